//! The device actor: a `SyncArbiter` thread that owns the compute device,
//! the model replica and the communicator (collective strategy), or the
//! CTR worker (parameter-server strategy). Every tensor operation and every
//! collective of a rank runs here (or on the communicator thread it owns),
//! never on the async arbiters.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use anyhow::{anyhow, Context as _, Result};

use crate::checkpoint::{CheckpointStore, FileRecord};
use crate::collective::training_state::RunRecord;
use crate::collective::{ParamChecksum, Replica, StepReport};
use crate::config::JobConfig;
use crate::data::ctr::CtrBatch;
use crate::data::{Batch, DataPosition, Pieces};
use crate::engines::comm::hierarchy::{self, NodeLayout};
use crate::engines::comm::memory::MemoryRings;
use crate::engines::comm::{parse_endpoints, CommWorker, Communicator, RingBreaker, RingLinks, RingTransport, Shared};
use crate::engines::compute::device_for;
use crate::models::export::ModelInfo;
use crate::models::{Model, ParamInit, Score, SparseModelDef};
use crate::net::auth::Credentials;
use crate::net::protocol::Roster;
use crate::pipeline::link::{StageLink, TransportStageLink};
use crate::pipeline::replica::{PipelineReplica, PipelineReport};
use crate::ps::wire::PulledRows;
use crate::ps::worker::{CtrWorker, PullPlan, ShardUpdate, StepOutcome};
use crate::telemetry::timeline::Span;

/// Builds a rank's model; called on the device thread with the job's seeded
/// initialiser, so every rank builds the same initial parameters.
pub type ModelFactory = Arc<dyn Fn(&ParamInit) -> Result<Model> + Send + Sync>;

/// How this rank reaches its ring neighbours.
pub enum RingLink {
    /// Alone: collectives are no-ops.
    Single,
    /// Threads of one process: the rank's communicator over rings in memory.
    Memory(Communicator),
    /// A rank of a simulated cluster that recovers in place: its end of each generation's ring.
    Simulated {
        /// This rank.
        rank: usize,
        /// The cluster's rings.
        rings: Arc<MemoryRings>,
        /// The nodes a hierarchical all-reduce runs over.
        layout: Option<NodeLayout>,
        /// Where the ring in use is handed, so a rollback order can break it.
        breaker: RingBreaker,
    },
    /// Processes: this rank's listener, bound before the rendezvous so
    /// that its neighbour can connect as soon as the roster is out.
    Tcp {
        /// This rank.
        rank: usize,
        /// Listener already bound to this rank's endpoint.
        listener: TcpListener,
        /// Deadline of connecting and of every collective.
        timeout: Duration,
        /// Use shared memory when every rank is on this host (or, in a hierarchical
        /// all-reduce, in the node ring).
        shared_memory: bool,
        /// `strategy.use_hierarchical_allreduce`.
        hierarchical: Option<bool>,
        /// The job's nodes as its config gives them.
        configured: NodeLayout,
        /// What the ring's connections prove.
        credentials: Credentials,
        /// Where the connected ring's sockets are handed, so a rollback order can break them.
        breaker: RingBreaker,
    },
}

impl RingLink {
    /// This rank's place in the ring.
    fn rank(&self) -> usize {
        match self {
            Self::Single => 0,
            Self::Memory(communicator) => communicator.rank(),
            Self::Simulated { rank, .. } | Self::Tcp { rank, .. } => *rank,
        }
    }

