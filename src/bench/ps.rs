//! `flotilla bench ps`: pull and push throughput against parameter-server shards running as
//! real processes on loopback. For every shard count and row width, the shards are started,
//! a client pulls (and pushes gradients for) the same set of unique ids repeatedly, and the
//! median time gives rows/s and GB/s (ids plus row values, both directions of payload).

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::actors::pserver::PServer;
use crate::config::PsMode;
use crate::net::auth::{ClusterToken, Credentials, TOKEN_VAR};
use crate::ps::client::{PsClient, ShardLink};
use crate::ps::dense::DenseSlice;
use crate::ps::optimizer::ServerOptimizer;
use crate::ps::placement::shard_of;
use crate::ps::server::serve_shard;
use crate::ps::table::{RowInit, SparseTable};
use crate::ps::wire::{Part, PullRequest, PushRequest, Request, UpdateKind};
use crate::ps::{Shard, ShardSpec};
use crate::rng::SplitMix64;

/// Arguments of `flotilla bench ps`.
#[derive(Debug, Clone, clap::Args)]
pub struct PsBenchArgs {
    /// Unique ids per request, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "10000,100000")]
    pub ids: Vec<usize>,
    /// Row widths (floats), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,64")]
    pub widths: Vec<usize>,
    /// Shard counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub shards: Vec<usize>,
    /// Timed iterations per case (after one warm-up that creates the rows).
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// One JSON object a line instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of one benchmark shard process (started by `bench ps`).
#[derive(Debug, Clone, clap::Args)]
pub struct PsBenchShardArgs {
    /// `ip:port` to serve on.
    #[arg(long)]
    pub endpoint: String,
    /// This shard's index.
    #[arg(long)]
    pub shard: usize,
    /// Shards in the benchmark.
    #[arg(long)]
    pub shards: usize,
    /// Row width.
    #[arg(long)]
    pub width: usize,
}

/// One case's figures.
#[derive(Debug, Clone, Serialize)]
pub struct PsFigures {
    /// `pull` or `push`.
    pub op: &'static str,
    /// Shard processes.
    pub shards: usize,
    /// Floats per row.
    pub width: usize,
    /// Unique ids per request (over all shards).
    pub ids: usize,
    /// Median time of one request to all shards, seconds.
    pub median_s: f64,
    /// Rows per second.
    pub rows_per_sec: f64,
    /// Payload (ids and values) per second, GB/s (1e9).
    pub gbps: f64,
}

/// Runs every case and prints its figures.
pub fn run(args: &PsBenchArgs) -> Result<()> {
    let exe = std::env::current_exe().context("locating the flotilla binary")?;
    if !args.json {
        println!(
            "{:>4} {:>6} {:>5} {:>8} {:>10} {:>12} {:>8}",
            "op", "shards", "width", "ids", "median ms", "rows/s", "GB/s"
        );
    }
    for &shards in &args.shards {
        for &width in &args.widths {
            let token = ClusterToken::generate()?;
            let servers = ShardProcesses::start(&exe, shards, width, &token)?;
            let credentials = Credentials::new(ClusterToken::new(&token)?, Duration::from_secs(60));
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let figures = runtime.block_on(measure(&servers.endpoints, width, args, &credentials));
            drop(servers);
            for f in figures? {
                if args.json {
                    println!("{}", serde_json::to_string(&f)?);
                } else {
                    println!(
                        "{:>4} {:>6} {:>5} {:>8} {:>10.2} {:>12.0} {:>8.2}",
                        f.op,
                        f.shards,
                        f.width,
                        f.ids,
                        f.median_s * 1e3,
                        f.rows_per_sec,
                        f.gbps
                    );
                }
            }
        }
    }
    Ok(())
}

/// Serves one benchmark shard (one table, async mode, one client) until the client leaves.
pub fn run_shard(args: &PsBenchShardArgs) -> Result<()> {
    let optimizer = ServerOptimizer::Adagrad {
        lr: 0.01,
        epsilon: 1e-10,
        initial_accumulator: 0.0,
    };
    let spec = ShardSpec {
        index: args.shard,
        server_num: args.shards,
        trainers: 1,
        mode: PsMode::Async,
        pass_steps: 0,
    };
    let table = SparseTable::new("bench", args.width, RowInit { seed: 1, bound: 0.1 }, optimizer);
    let shard = Shard::new(spec, DenseSlice::new(0, Vec::new(), optimizer), vec![table]);
    let credentials = Credentials::from_env(Duration::from_secs(60))?;
    let listener = TcpListener::bind(&args.endpoint).with_context(|| format!("binding {}", args.endpoint))?;
    listener.set_nonblocking(true)?;
    actix::System::new().block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let (all_left, done) = futures::channel::oneshot::channel();
        let actor = actix::Actor::start_in_arbiter(&actix::Arbiter::new().handle(), move |_| {
            PServer::new(shard, all_left, Duration::from_secs(60))
        });
        let open = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        actix::spawn(serve_shard(listener, actor.recipient(), 1 << 30, open, credentials));
        let _ = done.await;
        // Let the answer to the client's leave go out.
        tokio::time::sleep(Duration::from_millis(100)).await;
        Ok(())
    })
}

