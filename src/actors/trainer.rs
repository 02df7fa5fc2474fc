//! The trainer: one rank's training loop. It joins the rendezvous, has its
//! device actor build the replica, feeds it this rank's batches, checks
//! replica agreement every `strategy.check_every` steps, evaluates, and
//! waits at the final barrier so no rank leaves while others still need it.
//!
//! In a job that recovers in place, a failure the coordinator explains with a rollback order
//! (another rank was lost) does not end the trainer: it joins the next generation over a new
//! ring, restores the committed checkpoint's state — from the snapshot it kept in memory, or
//! from disk — and trains on from there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use anyhow::{anyhow, Context as _, Result};

use super::device::{
    CheckReplicas, DeviceActor, Evaluate, ModelFactory, Prepare, ReadParameters, Relink, RingLink, SaveCheckpoint,
    Snapshot, TakeSpans, TrainStep,
};
use super::divergence::check_loss;
use super::faults::RoleFaults;
use super::kept::{commit_on_this_node, Kept, Restore};
use super::recovery::{Recovery, StopAtCheckpoint, REPLICA_FILE};
use super::rollback::Orders;
use super::run_loop::{eval_due, run_steps, RunLoop};
use super::LOSSES_RESERVED;
use crate::checkpoint::HeldFile;
use crate::collective::preemption::is_preemption;
use crate::collective::training_state::RunRecord;
use crate::collective::ParamChecksum;
use crate::config::JobConfig;
use crate::data::RowSource;
use crate::models::export::ModelInfo;
use crate::models::Score;
use crate::net::protocol::Roster;
use crate::net::ControlBus;
use crate::telemetry::monitor::{MonitorSettings, StepSample};
use crate::telemetry::timeline::TraceTarget;

/// What a rank needs to train.
pub struct Trainer {
    /// This rank.
    pub rank: usize,
    /// The job.
    pub job: Arc<JobConfig>,
    /// The model's constructor.
    pub model: ModelFactory,
    /// What the model's files say besides its parameters.
    pub export: ModelInfo,
    /// Training split (each rank reads its shard of every global batch).
    pub train_data: RowSource,
    /// Held-out split (each rank evaluates a contiguous part).
    pub test_data: RowSource,
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
    /// How this rank rolls back in place; `None` when a lost rank stops the job.
    pub in_place: Option<InPlace>,
    /// The faults planned for this rank of a simulated cluster: its training runs under their
    /// switch.
    pub faults: Option<Arc<RoleFaults>>,
}

/// What a trainer needs to roll back inside its process.
pub struct InPlace {
    /// The coordinator's rollback orders.
    pub orders: Orders,
    /// Binds a data endpoint for the next generation's ring: the link, and its address.
    pub relink: Box<dyn Fn() -> Result<(RingLink, String)> + Send>,
}

/// Runs the training loop to its end.
#[derive(Message)]
#[rtype(result = "Result<RankOutcome>")]
pub struct Train;

/// What a rank reports when training ends.
#[derive(Debug, Clone)]
pub struct RankOutcome {
    /// Its place in the last generation (its rank, unless elastic membership changed who
    /// trains).
    pub rank: usize,
    /// The ranks that trained the last generation.
    pub world_size: usize,
    /// Optimizer steps taken.
    pub steps: usize,
    /// Global mean loss of the last step.
    pub final_loss: f32,
    /// The held-out split's score, over all ranks' shards.
    pub test_score: Score,
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
    /// The most bytes of activations this rank held for backward at once in one step of this
    /// generation ([`crate::collective::StepReport::peak_activation_bytes`]).
    pub peak_activation_bytes: usize,
}

