//! The stage actor: one rank of a pipeline job — stage `s` of pipeline replica `d`. It has its
//! device actor build the stage, feeds it the replica's part of every global batch (the stage
//! cuts it into micro-batches), evaluates through the pipeline at the end, and reports. A
//! launched job's ranks send their [`StageOutcome`]s to rank 0 as bytes
//! ([`StageOutcome::to_bytes`]), since rank 0 writes the outputs of every stage.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use anyhow::{ensure, Context as _, Result};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::device::{
    DeviceActor, ModelFactory, PipelineEvaluate, PipelineStep, PreparePipeline, ReadParameters, RestoreCheckpoint,
    SaveCheckpoint, StageLinks, TakeSpans,
};
use super::divergence::check_loss;
use super::recovery::Recovery;
use crate::config::JobConfig;
use crate::data::{Dataset, ShardedLoader};
use crate::engines::comm::Communicator;
use crate::net::frame::{encode_with, Frame};
use crate::net::ControlBus;
use crate::telemetry::monitor::{Monitor, MonitorSettings, StepSample};
use crate::telemetry::timeline::TraceTarget;

/// What a pipeline rank needs.
pub struct StageActor {
    /// Global rank: `replica × pp_degree + stage`.
    pub rank: usize,
    /// The job.
    pub job: Arc<JobConfig>,
    /// The model's constructor.
    pub model: ModelFactory,
    /// Training split (each replica reads its part of every global batch).
    pub train_data: Arc<Dataset>,
    /// Held-out split (each replica evaluates a contiguous part).
    pub test_data: Arc<Dataset>,
    /// Links to the neighbouring stages; taken at start.
    pub link: Option<StageLinks>,
    /// The ring among this stage's replicas; taken at start.
    pub data_parallel: Option<Communicator>,
    /// The device actor of this rank.
    pub device: Addr<DeviceActor>,
    /// How to report every step: the reporting rank's only.
    pub monitor: Option<MonitorSettings>,
    /// Where to write this rank's timeline, when tracing.
    pub trace: Option<TraceTarget>,
    /// The line to the coordinator, for checkpoints; taken at start.
    pub bus: Option<ControlBus>,
    /// The checkpoint to start from and where to write new ones.
    pub(crate) recovery: Recovery,
}

/// The checkpoint file of stage `stage`, written by its rank in replica 0 (replicas are equal).
fn stage_file(stage: usize) -> String {
    format!("stage-{stage}.safetensors")
}

/// Runs the pipeline training loop to its end.
#[derive(Message)]
#[rtype(result = "Result<StageOutcome>")]
pub struct TrainStage;

/// What a pipeline rank reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StageOutcome {
    /// Global rank.
    pub rank: usize,
    /// Steps taken.
    pub steps: usize,
    /// Global mean loss of every step (ranks holding the last virtual stage).
    pub losses: Vec<f32>,
    /// Held-out (correct, total) summed over replicas (ranks holding the last virtual stage).
    pub evaluated: Option<(usize, usize)>,
    /// Global samples per second.
    pub samples_per_sec: f64,
    /// Data-parallel all-reduce time over step time.
    pub allreduce_ratio: f64,
    /// Time waiting for the data-parallel all-reduce after the schedule over step time: the
    /// share the backward did not hide.
    pub exposed_allreduce_ratio: f64,
    /// Most micro-batch activations this stage held at once.
    pub peak_activations: usize,
    /// Most bytes of activations this stage held for backward at once.
    pub peak_activation_bytes: usize,
    /// Time waiting for neighbours over the time of the schedules: the stage's bubble as a
    /// share of the pipeline's step.
    pub bubble_fraction: f64,
    /// The stage's final parameters by name (as bytes, they travel apart from the serialized
    /// rest: see [`StageOutcome::to_bytes`]).
    #[serde(skip)]
    pub parameters: Vec<(String, Vec<f32>)>,
}

/// The serialized part of an encoded [`StageOutcome`]: the figures (the parameters are skipped),
/// and each parameter's name and length; the values follow as raw f32 bytes.
type EncodedHeader = (StageOutcome, Vec<(String, u64)>);

