//! A launcher of a job that recovers in place asks the coordinator, every heartbeat interval,
//! which processes it declared dead: one of this node's that still runs (stopped, or hung) is
//! killed, so that the launcher replaces it like any process that died.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::net::auth::Credentials;
use crate::net::protocol::DeadProcess;
use crate::net::ControlBus;

/// The coordinator's list of dead processes, as last heard.
pub struct DeathWatch {
    dead: Arc<Mutex<Vec<DeadProcess>>>,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl DeathWatch {
    /// Asks the coordinator at `master` every `interval` (retrying a broken line, each try at
    /// most `limit`) until dropped.
    pub fn start(
        master: String,
        credentials: Credentials,
        interval: Duration,
        limit: Duration,
        max_frame: usize,
    ) -> Result<Self> {
        let dead = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the death watch")?;
        let thread = {
            let (dead, stop) = (dead.clone(), stop.clone());
            thread::Builder::new()
                .name("death-watch".to_string())
                .spawn(move || {
                    runtime.block_on(async move {
                        let mut line: Option<ControlBus> = None;
                        while !stop.load(Ordering::Relaxed) {
                            match ask(&mut line, &master, &credentials, limit, max_frame).await {
                                Ok(list) => *dead.lock().unwrap_or_else(PoisonError::into_inner) = list,
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
