//! `flotilla launch`: starts this node's trainer processes with the
//! environment Paddle's launcher sets, and supervises them.
//!
//! Port layout (as `paddle.distributed.launch` with `--started_port`): the
//! coordinator listens on the first node's `started_port` unless `--master`
//! says otherwise, and local rank `i` of every node on `started_port + 1 + i`.
//! Without `--started_port`, a launcher that starts the whole job (one node)
//! picks free ports, so two jobs on one host never collide; the nodes of a
//! multi-node job agree on [`DEFAULT_STARTED_PORT`].

mod ports;
mod ps;
mod supervisor;

pub use crate::actors::recovery::death_watch::DeathWatch;
pub use ps::{LaunchPsArgs, PsRoles};
pub use supervisor::{supervise, OutputMode, PREEMPTION_GRACE_S};

use std::path::PathBuf;

use anyhow::{bail, ensure, Context as _, Result};

use crate::config::{host_port, JobConfig, GPU_NOT_BUILT};
use crate::job::{Refusal, COORDINATOR_PROCESS_VAR};
use crate::net::auth::{generate_job_id, ClusterToken, JOB_ID_VAR, TOKEN_VAR};

/// The address a launcher's processes use when no flag names one (`--node_ip`, `--host`).
pub const DEFAULT_NODE_IP: &str = "127.0.0.1";

/// The run directory when `--run-dir` is not given; a launcher sets it for its processes.
pub const RUN_DIR_VAR: &str = "FLOTILLA_RUN_DIR";

/// The variable that sets a launched rank's `cluster.device` (`--devices` sets it to `gpu`).
pub const DEVICE_VAR: &str = "FLOTILLA_DEVICE";

/// The first port of a launched job when `--started_port` is not given (Paddle's `PADDLE_PORT`).
pub const DEFAULT_STARTED_PORT: u16 = 6170;

/// The launcher's arguments, in Paddle's words.
#[derive(Debug, Clone, clap::Args)]
pub struct LaunchArgs {
    /// Number of nodes in the job; `MIN:MAX` makes it elastic: it goes on with as few as MIN
    /// when nodes are lost for good, and admits nodes that come later, up to MAX.
    #[arg(long, default_value = "1")]
    pub nnodes: NodeRange,
    /// Trainer processes on this node (default: one per `--devices` entry, else 1).
    #[arg(long = "nproc_per_node", alias = "nproc-per-node", allow_negative_numbers = true)]
    pub nproc_per_node: Option<usize>,
    /// This node's GPUs, comma-separated (Paddle 2.x; alias `--gpus`): the ranks train on GPUs
    /// (`cluster.device = "gpu"`, which needs a build with the `cuda` feature), local rank `i`
    /// on the `i`-th (`FLAGS_selected_gpus`).
    #[arg(long, alias = "gpus", value_delimiter = ',')]
    pub devices: Vec<usize>,
    /// `collective` (the default) or `ps`: a parameter-server job, as `launch-ps` starts it
    /// (Paddle 2.x's `--run_mode`; implied by the parameter-server flags below).
    #[arg(long = "run_mode", alias = "run-mode", value_enum)]
    pub run_mode: Option<RunMode>,
    /// The servers and trainers of a parameter-server job (`--run_mode ps`).
    #[command(flatten)]
    pub ps_roles: PsRoles,
    /// This node's IP, one of --cluster_node_ips.
    #[arg(long = "node_ip", alias = "node-ip", default_value = DEFAULT_NODE_IP)]
    pub node_ip: String,
    /// Every node's IP, comma-separated, node 0 first (Paddle 2.x: `--ips`).
    #[arg(
        long = "cluster_node_ips",
        alias = "cluster-node-ips",
        alias = "ips",
        default_value = DEFAULT_NODE_IP,
        value_delimiter = ',',
        value_parser = clap::builder::NonEmptyStringValueParser::new()
    )]
    pub cluster_node_ips: Vec<String>,
    /// The coordinator's IP:PORT (default: the first node, --started_port).
    #[arg(long)]
    pub master: Option<String>,
    /// This node's index among `--nnodes` (torchrun's `--node-rank`, Paddle 2.x's `--rank`):
    /// nodes are then named by index, not address, and each rank announces its own endpoint
    /// (on the address that routes to the coordinator) when it joins.
    #[arg(
        long = "node_rank",
        alias = "node-rank",
        alias = "rank",
        allow_negative_numbers = true
    )]
    pub node_rank: Option<usize>,
    /// The coordinator's host, with `--master-port` (torchrun's `--master-addr`).
    #[arg(long = "master_addr", alias = "master-addr")]
    pub master_addr: Option<String>,
    /// The coordinator's port, with `--master-addr` (torchrun's `--master-port`).
    #[arg(long = "master_port", alias = "master-port", allow_negative_numbers = true, value_parser = port_parser())]
    pub master_port: Option<u16>,
    /// The coordinator's HOST:PORT (torchrun's `--rdzv-endpoint`).
    #[arg(long = "rdzv_endpoint", alias = "rdzv-endpoint")]
    pub rdzv_endpoint: Option<String>,
    /// torchrun's rendezvous backend: `c10d` and `static` both mean flotilla's coordinator at
    /// `--rdzv-endpoint` (or `--master-addr`/`--master-port`), the rendezvous of every node; an
    /// external store (`etcd`, `etcd-v2`) is refused.
    #[arg(long = "rdzv_backend", alias = "rdzv-backend", value_enum)]
    pub rdzv_backend: Option<RendezvousBackend>,
    /// One node, the coordinator on a free port of this host (torchrun's `--standalone`).
    #[arg(long)]
    pub standalone: bool,
    /// First port of the job on each node (default: free ports on one node, 6170 on several).
    #[arg(long = "started_port", alias = "started-port", allow_negative_numbers = true, value_parser = port_parser())]
    pub started_port: Option<u16>,
    /// Restarts, logs and the job id of the processes it starts.
    #[command(flatten)]
    pub processes: ProcessFlags,
    /// What each process runs: `train [ARGS]` for flotilla's own trainer,
    /// or a program of your own and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// The rendezvous backends of torchrun whose contract flotilla's coordinator keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RendezvousBackend {
    /// The nodes meet at `--rdzv-endpoint`.
    C10d,
    /// The nodes meet at `--master-addr:--master-port`.
    Static,
}

