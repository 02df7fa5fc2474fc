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

use actix::prelude::*;
use anyhow::{ensure, Context as _, Result};
use bytes::Bytes;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use super::device::{Prepare, ReadParameters, ReadStateBytes, Relink, ReplicaPart, StageLinks, StageRelink};
use super::rank_generations::{train_generations, RankGenerations};
use super::rank_parts::RankParts;
use super::rank_steps::{train_generation, Place, StrategySteps};
use super::recovery::buddy::Buddy;
use super::recovery::faults::RoleFaults;
use super::recovery::kept::{acknowledge_checkpoint, BuddyCopy, Kept, RankCheckpoint, Restore};
use super::recovery::rollback::{takes_rollback_orders, OrderInbox, Orders};
use super::recovery::stage_file;
use super::run_loop::{run_steps, RunLoop};
use crate::checkpoint::HeldFile;
use crate::collective::training_state::RunRecord;
use crate::collective::StateBytes;
use crate::config::{GridPlace, HybridConfigs};
use crate::engines::comm::Communicator;
use crate::models::Score;
use crate::net::frame::{encode_with, Frame};
use crate::net::protocol::Roster;
use crate::net::ControlBus;

/// A pipeline rank (`(replica × pp_degree + stage) × mp_degree + part`): its parts, and its
/// first links.
pub struct StageActor {
    /// What the rank trains with.
    pub parts: RankParts,
    /// The first generation's links and roster; taken at start.
    pub generation: Option<StageGeneration>,
    /// The line to the coordinator, for checkpoints; taken at start.
    pub bus: Option<ControlBus>,
    /// How this rank rolls back in place; `None` when a lost rank stops the job.
    pub in_place: Option<StageInPlace>,
    /// Where the coordinator's rollback orders to this actor go: set when it starts, in a job
    /// that rolls back in place.
    pub inbox: Option<OrderInbox>,
}

/// The links of one generation of a pipeline rank.
pub struct StageGeneration {
    /// The coordinator's roster, when the ranks joined one (a launched job).
    pub roster: Option<Roster>,
    /// Links to the neighbouring stages.
    pub link: StageLinks,
    /// The ring among this stage's replicas.
    pub data_parallel: Communicator,
    /// The ring of the ranks that split this stage's layers, where they are split.
    pub layers: Option<Communicator>,
}

impl StageGeneration {
    /// The generation's links as the device actor takes them, for stage `stage`.
    fn into_relink(self, stage: usize) -> (Option<Roster>, StageRelink) {
        let links = StageRelink {
            stage,
            link: self.link,
            data_parallel: self.data_parallel,
            layers: self.layers,
        };
        (self.roster, links)
    }
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
    /// The bytes of parameters, gradients and optimizer state the rank holds.
    pub state_bytes: StateBytes,
    /// The stage's final parameters by name, on the stage's replica 0 (which reports them; empty
    /// on the others). As bytes, they travel apart from the serialized rest: see
    /// [`StageOutcome::to_bytes`].
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

takes_rollback_orders!(StageActor, |this, _in_place| (this.parts.rank, this.bus.as_ref()));

impl Handler<TrainStage> for StageActor {
    type Result = ResponseFuture<Result<StageOutcome>>;