impl Trainer {
    /// Starts the trainer actor and trains to the end; an actor that stopped names the rank.
    pub async fn train(self) -> Result<RankOutcome> {
        let rank = self.rank;
        self.start()
            .send(Train)
            .await
            .map_err(|e| anyhow!("rank {rank}: trainer actor stopped: {e}"))?
    }
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
            export: self.export.clone(),
            train_data: self.train_data.clone(),
            test_data: self.test_data.clone(),
            bus: self.bus.take(),
            link: self.link.take(),
            data_endpoint: self.data_endpoint.clone(),
            device: self.device.clone(),
            monitor: self.monitor.clone(),
            trace: self.trace.clone(),
            recovery: self.recovery.clone(),
            in_place: self.in_place.take(),
            faults: self.faults.clone(),
            kept: Kept::default(),
            roster: None,
        };
        Box::pin(RoleFaults::govern(self.faults.clone(), run.execute()))
    }
}

struct TrainingRun {
    rank: usize,
    job: Arc<JobConfig>,
    model: ModelFactory,
    export: ModelInfo,
    train_data: RowSource,
    test_data: RowSource,
    bus: Option<ControlBus>,
    link: Option<RingLink>,
    data_endpoint: String,
    device: Addr<DeviceActor>,
    monitor: Option<MonitorSettings>,
    trace: Option<TraceTarget>,
    recovery: Recovery,
    in_place: Option<InPlace>,
    faults: Option<Arc<RoleFaults>>,
    kept: Kept,
    /// The roster of the generation training.
    roster: Option<Roster>,
}

impl TrainingRun {
    async fn execute(mut self) -> Result<RankOutcome> {
        let rank = self.rank;
        let job = self.job.clone();
        let mut bus = self.bus.take().context("Train was sent twice")?;
        let link = self.link.take().context("Train was sent twice")?;
        let mut roster = join_training(&mut bus, rank, &job, self.data_endpoint.clone()).await?;
        self.recovery.check_joined(&roster)?;
        if let Some(in_place) = &self.in_place {
            in_place.orders.joined(&roster);
        }
        let clock_offset_us = match &self.trace {
            Some(_) => bus.clock_offset_us().await?,
            None => 0.0,
        };
        self.device
            .send(Prepare {
                job: job.clone(),
                model: self.model.clone(),
                export: self.export.clone(),
                link,
                roster: roster.clone(),
                // A later generation's ranks all restore one state: nothing to broadcast.
                broadcast: roster.generation == 0,
                steps: run_steps(&job, &self.train_data)?,
                trace_from: self.trace.as_ref().map(|t| t.origin.instant),
            })
            .await??;

        let first = roster.resume_step.unwrap_or(0);
        let mut run = RunLoop::start(
            &job,
            &self.train_data,
            place_in(&roster, rank)?,
            &self.recovery,
            first,
            self.monitor.as_ref(),
            clock_offset_us,
        )?;
        let mut failure = None;
        // Each pass is one generation; a new one starts only on a rollback order to a newer
        // generation, so the passes are bounded by the ranks the job loses.
        loop {
            if let Some(error) = failure.take() {
                let Some(in_place) = self.in_place.as_mut() else {
                    return Err(error);
                };
                in_place.orders.explain(error).await?;
                match self.rejoin(&mut bus).await {
                    Ok(next) => roster = next,
                    Err(e) => {
                        failure = Some(e);
                        continue;
                    }
                }
            }
            match self.train_generation(&mut bus, &roster, &mut run).await {
                Ok(outcome) => {
                    run.finish();
                    return Ok(outcome);
                }
                // Every rank stopped after the same step: nothing to recover.
                Err(e) if is_preemption(&e) => return Err(e),
                Err(e) => failure = Some(e),
            }
        }
    }

    /// Joins the next generation over a new ring after a rollback order.
    async fn rejoin(&mut self, bus: &mut ControlBus) -> Result<Roster> {
        let in_place = self.in_place.as_ref().context("a rollback without in-place recovery")?;
        let (link, endpoint) = (in_place.relink)()?;
        let roster = join_training(bus, self.rank, &self.job, endpoint).await?;
        in_place.orders.joined(&roster);
        self.device
            .send(Relink {
                job: self.job.clone(),
                link,
                roster: roster.clone(),
            })
            .await??;
        tracing::info!(
            rank = self.rank,
            generation = roster.generation,
            resume_step = roster.resume_step.unwrap_or(0),
            "rejoined"
        );
        Ok(roster)
    }