/// `--nnodes`: `N` nodes, or `MIN:MAX` (elastic, as torchrun's and Paddle's launchers say it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRange {
    /// The fewest nodes the job trains on.
    pub min: usize,
    /// The job's nodes, at most.
    pub max: usize,
}

impl NodeRange {
    /// MIN, when the job is elastic (MIN < MAX).
    pub fn elastic_min(&self) -> Option<usize> {
        (self.min < self.max).then_some(self.min)
    }

    fn check(&self) -> Result<()> {
        ensure!(self.min >= 1, "--nnodes {self}: a job needs at least one node");
        ensure!(
            self.min <= self.max,
            "--nnodes {}:{}: MIN is more than MAX",
            self.min,
            self.max
        );
        Ok(())
    }
}

impl std::str::FromStr for NodeRange {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> Result<Self> {
        let number = |part: &str| -> Result<usize> {
            part.trim()
                .parse()
                .with_context(|| format!("--nnodes {text}: {part:?} is not a number of nodes (N or MIN:MAX)"))
        };
        let range = match text.split_once(':') {
            Some((min, max)) => Self {
                min: number(min)?,
                max: number(max)?,
            },
            None => {
                let nodes = number(text)?;
                Self { min: nodes, max: nodes }
            }
        };
        range.check()?;
        Ok(range)
    }
}

impl std::fmt::Display for NodeRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.elastic_min() {
            Some(min) => write!(f, "{min}:{}", self.max),
            None => write!(f, "{}", self.max),
        }
    }
}

/// What both launchers are told of the processes they start, in Paddle's words.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ProcessFlags {
    /// Times a failed process is restarted — alone, while the others roll back in place, or
    /// all of them with `fault_tolerance.recovery = "restart"` — from the last checkpoint
    /// (default: the job's `fault_tolerance.max_restarts`; 0 for a program of your own).
    #[arg(
        long = "max_restarts",
        alias = "max-restarts",
        alias = "max_restart",
        allow_negative_numbers = true
    )]
    pub max_restarts: Option<usize>,
    /// Seconds the processes get, after a SIGTERM the launcher forwards (preemption), to commit
    /// a checkpoint and exit before they are killed: keep it below the engine's own wait before
    /// SIGKILL (Kubernetes' `terminationGracePeriodSeconds`, 30 by default; Slurm's `KillWait`).
    #[arg(
        long = "stop_grace_s",
        alias = "stop-grace-s",
        default_value_t = supervisor::PREEMPTION_GRACE_S,
        allow_negative_numbers = true
    )]
    pub stop_grace_s: u64,
    /// Where each process's output is also kept, as Paddle's launcher keeps it:
    /// `workerlog.<i>` per trainer (by local rank), `serverlog.<i>` per server, and the
    /// coordinator's `coordinatorlog`.
    #[arg(long = "log_dir", alias = "log-dir")]
    pub log_dir: Option<PathBuf>,
    /// The job's id, proved beside the cluster token (`FLOTILLA_JOB_ID`; torchrun's
    /// `--rdzv-id`; default: generated by a launcher that starts the whole job).
    #[arg(long = "job_id", alias = "job-id", alias = "rdzv-id", alias = "rdzv_id")]
    pub job_id: Option<String>,
}

