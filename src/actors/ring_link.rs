//! How a data-parallel rank reaches its ring neighbours, and the rings it connects from that
//! in each generation: the ring of every rank, or (tensor parallelism) the data-parallel ring of
//! its part of the layers and its layer group's ring.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _, Result};

use crate::config::{GridPlace, JobConfig};
use crate::engines::comm::hierarchy::{self, NodeLayout};
use crate::engines::comm::memory::MemoryRings;
use crate::engines::comm::{parse_endpoints, Communicator, RingBreaker, RingLinks, RingPlace};
use crate::net::auth::Credentials;
use crate::net::protocol::Roster;

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
    pub(crate) fn rank(&self) -> usize {
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
        let GridPlace { replica, part, .. } = job.strategy.hybrid_configs.place_of(rank);
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