    /// The communicator over this link for the generation of `roster`, as the rendezvous handed
    /// it out: this rank trains at its place in it.
    pub(crate) fn into_communicator(self, roster: &Roster) -> Result<Communicator> {
        let generation = roster.generation;
        let member = self.rank();
        let place = || {
            roster
                .place_of(member)
                .ok_or_else(|| anyhow!("rank {member} is not in the roster of generation {generation}"))
        };
        Ok(match self {
            Self::Single => Communicator::single(),
            Self::Memory(communicator) => communicator,
            Self::Simulated {
                rings, layout, breaker, ..
            } => {
                let (rank, world) = (place()?, roster.world_size());
                let flat = Box::new(rings.take(generation, RANKS_RING, world, rank)?);
                // A generation of fewer ranks than the layout's (elastic membership) rings flat.
                let ring = match layout.filter(|layout| layout.nodes * layout.per_node == world) {
                    Some(layout) => {
                        let (node, local) = (rank / layout.per_node, rank % layout.per_node);
                        let node_ring = rings.take(generation, &format!("node {node}"), layout.per_node, local)?;
                        let rail_ring = rings.take(generation, &format!("rail {local}"), layout.nodes, node)?;
                        Communicator::new(flat).into_levels(Box::new(node_ring), Box::new(rail_ring))
                    }
                    None => Communicator::new(flat),
                };
                breaker.arm(ring.link_breaks());
                ring
            }
            Self::Tcp {
                listener,
                timeout,
                shared_memory,
                hierarchical,
                configured,
                credentials,
                breaker,
                ..
            } => {
                let (rank, endpoints) = (place()?, parse_endpoints(&roster.endpoints)?);
                let abandoned = breaker.abandons(generation);
                let links = RingLinks {
                    endpoints: &endpoints,
                    listener: &listener,
                    timeout,
                    shared_memory,
                    credentials: &credentials,
                    abandoned: &abandoned,
                };
                let ring = hierarchy::connect_communicator(rank, &links, hierarchical, configured)?;
                breaker.arm(ring.link_breaks());
                ring
            }
        })
    }
}

/// The name of a simulated data-parallel job's ring of every rank in [`MemoryRings`].
pub const RANKS_RING: &str = "ranks";

/// Builds the replica: the model, the ring, and rank 0's parameters
/// broadcast to all.
#[derive(Message)]
#[rtype(result = "Result<()>")]
pub struct Prepare {
    /// The job.
    pub job: Arc<JobConfig>,
    /// The model's constructor.
    pub model: ModelFactory,
    /// What the model's checkpoint files say besides its parameters.
    pub export: ModelInfo,
    /// The ring this rank joins.
    pub link: RingLink,
    /// The generation the rank joined: who trains, where.
    pub roster: Roster,
    /// Whether rank 0's initial parameters are broadcast (not when a checkpoint's state is
    /// restored next by every rank).
    pub broadcast: bool,
    /// Batches of the whole run (the learning-rate schedule's length).
    pub steps: usize,
    /// Record a timeline measured from this instant.
    pub trace_from: Option<Instant>,
}

/// Goes on over a new ring after a rollback: the model stays, the communicator is rebuilt.
#[derive(Message)]
#[rtype(result = "Result<()>")]
pub struct Relink {
    /// The job.
    pub job: Arc<JobConfig>,
    /// The ring this rank joins.
    pub link: RingLink,
    /// The generation the rank joined: who trains, where.
    pub roster: Roster,
}

/// The replica's whole training state with the run's record, as a checkpoint file's bytes.
#[derive(Message)]
#[rtype(result = "Result<Vec<u8>>")]
pub struct Snapshot {
    /// Every step's loss so far, and where the streamed data is.
    pub run: RunRecord,
}

/// Every replica's position in the streamed data joined (over the ring of the replicas, or of
/// the stage's replicas): each replica reads only its parts.
#[derive(Message)]
#[rtype(result = "Result<DataPosition>")]
pub struct JoinDataPositions(pub DataPosition);

/// One training step on this rank's batch.
#[derive(Message)]
#[rtype(result = "Result<StepReport>")]
pub struct TrainStep(pub Batch);

/// Counts correct predictions on this rank's batch, summed over ranks.
#[derive(Message)]
#[rtype(result = "Result<Score>")]
pub struct Evaluate(pub Pieces);

/// Compares the replicas' parameter checksums.
#[derive(Message)]
#[rtype(result = "Result<ParamChecksum>")]
pub struct CheckReplicas;

/// Copies out the parameters, by name.
#[derive(Message)]
#[rtype(result = "Result<Vec<(String, Vec<f32>)>>")]
pub struct ReadParameters;

/// Builds the CTR worker of a parameter-server trainer.
#[derive(Message)]
#[rtype(result = "Result<()>")]
pub struct PrepareCtr {
    /// The job.
    pub job: Arc<JobConfig>,
    /// Its sparse model.
    pub model: SparseModelDef,
    /// The trainer's rank.
    pub rank: usize,
}

/// Plans the pull of a CTR batch (training, or evaluation when `training` is false).
#[derive(Message)]
#[rtype(result = "Result<PullPlan>")]
pub struct PlanCtr {
    /// This trainer's part of the batch.
    pub batch: CtrBatch,
    /// Whether the batch is trained on.
    pub training: bool,
}

