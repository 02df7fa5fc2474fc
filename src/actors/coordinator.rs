//! The coordinator: hands out the roster of data endpoints once every rank has joined, releases
//! barriers — gathers too, which are barriers where each rank hands rank 0 a part (a launched
//! pipeline's stage outcomes) — and commits checkpoints once every rank has acknowledged its
//! files. All wait at most the job's timeout; on expiry every waiting rank gets an error naming
//! the ranks that never arrived, never a silent hang.
//!
//! It also watches the ranks' heartbeats: a rank silent for longer than the heartbeat deadline,
//! whose heartbeat line breaks before it said goodbye, or that joins again as a new process, is
//! declared dead. Then, by default, the job stops: every waiting rank and every heartbeat is
//! answered with the reason (and a launcher restarts the whole job from the last checkpoint).
//! A coordinator that recovers in place instead starts a new *generation*: the survivors are
//! told (at their next heartbeat, and at once if they wait here) to leave what they are blocked
//! in and join again; the replacement of the lost rank joins too; once all have, every rank
//! gets the new roster and the step of the newest checkpoint this coordinator committed, and
//! training goes on from there — unless the whole job was asked to stop (a preemption's
//! SIGTERM): then nobody replaces the lost rank, the job stops, and the coordinator is over once
//! no rank of the job lives on.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use actix::prelude::*;
use bytes::Bytes;
use tokio::sync::oneshot;

use super::recovery::Recovery;
use crate::checkpoint::{CheckpointStore, CommitRecord, HeldFile};
use crate::config::JobConfig;
use crate::net::protocol::{
    Acknowledge, Barrier, Beat, ConnectionLost, DeadProcess, Gather, Heartbeat, Join, JoinRefused, Leave, ListDead,
    Membership, Roster, Settings,
};

type Waiter<T> = oneshot::Sender<Result<T, String>>;

/// The whole job was asked to stop (its processes got a preemption's SIGTERM): a rank lost from
/// now on is not replaced, and the coordinator is over once no rank lives on.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct JobAskedToStop;

/// A rank that asked to join: its data endpoint and mirror, and where its roster goes.
type Joined = (String, Option<String>, Waiter<Roster>);

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

/// The processes declared dead that are remembered for launchers to ask about.
const DEAD_REMEMBERED: usize = 64;
/// A rank waiting at a barrier or gather: its part (empty at a barrier), and where its answer goes.
type Arrival = (Bytes, Waiter<Vec<Bytes>>);

/// The ranks waiting at one barrier, gather or checkpoint acknowledgement.
#[derive(Default)]
struct Waiting {
    arrivals: BTreeMap<usize, Arrival>,
    /// The step whose checkpoint is committed once all have arrived (an acknowledgement).
    commits: Option<usize>,
}

/// Rendezvous, barriers, checkpoint commits and failure handling for one job.
pub struct Coordinator {
    world_size: usize,
    timeout: Duration,
    /// The generation forming or running: 0 at the start, one more after every rollback.
    generation: u64,
    /// Ranks that joined the forming generation.
    joining: BTreeMap<usize, Joined>,
    /// The ranks the forming generation waits for.
    expected: BTreeSet<usize>,
    /// The ranks training in the running generation, ascending: every rank, unless elastic
    /// membership went on without some.
    active: Vec<usize>,
    /// With elastic membership, ranks that asked to join while a generation runs: admitted at
    /// its next checkpoint. Each is answered within the timeout with the running roster, which
    /// does not hold it, and asks again.
    standby: BTreeMap<usize, (u64, Joined)>,
    /// Numbers each wait in `standby`, so a timer answers only the one it was set for.
    standby_serial: u64,
    /// Elastic membership, if the job has it.
    elastic: Option<Elastic>,
    /// The generation each rank of the job last joined.
    members: HashMap<usize, u64>,
    /// Ranks waiting at each barrier or gather.
    barriers: HashMap<String, Waiting>,
    /// How long a rank may go without a heartbeat; `None` when ranks share this process.
    heartbeat_deadline: Option<Duration>,
    /// When each rank that heartbeats was last heard from, on which line, and its process id.
    last_heard: HashMap<usize, (Instant, u64, u32)>,
    /// When the heartbeats were last checked (a check far later than due means this process
    /// itself was stalled).
    last_check: Instant,
    /// The processes declared dead, newest last (at most [`DEAD_REMEMBERED`]).
    dead: Vec<DeadProcess>,
    /// Ranks that finished and stopped heartbeating.
    left: HashSet<usize>,
    /// Why the job was stopped, once it was.
    stopped: Option<String>,
    /// Why the running generation was rolled back (told to the ranks still in an older one).
    rolled_back: String,
    /// Whether a lost rank is replaced in place (else the job stops).
    in_place: bool,
    /// Whether the whole job was asked to stop ([`JobAskedToStop`]).
    asked_to_stop: bool,
    /// Where checkpoints are committed; `None` when the job takes none.
    checkpoints: Option<CheckpointStore>,
    /// The roster of the running generation (the nodes that hold checkpoint files).
    roster: Option<Roster>,
    /// The newest checkpoint committed (or the one the run started from).
    committed: Option<usize>,
    /// The record of the newest commit, answered again to a rank that acknowledges it once
    /// more (its answer was lost with a coordinator that died committing it).
    record: Option<CommitRecord>,
    /// Told once every rank has left.
    finished: Option<oneshot::Sender<()>>,
    /// The job's settings, which a joining rank's must equal (none to compare when empty).
    settings: Settings,
    /// What to call each rank in messages (`rank N` when not given).
    names: Vec<String>,
}

impl Coordinator {
    /// A coordinator for `world_size` ranks that waits at most `timeout`
    /// for a rendezvous or a barrier to fill.
    pub fn new(world_size: usize, timeout: Duration) -> Self {
        Self {
            world_size,
            timeout,
            generation: 0,
            joining: BTreeMap::new(),
            expected: (0..world_size).collect(),
            active: (0..world_size).collect(),
            standby: BTreeMap::new(),
            standby_serial: 0,
            elastic: None,
            members: HashMap::new(),
            barriers: HashMap::new(),
            heartbeat_deadline: None,
            last_heard: HashMap::new(),
            last_check: Instant::now(),
            dead: Vec::new(),
            left: HashSet::new(),
            stopped: None,
            rolled_back: String::new(),
            in_place: false,
            asked_to_stop: false,
            checkpoints: None,
            roster: None,
            committed: None,
            record: None,
            finished: None,
            settings: Settings::new(),
            names: Vec::new(),
        }
    }

