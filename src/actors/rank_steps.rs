//! The steps of one generation of a rank, written once for every strategy whose rank drives a
//! device actor step by step (the data-parallel trainer, the pipeline stage): fault injection,
//! the step, periodic evaluation, the monitor's sample, the loss check, the strategy's own
//! check, a checkpoint or a stop where due; then the final evaluation, the timeline, and the
//! figures every outcome reports (one `comm_time_ratio`). The step and the evaluation are the
//! device actor's, whose replica trait serves both strategies; what differs — the checkpoint's
//! files, a replica check — is a [`StrategySteps`].

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};

use super::device::{Evaluate, TakeSpans, TrainStep};
use super::rank_parts::RankParts;
use super::recovery::divergence::check_loss;
use super::recovery::StopAtCheckpoint;
use super::run_loop::{eval_due, RunLoop};
use crate::collective::training_state::RunRecord;
use crate::collective::StepReport;
use crate::config::JobConfig;
use crate::models::{HeldOut, Score};
use crate::telemetry::monitor::StepSample;

/// What a strategy's rank does differently in its steps.
pub(crate) trait StrategySteps {
    /// What the strategy checks after `done` steps (the data-parallel replicas' checksums).
    async fn after_step(&mut self, done: usize) -> Result<()>;

    /// The checkpoint after `step` steps, its run record `record`.
    async fn checkpoint(&mut self, step: usize, record: RunRecord) -> Result<()>;
}

/// Where a generation's rank stands: its replica among the replicas training (its share of the
/// data and of the held-out split), and the role its timeline names.
pub(crate) struct Place {
    /// This rank's data-parallel replica among those training the generation.
    pub replica: usize,
    /// The replicas training it.
    pub replicas: usize,
    /// The role, in the timeline.
    pub role: String,
}

/// What a generation's steps measured, and what they ended with.
#[derive(Debug, Default)]
pub(crate) struct Generation {
    /// The step the generation resumed after.
    pub first: usize,
    /// Global mean loss of every step of the run, the restored ones first.
    pub losses: Vec<f32>,
    /// The held-out split's score after the last step; `None` where the rank holds no output.
    pub score: Option<Score>,
    /// Wall time of the steps.
    pub elapsed: Duration,
    step_time: Duration,
    comm_time: Duration,
    exposed_comm_time: Duration,
    pipeline_wait: Duration,
    pipeline_time: Duration,
    /// Most micro-batch activations held at once.
    pub peak_activations: usize,
    /// Most bytes of activations held for backward at once.
    pub peak_activation_bytes: usize,
}