/// Trains on the planned CTR batch with the rows pulled from each shard.
#[derive(Message)]
#[rtype(result = "Result<StepOutcome>")]
pub struct TrainCtr(pub Vec<PulledRows>);

/// Click probabilities of the planned CTR batch.
#[derive(Message)]
#[rtype(result = "Result<Vec<f32>>")]
pub struct PredictCtr(pub Vec<PulledRows>);

/// Geo mode: the deltas not pushed yet.
#[derive(Message)]
#[rtype(result = "Result<Option<Vec<ShardUpdate>>>")]
pub struct FlushCtr;

/// A parameter-server trainer's own state at a checkpoint (geo's local optimizer state; `None`
/// in the modes where a trainer holds none).
#[derive(Message)]
#[rtype(result = "Result<Option<Vec<u8>>>")]
pub struct CtrOwnState;

/// Takes back a parameter-server trainer's own state.
#[derive(Message)]
#[rtype(result = "Result<()>")]
pub struct RestoreCtrOwnState(pub Arc<Vec<u8>>);

/// Builds this rank's pipeline stage.
#[derive(Message)]
#[rtype(result = "Result<()>")]
pub struct PreparePipeline {
    /// The job.
    pub job: Arc<JobConfig>,
    /// The model's constructor (the stage keeps its own chunks).
    pub model: ModelFactory,
    /// What the model's checkpoint files say besides its parameters.
    pub export: ModelInfo,
    /// This rank, in the whole job.
    pub rank: usize,
    /// This rank's stage.
    pub stage: usize,
    /// Links to the neighbouring stages.
    pub link: StageLinks,
    /// The ring among this stage's data-parallel replicas.
    pub data_parallel: Communicator,
    /// Batches of the whole run (the learning-rate schedule's length).
    pub steps: usize,
    /// Record a timeline measured from this instant.
    pub trace_from: Option<Instant>,
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

/// A pipeline rank goes on over new links after a rollback: the stage stays, its links to the
/// neighbour stages and its replicas' ring are rebuilt.
#[derive(Message)]
#[rtype(result = "Result<()>")]
pub struct RelinkStage {
    /// This rank's stage.
    pub stage: usize,
    /// Links to the neighbouring stages.
    pub link: StageLinks,
    /// The ring among this stage's data-parallel replicas.
    pub data_parallel: Communicator,
}

/// One pipeline step on this replica's part of the batch.
#[derive(Message)]
#[rtype(result = "Result<PipelineReport>")]
pub struct PipelineStep(pub Batch);

/// Evaluates this replica's part of the held-out set through the pipeline.
#[derive(Message)]
#[rtype(result = "Result<Option<Score>>")]
pub struct PipelineEvaluate(pub Pieces);

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

/// The device thread's state: empty until [`Prepare`], [`PrepareCtr`] or [`PreparePipeline`].
#[derive(Default)]
pub struct DeviceActor {
    replica: Option<Replica>,
    ctr: Option<CtrWorker>,
    pipeline: Option<PipelineReplica>,
    /// What the model's checkpoint files say besides its parameters.
    export: ModelInfo,
}

impl DeviceActor {
    fn replica(&mut self) -> Result<&mut Replica> {
        self.replica
            .as_mut()
            .ok_or_else(|| anyhow!("the device actor was used before Prepare"))
    }

    /// This rank's training state — its stage's, or its replica's — with the run's record, to
    /// `out` as one checkpoint file.
    fn save_state(&self, out: &mut dyn std::io::Write, run: &RunRecord) -> Result<()> {
        match (&self.pipeline, &self.replica) {
            (Some(pipeline), _) => pipeline.save_state(out, &self.export, run),
            (None, Some(replica)) => replica.save_state(out, &self.export, run),
            (None, None) => Err(anyhow!("the device actor was used before Prepare")),
        }
    }

    fn pipeline(&mut self) -> Result<&mut PipelineReplica> {
        self.pipeline
            .as_mut()
            .ok_or_else(|| anyhow!("the device actor was used before PreparePipeline"))
    }

    fn ctr(&mut self) -> Result<&mut CtrWorker> {
        self.ctr
            .as_mut()
            .ok_or_else(|| anyhow!("the device actor was used before PrepareCtr"))
    }
}

impl Actor for DeviceActor {
    type Context = SyncContext<Self>;
}

impl Handler<Prepare> for DeviceActor {
    type Result = Result<()>;