    /// Calls each role by `config`'s name for it in its messages (a parameter-server job's
    /// "server 1").
    pub fn with_names_of(mut self, config: &JobConfig) -> Self {
        self.names = (0..config.roles()).map(|role| config.role_name(role)).collect();
        self
    }

    /// Declares a rank dead once it has been silent for `deadline` since its last heartbeat
    /// (ranks are watched from their first heartbeat on).
    pub fn with_heartbeat_deadline(mut self, deadline: Duration) -> Self {
        self.heartbeat_deadline = Some(deadline);
        self
    }

    /// Commits the checkpoints the ranks acknowledge into `store`; training started from the
    /// checkpoint of step `start` (if any).
    pub fn with_checkpoints(mut self, store: Option<CheckpointStore>, start: Option<usize>) -> Self {
        self.checkpoints = store;
        self.committed = start;
        self
    }

    /// Replaces a lost rank in place: the survivors roll back to the newest committed
    /// checkpoint and go on with the lost rank's replacement, instead of stopping. Each node of
    /// such a job keeps its own copy of the checkpoints: the coordinator records which node
    /// holds which file, and each node commits its copy, instead of committing them in its own
    /// directory.
    pub fn recovering_in_place(mut self) -> Self {
        self.in_place = true;
        self
    }

    /// The coordinator of `config`'s job: its roles by name, the job's deadline, the
    /// checkpoints its run commits and starts from, and the settings every role must share.
    pub(crate) fn for_job(config: &JobConfig, recovery: &Recovery) -> Self {
        Self::new(config.roles(), config.fault_tolerance.timeout())
            .with_names_of(config)
            .with_checkpoints(recovery.store.clone(), recovery.start_step())
            .with_settings(config.shared_settings())
            .with_elastic(Elastic::of(config))
    }

    /// Goes on with fewer nodes when some are lost for good, and admits nodes that come later,
    /// as `elastic` says — when the job recovers in place; otherwise a lost rank stops it.
    pub fn with_elastic(mut self, elastic: Option<Elastic>) -> Self {
        self.elastic = elastic;
        self
    }

    /// Refuses a rank whose settings differ from `settings` (a replacement started with another
    /// config), naming every key that differs.
    pub fn with_settings(mut self, settings: Settings) -> Self {
        self.settings = settings;
        self
    }

    /// Resumes from `record`, the newest commit a coordinator before it recorded (this one was
    /// restarted): its step is where a rollback resumes, and a rank whose acknowledgement of it
    /// was never answered gets the record.
    pub fn with_record(mut self, record: CommitRecord) -> Self {
        self.committed = Some(record.step);
        self.record = Some(record);
        self
    }

    /// Fires `done` once every rank has left (a coordinator of its own process then ends).
    pub fn with_finish(mut self, done: oneshot::Sender<()>) -> Self {
        self.finished = Some(done);
        self
    }

    /// The job's elastic membership, in effect where lost ranks are recovered from in place.
    fn elastic(&self) -> Option<Elastic> {
        self.elastic.filter(|_| self.in_place)
    }

    fn name(&self, rank: usize) -> String {
        self.names.get(rank).cloned().unwrap_or_else(|| format!("rank {rank}"))
    }

    /// Answers every rank waiting at a barrier with `reason`.
    fn fail_barriers(&mut self, reason: &str) {
        for (_, waiting) in self.barriers.drain() {
            for (_, (_, waiter)) in waiting.arrivals {
                let _ = waiter.send(Err(reason.to_string()));
            }
        }
    }

    /// Declares `rank` dead for `why`: the job stops, or (in place) rolls back to a new
    /// generation; every rank waiting here is told at once.
    fn declare_dead(&mut self, rank: usize, why: &str, ctx: &mut Context<Self>) {
        if self.left.contains(&rank) {
            return;
        }
        // Once the job was asked to stop, no replacement comes: the job stops, and is over once
        // no rank lives on.
        if self.asked_to_stop {
            self.forget(rank);
            if self.stopped.is_none() {
                self.stop(format!(
                    "{} declared dead after the job was asked to stop: {why}; the job is stopped",
                    self.name(rank)
                ));
            }
            self.finish_if_over();
            return;
        }
        if self.stopped.is_some() {
            return;
        }
        // A rank that waits to be admitted (or was dropped) trains in no generation: it is
        // forgotten, and nobody rolls back.
        if self.elastic().is_some() && !self.active.contains(&rank) {
            tracing::warn!("{} declared dead while outside the job: {why}", self.name(rank));
            self.forget(rank);
            if let Some((_, _, waiter)) = self.joining.remove(&rank) {
                let _ = waiter.send(Err(format!("{} declared dead: {why}", self.name(rank))));
            }
            self.expected.remove(&rank);
            self.try_form();
            return;
        }
        // Once a rank has left, training is over: there is nothing to roll back to.
        if !self.in_place || !self.left.is_empty() {
            self.stop(format!("{} declared dead: {why}; the job is stopped", self.name(rank)));
            return;
        }
        self.generation += 1;
        // The lost rank's replacement is awaited (with elastic membership, for a while).
        self.expected = self.active.iter().copied().collect();
        let resume = match self.committed {
            Some(step) => format!("the checkpoint of step {step}"),
            None => "step 0".to_string(),
        };
        let reason = format!(
            "{} declared dead: {why}; generation {} resumes from {resume} once its replacement joins",
            self.name(rank),
            self.generation
        );
        tracing::warn!("{reason}");
        self.fail_barriers(&reason);
        // Its replacement is a new member; the ranks already joining wait on for the new roster.
        self.forget(rank);
        if let Some((_, _, waiter)) = self.joining.remove(&rank) {
            let _ = waiter.send(Err(reason.clone()));
        }
        self.rolled_back = reason;
        // Ranks that joined the generation this one replaces wait on for its roster: its
        // deadlines run from now.
        if !self.joining.is_empty() {
            self.start_forming(ctx);
        }
    }

    /// Forgets `rank`'s process (remembered as dead, for launchers to ask about): its membership,
    /// its heartbeats, its wait for admission.
    fn forget(&mut self, rank: usize) {
        self.members.remove(&rank);
        self.standby.remove(&rank);
        if let Some((_, _, pid)) = self.last_heard.remove(&rank) {
            if self.dead.len() == DEAD_REMEMBERED {
                self.dead.remove(0);
            }
            self.dead.push(DeadProcess { rank, pid });
        }
    }

    /// Stops the job for `reason`: every rank waiting here, and every later request, hears it.
    fn stop(&mut self, reason: String) {
        tracing::error!("{reason}");
        self.fail_barriers(&reason);
        let joining = std::mem::take(&mut self.joining).into_values();
        let standby = std::mem::take(&mut self.standby)
            .into_values()
            .map(|(_, joined)| joined);
        for (_, _, waiter) in joining.chain(standby) {
            let _ = waiter.send(Err(reason.clone()));
        }
        self.stopped = Some(reason);
    }

