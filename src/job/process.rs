//! One rank of a multi-process job. Rank 0 also hosts the coordinator on
//! `cluster.master`; every rank binds its data endpoint (the configured one,
//! or an ephemeral port) before joining, reaches the coordinator over TCP
//! and builds its ring from the roster.

use std::net::TcpListener;

use actix::prelude::*;
use anyhow::{anyhow, Context, Result};

use super::control::connect_control;
use super::heartbeat::watched;
use super::{Recovery, RunOptions, RunOutcome, TrainingJob};
use crate::actors::device::RingLink;
use crate::actors::trainer::Train;
use crate::config::JobConfig;
use crate::net::auth::Credentials;

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

/// Checks `rank` against the world and binds its data endpoint.
pub(super) fn bind(config: &JobConfig, rank: usize) -> Result<RankEndpoints> {
    let world = config.world_size();
    anyhow::ensure!(
        rank < world,
        "PADDLE_TRAINER_ID = {rank} is outside the world size {world}"
    );
    let master = config.cluster.master.clone().ok_or_else(|| {
        anyhow!("{}: cluster.master is not set: a multi-process job needs the coordinator's ip:port (flotilla launch sets PADDLE_MASTER)", config.source_name)
    })?;
    let endpoint = config
        .cluster
        .endpoints
        .get(rank)
        .cloned()
        .unwrap_or_else(|| "127.0.0.1:0".to_string());
    let listener = TcpListener::bind(&endpoint)
        .with_context(|| format!("rank {rank}: cannot bind its data endpoint {endpoint}"))?;
    let data_endpoint = listener.local_addr()?.to_string();
    let credentials = Credentials::new(config.cluster.cluster_token()?, config.fault_tolerance.timeout());
    Ok(RankEndpoints {
        master,
        listener,
        data_endpoint,
        credentials,
    })
}

pub(super) fn run(job: &TrainingJob, rank: usize, options: &RunOptions) -> Result<Option<RunOutcome>> {
    let config = job.config.clone();
    let recovery = Recovery::plan(&config, &options.run_dir, &options.resume)?;
    let world = config.world_size();
    let timeout = config.fault_tolerance.timeout();
    let max_frame = config.cluster.max_frame_bytes();
    let RankEndpoints {
        master,
        listener,
        data_endpoint,
        credentials,
    } = bind(&config, rank)?;
    let link = if world == 1 {
        RingLink::Single
    } else {
        RingLink::Tcp {
            rank,
            listener,
            timeout,
            shared_memory: config.cluster.shared_memory,
            credentials: credentials.clone(),
        }
    };

    let outcome = System::new().block_on(async move {
        let bus = connect_control(rank, world, &master, &config.fault_tolerance, max_frame, &credentials).await?;
        let training = async {
            job.trainer(rank, bus, link, data_endpoint, options, recovery)
                .start()
                .send(Train)
                .await
                .map_err(|e| anyhow!("rank {rank}: trainer actor stopped: {e}"))?
        };
        watched(training, rank, &master, &config, &credentials).await
    })?;
    Ok((rank == 0).then(|| RunOutcome::from_rank0(outcome, world, "multi-process")))
}