impl ProcessFlags {
    /// The log of the process `kind.index` (`workerlog.0`), under `--log_dir`.
    fn log(&self, kind: &str, index: usize) -> Option<PathBuf> {
        self.log_dir.as_ref().map(|dir| dir.join(format!("{kind}.{index}")))
    }
}

/// One process to start.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildSpec {
    /// Its global rank (its index among the processes of one role).
    pub rank: usize,
    /// How its output lines and errors name it: `rank 3`, `server 0`, `trainer 1`.
    pub name: String,
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Environment added to the launcher's own.
    pub env: Vec<(String, String)>,
    /// Whether it is restarted alone when it fails, the others going on (a trainer of a job
    /// that recovers in place); else every process of the node is restarted.
    pub restart_alone: bool,
    /// A file that keeps a copy of its output (`--log_dir`: Paddle's `workerlog.N`), appended
    /// to across restarts.
    pub log: Option<PathBuf>,
}

impl ChildSpec {
    /// Whether it is the job's coordinator (started by [`recover_in_place`]).
    pub fn is_coordinator(&self) -> bool {
        self.name == COORDINATOR_NAME
    }
}

/// A port flag's parser: 1–65535. Port 0 ("any free port") cannot be a flag's value: every
/// process of the job must find the others at the ports the flags name.
pub(crate) fn port_parser() -> clap::builder::RangedI64ValueParser<u16> {
    clap::value_parser!(u16).range(1..)
}

/// What a launcher calls the coordinator process it starts.
const COORDINATOR_NAME: &str = "coordinator";

/// Where the processes of a launched job listen.
#[derive(Debug, Clone, PartialEq)]
pub struct JobAddresses {
    /// The coordinator's `host:port` (`PADDLE_MASTER`).
    pub master: String,
    /// Every trainer's `ip:port`, by rank (`PADDLE_TRAINER_ENDPOINTS`).
    pub trainers: Vec<String>,
    /// Every parameter-server shard's `ip:port` (`PADDLE_PSERVERS_IP_PORT_LIST`); empty for a
    /// collective job.
    pub servers: Vec<String>,
}

/// What kind of job `flotilla launch` starts (Paddle 2.x's `--run_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RunMode {
    /// Trainers that all-reduce (or a pipeline).
    Collective,
    /// Parameter servers and their trainers.
    Ps,
}

impl LaunchArgs {
    /// This node's trainer processes: `--nproc_per_node`, else one per device of `--devices`.
    fn nproc(&self) -> usize {
        match (self.nproc_per_node, self.devices.len()) {
            (Some(count), _) => count,
            (None, 0) => 1,
            (None, devices) => devices,
        }
    }

