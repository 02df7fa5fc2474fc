//! A role's heartbeats: on a control connection of its own (or, in a simulated cluster, on its
//! incarnation's line), the role tells the coordinator every `heartbeat_interval_ms` that it is
//! alive. When the coordinator has declared
//! another rank dead, or has itself been silent past the deadline, the role stops with that
//! reason instead of waiting on a peer that will never answer; when its work is done it says
//! goodbye, so its silence is not taken for a death (a role that failed says none).

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use tokio::sync::oneshot;

use crate::actors::rollback::OrderLine;
use crate::collective::preemption::is_preemption;
use crate::config::JobConfig;
use crate::net::auth::Credentials;
use crate::net::protocol::{Beat, CoordinatorLine};
use crate::net::ControlBus;

/// Where a role's heartbeats go.
#[derive(Clone, Copy)]
pub(super) enum CoordinatorAt<'a> {
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
    pub(super) fn tcp(master: &'a str, credentials: &'a Credentials) -> Self {
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
pub(super) async fn watched<T>(
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
    let max_frame = config.cluster.max_frame_bytes();
    let mut line: Option<ControlBus> = None;
    let mut last_answer = Instant::now();
    loop {
        let left = deadline.saturating_sub(last_answer.elapsed());
        if left.is_zero() {
            return Err(anyhow!(
                "rank {rank}: {} has not answered a heartbeat for {:.1}s \
                 (fault_tolerance.heartbeat_interval_ms × heartbeat_misses): presumed dead",
                at.name(),
                deadline.as_secs_f64()
            ));
        }
        match connected(&mut line, at, left, max_frame).await {
            Ok(bus) => match bus.heartbeat(rank, orders.and_then(OrderLine::member_of), left).await {
                Ok(Ok(Beat::Alive)) => last_answer = Instant::now(),
                Ok(Ok(Beat::RollBack { generation, reason })) => match orders {
                    Some(orders) => {
                        last_answer = Instant::now();
                        orders.order(generation, reason);
                    }
                    None => return Err(anyhow!("rank {rank}: {reason}")),
                },
                // The coordinator stopped the job: say why, at once.
                Ok(Err(reason)) => return Err(anyhow!("rank {rank}: {reason}")),
                Err(e) => {
                    tracing::debug!(rank, "heartbeat not answered: {e:#}");
                    line = None;
                }
            },
            // A broken line is retried until the deadline has passed.
            Err(e) => tracing::debug!(rank, "heartbeat line to {}: {e:#}", at.name()),
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
