//! A real one-node Slurm for the tests and benchmarks: Debian's `munged`, `slurmctld` and
//! `slurmd` started on this machine (its own ports, key and state directory; ended by pid when
//! dropped). Needs root and Debian's `slurmctld`, `slurmd`, `slurm-client` and `munge`.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port_range, installed, required, start_program, Finished, Started, TEST_TOKEN};

/// A one-node Slurm cluster of daemons this test started.
pub struct Slurm {
    /// Its configuration, keys, state and logs.
    pub dir: tempfile::TempDir,
    daemons: Vec<(&'static str, Child)>,
}

impl Slurm {
    /// Starts munge, the controller and the node daemon, and waits until the node is idle;
    /// `None` where Slurm cannot run here.
    pub fn start() -> Option<Self> {
        let parts = [
            ("munged", "munge"),
            ("slurmctld", "slurmctld"),
            ("slurmd", "slurmd"),
            ("srun", "slurm-client"),
        ];
        if !parts.iter().all(|(program, package)| installed(program, package)) {
            return None;
        }
        // SAFETY: geteuid has no preconditions.
        let root = match unsafe { libc::geteuid() } {
            0 => Ok(()),
            euid => Err(format!("this test runs as user {euid}")),
        };
        required("root (slurmd runs jobs as root here)", root)?;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for sub in ["state", "spool"] {
            std::fs::create_dir(d.join(sub)).unwrap();
        }
        let mut key = [0u8; 128];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").unwrap(), &mut key).unwrap();
        std::fs::write(d.join("munge.key"), key).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(d.join("munge.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap()
            .trim()
            .to_string();
        let ports = free_port_range(2);
        std::fs::write(d.join("slurm.conf"), slurm_conf(d, &host, ports)).unwrap();
        let mut slurm = Self {
            dir,
            daemons: Vec::new(),
        };
        let d = slurm.dir.path().to_path_buf();
        let at = |name: &str| d.join(name).display().to_string();
        slurm.spawn(
            "munged",
            &[
                "--foreground",
                "--force",
                &format!("--socket={}", at("munge.sock")),
                &format!("--key-file={}", at("munge.key")),
                &format!("--pid-file={}", at("munged.pid")),
                &format!("--log-file={}", at("munged.log")),
                &format!("--seed-file={}", at("munge.seed")),
            ],
        );
        slurm.wait_for("munge's socket", || d.join("munge.sock").exists());
        slurm.spawn("slurmctld", &["-D", "-f", &at("slurm.conf")]);
        slurm.spawn("slurmd", &["-D", "-f", &at("slurm.conf"), "-N", &host]);
        let conf = at("slurm.conf");
        slurm.wait_for("the node to be idle", || {
            let out = Command::new("sinfo")
                .args(["-h", "-o", "%T"])
                .env("SLURM_CONF", &conf)
                .output();
            out.is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "idle")
        });
        Some(slurm)
    }

    fn spawn(&mut self, program: &'static str, args: &[&str]) {
        let log = std::fs::File::create(self.dir.path().join(format!("{program}.out"))).unwrap();
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {program}: {e}"));
        self.daemons.push((program, child));
    }

    /// Waits (at most 30 s) until `ready`, failing with every daemon's log.
    fn wait_for(&self, what: &str, ready: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ready() {
            assert!(Instant::now() < deadline, "waited 30 s for {what}:\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn logs(&self) -> String {
        [
            "munged.out",
            "slurmctld.out",
            "slurmd.out",
            "slurmctld.log",
            "slurmd.log",
        ]
        .iter()
        .map(|name| {
            let text = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
            format!("--- {name}\n{text}")
        })
        .collect()
    }

    /// Starts `srun ARGS` against this cluster with `env`.
    pub fn start_srun(&self, args: &[&str], env: &[(&str, String)]) -> Started {
        let mut env = env.to_vec();
        env.push(("SLURM_CONF", self.dir.path().join("slurm.conf").display().to_string()));
        env.push(("FLOTILLA_TOKEN", TEST_TOKEN.to_string()));
        start_program("srun", args, &env)
    }

    /// Runs `srun ARGS` against this cluster with `env`, to its end (at most 180 s).
    pub fn srun(&self, args: &[&str], env: &[(&str, String)]) -> Finished {
        let finished = self.start_srun(args, env).finish(180);
        assert!(
            finished.success,
            "srun failed:\n{}\n{}\n{}",
            finished.stdout,
            finished.stderr,
            self.logs()
        );
        finished
    }
}

impl Drop for Slurm {
    /// Ends every daemon by its pid: SIGTERM, then SIGKILL after 10 s.
    fn drop(&mut self) {
        for (_, child) in self.daemons.iter().rev() {
            // SAFETY: the pid is this test's child, not yet reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for (program, child) in self.daemons.iter_mut().rev() {
            while child.try_wait().ok().flatten().is_none() {
                if Instant::now() > deadline {
                    eprintln!("{program} ignored SIGTERM: killed");
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// A one-node cluster's configuration, everything under `d`: munge authentication over its own
/// socket, processes tracked by process group (no cgroups in a container), as many CPUs as
/// the job's tasks whatever the machine has.
fn slurm_conf(d: &Path, host: &str, ports: u16) -> String {
    let at = |name: &str| d.join(name).display().to_string();
    format!(
        "ClusterName=flotilla\n\
         SlurmctldHost={host}(127.0.0.1)\n\
         SlurmctldPort={ctld}\n\
         SlurmdPort={slurmd}\n\
         AuthType=auth/munge\n\
         AuthInfo=socket={socket}\n\
         CredType=cred/munge\n\
         SlurmUser=root\n\
         SlurmdUser=root\n\
         StateSaveLocation={state}\n\
         SlurmdSpoolDir={spool}\n\
         SlurmctldPidFile={ctld_pid}\n\
         SlurmdPidFile={slurmd_pid}\n\
         SlurmctldLogFile={ctld_log}\n\
         SlurmdLogFile={slurmd_log}\n\
         ProctrackType=proctrack/pgid\n\
         TaskPlugin=task/none\n\
         MpiDefault=none\n\
         JobAcctGatherType=jobacct_gather/none\n\
         AccountingStorageType=accounting_storage/none\n\
         SelectType=select/cons_tres\n\
         SelectTypeParameters=CR_CPU\n\
         SlurmdParameters=config_overrides\n\
         ReturnToService=2\n\
         NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN\n\
         PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n",
        ctld = ports,
        slurmd = ports + 1,
        socket = at("munge.sock"),
        state = at("state"),
        spool = at("spool"),
        ctld_pid = at("slurmctld.pid"),
        slurmd_pid = at("slurmd.pid"),
        ctld_log = at("slurmctld.log"),
        slurmd_log = at("slurmd.log"),
    )
}