    /// These arguments with this node's place taken from the cluster engine that started this
    /// launcher, one per node (`srun --ntasks-per-node=1 flotilla launch …`, `mpirun --map-by
    /// ppr:1:node flotilla launch …`), when no flag places it: the engine's task index is the
    /// node rank, its task count the number of nodes, and its coordinator address (Slurm: the
    /// step's first node, at a port the job id derives) the master.
    pub fn placed_by_engine(mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let placed = self.node_rank.is_some()
            || self.named_master()?.is_some()
            || self.cluster_node_ips != [DEFAULT_NODE_IP]
            || self.standalone;
        if placed {
            return Ok(self);
        }
        let engine = crate::config::placement::engine_env(env)?;
        let value = |var: &str| engine.get(var).cloned().or_else(|| env(var));
        let (Some(task), Some(tasks)) = (engine.get("RANK"), engine.get("WORLD_SIZE")) else {
            return Ok(self);
        };
        let number = |var: &str, text: &str| -> Result<usize> {
            text.trim()
                .parse()
                .with_context(|| format!("the engine's {var} = {text:?} is not a number"))
        };
        let (node, nodes) = (number("RANK", task)?, number("WORLD_SIZE", tasks)?);
        if let Some(per_node) = engine.get("LOCAL_WORLD_SIZE").filter(|n| n.trim() != "1") {
            bail!(
                "the cluster engine started {per_node} launchers on this node: start one per node                  (srun --ntasks-per-node=1, mpirun --map-by ppr:1:node), each starting --nproc_per_node ranks"
            );
        }
        ensure!(
            self.nnodes.max == 1 || self.nnodes.max == nodes,
            "--nnodes {} contradicts the cluster engine's {nodes} tasks (one launcher per node)",
            self.nnodes.max
        );
        let (Some(addr), Some(port)) = (value("MASTER_ADDR"), value("MASTER_PORT")) else {
            bail!("the cluster engine names no coordinator: pass --master-addr and --master-port");
        };
        self.nnodes.max = nodes;
        self.nnodes.check()?;
        self.node_rank = Some(node);
        self.master_addr = Some(addr);
        self.master_port = Some(
            port.trim()
                .parse()
                .with_context(|| format!("MASTER_PORT = {port:?} is not a port"))?,
        );
        Ok(self)
    }

    /// The parameter-server launch these arguments ask for (`--run_mode ps`, or its flags), in
    /// `launch-ps`'s words; `None` for a collective job. Flags of the other mode are refused.
    pub fn parameter_servers(&self) -> Result<Option<LaunchPsArgs>> {
        match (self.run_mode, self.ps_roles.first_given()) {
            (Some(RunMode::Collective), Some(flag)) => {
                bail!("{flag} starts parameter servers, but --run_mode is collective")
            }
            (None, None) | (Some(RunMode::Collective), None) => return Ok(None),
            _ => {}
        }
        let collective_flags = [
            ("--nnodes", self.nnodes.max != 1),
            ("--nproc_per_node", self.nproc_per_node.is_some()),
            ("--devices", !self.devices.is_empty()),
            ("--node-rank", self.node_rank.is_some()),
        ];
        if let Some((flag, _)) = collective_flags.iter().find(|(_, given)| *given) {
            bail!("{flag} places collective ranks; a parameter-server job (--run_mode ps) is placed by --server_num/--worker_num or --servers/--workers");
        }
        Ok(Some(LaunchPsArgs {
            roles: self.ps_roles.clone(),
            host: self.node_ip.clone(),
            started_port: self.started_port,
            processes: self.processes.clone(),
            master: self.named_master()?,
            command: self.command.clone(),
        }))
    }
    /// These arguments with this node's process count taken from the job's config (its
    /// `cluster.nproc_per_node`, loaded by `config` only then) when neither `--nproc_per_node`
    /// nor `--devices` gives one: a launcher of flotilla's trainer starts as many ranks as the job
    /// says, not one.
    pub fn with_nproc_of(mut self, config: impl FnOnce() -> Option<Result<JobConfig>>) -> Self {
        if self.nproc_per_node.is_some() || !self.devices.is_empty() {
            return self;
        }
        match config() {
            Some(Ok(config)) => {
                let nproc = config.cluster.nproc_per_node;
                tracing::info!(
                    nproc,
                    "--nproc_per_node not given: {nproc} process(es) on this node, the job's cluster.nproc_per_node"
                );
                self.nproc_per_node = Some(nproc);
            }
            Some(Err(e)) => tracing::warn!(
                "--nproc_per_node not given, and the job's config does not load before its processes are \
                 placed ({e:#}): starting one process on this node"
            ),
            None => {}
        }
        self
    }

    /// These arguments with `--started_port` chosen: free ports on this host for a job this
    /// launcher starts whole (one node, no `--master`); else the default every node agrees on.
    pub fn with_ports_chosen(mut self) -> Result<Self> {
        ensure!(
            !self.standalone || self.nnodes.max == 1,
            "--standalone runs one node, but --nnodes is {}",
            self.nnodes.max
        );
        if self.started_port.is_none() {
            self.started_port = Some(match (self.nnodes.max, self.named_master()?) {
                (1, None) => ports::free_run(&self.node_ip, 1 + self.nproc())?,
                _ => DEFAULT_STARTED_PORT,
            });
        }
        Ok(self)
    }

