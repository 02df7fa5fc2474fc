//! The device actor: a `SyncArbiter` thread that owns the compute device and the rank's
//! replica — the whole model of a data-parallel rank, a pipeline rank's stage — with the
//! communicators it trains over. Every tensor operation and every collective of the rank runs
//! here (or on the communicator thread it owns), never on the async arbiters. One replica
//! trait serves every strategy; only preparing and relinking know which it is. (A
//! parameter-server trainer's device thread is [`super::ctr_device::CtrDevice`].)

use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use anyhow::{anyhow, bail, Context as _, Result};

use crate::checkpoint::{CheckpointStore, FileRecord};
use crate::collective::tensor_parallel::RingGroup;
use crate::collective::training_state::RunRecord;
use crate::collective::{ParamChecksum, RankReplica, Replica, StateBytes, StepReport};
use crate::config::JobConfig;
use crate::data::{Batch, DataPosition, Pieces};
use crate::engines::comm::hierarchy::{self, NodeLayout};
use crate::engines::comm::memory::MemoryRings;
use crate::engines::comm::{
    parse_endpoints, CommWorker, Communicator, RingBreaker, RingLinks, RingPlace, RingTransport, Shared,
};
use crate::engines::compute::device_for;
use crate::models::export::ModelInfo;
use crate::models::{Model, ParamInit, Score};
use crate::net::auth::Credentials;
use crate::net::protocol::Roster;
use crate::pipeline::link::{StageLink, TransportStageLink};
use crate::pipeline::replica::PipelineReplica;
use crate::telemetry::timeline::Span;

/// Builds a rank's model; called on the device thread with the job's seeded
/// initialiser, so every rank builds the same initial parameters.
pub type ModelFactory = Arc<dyn Fn(&ParamInit) -> Result<Model> + Send + Sync>;

/// How this rank reaches its ring neighbours.
pub enum RingLink {
    /// Alone: collectives are no-ops.
    Single,
    /// A rank of a simulated cluster (threads of one process): its end of each generation's
    /// rings in memory.
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
                let rank = place()?;
                let tcp = TcpRings {
                    listener: &listener,
                    timeout,
                    shared_memory,
                    credentials: &credentials,
                    breaker: &breaker,
                };
                let ring = tcp.connect(roster, |links| {
                    hierarchy::connect_communicator(rank, links, hierarchical, configured)
                })?;
                breaker.arm(ring.link_breaks());
                ring
            }
        })
    }
}

/// The rings of a data-parallel rank: among the replicas of its part of the model, and, where
/// its layers are split (tensor parallelism), among the ranks that split them.
pub(crate) struct RankRings {
    /// The data-parallel ring.
    pub replicas: Communicator,
    /// The layer group's ring.
    pub layers: Option<Communicator>,
}