    fn handle(&mut self, msg: Prepare, _: &mut Self::Context) -> Result<()> {
        let device = device_for(msg.job.cluster.device, msg.link.rank())?;
        let init = ParamInit::new(msg.job.train.seed, device.clone());
        let model = (msg.model)(&init).context("building the model")?;
        let comm = comm_worker(&msg.job, msg.link, &msg.roster, &device)?;
        let mut replica = Replica::new(model, &msg.job, comm, device, msg.steps)?;
        if msg.broadcast {
            replica.broadcast_parameters()?;
        }
        if let Some(origin) = msg.trace_from {
            replica.trace_from(origin);
        }
        self.replica = Some(replica);
        self.export = msg.export;
        Ok(())
    }
}

/// The communication thread over `link`, with NCCL beside the ring on GPU jobs.
fn comm_worker(job: &JobConfig, link: RingLink, roster: &Roster, device: &candle_core::Device) -> Result<CommWorker> {
    CommWorker::spawn_on(link.into_communicator(roster)?, device, job.fault_tolerance.timeout())
}

impl Handler<Relink> for DeviceActor {
    type Result = Result<()>;

    fn handle(&mut self, msg: Relink, _: &mut Self::Context) -> Result<()> {
        let replica = self.replica()?;
        let device = replica.device().clone();
        let comm = comm_worker(&msg.job, msg.link, &msg.roster, &device)?;
        replica.relink(comm);
        Ok(())
    }
}

impl Handler<Snapshot> for DeviceActor {
    type Result = Result<Vec<u8>>;

    fn handle(&mut self, msg: Snapshot, _: &mut Self::Context) -> Self::Result {
        let mut bytes = Vec::new();
        self.save_state(&mut bytes, &msg.run)?;
        Ok(bytes)
    }
}

impl Handler<JoinDataPositions> for DeviceActor {
    type Result = Result<DataPosition>;

    fn handle(&mut self, msg: JoinDataPositions, _: &mut Self::Context) -> Self::Result {
        match &mut self.pipeline {
            Some(pipeline) => pipeline.join_data_positions(&msg.0),
            None => self.replica()?.join_data_positions(&msg.0),
        }
    }
}

impl Handler<RelinkStage> for DeviceActor {
    type Result = Result<()>;

    fn handle(&mut self, msg: RelinkStage, _: &mut Self::Context) -> Result<()> {
        let pipeline = self.pipeline()?;
        let link = msg.link.on(msg.stage, &pipeline.device().clone())?;
        pipeline.relink(link, msg.data_parallel)
    }
}

impl Handler<TrainStep> for DeviceActor {
    type Result = Result<StepReport>;

    fn handle(&mut self, msg: TrainStep, _: &mut Self::Context) -> Self::Result {
        self.replica()?.train_step(&msg.0)
    }
}

impl Handler<Evaluate> for DeviceActor {
    type Result = Result<Score>;

    fn handle(&mut self, msg: Evaluate, _: &mut Self::Context) -> Self::Result {
        self.replica()?.evaluate(msg.0)
    }
}

impl Handler<CheckReplicas> for DeviceActor {
    type Result = Result<ParamChecksum>;

    fn handle(&mut self, _: CheckReplicas, _: &mut Self::Context) -> Self::Result {
        self.replica()?.check_replicas_agree()
    }
}

impl Handler<ReadParameters> for DeviceActor {
    type Result = Result<Vec<(String, Vec<f32>)>>;

    fn handle(&mut self, _: ReadParameters, _: &mut Self::Context) -> Self::Result {
        if let Some(pipeline) = &self.pipeline {
            return pipeline.parameters();
        }
        self.replica()?
            .parameters()
            .iter()
            .map(|p| Ok((p.name.clone(), p.var.flatten_all()?.to_vec1::<f32>()?)))
            .collect()
    }
}

impl Handler<SaveCheckpoint> for DeviceActor {
    type Result = Result<FileRecord>;

    fn handle(&mut self, msg: SaveCheckpoint, _: &mut Self::Context) -> Self::Result {
        msg.store
            .write_with(msg.step, &msg.file, |out| self.save_state(out, &msg.run))
    }
}

impl Handler<RestoreCheckpoint> for DeviceActor {
    type Result = Result<RunRecord>;