    /// The coordinator's address the flags name, in Paddle's words or torchrun's; flags that
    /// name different ones are refused, naming both.
    fn named_master(&self) -> Result<Option<String>> {
        let torchrun = match (&self.master_addr, self.master_port) {
            (Some(addr), Some(port)) => Some(host_port(addr, port)),
            (None, None) => None,
            (Some(_), None) => bail!("--master-addr needs --master-port"),
            (None, Some(_)) => bail!("--master-port needs --master-addr"),
        };
        let named = [
            ("--master", self.master.clone()),
            ("--master-addr:--master-port", torchrun),
            ("--rdzv-endpoint", self.rdzv_endpoint.clone()),
        ];
        let mut named = named.into_iter().filter_map(|(flag, value)| Some((flag, value?)));
        let Some((first_flag, first)) = named.next() else {
            return Ok(None);
        };
        for (flag, value) in named {
            ensure!(value == first, "{flag} {value} contradicts {first_flag} {first}");
        }
        Ok(Some(first))
    }

    /// This node's index: `--node-rank`, else the position of `--node_ip` in
    /// `--cluster_node_ips`.
    fn node_index(&self) -> Result<usize> {
        let index = match self.node_rank {
            Some(rank) => rank,
            None => self
                .cluster_node_ips
                .iter()
                .position(|ip| ip == &self.node_ip)
                .with_context(|| {
                    format!(
                        "--node_ip {} is not one of --cluster_node_ips {}",
                        self.node_ip,
                        self.cluster_node_ips.join(",")
                    )
                })?,
        };
        ensure!(
            index < self.nnodes.max,
            "--node-rank {index} is outside --nnodes {}",
            self.nnodes.max
        );
        Ok(index)
    }

    fn started_port(&self) -> u16 {
        self.started_port.unwrap_or(DEFAULT_STARTED_PORT)
    }

    /// The coordinator's and the trainers' addresses of the whole job, as every node's launcher
    /// computes them from the same flags.
    pub fn addresses(&self) -> Result<JobAddresses> {
        ensure!(
            self.nnodes.max >= 1 && self.nproc() >= 1,
            "--nnodes and --nproc_per_node must be at least 1"
        );
        ensure!(
            self.devices.is_empty() || self.devices.len() == self.nproc(),
            "--devices {} names {} device(s), but --nproc_per_node is {}",
            self.devices.iter().map(usize::to_string).collect::<Vec<_>>().join(","),
            self.devices.len(),
            self.nproc()
        );
        if self.node_rank.is_some() {
            // Nodes named by index: the ranks announce their endpoints when they join.
            let master = match self.named_master()? {
                Some(master) => master,
                None if self.nnodes.max == 1 => format!("{}:{}", self.node_ip, self.started_port()),
                None => bail!(
                    "--node-rank names nodes by index: the coordinator's address must be given \
                     (--master-addr and --master-port, --rdzv-endpoint, or --master)"
                ),
            };
            return Ok(JobAddresses {
                master,
                trainers: Vec::new(),
                servers: Vec::new(),
            });
        }
        if self.cluster_node_ips.len() != self.nnodes.max
            && (self.rdzv_backend.is_some() || self.rdzv_endpoint.is_some())
        {
            bail!(
                "--rdzv-endpoint: flotilla launch numbers the nodes of a job by --node-rank (give each \
                 node's launcher its index) or by --cluster_node_ips; to have torchrun number them at \
                 its c10d rendezvous, start the ranks with torchrun itself: `torchrun --nnodes {} \
                 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --no-python flotilla run --role trainer \
                 --config FILE`",
                self.nnodes.max
            );
        }
        if self.cluster_node_ips.len() != self.nnodes.max {
            bail!(
                "--cluster_node_ips lists {} node(s) ({}), but --nnodes is {}",
                self.cluster_node_ips.len(),
                self.cluster_node_ips.join(","),
                self.nnodes.max
            );
        }
        let last_port = usize::from(self.started_port()) + self.nproc();
        ensure!(
            last_port <= usize::from(u16::MAX),
            "--started_port {} leaves no room for {} processes",
            self.started_port(),
            self.nproc()
        );
        let master = self
            .named_master()?
            .unwrap_or_else(|| format!("{}:{}", self.cluster_node_ips[0], self.started_port()));
        let trainers = self
            .cluster_node_ips
            .iter()
            .flat_map(|ip| (0..self.nproc()).map(move |i| format!("{ip}:{}", usize::from(self.started_port()) + 1 + i)))
            .collect();
        Ok(JobAddresses {
            master,
            trainers,
            servers: Vec::new(),
        })
    }

