//! Faults of the simulated cluster's roles: a role killed or stalled before a step, as
//! `kill -9` and `kill -STOP` do to a process. A role's futures (its training, its heartbeats)
//! run under its [`RoleSwitch`]: a stalled role is no longer polled at all, so it stands still
//! wherever it waits; a killed one is dropped there.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{bail, Result};
use tokio::sync::watch;

/// What strikes a role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoleFault {
    /// Dropped where it waits, as a process killed with `SIGKILL`.
    Kill,
    /// No longer polled, as a process stopped with `SIGSTOP`, until it is killed.
    Stall,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RoleState {
    Running,
    Stalled,
    Killed,
}

/// Runs, stalls or kills one incarnation of a role.
#[derive(Clone)]
pub struct RoleSwitch(watch::Sender<RoleState>);

impl Default for RoleSwitch {
    fn default() -> Self {
        Self(watch::Sender::new(RoleState::Running))
    }
}

impl RoleSwitch {
    /// Kills the role: every future it governs ends at once with an error.
    pub fn kill(&self) {
        self.0.send_replace(RoleState::Killed);
    }

    fn strike(&self, fault: RoleFault) {
        self.0.send_replace(match fault {
            RoleFault::Kill => RoleState::Killed,
            RoleFault::Stall => RoleState::Stalled,
        });
    }

    /// Runs `work` while the role runs; a stalled role's work is not polled until the role is
    /// killed, and then it ends with an error, dropped where it waited.
    pub async fn govern<T>(&self, work: impl Future<Output = Result<T>>) -> Result<T> {
        let mut state = self.0.subscribe();
        tokio::pin!(work);
        loop {
            let now = *state.borrow_and_update();
            match now {
                RoleState::Killed => bail!("killed (a fault injected into the simulated cluster)"),
                // A strike is seen before the work is polled again.
                RoleState::Running => tokio::select! {
                    biased;
                    _ = state.changed() => {}
                    outcome = &mut work => return outcome,
                },
                // The sender lives in this switch: `changed` fails only if it is gone.
                RoleState::Stalled => {
                    let _ = state.changed().await;
                }
            }
        }
    }
}

/// The faults planned for one incarnation of a role: which strikes it before which step, each
/// once (a role that rolls back passes the step again).
pub struct RoleFaults {
    switch: RoleSwitch,
    planned: Mutex<Vec<(usize, RoleFault)>>,
}

impl RoleFaults {
    /// `planned` faults, struck through `switch`.
    pub fn new(switch: RoleSwitch, planned: Vec<(usize, RoleFault)>) -> Self {
        Self {
            switch,
            planned: Mutex::new(planned),
        }
    }

    /// Runs `work` under the switch of `faults`, or as it is when no faults are planned.
    pub async fn govern<T>(faults: Option<Arc<Self>>, work: impl Future<Output = Result<T>>) -> Result<T> {
        match faults {
            Some(faults) => faults.switch.govern(work).await,
            None => work.await,
        }
    }

    /// The role named `role` is about to take step `step` (counted from 0): a fault planned
    /// there strikes now, and the role goes no further than this call.
    pub async fn before_step(&self, role: &str, step: usize) {
        let fault = {
            let mut planned = self.planned.lock().unwrap_or_else(PoisonError::into_inner);
            let at = planned.iter().position(|&(s, _)| s == step);
            at.map(|at| planned.remove(at).1)
        };
        if let Some(fault) = fault {
            tracing::warn!(role, step, ?fault, "fault injected");
            self.switch.strike(fault);
            // The switch stops the role while it yields here.
            tokio::task::yield_now().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_stalled_role_stands_still_until_killed_and_a_fault_strikes_once() {
        let switch = RoleSwitch::default();
        let faults = RoleFaults::new(switch.clone(), vec![(3, RoleFault::Stall)]);
        let ticks = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counting = {
            let ticks = ticks.clone();
            async move {
                loop {
                    ticks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                #[allow(unreachable_code)]
                Ok::<(), anyhow::Error>(())
            }
        };
        let governed = tokio::spawn({
            let switch = switch.clone();
            async move { switch.govern(counting).await }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        faults.before_step("rank 1", 2).await;
        assert_eq!(*switch.0.borrow(), RoleState::Running);
        faults.before_step("rank 1", 3).await;
        assert_eq!(*switch.0.borrow(), RoleState::Stalled);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let stood = ticks.load(std::sync::atomic::Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            ticks.load(std::sync::atomic::Ordering::Relaxed),
            stood,
            "a stalled role is not polled"
        );
        switch.kill();
        let error = governed.await.unwrap().unwrap_err().to_string();
        assert!(error.contains("killed"), "{error}");
        assert!(faults.planned.lock().unwrap().is_empty(), "a fault strikes once");
    }
}
