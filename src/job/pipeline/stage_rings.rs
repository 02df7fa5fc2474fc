//! The rings of one rank of a launched pipeline job, all served by the rank's one data
//! endpoint: the data-parallel ring among its stage's replicas, the forward and backward rings
//! among its replica's stages, and the ring of the ranks that split its stage's layers. A
//! listener accepts only a hello from its ring-left neighbour, so the rings are connected in
//! phases that coordinator barriers keep apart.

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};

use crate::actors::device::StageLinks;
use crate::actors::stage::training_replicas;
use crate::config::{GridPlace, JobConfig};
use crate::engines::comm::{Abandoned, Communicator, RingLinks, RingPlace, RingTransport};
use crate::net::auth::Credentials;
use crate::net::protocol::Roster;
use crate::net::ControlBus;
use crate::pipeline::link::memory_links;

/// Connects rank `rank`'s rings over `listener`, its data endpoint: (a) the data-parallel ring
/// of its part of its stage (the ranks of that part and stage in the replicas training in
/// `roster`'s generation, when more than one does), then (b) the forward stage ring of its
/// part of its replica (when `pp_degree` > 1), then (c) the backward one, then (d) its stage's
/// layer group (when `mp_degree` > 1). A rollback order past the roster's generation
/// (`abandoned`) stops the connecting.
pub(super) async fn connect(
    bus: &mut ControlBus,
    config: &JobConfig,
    rank: usize,
    roster: &Roster,
    listener: TcpListener,
    credentials: Credentials,
    abandoned: Abandoned,
) -> Result<(StageLinks, Communicator, Option<Communicator>)> {
    let hybrid = &config.strategy.hybrid_configs;
    let (p, mp) = (hybrid.pp_degree, config.mp_degree());
    let GridPlace { replica, stage, part } = hybrid.place_of(rank);
    // Rings name the part they join only where the layers are split.
    let of_part = match mp {
        1 => String::new(),
        _ => format!("part {part} of "),
    };
    let training = training_replicas(hybrid, roster);
    let rings = Rings {
        who: hybrid.name_of(rank),
        listener,
        endpoints: endpoints(config, roster)?,
        timeout: config.fault_tolerance.timeout(),
        shared_memory: config.cluster.shared_memory,
        credentials,
        abandoned,
    };
    let data_parallel = if training.len() > 1 {
        let replicas: Vec<usize> = training
            .iter()
            .map(|&replica| hybrid.rank_of(GridPlace { replica, stage, part }))
            .collect();
        let position = training.iter().position(|&r| r == replica).with_context(|| {
            format!(
                "{} does not train in generation {}",
                hybrid.name_of(rank),
                roster.generation
            )
        })?;
        let name = format!("the data-parallel ring of {of_part}stage {stage}");
        Communicator::new(rings.connect(&name, replicas, position).await?)
    } else {
        Communicator::single()
    };
    let mut connected = training.len() > 1;
    let link = if p > 1 {
        if connected {
            bus.barrier(rank, "data-parallel rings connected").await?;
        }
        let stages = hybrid.stages_of(replica, part);
        let name = format!("the forward stage ring of {of_part}replica {replica}");
        let forward = rings.connect(&name, stages.clone(), stage).await?;
        bus.barrier(rank, "forward stage rings connected").await?;
        let name = format!("the backward stage ring of {of_part}replica {replica}");
        let backward = rings
            .connect(&name, stages.into_iter().rev().collect(), p - 1 - stage)
            .await?;
        connected = true;
        StageLinks::Rings { forward, backward }
    } else {
        // One stage: hand-offs between its own chunks (interleaving) loop back in memory.
        let to_itself = memory_links(1, rings.timeout).pop();
        StageLinks::Made(Box::new(to_itself.context("a one-stage pipeline has a link")?))
    };
    let layers = if mp > 1 {
        if connected {
            bus.barrier(rank, "stage rings connected").await?;
        }
        Some(rings.layer_group(config, rank).await?)
    } else {
        None
    };
    tracing::info!("{}: pipeline rings connected", rings.who);
    Ok((link, data_parallel, layers))
}

/// Every rank's data endpoint in `roster`, by rank; one not training this generation (never
/// connected to) as the unspecified address.
fn endpoints(config: &JobConfig, roster: &Roster) -> Result<Vec<SocketAddr>> {
    let unspecified = SocketAddr::from(([0, 0, 0, 0], 0));
    (0..config.world_size())
        .map(|member| match roster.endpoint_of(member) {
            Some(endpoint) => endpoint
                .parse::<SocketAddr>()
                .with_context(|| format!("rank {member} announced a bad endpoint {endpoint:?}")),
            None => Ok(unspecified),
        })
        .collect()
}

/// What connecting one of a rank's rings takes.
struct Rings {
    /// Names the rank in errors.
    who: String,
    listener: TcpListener,
    /// Every rank's data endpoint, by rank.
    endpoints: Vec<SocketAddr>,
    timeout: Duration,
    shared_memory: bool,
    credentials: Credentials,
    abandoned: Abandoned,
}

impl Rings {
    /// The ring of the ranks that split the layers of rank `rank`'s stage with it.
    async fn layer_group(&self, config: &JobConfig, rank: usize) -> Result<Communicator> {
        let hybrid = &config.strategy.hybrid_configs;
        let place = hybrid.place_of(rank);
        let members = (0..config.mp_degree())
            .map(|part| hybrid.rank_of(GridPlace { part, ..place }))
            .collect();
        let name = format!("the layer group of stage {} of replica {}", place.stage, place.replica);
        Ok(Communicator::new(self.connect(&name, members, place.part).await?))
    }

    /// Joins the ring over `members` (global ranks, in ring order) at `position`. Connecting
    /// blocks, so it runs on the blocking pool: the coordinator that rank 0 hosts on this
    /// thread keeps answering meanwhile.
    async fn connect(&self, name: &str, members: Vec<usize>, position: usize) -> Result<Box<dyn RingTransport>> {
        let context = || format!("{}: connecting {name} (ranks {members:?})", self.who);
        let place = RingPlace::new(position, members.clone()).with_context(context)?;
        let listener = self.listener.try_clone().with_context(context)?;
        let endpoints = self.endpoints.clone();
        let (timeout, shared_memory) = (self.timeout, self.shared_memory);
        let (credentials, abandoned) = (self.credentials.clone(), self.abandoned.clone());
        let transport = tokio::task::spawn_blocking(move || {
            let links = RingLinks {
                endpoints: &endpoints,
                listener: &listener,
                timeout,
                shared_memory,
                credentials: &credentials,
                abandoned: &abandoned,
            };
            links.connect(place)
        })
        .await
        .map_err(|e| anyhow!("the connecting thread failed: {e}"))
        .and_then(|connected| connected)
        .with_context(context)?;
        tracing::debug!("{}: connected {name}", self.who);
        Ok(transport)
    }
}
