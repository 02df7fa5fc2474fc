//! A parameter-server trainer's steps: each pulls its batch's rows from the shards (ahead, in
//! async mode, while the step before trains), trains on the device thread, pushes its update
//! (on a lane of its own in async mode), reports to the monitor and takes the checkpoints due.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};

use super::{pull_when_ready, push, shard_stats, sparse_table_metrics, InPlaceLine, Progress, PsRun, Pulled};
use crate::actors::ctr_device::{PlanCtr, TrainCtr};
use crate::actors::recovery::divergence::check_loss;
use crate::actors::recovery::StopAtCheckpoint;
use crate::config::PsMode;
use crate::data::ctr::{CtrLoader, DataLayout};
use crate::ps::client::PsClient;
use crate::ps::push_lane::PushLane;
use crate::ps::worker::{ShardUpdate, StepOutcome};
use crate::telemetry::metrics::peak_rss_bytes;
use crate::telemetry::monitor::StepSample;
use crate::telemetry::timeline::Lane;

/// One pass of steps (a generation's): the training data, the lane async pushes go out on, and
/// the rows pulled ahead for the next step.
struct Pass {
    loader: CtrLoader,
    lane: Option<PushLane>,
    prefetched: Option<Pulled>,
    /// Whether the next step's rows are pulled while a step trains (async mode).
    overlap: bool,
}

impl PsRun {
    /// Trains steps `first..steps`, taking the checkpoints due.
    pub(super) async fn train_steps(
        &mut self,
        client: &mut PsClient,
        first: usize,
        steps: usize,
        progress: &mut Progress,
        mut in_place: Option<&mut InPlaceLine>,
    ) -> Result<()> {
        let job = self.job.clone();
        let mut pass = self.start_pass(client, first)?;
        // Sync mode: SIGTERM asks the trainers to stop at a checkpoint, all after the same step
        // (the shards tell them, [`PulledRows::stop`]); the other modes share no step and end.
        let mut stop = StopAtCheckpoint::new(job.strategy.ps_mode() == PsMode::Sync)?;
        for step in first..steps {
            if let Some(faults) = &self.faults {
                faults.before_step(&format!("trainer {}", self.rank), step).await;
            }
            let step_started = Instant::now();
            let (pulled, mut step_comm) = self.pull(client, &mut pass, step, progress).await?;
            let asked = pulled.rows.iter().any(|rows| rows.stop);
            let next = stop.after(asked, &job, &self.recovery, step + 1, steps);
            let pull_ahead = pass.overlap && step + 1 < steps && !next.checkpoint;
            let (outcome, comm) = self
                .train_pulled(client, &mut pass, step, pulled, pull_ahead, progress)
                .await?;
            step_comm += comm;
            if let Some(updates) = outcome.push {
                step_comm += self.push_updates(client, &mut pass, step, updates, progress).await?;
            }
            progress.comm_time += step_comm;
            progress.losses.push(outcome.loss);
            self.record_step(client, progress, step, outcome.loss, step_started.elapsed(), step_comm)
                .await?;
            check_loss(self.rank, step + 1, outcome.loss)?;
            if next.checkpoint {
                if let Some(lane) = pass.lane.as_mut() {
                    lane.flush().await?;
                }
                let position = pass.loader.position();
                self.checkpoint(client, step + 1, position, in_place.as_deref_mut())
                    .await?;
            }
            if let Some(preempted) = next.stop {
                return Err(preempted.into());
            }
        }
        if let Some(lane) = pass.lane.as_mut() {
            lane.flush().await?;
        }
        Ok(())
    }

    /// A pass of steps from `first` on: the training data there and, in async mode, the lane
    /// the pushes go out on.
    fn start_pass(&mut self, client: &mut PsClient, first: usize) -> Result<Pass> {
        let (rank, place, job) = (self.rank, self.place, self.job.clone());
        let train = &job.train;
        let layout = DataLayout::of(train, job.world_size());
        let mut loader = CtrLoader::new(self.train_data.clone(), layout, train.batch_size, place, self.trainers)
            .with_context(|| format!("trainer {rank}: training data"))?;
        match self.resume_data.take() {
            Some(at) => loader
                .resume_at(&at)
                .with_context(|| format!("trainer {rank}: resuming the training data at step {first}"))?,
            None => loader.skip_batches(first)?,
        }
        // Async mode pulls step t+1's rows while step t computes, as Paddle's async
        // communicator does, and hands its pushes to a lane that sends them while it trains on:
        // its trainers wait only for what the staleness bound and the send queue say. Sync mode
        // cannot (step t+1's pull waits for step t's pushes), nor can geo (its plan depends on
        // the local copies step t changes). Nor is a checkpoint's step pulled ahead: the
        // trainers wait there until every one has pushed up to it.
        let overlap = job.strategy.ps_mode() == PsMode::Async;
        let lane =
            overlap.then(|| PushLane::start(client.another_lane(), place, &job.strategy.a_sync_configs, first as u64));
        Ok(Pass {
            loader,
            lane,
            prefetched: None,
            overlap,
        })
    }