    /// Whether a generation is forming: its roster is not out yet.
    fn forming(&self) -> bool {
        self.roster
            .as_ref()
            .is_none_or(|roster| roster.generation != self.generation)
    }

    /// Forms the generation once every expected rank has joined.
    fn try_form(&mut self) {
        if self.forming() && !self.joining.is_empty() && self.expected.iter().all(|r| self.joining.contains_key(r)) {
            let joined = std::mem::take(&mut self.joining);
            self.form(joined);
        }
    }

    /// Hands every rank of `joined` the roster of the forming generation, which they make up.
    fn form(&mut self, joined: BTreeMap<usize, Joined>) {
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
    fn form_elastic(&mut self, generation: u64, ctx: &mut Context<Self>) {
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
    fn hold(&mut self, rank: usize, joined: Joined, ctx: &mut Context<Self>) {
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
    fn admit_waiting(&mut self, step: usize, ctx: &mut Context<Self>) {
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

    /// Whether `rank` is a member of a generation older than the one forming or running.
    fn behind(&self, rank: usize) -> bool {
        self.members.get(&rank).is_some_and(|&joined| joined < self.generation)
    }

    /// Declares dead every watched rank silent for longer than the deadline. A check that comes
    /// late by half a deadline or more measures this process's own silence (it was stopped,
    /// swapped out or starved of CPU), not the ranks': their heartbeats wait unread on its
    /// lines, so every rank's deadline runs again from now instead.
    fn check_heartbeats(&mut self, ctx: &mut Context<Self>) {
        let Some(deadline) = self.heartbeat_deadline else {
            return;
        };
        let now = Instant::now();
        let stalled = now.saturating_duration_since(std::mem::replace(&mut self.last_check, now));
        if stalled > deadline / 2 {
            tracing::warn!(
                stalled_s = stalled.as_secs_f64(),
                "the coordinator itself did not run for {:.1}s: every rank's heartbeat deadline \
                 runs again from now rather than the ranks being taken for dead",
                stalled.as_secs_f64()
            );
            for (heard, _, _) in self.last_heard.values_mut() {
                *heard = now;
            }
            return;
        }
        let silent: Vec<(usize, Duration)> = self
            .last_heard
            .iter()
            .filter(|(rank, _)| !self.left.contains(rank))
            .map(|(&rank, (heard, _, _))| (rank, heard.elapsed()))
            .filter(|(_, silence)| *silence > deadline)
            .collect();
        for (rank, silence) in silent {
            let why = format!(
                "no heartbeat for {:.1}s (deadline {:.1}s)",
                silence.as_secs_f64(),
                deadline.as_secs_f64()
            );
            self.declare_dead(rank, &why, ctx);
        }
    }

    /// The ranks of `expected` missing from `present`, by their names: `ranks 1, 2`, or
    /// `server 0 and trainers 1, 3` in a parameter-server job.
    fn missing<T>(&self, expected: impl IntoIterator<Item = usize>, present: &BTreeMap<usize, T>) -> String {
        // Consecutive names of one kind ("trainer 1", "trainer 3") as one group.
        let mut groups: Vec<(String, Vec<String>)> = Vec::new();
        for name in expected
            .into_iter()
            .filter(|r| !present.contains_key(r))
            .map(|r| self.name(r))
        {
            let (kind, number) = name.rsplit_once(' ').unwrap_or(("rank", name.as_str()));
            match groups.last_mut() {
                Some((last, numbers)) if last == kind => numbers.push(number.to_string()),
                _ => groups.push((kind.to_string(), vec![number.to_string()])),
            }
        }
        let groups: Vec<String> = groups
            .into_iter()
            .map(|(kind, numbers)| {
                let plural = if numbers.len() == 1 { "" } else { "s" };
                format!("{kind}{plural} {}", numbers.join(", "))
            })
            .collect();
        groups.join(" and ")
    }

    /// `rank` arrives at barrier `name` with `part`: the answer comes once every rank has
    /// arrived (rank 0 gets all parts, by rank), or with an error naming the missing ranks
    /// once the timeout has passed since the first arrival. An acknowledgement (`commits`)
    /// is answered once the checkpoint is committed.
    fn arrive(
        &mut self,
        rank: usize,
        name: String,
        part: Bytes,
        commits: Option<usize>,
        ctx: &mut Context<Self>,
    ) -> oneshot::Receiver<Result<Vec<Bytes>, String>> {
        let (tx, rx) = oneshot::channel();
        if let Some(reason) = &self.stopped {
            let _ = tx.send(Err(reason.clone()));
            return rx;
        }
        if self.behind(rank) {
            let _ = tx.send(Err(self.rolled_back.clone()));
            return rx;
        }
        if rank >= self.world_size {
            let _ = tx.send(Err(format!("rank {rank} is outside world size {}", self.world_size)));
            return rx;
        }
        if !self.active.contains(&rank) {
            let _ = tx.send(Err(format!(
                "rank {rank} does not train in generation {}",
                self.generation
            )));
            return rx;
        }
        let waiting = self.barriers.entry(name.clone()).or_default();
        waiting.commits = commits;
        if waiting.arrivals.is_empty() {
            let name = name.clone();
            ctx.run_later(self.timeout, move |coordinator, _| {
                let Some(waiting) = coordinator.barriers.remove(&name) else {
                    return;
                };
                let reason = format!(
                    "barrier {name:?} timed out after {:.1}s: {} never arrived",
                    coordinator.timeout.as_secs_f64(),
                    coordinator.missing(coordinator.active.clone(), &waiting.arrivals)
                );
                tracing::error!("{reason}");
                for (_, (_, waiter)) in waiting.arrivals {
                    let _ = waiter.send(Err(reason.clone()));
                }
            });
        }
        waiting.arrivals.insert(rank, (part, tx));
        if waiting.arrivals.len() == self.active.len() {
            let arrived = self.barriers.remove(&name).unwrap_or_default();
            let parts: Vec<Bytes> = arrived.arrivals.values().map(|(part, _)| part.clone()).collect();
            // An acknowledgement is answered with the record of the commit.
            let answer = match arrived.commits {
                Some(step) => self
                    .commit(step, &parts)
                    .and_then(|record| serde_json::to_vec(&record).map_err(|e| e.to_string()))
                    .map(|record| vec![Bytes::from(record)]),
                None => Ok(parts),
            };
            for (_, (_, waiter)) in arrived.arrivals {
                let _ = waiter.send(answer.clone());
            }
            if let (Some(step), Ok(_)) = (arrived.commits, &answer) {
                self.admit_waiting(step, ctx);
            }
        }
        rx
    }

    /// Commits the checkpoint of `step` whose files every rank listed in its part. In place, each
    /// node keeps its own copy (no shared filesystem): the coordinator records which node holds
    /// which file, and each node commits its copy once told; otherwise the files are in the
    /// coordinator's directory, and it commits them there.
    fn commit(&mut self, step: usize, parts: &[Bytes]) -> Result<CommitRecord, String> {
        let mut files: Vec<HeldFile> = Vec::new();
        // The parts come by rank, of the ranks that train.
        for (&rank, part) in self.active.iter().zip(parts) {
            let acknowledged: Vec<HeldFile> = serde_json::from_slice(part)
                .map_err(|e| format!("rank {rank}'s acknowledgement of step {step}: {e}"))?;
            let node = self
                .roster
                .as_ref()
                .map_or_else(String::new, |r| r.host_of(rank).to_string());
            for HeldFile { record, nodes: copies } in acknowledged {
                // Its writer's node, and those it stored copies on.
                let nodes = std::iter::once(node.clone()).chain(copies);
                match files.iter_mut().find(|held| held.record.name == record.name) {
                    Some(held) if held.record == record => {
                        for node in nodes {
                            if !held.nodes.contains(&node) {
                                held.nodes.push(node);
                            }
                        }
                    }
                    Some(held) => {
                        return Err(format!(
                            "checkpoint of step {step}: two copies of {} differ ({} bytes, CRC-32C {:08x}; {} bytes, {:08x})",
                            record.name, held.record.bytes, held.record.crc32c, record.bytes, record.crc32c
                        ))
                    }
                    None => files.push(HeldFile {
                        record,
                        nodes: nodes.collect(),
                    }),
                }
            }
        }
        let record = CommitRecord {
            step,
            world_size: self.active.len(),
            files,
        };
        if let Some(store) = &self.checkpoints {
            let committed = if self.in_place {
                store.record(&record)
            } else {
                let files = record.files.iter().map(|held| held.record.clone()).collect();
                store.commit(step, record.world_size, files)
            };
            committed.map_err(|e| format!("committing the checkpoint of step {step}: {e:#}"))?;
        }
        self.committed = Some(step);
        self.record = Some(record.clone());
        Ok(record)
    }
}

impl Actor for Coordinator {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        if let Some(deadline) = self.heartbeat_deadline {
            // Checked ten times per deadline (a walk over the ranks), so a death is found
            // within a tenth of the deadline of being due.
            self.last_check = Instant::now();
            ctx.run_interval(deadline / 10, |coordinator, ctx| coordinator.check_heartbeats(ctx));
        }
    }
}

impl Coordinator {
    /// A generation began forming: with elastic membership it forms `elastic.timeout` later
    /// without the nodes still missing; it fails `timeout` later unless it formed.
    fn start_forming(&mut self, ctx: &mut Context<Self>) {
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
    fn expire_rendezvous(&mut self, ctx: &mut Context<Self>) {
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
    fn refuse_join(&self, msg: &Join) -> Option<JoinRefused> {
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
    fn differences(&self, settings: &Settings) -> Option<String> {
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
}

fn reply<T: Send + 'static>(rx: oneshot::Receiver<Result<T, String>>) -> ResponseFuture<Result<T, String>> {
    Box::pin(async move { rx.await.unwrap_or_else(|_| Err("the coordinator stopped".to_string())) })
}

impl Handler<Join> for Coordinator {
    type Result = ResponseFuture<Result<Roster, JoinRefused>>;

    fn handle(&mut self, msg: Join, ctx: &mut Self::Context) -> Self::Result {
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

impl Handler<Heartbeat> for Coordinator {
    type Result = Result<Beat, String>;

    fn handle(&mut self, msg: Heartbeat, _: &mut Self::Context) -> Self::Result {
        if let Some(reason) = &self.stopped {
            return Err(reason.clone());
        }
        // Another process beating for a member whose own process beats still (one started for
        // another job, or a replacement before the old one was found dead) speaks for nothing:
        // its silence, or its line's loss, must not count as the member's.
        let other_process = self
            .last_heard
            .get(&msg.rank)
            .is_some_and(|&(_, _, pid)| pid != msg.pid && self.members.contains_key(&msg.rank));
        if other_process {
            return Ok(Beat::Alive);
        }
        self.last_heard.insert(msg.rank, (Instant::now(), msg.line, msg.pid));
        self.reannounced(&msg);
        Ok(if self.behind(msg.rank) {
            Beat::RollBack {
                generation: self.generation,
                reason: self.rolled_back.clone(),
            }
        } else {
            Beat::Alive
        })
    }
}

impl Coordinator {
    /// A rank that trains in generation `member_of` which this coordinator does not know as a
    /// member (it was restarted) becomes one again; the job's generation is at least its. With
    /// elastic membership, the generation's members are the ranks that train: those its
    /// barriers and commits count.
    fn reannounced(&mut self, beat: &Heartbeat) {
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

impl Handler<ListDead> for Coordinator {
    type Result = Vec<DeadProcess>;

    fn handle(&mut self, _: ListDead, _: &mut Self::Context) -> Self::Result {
        self.dead.clone()
    }
}

impl Coordinator {
    /// Whether `rank` lives on as far as this coordinator knows: it heartbeats, waits to join
    /// or trains in a generation. A rank never heard from, once the job was asked to stop, ended
    /// with the signal before it reached here.
    fn lives_on(&self, rank: usize) -> bool {
        !self.left.contains(&rank)
            && (self.last_heard.contains_key(&rank)
                || self.joining.contains_key(&rank)
                || self.members.contains_key(&rank))
    }

    /// Tells whoever waits for this coordinator's end once the job is over: every rank left,
    /// or, once the job was asked to stop, none lives on.
    fn finish_if_over(&mut self) {
        let over = if self.asked_to_stop {
            !self.active.iter().any(|&rank| self.lives_on(rank))
        } else {
            self.active.iter().all(|rank| self.left.contains(rank))
        };
        if !over {
            return;
        }
        for (rank, (_, (_, _, waiter))) in std::mem::take(&mut self.standby) {
            let _ = waiter.send(Err(format!(
                "the job finished training before rank {rank} was admitted"
            )));
        }
        if let Some(done) = self.finished.take() {
            let _ = done.send(());
        }
    }
}

impl Handler<Leave> for Coordinator {
    type Result = Result<(), String>;

    fn handle(&mut self, msg: Leave, _: &mut Self::Context) -> Self::Result {
        // Only the line that carries a rank's heartbeats may end them: a leave on another one
        // (a stale process of the job, or the same command started twice) would switch off the
        // failure detection of a rank that still trains.
        if let Some(&(_, line, pid)) = self.last_heard.get(&msg.rank) {
            if line != msg.line {
                let reason = format!(
                    "{} may leave only on the connection that carries its heartbeats (those of pid {pid}): \
                     a leave from another connection is refused",
                    self.name(msg.rank)
                );
                tracing::warn!("{reason}");
                return Err(reason);
            }
        }
        self.left.insert(msg.rank);
        self.finish_if_over();
        Ok(())
    }
}

impl Handler<JobAskedToStop> for Coordinator {
    type Result = ();

    fn handle(&mut self, _: JobAskedToStop, _: &mut Self::Context) {
        tracing::info!("the job was asked to stop: a rank lost from now on is not replaced");
        self.asked_to_stop = true;
        // A rank awaited for a generation that has not formed yet (never heard from, or lost
        // just before) ended with the signal: the ranks waiting for it would wait in vain.
        let awaited = self.expected.iter().copied().find(|&rank| !self.lives_on(rank));
        if let Some(rank) = awaited.filter(|_| self.forming()) {
            self.stop(format!(
                "the job was asked to stop while {} was awaited; the job is stopped",
                self.name(rank)
            ));
        }
        self.finish_if_over();
    }
}

impl Handler<ConnectionLost> for Coordinator {
    type Result = ();

    fn handle(&mut self, msg: ConnectionLost, ctx: &mut Self::Context) {
        // The line of a process already replaced (or declared dead) says nothing new.
        if self
            .last_heard
            .get(&msg.rank)
            .is_some_and(|&(_, line, _)| line == msg.line)
        {
            self.declare_dead(msg.rank, "its heartbeat connection broke (the process is gone)", ctx);
        }
    }
}

impl Handler<Barrier> for Coordinator {
    type Result = ResponseFuture<Result<(), String>>;

    fn handle(&mut self, msg: Barrier, ctx: &mut Self::Context) -> Self::Result {
        let answer = reply(self.arrive(msg.rank, msg.name, Bytes::new(), None, ctx));
        Box::pin(async move { answer.await.map(|_| ()) })
    }
}

impl Handler<Gather> for Coordinator {
    type Result = ResponseFuture<Result<Vec<Bytes>, String>>;

    fn handle(&mut self, msg: Gather, ctx: &mut Self::Context) -> Self::Result {
        reply(self.arrive(msg.rank, msg.name, msg.part, None, ctx))
    }
}

impl Handler<Acknowledge> for Coordinator {
    type Result = ResponseFuture<Result<CommitRecord, String>>;

    fn handle(&mut self, msg: Acknowledge, ctx: &mut Self::Context) -> Self::Result {
        // Committed already: the rank's answer was lost (a coordinator that died committing).
        if let Some(record) = self.record.as_ref().filter(|r| r.step == msg.step) {
            let record = record.clone();
            tracing::info!(
                rank = msg.rank,
                step = msg.step,
                "acknowledged again: already committed"
            );
            return Box::pin(async move { Ok(record) });
        }
        let part = match serde_json::to_vec(&msg.files) {
            Ok(json) => Bytes::from(json),
            Err(e) => return Box::pin(async move { Err(format!("rank {}'s file records: {e}", msg.rank)) }),
        };
        let name = format!("checkpoint of step {}", msg.step);
        let answer = reply(self.arrive(msg.rank, name, part, Some(msg.step), ctx));
        Box::pin(async move {
            let parts = answer.await?;
            let record = parts.first().ok_or("a commit without its record")?;
            serde_json::from_slice(record).map_err(|e| format!("the record of a commit: {e}"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn join(c: &Addr<Coordinator>, rank: usize, world_size: usize) -> Result<Roster, String> {
        join_with(c, rank, world_size, Settings::new())
            .await
            .map_err(|refused| match refused {
                JoinRefused::Mismatch(reason) | JoinRefused::Failed(reason) => reason,
            })
    }

    async fn join_with(
        c: &Addr<Coordinator>,
        rank: usize,
        world_size: usize,
        settings: Settings,
    ) -> Result<Roster, JoinRefused> {
        let data_endpoint = format!("endpoint-{rank}");
        c.send(Join {
            rank,
            world_size,
            data_endpoint,
            mirror: None,
            settings,
        })
        .await
        .expect("coordinator alive")
    }

    #[actix::test]
    async fn roster_is_handed_out_by_rank() {
        let c = Coordinator::new(2, Duration::from_secs(5)).start();
        let (late, early) = futures::join!(join(&c, 1, 2), join(&c, 0, 2));
        let late = late.expect("both joined");
        assert_eq!(late.endpoints, vec!["endpoint-0".to_string(), "endpoint-1".to_string()]);
        assert_eq!((late.generation, late.resume_step), (0, None));
        assert_eq!(early, Ok(late));
    }

    #[actix::test]
    async fn a_rank_that_never_arrives_is_named() {
        let c = Coordinator::new(3, Duration::from_millis(200)).start();
        let err = join(&c, 0, 3).await.expect_err("ranks 1 and 2 are missing");
        assert!(err.contains("ranks 1, 2 never joined"), "{err}");
        let barrier = c
            .send(Barrier {
                rank: 2,
                name: "end".into(),
            })
            .await
            .expect("coordinator alive");
        let err = barrier.expect_err("ranks 0 and 1 never reach the barrier");
        assert!(err.contains("ranks 0, 1 never arrived"), "{err}");
    }

    #[actix::test]
    async fn a_gather_answers_every_rank_with_every_part_by_rank() {
        let c = Coordinator::new(3, Duration::from_secs(5)).start();
        let gather = |rank: usize, part: &'static [u8]| {
            c.send(Gather {
                rank,
                name: "outcomes".into(),
                part: Bytes::from_static(part),
            })
        };
        let (two, zero, one) = futures::join!(gather(2, b"c"), gather(0, b"a"), gather(1, b""));
        let zero = zero.expect("coordinator alive").expect("all arrived");
        assert_eq!(
            zero,
            vec![Bytes::from_static(b"a"), Bytes::new(), Bytes::from_static(b"c")]
        );
        // The parts are shared, not copied: the buses hand them to rank 0 alone.
        assert_eq!(one.expect("coordinator alive"), Ok(zero.clone()));
        assert_eq!(two.expect("coordinator alive"), Ok(zero));
    }

    #[actix::test]
    async fn a_coordinator_that_did_not_run_for_longer_than_the_deadline_gives_the_ranks_a_new_one() {
        let c = Coordinator::new(2, Duration::from_secs(30))
            .with_heartbeat_deadline(Duration::from_millis(200))
            .start();
        for rank in 0..2 {
            assert_eq!(beat(&c, rank, 0).await, Ok(Beat::Alive));
        }
        // The test's thread is the coordinator's: blocking it stops the coordinator as a SIGSTOP
        // (or a starved CPU) would, while the ranks' heartbeats would wait unread.
        std::thread::sleep(Duration::from_millis(700));
        // Its overdue heartbeat checks run first.
        tokio::time::sleep(Duration::from_millis(50)).await;
        for rank in 0..2 {
            assert_eq!(
                beat(&c, rank, 0).await,
                Ok(Beat::Alive),
                "rank {rank} was taken for dead for the coordinator's own silence"
            );
        }
    }

    #[actix::test]
    async fn a_silent_rank_is_declared_dead_and_everyone_is_told() {
        let c = Coordinator::new(2, Duration::from_secs(30))
            .with_heartbeat_deadline(Duration::from_millis(200))
            .start();
        for rank in 0..2 {
            c.send(Heartbeat {
                rank,
                pid: 0,
                member_of: None,
                line: 0,
            })
            .await
            .unwrap()
            .unwrap();
        }
        let barrier = c.send(Barrier {
            rank: 0,
            name: "step".into(),
        });
        // Rank 0 keeps heartbeating; rank 1 falls silent.
        let beating = async {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let _ = c
                    .send(Heartbeat {
                        rank: 0,
                        pid: 0,
                        member_of: None,
                        line: 0,
                    })
                    .await;
            }
        };
        let (waited, ()) = futures::join!(barrier, beating);
        let err = waited.unwrap().expect_err("the barrier cannot complete");
        assert!(err.contains("rank 1 declared dead: no heartbeat for"), "{err}");
        let refused = c
            .send(Heartbeat {
                rank: 0,
                pid: 0,
                member_of: None,
                line: 0,
            })
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(refused, err, "every later heartbeat hears why the job stopped");
    }

    /// The coordinator of a process of its own for `world` ranks, which replaces lost ranks in
    /// place, and what tells that it is over.
    fn coordinator_of_its_own(world: usize) -> (Addr<Coordinator>, oneshot::Receiver<()>) {
        let (done, finished) = oneshot::channel();
        let c = Coordinator::new(world, Duration::from_secs(30))
            .with_heartbeat_deadline(Duration::from_secs(30))
            .recovering_in_place()
            .with_finish(done)
            .start();
        (c, finished)
    }

    #[actix::test]
    async fn once_the_job_was_asked_to_stop_a_lost_rank_is_not_awaited_and_the_coordinator_ends() {
        let (c, mut finished) = coordinator_of_its_own(2);
        for rank in [0, 1] {
            beat(&c, rank, rank as u64).await.unwrap();
        }
        c.send(JobAskedToStop).await.unwrap();
        c.send(ConnectionLost { rank: 0, line: 0 }).await.unwrap();
        assert!(finished.try_recv().is_err(), "rank 1 still runs");
        let err = beat(&c, 1, 1).await.unwrap_err();
        assert!(
            err.contains("rank 0 declared dead after the job was asked to stop"),
            "{err}"
        );
        c.send(ConnectionLost { rank: 1, line: 1 }).await.unwrap();
        assert!(finished.try_recv().is_ok(), "no rank runs on");
    }

    #[actix::test]
    async fn a_rank_awaited_when_the_job_is_asked_to_stop_is_not_waited_for() {
        let (c, mut finished) = coordinator_of_its_own(2);
        beat(&c, 0, 0).await.unwrap();
        // Rank 1 ended with the signal before it reached the coordinator.
        let (joined, ()) = futures::join!(join(&c, 0, 2), async {
            c.send(JobAskedToStop).await.unwrap();
        });
        let err = joined.expect_err("nobody completes the rendezvous");
        assert!(
            err.contains("the job was asked to stop while rank 1 was awaited"),
            "{err}"
        );
        assert!(finished.try_recv().is_err(), "rank 0 still runs");
        c.send(ConnectionLost { rank: 0, line: 0 }).await.unwrap();
        assert!(finished.try_recv().is_ok(), "no rank runs on");
    }

    #[actix::test]
    async fn a_rank_lost_while_the_job_runs_is_awaited() {
        let (c, mut finished) = coordinator_of_its_own(1);
        beat(&c, 0, 0).await.unwrap();
        c.send(ConnectionLost { rank: 0, line: 0 }).await.unwrap();
        assert!(finished.try_recv().is_err(), "its replacement is awaited");
    }

    #[actix::test]
    async fn a_lost_connection_is_a_death_unless_the_rank_left() {
        let c = Coordinator::new(2, Duration::from_secs(30))
            .with_heartbeat_deadline(Duration::from_secs(30))
            .start();
        c.send(Heartbeat {
            rank: 1,
            pid: 0,
            member_of: None,
            line: 1,
        })
        .await
        .unwrap()
        .unwrap();
        let spoofed = c.send(Leave { rank: 1, line: 9 }).await.unwrap();
        assert!(
            spoofed.is_err_and(|e| e.contains("only on the connection that carries its heartbeats")),
            "a leave from another line must not end rank 1's failure detection"
        );
        c.send(Leave { rank: 1, line: 1 }).await.unwrap().unwrap();
        c.send(ConnectionLost { rank: 1, line: 1 }).await.unwrap();
        c.send(Heartbeat {
            rank: 0,
            pid: 0,
            member_of: None,
            line: 2,
        })
        .await
        .unwrap()
        .expect("a rank that left is not dead");
        c.send(ConnectionLost { rank: 0, line: 2 }).await.unwrap();
        let err = c
            .send(Heartbeat {
                rank: 1,
                pid: 0,
                member_of: None,
                line: 3,
            })
            .await
            .unwrap()
            .unwrap_err();
        assert!(
            err.contains("rank 0 declared dead: its heartbeat connection broke"),
            "{err}"
        );
    }

    #[actix::test]
    async fn wrong_world_size_and_duplicates_are_refused() {
        let c = Coordinator::new(2, Duration::from_millis(300)).start();
        let err = join(&c, 0, 3).await.expect_err("world size differs");
        assert!(err.contains("world size 3"), "{err}");
        let (first, twice) = futures::join!(join(&c, 1, 2), join(&c, 1, 2));
        assert!(twice.expect_err("same rank twice").contains("rank 1 joined twice"));
        assert!(first.expect_err("rank 0 never came").contains("rank 0 never joined"));
    }

    async fn beat(c: &Addr<Coordinator>, rank: usize, line: u64) -> Result<Beat, String> {
        c.send(Heartbeat {
            rank,
            pid: 100 + rank as u32,
            member_of: None,
            line,
        })
        .await
        .expect("coordinator alive")
    }

    #[actix::test]
    async fn in_place_a_lost_rank_rolls_the_survivors_back_and_its_replacement_rejoins() {
        let store_dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(store_dir.path(), 3);
        let c = Coordinator::new(3, Duration::from_secs(30))
            .with_heartbeat_deadline(Duration::from_secs(30))
            .with_checkpoints(Some(store), None)
            .recovering_in_place()
            .start();
        let (a, b, d) = futures::join!(join(&c, 0, 3), join(&c, 1, 3), join(&c, 2, 3));
        assert!(a.is_ok() && b.is_ok() && d.is_ok());
        for rank in 0..3 {
            assert_eq!(beat(&c, rank, rank as u64).await, Ok(Beat::Alive));
        }
        // Every rank acknowledges step 10's checkpoint; ranks 0 and 2 wrote a copy each on their
        // nodes, rank 2 one more on a buddy node: committed, recording every holder (the files
        // are theirs to commit).
        let written = crate::checkpoint::FileRecord {
            name: "replica".into(),
            bytes: 5,
            crc32c: crc32c::crc32c(b"state"),
        };
        let ack = |rank| {
            let held = HeldFile {
                record: written.clone(),
                nodes: if rank == 2 { vec!["node-9".into()] } else { Vec::new() },
            };
            c.send(Acknowledge {
                rank,
                step: 10,
                files: if rank == 1 { Vec::new() } else { vec![held] },
            })
        };
        let (x, y, z) = futures::join!(ack(0), ack(1), ack(2));
        for answer in [x, y, z] {
            answer.unwrap().expect("committed");
        }
        let record = CheckpointStore::new(store_dir.path(), 3).recorded().unwrap().unwrap();
        assert_eq!(record.step, 10);
        assert_eq!(
            record.files,
            vec![HeldFile {
                record: written,
                nodes: vec!["endpoint-0".into(), "endpoint-2".into(), "node-9".into()]
            }]
        );
        // Its answer lost with a coordinator that died committing, rank 1 acknowledges again —
        // to a coordinator restarted from the record: answered at once with it.
        let restarted = Coordinator::new(3, Duration::from_secs(5))
            .with_record(record.clone())
            .start();
        let again = Acknowledge {
            rank: 1,
            step: 10,
            files: Vec::new(),
        };
        assert_eq!(restarted.send(again).await.unwrap(), Ok(record));

        // Rank 1's line breaks: rank 0, waiting at a barrier, is told at once; rank 2 at its beat.
        let waiting = c.send(Barrier {
            rank: 0,
            name: "end".into(),
        });
        c.send(ConnectionLost { rank: 1, line: 1 }).await.unwrap();
        let told = waiting.await.unwrap().unwrap_err();
        assert!(
            told.contains("rank 1 declared dead")
                && told.contains("generation 1 resumes from the checkpoint of step 10"),
            "{told}"
        );
        match beat(&c, 2, 2).await {
            Ok(Beat::RollBack { generation: 1, reason }) => assert_eq!(reason, told),
            other => panic!("rank 2 should roll back: {other:?}"),
        }
        assert_eq!(c.send(ListDead).await.unwrap(), vec![DeadProcess { rank: 1, pid: 101 }]);
        // A request of the old generation is refused; the replacement beats as a newcomer.
        let stale = c.send(Barrier {
            rank: 2,
            name: "x".into(),
        });
        assert!(stale.await.unwrap().is_err());
        assert_eq!(beat(&c, 1, 7).await, Ok(Beat::Alive));
        // The old line's loss after the replacement beat on a new one is no new death.
        c.send(ConnectionLost { rank: 1, line: 1 }).await.unwrap();
        let (a, b, d) = futures::join!(join(&c, 2, 3), join(&c, 0, 3), join(&c, 1, 3));
        let roster = a.expect("generation 1 formed");
        assert_eq!((roster.generation, roster.resume_step), (1, Some(10)));
        assert_eq!(b, Ok(roster.clone()));
        assert_eq!(d, Ok(roster));
        assert_eq!(beat(&c, 2, 2).await, Ok(Beat::Alive), "rank 2 is in the new generation");
    }

    #[actix::test]
    async fn in_place_a_rank_joining_again_from_a_new_process_replaces_the_old_one() {
        let c = Coordinator::new(2, Duration::from_secs(30))
            .recovering_in_place()
            .start();
        let (a, b) = futures::join!(join(&c, 0, 2), join(&c, 1, 2));
        assert_eq!(a.unwrap().generation, 0);
        assert_eq!(b.unwrap().generation, 0);
        // Rank 1 restarted before its old line was seen to break.
        let (rejoined, survivor) = futures::join!(join(&c, 1, 2), join(&c, 0, 2));
        assert_eq!(rejoined.unwrap().generation, 1);
        assert_eq!(survivor.unwrap().generation, 1);
        // A replacement of another job's shape is refused as a mismatch, and changes nothing.
        let err = join_with(&c, 1, 3, Settings::new()).await.unwrap_err();
        assert_eq!(
            err,
            JoinRefused::Mismatch("rank 1 was started for world size 3, the job has 2".to_string())
        );
    }

    fn elastic(min_nodes: usize, max_nodes: usize, timeout_ms: u64) -> Elastic {
        Elastic {
            fixed: 0,
            min_nodes,
            max_nodes,
            per_node: 1,
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    /// A coordinator of `world` ranks with `elastic` membership, recovering in place, whose every
    /// rank joined generation 0 and was heard from.
    async fn elastic_job(world: usize, elastic: Elastic) -> Addr<Coordinator> {
        let c = Coordinator::new(world, Duration::from_secs(30))
            .with_heartbeat_deadline(Duration::from_secs(30))
            .with_elastic(Some(elastic))
            .recovering_in_place()
            .start();
        let joined = futures::future::join_all((0..world).map(|rank| join(&c, rank, world))).await;
        for (rank, roster) in joined.into_iter().enumerate() {
            assert_eq!(
                roster.expect("generation 0 formed").members,
                (0..world).collect::<Vec<_>>()
            );
            assert_eq!(beat(&c, rank, rank as u64).await, Ok(Beat::Alive));
        }
        c
    }

    async fn acknowledge(c: &Addr<Coordinator>, rank: usize, step: usize) -> Result<CommitRecord, String> {
        c.send(Acknowledge {
            rank,
            step,
            files: Vec::new(),
        })
        .await
        .expect("coordinator alive")
    }

    #[actix::test]
    async fn elastic_a_node_not_replaced_in_time_is_dropped_and_a_late_one_is_admitted_at_the_next_checkpoint() {
        let c = elastic_job(3, elastic(2, 3, 200)).await;
        // Rank 2's node is gone for good: once the elastic timeout passes, ranks 0 and 1 go on.
        c.send(ConnectionLost { rank: 2, line: 2 }).await.unwrap();
        let started = Instant::now();
        let (a, b) = futures::join!(join(&c, 0, 3), join(&c, 1, 3));
        let shrunk = a.expect("generation 1 formed without rank 2");
        assert!(
            started.elapsed() >= Duration::from_millis(200),
            "it waited for a replacement first"
        );
        assert_eq!((shrunk.members.clone(), shrunk.generation), (vec![0, 1], 1));
        assert_eq!((shrunk.place_of(1), shrunk.place_of(2)), (Some(1), None));
        assert_eq!(b, Ok(shrunk));
        // A barrier now waits for the two alone.
        let (x, y) = futures::join!(
            c.send(Barrier {
                rank: 0,
                name: "b".into()
            }),
            c.send(Barrier {
                rank: 1,
                name: "b".into()
            })
        );
        assert_eq!((x.unwrap(), y.unwrap()), (Ok(()), Ok(())));
        // A node comes back: it waits for the next checkpoint, which the two commit as theirs.
        let late = c.send(Join {
            rank: 2,
            world_size: 3,
            data_endpoint: "endpoint-2b".into(),
            mirror: None,
            settings: Settings::new(),
        });
        let (x, y) = futures::join!(acknowledge(&c, 0, 10), acknowledge(&c, 1, 10));
        assert_eq!(x.expect("committed").world_size, 2);
        assert!(y.is_ok());
        // Then every rank rolls over to a generation of three, from that checkpoint.
        match beat(&c, 0, 0).await {
            Ok(Beat::RollBack { generation: 2, reason }) => {
                assert!(
                    reason.contains("admitting rank 2 at the checkpoint of step 10"),
                    "{reason}"
                )
            }
            other => panic!("rank 0 should roll over to admit rank 2: {other:?}"),
        }
        let (a, b, late) = futures::join!(join(&c, 0, 3), join(&c, 1, 3), late);
        let grown = a.expect("generation 2 formed");
        assert_eq!(
            (grown.members.clone(), grown.generation, grown.resume_step),
            (vec![0, 1, 2], 2, Some(10))
        );
        assert_eq!(grown.endpoints[2], "endpoint-2b");
        assert_eq!(b, Ok(grown.clone()));
        assert_eq!(late.unwrap(), Ok(grown));
    }

    #[actix::test]
    async fn elastic_a_node_whose_ranks_are_found_dead_one_by_one_is_dropped_once() {
        let per_node_2 = Elastic {
            per_node: 2,
            ..elastic(1, 2, 150)
        };
        let c = elastic_job(4, per_node_2).await;
        // Rank 2 is found dead and rank 0 rejoins at once; then rank 3, and rank 1 rejoins: the
        // generation that replaced the first still forms, with the first node alone.
        c.send(ConnectionLost { rank: 2, line: 2 }).await.unwrap();
        let first = join(&c, 0, 4);
        let second = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            c.send(ConnectionLost { rank: 3, line: 3 }).await.unwrap();
            join(&c, 1, 4).await
        };
        let (a, b) = futures::join!(first, second);
        let roster = b.expect("formed without the second node");
        assert_eq!((roster.members.clone(), roster.generation), (vec![0, 1], 2));
        assert_eq!(a, Ok(roster));
    }

    #[actix::test]
    async fn elastic_a_rank_waiting_to_be_admitted_hears_the_running_roster_and_asks_again() {
        let c = Coordinator::new(2, Duration::from_millis(400))
            .with_elastic(Some(elastic(1, 2, 100)))
            .recovering_in_place()
            .start();
        // Rank 1 never comes: rank 0 trains alone once the elastic timeout passes.
        let alone = join(&c, 0, 2).await.expect("formed with one node");
        assert_eq!(alone.members, vec![0]);
        // Rank 1 comes late, while no checkpoint is due: within half the timeout it hears the
        // roster it is not in.
        let waited = join(&c, 1, 2).await.expect("answered with the running roster");
        assert_eq!((waited.place_of(1), waited.generation), (None, 0));
    }

    #[actix::test]
    async fn elastic_a_restarted_coordinator_counts_the_members_its_ranks_announce() {
        let restarted = Coordinator::new(3, Duration::from_secs(30))
            .with_heartbeat_deadline(Duration::from_secs(30))
            .with_elastic(Some(elastic(2, 3, 30_000)))
            .recovering_in_place()
            .start();
        // Generation 1 went on without rank 2; its ranks heartbeat to the new coordinator.
        for rank in [0, 1] {
            let beat = Heartbeat {
                rank,
                pid: 100 + rank as u32,
                member_of: Some(Membership {
                    generation: 1,
                    members: vec![0, 1],
                }),
                line: rank as u64,
            };
            assert_eq!(restarted.send(beat).await.unwrap(), Ok(Beat::Alive));
        }
        let record = futures::join!(acknowledge(&restarted, 0, 10), acknowledge(&restarted, 1, 10));
        for answer in [record.0, record.1] {
            assert_eq!(answer.expect("committed by the two members").world_size, 2);
        }
    }

    #[actix::test]
    async fn elastic_fewer_nodes_than_the_minimum_stop_the_job_saying_so() {
        let c = elastic_job(3, elastic(2, 3, 100)).await;
        c.send(ConnectionLost { rank: 1, line: 1 }).await.unwrap();
        c.send(ConnectionLost { rank: 2, line: 2 }).await.unwrap();
        let err = join(&c, 0, 3).await.unwrap_err();
        assert!(
            err.contains("1 whole node(s) joined generation")
                && err.contains("ranks 1, 2 never joined")
                && err.contains("fewer than the minimum of 2 (--nnodes 2:3); the job stops"),
            "{err}"
        );
        assert_eq!(beat(&c, 0, 0).await, Err(err), "every later request hears it");
    }

    #[actix::test]
    async fn a_rank_started_with_other_settings_is_refused_naming_every_key_that_differs() {
        let settings = |lr: &str| -> Settings {
            [
                ("train.lr".to_string(), lr.to_string()),
                ("train.seed".to_string(), "42".to_string()),
            ]
            .into()
        };
        let c = Coordinator::new(1, Duration::from_secs(30))
            .with_settings(settings("0.05"))
            .start();
        let err = join_with(&c, 0, 1, settings("0.1")).await.unwrap_err();
        assert_eq!(
            err,
            JoinRefused::Mismatch("rank 0 was started for another job: train.lr = 0.1, the job has 0.05".to_string())
        );
        assert!(join_with(&c, 0, 1, settings("0.05")).await.is_ok());
    }
}
