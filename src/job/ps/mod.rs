//! The parameter-server job: the wide&deep CTR model trained by `world_size` trainers against
//! `cluster.server_num` shards — all as actors of this process (simulated cluster), or as one
//! role of a job started by `flotilla launch-ps` (`TRAINING_ROLE`, Paddle's variables).

pub mod serving;
mod shard_generations;
mod struck;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use actix::prelude::*;
use anyhow::{anyhow, bail, ensure, Context as _, Result};
use futures::channel::oneshot;
use serde::Serialize;

use tokio::sync::mpsc;

use self::shard_generations::ShardGenerations;
use super::control::host_coordinator;
use super::launched_rank::{host_of, refused_if_mismatched, RankRecovery, RoleMirror};
use super::outputs::{write_config, write_summary};
use super::{FaultPlan, FaultReport, Recovery, Refusal, RunOptions};
use crate::actors::ctr_device::CtrDevice;
use crate::actors::ps_trainer::{PsInPlace, PsOutcome, PsTrainer};
use crate::actors::pserver::{PServer, TakeShardSpans, WrittenCheckpoint};
use crate::actors::recovery::heartbeat::{watched, CoordinatorAt};
use crate::actors::recovery::rollback::{OrderLine, Orders};
use crate::actors::Coordinator;
use crate::collective::preemption::PreemptionWatch;
use crate::config::{DatasetKind, JobConfig, PsMode};
use crate::data::ctr::{ClickLogParser, CriteoSynth, CtrSource, Split};
use crate::models::{ParamInit, SparseModelDef};
use crate::net::auth::Credentials;
use crate::net::ControlBus;
use crate::ps::client::{PsClient, ShardLink};
use crate::ps::dense::{dense_range, DenseSlice};
use crate::ps::optimizer::ServerOptimizer;
use crate::ps::policy::RowPolicy;
use crate::ps::server::serve_shard;
use crate::ps::snapshot::shard_file_name;
use crate::ps::table::{RowInit, SparseTable};
use crate::ps::wire::{ShardStats, TableStats};
use crate::ps::{Shard, ShardSpec, PAGE_ROWS};
use crate::telemetry::timeline::TraceTarget;

/// How long a shard waits, once every trainer has left, for their connections to close.
const LEAVE_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Held-out samples over which the planted model's AUC (the ceiling) is computed.
const CEILING_SAMPLES: u64 = 20_000;

/// The figures of a parameter-server run, as written to `summary.json`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PsSummary {
    /// `parameter-server`.
    pub strategy: String,
    /// `sync`, `async` or `geo`.
    pub mode: String,
    /// Where the roles ran: `in-process` or `multi-process`.
    pub cluster: String,
    /// Trainers.
    pub trainers: usize,
    /// Parameter-server shards.
    pub servers: usize,
    /// Steps per trainer.
    pub steps: usize,
    /// Samples per second counted over all trainers.
    pub samples_per_sec: f64,
    /// Trainer 0's time in pulls and pushes (including waits for other trainers in sync mode)
    /// over its training time.
    pub comm_time_ratio: f64,
    /// Trainer 0's loss on its part of the last batch.
    pub final_loss: f32,
    /// AUC on the held-out set with the shards' final values.
    pub auc: f64,
    /// Held-out samples evaluated.
    pub test_samples: usize,
    /// AUC of the planted click model on the same held-out set: the ceiling (synthetic data).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub planted_auc: Option<f64>,
    /// Size of each sparse table at the end, over all shards.
    pub tables: Vec<TableFigures>,
    /// Updates each shard applied: sync steps, or pushes (async and geo) — each trainer's push
    /// of each step counted once, however often the job rolled back.
    pub updates_applied: Vec<u64>,
}

/// How big one sparse table grew, and what a row costs.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TableFigures {
    /// The table.
    pub name: String,
    /// Rows over all shards.
    pub rows: u64,
    /// Bytes the shards allocated per row (values, optimizer state, index).
    pub bytes_per_row: f64,
    /// The ideal: id, values and optimizer state, `8 + 4 × (width + state)`.
    pub raw_bytes_per_row: usize,
    /// Under a row policy: rows stored by its entry rule, evicted for its memory cap and
    /// deleted at pass ends, over all shards.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyFigures>,
}

