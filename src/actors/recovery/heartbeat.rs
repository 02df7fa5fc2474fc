//! A role's heartbeats: on a control connection of its own (or, in a simulated cluster, on its
//! incarnation's line), the role tells the coordinator every `heartbeat_interval_ms` that it is
//! alive. When the coordinator has declared another rank dead the role stops (or rolls back)
//! with that reason instead of waiting on a peer that will never answer; when its work is done
//! it says goodbye, so its silence is not taken for a death (a role that failed says none).
//!
//! A silent coordinator is not at once a dead one. A role that recovers in place talks to a
//! coordinator process of its own, which a stall (a paused VM, swap, a starved CPU) can silence
//! for seconds and whose launcher replaces it when it stays silent: such a role keeps its
//! heartbeat waiting on the same line — dropping it would read as its own death to the
//! coordinator once it wakes — trains on, warns once the heartbeat deadline has passed, and
//! gives the coordinator up only after `fault_tolerance.timeout_s`. A role whose coordinator
//! lives in rank 0's process (a job restarted whole) takes its silence past the heartbeat
//! deadline for rank 0's death, as before.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use tokio::sync::oneshot;

use crate::actors::recovery::rollback::{OrderLine, RollbackOrder};
use crate::collective::preemption::is_preemption;
use crate::config::JobConfig;
use crate::net::auth::Credentials;
use crate::net::protocol::{Beat, CoordinatorLine};
use crate::net::ControlBus;

/// Where a role's heartbeats go.
#[derive(Clone, Copy)]
pub(crate) enum CoordinatorAt<'a> {
    /// At `master`, over TCP: each role beats on a connection of its own.
    Tcp {
        /// The coordinator's `ip:port`.
        master: &'a str,
        /// What the connection proves.
        credentials: &'a Credentials,
    },
    /// In this process (a simulated cluster), on the line of the role's incarnation.
    InMemory(&'a CoordinatorLine),
}

impl<'a> CoordinatorAt<'a> {
    /// At `master`, proving `credentials`.
    pub(crate) fn tcp(master: &'a str, credentials: &'a Credentials) -> Self {
        Self::Tcp { master, credentials }
    }

    /// The coordinator, as errors name it.
    fn name(&self) -> String {
        match self {
            Self::Tcp { master, .. } => format!("the coordinator at {master}"),
            Self::InMemory(_) => "the coordinator".to_string(),
        }
    }
}

/// Runs `work` (rank `rank`'s part of the job) while heartbeating to the coordinator `at`;
/// ends with the first error of either. Rollback orders go down `orders` (a role that does not
/// roll back in place stops on one).
pub(crate) async fn watched<T>(
    work: impl Future<Output = Result<T>>,
    rank: usize,
    at: CoordinatorAt<'_>,
    config: &JobConfig,
    orders: Option<&OrderLine>,
) -> Result<T> {
    let (done, stop) = oneshot::channel();
    let beats = beat(rank, at, config, orders, stop);
    tokio::pin!(work, beats);
    tokio::select! {
        outcome = &mut work => {
            // A role that finished (or stopped for preemption, with the others) says goodbye
            // (bounded by the deadline) before its process may exit; one that failed does not:
            // its silence is a death, recovered from.
            if outcome.as_ref().map_or_else(is_preemption, |_| true) {
                let _ = done.send(());
                if let Err(e) = beats.await {
                    tracing::debug!(rank, "after the work was done: {e:#}");
                }
            }
            outcome
        }
        stopped = &mut beats => match stopped {
            Err(e) => Err(e),
            Ok(()) => work.await,
        },
    }
}

