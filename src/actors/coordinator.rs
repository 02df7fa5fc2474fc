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
//! training goes on from there.

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
    Roster, Settings,
};

type Waiter<T> = oneshot::Sender<Result<T, String>>;

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
    /// Ranks that joined the forming generation: their data endpoints and mirrors, and where
    /// their roster goes.
    joining: BTreeMap<usize, (String, Option<String>, Waiter<Roster>)>,
    /// The generation each rank of the job last joined.
    members: HashMap<usize, u64>,
    /// Ranks waiting at each barrier or gather.
    barriers: HashMap<String, Waiting>,
    /// How long a rank may go without a heartbeat; `None` when ranks share this process.
    heartbeat_deadline: Option<Duration>,
    /// When each rank that heartbeats was last heard from, on which line, and its process id.
    last_heard: HashMap<usize, (Instant, u64, u32)>,
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
            members: HashMap::new(),
            barriers: HashMap::new(),
            heartbeat_deadline: None,
            last_heard: HashMap::new(),
            dead: Vec::new(),
            left: HashSet::new(),
            stopped: None,
            rolled_back: String::new(),
            in_place: false,
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
    fn declare_dead(&mut self, rank: usize, why: &str) {
        if self.stopped.is_some() || self.left.contains(&rank) {
            return;
        }
        // Once a rank has left, training is over: there is nothing to roll back to.
        if !self.in_place || !self.left.is_empty() {
            let reason = format!("{} declared dead: {why}; the job is stopped", self.name(rank));
            tracing::error!("{reason}");
            self.fail_barriers(&reason);
            for (_, (_, _, waiter)) in std::mem::take(&mut self.joining) {
                let _ = waiter.send(Err(reason.clone()));
            }
            self.stopped = Some(reason);
            return;
        }
        self.generation += 1;
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
        self.members.remove(&rank);
        if let Some((_, _, pid)) = self.last_heard.remove(&rank) {
            if self.dead.len() == DEAD_REMEMBERED {
                self.dead.remove(0);
            }
            self.dead.push(DeadProcess { rank, pid });
        }
        if let Some((_, _, waiter)) = self.joining.remove(&rank) {
            let _ = waiter.send(Err(reason.clone()));
        }
        self.rolled_back = reason;
    }

    /// Whether `rank` is a member of a generation older than the one forming or running.
    fn behind(&self, rank: usize) -> bool {
        self.members.get(&rank).is_some_and(|&joined| joined < self.generation)
    }

    /// Declares dead every watched rank silent for longer than the deadline.
    fn check_heartbeats(&mut self) {
        let Some(deadline) = self.heartbeat_deadline else {
            return;
        };
        let silent: Vec<(usize, Duration)> = self
            .last_heard
            .iter()
            .filter(|(rank, _)| !self.left.contains(rank))
            .map(|(&rank, (heard, _, _))| (rank, heard.elapsed()))
            .filter(|(_, silence)| *silence > deadline)
            .collect();
        for (rank, silence) in silent {
            self.declare_dead(
                rank,
                &format!(
                    "no heartbeat for {:.1}s (deadline {:.1}s)",
                    silence.as_secs_f64(),
                    deadline.as_secs_f64()
                ),
            );
        }
    }

    fn missing<T>(&self, present: &BTreeMap<usize, T>) -> String {
        let missing: Vec<String> = (0..self.world_size)
            .filter(|r| !present.contains_key(r))
            .map(|r| r.to_string())
            .collect();
        format!(
            "rank{} {}",
            if missing.len() == 1 { "" } else { "s" },
            missing.join(", ")
        )
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
                    coordinator.missing(&waiting.arrivals)
                );
                tracing::error!("{reason}");
                for (_, (_, waiter)) in waiting.arrivals {
                    let _ = waiter.send(Err(reason.clone()));
                }
            });
        }
        waiting.arrivals.insert(rank, (part, tx));
        if waiting.arrivals.len() == self.world_size {
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
        }
        rx
    }

    /// Commits the checkpoint of `step` whose files every rank listed in its part. In place, each
    /// node keeps its own copy (no shared filesystem): the coordinator records which node holds
    /// which file, and each node commits its copy once told; otherwise the files are in the
    /// coordinator's directory, and it commits them there.
    fn commit(&mut self, step: usize, parts: &[Bytes]) -> Result<CommitRecord, String> {
        let mut files: Vec<HeldFile> = Vec::new();
        for (rank, part) in parts.iter().enumerate() {
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
            world_size: self.world_size,
            files,
        };
        if let Some(store) = &self.checkpoints {
            let committed = if self.in_place {
                store.record(&record)
            } else {
                let files = record.files.iter().map(|held| held.record.clone()).collect();
                store.commit(step, self.world_size, files)
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
            ctx.run_interval(deadline / 10, |coordinator, _| coordinator.check_heartbeats());
        }
    }
}

