//! Jobs run by a real Slurm: the test starts Debian's `munged`, `slurmctld` and `slurmd` on
//! this machine (one node, its own ports, key and state directory; ended by pid afterwards), and
//! `srun` starts the job: one task per rank, each `flotilla run` reading its place from Slurm's
//! variables; and one task running our parameter-server launcher. Needs root and Debian's
//! `slurmctld`, `slurmd`, `slurm-client` and `munge` (CI installs them); skipped, saying why,
//! elsewhere.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{config, free_port_range, installed, ps_matches_uninterrupted, train_in_process, TEST_TOKEN};

const STEPS: &str = "train.steps=20";

/// A one-node Slurm cluster of daemons this test started.
struct Slurm {
    dir: tempfile::TempDir,
    daemons: Vec<(&'static str, Child)>,
}

impl Slurm {
    /// Starts munge, the controller and the node daemon, and waits until the node is idle;
    /// `None` where Slurm cannot run here.
    fn start() -> Option<Self> {
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
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: slurmd runs jobs as root here, and this test is not root");
            return None;
        }
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

    /// Runs `srun ARGS` against this cluster with `env`, to its end (at most 180 s).
    fn srun(&self, args: &[&str], env: &[(&str, String)]) -> common::Finished {
        let mut env = env.to_vec();
        env.push(("SLURM_CONF", self.dir.path().join("slurm.conf").display().to_string()));
        env.push(("FLOTILLA_TOKEN", TEST_TOKEN.to_string()));
        let finished = common::start_program("srun", args, &env).finish(180);
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

fn summary(run_dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(run_dir.join("summary.json")).unwrap()).unwrap()
}

/// `srun -n 4`: one task per rank of a data-parallel job, each a `flotilla run` that reads its
/// rank, the job's size and the coordinator (the step's first node, a port of the job's) from
/// Slurm; the same job under `srun --ntasks-per-node=1 flotilla launch` (the launcher's node
/// rank and coordinator from Slurm); then `srun -n 1` of our parameter-server launcher. Each
/// ends as the in-process run.
#[test]
fn srun_runs_a_data_parallel_job_rank_by_rank_and_under_launchers_and_a_parameter_server_job() {
    let Some(slurm) = Slurm::start() else {
        return;
    };
    let run_dir: PathBuf = slurm.dir.path().join("collective");
    let flotilla = env!("CARGO_BIN_EXE_flotilla");
    #[rustfmt::skip]
    let ranks = [
        "-N", "1", "-n", "4", "--overcommit",
        flotilla, "run", "--role", "trainer", "--config", "config.toml", "--set", STEPS,
    ];
    slurm.srun(&ranks, &[("FLOTILLA_RUN_DIR", run_dir.display().to_string())]);
    let collective = summary(&run_dir);
    assert_eq!(collective["world_size"], 4);
    let simulated = train_in_process(config(&[STEPS, "cluster.nproc_per_node=4"]));
    assert_eq!(collective["param_checksum"], simulated.summary.param_checksum.as_str());

    // One launcher per node, its place and the coordinator from Slurm.
    let run_dir: PathBuf = slurm.dir.path().join("launched");
    #[rustfmt::skip]
    let launcher = [
        "-N", "1", "--ntasks-per-node", "1", "--overcommit",
        flotilla, "launch", "--nproc_per_node", "4", "--", "train", "--config", "config.toml", "--set", STEPS,
        "--run-dir", run_dir.to_str().unwrap(),
    ];
    slurm.srun(&launcher, &[]);
    let launched = summary(&run_dir);
    assert_eq!(launched["param_checksum"], simulated.summary.param_checksum.as_str());

    let run_dir = slurm.dir.path().join("parameter-server");
    let port = free_port_range(6).to_string();
    let ps_steps = "train.steps=40";
    #[rustfmt::skip]
    let launcher = [
        "-N", "1", "-n", "1", "--overcommit",
        flotilla, "launch-ps", "--server_num", "2", "--worker_num", "2", "--started_port", &port, "--",
        "train", "--config", "examples/ctr_ps.toml", "--set", ps_steps, "--run-dir", run_dir.to_str().unwrap(),
    ];
    slurm.srun(&launcher, &[]);
    ps_matches_uninterrupted(&[ps_steps], &summary(&run_dir), &run_dir);
}
