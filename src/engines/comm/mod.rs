//! Communicators: collectives over a ring of ranks.
//!
//! Vocabulary, as nccl-tests uses it:
//! - **rank**: one participant, `0..world_size`; its *right* neighbour is
//!   `rank + 1 (mod n)`, its *left* one `rank - 1 (mod n)`.
//! - **transport**: how bytes reach the neighbours — [`tcp`] sockets between
//!   processes, [`shm`] shared memory between processes of one host, or
//!   [`memory`] channels between threads of one process. All carry the same
//!   messages, so the algorithms above them are identical and give
//!   bit-identical results in every world.
//! - **ring all-reduce**: reduce-scatter then all-gather, `2(n-1)` steps,
//!   each moving `1/n` of the buffer ([`ring`]).
//! - **hierarchical all-reduce**: with several ranks on each of several
//!   nodes, reduce-scatter in the node, all-reduce across nodes, all-gather
//!   in the node ([`hierarchy`]).
//! - **worker**: a thread that owns a communicator and runs collectives
//!   submitted by the compute thread, so communication overlaps backward
//!   ([`worker`]).

pub mod breaker;
pub mod hierarchy;
mod links;
pub mod memory;
#[cfg(feature = "cuda")]
pub mod nccl;
mod place;
pub mod ring;
mod send_queue;
mod share;
pub mod shm;
pub mod tcp;
mod tensors;
pub mod transport;
pub mod wire;
pub mod worker;

pub use breaker::{Abandoned, LinkBreak, RingBreaker};
pub use place::RingPlace;
pub use ring::Communicator;
pub use share::Shared;
pub use transport::RingTransport;
pub use wire::Wire;
pub use worker::{CommWorker, Pending};

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use anyhow::Context;

use crate::net::auth::Credentials;
use tcp::ReceiveLeft;

/// What connecting a rank's rings takes: every rank's data endpoint (by global rank), the
/// rank's one listener, and how its connections are made.
pub struct RingLinks<'a> {
    /// Every rank's data endpoint, by rank.
    pub endpoints: &'a [SocketAddr],
    /// This rank's listener (every ring's).
    pub listener: &'a TcpListener,
    /// Deadline of connecting each ring.
    pub timeout: Duration,
    /// Whether a ring whose members share a host may use shared memory.
    pub shared_memory: bool,
    /// What the rings' connections prove.
    pub credentials: &'a Credentials,
    /// Stops the connecting on a rollback order.
    pub abandoned: &'a Abandoned,
}

impl RingLinks<'_> {
    /// The member at `place` joins its ring, its members' endpoints those of their global
    /// ranks: over shared memory when `shared_memory` allows it and every member is on one
    /// host that has `/dev/shm`, over TCP otherwise. Every connection starts with the
    /// cluster-token handshake.
    pub fn connect(&self, place: RingPlace) -> anyhow::Result<Box<dyn RingTransport>> {
        let endpoints = place
            .ranks()
            .iter()
            .map(|&rank| self.endpoints.get(rank).copied())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| anyhow::anyhow!("{place}: the roster lists {} endpoints", self.endpoints.len()))?;
        connect_ring_transport(
            place,
            &endpoints,
            self.listener,
            self.timeout,
            self.shared_memory,
            self.credentials,
            self.abandoned,
        )
    }
}

/// The transport of the member at `place` of a ring whose members are at `endpoints`, by
/// position (see [`RingLinks::connect`]).
pub fn connect_ring_transport(
    place: RingPlace,
    endpoints: &[SocketAddr],
    listener: &TcpListener,
    timeout: Duration,
    shared_memory: bool,
    credentials: &Credentials,
    abandoned: &Abandoned,
) -> anyhow::Result<Box<dyn RingTransport>> {
    let shared_memory = shared_memory && shm::usable_for(endpoints);
    let streams = links::connect_ring_links(&place, endpoints, listener, timeout, credentials, abandoned)?;
    let links = tcp::ConnectedLinks::new(place, streams, timeout);
    Ok(if shared_memory {
        Box::new(shm::ShmLeft::open(links)?)
    } else {
        Box::new(tcp::TcpLeft::open(links)?)
    })
}

/// The rendezvous roster (`roster[r]` is rank `r`'s `ip:port`) as addresses.
pub fn parse_endpoints(roster: &[String]) -> anyhow::Result<Vec<SocketAddr>> {
    roster
        .iter()
        .enumerate()
        .map(|(r, e)| {
            e.parse::<SocketAddr>()
                .with_context(|| format!("rank {r} announced a bad endpoint {e:?}"))
        })
        .collect()
}