impl Generation {
    /// Global samples per second over the generation's steps.
    pub(super) fn samples_per_sec(&self, job: &JobConfig, steps: usize) -> f64 {
        ((steps - self.first) * job.train.batch_size) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Communication time over step time.
    pub(super) fn comm_time_ratio(&self) -> f64 {
        self.of_step_time(self.comm_time)
    }

    /// Communication not hidden behind compute, over step time.
    pub(super) fn exposed_comm_ratio(&self) -> f64 {
        self.of_step_time(self.exposed_comm_time)
    }

    /// The time a pipeline stage waited for its neighbours over its schedule's time.
    pub(super) fn bubble_fraction(&self) -> f64 {
        self.pipeline_wait.as_secs_f64() / self.pipeline_time.as_secs_f64().max(1e-9)
    }

    fn of_step_time(&self, time: Duration) -> f64 {
        match self.step_time.is_zero() {
            true => 0.0,
            false => time.as_secs_f64() / self.step_time.as_secs_f64(),
        }
    }

    fn add(&mut self, step: &StepReport) {
        self.step_time += step.step_time;
        self.comm_time += step.comm_time;
        self.exposed_comm_time += step.exposed_comm_time;
        if let Some((wait, time)) = step.pipeline {
            self.pipeline_wait += wait;
            self.pipeline_time += time;
        }
        self.peak_activations = self.peak_activations.max(step.peak_activations);
        self.peak_activation_bytes = self.peak_activation_bytes.max(step.peak_activation_bytes);
    }
}

/// Trains `run`'s steps after `first` (the state restored as `restored` says) to the end of the
/// run, then scores the held-out split (unless the last step just did) and writes the timeline.
pub(crate) async fn train_generation<S: StrategySteps>(
    strategy: &mut S,
    parts: &RankParts,
    place: Place,
    run: &mut RunLoop,
    first: usize,
    restored: RunRecord,
) -> Result<Generation> {
    let (rank, job, steps) = (parts.rank, &*parts.job, run.steps);
    // Every held-out row is scored: each replica takes its share, in pieces of any size.
    let piece_rows = job.eval_batch_rows();
    let test_share = || parts.test_data.share(place.replica, place.replicas, piece_rows);
    run.resume_data(rank, first, restored.data.as_ref());
    let mut generation = Generation {
        first,
        losses: restored.losses,
        ..Generation::default()
    };
    generation
        .losses
        .reserve(steps.saturating_sub(first).min(super::LOSSES_RESERVED));
    let loss_kind = job.train.resolved_loss()?;
    // The newest held-out score, and the steps it came after.
    let mut scored: Option<(usize, Option<Score>)> = None;
    let started = Instant::now();
    // SIGTERM asks the run to stop at a checkpoint rather than ending the process.
    let mut stop = StopAtCheckpoint::new(true)?;
    for step in first..steps {
        if let Some(faults) = &parts.faults {
            faults.before_step(&format!("rank {rank}"), step).await;
        }
        let report = parts
            .device
            .send(TrainStep(run.loader.batch(step)?))
            .await?
            .with_context(|| format!("step {step}"))?;
        generation.add(&report);
        let mut eval = None;
        if eval_due(job, step + 1, steps) {
            let score = parts.device.send(Evaluate(test_share()?)).await??;
            scored = Some((step + 1, score));
            eval = score.map(|score| score.held_out(loss_kind));
        }
        if let Some(loss) = report.loss {
            generation.losses.push(loss);
            if let Some(monitor) = &mut run.monitor {
                monitor.record(step + 1, sample_of(&report, loss, eval))?;
            }
            check_loss(rank, step + 1, loss)?;
        }
        strategy.after_step(step + 1).await?;
        // Every rank learns in the same step that one was asked to stop.
        let next = stop.after(report.stop_asked, job, &parts.recovery, step + 1, steps);
        if next.checkpoint {
            let data = run.data_position(&parts.device, step + 1).await?;
            let record = RunRecord {
                losses: generation.losses.clone(),
                data,
            };
            strategy.checkpoint(step + 1, record).await?;
        }
        if let Some(preempted) = next.stop {
            return Err(preempted.into());
        }
    }
    generation.elapsed = started.elapsed();
    generation.score = match scored {
        Some((done, score)) if done == steps => score,
        _ => parts.device.send(Evaluate(test_share()?)).await??,
    };
    if let Some(trace) = &parts.trace {
        let spans = parts.device.send(TakeSpans).await??;
        trace.write(rank, &place.role, run.clock_offset_us, spans)?;
    }
    Ok(generation)
}

/// The monitor's sample of a step whose global mean loss is `loss`, scored `eval` on the
/// held-out split where it was.
fn sample_of(report: &StepReport, loss: f32, eval: Option<HeldOut>) -> StepSample {
    StepSample {
        loss,
        loss_spread: report.loss_spread,
        lr: report.lr,
        step_time: report.step_time,
        comm_time: report.comm_time,
        exposed_comm_time: report.exposed_comm_time,
        bubble_fraction: report
            .pipeline
            .map(|(wait, time)| wait.as_secs_f64() / time.as_secs_f64().max(1e-9)),
        peak_rss_bytes: report.peak_rss_bytes,
        sparse_tables: None,
        eval,
    }
}
