//! The coordinator as a process of its own (`flotilla run --role coordinator`): losing any
//! role — a trainer, rank 0 included, a pipeline stage or a parameter-server shard — then never
//! loses the coordinator, which replaces the lost role in place: the survivors roll back inside
//! their processes and only the lost one is restarted.

use std::time::Duration;

use actix::System;
use anyhow::Result;
use tokio::sync::oneshot;

use super::control::host_coordinator;
use super::launched_rank::master;
use super::{Recovery, Resume, RunOptions};
use crate::actors::{Coordinator, JobAskedToStop};
use crate::collective::preemption::{self, PreemptionWatch};
use crate::config::JobConfig;
use crate::net::auth::Credentials;

/// How long the coordinator lingers after the last rank left, so its farewell is answered.
const LINGER: Duration = Duration::from_millis(200);

/// Serves the coordinator of `config`'s job at `cluster.master` until every rank has finished.
pub fn run_coordinator(config: &JobConfig, options: &RunOptions) -> Result<()> {
    let recovery = Recovery::plan(config, &options.run_dir, &options.resume)?;
    // Restarted: the newest checkpoint it committed before (whose files are on the ranks'
    // nodes, not necessarily here).
    let recorded = match (&options.resume, &recovery.store) {
        (Resume::Fresh, _) | (_, None) => None,
        (_, Some(store)) => store.recorded()?,
    };
    let master = master(config)?;
    let ft = &config.fault_tolerance;
    let credentials = Credentials::of_cluster(&config.cluster, ft.timeout())?;
    let world = config.roles();
    // A SIGTERM to the whole job (preemption) leaves the coordinator serving until the ranks,
    // stopping at a checkpoint it commits, have left — or ended with the signal (ranks still in
    // their rendezvous), which nobody replaces then.
    let _watch = PreemptionWatch::install()?;
    System::new().block_on(async move {
        let (done, finished) = oneshot::channel();
        let mut coordinator = Coordinator::for_job(config, &recovery)
            .with_checkpoints(recovery.store.clone(), recovery.start_step())
            .recovering_in_place()
            .with_finish(done);
        if let Some(record) = recorded {
            coordinator = coordinator.with_record(record);
        }
        let coordinator =
            host_coordinator(coordinator, &master, ft, config.cluster.max_frame_bytes(), &credentials).await?;
        tracing::info!(%master, world, "coordinator serving");
        // The sender lives in the coordinator, which lives as long as this system.
        let mut finished = std::pin::pin!(finished);
        tokio::select! {
            _ = &mut finished => {}
            () = preemption::until_asked() => {
                coordinator.do_send(JobAskedToStop);
                let _ = finished.await;
            }
        }
        tracing::info!("no rank of the job runs on");
        tokio::time::sleep(LINGER).await;
        Ok(())
    })
}
