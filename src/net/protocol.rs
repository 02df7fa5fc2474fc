//! The coordinator's protocol as actor messages: what a role asks of the coordinator, the same
//! whether the role shares its process (the messages themselves) or reaches it over TCP (frames
//! that the coordinator's server turns into these messages). The transports address the
//! coordinator through a [`CoordinatorLine`], so they need not know the actor behind it.

use actix::dev::ToEnvelope;
use actix::prelude::*;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::checkpoint::{CommitRecord, HeldFile};

/// Rank `rank` joins the job, reachable for ring traffic at `data_endpoint`: at the start, and
/// again after every rollback (a survivor, or the replacement of a lost rank).
#[derive(Message, Debug)]
#[rtype(result = "Result<Roster, JoinRefused>")]
pub struct Join {
    /// The joining rank.
    pub rank: usize,
    /// The world size the rank was configured with.
    pub world_size: usize,
    /// Its data-plane listener, `ip:port`.
    pub data_endpoint: String,
    /// Its checkpoint mirror, `ip:port`, when it serves one ([`crate::actors::recovery::file_mirror`]).
    pub mirror: Option<String>,
    /// The settings it was started with ([`crate::config::JobConfig::shared_settings`]; empty
    /// when it has none to compare).
    pub settings: Settings,
}

/// A job's settings by dotted key, as text.
pub type Settings = std::collections::BTreeMap<String, String>;

/// Why a rank may not join.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JoinRefused {
    /// It was started for another job (another world size, other settings): no restart of it
    /// can help.
    Mismatch(String),
    /// Anything else: the job stopped, the rendezvous timed out.
    Failed(String),
}

/// A rank was started for another job than the coordinator's: the reason names what differs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch(pub String);

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Mismatch {}

/// The answer to a [`Join`] once every rank has joined: who is where, in which generation, and
/// where training goes on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Roster {
    /// The ranks the job was started with (its members) that train in this generation, in
    /// ascending order: member `members[p]` trains at place `p` of the generation's ring. All of
    /// them, except in a job with elastic membership, which may go on without some.
    #[serde(default)]
    pub members: Vec<usize>,
    /// `endpoints[p]` is the data endpoint of the rank at place `p`.
    pub endpoints: Vec<String>,
    /// `mirrors[r]` is rank `r`'s checkpoint mirror, if it serves one.
    #[serde(default)]
    pub mirrors: Vec<Option<String>>,
    /// The job's generation: 0 at the start, one more after every rollback.
    pub generation: u64,
    /// The step of the newest checkpoint the coordinator committed (or the run started from):
    /// every rank continues after it; `None` means from step 0.
    pub resume_step: Option<usize>,
    /// The coordinator's record of that checkpoint, in a job whose nodes each keep their own
    /// copy: a node that wrote its files but lost every role before committing its copy commits
    /// it from this record.
    #[serde(default)]
    pub record: Option<CommitRecord>,
}

impl Roster {
    /// The ranks training in this generation.
    pub fn world_size(&self) -> usize {
        self.endpoints.len()
    }

    /// Where member `member` trains in this generation; `None` when it waits outside it (a
    /// node not yet admitted to a job with elastic membership).
    pub fn place_of(&self, member: usize) -> Option<usize> {
        if self.members.is_empty() {
            return (member < self.endpoints.len()).then_some(member);
        }
        self.members.binary_search(&member).ok()
    }

    /// The member at each place (the places themselves when the roster names none).
    pub fn members(&self) -> Vec<usize> {
        if self.members.is_empty() {
            (0..self.endpoints.len()).collect()
        } else {
            self.members.clone()
        }
    }

    /// The data endpoint of member `member`, if it trains in this generation.
    pub fn endpoint_of(&self, member: usize) -> Option<&str> {
        self.place_of(member).map(|place| self.endpoints[place].as_str())
    }

    /// The checkpoint mirror of member `member`, if it trains in this generation and serves one.
    pub fn mirror_of(&self, member: usize) -> Option<&str> {
        self.place_of(member)
            .and_then(|place| self.mirrors.get(place)?.as_deref())
    }

    /// The host member `rank`'s data endpoint is on: the node it runs on ("" when it does not
    /// train in this generation).
    pub fn host_of(&self, rank: usize) -> &str {
        let endpoint = self.endpoint_of(rank).unwrap_or_default();
        endpoint.rsplit_once(':').map_or(endpoint, |(host, _)| host)
    }

    /// Whether member `rank` is the lowest of the members `among` on its node (`among`: the
    /// ranks that hold the same state, or every member).
    pub fn first_on_its_host(&self, rank: usize, among: impl IntoIterator<Item = usize>) -> bool {
        among
            .into_iter()
            .filter(|&other| other < rank)
            .all(|other| self.host_of(other) != self.host_of(rank))
    }
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

/// Rank `rank` wrote `files` for the checkpoint of step `step` and waits until every rank has:
/// then the coordinator commits the checkpoint's manifest, and answers.
#[derive(Message, Debug)]
#[rtype(result = "Result<CommitRecord, String>")]
pub struct Acknowledge {
    /// The acknowledging rank.
    pub rank: usize,
    /// The checkpoint's step.
    pub step: usize,
    /// What this rank wrote for it (nothing when another rank holds the same state), with the
    /// other nodes it stored copies on.
    pub files: Vec<HeldFile>,
}

/// The generation a rank last joined, and who trains in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    /// The generation.
    pub generation: u64,
    /// Its roster's members ([`Roster::members`]'s field: empty when every rank trains).
    pub members: Vec<usize>,
}