    /// The processes this node starts, with their environment.
    pub fn plan(&self, flotilla: PathBuf) -> Result<Vec<ChildSpec>> {
        let JobAddresses {
            master,
            trainers: endpoints,
            ..
        } = self.addresses()?;
        let node_rank = self.node_index()?;
        let world = self.nnodes.max * self.nproc();
        let device = self.device()?;
        let (program, args) = match self.command.split_first() {
            Some((first, rest)) if first == "train" => (
                flotilla,
                ["run", "--role", "trainer"]
                    .iter()
                    .map(|s| s.to_string())
                    .chain(rest.iter().cloned())
                    .collect(),
            ),
            Some((first, rest)) => (PathBuf::from(first), rest.to_vec()),
            None => bail!("launch needs a command after `--`: `train --config FILE` or a program"),
        };
        let token = credentials_env(self.nnodes.max == 1, self.processes.job_id.as_deref())?;
        let (master_addr, master_port) = master
            .rsplit_once(':')
            .with_context(|| format!("the coordinator's address {master} has no port"))?;
        Ok((0..self.nproc())
            .map(|local_rank| {
                let rank = node_rank * self.nproc() + local_rank;
                let mut env = vec![
                    ("TRAINING_ROLE", "TRAINER".to_string()),
                    ("PADDLE_TRAINER_ID", rank.to_string()),
                    ("PADDLE_GLOBAL_RANK", rank.to_string()),
                    ("PADDLE_LOCAL_RANK", local_rank.to_string()),
                    ("PADDLE_LOCAL_SIZE", self.nproc().to_string()),
                    ("PADDLE_NNODES", self.nnodes.max.to_string()),
                    // Blank unless elastic: blank is unset.
                    (
                        "FLOTILLA_MIN_NNODES",
                        self.nnodes.elastic_min().map(|min| min.to_string()).unwrap_or_default(),
                    ),
                    ("PADDLE_TRAINERS_NUM", world.to_string()),
                    ("PADDLE_MASTER", master.clone()),
                    ("POD_IP", self.node_ip.clone()),
                    (
                        "FLAGS_selected_gpus",
                        self.devices.get(local_rank).unwrap_or(&local_rank).to_string(),
                    ),
                    // torchrun's names for the same, for programs that read those.
                    ("RANK", rank.to_string()),
                    ("LOCAL_RANK", local_rank.to_string()),
                    ("WORLD_SIZE", world.to_string()),
                    ("LOCAL_WORLD_SIZE", self.nproc().to_string()),
                    ("MASTER_ADDR", master_addr.trim_matches(['[', ']']).to_string()),
                    ("MASTER_PORT", master_port.to_string()),
                ];
                // Listed when nodes are named by address; announced at the rendezvous otherwise,
                // when a list this launcher inherited (an operator's, one endpoint per pod) must
                // not reach the ranks: blank is unset.
                let (listed, current) = match endpoints.get(rank) {
                    Some(endpoint) => (endpoints.join(","), endpoint.clone()),
                    None => (String::new(), String::new()),
                };
                env.push(("PADDLE_TRAINER_ENDPOINTS", listed));
                env.push(("PADDLE_CURRENT_ENDPOINT", current));
                env.extend(device.map(|device| (DEVICE_VAR, device.to_string())));
                env.extend(thread_env(self.nproc()));
                env.extend(token.iter().cloned());
                ChildSpec {
                    rank,
                    name: format!("rank {rank}"),
                    program: program.clone(),
                    args: args.clone(),
                    env: env.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
                    restart_alone: false,
                    log: self.processes.log("workerlog", local_rank),
                }
            })
            .collect())
    }

