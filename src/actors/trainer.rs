//! The trainer: one rank's training loop. It joins the rendezvous, has its
//! device actor build the replica, feeds it this rank's batches, checks
//! replica agreement every `strategy.check_every` steps, evaluates, and
//! waits at the final barrier so no rank leaves while others still need it.
//!
//! In a job that recovers in place, a failure the coordinator explains with a rollback order
//! (another rank was lost) does not end the trainer: it joins the next generation over a new
//! ring, restores the committed checkpoint's state — from the snapshot it kept in memory, or
//! from disk — and trains on from there.

use actix::prelude::*;
use anyhow::{anyhow, Context as _, Result};

use super::device::{CheckReplicas, Prepare, ReadParameters, ReadStateBytes, Relink, ReplicaPart};
use super::rank_generations::{train_generations, RankGenerations};
use super::rank_parts::RankParts;
use super::rank_steps::{train_generation, Place, StrategySteps};
use super::recovery::faults::RoleFaults;
use super::recovery::kept::{acknowledge_checkpoint, Kept, RankCheckpoint, Restore};
use super::recovery::rollback::{takes_rollback_orders, OrderInbox, Orders};
use super::recovery::REPLICA_FILE;
use super::ring_link::RingLink;
use super::run_loop::{run_steps, RunLoop};
use crate::collective::training_state::RunRecord;
use crate::collective::{ParamChecksum, StateBytes};
use crate::config::JobConfig;
use crate::models::{NamedValues, Score};
use crate::net::protocol::Roster;
use crate::net::ControlBus;

/// A data-parallel rank: its parts, and its first links.
pub struct Trainer {
    /// What the rank trains with.
    pub parts: RankParts,
    /// The line to the coordinator; taken when training starts.
    pub bus: Option<ControlBus>,
    /// The ring link; handed to the device actor at start.
    pub link: Option<RingLink>,
    /// This rank's data endpoint, announced at rendezvous.
    pub data_endpoint: String,
    /// How this rank rolls back in place; `None` when a lost rank stops the job.
    pub in_place: Option<InPlace>,
    /// Where the coordinator's rollback orders to this actor go: set when it starts, in a job
    /// that rolls back in place.
    pub inbox: Option<OrderInbox>,
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
    /// Final parameters by name, with their checksum: at place 0 only, which reports them.
    pub parameters: Option<(NamedValues, ParamChecksum)>,
    /// Global mean loss of every step.
    pub losses: Vec<f32>,
    /// The most bytes of activations this rank held for backward at once in one step of this
    /// generation ([`crate::collective::StepReport::peak_activation_bytes`]).
    pub peak_activation_bytes: usize,
    /// The bytes of state this rank held at the end.
    pub state_bytes: StateBytes,
}

impl Trainer {
    /// Starts the trainer actor and trains to the end; an actor that stopped names the rank.
    pub async fn train(self) -> Result<RankOutcome> {
        let rank = self.parts.rank;
        self.start()
            .send(Train)
            .await
            .map_err(|e| anyhow!("rank {rank}: trainer actor stopped: {e}"))?
    }
}

takes_rollback_orders!(Trainer, |this, _in_place| (this.parts.rank, this.bus.as_ref()));

impl Handler<Train> for Trainer {
    type Result = ResponseFuture<Result<RankOutcome>>;

    fn handle(&mut self, _: Train, _: &mut Self::Context) -> Self::Result {
        let run = TrainingRun {
            parts: self.parts.clone(),
            bus: self.bus.take(),
            link: self.link.take(),
            data_endpoint: self.data_endpoint.clone(),
            in_place: self.in_place.take(),
            kept: Kept::default(),
            roster: None,
        };
        Box::pin(RoleFaults::govern(self.parts.faults.clone(), run.execute()))
    }
}

struct TrainingRun {
    parts: RankParts,
    bus: Option<ControlBus>,
    link: Option<RingLink>,
    data_endpoint: String,
    in_place: Option<InPlace>,
    kept: Kept,
    /// The roster of the generation training.
    roster: Option<Roster>,
}

