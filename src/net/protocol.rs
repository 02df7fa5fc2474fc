//! The coordinator's protocol as actor messages: what a role asks of the coordinator, the same
//! whether the role shares its process (the messages themselves) or reaches it over TCP (frames
//! that the coordinator's server turns into these messages). The transports address the
//! coordinator through a [`CoordinatorLine`], so they need not know the actor behind it.

use actix::dev::ToEnvelope;
use actix::prelude::*;
use bytes::Bytes;

/// Rank `rank` joins the job, reachable for ring traffic at `data_endpoint`.
#[derive(Message, Debug)]
#[rtype(result = "Result<Vec<String>, String>")]
pub struct Join {
    /// The joining rank.
    pub rank: usize,
    /// The world size the rank was configured with.
    pub world_size: usize,
    /// Its data-plane listener, `ip:port`.
    pub data_endpoint: String,
}

/// Rank `rank` waits until every rank has reached barrier `name`.
#[derive(Message, Debug)]
#[rtype(result = "Result<(), String>")]
pub struct Barrier {
    /// The waiting rank.
    pub rank: usize,
    /// The barrier's name; the same name must be used by all ranks.
    pub name: String,
}

/// Rank `rank` hands `part` to rank 0 at gather `name` and waits until every rank has
/// handed its own. Every rank is answered with every rank's part, by rank (shared, not
/// copied); the buses hand the parts to rank 0 alone and their lengths to every rank.
#[derive(Message, Debug)]
#[rtype(result = "Result<Vec<Bytes>, String>")]
pub struct Gather {
    /// The arriving rank.
    pub rank: usize,
    /// The gather's name; the same name must be used by all ranks.
    pub name: String,
    /// What this rank hands rank 0 (empty when it has nothing to add).
    pub part: Bytes,
}

/// Rank `rank` is alive. Answered with the reason once the job is aborted.
#[derive(Message, Debug)]
#[rtype(result = "Result<(), String>")]
pub struct Heartbeat {
    /// The living rank.
    pub rank: usize,
}

/// Rank `rank` has finished: its silence from now on is not a death.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct Leave {
    /// The leaving rank.
    pub rank: usize,
}

/// Rank `rank`'s heartbeat connection broke before it left: its process is gone.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct ConnectionLost {
    /// The lost rank.
    pub rank: usize,
}

/// Where a role's requests to the coordinator go: one recipient per message, so the buses and
/// the server are independent of the actor that answers them.
#[derive(Clone)]
pub struct CoordinatorLine {
    pub(super) join: Recipient<Join>,
    pub(super) barrier: Recipient<Barrier>,
    pub(super) gather: Recipient<Gather>,
    pub(super) heartbeat: Recipient<Heartbeat>,
    pub(super) leave: Recipient<Leave>,
    pub(super) connection_lost: Recipient<ConnectionLost>,
}

impl<A> From<Addr<A>> for CoordinatorLine
where
    A: Handler<Join>
        + Handler<Barrier>
        + Handler<Gather>
        + Handler<Heartbeat>
        + Handler<Leave>
        + Handler<ConnectionLost>,
    A::Context: ToEnvelope<A, Join>
        + ToEnvelope<A, Barrier>
        + ToEnvelope<A, Gather>
        + ToEnvelope<A, Heartbeat>
        + ToEnvelope<A, Leave>
        + ToEnvelope<A, ConnectionLost>,
{
    fn from(coordinator: Addr<A>) -> Self {
        Self {
            join: coordinator.clone().recipient(),
            barrier: coordinator.clone().recipient(),
            gather: coordinator.clone().recipient(),
            heartbeat: coordinator.clone().recipient(),
            leave: coordinator.clone().recipient(),
            connection_lost: coordinator.recipient(),
        }
    }
}
