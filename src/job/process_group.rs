//! A process group for a training loop of one's own — `init_process_group` or `fleet.init`: the
//! ranks a launcher started (`flotilla launch`, torchrun, Paddle's launcher, or an engine that
//! sets their variables) meet at the coordinator, and connect the ring their collectives run
//! over. The coordinator watches every rank's heartbeats: when one dies, or the coordinator
//! stops answering, the others' collectives are broken off at once and fail naming why, instead
//! of waiting out the timeout.

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use actix::prelude::*;
use anyhow::{anyhow, bail, Context, Result};
use tokio::sync::oneshot;

use super::control::connect_control;
use super::data_parallel::ring_link;
use super::launched_rank::{bind, coordinator_is_own_process, RankEndpoints};
use super::torchrun;
use crate::actors::recovery::heartbeat::{watched, CoordinatorAt};
use crate::actors::Coordinator;
#[cfg(doc)]
use crate::collective::preemption::PREEMPTED_EXIT_CODE;
use crate::collective::preemption::{self, PreemptionWatch};
use crate::config::{placement, process_env, JobConfig};
use crate::engines::comm::{CommWorker, Communicator, RingBreaker, Wire};
use crate::net::auth::Credentials;
use crate::net::protocol::Roster;

/// This process's place among the ranks of a job, and the ring to the others.
pub struct ProcessGroup {
    rank: usize,
    comm: CommWorker,
    config: Arc<JobConfig>,
    /// The line to the coordinator; `None` for a rank alone.
    control: Option<ControlLine>,
    /// A first SIGTERM asks the loop to stop ([`ProcessGroup::stop_asked`]).
    _preemption: PreemptionWatch,
}

/// The thread that keeps this rank in touch with the coordinator.
struct ControlLine {
    /// Tells the thread the program is done with the group.
    finish: oneshot::Sender<()>,
    /// Why the group failed, once its thread knows.
    failure: Arc<Mutex<Option<String>>>,
    thread: JoinHandle<Result<()>>,
}

impl ProcessGroup {
    /// Joins the job `config` describes as the rank its launcher's environment names (alone, a
    /// job of one rank needs none): rank 0 hosts the coordinator on `cluster.master` (unless it
    /// runs as a process of its own), every rank meets the others there and connects its ring.
    /// Load `config` with the launcher's environment (as [`crate::cli::standard_command_line`]
    /// does), which gives the world size and the master.
    pub fn init(config: &JobConfig) -> Result<Self> {
        let mut config = config.clone();
        let world = config.world_size();
        let rank = rank_of(&config, world)?;
        if world == 1 {
            return Self::alone(rank, config);
        }
        // Under torchrun's agent the ranks meet their coordinator through its store.
        torchrun::meet_coordinator(&mut config, rank, &process_env)?;
        let config = Arc::new(config);
        let RankEndpoints {
            master,
            listener,
            data_endpoint,
            credentials,
        } = bind(&config, rank)?;
        let breaker = RingBreaker::default();
        let link = ring_link(&config, rank, listener, &credentials, &breaker);
        let (line, roster) = ControlLine::start(&config, rank, master, credentials, data_endpoint, breaker)?;
        let (line, roster) = line.wait_for_roster(&roster, rank, &config)?;
        let comm = CommWorker::spawn(link.into_communicator(&roster)?)?;
        // From here a SIGTERM waits for the loop's `stop_asked`; before, it ends the process.
        let preemption = PreemptionWatch::install()?;
        tracing::info!(rank, world, "joined the process group");
        Ok(Self {
            rank,
            comm,
            config,
            control: Some(line),
            _preemption: preemption,
        })
    }