/// The shard processes of one case; killed (by pid) if still running when dropped.
struct ShardProcesses {
    endpoints: Vec<String>,
    children: Vec<Child>,
}

impl ShardProcesses {
    fn start(exe: &std::path::Path, shards: usize, width: usize, token: &str) -> Result<Self> {
        let mut servers = Self {
            endpoints: Vec::new(),
            children: Vec::new(),
        };
        let threads = (std::thread::available_parallelism().map_or(1, |n| n.get()) / (shards + 1)).max(1);
        for shard in 0..shards {
            let probe = TcpListener::bind("127.0.0.1:0").context("finding a free loopback port")?;
            let endpoint = probe.local_addr()?.to_string();
            drop(probe);
            let child = Command::new(exe)
                .args(["bench", "ps-shard", "--endpoint", &endpoint])
                .args(["--shard", &shard.to_string(), "--shards", &shards.to_string()])
                .args(["--width", &width.to_string()])
                .env("RAYON_NUM_THREADS", threads.to_string())
                .env(TOKEN_VAR, token)
                .stdin(Stdio::null())
                .spawn()
                .with_context(|| format!("starting benchmark shard {shard}"))?;
            servers.children.push(child);
            servers.endpoints.push(endpoint);
        }
        Ok(servers)
    }
}

impl Drop for ShardProcesses {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        for child in &mut self.children {
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(10));
            }
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

/// Connects a client to the shards and measures every id count of `args` against them, then
/// lets the shards go.
async fn measure(
    endpoints: &[String],
    width: usize,
    args: &PsBenchArgs,
    credentials: &Credentials,
) -> Result<Vec<PsFigures>> {
    let shards = endpoints.len();
    let links = endpoints
        .iter()
        .map(|e| ShardLink::remote(e.clone(), 1 << 30, credentials.clone()))
        .collect();
    let mut client = PsClient::new(links, 0, Duration::from_secs(60));
    client.wait_for_servers().await?;
    let mut figures = Vec::new();
    let mut step = 0;
    for &count in &args.ids {
        let by_shard = ids_by_shard(count, shards);
        figures.extend(measure_case(&mut client, &by_shard, width, args.iters, &mut step).await?);
    }
    client
        .call_all(vec![Request::Leave { trainer: 0 }; shards], "leave")
        .await?;
    Ok(figures)
}

