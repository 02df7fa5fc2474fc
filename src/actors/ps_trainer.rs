//! The trainer of the parameter-server strategy: per batch it has its device actor plan the
//! pull (each id once, grouped by shard), pulls from every shard in parallel, trains, and
//! pushes the update back; at the end trainer 0 evaluates the AUC on the held-out set with the
//! shards' final values and has the shards save their tables.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use anyhow::{Context as _, Result};

use super::device::{DeviceActor, FlushCtr, PlanCtr, PredictCtr, PrepareCtr, TrainCtr};
use super::divergence::check_loss;
use super::recovery::Recovery;
use super::LOSSES_RESERVED;
use crate::checkpoint::CheckpointStore;
use crate::config::{JobConfig, PsMode};
use crate::data::ctr::{CtrLoader, CtrSource};
use crate::metrics::auc;
use crate::ps::client::PsClient;
use crate::ps::snapshot::shard_file_name;
use crate::ps::wire::{PullRequest, PulledRows, PushRequest, Reply, Request, TableStats, UpdateKind};
use crate::ps::worker::{PullPlan, ShardUpdate};
use crate::telemetry::metrics::peak_rss_bytes;
use crate::telemetry::monitor::{Monitor, MonitorSettings, StepSample};
use crate::telemetry::timeline::{Lane, Timeline, TraceTarget};

/// What a parameter-server trainer needs.
pub struct PsTrainer {
    /// This trainer's index (`PADDLE_TRAINER_ID`).
    pub rank: usize,
    /// The job.
    pub job: Arc<JobConfig>,
    /// Training data (each trainer reads its part of every global batch).
    pub train_data: CtrSource,
    /// Held-out data, evaluated by trainer 0.
    pub test_data: CtrSource,
    /// Links to the shards; taken when training starts.
    pub client: Option<PsClient>,
    /// The device actor of this trainer.
    pub device: Addr<DeviceActor>,
    /// Where trainer 0 has the shards save their tables (`ps-shard-<i>.safetensors`).
    pub save_dir: Option<PathBuf>,
    /// How to report every step: trainer 0's only.
    pub monitor: Option<MonitorSettings>,
    /// Where to write this trainer's timeline, and how far the coordinator's clock is ahead.
    pub trace: Option<(TraceTarget, f64)>,
    /// The checkpoint to start from and where trainer 0 has new ones taken.
    pub(crate) recovery: Recovery,
}

/// Runs the training loop to its end.
#[derive(Message)]
#[rtype(result = "Result<PsOutcome>")]
pub struct TrainPs;

/// What a parameter-server trainer reports.
#[derive(Debug, Clone)]
pub struct PsOutcome {
    /// The trainer.
    pub rank: usize,
    /// Steps taken.
    pub steps: usize,
    /// Loss of every step on this trainer's part of the batch.
    pub losses: Vec<f32>,
    /// Samples per second of the whole job (global batch × steps over this trainer's time).
    pub samples_per_sec: f64,
    /// Time in pulls and pushes (waiting for other trainers included) over training time.
    pub comm_time_ratio: f64,
    /// Held-out AUC (trainer 0 only).
    pub auc: Option<f64>,
    /// Held-out samples evaluated (trainer 0 only).
    pub test_samples: usize,
    /// Rows and bytes of each table over all shards, at the end (trainer 0 only).
    pub tables: Vec<TableStats>,
}

impl Actor for PsTrainer {
    type Context = Context<Self>;
}

impl Handler<TrainPs> for PsTrainer {
    type Result = ResponseFuture<Result<PsOutcome>>;

    fn handle(&mut self, _: TrainPs, _: &mut Self::Context) -> Self::Result {
        let run = PsRun {
            rank: self.rank,
            job: self.job.clone(),
            train_data: self.train_data.clone(),
            test_data: self.test_data.clone(),
            client: self.client.take(),
            device: self.device.clone(),
            save_dir: self.save_dir.clone(),
            monitor: self.monitor.clone(),
            trace: self.trace.clone(),
            recovery: self.recovery.clone(),
        };
        Box::pin(run.execute())
    }
}

struct PsRun {
    rank: usize,
    job: Arc<JobConfig>,
    train_data: CtrSource,
    test_data: CtrSource,
    client: Option<PsClient>,
    device: Addr<DeviceActor>,
    save_dir: Option<PathBuf>,
    monitor: Option<MonitorSettings>,
    trace: Option<(TraceTarget, f64)>,
    recovery: Recovery,
}

