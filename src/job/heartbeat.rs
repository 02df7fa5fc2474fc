//! A launched role's heartbeats: on a control connection of its own, the role tells the
//! coordinator every `heartbeat_interval_ms` that it is alive. When the coordinator has declared
//! another rank dead, or has itself been silent past the deadline, the role stops with that
//! reason instead of waiting on a peer that will never answer; when its work is done it says
//! goodbye, so its silence is not taken for a death.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use tokio::sync::oneshot;

use crate::actors::rollback::OrderLine;
use crate::config::JobConfig;
use crate::net::auth::Credentials;
use crate::net::protocol::Beat;
use crate::net::ControlBus;

/// Runs `work` (rank `rank`'s part of the job) while heartbeating to the coordinator at
/// `master`; ends with the first error of either. Rollback orders go down `orders` (a role that
/// does not roll back in place stops on one).
pub(super) async fn watched<T>(
    work: impl Future<Output = Result<T>>,
    rank: usize,
    master: &str,
    config: &JobConfig,
    credentials: &Credentials,
    orders: Option<&OrderLine>,
) -> Result<T> {
    let (done, stop) = oneshot::channel();
    let beats = beat(rank, master, config, credentials, orders, stop);
    tokio::pin!(work, beats);
    tokio::select! {
        outcome = &mut work => {
            let _ = done.send(());
            // Says goodbye (bounded by the deadline) before the process may exit.
            if let Err(e) = beats.await {
                tracing::debug!(rank, "after the work was done: {e:#}");
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
    master: &str,
    config: &JobConfig,
    credentials: &Credentials,
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
                "rank {rank}: the coordinator at {master} has not answered a heartbeat for {:.1}s \
                 (fault_tolerance.heartbeat_interval_ms × heartbeat_misses): presumed dead",
                deadline.as_secs_f64()
            ));
        }
        match connected(&mut line, master, left, max_frame, credentials).await {
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
            Err(e) => tracing::debug!(rank, "heartbeat line to {master}: {e:#}"),
        }
        tokio::select! {
            _ = &mut stop => {
                let limit = deadline.min(Duration::from_secs(2));
                return connected(&mut line, master, limit, max_frame, credentials).await?.leave(rank, limit).await;
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
    master: &str,
    limit: Duration,
    max_frame: usize,
    credentials: &Credentials,
) -> Result<&'a mut ControlBus> {
    let bus = match line.take() {
        Some(bus) => bus,
        None => ControlBus::connect(master, limit, max_frame, credentials).await?,
    };
    Ok(line.insert(bus))
}
