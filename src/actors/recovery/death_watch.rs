//! A launcher of a job that recovers in place asks the coordinator, every heartbeat interval,
//! which processes it declared dead: one of this node's that still runs (stopped, or hung) is
//! killed, so that the launcher replaces it like any process that died. The same questions tell
//! whether the coordinator itself still answers: one this launcher started that stays silent
//! past the watch's limit is replaced too.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::net::auth::Credentials;
use crate::net::protocol::DeadProcess;
use crate::net::ControlBus;

/// The coordinator's list of dead processes, as last heard, and when it last answered.
pub struct DeathWatch {
    dead: Arc<Mutex<Vec<DeadProcess>>>,
    answered: Arc<Mutex<Option<Instant>>>,
    /// How long the coordinator may go without answering before it is taken for hung.
    hang_limit: Duration,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl DeathWatch {
    /// Asks the coordinator at `master` every `interval` (retrying a broken line, each try at
    /// most `limit`) until dropped; takes it for hung once it has not answered for `hang_limit`.
    pub fn start(
        master: String,
        credentials: Credentials,
        interval: Duration,
        limit: Duration,
        hang_limit: Duration,
        max_frame: usize,
    ) -> Result<Self> {
        let dead = Arc::new(Mutex::new(Vec::new()));
        let answered = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the death watch")?;
        let thread = {
            let (dead, answered, stop) = (dead.clone(), answered.clone(), stop.clone());
            thread::Builder::new()
                .name("death-watch".to_string())
                .spawn(move || {
                    runtime.block_on(async move {
                        let mut line: Option<ControlBus> = None;
                        while !stop.load(Ordering::Relaxed) {
                            match ask(&mut line, &master, &credentials, limit, max_frame).await {
                                Ok(list) => {
                                    *dead.lock().unwrap_or_else(PoisonError::into_inner) = list;
                                    *answered.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
                                }
                                Err(e) => {
                                    tracing::debug!("asking the coordinator at {master} for dead processes: {e:#}");
                                    line = None;
                                }
                            }
                            tokio::time::sleep(interval).await;
                        }
                    })
                })
                .context("starting the death watch")?
        };
        Ok(Self {
            dead,
            answered,
            hang_limit,
            stop,
            thread: Some(thread),
        })
    }

    /// Whether the coordinator declared the process `pid` of rank `rank` dead.
    pub fn declared_dead(&self, rank: usize, pid: u32) -> bool {
        self.dead
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&DeadProcess { rank, pid })
    }

    /// How long the coordinator process started at `started` has gone without answering, once
    /// that is longer than the hang limit (counted from its start at the earliest, so that a
    /// replacement has the limit to come up).
    pub fn hung_for(&self, started: Instant) -> Option<Duration> {
        let answered = *self.answered.lock().unwrap_or_else(PoisonError::into_inner);
        let since = answered.map_or(started, |at| at.max(started));
        Some(since.elapsed()).filter(|silent| *silent > self.hang_limit)
    }
}

async fn ask(
    line: &mut Option<ControlBus>,
    master: &str,
    credentials: &Credentials,
    limit: Duration,
    max_frame: usize,
) -> Result<Vec<DeadProcess>> {
    let bus = match line.take() {
        Some(bus) => bus,
        None => ControlBus::connect(master, limit, max_frame, credentials).await?,
    };
    line.insert(bus).list_dead(limit).await
}

impl Drop for DeathWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