impl RingLink {
    /// Rank `self`'s rings in `roster`'s generation of `job`: the one ring of all the ranks, or
    /// with `hybrid_configs.mp_degree` > 1 the data-parallel ring of its part of the layers
    /// (ranks `r·mp + part`) and its replica's layer group (ranks `replica·mp + 0..mp`).
    pub(crate) fn into_rings(self, roster: &Roster, job: &JobConfig) -> Result<RankRings> {
        let mp = job.mp_degree();
        if mp == 1 {
            let replicas = self.into_communicator(roster)?;
            return Ok(RankRings { replicas, layers: None });
        }
        let generation = roster.generation;
        let member = self.rank();
        let rank = roster
            .place_of(member)
            .ok_or_else(|| anyhow!("rank {member} is not in the roster of generation {generation}"))?;
        let (replica, part) = job.tensor_place_of(rank);
        let replicas = roster.world_size() / mp;
        let data_parallel: Vec<usize> = (0..replicas).map(|r| r * mp + part).collect();
        let group: Vec<usize> = (0..mp).map(|p| replica * mp + p).collect();
        let (data_name, group_name) = (
            format!("the data-parallel ring of layer part {part}"),
            format!("the layer group of replica {replica}"),
        );
        // A ring of one (one replica, or a group of one) is no ring: its collectives are no-ops.
        let (replicas, layers, breaker) = match self {
            Self::Simulated { rings, breaker, .. } => {
                let take = |name: &str, size: usize, position: usize| -> Result<Communicator> {
                    Ok(match size {
                        1 => Communicator::single(),
                        _ => Communicator::new(Box::new(rings.take(generation, name, size, position)?)),
                    })
                };
                (
                    take(&data_name, replicas, replica)?,
                    take(&group_name, mp, part)?,
                    breaker,
                )
            }
            Self::Tcp {
                listener,
                timeout,
                shared_memory,
                credentials,
                breaker,
                ..
            } => {
                let tcp = TcpRings {
                    listener: &listener,
                    timeout,
                    shared_memory,
                    credentials: &credentials,
                    breaker: &breaker,
                };
                let (replicas, layers) = tcp.connect(roster, |links| {
                    // A listener takes a hello only from its ring-left neighbour: the ring of all
                    // the ranks first, whose barriers keep the next two rings' connecting apart.
                    let world = links.endpoints.len();
                    let mut all = Communicator::new(links.connect(RingPlace::identity(rank, world))?);
                    all.barrier("the ring of all ranks connected")?;
                    let connect = |members: Vec<usize>, position: usize, name: &str| -> Result<Communicator> {
                        if members.len() == 1 {
                            return Ok(Communicator::single());
                        }
                        let place = RingPlace::new(position, members)?;
                        let ring = links
                            .connect(place)
                            .with_context(|| format!("rank {rank}: connecting {name}"))?;
                        Ok(Communicator::new(ring))
                    };
                    let replicas = connect(data_parallel, replica, &data_name)?;
                    all.barrier("data-parallel rings connected")?;
                    Ok((replicas, connect(group, part, &group_name)?))
                })?;
                (replicas, layers, breaker)
            }
            Self::Single => bail!("rank {member} trains alone: it has no layer group"),
        };
        breaker.arm(replicas.link_breaks().into_iter().chain(layers.link_breaks()));
        Ok(RankRings {
            replicas,
            layers: Some(layers),
        })
    }
}

/// What connecting a rank's rings over TCP (or shared memory between processes) takes.
struct TcpRings<'a> {
    listener: &'a TcpListener,
    timeout: Duration,
    shared_memory: bool,
    credentials: &'a Credentials,
    breaker: &'a RingBreaker,
}

impl TcpRings<'_> {
    /// `connect` over the links to the endpoints of `roster`'s generation, given up if a
    /// rollback order passes that generation.
    fn connect<T>(&self, roster: &Roster, connect: impl FnOnce(&RingLinks) -> Result<T>) -> Result<T> {
        let endpoints = parse_endpoints(&roster.endpoints)?;
        let abandoned = self.breaker.abandons(roster.generation);
        connect(&RingLinks {
            endpoints: &endpoints,
            listener: self.listener,
            timeout: self.timeout,
            shared_memory: self.shared_memory,
            credentials: self.credentials,
            abandoned: &abandoned,
        })
    }
}

/// The name of a simulated data-parallel job's ring of every rank in [`MemoryRings`].
pub const RANKS_RING: &str = "ranks";

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
    Stage(StageRelink),
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

/// Copies out the parameters, by name.
#[derive(Message)]
#[rtype(result = "Result<Vec<(String, Vec<f32>)>>")]
pub struct ReadParameters;

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
        let init = ParamInit::new(msg.job.train.seed, device.clone());
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
            ReplicaPart::Stage { links, .. } => {
                let link = links.link.on(links.stage, &device)?;
                let stage = links.stage;
                DeviceState::Stage(PipelineReplica::new(
                    &msg.job,
                    model,
                    stage,
                    link,
                    links.data_parallel,
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
            (DeviceState::Stage(stage), Relink::Stage(links)) => {
                let link = links.link.on(links.stage, &stage.device().clone())?;
                stage.relink(link, links.data_parallel)
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
    type Result = Result<Vec<(String, Vec<f32>)>>;

    fn handle(&mut self, _: ReadParameters, _: &mut Self::Context) -> Self::Result {
        self.state.replica()?.parameters()
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
