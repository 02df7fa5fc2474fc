//! The device actor: a `SyncArbiter` thread that owns the compute device and the rank's
//! replica — the whole model of a data-parallel rank, a pipeline rank's stage — with the
//! communicators it trains over. Every tensor operation and every collective of the rank runs
//! here (or on the communicator thread it owns), never on the async arbiters. One replica
//! trait serves every strategy; only preparing and relinking know which it is. (A
//! parameter-server trainer's device thread is [`super::ctr_device::CtrDevice`].)

use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use anyhow::{anyhow, Context as _, Result};

use super::ring_link::{RankRings, RingLink};
use crate::checkpoint::{CheckpointStore, FileRecord};
use crate::collective::tensor_parallel::RingGroup;
use crate::collective::training_state::RunRecord;
use crate::collective::{ParamChecksum, RankReplica, Replica, StateBytes, StepReport};
use crate::config::JobConfig;
use crate::data::{Batch, DataPosition, Pieces};
use crate::engines::comm::{CommWorker, Communicator, RingTransport, Shared};
use crate::engines::compute::device_for;
use crate::models::export::ModelInfo;
use crate::models::{Model, NamedValues, ParamInit, Precision, Score};
use crate::net::protocol::Roster;
use crate::pipeline::link::{StageLink, TransportStageLink};
use crate::pipeline::replica::PipelineReplica;
use crate::telemetry::timeline::Span;

/// Builds a rank's model; called on the device thread with the job's seeded
/// initialiser, so every rank builds the same initial parameters.
pub type ModelFactory = Arc<dyn Fn(&ParamInit) -> Result<Model> + Send + Sync>;

/// Builds the rank's replica: the model (from the job's seed, the same on every rank), the
/// part of it this rank holds, and its links.
#[derive(Message)]
#[rtype(result = "Result<()>")]
pub struct Prepare {
    /// The job.
    pub job: Arc<JobConfig>,
    /// The model's constructor.
    pub model: ModelFactory,
    /// What the model's checkpoint files say besides its parameters.
    pub export: ModelInfo,
    /// What this rank holds, and how it reaches the ranks it trains with.
    pub part: ReplicaPart,
    /// Batches of the whole run (the learning-rate schedule's length).
    pub steps: usize,
    /// Record a timeline measured from this instant.
    pub trace_from: Option<Instant>,
}

/// What a rank's replica is, by strategy.
pub enum ReplicaPart {
    /// A data-parallel rank: the whole model, its ring among every rank.
    Whole {
        /// The ring this rank joins.
        link: RingLink,
        /// The generation the rank joined: who trains, where.
        roster: Roster,
        /// Whether rank 0's initial parameters are broadcast (not when a checkpoint's state
        /// is restored next by every rank).
        broadcast: bool,
    },
    /// A pipeline rank: one stage of a replica of the pipeline.
    Stage {
        /// This rank, in the whole job.
        rank: usize,
        /// The stage's links.
        links: StageRelink,
    },
}

/// A pipeline rank's links: to its neighbour stages and among its stage's replicas.
pub struct StageRelink {
    /// This rank's stage.
    pub stage: usize,
    /// Links to the neighbouring stages.
    pub link: StageLinks,
    /// The ring among this stage's data-parallel replicas.
    pub data_parallel: Communicator,
    /// The ring of the ranks that split the stage's layers with this one, where they are split.
    pub layers: Option<Communicator>,
}

impl StageRelink {
    /// The layer group's communication thread, where the layers are split.
    fn layer_worker(&mut self, job: &JobConfig, device: &candle_core::Device) -> Result<Option<CommWorker>> {
        let timeout = job.fault_tolerance.timeout();
        self.layers
            .take()
            .map(|ring| CommWorker::spawn_on(ring, device, timeout))
            .transpose()
    }
}

/// Goes on over new links after a rollback: the replica stays, its links are rebuilt (the
/// state comes from a snapshot next).
#[derive(Message)]
#[rtype(result = "Result<()>")]
pub enum Relink {
    /// A data-parallel rank's new ring.
    Ring {
        /// The job.
        job: Arc<JobConfig>,
        /// The ring this rank joins.
        link: RingLink,
        /// The generation the rank joined: who trains, where.
        roster: Roster,
    },
    /// A pipeline rank's new links.
    Stage {
        /// The job.
        job: Arc<JobConfig>,
        /// The links.
        links: StageRelink,
    },
}

