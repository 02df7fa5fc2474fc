//! `flotilla bench allreduce`: all-reduce between real processes — or the sharded optimizer's
//! reduce-scatter and all-gather of shards (`--collective`) — by the ring on loopback or by
//! NCCL on one GPU per process, reported as nccl-tests does: median time, algorithm bandwidth
//! (bytes of the whole buffer / time) and bus bandwidth (what each link carries, comparable
//! across world sizes: algbw × 2(n−1)/n for an all-reduce, × (n−1)/n for the other two).

use std::net::TcpListener;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use serde::Serialize;

use crate::actors::Coordinator;
use crate::config::{DeviceKind, FaultToleranceConfig};
use crate::engines::comm::hierarchy::{self, NodeLayout};
use crate::engines::comm::{Abandoned, Communicator, RingLinks, Wire};
use crate::engines::compute::device_for;
use crate::job::connect_control;
use crate::launch::{supervise, ChildSpec, OutputMode, PREEMPTION_GRACE_S};
use crate::net::auth::{ClusterToken, Credentials, TOKEN_VAR};
use crate::net::protocol::Roster;

/// Arguments shared by the parent and its ranks.
#[derive(Debug, Clone, clap::Args)]
pub struct AllReduceArgs {
    /// Buffer sizes in MiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub size_mb: Vec<f64>,
    /// Timed iterations per size (after two warm-up ones).
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// One JSON object a line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Ring transport between the processes (and NCCL's bootstrap).
    #[arg(long, value_enum, default_value_t = Transport::Shm)]
    pub transport: Transport,
    /// What reduces: the ring on host buffers, or NCCL on GPU buffers (one GPU per process,
    /// rank r on visible GPU r; needs a `cuda` build).
    #[arg(long, value_enum, default_value_t = Backend::Ring)]
    pub backend: Backend,
    /// The ring's all-reduce: one flat ring over every rank, or hierarchical (in each node,
    /// then across the nodes of `--nnodes`).
    #[arg(long, value_enum, default_value_t = Algorithm::Flat)]
    pub algorithm: Algorithm,
    /// The values on the ring's links: f32, or bfloat16 summed in f32 (as
    /// `strategy.fp16_allreduce`); the figures count the f32 buffer's bytes either way.
    #[arg(long, value_enum, default_value_t = Wire::F32)]
    pub wire: Wire,
    /// The collective timed: the all-reduce, or one half of it as a sharded optimizer uses
    /// them (the ring only).
    #[arg(long, value_enum, default_value_t = Collective::AllReduce)]
    pub collective: Collective,
}

/// The collective a benchmark times (nccl-tests' `all_reduce_perf`, `reduce_scatter_perf`,
/// `all_gather_perf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
pub enum Collective {
    /// Every rank ends with the sum of the whole buffer.
    #[value(name = "allreduce")]
    #[serde(rename = "allreduce")]
    AllReduce,
    /// Every rank ends with the sum of its shard of the buffer.
    #[value(name = "reducescatter")]
    #[serde(rename = "reducescatter")]
    ReduceScatter,
    /// Every rank's shard of the buffer reaches every rank.
    #[value(name = "allgather")]
    #[serde(rename = "allgather")]
    AllGather,
}

impl Collective {
    /// The bytes each link carries per byte of the buffer, over `1 / algbw`: nccl-tests' bus
    /// bandwidth factor.
    fn bus_factor(self, world: usize) -> f64 {
        let n = world as f64;
        match self {
            Self::AllReduce => 2.0 * (n - 1.0) / n,
            Self::ReduceScatter | Self::AllGather => (n - 1.0) / n,
        }
    }
}

/// Where this node's ranks sit in a benchmark over several nodes (one `bench allreduce` per
/// node, as one launcher per node).
#[derive(Debug, Clone, clap::Args)]
pub struct NodeFlags {
    /// Nodes in the benchmark.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Where rank 0 (on node 0) rendezvouses the ranks, `HOST:PORT` (default: a free loopback
    /// port, one node only).
    #[arg(long)]
    pub master: Option<String>,
    /// The address this node's ranks listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub node_ip: String,
}

/// The all-reduce algorithm over the ring transports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    /// One ring over every rank.
    Flat,
    /// Reduce-scatter in the node, all-reduce across nodes, all-gather in the node.
    Hierarchical,
}

/// The all-reduce a benchmark measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// flotilla's ring over the transport, host memory.
    Ring,
    /// NCCL, GPU memory.
    Nccl,
}

/// The ring transport a benchmark uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Shared memory between processes of this host.
    Shm,
    /// Loopback TCP.
    Tcp,
}

