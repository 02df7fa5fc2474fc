//! A pipeline job in one process: `dp_degree` replicas of a `pp_degree`-stage pipeline, every
//! rank a stage actor with its own device actor; stages linked by channels, each stage's
//! replicas by an in-memory ring.

use actix::prelude::*;
use anyhow::{anyhow, Context as _, Result};

use super::{RunOutcome, Summary, TrainingJob};
use crate::actors::device::RingLink;
use crate::actors::stage::{StageActor, StageOutcome, TrainStage};
use crate::actors::DeviceActor;
use crate::collective::ParamChecksum;
use crate::engines::comm::memory;
use crate::pipeline::link::{memory_links, StageLink};

pub(super) fn run(job: &TrainingJob, show_progress: bool) -> Result<RunOutcome> {
    let config = job.config.clone();
    let (d, p) = (
        config.strategy.hybrid_configs.dp_degree,
        config.strategy.hybrid_configs.pp_degree,
    );
    let timeout = config.fault_tolerance.timeout();
    let outcomes = System::new().block_on(async move {
        // links[rank]: stage links within each replica, rings across replicas of each stage.
        let mut stage_links: Vec<Option<Box<dyn StageLink>>> = Vec::with_capacity(d * p);
        for _ in 0..d {
            stage_links.extend(
                memory_links(p, timeout)
                    .into_iter()
                    .map(|l| Some(Box::new(l) as Box<dyn StageLink>)),
            );
        }
        let mut rings: Vec<Vec<Option<RingLink>>> = (0..p)
            .map(|_| {
                if d == 1 {
                    vec![Some(RingLink::Single)]
                } else {
                    memory::ring(d, timeout)
                        .into_iter()
                        .map(|t| Some(RingLink::Memory(t)))
                        .collect()
                }
            })
            .collect();
        let runs = (0..d * p).map(|rank| {
            let (replica, stage) = (rank / p, rank % p);
            let actor = StageActor {
                rank,
                job: config.clone(),
                model: job.model.clone(),
                train_data: job.train_data.clone(),
                test_data: job.test_data.clone(),
                link: stage_links[rank].take(),
                data_parallel: rings[stage][replica].take(),
                device: SyncArbiter::start(1, DeviceActor::default),
                show_progress: show_progress && rank == p - 1,
            };
            async move {
                actor
                    .start()
                    .send(TrainStage)
                    .await
                    .map_err(|e| anyhow!("rank {rank}: stage actor stopped: {e}"))?
                    .map_err(|e| e.context(format!("rank {rank} (stage {stage} of replica {replica})")))
            }
        });
        futures::future::try_join_all(runs).await
    })?;
    summarise(job, &outcomes[..p])
}

/// The run's outcome from replica 0's stages (replicas hold equal parameters).
fn summarise(job: &TrainingJob, replica0: &[StageOutcome]) -> Result<RunOutcome> {
    let config = &job.config;
    let last = replica0.last().context("a pipeline needs at least one stage")?;
    let holder = replica0
        .iter()
        .find(|o| o.evaluated.is_some())
        .context("no stage held the last virtual stage")?;
    let (correct, total) = holder.evaluated.unwrap_or_default();
    let parameters: Vec<(String, Vec<f32>)> = replica0.iter().flat_map(|o| o.parameters.clone()).collect();
    Ok(RunOutcome {
        summary: Summary {
            strategy: "pipeline".to_string(),
            world_size: config.world_size(),
            cluster: "in-process".to_string(),
            steps: last.steps,
            samples_per_sec: last.samples_per_sec,
            final_loss: holder.losses.last().copied().unwrap_or(f32::NAN),
            test_accuracy: if total == 0 { 0.0 } else { correct as f64 / total as f64 },
            comm_time_ratio: holder.allreduce_ratio,
            exposed_comm_ratio: holder.allreduce_ratio,
            param_checksum: ParamChecksum::of_values(&parameters).to_string(),
            peak_activation_bytes: Some(replica0.iter().map(|o| o.peak_activation_bytes).collect()),
            bubble_fraction: Some(replica0.iter().map(|o| o.bubble_fraction).sum::<f64>() / replica0.len() as f64),
        },
        losses: holder.losses.clone(),
        parameters,
    })
}