/// How a pipeline stage reaches its neighbour stages.
pub enum StageLinks {
    /// Made already: channels between the threads of one process (a one-stage pipeline's
    /// loop to itself included).
    Made(Box<dyn StageLink>),
    /// Connected ring transports to stages in other processes; the device thread wraps them
    /// in a [`TransportStageLink`], so that received tensors land on its device.
    Rings {
        /// Ring rank `stage` of the replica's stages in order.
        forward: Box<dyn RingTransport>,
        /// Ring rank `p − 1 − stage` of the replica's stages in reverse order.
        backward: Box<dyn RingTransport>,
    },
}

impl StageLinks {
    /// Stage `stage`'s link, receiving tensors onto `device`.
    fn on(self, stage: usize, device: &candle_core::Device) -> Result<Box<dyn StageLink>> {
        Ok(match self {
            StageLinks::Made(link) => link,
            StageLinks::Rings { forward, backward } => {
                Box::new(TransportStageLink::new(stage, forward, backward, device.clone())?)
            }
        })
    }
}

/// The replica's whole training state with the run's record, as a checkpoint file's bytes.
#[derive(Message)]
#[rtype(result = "Result<Vec<u8>>")]
pub struct Snapshot {
    /// Every step's loss so far, and where the streamed data is.
    pub run: RunRecord,
}

/// Takes part in a save that another rank of the ring writes ([`RankReplica::join_save`]).
#[derive(Message)]
#[rtype(result = "Result<()>")]
pub struct JoinSave;

/// Every replica's position in the streamed data joined (over the ring of the replicas, or of
/// the stage's replicas): each replica reads only its parts.
#[derive(Message)]
#[rtype(result = "Result<DataPosition>")]
pub struct JoinDataPositions(pub DataPosition);

/// One training step on this rank's part of the global batch.
#[derive(Message)]
#[rtype(result = "Result<StepReport>")]
pub struct TrainStep(pub Batch);

/// The score of this replica's share of the held-out split, summed over the replicas; `None`
/// where the rank holds no output (a pipeline stage before the last).
#[derive(Message)]
#[rtype(result = "Result<Option<Score>>")]
pub struct Evaluate(pub Pieces);

/// Compares the replicas' parameter checksums.
#[derive(Message)]
#[rtype(result = "Result<ParamChecksum>")]
pub struct CheckReplicas;

/// Copies out the whole model's parameters, by name, on the rank that keeps them (the one that
/// reports them); every rank of the ring and of the layer group joins the gathers.
#[derive(Message)]
#[rtype(result = "Result<Option<NamedValues>>")]
pub struct ReadParameters {
    /// Whether this rank keeps them (`None` is answered elsewhere).
    pub keep: bool,
}

/// Tells the bytes of state the rank holds.
#[derive(Message)]
#[rtype(result = "Result<StateBytes>")]
pub struct ReadStateBytes;

/// Writes this rank's training state as file `file` of step `step`'s checkpoint in `store`.
#[derive(Message)]
#[rtype(result = "Result<FileRecord>")]
pub struct SaveCheckpoint {
    /// The job's checkpoint directory.
    pub store: CheckpointStore,
    /// The step the checkpoint is taken after.
    pub step: usize,
    /// The file's name in the step's directory.
    pub file: String,
    /// The losses this rank has seen and where the streamed data is, kept with the state.
    pub run: RunRecord,
}

/// Continues from a training state written by [`SaveCheckpoint`]; answers the run record it
/// held.
#[derive(Message)]
#[rtype(result = "Result<RunRecord>")]
pub struct RestoreCheckpoint(pub Arc<Vec<u8>>);

/// Gives the state after step `step` to the ranks that lack it: `Some` where this rank holds
/// it. Answers where this rank's copy came from.
#[derive(Message)]
#[rtype(result = "Result<Shared>")]
pub struct ShareState {
    /// The step the state is of.
    pub step: usize,
    /// This rank's copy, if it holds one.
    pub mine: Option<Arc<Vec<u8>>>,
}

