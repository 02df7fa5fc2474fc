//! Who trains: the rendezvous that forms each generation (fixed, or elastic with nodes that
//! come and go whole), the settings a joining rank must share, and ranks that announce their
//! generation to a restarted coordinator.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use super::{reply, Coordinator, Joined};
use crate::config::JobConfig;
use crate::net::protocol::{DeadProcess, Heartbeat, Join, Membership, Roster, Settings};

/// Why a rank may not join.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum JoinRefused {
    /// It was started for another job (another world size, other settings): no restart of it
    /// can help.
    Mismatch(String),
    /// Anything else: the job stopped, the rendezvous timed out.
    Failed(String),
}

/// Elastic membership: the job may go on with fewer nodes than it was started for, down to
/// `min_nodes`, and grows back when nodes come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elastic {
    /// The fewest nodes the job trains on (`--nnodes MIN:MAX`'s MIN).
    pub min_nodes: usize,
    /// The job's nodes at most (MAX).
    pub max_nodes: usize,
    /// Ranks before the elastic ones, which every generation waits for: a parameter-server
    /// job's servers (a lost one is replaced, never dropped).
    pub fixed: usize,
    /// Elastic ranks per node: rank `r ≥ fixed` is on node `(r - fixed) / per_node`, and nodes
    /// come and go whole.
    pub per_node: usize,
    /// How long a forming generation waits for every expected rank before it forms without
    /// the nodes still missing.
    pub timeout: Duration,
}

impl Elastic {
    /// The elastic membership of `config`'s job, if it has one (`cluster.min_nnodes`).
    pub fn of(config: &JobConfig) -> Option<Self> {
        config.cluster.min_nnodes.map(|min_nodes| Self {
            min_nodes,
            max_nodes: config.cluster.nnodes,
            fixed: config.cluster.server_num,
            per_node: config.cluster.nproc_per_node,
            timeout: config.fault_tolerance.elastic_timeout(),
        })
    }

    /// The elastic ranks of `joined` whose node joined whole.
    fn whole_nodes(&self, joined: impl IntoIterator<Item = usize>) -> Vec<usize> {
        let joined: BTreeSet<usize> = joined.into_iter().collect();
        joined
            .iter()
            .copied()
            .filter(|&rank| rank >= self.fixed)
            .filter(|rank| {
                let first = (rank - self.fixed) / self.per_node * self.per_node + self.fixed;
                (first..first + self.per_node).all(|r| joined.contains(&r))
            })
            .collect()
    }

    /// The fixed ranks missing from `joined`.
    fn fixed_missing(&self, joined: &BTreeMap<usize, Joined>) -> Vec<usize> {
        (0..self.fixed).filter(|rank| !joined.contains_key(rank)).collect()
    }
}

impl Coordinator {
    /// Rank `msg.rank` joins: answered with the roster once its generation forms, or the
    /// refusal that says why not.
    pub(super) fn join(&mut self, msg: Join, ctx: &mut Context<Self>) -> ResponseFuture<Result<Roster, JoinRefused>> {
        if let Some(refusal) = self.refuse_join(&msg) {
            if let JoinRefused::Mismatch(reason) = &refusal {
                tracing::error!("refused a join: {reason}");
            }
            return Box::pin(async move { Err(refusal) });
        }
        let (tx, rx) = oneshot::channel();
        let joined = (msg.data_endpoint, msg.mirror, tx);
        // With elastic membership, a rank outside the running generation (a node that came late,
        // or came back) waits for the next checkpoint to be admitted.
        if self.elastic().is_some() && !self.forming() && !self.active.contains(&msg.rank) {
            self.hold(msg.rank, joined, ctx);
            let answer = reply(rx);
            return Box::pin(async move { answer.await.map_err(JoinRefused::Failed) });
        }
        // A member of the running generation joining again is a new process in its place: the
        // old one is gone, whether or not its line has broken yet.
        if self.members.get(&msg.rank) == Some(&self.generation) {
            self.declare_dead(msg.rank, "a new process joined in its place", ctx);
        }
        if let Some((_, _, earlier)) = self.joining.remove(&msg.rank) {
            let _ = earlier.send(Err(format!("rank {} joined again from a new process", msg.rank)));
        }
        tracing::debug!(rank = msg.rank, endpoint = %joined.0, generation = self.generation, "rank joined");
        if self.joining.is_empty() {
            self.start_forming(ctx);
        }
        self.joining.insert(msg.rank, joined);
        if self.elastic().is_some() {
            // A rank that comes while a generation forms is admitted with it.
            self.expected.insert(msg.rank);
        }
        self.try_form();
        let answer = reply(rx);
        Box::pin(async move { answer.await.map_err(JoinRefused::Failed) })
    }
}

impl Coordinator {
    /// Whether a generation is forming: its roster is not out yet.
    pub(super) fn forming(&self) -> bool {
        self.roster
            .as_ref()
            .is_none_or(|roster| roster.generation != self.generation)
    }