impl PsRun {
    async fn execute(mut self) -> Result<PsOutcome> {
        let rank = self.rank;
        let job = self.job.clone();
        let train = &job.train;
        let world = job.world_size();
        let mut client = self.client.take().context("TrainPs was sent twice")?;
        self.device
            .send(PrepareCtr {
                job: job.clone(),
                rank: self.rank,
            })
            .await??;
        client.wait_for_servers().await?;

        let batches_per_epoch = (self.train_data.records_per_epoch()? as usize / train.batch_size).max(1);
        let steps = train.length().steps(batches_per_epoch)?;
        let mut loader = CtrLoader::new(self.train_data.clone(), train.batch_size, rank, world)
            .with_context(|| format!("trainer {rank}: training data"))?;
        // The shards hold the state of a checkpoint; the trainers only move on to its step.
        let first = self.recovery.first_step(steps)?;
        loader.skip_batches(first)?;
        let mut monitor = self
            .monitor
            .as_ref()
            .map(|settings| Monitor::start(settings, steps, first, train.batch_size, train.log_every))
            .transpose()?;
        let mut timeline = self.trace.as_ref().map(|(t, _)| Timeline::new(t.origin.instant));
        let started = Instant::now();
        let mut losses = Vec::with_capacity(steps.min(LOSSES_RESERVED));
        let mut comm_time = Duration::ZERO;
        // Async mode pulls step t+1's rows while step t computes, as Paddle's async
        // communicator does: its trainers never wait, so slightly staler rows are within its
        // contract. Sync mode cannot (step t+1's pull waits for step t's pushes), nor can geo
        // (its plan depends on the local copies step t changes).
        let prefetch = job.strategy.ps_mode() == PsMode::Async;
        let mut prefetched = None;
        for step in first..steps {
            let step_started = Instant::now();
            let pulling = step_started;
            let pulled = match prefetched.take() {
                Some(pulled) => pulled,
                None => {
                    let batch = loader.next_batch()?;
                    let plan = self.device.send(PlanCtr { batch, training: true }).await??;
                    pull(&mut client, rank, step as u64, plan, &format!("pull of step {step}")).await?
                }
            };
            let pulled_at = Instant::now();
            let mut step_comm = pulled_at - pulling;
            if let Some(t) = &mut timeline {
                t.record_between(Lane::Communication, format!("pull {step}"), "pull", pulling, pulled_at);
            }
            let training = self.device.send(TrainCtr(pulled));
            let outcome = if prefetch && step + 1 < steps {
                let batch = loader.next_batch()?;
                let plan = self.device.send(PlanCtr { batch, training: true }).await??;
                let what = format!("pull of step {}", step + 1);
                let next = pull(&mut client, rank, step as u64 + 1, plan, &what);
                let (outcome, next) = futures::join!(training, next);
                prefetched = Some(next?);
                outcome??
            } else {
                training.await??
            };
            if let Some(t) = &mut timeline {
                t.record(format!("train {step}"), "compute", pulled_at);
            }
            if let Some(updates) = outcome.push {
                let pushing = Instant::now();
                push(
                    &mut client,
                    rank,
                    step as u64,
                    &job,
                    updates,
                    &format!("push of step {step}"),
                )
                .await?;
                step_comm += pushing.elapsed();
                if let Some(t) = &mut timeline {
                    t.record_between(
                        Lane::Communication,
                        format!("push {step}"),
                        "push",
                        pushing,
                        Instant::now(),
                    );
                }
            }
            comm_time += step_comm;
            losses.push(outcome.loss);
            if let Some(monitor) = &mut monitor {
                let sample = StepSample {
                    loss: outcome.loss,
                    // Trainers exchange no losses: the loss is trainer 0's part of the batch.
                    loss_spread: None,
                    lr: train.lr,
                    step_time: step_started.elapsed(),
                    comm_time: step_comm,
                    exposed_comm_time: step_comm,
                    bubble_fraction: None,
                    peak_rss_bytes: peak_rss_bytes(),
                };
                monitor.record(step + 1, sample)?;
            }
            check_loss(rank, step + 1, outcome.loss)?;
            if let Some(store) = self.recovery.store.as_ref().filter(|_| rank == 0) {
                if self.recovery.due(&job, step + 1, steps) {
                    checkpoint(&mut client, store, step + 1, world).await?;
                }
            }
        }
        if let Some(updates) = self.device.send(FlushCtr).await?? {
            push(&mut client, rank, steps as u64, &job, updates, "final geo push").await?;
        }
        let elapsed = started.elapsed();
        if let Some(monitor) = &monitor {
            monitor.finish();
        }
        if let (Some((trace, clock_offset_us)), Some(mut timeline)) = (&self.trace, timeline) {
            // Servers are tracks 0.., trainers after them, as they are numbered for heartbeats.
            let track = job.cluster.server_num + rank;
            trace.write(track, &format!("trainer {rank}"), *clock_offset_us, timeline.take())?;
        }
        let servers = client.server_num();
        let everyone = |request: Request| vec![request; servers];
        client
            .call_all(everyone(Request::EndTraining { trainer: rank }), "end of training")
            .await?;

        let (auc, test_samples, tables) = if rank == 0 {
            let (auc, test_samples) = self.evaluate(&mut client, steps as u64).await?;
            let tables = table_stats(&mut client).await?;
            if let Some(dir) = &self.save_dir {
                std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
                let saves = (0..client.server_num())
                    .map(|shard| Request::Save {
                        path: dir.join(shard_file_name(shard)).display().to_string(),
                    })
                    .collect();
                client.call_all(saves, "save of the tables").await?;
            }
            (auc, test_samples, tables)
        } else {
            (None, 0, Vec::new())
        };
        client
            .call_all(everyone(Request::Leave { trainer: rank }), "leave")
            .await?;
        Ok(PsOutcome {
            rank,
            steps,
            losses,
            samples_per_sec: ((steps - first) * train.batch_size) as f64 / elapsed.as_secs_f64().max(1e-9),
            comm_time_ratio: comm_time.as_secs_f64() / elapsed.as_secs_f64().max(1e-9),
            auc,
            test_samples,
            tables,
        })
    }

