//! A pipeline job: `dp_degree` replicas of a `pp_degree`-stage pipeline, every rank a stage
//! actor with its own device actor. In one process ([`run`]) stages are linked by channels and
//! each stage's replicas by an in-memory ring. As one rank of a launched job ([`run_rank`])
//! they are linked by rings over TCP or shared memory ([`super::stage_rings`]), and rank 0
//! writes the outputs from the outcomes replica 0's ranks gather to it over the control bus.

use actix::prelude::*;
use anyhow::{anyhow, Context as _, Result};
use bytes::Bytes;

use super::control::connect_control;
use super::heartbeat::watched;
use super::process::{bind, RankEndpoints};
use super::{stage_rings, Recovery, RunOptions, RunOutcome, Summary, TrainingJob};
use crate::actors::device::StageLinks;
use crate::actors::stage::{StageActor, StageOutcome, TrainStage};
use crate::actors::{Coordinator, DeviceActor};
use crate::collective::ParamChecksum;
use crate::engines::comm::{memory, Communicator};
use crate::net::ControlBus;
use crate::pipeline::link::memory_links;
use crate::telemetry::timeline::TraceTarget;

/// All ranks in this process.
pub(super) fn run(job: &TrainingJob, options: &RunOptions) -> Result<RunOutcome> {
    let config = job.config.clone();
    let trace = options.trace_target();
    let (d, p) = (
        config.strategy.hybrid_configs.dp_degree,
        config.strategy.hybrid_configs.pp_degree,
    );
    let timeout = config.fault_tolerance.timeout();
    let recovery = Recovery::plan(&config, &options.run_dir, &options.resume)?;
    let outcomes = System::new().block_on(async move {
        // For the checkpoint protocol's gathers.
        let coordinator = Coordinator::for_job(d * p, &config, &recovery).start();
        // links[rank]: stage links within each replica, rings across replicas of each stage.
        let mut stage_links: Vec<Option<StageLinks>> = Vec::with_capacity(d * p);
        for _ in 0..d {
            stage_links.extend(
                memory_links(p, timeout)
                    .into_iter()
                    .map(|l| Some(StageLinks::Made(Box::new(l)))),
            );
        }
        let mut rings: Vec<Vec<Option<Communicator>>> = (0..p)
            .map(|_| {
                if d == 1 {
                    vec![Some(Communicator::single())]
                } else {
                    memory::ring(d, timeout)
                        .into_iter()
                        .map(|t| Some(Communicator::new(Box::new(t))))
                        .collect()
                }
            })
            .collect();
        let runs = (0..d * p).map(|rank| {
            let (link, data_parallel) = (stage_links[rank].take(), rings[rank % p][rank / p].take());
            let bus = ControlBus::InMemory(coordinator.clone().into());
            let recovery = recovery.clone();
            let trace = trace.clone();
            async move {
                let link = link.context("each rank's stage link is taken once")?;
                let data_parallel = data_parallel.context("each rank's ring is taken once")?;
                let lines = StageLines {
                    link,
                    data_parallel,
                    bus,
                };
                train(stage_actor(job, rank, lines, recovery, options, trace)).await
            }
        });
        futures::future::try_join_all(runs).await
    })?;
    summarise(job, &outcomes[..p], "in-process")
}

