//! The start of one rank of a launched data-parallel or pipeline job, written once: how it
//! recovers, its data endpoint bound before the rendezvous, the line rollback orders arrive on,
//! its line to the coordinator (hosted by rank 0 unless the coordinator runs as a process of
//! its own), and the heartbeats that watch its training.

use std::future::Future;
use std::net::TcpListener;
use std::sync::Arc;

use anyhow::{anyhow, Context as _, Result};

use super::control::connect_control;
use super::{Recovery, Refusal, RunOptions};
use crate::actors::recovery::buddy::Buddy;
use crate::actors::recovery::file_mirror::{serve_mirror, MirrorLine};
use crate::actors::recovery::heartbeat::{watched, CoordinatorAt};
use crate::actors::recovery::rollback::{order_line, OrderLine, Orders};
use crate::actors::Coordinator;
use crate::checkpoint::CheckpointStore;
use crate::config::JobConfig;
use crate::engines::comm::RingBreaker;
use crate::net::auth::Credentials;
use crate::net::protocol::Mismatch;
use crate::net::ControlBus;

/// Set (to any value) on the trainers of a job whose coordinator runs as a process of its own
/// (`flotilla run --role coordinator`, which `flotilla launch` starts): rank 0 hosts none, and
/// a lost rank is replaced in place while the others roll back inside their processes.
pub const COORDINATOR_PROCESS_VAR: &str = "FLOTILLA_COORDINATOR_PROCESS";

/// Whether this process's job has a coordinator process of its own.
pub fn coordinator_is_own_process() -> bool {
    std::env::var_os(COORDINATOR_PROCESS_VAR).is_some()
}

/// Where a rank of a launched job meets the others.
pub(super) struct RankEndpoints {
    /// The coordinator's `ip:port`.
    pub master: String,
    /// This rank's data endpoint, bound before the rendezvous so that peers
    /// can connect as soon as the roster is out.
    pub listener: TcpListener,
    /// The listener's address, announced at the rendezvous.
    pub data_endpoint: String,
    /// What every connection to another process proves.
    pub credentials: Credentials,
}

/// The coordinator's `ip:port`, `cluster.master`.
pub(super) fn master(config: &JobConfig) -> Result<String> {
    config.cluster.master.clone().ok_or_else(|| {
        anyhow!("{}: cluster.master is not set: a multi-process job needs the coordinator's ip:port (flotilla launch sets PADDLE_MASTER)", config.source_name)
    })
}

/// Binds `rank`'s data endpoint (the configured one, else an ephemeral port on the address this
/// host reaches the coordinator from: started by an engine that lists no endpoints, a rank
/// announces one its peers on other hosts can reach): the listener and its address.
pub(super) fn bind_data_endpoint(config: &JobConfig, rank: usize) -> Result<(TcpListener, String)> {
    let endpoint = match config.cluster.endpoints.get(rank) {
        Some(endpoint) => endpoint.clone(),
        None => format!("{}:0", address_towards(config.cluster.master.as_deref())),
    };
    let listener = TcpListener::bind(&endpoint)
        .with_context(|| format!("rank {rank}: cannot bind its data endpoint {endpoint}"))?;
    let data_endpoint = listener.local_addr()?.to_string();
    Ok((listener, data_endpoint))
}

/// The address of this host's interface that routes to `master` (no packet is sent: a UDP
/// socket's connect only picks the route); the loopback address without one.
pub(super) fn address_towards(master: Option<&str>) -> std::net::IpAddr {
    let loopback = std::net::IpAddr::from([127, 0, 0, 1]);
    let Some(master) = master else {
        return loopback;
    };
    let routed = std::net::UdpSocket::bind("0.0.0.0:0")
        .and_then(|socket| socket.connect(master).map(|()| socket))
        .and_then(|socket| socket.local_addr());
    match routed {
        Ok(local) => local.ip(),
        Err(e) => {
            tracing::debug!("no route to the coordinator at {master} ({e}): the data endpoint stays on loopback");
            loopback
        }
    }
}

