//! The coordinator's protocol: one [`Request`] enum and one [`Answer`] enum, the same values
//! whether the role shares the coordinator's process (a [`Call`] to its actor) or reaches it
//! over TCP (the headers of frames, which the coordinator's server decodes and hands to the
//! actor as the same [`Call`]). The transports address the coordinator through a
//! [`CoordinatorLine`], so they need not know the actor behind it.

use actix::dev::ToEnvelope;
use actix::prelude::*;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::checkpoint::{CommitRecord, HeldFile};

/// What a role asks of the coordinator: the header of a frame on the wire and, inside a
/// [`Call`], the coordinator actor's message — one value in both places, so the server only
/// decodes, sends and encodes. Answered by an [`Answer`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// A rank joins the job: at the start, and again after every rollback.
    Join(Join),
    /// A rank waits until every rank has reached barrier `name`; answered by
    /// [`Answer::Released`].
    Barrier {
        /// The waiting rank.
        rank: usize,
        /// The barrier's name; the same name must be used by all ranks.
        name: String,
    },
    /// A rank hands rank 0 its part of gather `name` (the call's part: the frame's payload) and
    /// waits until every rank has handed its own; answered by [`Answer::Gathered`].
    Gather {
        /// The arriving rank.
        rank: usize,
        /// The gather's name; the same name must be used by all ranks.
        name: String,
    },
    /// A rank wrote `files` for the checkpoint of step `step` and waits until every rank has:
    /// then the coordinator commits the checkpoint's manifest, and answers
    /// [`Answer::Committed`].
    Acknowledge {
        /// The acknowledging rank.
        rank: usize,
        /// The checkpoint's step.
        step: usize,
        /// What this rank wrote for it (nothing when another rank holds the same state), with
        /// the other nodes it stored copies on.
        files: Vec<HeldFile>,
    },
    /// A rank is alive; sent every `fault_tolerance.heartbeat_interval_ms` on a line of its own.
    /// Answered by [`Answer::Alive`], or refused once the job is stopped.
    Heartbeat(Heartbeat),
    /// A rank has finished: its silence from now on is not a death. Refused unless it comes on
    /// the line that carries the rank's heartbeats.
    Leave {
        /// The leaving rank.
        rank: usize,
    },
    /// A launcher asks which processes the coordinator declared dead; answered by
    /// [`Answer::Dead`].
    ListDead,
    /// What time is it at the coordinator? Asked a few times at start by roles that record a
    /// timeline, to put every process's spans on the coordinator's clock.
    ClockProbe,
}

impl Request {
    /// The rank a request speaks for; `None` for a launcher's question and a clock probe.
    pub fn rank(&self) -> Option<usize> {
        match self {
            Self::Join(Join { rank, .. })
            | Self::Barrier { rank, .. }
            | Self::Gather { rank, .. }
            | Self::Acknowledge { rank, .. }
            | Self::Heartbeat(Heartbeat { rank, .. })
            | Self::Leave { rank } => Some(*rank),
            Self::ListDead | Self::ClockProbe => None,
        }
    }

    /// Whether the reply hands back every rank's part: to rank 0 at a gather, alone.
    pub fn receives_parts(&self) -> bool {
        matches!(self, Self::Gather { rank: 0, .. })
    }
}

/// The coordinator's answer to a [`Request`]: a frame's header on the wire, with the
/// [`Reply`]'s parts as its payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Answer {
    /// Rendezvous complete: every rank's data endpoint, the generation, the step to resume at.
    Roster(Box<Roster>),
    /// A join was refused: the rank was started for another job (the reason names the
    /// difference), so no restart of it can help.
    Mismatched {
        /// What differs.
        reason: String,
    },
    /// A request was refused or failed; the reason names what went wrong.
    Refused {
        /// Human-readable cause.
        reason: String,
    },
    /// Everyone reached barrier `name`.
    Released {
        /// Which barrier.
        name: String,
    },
    /// Everyone reached gather `name`; to rank 0 the reply's parts are every rank's part, by
    /// rank (to the others there are none).
    Gathered {
        /// Which gather.
        name: String,
        /// Bytes of each rank's part, by rank (to every rank: how a gather in pieces knows
        /// when every rank has sent its last).
        lengths: Vec<u64>,
    },
    /// Every rank acknowledged the checkpoint and the coordinator committed it: its record of
    /// which node holds which file.
    Committed(CommitRecord),
    /// The coordinator heard the heartbeat (or the farewell): go on, or roll back.
    Alive(Beat),
    /// The processes declared dead, newest last.
    Dead {
        /// Rank and process id of each.
        processes: Vec<DeadProcess>,
    },
    /// The coordinator's wall clock when it answered a [`Request::ClockProbe`].
    Clock {
        /// Microseconds since the Unix epoch.
        unix_us: f64,
    },
}

/// A [`Request`] as the coordinator actor's message: with the part it hands over (a gather's;
/// empty otherwise) and the line it came on (a launched role's connection, or a simulated
/// role's incarnation), so the loss of an old process's line is told from its replacement's.
#[derive(Message, Debug)]
#[rtype(result = "Reply")]
pub struct Call {
    /// What is asked.
    pub request: Request,
    /// What the request hands over.
    pub part: Bytes,
    /// Which line carried it.
    pub line: u64,
}

/// The coordinator's [`Answer`], with the parts it hands back (a gather's, to rank 0): shared in
/// one process, back to back as the frame's payload over TCP.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// The answer.
    pub answer: Answer,
    /// What it hands back.
    pub parts: Vec<Bytes>,
}

impl Reply {
    /// An answer that hands nothing back.
    pub fn bare(answer: Answer) -> Self {
        Self {
            answer,
            parts: Vec::new(),
        }
    }

    /// The refusal that says `reason`.
    pub fn refused(reason: impl Into<String>) -> Self {
        Self::bare(Answer::Refused { reason: reason.into() })
    }
}

/// Rank `rank` joins the job, reachable for ring traffic at `data_endpoint`: at the start, and
/// again after every rollback (a survivor, or the replacement of a lost rank).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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

/// The generation a rank last joined, and who trains in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    /// The generation.
    pub generation: u64,
    /// Its roster's members ([`Roster::members`]'s field: empty when every rank trains).
    pub members: Vec<usize>,
}

/// Rank `rank` is alive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The living rank.
    pub rank: usize,
    /// Its process id on its node.
    pub pid: u32,
    /// The generation it last joined (none before its first roster): a coordinator that was
    /// restarted learns from it who trains, and in which generation.
    pub member_of: Option<Membership>,
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

/// A process the coordinator declared dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadProcess {
    /// Its rank.
    pub rank: usize,
    /// Its process id on its node.
    pub pid: u32,
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

/// Where a role's requests to the coordinator go, so the buses and the server are independent of
/// the actor that answers them.
#[derive(Clone)]
pub struct CoordinatorLine {
    pub(super) call: Recipient<Call>,
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
    A: Handler<Call> + Handler<ConnectionLost> + Handler<ReachRank>,
    A::Context: ToEnvelope<A, Call> + ToEnvelope<A, ConnectionLost> + ToEnvelope<A, ReachRank>,
{
    fn from(coordinator: Addr<A>) -> Self {
        Self {
            call: coordinator.clone().recipient(),
            connection_lost: coordinator.clone().recipient(),
            reach: coordinator.recipient(),
            process: std::process::id(),
        }
    }
}
