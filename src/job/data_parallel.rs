//! One rank of a launched data-parallel job. Rank 0 also hosts the coordinator on
//! `cluster.master`, unless the coordinator runs as a process of its own
//! ([`super::COORDINATOR_PROCESS_VAR`]): then a lost rank is replaced in place, and
//! this rank rolls back inside its process. Every rank binds its data endpoint
//! (the configured one, or an ephemeral port) before joining
//! ([`super::launched_rank`]), reaches the coordinator over TCP and builds its ring from the
//! roster.

use std::net::TcpListener;

use actix::prelude::*;
use anyhow::Result;

use super::launched_rank::{bind_data_endpoint, refused_if_mismatched, LaunchedRank, RankStart};
use super::{RunOptions, RunOutcome, TrainingJob};
use crate::actors::ring_link::RingLink;
use crate::actors::trainer::InPlace;
use crate::config::JobConfig;
use crate::engines::comm::hierarchy::NodeLayout;
use crate::engines::comm::RingBreaker;
use crate::net::auth::Credentials;

/// Runs data-parallel rank `rank` of `job` as a launched process: the outcome where it is the
/// rank at place 0.
pub(super) fn run(job: &TrainingJob, rank: usize, options: &RunOptions) -> Result<Option<RunOutcome>> {
    let (launched, start) = LaunchedRank::prepare(job.config.clone(), rank, options)?;
    let RankStart {
        listener,
        data_endpoint,
        recovery,
        orders,
        breaker,
    } = start;
    let config = launched.config.clone();
    let credentials = launched.credentials.clone();
    let link = ring_link(&config, rank, listener, &credentials, &breaker);
    let in_place = orders.map(|orders| InPlace {
        orders,
        relink: Box::new(move || {
            let (listener, endpoint) = bind_data_endpoint(&config, rank)?;
            Ok((ring_link(&config, rank, listener, &credentials, &breaker), endpoint))
        }),
    });
    System::new()
        .block_on(async move {
            let bus = launched.connect(&recovery).await?;
            let training = async {
                let mut trainer = job.trainer(rank, bus, link, data_endpoint, options, recovery);
                trainer.in_place = in_place;
                let outcome = trainer.train().await?;
                // The rank at place 0 writes the outputs before it says goodbye: until then its
                // loss is a death the coordinator recovers from.
                let outcome = match outcome.rank {
                    0 => Some(RunOutcome::from_rank0(outcome, &job.config, "multi-process")?),
                    _ => None,
                };
                if let Some(outcome) = &outcome {
                    outcome.write(&options.run_dir, job)?;
                }
                Ok(outcome)
            };
            launched.watched(training).await
        })
        .map_err(refused_if_mismatched)
}

/// Rank `rank`'s ring link over `listener` (none when it trains alone).
pub(crate) fn ring_link(
    config: &JobConfig,
    rank: usize,
    listener: TcpListener,
    credentials: &Credentials,
    breaker: &RingBreaker,
) -> RingLink {
    if config.world_size() == 1 {
        return RingLink::Single;
    }
    RingLink::Tcp {
        rank,
        listener,
        timeout: config.fault_tolerance.timeout(),
        shared_memory: config.cluster.shared_memory,
        hierarchical: config.hierarchical_setting(),
        configured: NodeLayout::configured(config),
        credentials: credentials.clone(),
        breaker: breaker.clone(),
    }
}
