//! `flotilla launch-ps` (alias `launch_ps`): starts the parameter servers and the trainers of a
//! parameter-server job with the environment Paddle's `launch_ps` / `fleetrun` sets, and
//! supervises them. Servers listen on `host:started_port + i` unless `--servers` lists their
//! endpoints; trainers need no listening port, but get `PADDLE_TRAINER_ENDPOINTS` as in Paddle.

use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Result};

use super::{
    credentials_env, thread_env, ChildSpec, JobAddresses, ProcessFlags, DEFAULT_NODE_IP, DEFAULT_STARTED_PORT,
};

/// How many servers and trainers a parameter-server job has, or where each listens: the flags
/// of `launch-ps` (Paddle 1.x's `--worker_num`, `--workers`) and of `launch --run_mode ps`
/// (Paddle 2.x's `--trainer_num`, `--trainers`), one set under both names.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PsRoles {
    /// Parameter-server processes to start.
    #[arg(long = "server_num", alias = "server-num", allow_negative_numbers = true)]
    pub server_num: Option<usize>,
    /// Trainer processes to start (`--worker_num`, Paddle 2.x's `--trainer_num`).
    #[arg(
        long = "worker_num",
        alias = "worker-num",
        alias = "trainer_num",
        alias = "trainer-num",
        allow_negative_numbers = true
    )]
    pub worker_num: Option<usize>,
    /// Explicit `host:port` of every server, comma-separated (instead of `--server_num`).
    #[arg(long, value_delimiter = ',')]
    pub servers: Vec<String>,
    /// Explicit `host:port` of every trainer, comma-separated (instead of `--worker_num`;
    /// Paddle 2.x's `--trainers`).
    #[arg(long, alias = "trainers", value_delimiter = ',')]
    pub workers: Vec<String>,
}

impl PsRoles {
    /// The first of these flags given, if any.
    pub(super) fn first_given(&self) -> Option<&'static str> {
        [
            ("--server_num", self.server_num.is_some()),
            ("--worker_num", self.worker_num.is_some()),
            ("--servers", !self.servers.is_empty()),
            ("--workers", !self.workers.is_empty()),
        ]
        .into_iter()
        .find_map(|(flag, given)| given.then_some(flag))
    }
}

/// Command-line arguments of `flotilla launch-ps`.
#[derive(Debug, Clone, clap::Args)]
pub struct LaunchPsArgs {
    /// How many servers and trainers, or their endpoints.
    #[command(flatten)]
    pub roles: PsRoles,
    /// This node's address: the servers and trainers listed at it are started here (run
    /// launch-ps on every node of a job with the same lists), the coordinator where `--master` is.
    #[arg(long, default_value = DEFAULT_NODE_IP)]
    pub host: String,
    /// First port: servers take `started_port + i`, trainers the ports after them (default:
    /// free ports when every role is this node's, else Paddle's `PADDLE_PORT` default, 6170).
    #[arg(long = "started_port", alias = "started-port", allow_negative_numbers = true, value_parser = super::port_parser())]
    pub started_port: Option<u16>,
    /// Restarts, logs and the job id of the processes it starts.
    #[command(flatten)]
    pub processes: ProcessFlags,
    /// Where the coordinator the roles heartbeat to listens (default: `--host`, the port after
    /// the trainers'): a process of its own, or server 0 with `recovery = "restart"`.
    #[arg(long)]
    pub master: Option<String>,
    /// `train [--config FILE] [--set K=V]…` (run as each role), or a program of your own.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

impl LaunchPsArgs {
    /// These arguments with `--started_port` chosen: free ports on `--host` when this launcher
    /// starts every role (counts, not lists, and no `--master`); else the default.
    pub fn with_ports_chosen(mut self) -> Result<Self> {
        if self.started_port.is_none() {
            let whole_job = self.roles.servers.is_empty() && self.roles.workers.is_empty() && self.master.is_none();
            let roles = self.roles.server_num.unwrap_or(0) + self.roles.worker_num.unwrap_or(0);
            self.started_port = Some(match whole_job {
                true => super::ports::free_run(&self.host, roles + 1)?,
                false => DEFAULT_STARTED_PORT,
            });
        }
        Ok(self)
    }

    fn started_port(&self) -> u16 {
        self.started_port.unwrap_or(DEFAULT_STARTED_PORT)
    }

    /// The servers', the trainers' and the coordinator's addresses.
    pub fn addresses(&self) -> Result<JobAddresses> {
        let roles = &self.roles;
        let servers = self.endpoints("--servers", &roles.servers, "--server_num", roles.server_num, 0)?;
        let trainers = self.endpoints(
            "--workers",
            &roles.workers,
            "--worker_num",
            roles.worker_num,
            servers.len(),
        )?;
        let master = match &self.master {
            Some(master) => master.clone(),
            None => {
                let port = usize::from(self.started_port()) + servers.len() + trainers.len();
                ensure!(
                    port <= usize::from(u16::MAX),
                    "--started_port {} leaves no port for the coordinator",
                    self.started_port()
                );
                format!("{}:{port}", self.host)
            }
        };
        Ok(JobAddresses {
            master,
            trainers,
            servers,
        })
    }

