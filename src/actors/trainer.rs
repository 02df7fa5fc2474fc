//! The trainer: one rank's training loop. It joins the rendezvous, has its
//! device actor build the replica, feeds it this rank's batches, checks
//! replica agreement every `strategy.check_every` steps, evaluates, and
//! waits at the final barrier so no rank leaves while others still need it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use anyhow::{Context as _, Result};

use super::checkpointing;
use super::device::{
    CheckReplicas, DeviceActor, Evaluate, ModelFactory, Prepare, ReadParameters, RestoreCheckpoint, RingLink,
    SaveCheckpoint, TakeSpans, TrainStep,
};
use super::divergence::check_loss;
use super::recovery::Recovery;
use super::LOSSES_RESERVED;
use crate::collective::ParamChecksum;
use crate::config::JobConfig;
use crate::data::{Dataset, ShardedLoader};
use crate::net::ControlBus;
use crate::telemetry::monitor::{Monitor, MonitorSettings, StepSample};
use crate::telemetry::timeline::TraceTarget;

/// What a rank needs to train.
pub struct Trainer {
    /// This rank.
    pub rank: usize,
    /// The job.
    pub job: Arc<JobConfig>,
    /// The model's constructor.
    pub model: ModelFactory,
    /// Training split (each rank reads its shard of every global batch).
    pub train_data: Arc<Dataset>,
    /// Held-out split (each rank evaluates a contiguous part).
    pub test_data: Arc<Dataset>,
    /// The line to the coordinator; taken when training starts.
    pub bus: Option<ControlBus>,
    /// The ring link; handed to the device actor at start.
    pub link: Option<RingLink>,
    /// This rank's data endpoint, announced at rendezvous.
    pub data_endpoint: String,
    /// The device actor of this rank.
    pub device: Addr<DeviceActor>,
    /// How to report every step: the reporting rank's only.
    pub monitor: Option<MonitorSettings>,
    /// Where to write this rank's timeline, when tracing.
    pub trace: Option<TraceTarget>,
    /// The checkpoint to start from and where to write new ones.
    pub(crate) recovery: Recovery,
}

/// The file a data-parallel job's checkpoint holds: rank 0's replica (all replicas are equal).
const REPLICA_FILE: &str = "replica.safetensors";

/// Runs the training loop to its end.
#[derive(Message)]
#[rtype(result = "Result<RankOutcome>")]
pub struct Train;

/// What a rank reports when training ends.
#[derive(Debug, Clone)]
pub struct RankOutcome {
    /// The rank.
    pub rank: usize,
    /// Optimizer steps taken.
    pub steps: usize,
    /// Global mean loss of the last step.
    pub final_loss: f32,
    /// Accuracy on the held-out split (all ranks' shards).
    pub test_accuracy: f64,
    /// Global samples per second over the training loop.
    pub samples_per_sec: f64,
    /// Communication time over step time.
    pub comm_time_ratio: f64,
    /// Communication not hidden behind backward, over step time.
    pub exposed_comm_ratio: f64,
    /// Checksum of the final parameters.
    pub param_checksum: ParamChecksum,
    /// Final parameters by name.
    pub parameters: Vec<(String, Vec<f32>)>,
    /// Global mean loss of every step.
    pub losses: Vec<f32>,
}

impl Actor for Trainer {
    type Context = Context<Self>;
}

impl Handler<Train> for Trainer {
    type Result = ResponseFuture<Result<RankOutcome>>;

    fn handle(&mut self, _: Train, _: &mut Self::Context) -> Self::Result {
        let run = TrainingRun {
            rank: self.rank,
            job: self.job.clone(),
            model: self.model.clone(),
            train_data: self.train_data.clone(),
            test_data: self.test_data.clone(),
            bus: self.bus.take(),
            link: self.link.take(),
            data_endpoint: self.data_endpoint.clone(),
            device: self.device.clone(),
            monitor: self.monitor.clone(),
            trace: self.trace.clone(),
            recovery: self.recovery.clone(),
        };
        Box::pin(run.execute())
    }
}

struct TrainingRun {
    rank: usize,
    job: Arc<JobConfig>,
    model: ModelFactory,
    train_data: Arc<Dataset>,
    test_data: Arc<Dataset>,
    bus: Option<ControlBus>,
    link: Option<RingLink>,
    data_endpoint: String,
    device: Addr<DeviceActor>,
    monitor: Option<MonitorSettings>,
    trace: Option<TraceTarget>,
    recovery: Recovery,
}