/// One rank of a launched job: rank 0 also hosts the coordinator and returns the outcome.
pub(super) fn run_rank(job: &TrainingJob, rank: usize, options: &RunOptions) -> Result<Option<RunOutcome>> {
    let config = job.config.clone();
    let trace = options.trace_target();
    let (world, p) = (config.world_size(), config.strategy.hybrid_configs.pp_degree);
    let max_frame = config.cluster.max_frame_bytes();
    let RankEndpoints {
        master,
        listener,
        data_endpoint,
        credentials,
    } = bind(&config, rank)?;
    let recovery = Recovery::plan(&config, &options.run_dir, &options.resume)?;
    System::new().block_on(async move {
        let coordinator = (rank == 0).then(|| Coordinator::for_job(world, &config, &recovery));
        let mut bus = connect_control(
            coordinator,
            rank,
            &master,
            &config.fault_tolerance,
            max_frame,
            &credentials,
        )
        .await?;
        let roster = bus.join(rank, world, data_endpoint, config.shared_settings()).await?;
        let (link, data_parallel) = stage_rings::connect(
            &mut bus,
            &config,
            rank,
            &roster.endpoints,
            listener,
            credentials.clone(),
        )
        .await?;
        // The stage's own line for the checkpoint protocol; `bus` gathers the outcomes after.
        let stage_bus = ControlBus::connect(&master, config.fault_tolerance.timeout(), max_frame, &credentials).await?;
        let lines = StageLines {
            link,
            data_parallel,
            bus: stage_bus,
        };
        let training = train(stage_actor(job, rank, lines, recovery, options, trace));
        let outcome = watched(training, rank, &master, &config, &credentials, None).await?;
        // Rank 0 holds only its own stage, and the outputs need every stage's parameters and
        // the last stage's losses: replica 0's ranks (0..p) hand it their outcomes. The gather
        // is the end-of-training barrier too, so no rank (rank 0, with the coordinator, least
        // of all) leaves while another still needs it.
        let part = if rank < p { outcome.to_bytes()? } else { Bytes::new() };
        let parts = bus.gather(rank, "stage outcomes of replica 0", part).await?;
        if rank != 0 {
            return Ok(None);
        }
        let replica0 = parts
            .into_iter()
            .take(p)
            .map(StageOutcome::from_bytes)
            .collect::<Result<Vec<_>>>()
            .context("rank 0: gathering the stage outcomes of replica 0")?;
        summarise(job, &replica0, "multi-process").map(Some)
    })
}

/// How a stage reaches the others: its neighbours, its replicas, the coordinator.
struct StageLines {
    link: StageLinks,
    data_parallel: Communicator,
    bus: ControlBus,
}

/// Rank `rank`'s stage actor with its own device actor; the rank of replica 0's last stage,
/// which sees the loss, reports. Must run inside an actix system.
fn stage_actor(
    job: &TrainingJob,
    rank: usize,
    lines: StageLines,
    recovery: Recovery,
    options: &RunOptions,
    trace: Option<TraceTarget>,
) -> StageActor {
    let p = job.config.strategy.hybrid_configs.pp_degree;
    StageActor {
        rank,
        job: job.config.clone(),
        model: job.model.clone(),
        train_data: job.train_data.clone(),
        test_data: job.test_data.clone(),
        link: Some(lines.link),
        data_parallel: Some(lines.data_parallel),
        bus: Some(lines.bus),
        recovery,
        device: SyncArbiter::start(1, DeviceActor::default),
        monitor: (rank == p - 1).then(|| options.monitor()),
        trace,
    }
}

/// Trains `actor` to its end; an error names its rank, stage and replica.
async fn train(actor: StageActor) -> Result<StageOutcome> {
    let rank = actor.rank;
    let p = actor.job.strategy.hybrid_configs.pp_degree;
    let (replica, stage) = (rank / p, rank % p);
    actor
        .start()
        .send(TrainStage)
        .await
        .map_err(|e| anyhow!("rank {rank}: stage actor stopped: {e}"))?
        .map_err(|e| e.context(format!("rank {rank} (stage {stage} of replica {replica})")))
}

/// The run's outcome from replica 0's stages (replicas hold equal parameters).
fn summarise(job: &TrainingJob, replica0: &[StageOutcome], cluster: &str) -> Result<RunOutcome> {
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
            cluster: cluster.to_string(),
            steps: last.steps,
            samples_per_sec: last.samples_per_sec,
            final_loss: holder.losses.last().copied().unwrap_or(f32::NAN),
            test_accuracy: if total == 0 { 0.0 } else { correct as f64 / total as f64 },
            comm_time_ratio: holder.allreduce_ratio,
            exposed_comm_ratio: holder.exposed_allreduce_ratio,
            param_checksum: ParamChecksum::of_values(&parameters).to_string(),
            peak_activation_bytes: Some(replica0.iter().map(|o| o.peak_activation_bytes).collect()),
            bubble_fraction: Some(replica0.iter().map(|o| o.bubble_fraction).sum::<f64>() / replica0.len() as f64),
        },
        losses: holder.losses.clone(),
        parameters,
    })
}