    /// Whether this node (`--host`) runs the coordinator (`--master`'s host).
    pub fn hosts_coordinator(&self) -> Result<bool> {
        let master = self.addresses()?.master;
        Ok(master.rsplit_once(':').is_some_and(|(host, _)| host == self.host))
    }

    /// This node's server processes, then its trainer processes, with their environment: those
    /// of the servers and trainers listed whose address is `--host` (as Paddle's launcher
    /// starts on each node the roles of its IP); every role is numbered in the whole lists.
    pub fn plan(&self, flotilla: PathBuf) -> Result<Vec<ChildSpec>> {
        let JobAddresses {
            master,
            trainers: workers,
            servers,
        } = self.addresses()?;
        let job = [
            ("PADDLE_MASTER", master),
            ("PADDLE_PSERVERS_IP_PORT_LIST", servers.join(",")),
            ("PADDLE_PSERVER_ENDPOINTS", servers.join(",")),
            ("PADDLE_TRAINER_ENDPOINTS", workers.join(",")),
            ("PADDLE_TRAINERS_NUM", workers.len().to_string()),
        ];
        // This node's processes share its cores; one launcher starts the whole job only when
        // every role is on its node.
        let processes = servers.iter().chain(&workers).filter(|e| self.is_here(e)).count();
        let token = credentials_env(
            processes == servers.len() + workers.len(),
            self.processes.job_id.as_deref(),
        )?;
        let env = RoleEnv {
            job: job.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            node: thread_env(processes)
                .into_iter()
                .chain(token)
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        };
        let mut children = Vec::with_capacity(processes);
        for (role, endpoints) in [(PsRole::Server, &servers), (PsRole::Trainer, &workers)] {
            let (program, args) = self.role_command(&flotilla, role)?;
            for (index, endpoint) in endpoints.iter().enumerate() {
                let (ip, port) = endpoint
                    .rsplit_once(':')
                    .ok_or_else(|| anyhow::anyhow!("{endpoint:?} is not a host:port address"))?;
                if !self.is_here(endpoint) {
                    continue;
                }
                children.push(ChildSpec {
                    rank: role.rank(index, servers.len()),
                    name: format!("{} {index}", role.process_name()),
                    program: program.clone(),
                    args: args.clone(),
                    env: env.of(role, index, endpoint, (ip, port)),
                    restart_alone: false,
                    log: self.processes.log(role.log_name(), index),
                });
            }
        }
        ensure!(
            !children.is_empty(),
            "none of the servers {servers:?} and trainers {workers:?} is on this node (--host {}): run \
             launch-ps on each node with its own --host",
            self.host
        );
        Ok(children)
    }

    /// Whether `endpoint` is on this node (`--host`).
    fn is_here(&self, endpoint: &str) -> bool {
        endpoint.rsplit_once(':').is_some_and(|(ip, _)| ip == self.host)
    }

    /// The program and arguments a `role` process runs: `train …` runs this binary as that
    /// role, any other command as it is.
    fn role_command(&self, flotilla: &Path, role: PsRole) -> Result<(PathBuf, Vec<String>)> {
        match self.command.split_first() {
            Some((first, rest)) if first == "train" => Ok((
                flotilla.to_path_buf(),
                ["run", "--role", role.run_role()]
                    .iter()
                    .map(|s| s.to_string())
                    .chain(rest.iter().cloned())
                    .collect(),
            )),
            Some((first, rest)) => Ok((PathBuf::from(first), rest.to_vec())),
            None => bail!("launch-ps needs a command after `--`: `train --config FILE` or a program"),
        }
    }

    /// The endpoints of one role: the explicit list, or `count` ports on `--host` from
    /// `started_port + first`.
    fn endpoints(
        &self,
        list_flag: &str,
        list: &[String],
        count_flag: &str,
        count: Option<usize>,
        first: usize,
    ) -> Result<Vec<String>> {
        if !list.is_empty() {
            if let Some(count) = count.filter(|&c| c != list.len()) {
                bail!("{list_flag} lists {} endpoints but {count_flag} is {count}", list.len());
            }
            return Ok(list.iter().map(|e| e.trim().to_string()).collect());
        }
        let count = count.ok_or_else(|| anyhow::anyhow!("give {count_flag} or {list_flag}"))?;
        ensure!(count >= 1, "{count_flag} must be at least 1");
        let last = usize::from(self.started_port()) + first + count - 1;
        ensure!(
            last <= usize::from(u16::MAX),
            "--started_port {} leaves no room for {count} processes",
            self.started_port()
        );
        Ok((0..count)
            .map(|i| format!("{}:{}", self.host, usize::from(self.started_port()) + first + i))
            .collect())
    }
}

/// The two kinds of process of a parameter-server job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PsRole {
    Server,
    Trainer,
}

