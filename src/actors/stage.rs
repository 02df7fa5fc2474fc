//! The stage actor: one rank of a pipeline job — stage `s` of pipeline replica `d`. It has its
//! device actor build the stage, feeds it the replica's part of every global batch (the stage
//! cuts it into micro-batches), evaluates through the pipeline at the end, and reports. A
//! launched job's ranks send their [`StageOutcome`]s to rank 0 as bytes
//! ([`StageOutcome::to_bytes`]), since rank 0 writes the outputs of every stage.
//!
//! In a job that recovers in place, a failure the coordinator explains with a rollback order
//! (another rank was lost) does not end the stage: it joins the next generation over new stage
//! and data-parallel rings, restores its stage's committed state — from memory, its node's disk,
//! or a replica of its stage — and trains on from there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use anyhow::{ensure, Context as _, Result};
use bytes::Bytes;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use super::buddy::Buddy;
use super::device::{
    DeviceActor, ModelFactory, PipelineEvaluate, PipelineStep, PreparePipeline, ReadParameters, RelinkStage,
    SaveCheckpoint, Snapshot, StageLinks, TakeSpans,
};
use super::divergence::check_loss;
use super::faults::RoleFaults;
use super::kept::{commit_on_this_node, BuddyCopy, Kept, Restore};
use super::recovery::{stage_file, Recovery, StopAtCheckpoint};
use super::rollback::Orders;
use super::run_loop::{eval_due, run_steps, RunLoop};
use crate::checkpoint::HeldFile;
use crate::collective::preemption::is_preemption;
use crate::collective::training_state::RunRecord;
use crate::config::{HybridConfigs, JobConfig};
use crate::data::RowSource;
use crate::engines::comm::Communicator;
use crate::models::export::ModelInfo;
use crate::models::Score;
use crate::net::frame::{encode_with, Frame};
use crate::net::protocol::Roster;
use crate::net::ControlBus;
use crate::telemetry::monitor::{MonitorSettings, StepSample};
use crate::telemetry::timeline::TraceTarget;

/// What a pipeline rank needs.
pub struct StageActor {
    /// Global rank: `replica × pp_degree + stage`.
    pub rank: usize,
    /// The job.
    pub job: Arc<JobConfig>,
    /// The model's constructor.
    pub model: ModelFactory,
    /// What the model's files say besides its parameters.
    pub export: ModelInfo,
    /// Training split (each replica reads its part of every global batch).
    pub train_data: RowSource,
    /// Held-out split (each replica evaluates a contiguous part).
    pub test_data: RowSource,
    /// The first generation's links and roster; taken at start.
    pub generation: Option<StageGeneration>,
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
    /// How this rank rolls back in place; `None` when a lost rank stops the job.
    pub in_place: Option<StageInPlace>,
    /// The faults planned for this rank of a simulated cluster: its training runs under their
    /// switch.
    pub faults: Option<Arc<RoleFaults>>,
}

/// The links of one generation of a pipeline rank.
pub struct StageGeneration {
    /// The coordinator's roster, when the ranks joined one (a launched job).
    pub roster: Option<Roster>,
    /// Links to the neighbouring stages.
    pub link: StageLinks,
    /// The ring among this stage's replicas.
    pub data_parallel: Communicator,
}

/// Joins the next generation over the rank's line to the coordinator: a new data endpoint, the
/// new roster, the stage's rings connected again.
pub type Rejoin = Box<dyn for<'a> FnMut(&'a mut ControlBus) -> BoxFuture<'a, Result<StageGeneration>> + Send>;

/// What a pipeline rank needs to roll back inside its process.
pub struct StageInPlace {
    /// The coordinator's rollback orders.
    pub orders: Orders,
    /// How it joins the next generation.
    pub rejoin: Rejoin,
    /// Where it keeps a copy of its stage when no other node does (`None`: nowhere).
    pub buddy: Option<Buddy>,
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
    /// The held-out score summed over replicas (ranks holding the last virtual stage).
    pub evaluated: Option<Score>,
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
        let (replica, stage) = self.job.strategy.hybrid_configs.place_of(self.rank);
        let run = StageRun {
            rank: self.rank,
            replica,
            stage,
            job: self.job.clone(),
            model: self.model.clone(),
            export: self.export.clone(),
            train_data: self.train_data.clone(),
            test_data: self.test_data.clone(),
            device: self.device.clone(),
            monitor: self.monitor.clone(),
            trace: self.trace.clone(),
            bus: self.bus.take(),
            recovery: self.recovery.clone(),
            in_place: self.in_place.take(),
            faults: self.faults.clone(),
            kept: Kept::default(),
            roster: None,
        };
        let generation = self.generation.take();
        let faults = self.faults.clone();
        Box::pin(async move {
            let generation = generation.context("TrainStage was sent twice")?;
            RoleFaults::govern(faults, run.execute(generation)).await
        })
    }
}