    /// The group of a job of one rank: no coordinator, no ring.
    fn alone(rank: usize, config: JobConfig) -> Result<Self> {
        let comm = CommWorker::spawn(Communicator::single())?;
        Ok(Self {
            rank,
            comm,
            config: Arc::new(config),
            control: None,
            _preemption: PreemptionWatch::install()?,
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the job has.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The job's config.
    pub fn config(&self) -> &JobConfig {
        &self.config
    }

    /// The ring's communication thread.
    pub(crate) fn comm(&self) -> &CommWorker {
        &self.comm
    }

    /// Averages `values` over the ranks (each rank gets the mean), as a loop averages its
    /// figures; `what` names the operation in errors.
    pub fn all_reduce_mean(&self, what: &str, values: Vec<f32>) -> Result<Vec<f32>> {
        let what = what.to_string();
        let outcome = self.comm.run(move |c| {
            let mut values = values;
            c.all_reduce_mean(&what, &mut values, Wire::F32)?;
            Ok(values)
        });
        self.explained(outcome)
    }

    /// Whether any rank got a SIGTERM (preemption) — the same answer on every rank, so all stop
    /// after the same step: a collective, which every rank calls at the same point of its loop
    /// (after each step, say). A first SIGTERM no longer ends the process while the group lives;
    /// a second does. Stop with [`PREEMPTED_EXIT_CODE`] after saving what is needed.
    pub fn stop_asked(&self) -> Result<bool> {
        let mine = if preemption::asked() { 1.0 } else { 0.0 };
        Ok(self.all_reduce_mean("the agreement on stopping", vec![mine])?[0] > 0.0)
    }

    /// `outcome`, with why the group failed when a collective failed for it.
    pub(crate) fn explained<T>(&self, outcome: Result<T>) -> Result<T> {
        let failure = self
            .control
            .as_ref()
            .and_then(|line| line.failure.lock().unwrap_or_else(PoisonError::into_inner).clone());
        match (outcome, failure) {
            (Err(e), Some(why)) => Err(e.context(why)),
            (outcome, _) => outcome,
        }
    }

    /// Leaves the job once every rank has reached the end: call it when the loop is done. A
    /// group dropped without it counts as a rank that failed, and the coordinator stops the
    /// others.
    pub fn finish(self) -> Result<()> {
        let Some(line) = self.control else {
            return Ok(());
        };
        drop(self.comm);
        // The thread ends by itself if it already failed.
        let _ = line.finish.send(());
        line.thread
            .join()
            .map_err(|_| anyhow!("rank {}: the thread that talks to the coordinator panicked", self.rank))?
    }
}

/// This process's rank, as its launcher's environment names it; 0 in a job of one rank,
/// which needs no launcher.
fn rank_of(config: &JobConfig, world: usize) -> Result<usize> {
    match placement::rank(&process_env)? {
        Some(rank) => Ok(rank),
        None if world == 1 => Ok(0),
        None => bail!(
            "{}: a process group of {world} ranks needs this process's rank (PADDLE_TRAINER_ID or RANK): \
             start the program with `flotilla launch --nproc_per_node {world} -- PROGRAM`",
            config.source_name
        ),
    }
}

impl ControlLine {
    /// Starts rank `rank`'s control thread ([`keep_in_touch`]), which hands the roster over on
    /// the returned channel. When the thread fails, whatever collective the program is blocked
    /// in can never finish: `breaker` breaks it off, and the failure is kept to explain it.
    fn start(
        config: &Arc<JobConfig>,
        rank: usize,
        master: String,
        credentials: Credentials,
        data_endpoint: String,
        breaker: RingBreaker,
    ) -> Result<(Self, Receiver<Roster>)> {
        let (roster_to, roster) = std::sync::mpsc::channel();
        let (finish, finished) = oneshot::channel();
        let failure = Arc::new(Mutex::new(None));
        let thread = {
            let (config, failure) = (config.clone(), failure.clone());
            std::thread::Builder::new()
                .name(format!("rank {rank} control"))
                .spawn(move || {
                    let outcome =
                        keep_in_touch(&config, rank, &master, &credentials, data_endpoint, roster_to, finished);
                    if let Err(e) = &outcome {
                        // Whatever collective the program is blocked in can never finish.
                        *failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(format!("{e:#}"));
                        breaker.break_for(u64::MAX);
                    }
                    outcome
                })
                .context("cannot start the thread that talks to the coordinator")?
        };
        let line = Self {
            finish,
            failure,
            thread,
        };
        Ok((line, roster))
    }

    /// The roster the control thread got at the rendezvous, or why it got none.
    fn wait_for_roster(self, roster: &Receiver<Roster>, rank: usize, config: &JobConfig) -> Result<(Self, Roster)> {
        if let Ok(roster) = roster.recv() {
            return Ok((self, roster));
        }
        let why = self
            .thread
            .join()
            .map_err(|_| anyhow!("the thread that talks to the coordinator panicked"))?;
        Err(why
            .err()
            .unwrap_or_else(|| anyhow!("the rendezvous ended without a roster")))
        .with_context(|| {
            format!(
                "rank {rank}: joining the job at {}",
                config.cluster.master.as_deref().unwrap_or("?")
            )
        })
    }
}

/// The control thread of rank `rank`: hosts the coordinator on rank 0 (unless it runs as a
/// process of its own), joins the job reachable at `data_endpoint`, hands the roster over, and
/// heartbeats until `finished` fires; then waits at the end barrier and says goodbye.
fn keep_in_touch(
    config: &JobConfig,
    rank: usize,
    master: &str,
    credentials: &Credentials,
    data_endpoint: String,
    roster_to: Sender<Roster>,
    finished: oneshot::Receiver<()>,
) -> Result<()> {
    let coordinator = (rank == 0 && !coordinator_is_own_process()).then(|| {
        Coordinator::new(config.roles(), config.fault_tolerance.timeout())
            .with_names_of(config)
            .with_settings(config.shared_settings())
    });
    System::new().block_on(async move {
        let mut bus = connect_control(
            coordinator,
            rank,
            master,
            &config.fault_tolerance,
            config.cluster.max_frame_bytes(),
            credentials,
        )
        .await?;
        let work = async {
            let roster = bus
                .join_admitted(rank, config.world_size(), data_endpoint, None, config.shared_settings())
                .await?;
            roster_to
                .send(roster)
                .map_err(|_| anyhow!("the program stopped waiting for the rendezvous"))?;
            finished
                .await
                .map_err(|_| anyhow!("rank {rank}: the program ended without ProcessGroup::finish"))?;
            bus.barrier(rank, "the end of training").await
        };
        watched(work, rank, CoordinatorAt::tcp(master, credentials), config, None).await
    })
}