/// What a table's row policy did over the run, summed over the shards.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PolicyFigures {
    /// Rows stored.
    pub admitted: u64,
    /// Rows evicted, lowest score first, to stay under the memory cap.
    pub evicted: u64,
    /// Rows deleted at the end of a pass.
    pub deleted: u64,
}

/// A parameter-server job: the config, its model and its data.
#[derive(Clone)]
pub struct ParameterServerJob {
    /// The validated config (`cluster.server_num > 0`).
    pub config: Arc<JobConfig>,
    /// The sparse model: the built-in one `train.model` names, or a program's own.
    pub model: SparseModelDef,
    /// Training click logs.
    pub train_data: CtrSource,
    /// Held-out click logs.
    pub test_data: CtrSource,
}

impl ParameterServerJob {
    /// The job `config.train` describes, with the built-in model `train.model` names; what keeps
    /// it from being built (its data, its model) is refused: no restart changes it.
    pub fn builtin(config: JobConfig) -> Result<Self> {
        let model = SparseModelDef::builtin(&config.train).map_err(Refusal::wrap)?;
        Self::new(config, model).map_err(Refusal::wrap)
    }

    /// The job `config` describes, training `model`: a program's own (`train.model = "custom"`)
    /// or a built-in one. Settings of sparse tables the model does not have are refused.
    pub fn new(config: JobConfig, model: SparseModelDef) -> Result<Self> {
        config
            .check_sparse_table_names(&model.table_names())
            .map_err(Refusal::wrap)?;
        let train = &config.train;
        let (train_data, test_data) = match train.dataset {
            DatasetKind::CriteoSynthetic => {
                let synth = Arc::new(CriteoSynth::new(train.seed, train.synthetic_vocab));
                let test = (train.synthetic_samples as f64 * train.test_fraction).round() as u64;
                let source = |split, samples| CtrSource::Synthetic {
                    synth: synth.clone(),
                    split,
                    samples,
                };
                (
                    source(Split::Train, train.synthetic_samples as u64 - test),
                    source(Split::Test, test.max(1)),
                )
            }
            DatasetKind::Criteo | DatasetKind::ClickLog => {
                let schema = train.click_log_schema().context("train.click_log")?;
                let parser = Arc::new(ClickLogParser::new(schema));
                let files = |names: &[String]| CtrSource::Files {
                    files: names.iter().map(PathBuf::from).collect(),
                    parser: parser.clone(),
                };
                (files(&train.train_files), files(&train.test_files))
            }
            DatasetKind::Digits
            | DatasetKind::Synthetic
            | DatasetKind::Text
            | DatasetKind::Csv
            | DatasetKind::Parquet
            | DatasetKind::Arrays => {
                bail!("the parameter-server job trains on click logs (criteo_synthetic, criteo or click_log)")
            }
        };
        model.check_slots(train_data.shape()).map_err(Refusal::wrap)?;
        Ok(Self {
            config: Arc::new(config),
            model,
            train_data,
            test_data,
        })
    }

    /// Runs the role the environment names: `TRAINING_ROLE=PSERVER` serves one shard,
    /// `TRAINING_ROLE=TRAINER` trains as `PADDLE_TRAINER_ID`; without them every role runs
    /// in this process. Returns the summary where this process is trainer 0.
    pub fn run(&self, options: &RunOptions) -> Result<Option<PsSummary>> {
        match std::env::var("TRAINING_ROLE").ok().as_deref().map(str::trim) {
            Some("PSERVER") => self
                .run_server(shard_index_from_env(&self.config)?, options)
                .map(|()| None),
            Some("TRAINER") => {
                let id = std::env::var("PADDLE_TRAINER_ID").context("TRAINING_ROLE=TRAINER needs PADDLE_TRAINER_ID")?;
                let rank = id
                    .trim()
                    .parse()
                    .with_context(|| format!("PADDLE_TRAINER_ID = {id:?} is not a trainer index"))?;
                self.run_trainer(rank, options)
            }
            Some(other) => bail!("TRAINING_ROLE = {other:?}: expected PSERVER or TRAINER"),
            None => self.run_simulated(options).map(Some),
        }
    }