    /// Forms the generation once every expected rank has joined.
    pub(super) fn try_form(&mut self) {
        if self.forming() && !self.joining.is_empty() && self.expected.iter().all(|r| self.joining.contains_key(r)) {
            let joined = std::mem::take(&mut self.joining);
            self.form(joined);
        }
    }

    /// Hands every rank of `joined` the roster of the forming generation, which they make up.
    pub(super) fn form(&mut self, joined: BTreeMap<usize, Joined>) {
        let roster = Roster {
            members: joined.keys().copied().collect(),
            endpoints: joined.values().map(|(endpoint, _, _)| endpoint.clone()).collect(),
            mirrors: joined.values().map(|(_, mirror, _)| mirror.clone()).collect(),
            generation: self.generation,
            resume_step: self.committed,
            record: self.record.clone().filter(|record| Some(record.step) == self.committed),
        };
        tracing::info!(
            ranks = roster.world_size(),
            of = self.world_size,
            generation = self.generation,
            resume_step = ?self.committed,
            "rendezvous complete"
        );
        for (rank, (_, _, waiter)) in joined {
            self.members.insert(rank, self.generation);
            let _ = waiter.send(Ok(roster.clone()));
        }
        self.active = roster.members.clone();
        self.expected = self.active.iter().copied().collect();
        self.roster = Some(roster);
    }

    /// With elastic membership, `elastic.timeout` after a generation began forming: it forms
    /// with the nodes that joined whole, or — fewer than the minimum — the job stops.
    pub(super) fn form_elastic(&mut self, generation: u64, ctx: &mut Context<Self>) {
        let Some(elastic) = self.elastic() else {
            return;
        };
        if self.generation != generation || !self.forming() || self.joining.is_empty() {
            return;
        }
        let fixed_missing = elastic.fixed_missing(&self.joining);
        if !fixed_missing.is_empty() {
            // A fixed rank is replaced, never dropped: the generation looks again a little later
            // (until the rendezvous times out).
            let missing: Vec<String> = fixed_missing.into_iter().map(|rank| self.name(rank)).collect();
            tracing::warn!(
                "elastic membership: generation {generation} waits on for {}, which is replaced, never dropped",
                missing.join(", ")
            );
            ctx.run_later(elastic.timeout / 4, move |coordinator, ctx| {
                coordinator.form_elastic(generation, ctx)
            });
            return;
        }
        let whole = elastic.whole_nodes(self.joining.keys().copied());
        let nodes = whole.len() / elastic.per_node;
        let missing = self.missing(self.expected.iter().copied(), &self.joining);
        if nodes < elastic.min_nodes {
            self.stop(format!(
                "elastic membership: {nodes} whole node(s) joined generation {generation} within \
                 fault_tolerance.elastic_timeout_s = {:.1}s ({missing} never joined), fewer than the minimum of {} \
                 (--nnodes {}:{}); the job stops",
                elastic.timeout.as_secs_f64(),
                elastic.min_nodes,
                elastic.min_nodes,
                elastic.max_nodes
            ));
            return;
        }
        tracing::warn!(
            "elastic membership: generation {generation} goes on with {nodes} node(s) ({} ranks); {missing} did not join \
             within fault_tolerance.elastic_timeout_s = {:.1}s",
            whole.len(),
            elastic.timeout.as_secs_f64()
        );
        let mut joined = std::mem::take(&mut self.joining);
        // The ranks of a node that did not join whole wait to be admitted with it.
        let partial: Vec<usize> = joined
            .keys()
            .copied()
            .filter(|&r| r >= elastic.fixed && !whole.contains(&r))
            .collect();
        let waiting: Vec<(usize, Joined)> = partial
            .into_iter()
            .filter_map(|r| joined.remove(&r).map(|j| (r, j)))
            .collect();
        self.form(joined);
        for (rank, joined) in waiting {
            self.hold(rank, joined, ctx);
        }
    }

    /// Holds `rank`, which asked to join while a generation runs, until the next checkpoint
    /// admits it, or — at the latest half the timeout later — answers it with the running
    /// roster, which does not hold it, so it asks again.
    pub(super) fn hold(&mut self, rank: usize, joined: Joined, ctx: &mut Context<Self>) {
        self.standby_serial += 1;
        let serial = self.standby_serial;
        tracing::info!(rank, "waiting to be admitted at the next checkpoint");
        if let Some((_, (_, _, earlier))) = self.standby.insert(rank, (serial, joined)) {
            let _ = earlier.send(Err(format!("rank {rank} joined again from a new process")));
        }
        ctx.run_later(self.timeout / 2, move |coordinator, _| {
            if coordinator.standby.get(&rank).is_some_and(|(s, _)| *s == serial) {
                if let (Some((_, (_, _, waiter))), Some(roster)) =
                    (coordinator.standby.remove(&rank), coordinator.roster.clone())
                {
                    let _ = waiter.send(Ok(roster));
                }
            }
        });
    }