impl StageOutcome {
    /// Encodes the outcome as a frame body: the figures and parameter names serialized, the
    /// parameter values as raw f32 bytes, never through the serializer.
    pub fn to_bytes(&self) -> Result<Bytes> {
        let lengths: Vec<(&str, u64)> = self
            .parameters
            .iter()
            .map(|(name, values)| (name.as_str(), values.len() as u64))
            .collect();
        let header = (self, lengths);
        let payload_len = self.parameters.iter().map(|(_, v)| v.len() * 4).sum();
        encode_with(&header, payload_len, |out| {
            for (_, values) in &self.parameters {
                out.extend_from_slice(bytemuck::cast_slice(values));
            }
        })
    }

    /// Decodes what [`StageOutcome::to_bytes`] encoded, checking every length against the bytes
    /// that arrived.
    pub fn from_bytes(bytes: Bytes) -> Result<Self> {
        let frame = Frame::<EncodedHeader>::decode(bytes).context("decoding a stage outcome")?;
        let (mut outcome, lengths) = frame.header;
        let expected = lengths
            .iter()
            .try_fold(0u64, |sum, (_, n)| sum.checked_add(n.checked_mul(4)?));
        ensure!(
            expected == Some(frame.payload.len() as u64),
            "rank {}: its stage outcome lists parameters that do not fill the {} bytes that arrived",
            outcome.rank,
            frame.payload.len()
        );
        let mut offset = 0;
        for (name, n) in lengths {
            let end = offset + n as usize * 4;
            outcome
                .parameters
                .push((name, bytemuck::pod_collect_to_vec(&frame.payload[offset..end])));
            offset = end;
        }
        Ok(outcome)
    }
}

impl Actor for StageActor {
    type Context = Context<Self>;
}

impl Handler<TrainStage> for StageActor {
    type Result = ResponseFuture<Result<StageOutcome>>;