    /// Every shard and trainer as actors of this process.
    pub fn run_simulated(&self, options: &RunOptions) -> Result<PsSummary> {
        write_config(&options.run_dir, &self.config)?;
        let config = self.config.clone();
        let (servers, world) = (config.cluster.server_num, config.world_size());
        let (timeout, retry) = (config.fault_tolerance.timeout(), config.fault_tolerance.retry);
        let recovery = Recovery::plan(&config, &options.run_dir, &options.resume)?;
        let trace = options.trace_target();
        let outcomes = System::new().block_on(async move {
            let shards = (0..servers)
                .map(|index| {
                    let shard = start_shard(self, index, &recovery)?;
                    let (all_left, _) = oneshot::channel();
                    let origin = trace.as_ref().map(|t| t.origin.instant);
                    let server = PServer::new(shard, all_left, timeout)
                        .traced_from(origin)
                        .writing_in(&options.run_dir, recovery.store.as_ref().map(|store| store.root()));
                    Ok(PServer::start_in_arbiter(&Arbiter::new().handle(), move |_| server))
                })
                .collect::<Result<Vec<_>>>()?;
            let runs = (0..world).map(|rank| {
                let links = shards
                    .iter()
                    .map(|shard| ShardLink::local(shard.clone().recipient()))
                    .collect();
                let client = PsClient::new(links, retry, timeout);
                let trace = trace.clone().map(|t| (t, 0.0));
                let trainer = self.trainer(rank, client, options, trace, recovery.clone());
                async move { trainer.train().await.map_err(|e| e.context(format!("trainer {rank}"))) }
            });
            let outcomes = futures::future::try_join_all(runs).await?;
            if let Some(trace) = &trace {
                for (index, shard) in shards.iter().enumerate() {
                    let spans = shard.send(TakeShardSpans).await?;
                    trace.write(index, &format!("server {index}"), 0.0, spans)?;
                }
            }
            anyhow::Ok(outcomes)
        })?;
        let place0 = outcomes
            .into_iter()
            .find(|outcome| outcome.place == 0)
            .context("a job needs at least one trainer")?;
        let summary = self.summary(place0, "in-process")?;
        options.merge_in_process_trace()?;
        write_summary(&options.run_dir, &summary)?;
        Ok(summary)
    }

    /// Every shard and trainer as actors of this process, struck by `faults`, recovering in
    /// place as a launched job does (see [`FaultPlan`]); also answers the replacements each
    /// role needed.
    pub fn run_simulated_with_faults(
        &self,
        options: &RunOptions,
        faults: &FaultPlan,
    ) -> Result<(PsSummary, FaultReport)> {
        struck::run_with_faults(self, options, faults)
    }

    /// Serves shard `index` at `cluster.pservers[index]` until every trainer has left.
    pub fn run_server(&self, index: usize, options: &RunOptions) -> Result<()> {
        let ShardStart {
            endpoint,
            listener,
            recovery,
            order_line,
            orders,
            shard,
            mirror,
            timeout,
            credentials,
            heartbeats,
            _watch,
        } = self.start_server(index, options)?;
        let config = self.config.clone();
        System::new()
            .block_on(async move {
                let max_frame = config.cluster.max_frame_bytes();
                // Without a coordinator process of its own, server 0 hosts it.
                if let (0, Some(at), None) = (index, &heartbeats, &orders) {
                    host_job_coordinator(&config, at).await?;
                }
                let listener = tokio::net::TcpListener::from_std(listener)?;
                let (all_left, done) = oneshot::channel();
                let trace = options.trace_target();
                // Measured at start, while the coordinator surely serves; server 0 hosting the
                // coordinator shares its clock.
                let clock_offset_us = match (&trace, &heartbeats) {
                    (Some(_), Some(at)) if index > 0 || orders.is_some() => {
                        clock_offset_us(at, timeout, max_frame).await?
                    }
                    _ => 0.0,
                };
                let (acknowledge, acks) = mpsc::unbounded_channel();
                let in_place = orders.is_some().then_some(acknowledge);
                let server =
                    PServer::new(shard, all_left, timeout).traced_from(trace.as_ref().map(|t| t.origin.instant));
                let actor = shard_actor(server, options, &recovery, in_place)?;
                let open = Arc::new(AtomicUsize::new(0));
                actix::spawn(serve_shard(
                    listener,
                    actor.clone().recipient(),
                    max_frame,
                    open.clone(),
                    credentials.clone(),
                ));
                let serving = async {
                    match (orders, &heartbeats) {
                        (Some(orders), Some((master, credentials))) => {
                            let bus = ControlBus::connect(master, timeout, max_frame, credentials).await?;
                            let generations = ShardGenerations {
                                index,
                                job: self,
                                actor: actor.clone(),
                                bus,
                                orders,
                                endpoint: endpoint.clone(),
                                mirror: mirror.map(RoleMirror::serve_at).transpose()?,
                                recovery: &recovery,
                                joined: false,
                            };
                            generations.serve(acks, done).await?;
                        }
                        _ => done
                            .await
                            .map_err(|_| anyhow!("parameter server {index} stopped before every trainer left"))?,
                    }
                    wait_for_hang_ups(&open).await;
                    tracing::info!("parameter server {index}: every trainer has left; shutting down");
                    if let Some(trace) = &trace {
                        let spans = actor.send(TakeShardSpans).await?;
                        trace.write(index, &format!("server {index}"), clock_offset_us, spans)?;
                    }
                    Ok(())
                };
                with_heartbeats(serving, index, heartbeats.as_ref(), &config, order_line.as_ref()).await
            })
            .map_err(refused_if_mismatched)
    }