    /// Brings the replica to the state after `step` steps: see [`Restore::to`].
    async fn restore(&mut self, step: usize) -> Result<RunRecord> {
        let restore = Restore {
            rank: self.rank,
            device: &self.device,
            kept: self.in_place.is_some().then_some(&mut self.kept),
            ring_ranks: self.roster.as_ref().map(Roster::members).unwrap_or_default(),
            // Every node keeps a replica: no buddy copies.
            buddy: None,
        };
        let (recovery, roster) = (&self.recovery, self.roster.as_ref());
        // The replica file holds the whole model: it restores on any number of ranks.
        restore.to(step, || recovery.read_replica(step, roster)).await
    }

    /// Trains one generation, from its roster's resume step to the end of the run.
    async fn train_generation(
        &mut self,
        bus: &mut ControlBus,
        roster: &Roster,
        run: &mut RunLoop,
    ) -> Result<RankOutcome> {
        let rank = self.rank;
        let job = self.job.clone();
        let (place, world) = place_in(roster, rank)?;
        let steps = run.steps;
        let first = roster.resume_step.unwrap_or(0);
        self.roster = Some(roster.clone());
        // This generation's part of every global batch (another one when membership changed).
        run.loader.place(place, world)?;
        let restored = self.restore(first).await?;
        run.resume_data(rank, first, restored.data.as_ref());
        let mut losses = Vec::with_capacity(steps.min(LOSSES_RESERVED));
        losses.extend(restored.losses);
        let started = Instant::now();
        let (mut step_time, mut comm_time, mut exposed) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let mut peak_activation_bytes = 0;
        let check_every = job.strategy.check_every;
        let loss_kind = job.train.resolved_loss()?;
        let test_data = self.test_data.clone();
        let piece_rows = job.eval_batch_rows();
        let test_shard = || test_data.share(place, world, piece_rows);
        // The newest held-out score, and the steps it came after.
        let mut scored: Option<(usize, Score)> = None;
        // SIGTERM asks the run to stop at a checkpoint rather than ending the process.
        let mut stop = StopAtCheckpoint::new(true)?;
        for step in first..steps {
            if let Some(faults) = &self.faults {
                faults.before_step(&format!("rank {rank}"), step).await;
            }
            let report = self.device.send(TrainStep(run.loader.batch(step)?)).await??;
            step_time += report.step_time;
            comm_time += report.comm_time;
            exposed += report.exposed_comm_time;
            peak_activation_bytes = peak_activation_bytes.max(report.peak_activation_bytes);
            losses.push(report.loss);
            let mut eval = None;
            if eval_due(&job, step + 1, steps) {
                let score = self.device.send(Evaluate(test_shard()?)).await??;
                scored = Some((step + 1, score));
                eval = Some(score.held_out(loss_kind));
            }
            if let Some(monitor) = &mut run.monitor {
                let sample = StepSample {
                    loss: report.loss,
                    loss_spread: Some(report.loss_spread),
                    lr: report.lr,
                    step_time: report.step_time,
                    comm_time: report.comm_time,
                    exposed_comm_time: report.exposed_comm_time,
                    bubble_fraction: None,
                    peak_rss_bytes: report.peak_rss_bytes,
                    sparse_tables: None,
                    eval,
                };
                monitor.record(step + 1, sample)?;
            }
            check_loss(rank, step + 1, report.loss)?;
            if check_every > 0 && (step + 1) % check_every == 0 {
                self.device.send(CheckReplicas).await??;
            }
            // Every rank learns in the same step that one was asked to stop.
            let next = stop.after(report.stop_asked, &job, &self.recovery, step + 1, steps);
            if next.checkpoint {
                let data = run.data_position(&self.device, step + 1).await?;
                let record = RunRecord {
                    losses: losses.clone(),
                    data,
                };
                self.checkpoint(bus, step + 1, record).await?;
            }
            if let Some(preempted) = next.stop {
                return Err(preempted.into());
            }
        }
        let elapsed = started.elapsed();
        if let Some(trace) = &self.trace {
            let spans = self.device.send(TakeSpans).await??;
            trace.write(rank, "trainer", run.clock_offset_us, spans)?;
        }

        let param_checksum = self.device.send(CheckReplicas).await??;
        let test_score = match scored {
            Some((done, score)) if done == steps => score,
            _ => self.device.send(Evaluate(test_shard()?)).await??,
        };
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
            rank: place,
            world_size: world,
            steps,
            final_loss: losses.last().copied().unwrap_or(f32::NAN),
            test_score,
            samples_per_sec: ((steps - first) * job.train.batch_size) as f64 / elapsed.as_secs_f64().max(1e-9),
            comm_time_ratio: ratio(comm_time),
            exposed_comm_ratio: ratio(exposed),
            param_checksum,
            parameters,
            losses,
            peak_activation_bytes,
        })
    }

    /// The checkpoint after `step` steps: rank 0 writes the replica (all are equal), every rank
    /// acknowledges, the coordinator commits. In a job that recovers in place every rank keeps
    /// the state in memory, and the first rank on each node writes it to that node's disk and
    /// commits it there once the coordinator has: a node needs no shared filesystem, and a
    /// node lost with its disk loses no committed checkpoint.
    async fn checkpoint(&mut self, bus: &mut ControlBus, step: usize, run: RunRecord) -> Result<()> {
        let store = self.recovery.store.clone().context("a checkpoint without a store")?;
        let roster = self.roster.as_ref().context("a checkpoint before the rendezvous")?;
        let (place, _) = place_in(roster, self.rank)?;
        let writes = match &self.in_place {
            Some(_) => roster.first_on_its_host(self.rank, roster.members()),
            None => place == 0,
        };
        let written = match (self.in_place.is_some(), writes) {
            (false, false) => Vec::new(),
            // Streamed to the file tensor by tensor: no copy of the state in memory.
            (false, true) => {
                let save = SaveCheckpoint {
                    store: store.clone(),
                    step,
                    file: REPLICA_FILE.to_string(),
                    run,
                };
                vec![self.device.send(save).await??]
            }
            // The copy kept for a rollback is the one written.
            (true, _) => {
                let state = Arc::new(self.device.send(Snapshot { run }).await??);
                self.kept.taken(step, state.clone());
                if writes {
                    let store = store.clone();
                    let write = tokio::task::spawn_blocking(move || store.write(step, REPLICA_FILE, &state));
                    vec![write.await.context("the checkpoint writer stopped")??]
                } else {
                    Vec::new()
                }
            }
        };
        // Every node keeps a replica: no copies elsewhere.
        let written = written.into_iter().map(HeldFile::here).collect();
        let record = bus.acknowledge(self.rank, step, written).await?;
        if self.in_place.is_some() {
            self.kept.committed();
            commit_on_this_node(&store, record, self.roster.as_ref(), self.rank).await?;
        }
        Ok(())
    }
}

/// Joins the job's next generation as `rank` reachable at `data_endpoint`.
async fn join_training(bus: &mut ControlBus, rank: usize, job: &JobConfig, data_endpoint: String) -> Result<Roster> {
    bus.join_admitted(rank, job.world_size(), data_endpoint, None, job.shared_settings())
        .await
}

/// Where `rank` trains in `roster`'s generation, and how many ranks train it.
fn place_in(roster: &Roster, rank: usize) -> Result<(usize, usize)> {
    let place = roster
        .place_of(rank)
        .with_context(|| format!("rank {rank} is not in the roster of generation {}", roster.generation))?;
    Ok((place, roster.world_size()))
}