/// Checks `rank` against the world and binds its data endpoint.
pub(super) fn bind(config: &JobConfig, rank: usize) -> Result<RankEndpoints> {
    let world = config.world_size();
    anyhow::ensure!(
        rank < world,
        "PADDLE_TRAINER_ID = {rank} is outside the world size {world}"
    );
    let master = master(config)?;
    let (listener, data_endpoint) = bind_data_endpoint(config, rank)?;
    let credentials = Credentials::of_cluster(&config.cluster, config.fault_tolerance.timeout())?;
    Ok(RankEndpoints {
        master,
        listener,
        data_endpoint,
        credentials,
    })
}

/// A role's checkpoint mirror ([`crate::actors::recovery::file_mirror`]), for a job that recovers in place
/// and takes checkpoints: bound when the role starts, served for its life.
pub(super) struct RoleMirror {
    listener: TcpListener,
    /// Where other roles reach it.
    endpoint: String,
    store: CheckpointStore,
    line: MirrorLine,
}

impl RoleMirror {
    /// The mirror of a role on `host` of `config`'s job, which writes checkpoints to `recovery`'s
    /// store; `None` when the job takes none.
    pub(super) fn bind(config: &JobConfig, host: &str, recovery: &Recovery) -> Result<Option<Self>> {
        let Some(store) = recovery.store.clone() else {
            return Ok(None);
        };
        let listener =
            TcpListener::bind((host, 0)).with_context(|| format!("cannot bind a checkpoint mirror on {host}"))?;
        listener.set_nonblocking(true)?;
        let endpoint = listener.local_addr()?.to_string();
        let ft = &config.fault_tolerance;
        let line = MirrorLine {
            credentials: Credentials::of_cluster(&config.cluster, ft.timeout())?,
            max_frame: config.cluster.max_frame_bytes(),
            timeout: ft.timeout(),
        };
        Ok(Some(Self {
            listener,
            endpoint,
            store,
            line,
        }))
    }

    /// Serves the mirror (inside an actix system); returns its address, which the role
    /// announces, and how the role reaches its buddy's.
    pub(super) fn serve_at(self) -> Result<(String, Buddy)> {
        let listener = tokio::net::TcpListener::from_std(self.listener)?;
        let line = self.line.clone();
        actix::spawn(serve_mirror(
            listener,
            self.store,
            line.credentials.clone(),
            line.max_frame,
        ));
        Ok((self.endpoint, Buddy { line }))
    }
}

/// The host part of an `ip:port` endpoint.
pub(super) fn host_of(endpoint: &str) -> &str {
    endpoint.rsplit_once(':').map_or(endpoint, |(host, _)| host)
}

/// How a launched rank recovers: the checkpoints it starts from and writes, and — when the
/// coordinator runs as a process of its own, so the job recovers in place — the line its
/// rollback orders arrive on (the heartbeat side) and the orders (the training side).
pub(super) struct RankRecovery {
    pub(super) recovery: Recovery,
    pub(super) orders: Option<(OrderLine, Orders)>,
}

impl RankRecovery {
    /// The recovery of a rank of `config`'s job started as `options` say.
    pub(super) fn plan(config: &JobConfig, options: &RunOptions) -> Result<Self> {
        if !coordinator_is_own_process() {
            let recovery = Recovery::plan(config, &options.run_dir, &options.resume)?;
            return Ok(Self { recovery, orders: None });
        }
        let recovery = Recovery::plan_replaceable(config, &options.run_dir, &options.resume)?;
        // A failed rank waits this long to hear whether a peer's death explains its failure:
        // the coordinator's detection, then a heartbeat to carry the order.
        let ft = &config.fault_tolerance;
        let grace = ft.heartbeat_deadline() + 2 * ft.heartbeat_interval();
        Ok(Self {
            recovery,
            orders: Some(order_line(grace)),
        })
    }
}

/// A rank the coordinator refused as started for another job exits as refusing to start: no
/// restart of it can help.
pub(super) fn refused_if_mismatched(error: anyhow::Error) -> anyhow::Error {
    if error.chain().any(|cause| cause.is::<Mismatch>()) {
        Refusal::wrap(error)
    } else {
        error
    }
}

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
