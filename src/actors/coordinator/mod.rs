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

mod barriers;
mod calls;
mod liveness;
mod membership;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::oneshot;

use self::barriers::Waiting;
pub use self::membership::Elastic;
use super::recovery::Recovery;
use crate::checkpoint::{CheckpointStore, CommitRecord};
use crate::config::JobConfig;
use crate::net::protocol::{DeadProcess, RollbackOrder, Roster, Settings};

type Waiter<T> = oneshot::Sender<Result<T, String>>;

/// The whole job was asked to stop (its processes got a preemption's SIGTERM): a rank lost from
/// now on is not replaced, and the coordinator is over once no rank lives on.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct JobAskedToStop;

/// A rank that asked to join: its data endpoint and mirror, and where its roster goes.
type Joined = (String, Option<String>, Waiter<Roster>);

/// The processes declared dead that are remembered for launchers to ask about.
const DEAD_REMEMBERED: usize = 64;

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
    /// Rank actors in this process, which take rollback orders as messages.
    reached: HashMap<usize, Recipient<RollbackOrder>>,
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

fn reply<T: Send + 'static>(rx: oneshot::Receiver<Result<T, String>>) -> ResponseFuture<Result<T, String>> {
    Box::pin(async move { rx.await.unwrap_or_else(|_| Err("the coordinator stopped".to_string())) })
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
            reached: HashMap::new(),
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

    /// Forgets `rank`'s process (remembered as dead, for launchers to ask about): its membership,
    /// its heartbeats, its wait for admission.
    fn forget(&mut self, rank: usize) {
        self.members.remove(&rank);
        self.reached.remove(&rank);
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