/// What the device thread holds: nothing until [`Prepare`], then the rank's replica.
#[derive(Default)]
enum DeviceState {
    #[default]
    Unprepared,
    Whole(Replica),
    Stage(PipelineReplica),
}

/// The device thread's state.
#[derive(Default)]
pub struct DeviceActor {
    state: DeviceState,
    /// What the model's checkpoint files say besides its parameters.
    export: ModelInfo,
}

impl DeviceState {
    /// The rank's replica, whatever its strategy.
    fn replica(&mut self) -> Result<&mut dyn RankReplica> {
        match self {
            DeviceState::Whole(replica) => Ok(replica),
            DeviceState::Stage(stage) => Ok(stage),
            DeviceState::Unprepared => Err(anyhow!("the device actor was used before Prepare")),
        }
    }
}

impl Actor for DeviceActor {
    type Context = SyncContext<Self>;
}

impl Handler<Prepare> for DeviceActor {
    type Result = Result<()>;

    fn handle(&mut self, msg: Prepare, _: &mut Self::Context) -> Result<()> {
        let rank = match &msg.part {
            ReplicaPart::Whole { link, .. } => link.rank(),
            ReplicaPart::Stage { rank, .. } => *rank,
        };
        let device = device_for(msg.job.cluster.device, rank)?;
        let init = ParamInit::new(msg.job.train.seed, device.clone())
            .with_products(Precision::of(&msg.job))
            .deferring(msg.job.defers_parameters() && matches!(msg.part, ReplicaPart::Whole { .. }));
        let model = (msg.model)(&init).context("building the model")?;
        self.state = match msg.part {
            ReplicaPart::Whole {
                link,
                roster,
                broadcast,
            } => {
                let rings = rank_rings(&msg.job, link, &roster, &device)?;
                let mut replica = Replica::new(model, &msg.job, rings, device, msg.steps)?;
                if broadcast {
                    replica.broadcast_parameters()?;
                }
                DeviceState::Whole(replica)
            }
            ReplicaPart::Stage { mut links, .. } => {
                let layers = links
                    .layer_worker(&msg.job, &device)?
                    .map(|comm| Arc::new(RingGroup::new(comm)));
                let link = links.link.on(links.stage, &device)?;
                DeviceState::Stage(PipelineReplica::new(
                    &msg.job,
                    model,
                    (links.stage, link),
                    (links.data_parallel, layers),
                    device,
                    msg.steps,
                )?)
            }
        };
        if let Some(origin) = msg.trace_from {
            self.state.replica()?.trace_from(origin);
        }
        self.export = msg.export;
        Ok(())
    }
}

/// The communication threads over `link`'s rings: the data-parallel ring's (with NCCL beside it
/// on GPU jobs), and the layer group's where the layers are split.
fn comm_workers(
    job: &JobConfig,
    link: RingLink,
    roster: &Roster,
    device: &candle_core::Device,
) -> Result<(CommWorker, Option<CommWorker>)> {
    let RankRings { mut replicas, layers } = link.into_rings(roster, job)?;
    if job.shards_within_nodes() {
        replicas = replicas.sharding_within_nodes()?;
    }
    let timeout = job.fault_tolerance.timeout();
    let layers = layers
        .map(|ring| CommWorker::spawn_on(ring, device, timeout))
        .transpose()?;
    Ok((CommWorker::spawn_on(replicas, device, timeout)?, layers))
}

/// A new replica's rings ([`comm_workers`]), its layer group's as the split layers see it.
fn rank_rings(
    job: &JobConfig,
    link: RingLink,
    roster: &Roster,
    device: &candle_core::Device,
) -> Result<(CommWorker, Option<Arc<RingGroup>>)> {
    let (replicas, layers) = comm_workers(job, link, roster, device)?;
    Ok((replicas, layers.map(|comm| Arc::new(RingGroup::new(comm)))))
}

impl Handler<Relink> for DeviceActor {
    type Result = Result<()>;

