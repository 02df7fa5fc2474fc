//! The control line of one process of a multi-process job: rank 0 hosts
//! the coordinator on the master endpoint, and every rank (rank 0 too)
//! connects to it over TCP, so all ranks take the same path.

use actix::Actor;
use anyhow::{Context, Result};

use crate::actors::Coordinator;
use crate::config::FaultToleranceConfig;
use crate::net::auth::Credentials;
use crate::net::{server, ControlBus};

/// Hosts the coordinator when `rank` is 0, then connects to it. Must run
/// inside an actix system.
pub async fn connect_control(
    rank: usize,
    world_size: usize,
    master: &str,
    fault_tolerance: &FaultToleranceConfig,
    max_frame_bytes: usize,
    credentials: &Credentials,
) -> Result<ControlBus> {
    let timeout = fault_tolerance.timeout();
    if rank == 0 {
        let coordinator = Coordinator::new(world_size, timeout);
        host_coordinator(coordinator, master, fault_tolerance, max_frame_bytes, credentials)
            .await
            .context("rank 0")?;
    }
    ControlBus::connect(master, timeout, max_frame_bytes, credentials)
        .await
        .with_context(|| format!("rank {rank}"))
}

/// Serves `coordinator`, watching heartbeats, at `master` (cluster.master) until the actor
/// system stops. Must run inside an actix system.
pub(super) async fn host_coordinator(
    coordinator: Coordinator,
    master: &str,
    fault_tolerance: &FaultToleranceConfig,
    max_frame_bytes: usize,
    credentials: &Credentials,
) -> Result<()> {
    let control = tokio::net::TcpListener::bind(master)
        .await
        .with_context(|| format!("cannot bind the coordinator endpoint {master} (cluster.master)"))?;
    let coordinator = coordinator
        .with_heartbeat_deadline(fault_tolerance.heartbeat_deadline())
        .start();
    actix::spawn(server::serve(
        control,
        coordinator.into(),
        max_frame_bytes,
        credentials.clone(),
    ));
    Ok(())
}