    /// What shard `index` serves with, set up before its actor system starts.
    fn start_server(&self, index: usize, options: &RunOptions) -> Result<ShardStart> {
        let config = &self.config;
        let (endpoint, listener) = shard_listener(config, index)?;
        let RankRecovery { recovery, orders } = RankRecovery::plan(config, options)?;
        let shard = start_shard(self, index, &recovery)?;
        // A shard that rolls back in place keeps a copy of its state on the next node.
        let mirror = match orders.is_some() {
            true => RoleMirror::bind(config, host_of(&endpoint), &recovery)?,
            false => None,
        };
        let timeout = config.fault_tolerance.timeout();
        let credentials = Credentials::of_cluster(&config.cluster, timeout)?;
        tracing::info!(
            "parameter server {index} of {} listening on {endpoint}",
            config.cluster.server_num
        );
        let heartbeats = self.heartbeat_line(index)?;
        let (order_line, orders) = orders.unzip();
        // Sync mode: a first SIGTERM does not end the shard, which tells the trainers at their
        // next step and serves on until they checkpointed and left; the other modes end at once.
        let watch = (config.strategy.ps_mode() == PsMode::Sync)
            .then(PreemptionWatch::install)
            .transpose()?;
        Ok(ShardStart {
            endpoint,
            listener,
            recovery,
            order_line,
            orders,
            shard,
            mirror,
            timeout,
            credentials,
            heartbeats,
            _watch: watch,
        })
    }

    /// Where role `rank` (servers first, then trainers) heartbeats, when the job has a
    /// coordinator (`cluster.master`, which `launch-ps` sets).
    fn heartbeat_line(&self, rank: usize) -> Result<Option<(String, Credentials)>> {
        let config = &self.config;
        let Some(master) = config.cluster.master.clone() else {
            tracing::warn!("role {rank}: no cluster.master, so no heartbeats: only deadlines find a dead peer");
            return Ok(None);
        };
        let credentials = Credentials::of_cluster(&config.cluster, config.fault_tolerance.timeout())?;
        Ok(Some((master, credentials)))
    }

