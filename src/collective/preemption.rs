//! Preemption: a cluster taking a job's machines back (Slurm's preemption, a Kubernetes eviction, a
//! spot instance reclaimed) sends SIGTERM and waits a grace period before SIGKILL. While a
//! data-parallel, pipeline or sync parameter-server run trains, the first SIGTERM asks it to stop
//! at the next step where a checkpoint may fall: every rank learns of it in the same step — a
//! data-parallel rank in that step's gather of the losses, a pipeline stage on the step's messages
//! (`pipeline::link`'s signals), a sync parameter-server trainer in the shards' answers to its
//! pulls (`ps::wire::PulledRows::stop`) — so all stop after the same step, whichever got the
//! signal, write the checkpoint and exit with [`PREEMPTED_EXIT_CODE`]; `--resume` continues the run
//! from it. A second SIGTERM ends the process at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use anyhow::{Context, Result};
use signal_hook::consts::SIGTERM;
use signal_hook::SigId;

/// The exit code of a process that stopped for preemption: 128 + SIGTERM, as if the signal had
/// ended it.
pub const PREEMPTED_EXIT_CODE: u8 = 143;

/// Whether this process was asked to stop.
static ASKED: LazyLock<Arc<AtomicBool>> = LazyLock::new(|| Arc::new(AtomicBool::new(false)));

/// The watches alive in this process, and the handlers they share.
static WATCHES: Mutex<Option<(usize, [SigId; 2])>> = Mutex::new(None);

/// While alive, a first SIGTERM sets [`asked`] instead of ending the process. Watches nest: the
/// handlers are installed with the first and removed with the last (the ranks of a simulated
/// cluster share their process).
pub struct PreemptionWatch(());

impl PreemptionWatch {
    /// Starts watching for SIGTERM.
    pub fn install() -> Result<Self> {
        let mut watches = WATCHES.lock().unwrap_or_else(PoisonError::into_inner);
        match watches.as_mut() {
            Some((count, _)) => *count += 1,
            None => {
                let flag = ASKED.clone();
                // Registered first, so it runs first: it exits only when an earlier SIGTERM
                // already set the flag.
                let exit = signal_hook::flag::register_conditional_shutdown(
                    SIGTERM,
                    i32::from(PREEMPTED_EXIT_CODE),
                    flag.clone(),
                )
                .context("installing the SIGTERM handler")?;
                let set = signal_hook::flag::register(SIGTERM, flag).context("installing the SIGTERM handler")?;
                *watches = Some((1, [exit, set]));
            }
        }
        Ok(Self(()))
    }
}

impl Drop for PreemptionWatch {
    fn drop(&mut self) {
        let mut watches = WATCHES.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((count, handlers)) = watches.as_mut() {
            *count -= 1;
            if *count == 0 {
                for handler in *handlers {
                    signal_hook::low_level::unregister(handler);
                }
                *watches = None;
            }
        }
    }
}

/// Whether this process got a SIGTERM while watched.
pub fn asked() -> bool {
    ASKED.load(Ordering::SeqCst)
}

/// Resolves once this process got a SIGTERM while watched (looked at every tenth of a second).
pub async fn until_asked() {
    while !asked() {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A run that stopped for preemption, after `step` steps.
#[derive(Debug)]
pub struct Preempted {
    /// Steps done.
    pub step: usize,
    /// Whether the checkpoint of that step was committed.
    pub checkpointed: bool,
}

impl std::fmt::Display for Preempted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let step = self.step;
        if self.checkpointed {
            write!(
                f,
                "stopped on SIGTERM after step {step}, its checkpoint committed: continue with `flotilla train --resume RUN_DIR`"
            )
        } else {
            write!(
                f,
                "stopped on SIGTERM after step {step} without a checkpoint (fault_tolerance.checkpoint_every = 0): a new run starts again at step 0"
            )
        }
    }
}

impl std::error::Error for Preempted {}

/// A launcher's processes that stopped for preemption, each after the same step.
#[derive(Debug)]
pub struct ProcessesPreempted;

impl std::fmt::Display for ProcessesPreempted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the processes stopped on SIGTERM (preemption), all after the same step: \
             continue with `flotilla train --resume RUN_DIR`"
        )
    }
}

impl std::error::Error for ProcessesPreempted {}

/// Whether `error` is a stop for preemption: a rank's, or a launcher's whose processes stopped.
pub fn is_preemption(error: &anyhow::Error) -> bool {
    error
        .chain()
        .any(|cause| cause.is::<Preempted>() || cause.is::<ProcessesPreempted>())
}