/// One size's figures.
#[derive(Debug, Clone, Serialize)]
pub struct AllReduceFigures {
    /// The collective timed.
    pub op: Collective,
    /// Processes.
    pub nproc: usize,
    /// The ring transport.
    pub transport: Transport,
    /// Ring or NCCL.
    pub backend: Backend,
    /// Flat or hierarchical.
    pub algorithm: Algorithm,
    /// The values on the links.
    pub wire: Wire,
    /// Nodes.
    pub nnodes: usize,
    /// Buffer size in bytes.
    pub bytes: usize,
    /// Median over iterations of the slowest rank's time, seconds.
    pub median_s: f64,
    /// bytes / median, GB/s (1e9).
    pub algbw_gbps: f64,
    /// algbw × 2(n−1)/n, GB/s.
    pub busbw_gbps: f64,
}

/// Starts this node's `nproc` ranks of this binary and relays rank 0's figures.
pub fn run(nproc: usize, nodes: &NodeFlags, args: &AllReduceArgs) -> Result<()> {
    let world = nproc * nodes.nnodes;
    anyhow::ensure!(
        world >= 2 || args.backend == Backend::Nccl,
        "a ring all-reduce benchmark needs two ranks or more (--nproc × --nnodes)"
    );
    anyhow::ensure!(
        args.collective == Collective::AllReduce || args.backend == Backend::Ring,
        "--collective {:?} is the ring's: NCCL's reduce-scatter and all-gather are not wired to this benchmark",
        args.collective
    );
    anyhow::ensure!(
        nodes.node_rank < nodes.nnodes,
        "--node-rank {} is outside --nnodes {}",
        nodes.node_rank,
        nodes.nnodes
    );
    let master = match (&nodes.master, nodes.nnodes) {
        (Some(master), _) => master.clone(),
        (None, 1) => free_loopback_port()?,
        (None, _) => anyhow::bail!("--nnodes {} needs --master HOST:PORT, on node 0", nodes.nnodes),
    };
    let exe = std::env::current_exe().context("locating the flotilla binary")?;
    let mut rank_args = vec![
        "bench".to_string(),
        "allreduce-rank".to_string(),
        "--iters".to_string(),
        args.iters.to_string(),
    ];
    rank_args.push("--size-mb".to_string());
    rank_args.push(args.size_mb.iter().map(f64::to_string).collect::<Vec<_>>().join(","));
    if args.json {
        rank_args.push("--json".to_string());
    }
    rank_args.push("--transport".to_string());
    rank_args.push(format!("{:?}", args.transport).to_lowercase());
    rank_args.push("--backend".to_string());
    rank_args.push(format!("{:?}", args.backend).to_lowercase());
    rank_args.push("--algorithm".to_string());
    rank_args.push(format!("{:?}", args.algorithm).to_lowercase());
    rank_args.push("--wire".to_string());
    rank_args.push(format!("{:?}", args.wire).to_lowercase());
    rank_args.push("--collective".to_string());
    rank_args.push(format!("{:?}", args.collective).to_lowercase());
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .div_ceil(nproc)
        .max(1);
    // The nodes share one token, as a launched job's do.
    let token = match std::env::var(TOKEN_VAR) {
        Ok(token) => token,
        Err(_) if nodes.nnodes == 1 => ClusterToken::generate()?,
        Err(_) => anyhow::bail!("{TOKEN_VAR} must be set, the same on every node"),
    };
    let children = (0..nproc)
        .map(|local| nodes.node_rank * nproc + local)
        .map(|rank| ChildSpec {
            rank,
            name: format!("rank {rank}"),
            program: exe.clone(),
            args: rank_args.clone(),
            env: vec![
                ("PADDLE_TRAINER_ID".to_string(), rank.to_string()),
                ("PADDLE_TRAINERS_NUM".to_string(), world.to_string()),
                ("PADDLE_NNODES".to_string(), nodes.nnodes.to_string()),
                ("POD_IP".to_string(), nodes.node_ip.clone()),
                ("PADDLE_MASTER".to_string(), master.clone()),
                ("RAYON_NUM_THREADS".to_string(), threads.to_string()),
                (TOKEN_VAR.to_string(), token.clone()),
            ],
            restart_alone: false,
            log: None,
        })
        .collect();
    let grace = std::time::Duration::from_secs(PREEMPTION_GRACE_S);
    supervise(children, OutputMode::Rank0Plain, 0, None, grace)
}

fn free_loopback_port() -> Result<String> {
    let probe = TcpListener::bind("127.0.0.1:0").context("finding a free loopback port")?;
    Ok(probe.local_addr()?.to_string())
}