impl TrainingRun {
    async fn execute(mut self) -> Result<RankOutcome> {
        let rank = self.parts.rank;
        let job = self.parts.job.clone();
        let link = self.link.take().context("Train was sent twice")?;
        let endpoint = self.data_endpoint.clone();
        let roster = join_training(self.bus_mut()?, rank, &job, endpoint).await?;
        self.parts.recovery.check_joined(&roster)?;
        if let Some(in_place) = &self.in_place {
            in_place.orders.joined(&roster);
        }
        let clock_offset_us = match &self.parts.trace {
            Some(_) => self.bus_mut()?.clock_offset_us().await?,
            None => 0.0,
        };
        self.parts
            .device
            .send(Prepare {
                job: job.clone(),
                model: self.parts.model.clone(),
                export: self.parts.export.clone(),
                part: ReplicaPart::Whole {
                    link,
                    roster: roster.clone(),
                    // A later generation's ranks all restore one state: nothing to broadcast.
                    broadcast: roster.generation == 0,
                },
                steps: run_steps(&job, &self.parts.train_data)?,
                trace_from: self.parts.trace.as_ref().map(|t| t.origin.instant),
            })
            .await??;

        let first = roster.resume_step.unwrap_or(0);
        let mut run = RunLoop::start(
            &job,
            &self.parts.train_data,
            data_place(&job, &roster, rank)?,
            &self.parts.recovery,
            first,
            self.parts.monitor.as_ref(),
            clock_offset_us,
        )?;
        self.roster = Some(roster);
        let outcome = train_generations(&mut self, &mut run, first).await?;
        run.finish();
        Ok(outcome)
    }

    /// Brings the replica to the state after `step` steps: see [`Restore::to`].
    async fn restore(&mut self, step: usize) -> Result<RunRecord> {
        let restore = Restore {
            rank: self.parts.rank,
            device: &self.parts.device,
            kept: self.in_place.is_some().then_some(&mut self.kept),
            ring_ranks: self.roster.as_ref().map(Roster::members).unwrap_or_default(),
            // Every node keeps a replica: no buddy copies.
            buddy: None,
        };
        let (recovery, roster) = (&self.parts.recovery, self.roster.as_ref());
        // The replica file holds the whole model: it restores on any number of ranks.
        restore.to(step, || recovery.read_replica(step, roster)).await
    }

    /// The line to the coordinator.
    fn bus_mut(&mut self) -> Result<&mut ControlBus> {
        self.bus.as_mut().context("a trainer without a line to the coordinator")
    }

    /// The checkpoint after `step` steps: rank 0 writes the replica (all are equal), every rank
    /// acknowledges, the coordinator commits. In a job that recovers in place every rank keeps
    /// the state in memory, and the first rank on each node writes it to that node's disk and
    /// commits it there once the coordinator has: a node needs no shared filesystem, and a
    /// node lost with its disk loses no committed checkpoint.
    async fn write_checkpoint(&mut self, step: usize, run: RunRecord) -> Result<()> {
        let store = self.parts.recovery.checkpoint_store()?;
        let roster = self.roster.clone().context("a checkpoint before the rendezvous")?;
        let (place, _) = place_in(&roster, self.parts.rank)?;
        let in_place = self.in_place.is_some();
        let checkpoint = RankCheckpoint {
            step,
            file: REPLICA_FILE.to_string(),
            writes: match in_place {
                true => roster.first_on_its_host(self.parts.rank, roster.members()),
                false => place == 0,
            },
            // Sharded states are gathered over the ring, split layers over their groups.
            gathered: self.parts.job.strategy.sharding || self.parts.job.mp_degree() > 1,
            device: &self.parts.device,
            store: &store,
            kept: in_place.then_some(&mut self.kept),
        };
        // Every node keeps a replica: no copies elsewhere.
        let written = checkpoint.write(run).await?.0.into_iter().collect();
        let bus = self
            .bus
            .as_mut()
            .context("a trainer without a line to the coordinator")?;
        let kept = in_place.then_some(&mut self.kept);
        acknowledge_checkpoint(bus, (self.parts.rank, step), written, kept, &store, Some(&roster)).await
    }
}

impl RankGenerations for TrainingRun {
    type Run = RunLoop;
    type Outcome = RankOutcome;

    fn rank(&self) -> usize {
        self.parts.rank
    }