/// Heartbeats until `stop` fires (then leaves, and returns `Ok`) or the job cannot go on.
async fn beat(
    rank: usize,
    at: CoordinatorAt<'_>,
    config: &JobConfig,
    orders: Option<&OrderLine>,
    mut stop: oneshot::Receiver<()>,
) -> Result<()> {
    let ft = &config.fault_tolerance;
    let (interval, deadline) = (ft.heartbeat_interval(), ft.heartbeat_deadline());
    let patience = CoordinatorPatience::of(config, orders.is_some());
    let max_frame = config.cluster.max_frame_bytes();
    let mut line: Option<ControlBus> = None;
    let mut last_answer = Instant::now();
    let mut warned = false;
    loop {
        let left = patience.limit.saturating_sub(last_answer.elapsed());
        if left.is_zero() {
            return Err(anyhow!(
                "rank {rank}: {} has not answered a heartbeat for {:.1}s ({}): presumed dead",
                at.name(),
                patience.limit.as_secs_f64(),
                patience.key
            ));
        }
        let heartbeat = async {
            let bus = connected(&mut line, at, left, max_frame).await?;
            bus.heartbeat(rank, orders.and_then(OrderLine::member_of), left).await
        };
        let answered = warn_when_late(heartbeat, rank, at, last_answer + deadline, &mut warned).await;
        if warned && answered.is_ok() {
            warned = false;
            tracing::info!(
                rank,
                silent_s = last_answer.elapsed().as_secs_f64(),
                "{} answers again",
                at.name()
            );
        }
        match answered {
            Ok(Ok(Beat::Alive)) => last_answer = Instant::now(),
            Ok(Ok(Beat::RollBack { generation, reason })) => match orders {
                Some(orders) => {
                    last_answer = Instant::now();
                    orders.order(RollbackOrder { generation, reason });
                }
                None => return Err(anyhow!("rank {rank}: {reason}")),
            },
            // The coordinator stopped the job: say why, at once.
            Ok(Err(reason)) => return Err(anyhow!("rank {rank}: {reason}")),
            // A broken line is connected again until the coordinator is presumed dead.
            Err(e) => {
                tracing::debug!(rank, "heartbeat to {} not answered: {e:#}", at.name());
                line = None;
            }
        }
        tokio::select! {
            _ = &mut stop => {
                let limit = deadline.min(Duration::from_secs(2));
                return connected(&mut line, at, limit, max_frame).await?.leave(rank, limit).await;
            }
            () = tokio::time::sleep(interval) => {}
            // A failed rank asks whether a rollback explains its failure: beat now.
            () = asked(orders) => {}
        }
    }
}

/// How long a role waits for a silent coordinator before it presumes it dead, and the setting
/// that says so.
struct CoordinatorPatience {
    limit: Duration,
    key: &'static str,
}

impl CoordinatorPatience {
    /// `fault_tolerance.timeout_s` (at least the heartbeat deadline) for a role that recovers in
    /// place, whose coordinator is a process of its own that its launcher replaces when it hangs;
    /// the heartbeat deadline for one whose coordinator lives in rank 0's process.
    fn of(config: &JobConfig, in_place: bool) -> Self {
        let ft = &config.fault_tolerance;
        if in_place {
            Self {
                limit: ft.coordinator_patience(),
                key: "fault_tolerance.timeout_s",
            }
        } else {
            Self {
                limit: ft.heartbeat_deadline(),
                key: "fault_tolerance.heartbeat_interval_ms × heartbeat_misses",
            }
        }
    }
}

/// Awaits `heartbeat`'s answer; past `due` (the heartbeat deadline since the coordinator last
/// answered) warns, once per silence, that the role trains on without it.
async fn warn_when_late<T>(
    heartbeat: impl Future<Output = T>,
    rank: usize,
    at: CoordinatorAt<'_>,
    due: Instant,
    warned: &mut bool,
) -> T {
    tokio::pin!(heartbeat);
    tokio::select! {
        answer = &mut heartbeat => answer,
        () = tokio::time::sleep_until(due.into()), if !*warned => {
            *warned = true;
            tracing::warn!(
                rank,
                "{} has not answered a heartbeat within the heartbeat deadline \
                 (fault_tolerance.heartbeat_interval_ms × heartbeat_misses): training on and waiting for it",
                at.name()
            );
            heartbeat.await
        }
    }
}

/// Resolves when the training side asks for a heartbeat now (never without an order line).
async fn asked(orders: Option<&OrderLine>) {
    match orders {
        Some(orders) => orders.asked().await,
        None => std::future::pending().await,
    }
}

/// The heartbeat line, connected (within `limit`) if it is not.
async fn connected<'a>(
    line: &'a mut Option<ControlBus>,
    at: CoordinatorAt<'_>,
    limit: Duration,
    max_frame: usize,
) -> Result<&'a mut ControlBus> {
    let bus = match (line.take(), at) {
        (Some(bus), _) => bus,
        (None, CoordinatorAt::Tcp { master, credentials }) => {
            ControlBus::connect(master, limit, max_frame, credentials).await?
        }
        (None, CoordinatorAt::InMemory(coordinator)) => ControlBus::InMemory(coordinator.clone()),
    };
    Ok(line.insert(bus))
}