    /// Trains as trainer `rank` against the shards at `cluster.pservers`.
    pub fn run_trainer(&self, rank: usize, options: &RunOptions) -> Result<Option<PsSummary>> {
        let config = self.config.clone();
        let world = config.world_size();
        anyhow::ensure!(
            rank < world,
            "PADDLE_TRAINER_ID = {rank} is outside the {world} trainers"
        );
        if rank == 0 {
            write_config(&options.run_dir, &self.config)?;
        }
        anyhow::ensure!(
            config.cluster.pservers.len() == config.cluster.server_num,
            "{}: cluster.pservers (PADDLE_PSERVERS_IP_PORT_LIST) must list the {} parameter servers of a multi-process job",
            config.source_name,
            config.cluster.server_num
        );
        let max_frame = config.cluster.max_frame_bytes();
        let credentials = Credentials::of_cluster(&config.cluster, config.fault_tolerance.timeout())?;
        let links = config
            .cluster
            .pservers
            .iter()
            .map(|endpoint| ShardLink::remote(endpoint.clone(), max_frame, credentials.clone()))
            .collect();
        let client = PsClient::new(links, config.fault_tolerance.retry, config.fault_tolerance.timeout());
        let RankRecovery { recovery, orders } = RankRecovery::plan(&config, options)?;
        let role = config.cluster.server_num + rank;
        let endpoint = std::env::var("PADDLE_CURRENT_ENDPOINT").unwrap_or_else(|_| "127.0.0.1:0".to_string());
        // A geo trainer that rolls back in place keeps a copy of its own state on the next node,
        // and every trainer keeps the copies of the node before.
        let mirror = match orders.is_some() {
            true => RoleMirror::bind(&config, host_of(&endpoint), &recovery)?,
            false => None,
        };
        let heartbeats = self.heartbeat_line(role)?;
        let (order_line, orders) = orders.unzip();
        let outcome = System::new()
            .block_on(async move {
                let timeout = config.fault_tolerance.timeout();
                let trace = match (options.trace_target(), &heartbeats) {
                    (Some(target), Some((master, credentials))) => {
                        let mut bus = ControlBus::connect(master, timeout, max_frame, credentials).await?;
                        Some((target, bus.clock_offset_us().await?))
                    }
                    (Some(target), None) => Some((target, 0.0)),
                    (None, _) => None,
                };
                let in_place = match (orders, &heartbeats) {
                    (Some(orders), Some((master, credentials))) => Some(PsInPlace {
                        bus: ControlBus::connect(master, timeout, max_frame, credentials).await?,
                        orders,
                        endpoint,
                        mirror: mirror.map(RoleMirror::serve_at).transpose()?,
                    }),
                    _ => None,
                };
                let training = async {
                    let mut trainer = self.trainer(rank, client, options, trace, recovery);
                    trainer.in_place = in_place;
                    let outcome = trainer.train().await?;
                    // The trainer at place 0 writes the summary before it says goodbye: until
                    // then its loss is a death the coordinator recovers from.
                    if outcome.place != 0 {
                        return Ok(None);
                    }
                    let summary = self.summary(outcome, "multi-process")?;
                    write_summary(&options.run_dir, &summary)?;
                    Ok(Some(summary))
                };
                with_heartbeats(training, role, heartbeats.as_ref(), &config, order_line.as_ref()).await
            })
            .map_err(refused_if_mismatched)?;
        Ok(outcome)
    }

    pub(super) fn trainer(
        &self,
        rank: usize,
        client: PsClient,
        options: &RunOptions,
        trace: Option<(TraceTarget, f64)>,
        recovery: Recovery,
    ) -> PsTrainer {
        PsTrainer {
            rank,
            job: self.config.clone(),
            model: self.model.clone(),
            train_data: self.train_data.clone(),
            test_data: self.test_data.clone(),
            client: Some(client),
            device: SyncArbiter::start(1, CtrDevice::default),
            // Whichever trainer ends at place 0 has the shards save their tables.
            save_tables: true,
            monitor: (rank == 0).then(|| options.monitor(&self.config, rank, "ps_trainer")),
            trace,
            recovery,
            in_place: None,
            inbox: None,
            faults: None,
        }
    }

    pub(super) fn summary(&self, place0: PsOutcome, cluster: &str) -> Result<PsSummary> {
        let config = &self.config;
        let planted_auc = match &self.test_data {
            CtrSource::Synthetic { synth, split, samples } => {
                synth.planted_auc(*split, (*samples).min(CEILING_SAMPLES))
            }
            CtrSource::Files { .. } => None,
        };
        Ok(PsSummary {
            strategy: "parameter-server".to_string(),
            mode: config.strategy.ps_mode().name().to_string(),
            cluster: cluster.to_string(),
            trainers: place0.trainers,
            servers: config.cluster.server_num,
            steps: place0.steps,
            samples_per_sec: place0.samples_per_sec,
            comm_time_ratio: place0.comm_time_ratio,
            final_loss: place0.losses.last().copied().unwrap_or(f32::NAN),
            auc: place0
                .auc
                .context("the held-out set has only one class (or no samples): AUC is undefined")?,
            test_samples: place0.test_samples,
            planted_auc,
            tables: table_figures(config, &self.model, &place0.shards),
            updates_applied: place0.shards.iter().map(|s| s.updates_applied).collect(),
        })
    }
}

