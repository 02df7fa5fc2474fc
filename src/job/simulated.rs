//! The simulated cluster: every rank's trainer and device actor in this
//! process, the coordinator reached by actor messages, ring links in memory.

use actix::prelude::*;
use anyhow::{anyhow, Result};

use super::{Recovery, RunOptions, RunOutcome, TrainingJob};
use crate::actors::device::RingLink;
use crate::actors::trainer::Train;
use crate::actors::Coordinator;
use crate::engines::comm::memory;
use crate::net::ControlBus;

pub(super) fn run(job: &TrainingJob, options: &RunOptions) -> Result<RunOutcome> {
    let world = job.config.world_size();
    let recovery = Recovery::plan(&job.config, &options.run_dir, &options.resume)?;
    let timeout = job.config.fault_tolerance.timeout();
    let outcomes = System::new().block_on(async move {
        let coordinator = Coordinator::for_job(world, &job.config, &recovery).start();
        let links: Vec<RingLink> = if world == 1 {
            vec![RingLink::Single]
        } else {
            memory::ring(world, timeout).into_iter().map(RingLink::Memory).collect()
        };
        let runs: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(rank, link)| {
                let bus = ControlBus::InMemory(coordinator.clone().into());
                let trainer = job.trainer(rank, bus, link, format!("memory:{rank}"), options, recovery.clone());
                let run = trainer.start().send(Train);
                async move {
                    run.await
                        .map_err(|e| anyhow!("rank {rank}: trainer actor stopped: {e}"))?
                        .map_err(|e| e.context(format!("rank {rank}")))
                }
            })
            .collect();
        // The first rank to fail ends the run with its error, rather than
        // leaving it to wait for the others' timeouts.
        futures::future::try_join_all(runs).await
    })?;
    let rank0 = outcomes
        .into_iter()
        .next()
        .ok_or_else(|| anyhow!("a job needs at least one rank"))?;
    Ok(RunOutcome::from_rank0(rank0, world, "in-process"))
}
