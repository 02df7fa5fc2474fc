//! The start of one rank of a launched data-parallel or pipeline job, written once: how it
//! recovers, its data endpoint bound before the rendezvous, the line rollback orders arrive on,
//! its line to the coordinator (hosted by rank 0 unless the coordinator runs as a process of
//! its own), and the heartbeats that watch its training.

use std::future::Future;
use std::net::TcpListener;
use std::sync::Arc;

use anyhow::Result;

use super::control::connect_control;
use super::process::{bind, RankEndpoints, RankRecovery};
use super::{Recovery, RunOptions};
use crate::actors::recovery::heartbeat::{watched, CoordinatorAt};
use crate::actors::recovery::rollback::{OrderLine, Orders};
use crate::actors::Coordinator;
use crate::config::JobConfig;
use crate::engines::comm::RingBreaker;
use crate::net::auth::Credentials;
use crate::net::ControlBus;

/// A rank of a launched job: where it meets the others and the line its orders arrive on.
pub(super) struct LaunchedRank {
    /// The job.
    pub(super) config: Arc<JobConfig>,
    /// This rank.
    pub(super) rank: usize,
    /// The coordinator's `ip:port`.
    pub(super) master: String,
    /// What every connection to another process proves.
    pub(super) credentials: Credentials,
    /// The heartbeat side of rollback orders, when the job recovers in place.
    order_line: Option<OrderLine>,
}

/// What the rank starts training with, its own to move.
pub(super) struct RankStart {
    /// Its data endpoint, bound before the rendezvous so peers can connect once the roster is
    /// out.
    pub(super) listener: TcpListener,
    /// The listener's address, announced at the rendezvous.
    pub(super) data_endpoint: String,
    /// The checkpoints it starts from and writes.
    pub(super) recovery: Recovery,
    /// The training side of rollback orders, when the job recovers in place.
    pub(super) orders: Option<Orders>,
    /// Where its rings hand their sockets, so a rollback order breaks the ring it is blocked in.
    pub(super) breaker: RingBreaker,
}

impl LaunchedRank {
    /// Rank `rank` of `config`'s job started as `options` say: its recovery planned, its data
    /// endpoint bound.
    pub(super) fn prepare(config: Arc<JobConfig>, rank: usize, options: &RunOptions) -> Result<(Self, RankStart)> {
        let RankRecovery { recovery, orders } = RankRecovery::plan(&config, options)?;
        let RankEndpoints {
            master,
            listener,
            data_endpoint,
            credentials,
        } = bind(&config, rank)?;
        let (order_line, orders) = orders.unzip();
        let breaker = order_line.as_ref().map(OrderLine::breaker).unwrap_or_default();
        let launched = Self {
            config,
            rank,
            master,
            credentials,
            order_line,
        };
        let start = RankStart {
            listener,
            data_endpoint,
            recovery,
            orders,
            breaker,
        };
        Ok((launched, start))
    }

    /// Whether the job recovers in place: its coordinator runs as a process of its own.
    pub(super) fn recovers_in_place(&self) -> bool {
        self.order_line.is_some()
    }

    /// The rank's line to the coordinator; rank 0 first hosts it, unless it runs as a process
    /// of its own. Must run inside an actix system.
    pub(super) async fn connect(&self, recovery: &Recovery) -> Result<ControlBus> {
        let config = &self.config;
        let hosted = (self.rank == 0 && !self.recovers_in_place()).then(|| Coordinator::for_job(config, recovery));
        let max_frame = config.cluster.max_frame_bytes();
        let ft = &config.fault_tolerance;
        connect_control(hosted, self.rank, &self.master, ft, max_frame, &self.credentials).await
    }

    /// Another line to the coordinator (the first one already serves something else).
    pub(super) async fn another_line(&self) -> Result<ControlBus> {
        let config = &self.config;
        let (timeout, max_frame) = (config.fault_tolerance.timeout(), config.cluster.max_frame_bytes());
        ControlBus::connect(&self.master, timeout, max_frame, &self.credentials).await
    }

    /// Runs `training` while heartbeating to the coordinator; rollback orders go down the
    /// rank's order line.
    pub(super) async fn watched<T>(&self, training: impl Future<Output = Result<T>>) -> Result<T> {
        let at = CoordinatorAt::tcp(&self.master, &self.credentials);
        watched(training, self.rank, at, &self.config, self.order_line.as_ref()).await
    }
}