struct StageRun {
    rank: usize,
    replica: usize,
    stage: usize,
    job: Arc<JobConfig>,
    model: ModelFactory,
    export: ModelInfo,
    train_data: RowSource,
    test_data: RowSource,
    device: Addr<DeviceActor>,
    monitor: Option<MonitorSettings>,
    trace: Option<TraceTarget>,
    bus: Option<ControlBus>,
    recovery: Recovery,
    in_place: Option<StageInPlace>,
    faults: Option<Arc<RoleFaults>>,
    kept: Kept,
    /// The roster of the generation training (a launched job's).
    roster: Option<Roster>,
}

/// What one generation's steps measured.
#[derive(Default)]
struct StageFigures {
    first: usize,
    elapsed: Duration,
    step_time: Duration,
    allreduce: Duration,
    exposed: Duration,
    peak: usize,
    peak_bytes: usize,
    pipeline_wait: Duration,
    pipeline_time: Duration,
}

impl StageRun {
    async fn execute(mut self, generation: StageGeneration) -> Result<StageOutcome> {
        let job = self.job.clone();
        let rank = self.rank;
        let clock_offset_us = match (&self.trace, self.bus.as_mut()) {
            (Some(_), Some(bus)) => bus.clock_offset_us().await?,
            _ => 0.0,
        };
        let StageGeneration {
            roster,
            link,
            data_parallel,
        } = generation;
        if let Some(roster) = &roster {
            self.recovery.check_joined(roster)?;
        }
        self.device
            .send(PreparePipeline {
                job: job.clone(),
                model: self.model.clone(),
                export: self.export.clone(),
                rank,
                stage: self.stage,
                link,
                data_parallel,
                steps: run_steps(&job, &self.train_data)?,
                trace_from: self.trace.as_ref().map(|t| t.origin.instant),
            })
            .await??;
        let mut first = match &roster {
            Some(roster) => roster.resume_step.unwrap_or(0),
            None => self.recovery.start_step().unwrap_or(0),
        };
        if let (Some(in_place), Some(roster)) = (&self.in_place, &roster) {
            in_place.orders.joined(roster);
        }
        self.roster = roster;
        let mut run = RunLoop::start(
            &job,
            &self.train_data,
            self.replica_place(),
            &self.recovery,
            first,
            self.monitor.as_ref(),
            clock_offset_us,
        )?;
        // Each pass is one generation; a new one starts only on a rollback order to a newer
        // generation, so the passes are bounded by the ranks the job loses.
        loop {
            let failure = match self.train_generation(first, &mut run).await {
                Ok(outcome) => {
                    run.finish();
                    return Ok(outcome);
                }
                // Every rank stopped after the same step: nothing to recover.
                Err(e) if is_preemption(&e) => return Err(e),
                Err(e) => e,
            };
            first = self.roll_back(failure).await?;
        }
    }

    /// After `failure`: the coordinator's rollback order that explains it, and the next
    /// generation joined; returns the step it resumes after. Without an order, `failure` stands.
    async fn roll_back(&mut self, mut failure: anyhow::Error) -> Result<usize> {
        loop {
            let Some(in_place) = self.in_place.as_mut() else {
                return Err(failure);
            };
            in_place.orders.explain(failure).await?;
            let bus = self
                .bus
                .as_mut()
                .context("a stage rolling back needs a line to the coordinator")?;
            match (in_place.rejoin)(bus).await {
                Ok(generation) => {
                    let roster = generation.roster.context("a rejoined generation has a roster")?;
                    in_place.orders.joined(&roster);
                    self.device
                        .send(RelinkStage {
                            stage: self.stage,
                            link: generation.link,
                            data_parallel: generation.data_parallel,
                        })
                        .await??;
                    tracing::info!(
                        rank = self.rank,
                        generation = roster.generation,
                        resume_step = roster.resume_step.unwrap_or(0),
                        "rejoined"
                    );
                    let first = roster.resume_step.unwrap_or(0);
                    self.roster = Some(roster);
                    return Ok(first);
                }
                Err(e) => failure = e,
            }
        }
    }