impl Coordinator {
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
                coordinator.missing(&coordinator.joining),
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
        // A member of the running generation joining again is a new process in its place: the
        // old one is gone, whether or not its line has broken yet.
        if self.members.get(&msg.rank) == Some(&self.generation) {
            self.declare_dead(msg.rank, "a new process joined in its place");
        }
        if let Some((_, _, earlier)) = self.joining.remove(&msg.rank) {
            let _ = earlier.send(Err(format!("rank {} joined again from a new process", msg.rank)));
        }
        tracing::debug!(rank = msg.rank, endpoint = %msg.data_endpoint, generation = self.generation, "rank joined");
        if self.joining.is_empty() {
            self.expire_rendezvous(ctx);
        }
        self.joining.insert(msg.rank, (msg.data_endpoint, msg.mirror, tx));
        if self.joining.len() == self.world_size {
            let joined = std::mem::take(&mut self.joining);
            let roster = Roster {
                endpoints: joined.values().map(|(endpoint, _, _)| endpoint.clone()).collect(),
                mirrors: joined.values().map(|(_, mirror, _)| mirror.clone()).collect(),
                generation: self.generation,
                resume_step: self.committed,
                record: self.record.clone().filter(|record| Some(record.step) == self.committed),
            };
            tracing::info!(
                world_size = self.world_size,
                generation = self.generation,
                resume_step = ?self.committed,
                "rendezvous complete"
            );
            for (rank, (_, _, waiter)) in joined {
                self.members.insert(rank, self.generation);
                let _ = waiter.send(Ok(roster.clone()));
            }
            self.roster = Some(roster);
        }
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
    /// member (it was restarted) becomes one again; the job's generation is at least its.
    fn reannounced(&mut self, beat: &Heartbeat) {
        let Some(generation) = beat.member_of else {
            return;
        };
        let declared_dead = self.dead.contains(&DeadProcess {
            rank: beat.rank,
            pid: beat.pid,
        });
        if declared_dead || self.members.contains_key(&beat.rank) || self.joining.contains_key(&beat.rank) {
            return;
        }
        tracing::info!(rank = beat.rank, generation, "a rank trains on in its generation");
        self.members.insert(beat.rank, generation);
        self.generation = self.generation.max(generation);
    }
}

impl Handler<ListDead> for Coordinator {
    type Result = Vec<DeadProcess>;

    fn handle(&mut self, _: ListDead, _: &mut Self::Context) -> Self::Result {
        self.dead.clone()
    }
}

impl Handler<Leave> for Coordinator {
    type Result = ();

    fn handle(&mut self, msg: Leave, _: &mut Self::Context) {
        self.left.insert(msg.rank);
        if self.left.len() == self.world_size {
            if let Some(done) = self.finished.take() {
                let _ = done.send(());
            }
        }
    }
}

impl Handler<ConnectionLost> for Coordinator {
    type Result = ();

    fn handle(&mut self, msg: ConnectionLost, _: &mut Self::Context) {
        // The line of a process already replaced (or declared dead) says nothing new.
        if self
            .last_heard
            .get(&msg.rank)
            .is_some_and(|&(_, line, _)| line == msg.line)
        {
            self.declare_dead(msg.rank, "its heartbeat connection broke (the process is gone)");
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
        c.send(Leave { rank: 1 }).await.unwrap();
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