    fn handle(&mut self, _: TrainStage, _: &mut Self::Context) -> Self::Result {
        let run = StageRun {
            place: self.parts.job.strategy.hybrid_configs.place_of(self.parts.rank),
            parts: self.parts.clone(),
            bus: self.bus.take(),
            in_place: self.in_place.take(),
            kept: Kept::default(),
            roster: None,
        };
        let generation = self.generation.take();
        let faults = self.parts.faults.clone();
        Box::pin(async move {
            let generation = generation.context("TrainStage was sent twice")?;
            RoleFaults::govern(faults, run.execute(generation)).await
        })
    }
}

struct StageRun {
    parts: RankParts,
    /// This rank's replica, stage and part of the stage's layers.
    place: GridPlace,
    bus: Option<ControlBus>,
    in_place: Option<StageInPlace>,
    kept: Kept,
    /// The roster of the generation training (a launched job's).
    roster: Option<Roster>,
}

impl StageRun {
    async fn execute(mut self, generation: StageGeneration) -> Result<StageOutcome> {
        let job = self.parts.job.clone();
        let rank = self.parts.rank;
        let clock_offset_us = match (&self.parts.trace, self.bus.as_mut()) {
            (Some(_), Some(bus)) => bus.clock_offset_us().await?,
            _ => 0.0,
        };
        let (roster, links) = generation.into_relink(self.place.stage);
        if let Some(roster) = &roster {
            self.parts.recovery.check_joined(roster)?;
        }
        self.parts
            .device
            .send(Prepare {
                job: job.clone(),
                model: self.parts.model.clone(),
                export: self.parts.export.clone(),
                part: ReplicaPart::Stage { rank, links },
                steps: run_steps(&job, &self.parts.train_data)?,
                trace_from: self.parts.trace.as_ref().map(|t| t.origin.instant),
            })
            .await??;
        let first = match &roster {
            Some(roster) => roster.resume_step.unwrap_or(0),
            None => self.parts.recovery.start_step().unwrap_or(0),
        };
        if let (Some(in_place), Some(roster)) = (&self.in_place, &roster) {
            in_place.orders.joined(roster);
        }
        self.roster = roster;
        let mut run = RunLoop::start(
            &job,
            &self.parts.train_data,
            self.replica_place(),
            &self.parts.recovery,
            first,
            self.parts.monitor.as_ref(),
            clock_offset_us,
        )?;
        let outcome = train_generations(&mut self, &mut run, first).await?;
        run.finish();
        Ok(outcome)
    }

    /// The ranks holding this rank's part of its stage in every replica training this
    /// generation, by replica.
    fn replicas_of_stage(&self) -> Vec<usize> {
        let hybrid = &self.parts.job.strategy.hybrid_configs;
        let GridPlace { stage, part, .. } = self.place;
        match &self.roster {
            Some(roster) => training_replicas(hybrid, roster)
                .into_iter()
                .map(|replica| hybrid.rank_of(GridPlace { replica, stage, part }))
                .collect(),
            None => hybrid.replicas_of(stage, part),
        }
    }

    /// This rank's replica among those training this generation, and how many train: every
    /// replica, unless elastic membership went on without some.
    fn replica_place(&self) -> (usize, usize) {
        let hybrid = &self.parts.job.strategy.hybrid_configs;
        match &self.roster {
            Some(roster) => {
                let training = training_replicas(hybrid, roster);
                let place = training.iter().position(|&replica| replica == self.place.replica);
                (place.unwrap_or(self.place.replica), training.len().max(1))
            }
            None => (self.place.replica, hybrid.replicas()),
        }
    }

    /// Brings the stage to the state after `step` steps (every replica of a stage continues
    /// from replica 0's state of it, the stage holding the loss from replica 0's losses): see
    /// [`Restore::to`].
    async fn restore(&mut self, step: usize) -> Result<RunRecord> {
        let ring_ranks = self.replicas_of_stage();
        let file = stage_file(self.place.stage);
        // Only a stage no other node runs has a copy on the next node; another's replicas share it.
        let buddy = match (&self.in_place, &self.roster) {
            (Some(StageInPlace { buddy: Some(buddy), .. }), Some(roster))
                if Buddy::only_here(roster, self.parts.rank, ring_ranks.iter().copied()) =>
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
            rank: self.parts.rank,
            device: &self.parts.device,
            kept: self.in_place.is_some().then_some(&mut self.kept),
            ring_ranks,
            buddy,
        };
        let (recovery, world_size, roster) = (&self.parts.recovery, self.parts.job.world_size(), self.roster.as_ref());
        let cut = (self.place.stage, self.parts.job.strategy.hybrid_configs.pp_degree);
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
        if !Buddy::only_here(roster, self.parts.rank, self.replicas_of_stage()) {
            return Ok(None);
        }
        buddy
            .copy(roster, self.parts.rank, step, &stage_file(self.place.stage), state)
            .await
    }

