//! The control line of one process of a multi-process job: the coordinator is hosted on the
//! master endpoint by rank 0 (or runs as a process of its own), and every rank (rank 0 too)
//! connects to it over TCP, so all ranks take the same path.

use actix::Addr;
use anyhow::{Context, Result};

use crate::actors::Coordinator;
use crate::config::FaultToleranceConfig;
use crate::net::auth::Credentials;
use crate::net::{server, ControlBus};

/// Hosts `coordinator` when this process hosts one (rank 0's), then connects rank `rank` to
/// the coordinator at `master`. Must run inside an actix system.
pub async fn connect_control(
    coordinator: Option<Coordinator>,
    rank: usize,
    master: &str,
    fault_tolerance: &FaultToleranceConfig,
    max_frame_bytes: usize,
    credentials: &Credentials,
) -> Result<ControlBus> {
    let timeout = fault_tolerance.timeout();
    if let Some(coordinator) = coordinator {
        host_coordinator(coordinator, master, fault_tolerance, max_frame_bytes, credentials)
            .await
            .with_context(|| format!("rank {rank}"))?;
    }
    ControlBus::connect(master, timeout, max_frame_bytes, credentials)
        .await
        .with_context(|| format!("rank {rank}"))
}

/// Serves `coordinator`, watching heartbeats, at `master` (cluster.master) until the actor
/// system stops, and returns its address. Must run inside an actix system.
pub(super) async fn host_coordinator(
    coordinator: Coordinator,
    master: &str,
    fault_tolerance: &FaultToleranceConfig,
    max_frame_bytes: usize,
    credentials: &Credentials,
) -> Result<Addr<Coordinator>> {
    let control = tokio::net::TcpListener::bind(master)
        .await
        .with_context(|| format!("cannot bind the coordinator endpoint {master} (cluster.master)"))?;
    let coordinator = actix::Actor::start(coordinator.with_heartbeat_deadline(fault_tolerance.heartbeat_deadline()));
    actix::spawn(server::serve(
        control,
        coordinator.clone().into(),
        max_frame_bytes,
        credentials.clone(),
    ));
    Ok(coordinator)
}
