//! `flotilla bench allreduce`: all-reduce between real processes, by the ring on loopback or
//! by NCCL on one GPU per process, reported as nccl-tests does: median time, algorithm
//! bandwidth (bytes / time) and bus bandwidth (algbw × 2(n−1)/n, what each link carries,
//! comparable across world sizes).

use std::net::TcpListener;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use serde::Serialize;

use crate::actors::Coordinator;
use crate::config::{DeviceKind, FaultToleranceConfig};
use crate::engines::comm::{connect_ring, Abandoned, Communicator};
use crate::engines::compute::device_for;
use crate::job::connect_control;
use crate::launch::{supervise, ChildSpec, OutputMode};
use crate::net::auth::{ClusterToken, Credentials, TOKEN_VAR};

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
    /// Always `"allreduce"`.
    pub op: &'static str,
    /// Processes.
    pub nproc: usize,
    /// The ring transport.
    pub transport: Transport,
    /// Ring or NCCL.
    pub backend: Backend,
    /// Buffer size in bytes.
    pub bytes: usize,
    /// Median over iterations of the slowest rank's time, seconds.
    pub median_s: f64,
    /// bytes / median, GB/s (1e9).
    pub algbw_gbps: f64,
    /// algbw × 2(n−1)/n, GB/s.
    pub busbw_gbps: f64,
}

/// Starts `nproc` ranks of this binary on loopback and relays rank 0's
/// figures.
pub fn run(nproc: usize, args: &AllReduceArgs) -> Result<()> {
    anyhow::ensure!(
        nproc >= 2 || args.backend == Backend::Nccl,
        "--nproc must be at least 2 for a ring all-reduce benchmark"
    );
    let master = free_loopback_port()?;
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
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .div_ceil(nproc)
        .max(1);
    let token = ClusterToken::generate()?;
    let children = (0..nproc)
        .map(|rank| ChildSpec {
            rank,
            name: format!("rank {rank}"),
            program: exe.clone(),
            args: rank_args.clone(),
            env: vec![
                ("PADDLE_TRAINER_ID".to_string(), rank.to_string()),
                ("PADDLE_TRAINERS_NUM".to_string(), nproc.to_string()),
                ("PADDLE_MASTER".to_string(), master.clone()),
                ("RAYON_NUM_THREADS".to_string(), threads.to_string()),
                (TOKEN_VAR.to_string(), token.clone()),
            ],
            restart_alone: false,
            log: None,
        })
        .collect();
    supervise(children, OutputMode::Rank0Plain, 0, None)
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

/// One rank of the benchmark (started by [`run`]).
pub fn run_rank(args: &AllReduceArgs) -> Result<()> {
    anyhow::ensure!(args.iters >= 1, "--iters must be at least 1");
    let rank = env_usize("PADDLE_TRAINER_ID")?;
    let world = env_usize("PADDLE_TRAINERS_NUM")?;
    let master = std::env::var("PADDLE_MASTER").context("PADDLE_MASTER is not set")?;
    let timeout = Duration::from_secs(120);
    let credentials = Credentials::from_env(timeout)?;
    let listener = TcpListener::bind("127.0.0.1:0").context("binding the ring listener")?;
    let endpoint = listener.local_addr()?.to_string();
    let control = credentials.clone();
    let roster = actix::System::new().block_on(async move {
        let fault_tolerance = FaultToleranceConfig {
            timeout_s: timeout.as_secs_f64(),
            ..FaultToleranceConfig::default()
        };
        let coordinator = (rank == 0).then(|| Coordinator::new(world, timeout));
        let mut bus = connect_control(coordinator, rank, &master, &fault_tolerance, 1 << 20, &control).await?;
        let roster = bus.join(rank, world, endpoint, None, Default::default()).await?;
        Ok::<_, anyhow::Error>(roster)
    })?;
    let device = match args.backend {
        Backend::Ring => Device::Cpu,
        Backend::Nccl => device_for(DeviceKind::Gpu, rank)?,
    };
    let endpoints = roster
        .endpoints
        .iter()
        .map(|e| e.parse())
        .collect::<Result<Vec<_>, _>>()?;
    let mut comm = if world == 1 {
        Communicator::single()
    } else {
        connect_ring(
            rank,
            &endpoints,
            &listener,
            timeout,
            args.transport == Transport::Shm,
            &credentials,
            &Abandoned::never(),
        )?
    };
    #[cfg(feature = "cuda")]
    if args.backend == Backend::Nccl {
        comm.join_nccl(&device, timeout)?;
    }
    if rank == 0 && !args.json {
        println!(
            "{:>10} {:>6} {:>9} {:>7} {:>12} {:>12} {:>12}",
            "size_MiB", "nproc", "transport", "backend", "median_ms", "algbw_GB/s", "busbw_GB/s"
        );
    }
    for &size_mb in &args.size_mb {
        let len = ((size_mb * (1 << 20) as f64) as usize) / 4;
        let mut all_reduce = buffer_of(len, &device)?;
        let mut times = Vec::with_capacity(args.iters);
        for iter in 0..args.iters + 2 {
            comm.barrier("benchmark barrier")?;
            let start = Instant::now();
            all_reduce(&mut comm)?;
            if iter >= 2 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        // As nccl-tests and the PyTorch peer do: an iteration takes as long
        // as its slowest rank.
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
        let median = slowest[slowest.len() / 2];
        let bytes = len * 4;
        let algbw = bytes as f64 / median / 1e9;
        let figures = AllReduceFigures {
            op: "allreduce",
            nproc: world,
            transport: args.transport,
            backend: args.backend,
            bytes,
            median_s: median,
            algbw_gbps: algbw,
            busbw_gbps: algbw * 2.0 * (world - 1) as f64 / world as f64,
        };
        if rank == 0 {
            if args.json {
                println!("{}", serde_json::to_string(&figures)?);
            } else {
                println!(
                    "{:>10} {:>6} {:>9} {:>7} {:>12.3} {:>12.3} {:>12.3}",
                    size_mb,
                    world,
                    format!("{:?}", args.transport).to_lowercase(),
                    format!("{:?}", args.backend).to_lowercase(),
                    median * 1e3,
                    figures.algbw_gbps,
                    figures.busbw_gbps
                );
            }
        }
    }
    comm.barrier("end of benchmark")?;
    Ok(())
}

/// One timed all-reduce of a benchmark's buffer.
type TimedAllReduce = Box<dyn FnMut(&mut Communicator) -> Result<()>>;

/// A buffer of `len` floats on `device` and the all-reduce the benchmark times: the ring's, in
/// place on the host, or NCCL's (every figure includes waiting for the GPU).
fn buffer_of(len: usize, device: &Device) -> Result<TimedAllReduce> {
    let data: Vec<f32> = (0..len).map(|i| (i % 97) as f32).collect();
    Ok(if device.is_cuda() {
        let tensor = Tensor::from_vec(data, len, device)?;
        Box::new(move |comm| {
            comm.all_reduce_mean_tensor("benchmark all-reduce", tensor.clone())
                .map(drop)
        })
    } else {
        let mut data = data;
        Box::new(move |comm| comm.all_reduce_sum("benchmark all-reduce", &mut data))
    })
}