    /// Trains from the state after step `first` to the end of the run and evaluates.
    async fn train_generation(&mut self, first: usize, run: &mut RunLoop) -> Result<StageOutcome> {
        let job = self.job.clone();
        let (rank, stage) = (self.rank, self.stage);
        // This generation's part of every global batch (another one when membership changed).
        let (replica, d) = self.replica_place();
        run.loader.place(replica, d)?;
        let steps = run.steps;
        let restored = self.restore(first).await?;
        run.resume_data(rank, first, restored.data.as_ref());
        let mut losses = restored.losses;
        let mut figures = StageFigures {
            first,
            ..StageFigures::default()
        };
        let loss_kind = job.train.resolved_loss()?;
        // Every held-out row is scored: each replica takes its share, in pieces of any size.
        let test_data = self.test_data.clone();
        let piece_rows = job.eval_batch_rows();
        let test_share = || test_data.share(replica, d, piece_rows);
        // The newest held-out score (on the stage holding the model's output), and the steps it
        // came after.
        let mut scored: Option<(usize, Option<Score>)> = None;
        let started = Instant::now();
        // SIGTERM asks the run to stop at a checkpoint rather than ending the process.
        let mut stop = StopAtCheckpoint::new(true)?;
        for step in first..steps {
            if let Some(faults) = &self.faults {
                faults.before_step(&format!("rank {rank}"), step).await;
            }
            let report = self
                .device
                .send(PipelineStep(run.loader.batch(step)?))
                .await?
                .with_context(|| format!("step {step}"))?;
            figures.step_time += report.step_time;
            figures.allreduce += report.allreduce_time;
            figures.exposed += report.exposed_allreduce_time;
            figures.peak = figures.peak.max(report.peak_activations);
            figures.peak_bytes = figures.peak_bytes.max(report.peak_activation_bytes);
            figures.pipeline_wait += report.pipeline_wait;
            figures.pipeline_time += report.pipeline_time;
            let mut eval = None;
            if eval_due(&job, step + 1, steps) {
                let score = self.device.send(PipelineEvaluate(test_share()?)).await??;
                scored = Some((step + 1, score));
                eval = score.map(|score| score.held_out(loss_kind));
            }
            if let Some(loss) = report.loss {
                losses.push(loss);
                if let Some(monitor) = &mut run.monitor {
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
                        sparse_tables: None,
                        eval,
                    };
                    monitor.record(step + 1, sample)?;
                }
                check_loss(rank, step + 1, loss)?;
            }
            // Every rank learns in the same step that one was asked to stop.
            let next = stop.after(report.stop_asked, &job, &self.recovery, step + 1, steps);
            if next.checkpoint {
                let data = run.data_position(&self.device, step + 1).await?;
                let record = RunRecord {
                    losses: losses.clone(),
                    data,
                };
                self.checkpoint(step + 1, record).await?;
            }
            if let Some(preempted) = next.stop {
                return Err(preempted.into());
            }
        }
        figures.elapsed = started.elapsed();
        let evaluated = match scored {
            Some((done, score)) if done == steps => score,
            _ => self.device.send(PipelineEvaluate(test_share()?)).await??,
        };
        let parameters = self.device.send(ReadParameters).await??;
        if let Some(trace) = &self.trace {
            let spans = self.device.send(TakeSpans).await??;
            let role = format!("stage {stage} (replica {replica})");
            trace.write(rank, &role, run.clock_offset_us, spans)?;
        }
        let ratio = |d: Duration| d.as_secs_f64() / figures.step_time.as_secs_f64().max(1e-9);
        Ok(StageOutcome {
            rank,
            steps,
            losses,
            evaluated,
            samples_per_sec: ((steps - figures.first) * job.train.batch_size) as f64
                / figures.elapsed.as_secs_f64().max(1e-9),
            allreduce_ratio: ratio(figures.allreduce),
            exposed_allreduce_ratio: ratio(figures.exposed),
            peak_activations: figures.peak,
            peak_activation_bytes: figures.peak_bytes,
            bubble_fraction: figures.pipeline_wait.as_secs_f64() / figures.pipeline_time.as_secs_f64().max(1e-9),
            parameters,
        })
    }

    /// The ranks of this stage in every replica training this generation, by replica.
    fn replicas_of_stage(&self) -> Vec<usize> {
        let hybrid = &self.job.strategy.hybrid_configs;
        match &self.roster {
            Some(roster) => training_replicas(hybrid, roster)
                .into_iter()
                .map(|replica| hybrid.rank_of(replica, self.stage))
                .collect(),
            None => hybrid.replicas_of(self.stage),
        }
    }

    /// This rank's replica among those training this generation, and how many train: every
    /// replica, unless elastic membership went on without some.
    fn replica_place(&self) -> (usize, usize) {
        let hybrid = &self.job.strategy.hybrid_configs;
        match &self.roster {
            Some(roster) => {
                let training = training_replicas(hybrid, roster);
                let place = training.iter().position(|&replica| replica == self.replica);
                (place.unwrap_or(self.replica), training.len().max(1))
            }
            None => (self.replica, hybrid.dp_degree),
        }
    }

    /// Brings the stage to the state after `step` steps (every replica of a stage continues
    /// from replica 0's state of it, the stage holding the loss from replica 0's losses): see
    /// [`Restore::to`].
    async fn restore(&mut self, step: usize) -> Result<RunRecord> {
        let ring_ranks = self.replicas_of_stage();
        let file = stage_file(self.stage);
        // Only a stage no other node runs has a copy on the next node; another's replicas share it.
        let buddy = match (&self.in_place, &self.roster) {
            (Some(StageInPlace { buddy: Some(buddy), .. }), Some(roster))
                if Buddy::only_here(roster, self.rank, ring_ranks.iter().copied()) =>
            {
                Some(BuddyCopy {
                    buddy,
                    roster,
                    name: file.clone(),
                })
            }
            _ => None,
        };
        let restore = Restore {
            rank: self.rank,
            device: &self.device,
            kept: self.in_place.is_some().then_some(&mut self.kept),
            ring_ranks,
            buddy,
        };
        let (recovery, world_size, roster) = (&self.recovery, self.job.world_size(), self.roster.as_ref());
        let cut = (self.stage, self.job.strategy.hybrid_configs.pp_degree);
        restore
            .to(step, || recovery.read_stage(step, world_size, roster, cut))
            .await
    }

    /// Stores the stage's checkpoint on the next node when every replica of it runs on this one;
    /// says which host that is.
    async fn copy_to_buddy(&self, step: usize, state: &[u8]) -> Result<Option<String>> {
        let (Some(StageInPlace { buddy: Some(buddy), .. }), Some(roster)) = (&self.in_place, &self.roster) else {
            return Ok(None);
        };
        if !Buddy::only_here(roster, self.rank, self.replicas_of_stage()) {
            return Ok(None);
        }
        buddy
            .copy(roster, self.rank, step, &stage_file(self.stage), state)
            .await
    }

    /// The checkpoint after `step` steps: replica 0's rank of each stage writes the stage's
    /// state (its replicas are equal), every rank acknowledges, the coordinator commits. A rank
    /// that rolls back in place keeps its state in memory too, and each node keeps its own copy:
    /// the first replica of each stage on a node writes the stage there, and the node's first
    /// rank commits the node's files once the coordinator has.
    async fn checkpoint(&mut self, step: usize, run: RunRecord) -> Result<()> {
        let store = self.recovery.store.clone().context("a checkpoint without a store")?;
        let writes = match (&self.in_place, &self.roster) {
            (Some(_), Some(roster)) => roster.first_on_its_host(self.rank, self.replicas_of_stage()),
            _ => self.replica == 0,
        };
        let written = if self.in_place.is_some() {
            let state = Arc::new(self.device.send(Snapshot { run }).await??);
            self.kept.taken(step, state.clone());
            if writes {
                let (writer, file) = (store.clone(), stage_file(self.stage));
                let bytes = state.clone();
                let write = tokio::task::spawn_blocking(move || writer.write(step, &file, &bytes));
                let written = write.await.context("the checkpoint writer stopped")??;
                let mut held = HeldFile::here(written);
                held.nodes.extend(self.copy_to_buddy(step, &state).await?);
                vec![held]
            } else {
                Vec::new()
            }
        } else if writes {
            // Streamed to the file tensor by tensor: no copy of the state in memory.
            let save = SaveCheckpoint {
                store: store.clone(),
                step,
                file: stage_file(self.stage),
                run,
            };
            vec![HeldFile::here(self.device.send(save).await??)]
        } else {
            Vec::new()
        };
        let bus = self
            .bus
            .as_mut()
            .context("a checkpointing stage needs a line to the coordinator")?;
        let record = bus.acknowledge(self.rank, step, written).await?;
        if self.in_place.is_some() {
            self.kept.committed();
            commit_on_this_node(&store, record, self.roster.as_ref(), self.rank).await?;
        }
        Ok(())
    }
}

/// The replicas every stage of which trains in `roster`'s generation (all of them, unless
/// elastic membership went on without some), in order.
pub(crate) fn training_replicas(hybrid: &HybridConfigs, roster: &Roster) -> Vec<usize> {
    (0..hybrid.dp_degree)
        .filter(|&replica| {
            hybrid
                .stages_of(replica)
                .into_iter()
                .all(|rank| roster.place_of(rank).is_some())
        })
        .collect()
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
            evaluated: Some(Score {
                total: 7.0,
                loss_total: 4.5,
                count: 9,
            }),
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
        assert_eq!(
            (back.rank, back.steps, back.evaluated),
            (
                1,
                3,
                Some(Score {
                    total: 7.0,
                    loss_total: 4.5,
                    count: 9
                })
            )
        );
        assert_eq!(format!("{:?}", back.losses), format!("{:?}", outcome.losses));
        assert_eq!(back.peak_activation_bytes, 4096);

        let err = StageOutcome::from_bytes(bytes.slice(..bytes.len() - 4)).unwrap_err();
        assert!(err.to_string().contains("rank 1"), "{err}");
        assert!(StageOutcome::from_bytes(Bytes::from_static(&[9, 0, 0, 0, 1])).is_err());
    }
}