impl TrainingRun {
    async fn execute(self) -> Result<RankOutcome> {
        let rank = self.rank;
        let job = self.job.clone();
        let world = job.world_size();
        let mut bus = self.bus.context("Train was sent twice")?;
        let link = self.link.context("Train was sent twice")?;
        let roster = bus.join(rank, world, self.data_endpoint.clone()).await?;
        let clock_offset_us = match &self.trace {
            Some(_) => bus.clock_offset_us().await?,
            None => 0.0,
        };
        self.device
            .send(Prepare {
                job: job.clone(),
                model: self.model.clone(),
                link,
                roster,
                trace_from: self.trace.as_ref().map(|t| t.origin.instant),
            })
            .await??;

        let train = &job.train;
        let mut loader = ShardedLoader::new(self.train_data.clone(), train.batch_size, rank, world, train.seed)
            .with_context(|| format!("train.batch_size = {}", train.batch_size))?;
        let steps = train.length().steps(loader.batches_per_epoch())?;
        crate::optim::check_run_length(&job.strategy, steps)?;
        let first = self.recovery.first_step(steps)?;
        let mut losses = Vec::with_capacity(steps.min(LOSSES_RESERVED));
        if let Some(checkpoint) = &self.recovery.start {
            let restored = RestoreCheckpoint(checkpoint.read(REPLICA_FILE)?);
            losses = self.device.send(restored).await??;
        }
        let mut monitor = self
            .monitor
            .as_ref()
            .map(|settings| Monitor::start(settings, steps, first, train.batch_size, train.log_every))
            .transpose()?;
        let started = Instant::now();
        let (mut step_time, mut comm_time, mut exposed) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let check_every = job.strategy.check_every;
        for step in first..steps {
            let report = self.device.send(TrainStep(loader.batch(step))).await??;
            step_time += report.step_time;
            comm_time += report.comm_time;
            exposed += report.exposed_comm_time;
            losses.push(report.loss);
            if let Some(monitor) = &mut monitor {
                let sample = StepSample {
                    loss: report.loss,
                    loss_spread: Some(report.loss_spread),
                    lr: report.lr,
                    step_time: report.step_time,
                    comm_time: report.comm_time,
                    exposed_comm_time: report.exposed_comm_time,
                    bubble_fraction: None,
                    peak_rss_bytes: report.peak_rss_bytes,
                };
                monitor.record(step + 1, sample)?;
            }
            check_loss(rank, step + 1, report.loss)?;
            if check_every > 0 && (step + 1) % check_every == 0 {
                self.device.send(CheckReplicas).await??;
            }
            if let Some(store) = self
                .recovery
                .store
                .as_ref()
                .filter(|_| self.recovery.due(&job, step + 1, steps))
            {
                let written = if rank == 0 {
                    let save = SaveCheckpoint {
                        store: store.clone(),
                        step: step + 1,
                        file: REPLICA_FILE.to_string(),
                        losses: losses.clone(),
                    };
                    vec![self.device.send(save).await??]
                } else {
                    Vec::new()
                };
                checkpointing::acknowledge(&mut bus, rank, world, store, step + 1, &written).await?;
            }
        }
        let elapsed = started.elapsed();
        if let Some(monitor) = &monitor {
            monitor.finish();
        }
        if let Some(trace) = &self.trace {
            let spans = self.device.send(TakeSpans).await??;
            trace.write(rank, "trainer", clock_offset_us, spans)?;
        }

        let param_checksum = self.device.send(CheckReplicas).await??;
        let test_rows = self.test_data.len();
        let shard: Vec<usize> = (rank * test_rows / world..(rank + 1) * test_rows / world).collect();
        let (correct, total) = self.device.send(Evaluate(self.test_data.select(&shard))).await??;
        let parameters = self.device.send(ReadParameters).await??;
        bus.barrier(rank, "end of training").await?;
        let ratio = |d: Duration| {
            if step_time.is_zero() {
                0.0
            } else {
                d.as_secs_f64() / step_time.as_secs_f64()
            }
        };
        Ok(RankOutcome {
            rank,
            steps,
            final_loss: losses.last().copied().unwrap_or(f32::NAN),
            test_accuracy: if total == 0 { 0.0 } else { correct as f64 / total as f64 },
            samples_per_sec: ((steps - first) * train.batch_size) as f64 / elapsed.as_secs_f64().max(1e-9),
            comm_time_ratio: ratio(comm_time),
            exposed_comm_ratio: ratio(exposed),
            param_checksum,
            parameters,
            losses,
        })
    }
}