    /// AUC of the shards' final values on the held-out set (once every trainer has ended).
    async fn evaluate(&self, client: &mut PsClient, version: u64) -> Result<(Option<f64>, usize)> {
        let mut loader = CtrLoader::new(self.test_data.clone(), self.job.train.batch_size, 0, 1)
            .context("trainer 0: held-out data")?;
        let (mut scores, mut labels) = (Vec::new(), Vec::new());
        while let Some(batch) = loader.next_eval_batch()? {
            labels.extend_from_slice(&batch.labels);
            let plan = self.device.send(PlanCtr { batch, training: false }).await??;
            let pulled = pull_rows(client, self.rank, version, true, plan, "pull for evaluation").await?;
            scores.extend(self.device.send(PredictCtr(pulled)).await??);
        }
        Ok((auc(&scores, &labels), scores.len()))
    }
}

/// Each table's rows and bytes, summed over the shards.
async fn table_stats(client: &mut PsClient) -> Result<Vec<TableStats>> {
    let replies = client
        .call_all(vec![Request::Stats; client.server_num()], "table statistics")
        .await?;
    let mut total: Vec<TableStats> = Vec::new();
    for reply in replies {
        let Reply::Stats(tables) = reply else {
            anyhow::bail!("a parameter server answered the statistics request with something else");
        };
        total.resize(tables.len().max(total.len()), TableStats::default());
        for (sum, table) in total.iter_mut().zip(tables) {
            sum.rows += table.rows;
            sum.bytes += table.bytes;
        }
    }
    Ok(total)
}

/// Pulls `plan` from every shard at once, for training.
async fn pull(
    client: &mut PsClient,
    trainer: usize,
    version: u64,
    plan: PullPlan,
    what: &str,
) -> Result<Vec<PulledRows>> {
    pull_rows(client, trainer, version, false, plan, what).await
}

/// Pulls `plan` from every shard at once; with `after_training`, once every trainer has ended.
async fn pull_rows(
    client: &mut PsClient,
    trainer: usize,
    version: u64,
    after_training: bool,
    plan: PullPlan,
    what: &str,
) -> Result<Vec<PulledRows>> {
    let requests = plan
        .ids
        .into_iter()
        .map(|ids| {
            Request::Pull(PullRequest {
                trainer,
                version,
                after_training,
                ids,
                dense: plan.dense,
            })
        })
        .collect();
    client
        .call_all(requests, what)
        .await?
        .into_iter()
        .enumerate()
        .map(|(shard, reply)| match reply {
            Reply::Rows(rows) => Ok(rows),
            _ => anyhow::bail!("parameter server {shard} answered the {what} without rows"),
        })
        .collect()
}

/// Pushes each shard its part of an update.
async fn push(
    client: &mut PsClient,
    trainer: usize,
    step: u64,
    job: &JobConfig,
    updates: Vec<ShardUpdate>,
    what: &str,
) -> Result<()> {
    let kind = match job.strategy.ps_mode() {
        PsMode::Geo { .. } => UpdateKind::Deltas,
        _ => UpdateKind::Gradients,
    };
    let requests = updates
        .into_iter()
        .map(|update| {
            Request::Push(PushRequest {
                trainer,
                step,
                kind,
                ids: update.ids,
                values: update.values,
                dense: update.dense,
            })
        })
        .collect();
    client.call_all(requests, what).await.map(drop)
}

/// Has every shard write its part of step `step`'s checkpoint (each once it has applied that
/// step: every trainer pushed it), then commits the checkpoint: in sync mode the trainers hold
/// nothing a restart needs besides the step.
async fn checkpoint(client: &mut PsClient, store: &CheckpointStore, step: usize, trainers: usize) -> Result<()> {
    let servers = client.server_num();
    let dir = store.root().display().to_string();
    let orders = vec![Request::Checkpoint { dir, step: step as u64 }; servers];
    let mut files = Vec::with_capacity(servers);
    for reply in client.call_all(orders, &format!("checkpoint of step {step}")).await? {
        match reply {
            Reply::Checkpointed(record) => files.push(record),
            other => anyhow::bail!("a shard answered a checkpoint order with {other:?}"),
        }
    }
    store.commit(step, trainers + servers, files)
}