    /// The `cluster.device` the ranks get (through [`DEVICE_VAR`]): `gpu` when `--devices`
    /// names GPUs, as Paddle's launcher means them, else none, leaving the job's own. A build
    /// without CUDA refuses `--devices` rather than train on the CPU while naming GPUs.
    fn device(&self) -> Result<Option<&'static str>> {
        if self.devices.is_empty() {
            return Ok(None);
        }
        if !cfg!(feature = "cuda") {
            let devices: Vec<String> = self.devices.iter().map(usize::to_string).collect();
            return Err(Refusal::wrap(anyhow::anyhow!(
                "--devices {} sets cluster.device = {GPU_NOT_BUILT}",
                devices.join(",")
            )));
        }
        Ok(Some("gpu"))
    }

    /// Makes `children` (this node's trainers, as [`LaunchArgs::plan`] made them) a job that
    /// recovers in place ([`recover_in_place`]); the first node starts the coordinator.
    pub fn recover_in_place(&self, children: &mut Vec<ChildSpec>) -> Result<()> {
        let first_node = self.node_index()? == 0;
        recover_in_place(children, first_node.then_some(self.nnodes.max * self.nproc()));
        Ok(())
    }
}

/// Makes `children` a job that recovers in place: a failed process is restarted alone — a role
/// while the others roll back inside their processes, the coordinator while the roles train on
/// and tell it who they are. With `coordinator` (the rank the launcher calls it by), this
/// launcher also starts the coordinator as a process of its own, first, with the roles'
/// environment but no role.
pub fn recover_in_place(children: &mut Vec<ChildSpec>, coordinator: Option<usize>) {
    for child in children.iter_mut() {
        child.env.push((COORDINATOR_PROCESS_VAR.to_string(), "1".to_string()));
        child.restart_alone = true;
    }
    let (Some(first), Some(rank)) = (children.first().cloned(), coordinator) else {
        return;
    };
    let role_only = [
        "TRAINING_ROLE",
        "PADDLE_TRAINER_ID",
        "PADDLE_GLOBAL_RANK",
        "PADDLE_LOCAL_RANK",
        "PADDLE_CURRENT_ENDPOINT",
        "PADDLE_PORT",
        "RANK",
        "LOCAL_RANK",
    ];
    let mut args = first.args.clone();
    if let Some(role) = args.iter().position(|a| a == "--role") {
        if let Some(name) = args.get_mut(role + 1) {
            *name = "coordinator".to_string();
        }
    }
    children.insert(
        0,
        ChildSpec {
            rank,
            name: COORDINATOR_NAME.to_string(),
            args,
            env: first
                .env
                .into_iter()
                .filter(|(key, _)| !role_only.contains(&key.as_str()))
                .collect(),
            restart_alone: true,
            log: first.log.as_ref().map(|log| log.with_file_name("coordinatorlog")),
            ..first
        },
    );
}

/// The cluster token and the job id for the processes of one launcher: those in
/// `FLOTILLA_TOKEN` and `FLOTILLA_JOB_ID` (which they inherit), else fresh ones when this
/// launcher starts the whole job (one node), so that two jobs on one host never talk even when
/// they share a token. The nodes of a multi-node job must share both, so there they come from
/// the variables (or `cluster.token`, `cluster.job_id`) on every node (a process without a
/// token says so).
/// A `job_id` the launcher was given (`--job_id`) is every process's.
pub fn credentials_env(whole_job: bool, job_id: Option<&str>) -> Result<Vec<(&'static str, String)>> {
    let mut env = Vec::new();
    if whole_job && std::env::var_os(TOKEN_VAR).is_none() {
        env.push((TOKEN_VAR, ClusterToken::generate()?));
    }
    match job_id {
        Some(id) => env.push((JOB_ID_VAR, id.to_string())),
        None if whole_job && std::env::var_os(JOB_ID_VAR).is_none() => env.push((JOB_ID_VAR, generate_job_id()?)),
        None => {}
    }
    Ok(env)
}

/// The compute-thread variables (`CANDLE_NUM_THREADS`, `RAYON_NUM_THREADS`) for `ranks` ranks
/// sharing this node's cores, except those already set. Ranks must not each claim every core:
/// candle's worker pool serialises concurrent callers and spins while it waits, so with four
/// stages of a pipeline in one process on two cores, one thread each trained 2.1× faster than
/// the default.
pub fn thread_env(ranks: usize) -> Vec<(&'static str, String)> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .div_ceil(ranks.max(1))
        .max(1);
    ["CANDLE_NUM_THREADS", "RAYON_NUM_THREADS"]
        .into_iter()
        .filter(|var| std::env::var_os(var).is_none())
        .map(|var| (var, threads.to_string()))
        .collect()
}

#[cfg(test)]
mod tests;