    /// The checkpoint after `step` steps: replica 0's rank of each stage writes the stage's
    /// state (its replicas are equal; split layers gathered from the parts to part 0, sharded
    /// states from the replicas), every
    /// rank acknowledges, the coordinator commits. A rank that rolls back in place keeps its
    /// state in memory too, and each node keeps its own copy: the first replica of each stage
    /// on a node writes the stage there, and the node's first rank commits the node's files
    /// once the coordinator has.
    async fn write_checkpoint(&mut self, step: usize, run: RunRecord) -> Result<()> {
        let store = self.parts.recovery.checkpoint_store()?;
        let in_place = self.in_place.is_some();
        let GridPlace { replica, stage, part } = self.place;
        let writes = part == 0
            && match (in_place, &self.roster) {
                (true, Some(roster)) => roster.first_on_its_host(self.parts.rank, self.replicas_of_stage()),
                _ => replica == 0,
            };
        let checkpoint = RankCheckpoint {
            step,
            file: stage_file(stage),
            writes,
            // Sharded states are gathered from every replica of the stage's part, replica 0's
            // split layers from its layer group.
            gathered: self.parts.job.strategy.sharding || (replica == 0 && self.parts.job.mp_degree() > 1),
            device: &self.parts.device,
            store: &store,
            kept: in_place.then_some(&mut self.kept),
        };
        let (written, state) = checkpoint.write(run).await?;
        let mut written: Vec<HeldFile> = written.into_iter().collect();
        if let (Some(held), Some(state)) = (written.first_mut(), state) {
            held.nodes.extend(self.copy_to_buddy(step, &state).await?);
        }
        let bus = self
            .bus
            .as_mut()
            .context("a checkpointing stage needs a line to the coordinator")?;
        let kept = in_place.then_some(&mut self.kept);
        acknowledge_checkpoint(
            bus,
            (self.parts.rank, step),
            written,
            kept,
            &store,
            self.roster.as_ref(),
        )
        .await
    }
}

impl RankGenerations for StageRun {
    type Run = RunLoop;
    type Outcome = StageOutcome;

    fn rank(&self) -> usize {
        self.parts.rank
    }

    /// Trains from the state after step `first` to the end of the run and evaluates.
    async fn generation(&mut self, run: &mut RunLoop, first: usize) -> Result<StageOutcome> {
        let job = self.parts.job.clone();
        let (rank, stage) = (self.parts.rank, self.place.stage);
        // This generation's part of every global batch (another one when membership changed).
        let (replica, d) = self.replica_place();
        run.loader.place(replica, d)?;
        let restored = self.restore(first).await?;
        let place = Place {
            replica,
            replicas: d,
            role: format!("stage {stage} (replica {replica})"),
        };
        let parts = self.parts.clone();
        let generation = train_generation(self, &parts, place, run, first, restored).await?;
        let parameters = (self.parts.device.send(ReadParameters { keep: replica == 0 }).await??).unwrap_or_default();
        let state_bytes = self.parts.device.send(ReadStateBytes).await??;
        Ok(StageOutcome {
            state_bytes,
            rank,
            steps: run.steps,
            evaluated: generation.score,
            samples_per_sec: generation.samples_per_sec(&job, run.steps),
            allreduce_ratio: generation.comm_time_ratio(),
            exposed_allreduce_ratio: generation.exposed_comm_ratio(),
            peak_activations: generation.peak_activations,
            peak_activation_bytes: generation.peak_activation_bytes,
            bubble_fraction: generation.bubble_fraction(),
            parameters,
            losses: generation.losses,
        })
    }

    fn orders(&mut self) -> Option<&mut Orders> {
        self.in_place.as_mut().map(|in_place| &mut in_place.orders)
    }

    /// Joins the next generation over new stage and data-parallel rings.
    async fn rejoin(&mut self, _run: &mut RunLoop) -> Result<Roster> {
        let in_place = self.in_place.as_mut().context("a rollback without in-place recovery")?;
        let bus = self
            .bus
            .as_mut()
            .context("a stage rolling back needs a line to the coordinator")?;
        let (roster, links) = (in_place.rejoin)(bus).await?.into_relink(self.place.stage);
        let roster = roster.context("a rejoined generation has a roster")?;
        let job = self.parts.job.clone();
        self.parts.device.send(Relink::Stage { job, links }).await??;
        self.roster = Some(roster.clone());
        Ok(roster)
    }
}

impl StrategySteps for StageRun {
    async fn after_step(&mut self, _done: usize) -> Result<()> {
        Ok(())
    }

    async fn checkpoint(&mut self, step: usize, record: RunRecord) -> Result<()> {
        self.write_checkpoint(step, record).await
    }
}

/// The replicas every rank of which trains in `roster`'s generation (all of them, unless
/// elastic membership went on without some), in order.
pub(crate) fn training_replicas(hybrid: &HybridConfigs, roster: &Roster) -> Vec<usize> {
    (0..hybrid.replicas())
        .filter(|&replica| {
            hybrid
                .ranks_of_replica(replica)
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
            state_bytes: StateBytes::default(),
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