fn env_usize(name: &str) -> Result<usize> {
    let value = std::env::var(name)
        .with_context(|| format!("{name} is not set (this command is started by `flotilla bench allreduce`)"))?;
    value
        .parse()
        .with_context(|| format!("{name} = {value:?} is not a number"))
}

/// What [`run`] tells a rank through the environment: where it sits in the benchmark, and
/// the cluster token.
struct RankPlace {
    rank: usize,
    world: usize,
    master: String,
    credentials: Credentials,
    nodes: usize,
    node_ip: String,
}

impl RankPlace {
    fn from_env(timeout: Duration) -> Result<Self> {
        Ok(Self {
            rank: env_usize("PADDLE_TRAINER_ID")?,
            world: env_usize("PADDLE_TRAINERS_NUM")?,
            master: std::env::var("PADDLE_MASTER").context("PADDLE_MASTER is not set")?,
            credentials: Credentials::from_env(timeout)?,
            nodes: env_usize("PADDLE_NNODES")?,
            node_ip: std::env::var("POD_IP").context("POD_IP is not set")?,
        })
    }
}

/// One rank of the benchmark (started by [`run`]).
pub fn run_rank(args: &AllReduceArgs) -> Result<()> {
    anyhow::ensure!(args.iters >= 1, "--iters must be at least 1");
    let timeout = Duration::from_secs(120);
    let place = RankPlace::from_env(timeout)?;
    let node_ip = &place.node_ip;
    let listener =
        TcpListener::bind((node_ip.as_str(), 0)).with_context(|| format!("binding the ring listener on {node_ip}"))?;
    let roster = join_rendezvous(&place, listener.local_addr()?.to_string(), timeout)?;
    let device = match args.backend {
        Backend::Ring => Device::Cpu,
        Backend::Nccl => device_for(DeviceKind::Gpu, place.rank)?,
    };
    let mut comm = connect_ring(&place, &roster, &listener, args, timeout)?;
    #[cfg(feature = "cuda")]
    if args.backend == Backend::Nccl {
        comm.join_nccl(&device, timeout)?;
    }
    if place.rank == 0 && !args.json {
        print_header();
    }
    for &size_mb in &args.size_mb {
        let len = ((size_mb * (1 << 20) as f64) as usize) / 4;
        let times = time_collectives(&mut comm, len, &device, args)?;
        let median = slowest_rank_median(&mut comm, &times)?;
        let figures = AllReduceFigures::new(args, &place, len * 4, median);
        if place.rank == 0 {
            print_figures(size_mb, &figures, args.json)?;
        }
    }
    comm.barrier("end of benchmark")?;
    Ok(())
}

/// Rendezvouses every rank at the master (rank 0 hosting the coordinator) and returns the
/// roster with every rank's ring endpoint.
fn join_rendezvous(place: &RankPlace, endpoint: String, timeout: Duration) -> Result<Roster> {
    let (rank, world) = (place.rank, place.world);
    let master = place.master.clone();
    let control = place.credentials.clone();
    actix::System::new().block_on(async move {
        let fault_tolerance = FaultToleranceConfig {
            timeout_s: timeout.as_secs_f64(),
            ..FaultToleranceConfig::default()
        };
        let coordinator = (rank == 0).then(|| Coordinator::new(world, timeout));
        let mut bus = connect_control(coordinator, rank, &master, &fault_tolerance, 1 << 20, &control).await?;
        let roster = bus.join(rank, world, endpoint, None, Default::default()).await?;
        Ok::<_, anyhow::Error>(roster)
    })
}

/// The communicator the benchmark times: the ring (flat or hierarchical, as `args` says)
/// between the roster's endpoints, or a lone rank's.
fn connect_ring(
    place: &RankPlace,
    roster: &Roster,
    listener: &TcpListener,
    args: &AllReduceArgs,
    timeout: Duration,
) -> Result<Communicator> {
    let endpoints = roster
        .endpoints
        .iter()
        .map(|e| e.parse())
        .collect::<Result<Vec<_>, _>>()?;
    if place.world == 1 {
        return Ok(Communicator::single());
    }
    let abandoned = Abandoned::never();
    let links = RingLinks {
        endpoints: &endpoints,
        listener,
        timeout,
        shared_memory: args.transport == Transport::Shm,
        credentials: &place.credentials,
        abandoned: &abandoned,
    };
    let nodes = NodeLayout {
        nodes: place.nodes,
        per_node: place.world / place.nodes.max(1),
    };
    let hierarchical = args.algorithm == Algorithm::Hierarchical;
    hierarchy::connect_communicator(place.rank, &links, Some(hierarchical), nodes)
}