/// Rank `rank` is alive, heard on the control line numbered `line`. Answered with the reason
/// once the job is stopped.
#[derive(Message, Debug)]
#[rtype(result = "Result<Beat, String>")]
pub struct Heartbeat {
    /// The living rank.
    pub rank: usize,
    /// Its process id on its node.
    pub pid: u32,
    /// The generation it last joined (none before its first roster): a coordinator that was
    /// restarted learns from it who trains, and in which generation.
    pub member_of: Option<Membership>,
    /// Which connection carried it (so the loss of an old process's line is told from the
    /// loss of its replacement's).
    pub line: u64,
}

/// The coordinator's answer to a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Beat {
    /// Go on.
    Alive,
    /// A rank was lost: leave what you are blocked in, and join generation `generation`,
    /// where training continues from the newest committed checkpoint.
    RollBack {
        /// The generation to join.
        generation: u64,
        /// Which rank was lost, and why.
        reason: String,
    },
}

/// The processes the coordinator declared dead, newest last: a launcher kills those of its own
/// that still run (a stopped one, say), so that they are replaced.
#[derive(Message, Debug)]
#[rtype(result = "Vec<DeadProcess>")]
pub struct ListDead;

/// A process the coordinator declared dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadProcess {
    /// Its rank.
    pub rank: usize,
    /// Its process id on its node.
    pub pid: u32,
}

/// Rank `rank` has finished: its silence from now on is not a death. Refused (with the reason)
/// unless it comes on the line that carries the rank's heartbeats.
#[derive(Message, Debug)]
#[rtype(result = "Result<(), String>")]
pub struct Leave {
    /// The leaving rank.
    pub rank: usize,
    /// Which connection carried it.
    pub line: u64,
}

/// Rank `rank`'s heartbeat line `line` broke before it left: its process is gone (unless a
/// replacement already beats on another line).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct ConnectionLost {
    /// The lost rank.
    pub rank: usize,
    /// The line that broke.
    pub line: u64,
}

/// The coordinator lost a rank: every survivor leaves what it is blocked in and joins generation
/// `generation`. A message to the rank's actor: sent by a coordinator in the same process, or
/// handed on by the heartbeat that heard it from one in another.
#[derive(Message, Debug, Clone, PartialEq, Eq)]
#[rtype(result = "()")]
pub struct RollbackOrder {
    /// The generation to join.
    pub generation: u64,
    /// Which rank was lost, and why.
    pub reason: String,
}

/// Rank `rank`'s actor, in the coordinator's process, takes the coordinator's rollback orders
/// as messages (sent by incarnation line `line`): they go to it at once instead of riding on
/// the answers to its heartbeats.
#[derive(Message)]
#[rtype(result = "()")]
pub struct ReachRank {
    /// The rank.
    pub rank: usize,
    /// The incarnation's line.
    pub line: u64,
    /// Its actor.
    pub actor: Recipient<RollbackOrder>,
}

/// Where a role's requests to the coordinator go: one recipient per message, so the buses and
/// the server are independent of the actor that answers them.
#[derive(Clone)]
pub struct CoordinatorLine {
    pub(super) join: Recipient<Join>,
    pub(super) barrier: Recipient<Barrier>,
    pub(super) gather: Recipient<Gather>,
    pub(super) acknowledge: Recipient<Acknowledge>,
    pub(super) heartbeat: Recipient<Heartbeat>,
    pub(super) list_dead: Recipient<ListDead>,
    pub(super) leave: Recipient<Leave>,
    pub(super) connection_lost: Recipient<ConnectionLost>,
    reach: Recipient<ReachRank>,
    /// The process this line speaks for: this one, or an incarnation of a role of a simulated
    /// cluster.
    pub(super) process: u32,
}

impl CoordinatorLine {
    /// The line of incarnation `id` of a role of a simulated cluster: its heartbeats name it as
    /// their process and their line, as a launched role's name its pid and its connection.
    pub fn for_incarnation(mut self, id: u32) -> Self {
        self.process = id;
        self
    }

    /// Tells the coordinator that this line's incarnation of `rank` is gone, as a launched
    /// role's broken heartbeat connection does.
    pub fn incarnation_gone(&self, rank: usize) {
        self.connection_lost.do_send(ConnectionLost {
            rank,
            line: u64::from(self.process),
        });
    }

    /// Rank `rank`'s `actor` takes the coordinator's rollback orders from now on.
    pub fn reach(&self, rank: usize, actor: Recipient<RollbackOrder>) {
        self.reach.do_send(ReachRank {
            rank,
            line: u64::from(self.process),
            actor,
        });
    }
}

impl<A> From<Addr<A>> for CoordinatorLine
where
    A: Handler<Join>
        + Handler<Barrier>
        + Handler<Gather>
        + Handler<Acknowledge>
        + Handler<Heartbeat>
        + Handler<ListDead>
        + Handler<Leave>
        + Handler<ConnectionLost>
        + Handler<ReachRank>,
    A::Context: ToEnvelope<A, Join>
        + ToEnvelope<A, Barrier>
        + ToEnvelope<A, Gather>
        + ToEnvelope<A, Acknowledge>
        + ToEnvelope<A, Heartbeat>
        + ToEnvelope<A, ListDead>
        + ToEnvelope<A, Leave>
        + ToEnvelope<A, ConnectionLost>
        + ToEnvelope<A, ReachRank>,
{
    fn from(coordinator: Addr<A>) -> Self {
        Self {
            join: coordinator.clone().recipient(),
            barrier: coordinator.clone().recipient(),
            gather: coordinator.clone().recipient(),
            acknowledge: coordinator.clone().recipient(),
            heartbeat: coordinator.clone().recipient(),
            list_dead: coordinator.clone().recipient(),
            leave: coordinator.clone().recipient(),
            connection_lost: coordinator.clone().recipient(),
            reach: coordinator.recipient(),
            process: std::process::id(),
        }
    }
}