/// Each table's rows and bytes, summed over the shards.
fn table_figures(job: &JobConfig, model: &SparseModelDef, shards: &[ShardStats]) -> Vec<TableFigures> {
    model
        .tables()
        .iter()
        .enumerate()
        .map(|(table, spec)| {
            let total = TableStats::total(shards, table);
            let policed = job.strategy.sparse_table_configs.contains_key(&spec.name);
            let optimizer = ServerOptimizer::for_table(job, spec);
            TableFigures {
                name: spec.name.clone(),
                rows: total.rows,
                bytes_per_row: total.bytes as f64 / total.rows.max(1) as f64,
                raw_bytes_per_row: 8 + 4 * (spec.width + optimizer.state_len(spec.width)),
                policy: policed.then_some(PolicyFigures {
                    admitted: total.admitted,
                    evicted: total.evicted,
                    deleted: total.deleted,
                }),
            }
        })
        .collect()
}

/// Shard `index` of the job training `model`: its slice of the model's dense parameters (from
/// the seed, as every trainer would build them) and empty tables, or what
/// `train.init_tables_from` holds.
pub fn build_shard(job: &JobConfig, model: &SparseModelDef, index: usize) -> Result<Shard> {
    let servers = job.cluster.server_num;
    let optimizer = ServerOptimizer::for_job(job);
    let built = model.build(&ParamInit::new(job.train.seed, candle_core::Device::Cpu))?;
    let mut dense = Vec::new();
    for (_, param) in built.parameters() {
        dense.extend(param.var()?.flatten_all()?.to_vec1::<f32>()?);
    }
    let range = dense_range(dense.len(), index, servers);
    let slice = DenseSlice::new(range.start, dense[range].to_vec(), optimizer);
    let tables = model
        .tables()
        .iter()
        .map(|table| {
            let init = RowInit {
                seed: job.train.seed,
                bound: table.init_bound,
            };
            let empty = SparseTable::new(&table.name, table.width, init, ServerOptimizer::for_table(job, table));
            match job.strategy.sparse_table_configs.get(&table.name) {
                Some(policy) => {
                    let policed = empty.with_policy(RowPolicy::new(policy.clone(), &table.name, job.train.seed));
                    ensure!(
                        policed.row_budget() != Some(0),
                        "strategy.sparse_table_configs.{}.max_memory_mb = {}: too little for one page of {} rows \
                         of {} bytes on a shard",
                        table.name,
                        policy.max_memory_mb,
                        PAGE_ROWS,
                        policed.raw_bytes_per_row() - 8
                    );
                    Ok(policed)
                }
                None => Ok(empty),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let spec = ShardSpec {
        index,
        server_num: servers,
        trainers: job.world_size(),
        mode: job.strategy.ps_mode(),
        pass_steps: job.strategy.sparse_pass_steps,
    };
    let mut shard = Shard::new(spec, slice, tables);
    if let Some(dir) = &job.train.init_tables_from {
        let path = Path::new(dir).join(shard_file_name(index));
        shard
            .load(&path)
            .with_context(|| format!("parameter server {index}: train.init_tables_from"))?;
        tracing::info!("parameter server {index} starts from {}", path.display());
    }
    Ok(shard)
}

/// Runs `work` of role `role`, heartbeating on `line` (the coordinator and the credentials) when
/// the job has one; rollback orders go down `orders` when the role rolls back in place.
async fn with_heartbeats<T>(
    work: impl std::future::Future<Output = Result<T>>,
    role: usize,
    line: Option<&(String, Credentials)>,
    config: &JobConfig,
    orders: Option<&OrderLine>,
) -> Result<T> {
    match line {
        Some((master, credentials)) => {
            watched(work, role, CoordinatorAt::tcp(master, credentials), config, orders).await
        }
        None => work.await,
    }
}

/// Shard `index` of the job, brought to the checkpoint `recovery` starts from (if any).
pub(super) fn start_shard(job: &ParameterServerJob, index: usize, recovery: &Recovery) -> Result<Shard> {
    let mut shard = build_shard(&job.config, &job.model, index)?;
    let job = &*job.config;
    if let Some(checkpoint) = &recovery.start {
        let resuming = || format!("parameter server {index}: resuming from {}", checkpoint.dir.display());
        let written_by = checkpoint.numbered_files(shard_file_name);
        let step = checkpoint.step as u64;
        if written_by.len() == job.cluster.server_num {
            shard
                .resume(&checkpoint.read(&shard_file_name(index))?, step)
                .with_context(resuming)?;
        } else {
            let started = std::time::Instant::now();
            let files = written_by
                .iter()
                .map(|name| checkpoint.read(name))
                .collect::<Result<Vec<_>>>()?;
            shard.resume_rehashed(&files, step).with_context(resuming)?;
            tracing::info!(
                server = index,
                written_by = files.len(),
                servers = job.cluster.server_num,
                seconds = started.elapsed().as_secs_f64(),
                "re-hashed the checkpoint's rows and dense slices onto this many servers"
            );
        }
    }
    Ok(shard)
}

/// Which shard this process serves: the position of `POD_IP:PADDLE_PORT` in the server list
/// (as Paddle's launcher identifies servers).
pub fn shard_index_from_env(job: &JobConfig) -> Result<usize> {
    let ip = std::env::var("POD_IP").context("TRAINING_ROLE=PSERVER needs POD_IP")?;
    let port = std::env::var("PADDLE_PORT").context("TRAINING_ROLE=PSERVER needs PADDLE_PORT")?;
    let me = format!("{}:{}", ip.trim(), port.trim());
    job.cluster
        .pservers
        .iter()
        .position(|endpoint| endpoint.trim() == me)
        .with_context(|| {
            format!(
                "POD_IP:PADDLE_PORT = {me} is not in the server list {:?} (PADDLE_PSERVERS_IP_PORT_LIST)",
                job.cluster.pservers
            )
        })
}

/// Shard `index`'s endpoint (`cluster.pservers`) and its listener, bound there.
fn shard_listener(config: &JobConfig, index: usize) -> Result<(String, TcpListener)> {
    let endpoint = config.cluster.pservers.get(index).cloned().with_context(|| {
        format!("parameter server {index}: cluster.pservers (PADDLE_PSERVERS_IP_PORT_LIST) has no entry {index}")
    })?;
    let listener = TcpListener::bind(&endpoint)
        .with_context(|| format!("parameter server {index}: cannot listen on {endpoint}"))?;
    listener.set_nonblocking(true)?;
    Ok((endpoint, listener))
}

/// How far the clock of the coordinator at `master` is ahead of this process's, in µs.
async fn clock_offset_us(
    (master, credentials): &(String, Credentials),
    timeout: std::time::Duration,
    max_frame: usize,
) -> Result<f64> {
    let mut bus = ControlBus::connect(master, timeout, max_frame, credentials).await?;
    bus.clock_offset_us().await
}

/// The last trainer's leave is answered after the shard learns of it: waits (boundedly) until
/// the trainers have read their answers and hung up (`open` connections left).
async fn wait_for_hang_ups(open: &AtomicUsize) {
    let deadline = tokio::time::Instant::now() + LEAVE_GRACE;
    while open.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// A shard's process before its actor system starts: where it listens, what it recovers from,
/// how it hears rollback orders and heartbeats to the coordinator.
struct ShardStart {
    endpoint: String,
    listener: TcpListener,
    recovery: Recovery,
    order_line: Option<OrderLine>,
    orders: Option<Orders>,
    shard: Shard,
    mirror: Option<RoleMirror>,
    timeout: std::time::Duration,
    credentials: Credentials,
    heartbeats: Option<(String, Credentials)>,
    /// Held while the shard serves (sync mode's first SIGTERM).
    _watch: Option<PreemptionWatch>,
}

/// Starts `server` on an arbiter of its own, writing in the run directory and the checkpoint
/// store; recovering in place (its checkpoint files handed to
/// `acknowledge`) where the job does.
fn shard_actor(
    server: PServer,
    options: &RunOptions,
    recovery: &Recovery,
    acknowledge: Option<mpsc::UnboundedSender<WrittenCheckpoint>>,
) -> Result<Addr<PServer>> {
    let server = server.writing_in(&options.run_dir, recovery.store.as_ref().map(|store| store.root()));
    let server = match acknowledge {
        Some(acknowledge) => server.recovering_in_place(recovery.start_step().unwrap_or(0) as u64, acknowledge)?,
        None => server,
    };
    Ok(PServer::start_in_arbiter(&Arbiter::new().handle(), move |_| server))
}

/// Hosts the coordinator of `config`'s job at `master`, in server 0's process (a job without a
/// coordinator process of its own).
async fn host_job_coordinator(config: &JobConfig, (master, credentials): &(String, Credentials)) -> Result<()> {
    let coordinator = Coordinator::new(config.roles(), config.fault_tolerance.timeout()).with_names_of(config);
    let max_frame = config.cluster.max_frame_bytes();
    host_coordinator(coordinator, master, &config.fault_tolerance, max_frame, credentials)
        .await
        .context("parameter server 0")?;
    Ok(())
}