/// Each timed iteration's seconds on this rank, after two warm-up ones; a barrier before each
/// makes the ranks start together.
fn time_collectives(comm: &mut Communicator, len: usize, device: &Device, args: &AllReduceArgs) -> Result<Vec<f64>> {
    let mut collective = buffer_of(len, device, args.wire, args.collective)?;
    let mut times = Vec::with_capacity(args.iters);
    for iter in 0..args.iters + 2 {
        comm.barrier("benchmark barrier")?;
        let start = Instant::now();
        collective(comm)?;
        if iter >= 2 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    Ok(times)
}

/// The median over iterations of the slowest rank's time: as nccl-tests and the PyTorch peer
/// do, an iteration takes as long as its slowest rank.
fn slowest_rank_median(comm: &mut Communicator, times: &[f64]) -> Result<f64> {
    let mine: Vec<u8> = times.iter().flat_map(|t| t.to_le_bytes()).collect();
    let all = comm.all_gather("benchmark timings", &mine)?;
    let mut slowest: Vec<f64> = (0..times.len())
        .map(|i| {
            all.iter()
                .map(|rank| f64::from_le_bytes(rank[i * 8..(i + 1) * 8].try_into().unwrap_or_default()))
                .fold(0.0, f64::max)
        })
        .collect();
    slowest.sort_by(f64::total_cmp);
    Ok(slowest[slowest.len() / 2])
}

impl AllReduceFigures {
    /// The figures of a `bytes` buffer whose all-reduce took `median` seconds.
    fn new(args: &AllReduceArgs, place: &RankPlace, bytes: usize, median: f64) -> Self {
        let world = place.world;
        let algbw = bytes as f64 / median / 1e9;
        Self {
            op: args.collective,
            nproc: world,
            transport: args.transport,
            backend: args.backend,
            algorithm: args.algorithm,
            wire: args.wire,
            nnodes: place.nodes,
            bytes,
            median_s: median,
            algbw_gbps: algbw,
            busbw_gbps: algbw * args.collective.bus_factor(world),
        }
    }
}

/// The table's header line (the table form only).
fn print_header() {
    println!(
        "{:>13} {:>10} {:>6} {:>6} {:>9} {:>7} {:>12} {:>5} {:>12} {:>12} {:>12}",
        "collective",
        "size_MiB",
        "nnodes",
        "nproc",
        "transport",
        "backend",
        "algorithm",
        "wire",
        "median_ms",
        "algbw_GB/s",
        "busbw_GB/s"
    );
}

/// One size's figures, as a JSON object or a table row.
fn print_figures(size_mb: f64, figures: &AllReduceFigures, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(figures)?);
    } else {
        println!(
            "{:>13} {:>10} {:>6} {:>6} {:>9} {:>7} {:>12} {:>5} {:>12.3} {:>12.3} {:>12.3}",
            format!("{:?}", figures.op).to_lowercase(),
            size_mb,
            figures.nnodes,
            figures.nproc,
            format!("{:?}", figures.transport).to_lowercase(),
            format!("{:?}", figures.backend).to_lowercase(),
            format!("{:?}", figures.algorithm).to_lowercase(),
            format!("{:?}", figures.wire).to_lowercase(),
            figures.median_s * 1e3,
            figures.algbw_gbps,
            figures.busbw_gbps
        );
    }
    Ok(())
}

/// One timed collective over a benchmark's buffer.
type TimedCollective = Box<dyn FnMut(&mut Communicator) -> Result<()>>;

/// A buffer of `len` floats on `device` and the collective the benchmark times: the ring's, in
/// place on the host, its values travelling as `wire` says, or NCCL's all-reduce (every figure
/// includes waiting for the GPU).
fn buffer_of(len: usize, device: &Device, wire: Wire, collective: Collective) -> Result<TimedCollective> {
    let data: Vec<f32> = (0..len).map(|i| (i % 97) as f32).collect();
    Ok(if device.is_cuda() {
        let tensor = Tensor::from_vec(data, len, device)?;
        Box::new(move |comm| {
            comm.all_reduce_mean_tensor("benchmark all-reduce", tensor.clone(), wire)
                .map(drop)
        })
    } else {
        let mut data = data;
        match collective {
            Collective::AllReduce => {
                Box::new(move |comm| comm.all_reduce_sum_as("benchmark all-reduce", &mut data, wire))
            }
            Collective::ReduceScatter => Box::new(move |comm| {
                comm.reduce_scatter_sum_as("benchmark reduce-scatter", &mut data, wire)
                    .map(drop)
            }),
            Collective::AllGather => {
                Box::new(move |comm| comm.all_gather_shards_as("benchmark all-gather", &mut data, wire))
            }
        }
    })
}