impl PsRole {
    /// The role as `run --role` takes it.
    fn run_role(self) -> &'static str {
        match self {
            Self::Server => "pserver",
            Self::Trainer => "trainer",
        }
    }

    /// The job rank of the role's process `index`, as the coordinator numbers the roles:
    /// the `servers` first, then the trainers.
    fn rank(self, index: usize, servers: usize) -> usize {
        match self {
            Self::Server => index,
            Self::Trainer => servers + index,
        }
    }

    /// How the launcher names the role's processes.
    fn process_name(self) -> &'static str {
        match self {
            Self::Server => "server",
            Self::Trainer => "trainer",
        }
    }

    /// The role's log files, named as Paddle's launcher names them.
    fn log_name(self) -> &'static str {
        match self {
            Self::Server => "serverlog",
            Self::Trainer => "workerlog",
        }
    }
}

/// The environment every process on this node gets, around the variables of its own role.
struct RoleEnv {
    /// The job's addresses, the same on every node.
    job: Vec<(String, String)>,
    /// This node's thread counts and the job's credentials.
    node: Vec<(String, String)>,
}

impl RoleEnv {
    /// The environment of `role` process `index`, listening at `endpoint` (`ip`, `port`), as
    /// Paddle's launcher sets it.
    fn of(&self, role: PsRole, index: usize, endpoint: &str, (ip, port): (&str, &str)) -> Vec<(String, String)> {
        let mut env = self.job.clone();
        env.push(("POD_IP".into(), ip.to_string()));
        env.push(("PADDLE_PORT".into(), port.to_string()));
        match role {
            PsRole::Server => env.push(("TRAINING_ROLE".into(), "PSERVER".into())),
            PsRole::Trainer => {
                env.push(("TRAINING_ROLE".into(), "TRAINER".into()));
                env.push(("PADDLE_TRAINER_ID".into(), index.to_string()));
                env.push(("PADDLE_CURRENT_ENDPOINT".into(), endpoint.to_string()));
            }
        }
        env.extend(self.node.iter().cloned());
        env
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        launch: LaunchPsArgs,
    }

    fn plan(line: &str) -> Result<Vec<ChildSpec>> {
        Cli::try_parse_from(std::iter::once("launch-ps").chain(line.split_whitespace()))?
            .launch
            .plan("flotilla".into())
    }

    fn env<'a>(child: &'a ChildSpec, key: &str) -> &'a str {
        child.env.iter().find(|(k, _)| k == key).map_or("", |(_, v)| v.as_str())
    }

    #[test]
    fn servers_then_trainers_with_paddle_variables() -> Result<()> {
        let children = plan("--server_num 2 --worker_num 3 -- train --config c.toml")?;
        let names: Vec<&str> = children.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["server 0", "server 1", "trainer 0", "trainer 1", "trainer 2"]);
        assert_eq!(children[1].args, ["run", "--role", "pserver", "--config", "c.toml"]);
        assert_eq!(children[4].args, ["run", "--role", "trainer", "--config", "c.toml"]);
        assert_eq!(env(&children[1], "TRAINING_ROLE"), "PSERVER");
        assert_eq!(env(&children[1], "PADDLE_PORT"), "6171");
        assert_eq!(
            env(&children[0], "PADDLE_PSERVERS_IP_PORT_LIST"),
            "127.0.0.1:6170,127.0.0.1:6171"
        );
        assert_eq!(
            env(&children[0], "PADDLE_PSERVER_ENDPOINTS"),
            "127.0.0.1:6170,127.0.0.1:6171"
        );
        assert_eq!(env(&children[3], "TRAINING_ROLE"), "TRAINER");
        assert_eq!(env(&children[3], "PADDLE_TRAINER_ID"), "1");
        assert_eq!(env(&children[3], "PADDLE_TRAINERS_NUM"), "3");
        assert_eq!(env(&children[3], "PADDLE_PORT"), "6173");
        Ok(())
    }

    #[test]
    fn explicit_endpoints_and_their_contradictions() -> Result<()> {
        let lists = "--servers 10.0.0.1:7000,10.0.0.2:7000 --workers 10.0.0.1:1,10.0.0.2:1";
        // Each node starts the roles of its own address, numbered in the whole lists.
        let children = plan(&format!("--host 10.0.0.2 {lists} -- ./mine x"))?;
        let names: Vec<&str> = children.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["server 1", "trainer 1"]);
        assert_eq!(children[0].program, PathBuf::from("./mine"));
        assert_eq!(env(&children[0], "POD_IP"), "10.0.0.2");
        assert_eq!(env(&children[1], "PADDLE_TRAINER_ID"), "1");
        assert_eq!(children[1].rank, 3, "servers first, then trainers");
        let err = plan(&format!("{lists} -- ./mine x")).unwrap_err();
        assert!(err.to_string().starts_with("none of the servers"), "{err}");
        let err = plan("--server_num 3 --servers 10.0.0.1:7000 --worker_num 1 -- train").unwrap_err();
        assert_eq!(err.to_string(), "--servers lists 1 endpoints but --server_num is 3");
        let err = plan("--worker_num 1 -- train").unwrap_err();
        assert_eq!(err.to_string(), "give --server_num or --servers");
        Ok(())
    }
}