    /// Step `step`'s rows: pulled ahead during the step before, or now. Answers them and the
    /// time the step waited for them.
    async fn pull(
        &mut self,
        client: &mut PsClient,
        pass: &mut Pass,
        step: usize,
        progress: &mut Progress,
    ) -> Result<(Pulled, Duration)> {
        let (pulled, waited) = match pass.prefetched.take() {
            Some(pulled) => (pulled, Duration::ZERO),
            None => {
                let batch = pass.loader.next_batch()?;
                let plan = self.device.send(PlanCtr { batch, training: true }).await??;
                let pulling = Instant::now();
                let pulled = pull_when_ready(client, pass.lane.as_mut(), self.place, step as u64, plan).await?;
                (pulled, pulling.elapsed())
            }
        };
        if let Some(t) = &mut progress.timeline {
            let name = format!("pull {step}");
            t.record_between(Lane::Communication, name, "pull", pulled.started, pulled.finished);
        }
        Ok((pulled, waited))
    }

    /// Trains step `step` on its `pulled` rows — pulling the next step's meanwhile when
    /// `pull_ahead` — and answers the outcome with the time the step waited for that pull.
    async fn train_pulled(
        &mut self,
        client: &mut PsClient,
        pass: &mut Pass,
        step: usize,
        pulled: Pulled,
        pull_ahead: bool,
        progress: &mut Progress,
    ) -> Result<(StepOutcome, Duration)> {
        // The next step's pull is planned before this one trains: the device takes messages
        // in order.
        let next_plan = match pull_ahead {
            true => {
                let batch = pass.loader.next_batch()?;
                Some(self.device.send(PlanCtr { batch, training: true }).await??)
            }
            false => None,
        };
        let computing = Instant::now();
        let training = self.device.send(TrainCtr(pulled.rows));
        let (outcome, trained, waited) = match next_plan {
            Some(plan) => {
                let training = async { (training.await, Instant::now()) };
                let next = pull_when_ready(client, pass.lane.as_mut(), self.place, step as u64 + 1, plan);
                let ((outcome, trained), next) = futures::join!(training, next);
                let next = next?;
                let waited = next.finished.saturating_duration_since(trained);
                pass.prefetched = Some(next);
                (outcome??, trained, waited)
            }
            None => (training.await??, Instant::now(), Duration::ZERO),
        };
        if let Some(t) = &mut progress.timeline {
            t.record_between(Lane::Compute, format!("train {step}"), "compute", computing, trained);
        }
        Ok((outcome, waited))
    }

    /// Pushes step `step`'s `updates` (on the lane in async mode); answers the time it took.
    async fn push_updates(
        &mut self,
        client: &mut PsClient,
        pass: &mut Pass,
        step: usize,
        updates: Vec<ShardUpdate>,
        progress: &mut Progress,
    ) -> Result<Duration> {
        let pushing = Instant::now();
        let what = format!("push of step {step}");
        match pass.lane.as_mut() {
            Some(lane) => lane.send(step as u64, updates).await?,
            None => push(client, self.place, step as u64, &self.job, updates, &what).await?,
        }
        let pushed = Instant::now();
        if let Some(t) = &mut progress.timeline {
            t.record_between(Lane::Communication, format!("push {step}"), "push", pushing, pushed);
        }
        Ok(pushed - pushing)
    }

    /// Step `step`'s sample for the monitor (trainer 0's): with the tables' row counts at
    /// progress-log steps where tables have a row policy.
    async fn record_step(
        &mut self,
        client: &mut PsClient,
        progress: &mut Progress,
        step: usize,
        loss: f32,
        step_time: Duration,
        comm_time: Duration,
    ) -> Result<()> {
        let Some(monitor) = &mut progress.monitor else {
            return Ok(());
        };
        let policed = !self.job.strategy.sparse_table_configs.is_empty();
        let sparse_tables = match policed && monitor.is_log_step(step + 1) {
            true => Some(sparse_table_metrics(
                &self.job,
                &self.model,
                &shard_stats(client).await?,
            )),
            false => None,
        };
        let sample = StepSample {
            loss,
            // Trainers exchange no losses: the loss is trainer 0's part of the batch.
            loss_spread: None,
            lr: self.job.train.lr,
            step_time,
            comm_time,
            exposed_comm_time: comm_time,
            bubble_fraction: None,
            peak_rss_bytes: peak_rss_bytes(),
            sparse_tables,
            eval: None,
        };
        monitor.record(step + 1, sample)?;
        Ok(())
    }
}