    fn handle(&mut self, msg: Relink, _: &mut Self::Context) -> Result<()> {
        match (&mut self.state, msg) {
            (DeviceState::Whole(replica), Relink::Ring { job, link, roster }) => {
                let (comm, layers) = comm_workers(&job, link, &roster, &replica.device().clone())?;
                replica.relink(comm, layers)
            }
            (DeviceState::Stage(stage), Relink::Stage { job, mut links }) => {
                let device = stage.device().clone();
                let layers = links.layer_worker(&job, &device)?;
                let link = links.link.on(links.stage, &device)?;
                stage.relink(link, links.data_parallel, layers)
            }
            _ => Err(anyhow!("a relink of another strategy than the rank's replica")),
        }
    }
}

impl Handler<TrainStep> for DeviceActor {
    type Result = Result<StepReport>;

    fn handle(&mut self, msg: TrainStep, _: &mut Self::Context) -> Self::Result {
        self.state.replica()?.train_step(&msg.0)
    }
}

impl Handler<Evaluate> for DeviceActor {
    type Result = Result<Option<Score>>;

    fn handle(&mut self, msg: Evaluate, _: &mut Self::Context) -> Self::Result {
        self.state.replica()?.evaluate(msg.0)
    }
}

impl Handler<CheckReplicas> for DeviceActor {
    type Result = Result<ParamChecksum>;

    fn handle(&mut self, _: CheckReplicas, _: &mut Self::Context) -> Self::Result {
        self.state.replica()?.check_replicas_agree()
    }
}

impl Handler<ReadStateBytes> for DeviceActor {
    type Result = Result<StateBytes>;

    fn handle(&mut self, _: ReadStateBytes, _: &mut Self::Context) -> Self::Result {
        Ok(self.state.replica()?.state_bytes())
    }
}

impl Handler<ReadParameters> for DeviceActor {
    type Result = Result<Option<NamedValues>>;

    fn handle(&mut self, msg: ReadParameters, _: &mut Self::Context) -> Self::Result {
        self.state.replica()?.parameters(msg.keep)
    }
}

impl Handler<Snapshot> for DeviceActor {
    type Result = Result<Vec<u8>>;

    fn handle(&mut self, msg: Snapshot, _: &mut Self::Context) -> Self::Result {
        let mut bytes = Vec::new();
        self.state.replica()?.save_state(&mut bytes, &self.export, &msg.run)?;
        Ok(bytes)
    }
}

impl Handler<JoinSave> for DeviceActor {
    type Result = Result<()>;

    fn handle(&mut self, _: JoinSave, _: &mut Self::Context) -> Self::Result {
        self.state.replica()?.join_save()
    }
}

impl Handler<SaveCheckpoint> for DeviceActor {
    type Result = Result<FileRecord>;

    fn handle(&mut self, msg: SaveCheckpoint, _: &mut Self::Context) -> Self::Result {
        let replica = self.state.replica()?;
        msg.store.write_with(msg.step, &msg.file, |out| {
            replica.save_state(out, &self.export, &msg.run)
        })
    }
}

impl Handler<RestoreCheckpoint> for DeviceActor {
    type Result = Result<RunRecord>;

    fn handle(&mut self, msg: RestoreCheckpoint, _: &mut Self::Context) -> Self::Result {
        self.state.replica()?.restore_state(&msg.0)
    }
}

impl Handler<ShareState> for DeviceActor {
    type Result = Result<Shared>;

    fn handle(&mut self, msg: ShareState, _: &mut Self::Context) -> Self::Result {
        self.state.replica()?.share_state(msg.step, msg.mine)
    }
}

impl Handler<JoinDataPositions> for DeviceActor {
    type Result = Result<DataPosition>;

    fn handle(&mut self, msg: JoinDataPositions, _: &mut Self::Context) -> Self::Result {
        self.state.replica()?.join_data_positions(&msg.0)
    }
}

/// Hands over the timeline spans recorded so far.
#[derive(Message)]
#[rtype(result = "Result<Vec<Span>>")]
pub struct TakeSpans;

impl Handler<TakeSpans> for DeviceActor {
    type Result = Result<Vec<Span>>;

    fn handle(&mut self, _: TakeSpans, _: &mut Self::Context) -> Self::Result {
        Ok(self.state.replica()?.take_spans())
    }
}