    fn handle(&mut self, msg: RestoreCheckpoint, _: &mut Self::Context) -> Self::Result {
        match &mut self.pipeline {
            Some(pipeline) => pipeline.restore_state(&msg.0),
            None => self.replica()?.restore_state(&msg.0),
        }
    }
}

impl Handler<ShareState> for DeviceActor {
    type Result = Result<Shared>;

    fn handle(&mut self, msg: ShareState, _: &mut Self::Context) -> Self::Result {
        match &mut self.pipeline {
            Some(pipeline) => pipeline.share_state(msg.step, msg.mine),
            None => self.replica()?.share_state(msg.step, msg.mine),
        }
    }
}

impl Handler<PrepareCtr> for DeviceActor {
    type Result = Result<()>;

    fn handle(&mut self, msg: PrepareCtr, _: &mut Self::Context) -> Result<()> {
        let device = device_for(msg.job.cluster.device, msg.rank)?;
        self.ctr = Some(CtrWorker::new(&msg.job, &msg.model, device)?);
        Ok(())
    }
}

impl Handler<PlanCtr> for DeviceActor {
    type Result = Result<PullPlan>;

    fn handle(&mut self, msg: PlanCtr, _: &mut Self::Context) -> Self::Result {
        self.ctr()?.plan(msg.batch, msg.training)
    }
}

impl Handler<TrainCtr> for DeviceActor {
    type Result = Result<StepOutcome>;

    fn handle(&mut self, msg: TrainCtr, _: &mut Self::Context) -> Self::Result {
        self.ctr()?.train_step(msg.0)
    }
}

impl Handler<PredictCtr> for DeviceActor {
    type Result = Result<Vec<f32>>;

    fn handle(&mut self, msg: PredictCtr, _: &mut Self::Context) -> Self::Result {
        self.ctr()?.predict(msg.0)
    }
}

impl Handler<FlushCtr> for DeviceActor {
    type Result = Result<Option<Vec<ShardUpdate>>>;

    fn handle(&mut self, _: FlushCtr, _: &mut Self::Context) -> Self::Result {
        self.ctr()?.flush()
    }
}

impl Handler<CtrOwnState> for DeviceActor {
    type Result = Result<Option<Vec<u8>>>;

    fn handle(&mut self, _: CtrOwnState, _: &mut Self::Context) -> Self::Result {
        self.ctr()?.own_state()
    }
}

impl Handler<RestoreCtrOwnState> for DeviceActor {
    type Result = Result<()>;

    fn handle(&mut self, msg: RestoreCtrOwnState, _: &mut Self::Context) -> Self::Result {
        self.ctr()?.restore_own_state(&msg.0)
    }
}

impl Handler<PreparePipeline> for DeviceActor {
    type Result = Result<()>;

    fn handle(&mut self, msg: PreparePipeline, _: &mut Self::Context) -> Result<()> {
        let device = device_for(msg.job.cluster.device, msg.rank)?;
        let init = ParamInit::new(msg.job.train.seed, device.clone());
        let model = (msg.model)(&init).context("building the model")?;
        let link = msg.link.on(msg.stage, &device)?;
        let mut pipeline =
            PipelineReplica::new(&msg.job, model, msg.stage, link, msg.data_parallel, device, msg.steps)?;
        if let Some(origin) = msg.trace_from {
            pipeline.trace_from(origin);
        }
        self.pipeline = Some(pipeline);
        self.export = msg.export;
        Ok(())
    }
}

/// Hands over the timeline spans recorded so far (collective or pipeline ranks).
#[derive(Message)]
#[rtype(result = "Result<Vec<Span>>")]
pub struct TakeSpans;

impl Handler<TakeSpans> for DeviceActor {
    type Result = Result<Vec<Span>>;

    fn handle(&mut self, _: TakeSpans, _: &mut Self::Context) -> Self::Result {
        match &mut self.pipeline {
            Some(pipeline) => Ok(pipeline.take_spans()),
            None => Ok(self.replica()?.take_spans()),
        }
    }
}

impl Handler<PipelineStep> for DeviceActor {
    type Result = Result<PipelineReport>;

    fn handle(&mut self, msg: PipelineStep, _: &mut Self::Context) -> Self::Result {
        self.pipeline()?.train_step(&msg.0)
    }
}

impl Handler<PipelineEvaluate> for DeviceActor {
    type Result = Result<Option<Score>>;

    fn handle(&mut self, msg: PipelineEvaluate, _: &mut Self::Context) -> Self::Result {
        self.pipeline()?.evaluate(msg.0)
    }
}