/// `count` ids, seeded by the count so every shard setting reads the same ones, grouped by
/// the shard that holds them.
fn ids_by_shard(count: usize, shards: usize) -> Vec<Vec<u64>> {
    let mut rng = SplitMix64::new(count as u64);
    let mut by_shard = vec![Vec::new(); shards];
    for _ in 0..count {
        let id = rng.next_u64();
        by_shard[shard_of(0, id, shards)].push(id);
    }
    by_shard
}

/// The pull and push figures of one set of ids; `step` numbers the pushes across cases.
async fn measure_case(
    client: &mut PsClient,
    by_shard: &[Vec<u64>],
    width: usize,
    iters: usize,
    step: &mut u64,
) -> Result<[PsFigures; 2]> {
    let shards = by_shard.len();
    let count = by_shard.iter().map(Vec::len).sum();
    // A push creates the rows, which the pulls then read.
    *step += 1;
    client
        .call_all(push_requests(by_shard, width, *step), "warm-up push")
        .await?;
    client.call_all(pull_requests(by_shard), "warm-up pull").await?;
    let mut times = time_requests(client, iters, "pull", || pull_requests(by_shard)).await?;
    let pull = figures_of("pull", shards, width, count, &mut times);
    let mut times = time_requests(client, iters, "push", || {
        *step += 1;
        push_requests(by_shard, width, *step)
    })
    .await?;
    let push = figures_of("push", shards, width, count, &mut times);
    check_parts_join_to_the_whole(client, pull_requests(by_shard)).await?;
    Ok([pull, push])
}

/// The time of each of `iters` calls to all shards; building the requests is not timed.
async fn time_requests(
    client: &mut PsClient,
    iters: usize,
    what: &str,
    mut requests: impl FnMut() -> Vec<Request>,
) -> Result<Vec<Duration>> {
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let requests = requests();
        let started = Instant::now();
        client.call_all(requests, what).await?;
        times.push(started.elapsed());
    }
    Ok(times)
}

/// One training pull per shard, of that shard's ids.
fn pull_requests(by_shard: &[Vec<u64>]) -> Vec<Request> {
    by_shard
        .iter()
        .map(|ids| {
            Request::Pull(PullRequest {
                trainer: 0,
                version: 0,
                after_training: false,
                training: true,
                ids: vec![ids.clone()],
                dense: false,
            })
        })
        .collect()
}

/// One gradient push per shard, a small constant gradient for each of that shard's ids.
fn push_requests(by_shard: &[Vec<u64>], width: usize, step: u64) -> Vec<Request> {
    by_shard
        .iter()
        .map(|ids| {
            Request::Push(PushRequest {
                trainer: 0,
                step,
                part: Part::WHOLE,
                kind: UpdateKind::Gradients,
                ids: vec![ids.clone()],
                values: vec![vec![1e-3; ids.len() * width]],
                counts: Vec::new(),
                dense: Vec::new(),
                stop: false,
            })
        })
        .collect()
}

/// The rows pulled in pipelined parts (as timed) equal those of one whole pull: the check
/// that the figures measure a correct exchange.
async fn check_parts_join_to_the_whole(client: &mut PsClient, pulls: Vec<Request>) -> Result<()> {
    let mut whole = client.another_lane().with_part_ids(usize::MAX);
    let in_parts = client.call_all(pulls.clone(), "pull").await?;
    let at_once = whole.call_all(pulls, "whole pull").await?;
    anyhow::ensure!(
        in_parts == at_once,
        "the rows pulled in parts differ from those of one whole pull"
    );
    Ok(())
}

fn figures_of(op: &'static str, shards: usize, width: usize, ids: usize, times: &mut [Duration]) -> PsFigures {
    times.sort_unstable();
    let median = times
        .get(times.len() / 2)
        .copied()
        .unwrap_or_default()
        .as_secs_f64()
        .max(1e-12);
    PsFigures {
        op,
        shards,
        width,
        ids,
        median_s: median,
        rows_per_sec: ids as f64 / median,
        gbps: (ids * (8 + 4 * width)) as f64 / median / 1e9,
    }
}