    /// With elastic membership, once the checkpoint of `step` is committed: the ranks waiting
    /// are admitted — a new generation forms of them and the running one, from that checkpoint.
    pub(super) fn admit_waiting(&mut self, step: usize, ctx: &mut Context<Self>) {
        if self.elastic().is_none() || self.standby.is_empty() || self.stopped.is_some() {
            return;
        }
        let admitted: Vec<String> = self.standby.keys().map(|&rank| self.name(rank)).collect();
        self.generation += 1;
        self.rolled_back = format!(
            "admitting {} at the checkpoint of step {step}: generation {} resumes from it",
            admitted.join(", "),
            self.generation
        );
        tracing::info!("{}", self.rolled_back);
        self.joining = std::mem::take(&mut self.standby)
            .into_iter()
            .map(|(rank, (_, joined))| (rank, joined))
            .collect();
        self.expected = self.active.iter().chain(self.joining.keys()).copied().collect();
        self.start_forming(ctx);
    }

    /// A generation began forming: with elastic membership it forms `elastic.timeout` later
    /// without the nodes still missing; it fails `timeout` later unless it formed.
    pub(super) fn start_forming(&mut self, ctx: &mut Context<Self>) {
        if let Some(elastic) = self.elastic() {
            let generation = self.generation;
            ctx.run_later(elastic.timeout, move |coordinator, ctx| {
                coordinator.form_elastic(generation, ctx)
            });
        }
        self.expire_rendezvous(ctx);
    }

    /// Fails the forming generation `timeout` after its first arrival unless every rank has
    /// joined by then. (Roles that only heartbeat, as a parameter-server job's, never join.)
    pub(super) fn expire_rendezvous(&mut self, ctx: &mut Context<Self>) {
        let generation = self.generation;
        ctx.run_later(self.timeout, move |coordinator, _| {
            if coordinator.generation != generation || coordinator.joining.is_empty() {
                return;
            }
            let reason = format!(
                "rendezvous timed out after {:.1}s: {} never joined (world size {})",
                coordinator.timeout.as_secs_f64(),
                coordinator.missing(coordinator.expected.clone(), &coordinator.joining),
                coordinator.world_size
            );
            tracing::error!("{reason}");
            for (_, (_, _, waiter)) in std::mem::take(&mut coordinator.joining) {
                let _ = waiter.send(Err(reason.clone()));
            }
        });
    }

    /// Why `msg` may not join, if it may not.
    pub(super) fn refuse_join(&self, msg: &Join) -> Option<JoinRefused> {
        if let Some(reason) = &self.stopped {
            Some(JoinRefused::Failed(reason.clone()))
        } else if msg.world_size != self.world_size {
            Some(JoinRefused::Mismatch(format!(
                "rank {} was started for world size {}, the job has {}",
                msg.rank, msg.world_size, self.world_size
            )))
        } else if msg.rank >= self.world_size {
            Some(JoinRefused::Mismatch(format!(
                "rank {} is outside world size {}",
                msg.rank, self.world_size
            )))
        } else if let Some(differences) = self.differences(&msg.settings) {
            Some(JoinRefused::Mismatch(format!(
                "rank {} was started for another job: {differences}",
                msg.rank
            )))
        } else if !self.in_place && (self.members.contains_key(&msg.rank) || self.joining.contains_key(&msg.rank)) {
            Some(JoinRefused::Failed(format!("rank {} joined twice", msg.rank)))
        } else {
            None
        }
    }

    /// How `settings` differ from the job's, key by key; `None` when they do not (or when
    /// either side has none to compare).
    pub(super) fn differences(&self, settings: &Settings) -> Option<String> {
        if settings.is_empty() || self.settings.is_empty() {
            return None;
        }
        let unset = "unset".to_string();
        let keys: BTreeSet<&String> = settings.keys().chain(self.settings.keys()).collect();
        let differences: Vec<String> = keys
            .into_iter()
            .filter(|key| settings.get(*key) != self.settings.get(*key))
            .map(|key| {
                let (its, ours) = (
                    settings.get(key).unwrap_or(&unset),
                    self.settings.get(key).unwrap_or(&unset),
                );
                format!("{key} = {its}, the job has {ours}")
            })
            .collect();
        (!differences.is_empty()).then(|| differences.join("; "))
    }

    /// A rank that trains in generation `member_of` which this coordinator does not know as a
    /// member (it was restarted) becomes one again; the job's generation is at least its. With
    /// elastic membership, the generation's members are the ranks that train: those its
    /// barriers and commits count.
    pub(super) fn reannounced(&mut self, beat: &Heartbeat) {
        let Some(Membership { generation, members }) = &beat.member_of else {
            return;
        };
        let generation = *generation;
        let declared_dead = self.dead.contains(&DeadProcess {
            rank: beat.rank,
            pid: beat.pid,
        });
        if declared_dead || self.members.contains_key(&beat.rank) || self.joining.contains_key(&beat.rank) {
            return;
        }
        tracing::info!(rank = beat.rank, generation, "a rank trains on in its generation");
        self.members.insert(beat.rank, generation);
        let restarted = self.roster.is_none();
        if self.elastic().is_some() && restarted && !members.is_empty() && generation >= self.generation {
            self.active = members.clone();
            self.expected = self.active.iter().copied().collect();
        }
        self.generation = self.generation.max(generation);
    }
}