    /// Trains one generation, from the state after step `first` to the end of the run.
    async fn generation(&mut self, run: &mut RunLoop, first: usize) -> Result<RankOutcome> {
        let rank = self.parts.rank;
        let job = self.parts.job.clone();
        let roster = self.roster.as_ref().context("a generation before the rendezvous")?;
        let (place, world) = place_in(roster, rank)?;
        // This generation's part of every global batch (another one when membership changed).
        let (replica, replicas) = data_place(&job, roster, rank)?;
        run.loader.place(replica, replicas)?;
        let restored = self.restore(first).await?;
        let at = Place {
            replica,
            replicas,
            role: "trainer".to_string(),
        };
        let parts = self.parts.clone();
        let generation = train_generation(self, &parts, at, run, first, restored).await?;
        self.parts.device.send(CheckReplicas).await??;
        let test_score = generation
            .score
            .context("a data-parallel replica scores the held-out split")?;
        // The whole model's, split layers gathered: its checksum is the whole model's too.
        let parameters = (self.parts.device.send(ReadParameters { keep: place == 0 }).await??).map(|values| {
            let checksum = ParamChecksum::of_values(&values);
            (values, checksum)
        });
        let state_bytes = self.parts.device.send(ReadStateBytes).await??;
        self.bus_mut()?.barrier(rank, "end of training").await?;
        Ok(RankOutcome {
            rank: place,
            world_size: world,
            steps: run.steps,
            final_loss: generation.losses.last().copied().unwrap_or(f32::NAN),
            test_score,
            samples_per_sec: generation.samples_per_sec(&job, run.steps),
            comm_time_ratio: generation.comm_time_ratio(),
            exposed_comm_ratio: generation.exposed_comm_ratio(),
            parameters,
            peak_activation_bytes: generation.peak_activation_bytes,
            state_bytes,
            losses: generation.losses,
        })
    }

    fn orders(&mut self) -> Option<&mut Orders> {
        self.in_place.as_mut().map(|in_place| &mut in_place.orders)
    }

    /// Joins the next generation over a new ring.
    async fn rejoin(&mut self, _run: &mut RunLoop) -> Result<Roster> {
        let in_place = self.in_place.as_ref().context("a rollback without in-place recovery")?;
        let (link, endpoint) = (in_place.relink)()?;
        let (rank, job) = (self.parts.rank, self.parts.job.clone());
        let roster = join_training(self.bus_mut()?, rank, &job, endpoint).await?;
        self.parts
            .device
            .send(Relink::Ring {
                job: self.parts.job.clone(),
                link,
                roster: roster.clone(),
            })
            .await??;
        self.roster = Some(roster.clone());
        Ok(roster)
    }
}

impl StrategySteps for TrainingRun {
    /// Every `strategy.check_every` steps the replicas compare their parameters' checksums.
    async fn after_step(&mut self, done: usize) -> Result<()> {
        let every = self.parts.job.strategy.check_every;
        if every > 0 && done.is_multiple_of(every) {
            self.parts.device.send(CheckReplicas).await??;
        }
        Ok(())
    }

    async fn checkpoint(&mut self, step: usize, record: RunRecord) -> Result<()> {
        self.write_checkpoint(step, record).await
    }
}

/// Joins the job's next generation as `rank` reachable at `data_endpoint`.
async fn join_training(bus: &mut ControlBus, rank: usize, job: &JobConfig, data_endpoint: String) -> Result<Roster> {
    bus.join_admitted(rank, job.world_size(), data_endpoint, None, job.shared_settings())
        .await
}

/// The replica `rank` trains in `roster`'s generation, and how many replicas train: the ranks,
/// or where layers are split the layer groups, whose ranks all read the same batches.
fn data_place(job: &JobConfig, roster: &Roster, rank: usize) -> Result<(usize, usize)> {
    let (place, world) = place_in(roster, rank)?;
    let mp = job.mp_degree();
    Ok((place / mp, world / mp))
}

/// Where `rank` trains in `roster`'s generation, and how many ranks train it.
fn place_in(roster: &Roster, rank: usize) -> Result<(usize, usize)> {
    let place = roster
        .place_of(rank)
        .with_context(|| format!("rank {rank} is not in the roster of generation {}", roster.generation))?;
    Ok((place, roster.world_size()))
}
