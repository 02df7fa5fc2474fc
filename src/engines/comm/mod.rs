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
pub mod worker;

pub use breaker::{Abandoned, LinkBreak, RingBreaker};
pub use place::RingPlace;
pub use ring::Communicator;
pub use share::Shared;
pub use transport::RingTransport;
pub use worker::{CommWorker, Pending};

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use anyhow::Context;

use crate::net::auth::Credentials;

/// The communicator of `rank` in a ring of processes at `endpoints`: over
/// shared memory when `shared_memory` allows it and every rank is on one
/// host that has `/dev/shm`, over TCP otherwise. Every connection starts
/// with the cluster-token handshake.
pub fn connect_ring(
    rank: usize,
    endpoints: &[SocketAddr],
    listener: &TcpListener,
    timeout: Duration,
    shared_memory: bool,
    credentials: &Credentials,
    abandoned: &Abandoned,
) -> anyhow::Result<Communicator> {
    Ok(Communicator::new(connect_ring_transport(
        RingPlace::identity(rank, endpoints.len()),
        endpoints,
        listener,
        timeout,
        shared_memory,
        credentials,
        abandoned,
    )?))
}

/// The transport under [`connect_ring`] for the member at `place`, whose
/// endpoint is `endpoints[place.position()]`: for rings over some of the
/// ranks and rings that carry other traffic than collectives (pipeline
/// stages' activations).
pub fn connect_ring_transport(
    place: RingPlace,
    endpoints: &[SocketAddr],
    listener: &TcpListener,
    timeout: Duration,
    shared_memory: bool,
    credentials: &Credentials,
    abandoned: &Abandoned,
) -> anyhow::Result<Box<dyn RingTransport>> {
    Ok(if shared_memory && shm::usable_for(endpoints) {
        Box::new(shm::ShmTransport::connect(
            place,
            endpoints,
            listener,
            timeout,
            credentials,
            abandoned,
        )?)
    } else {
        Box::new(tcp::TcpTransport::connect(
            place,
            endpoints,
            listener,
            timeout,
            credentials,
            abandoned,
        )?)
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