    fn handle(&mut self, _: TrainStage, _: &mut Self::Context) -> Self::Result {
        let job = self.job.clone();
        let rank = self.rank;
        let (p, d) = (
            job.strategy.hybrid_configs.pp_degree,
            job.strategy.hybrid_configs.dp_degree,
        );
        let (replica, stage) = (rank / p, rank % p);
        let device = self.device.clone();
        let model = self.model.clone();
        let (train_data, test_data) = (self.train_data.clone(), self.test_data.clone());
        let link = self.link.take();
        let data_parallel = self.data_parallel.take();
        let monitor_settings = self.monitor.clone();
        let trace = self.trace.clone();
        let mut bus = self.bus.take();
        let recovery = self.recovery.clone();
        Box::pin(async move {
            let clock_offset_us = match (&trace, bus.as_mut()) {
                (Some(_), Some(bus)) => bus.clock_offset_us().await?,
                _ => 0.0,
            };
            device
                .send(PreparePipeline {
                    job: job.clone(),
                    model,
                    rank,
                    stage,
                    link: link.context("TrainStage was sent twice")?,
                    data_parallel: data_parallel.context("TrainStage was sent twice")?,
                    trace_from: trace.as_ref().map(|t| t.origin.instant),
                })
                .await??;
            let train = &job.train;
            let mut loader = ShardedLoader::new(train_data, train.batch_size, replica, d, train.seed)
                .with_context(|| format!("train.batch_size = {}", train.batch_size))?;
            let steps = train.length().steps(loader.batches_per_epoch())?;
            crate::optim::check_run_length(&job.strategy, steps)?;
            let first = recovery.first_step(steps)?;
            let mut losses = Vec::new();
            if let Some(checkpoint) = &recovery.start {
                // Every replica of a stage continues from replica 0's state of it, and the
                // stage holding the loss from replica 0's losses.
                let restored = RestoreCheckpoint(Arc::new(checkpoint.read(&stage_file(stage))?));
                losses = device.send(restored).await??;
            }
            let mut monitor = monitor_settings
                .as_ref()
                .map(|settings| Monitor::start(settings, steps, first, train.batch_size, train.log_every))
                .transpose()?;
            let started = Instant::now();
            let (mut step_time, mut allreduce, mut exposed) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
            let (mut peak, mut peak_bytes) = (0, 0);
            let (mut pipeline_wait, mut pipeline_time) = (Duration::ZERO, Duration::ZERO);
            for step in first..steps {
                let report = device
                    .send(PipelineStep(loader.batch(step)))
                    .await?
                    .with_context(|| format!("step {step}"))?;
                step_time += report.step_time;
                allreduce += report.allreduce_time;
                exposed += report.exposed_allreduce_time;
                peak = peak.max(report.peak_activations);
                peak_bytes = peak_bytes.max(report.peak_activation_bytes);
                pipeline_wait += report.pipeline_wait;
                pipeline_time += report.pipeline_time;
                if let Some(loss) = report.loss {
                    losses.push(loss);
                    if let Some(monitor) = &mut monitor {
                        let sample = StepSample {
                            loss,
                            loss_spread: report.loss_spread,
                            lr: report.lr,
                            step_time: report.step_time,
                            comm_time: report.allreduce_time,
                            exposed_comm_time: report.exposed_allreduce_time,
                            bubble_fraction: Some(
                                report.pipeline_wait.as_secs_f64() / report.pipeline_time.as_secs_f64().max(1e-9),
                            ),
                            peak_rss_bytes: report.peak_rss_bytes,
                        };
                        monitor.record(step + 1, sample)?;
                    }
                    check_loss(rank, step + 1, loss)?;
                }
                if let Some(store) = recovery.store.as_ref().filter(|_| recovery.due(&job, step + 1, steps)) {
                    let written = if replica == 0 {
                        let save = SaveCheckpoint {
                            store: store.clone(),
                            step: step + 1,
                            file: stage_file(stage),
                            losses: losses.clone(),
                        };
                        vec![device.send(save).await??]
                    } else {
                        Vec::new()
                    };
                    let bus = bus
                        .as_mut()
                        .context("a checkpointing stage needs a line to the coordinator")?;
                    bus.acknowledge(rank, step + 1, written).await?;
                }
            }
            let elapsed = started.elapsed();
            if let Some(monitor) = &monitor {
                monitor.finish();
            }
            // The held-out set is cut like a global batch: whole micro-batches per replica.
            let m = job.strategy.pipeline_configs.accumulate_steps;
            let per_replica = test_data.len() / (d * m) * m;
            let rows: Vec<usize> = (replica * per_replica..(replica + 1) * per_replica).collect();
            let evaluated = device.send(PipelineEvaluate(test_data.select(&rows))).await??;
            let parameters = device.send(ReadParameters).await??;
            if let Some(trace) = &trace {
                let spans = device.send(TakeSpans).await??;
                let role = format!("stage {stage} (replica {replica})");
                trace.write(rank, &role, clock_offset_us, spans)?;
            }
            Ok(StageOutcome {
                rank,
                steps,
                losses,
                evaluated,
                samples_per_sec: ((steps - first) * train.batch_size) as f64 / elapsed.as_secs_f64().max(1e-9),
                allreduce_ratio: allreduce.as_secs_f64() / step_time.as_secs_f64().max(1e-9),
                exposed_allreduce_ratio: exposed.as_secs_f64() / step_time.as_secs_f64().max(1e-9),
                peak_activations: peak,
                peak_activation_bytes: peak_bytes,
                bubble_fraction: pipeline_wait.as_secs_f64() / pipeline_time.as_secs_f64().max(1e-9),
                parameters,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_survive_their_bytes_and_short_ones_are_refused() {
        let outcome = StageOutcome {
            rank: 1,
            steps: 3,
            losses: vec![2.5, f32::NAN, 0.25],
            evaluated: Some((7, 9)),
            samples_per_sec: 12.5,
            allreduce_ratio: 0.125,
            exposed_allreduce_ratio: 0.0625,
            peak_activations: 4,
            peak_activation_bytes: 4096,
            bubble_fraction: 0.5,
            parameters: vec![("fc0.weight".into(), vec![1.0, -2.0, 3.5]), ("fc0.bias".into(), vec![])],
        };
        let bytes = outcome.to_bytes().unwrap();
        let back = StageOutcome::from_bytes(bytes.clone()).unwrap();
        assert_eq!(back.parameters, outcome.parameters);
        assert_eq!((back.rank, back.steps, back.evaluated), (1, 3, Some((7, 9))));
        assert_eq!(format!("{:?}", back.losses), format!("{:?}", outcome.losses));
        assert_eq!(back.peak_activation_bytes, 4096);

        let err = StageOutcome::from_bytes(bytes.slice(..bytes.len() - 4)).unwrap_err();
        assert!(err.to_string().contains("rank 1"), "{err}");
        assert!(StageOutcome::from_bytes(Bytes::from_static(&[9, 0, 0, 0, 1])).is_err());
    }
}
