//! A pipeline job: `dp_degree` replicas of a `pp_degree`-stage pipeline, every rank a stage
//! actor with its own device actor. In one process ([`run`]) stages are linked by channels and
//! each stage's replicas by an in-memory ring. As one rank of a launched job ([`run_rank`])
//! they are linked by rings over TCP or shared memory ([`super::stage_rings`]), and rank 0
//! writes the outputs from the outcomes replica 0's ranks gather to it over the control bus.

mod stage_rings;

use std::net::TcpListener;
use std::sync::Arc;

use actix::prelude::*;
use anyhow::{anyhow, Context as _, Result};
use bytes::Bytes;
use futures::future::BoxFuture;

use super::launched_rank::{bind_data_endpoint, host_of, refused_if_mismatched, LaunchedRank, RankStart, RoleMirror};
use super::simulated::run_struck;
use super::{FaultPlan, FaultReport, Recovery, RunOptions, RunOutcome, Summary, TrainingJob};
use crate::actors::device::StageLinks;
use crate::actors::stage::{Rejoin, StageActor, StageGeneration, StageInPlace, StageOutcome, TrainStage};
use crate::actors::Coordinator;
use crate::collective::ParamChecksum;
use crate::config::{GridPlace, HybridConfigs, JobConfig};
use crate::engines::comm::memory::MemoryRings;
use crate::engines::comm::{Communicator, RingBreaker, RingTransport};
use crate::models::Precision;
use crate::net::auth::Credentials;
use crate::net::ControlBus;
use crate::pipeline::link::memory_links;
use crate::telemetry::timeline::TraceTarget;

/// All ranks in this process.
pub(super) fn run(job: &TrainingJob, options: &RunOptions) -> Result<RunOutcome> {
    let config = job.config.clone();
    let trace = options.trace_target();
    let hybrid = config.strategy.hybrid_configs.clone();
    let timeout = config.fault_tolerance.timeout();
    let recovery = Recovery::plan(&config, &options.run_dir, &options.resume)?;
    let outcomes = System::new().block_on(async move {
        // For the checkpoint protocol's gathers.
        let coordinator = Coordinator::for_job(&config, &recovery).start();
        // Stage links by rank: channels within each part of each replica.
        let mut stage_links: Vec<Option<StageLinks>> = (0..config.world_size()).map(|_| None).collect();
        for replica in 0..hybrid.replicas() {
            for part in 0..config.mp_degree() {
                let links = memory_links(hybrid.pp_degree, timeout);
                for (rank, link) in hybrid.stages_of(replica, part).into_iter().zip(links) {
                    stage_links[rank] = Some(StageLinks::Made(Box::new(link)));
                }
            }
        }
        let rings = MemoryRings::new(timeout, Vec::new());
        let runs = stage_links.into_iter().enumerate().map(|(rank, link)| {
            let group_rings = group_rings_in_memory(&hybrid, rank, &rings, 0);
            let bus = ControlBus::InMemory(coordinator.clone().into());
            let recovery = recovery.clone();
            let trace = trace.clone();
            async move {
                let (data_parallel, layers) = group_rings?;
                let generation = StageGeneration {
                    roster: None,
                    link: link.context("every rank has a stage link")?,
                    data_parallel,
                    layers,
                };
                train(stage_actor(job, rank, generation, bus, recovery, options, trace)).await
            }
        });
        futures::future::try_join_all(runs).await
    })?;
    summarise(job, &outcomes, "in-process")
}

/// All ranks in this process, struck by `plan` and recovering in place: each incarnation joins
/// each generation through the coordinator and takes its ends of that generation's rings in
/// memory.
pub(super) fn run_with_faults(
    job: &TrainingJob,
    options: &RunOptions,
    plan: &FaultPlan,
) -> Result<(RunOutcome, FaultReport)> {
    let config = &job.config;
    let recovery = Recovery::plan(config, &options.run_dir, &options.resume)?;
    let trace = options.trace_target();
    let hybrid = &config.strategy.hybrid_configs;
    let link_faults = plan.on_rings(|from, to| ring_between(hybrid, from, to))?;
    let (outcomes, report) = run_struck(config, &recovery, plan, link_faults, |incarnation| {
        let rank = incarnation.rank;
        let mut rejoin = rejoin_in_memory(config.clone(), rank, incarnation.rings, incarnation.breaker);
        let (recovery, trace) = (recovery.clone(), trace.clone());
        async move {
            let mut bus = ControlBus::InMemory(incarnation.line);
            let generation = rejoin(&mut bus).await?;
            let mut actor = stage_actor(job, rank, generation, bus, recovery, options, trace);
            actor.in_place = Some(StageInPlace {
                orders: incarnation.orders,
                rejoin,
                buddy: None,
            });
            actor.parts.faults = Some(incarnation.faults);
            train(actor).await
        }
    })?;
    Ok((summarise(job, &outcomes, "in-process")?, report))
}

/// The ring of a simulated pipeline laid out as `hybrid` says that carries rank `from`'s
/// messages to rank `to`, and `from`'s position in it: the forward ring to the next stage, the
/// backward ring to the stage before, the ring of the stage's replicas to the next replica, the
/// stage's layer group to the next part.
fn ring_between(hybrid: &HybridConfigs, from: usize, to: usize) -> Option<(String, usize)> {
    let (d, p, mp) = (hybrid.replicas(), hybrid.pp_degree, hybrid.mp_degree.max(1));
    let (at, next) = (hybrid.place_of(from), hybrid.place_of(to));
    let GridPlace { replica, stage, part } = at;
    let same_stage_part = next.stage == stage && next.part == part;
    if next.replica == replica && next.part == part && next.stage == stage + 1 {
        Some((forward_ring(replica, part), stage))
    } else if next.replica == replica && next.part == part && next.stage + 1 == stage {
        Some((backward_ring(replica, part), p - 1 - stage))
    } else if d > 1 && same_stage_part && next.replica == (replica + 1) % d {
        Some((replicas_ring(stage, part), replica))
    } else if mp > 1 && next.replica == replica && next.stage == stage && next.part == (part + 1) % mp {
        Some((layers_ring(replica, stage), part))
    } else {
        None
    }
}

fn forward_ring(replica: usize, part: usize) -> String {
    format!("forward stages of part {part} of replica {replica}")
}

fn backward_ring(replica: usize, part: usize) -> String {
    format!("backward stages of part {part} of replica {replica}")
}

fn replicas_ring(stage: usize, part: usize) -> String {
    format!("replicas of part {part} of stage {stage}")
}

fn layers_ring(replica: usize, stage: usize) -> String {
    format!("layer group of stage {stage} of replica {replica}")
}

/// Rank `rank`'s ends of generation `generation`'s rings in memory among the ranks that hold
/// its part of its stage in the other replicas, and among those that split its stage's layers
/// with it (where they are split). A ring of one is no ring: its collectives are no-ops.
fn group_rings_in_memory(
    hybrid: &HybridConfigs,
    rank: usize,
    rings: &MemoryRings,
    generation: u64,
) -> Result<(Communicator, Option<Communicator>)> {
    let GridPlace { replica, stage, part } = hybrid.place_of(rank);
    let (d, mp) = (hybrid.replicas(), hybrid.mp_degree.max(1));
    let data_parallel = match d {
        1 => Communicator::single(),
        _ => Communicator::new(Box::new(rings.take(
            generation,
            &replicas_ring(stage, part),
            d,
            replica,
        )?)),
    };
    let layers = match mp {
        1 => None,
        _ => Some(Communicator::new(Box::new(rings.take(
            generation,
            &layers_ring(replica, stage),
            mp,
            part,
        )?))),
    };
    Ok((data_parallel, layers))
}

/// How rank `rank` of a simulated pipeline joins each generation: through the coordinator, then
/// its ends of that generation's rings in memory — among its stage's replicas, the forward and
/// backward rings of its replica's stages, its stage's layer group — which a rollback order
/// breaks.
fn rejoin_in_memory(config: Arc<JobConfig>, rank: usize, rings: Arc<MemoryRings>, breaker: RingBreaker) -> Rejoin {
    Box::new(move |bus: &mut ControlBus| -> BoxFuture<'_, Result<StageGeneration>> {
        let (config, rings, breaker) = (config.clone(), rings.clone(), breaker.clone());
        Box::pin(async move {
            let endpoint = format!("memory:{rank}");
            let roster = bus
                .join(rank, config.world_size(), endpoint, None, config.shared_settings())
                .await?;
            let hybrid = &config.strategy.hybrid_configs;
            let (p, generation) = (hybrid.pp_degree, roster.generation);
            let GridPlace { replica, stage, part } = hybrid.place_of(rank);
            let (data_parallel, layers) = group_rings_in_memory(hybrid, rank, &rings, generation)?;
            let mut breaks: Vec<_> = data_parallel.link_breaks();
            breaks.extend(layers.iter().flat_map(Communicator::link_breaks));
            let link = match p {
                // One stage: hand-offs between its own chunks loop back in memory.
                1 => StageLinks::Made(Box::new(
                    memory_links(1, config.fault_tolerance.timeout())
                        .pop()
                        .context("a one-stage pipeline has a link")?,
                )),
                _ => {
                    let forward = rings.take(generation, &forward_ring(replica, part), p, stage)?;
                    let backward = rings.take(generation, &backward_ring(replica, part), p, p - 1 - stage)?;
                    breaks.extend(forward.link_break());
                    breaks.extend(backward.link_break());
                    StageLinks::Rings {
                        forward: Box::new(forward),
                        backward: Box::new(backward),
                    }
                }
            };
            breaker.arm(breaks);
            Ok(StageGeneration {
                roster: Some(roster),
                link,
                data_parallel,
                layers,
            })
        })
    })
}

/// One rank of a launched job: rank 0 also hosts the coordinator (unless it runs as a process
/// of its own: then a lost rank is replaced in place), and writes the outputs.
pub(super) fn run_rank(job: &TrainingJob, rank: usize, options: &RunOptions) -> Result<Option<RunOutcome>> {
    let trace = options.trace_target();
    let reporting = job.config.strategy.hybrid_configs.stages_of(0, 0);
    let (launched, start) = LaunchedRank::prepare(job.config.clone(), rank, options)?;
    let RankStart {
        listener,
        data_endpoint,
        recovery,
        orders,
        breaker,
    } = start;
    // A rank that rolls back in place keeps buddy copies of stages only its node holds.
    let mirror = match launched.recovers_in_place() {
        true => RoleMirror::bind(&launched.config, host_of(&data_endpoint), &recovery)?,
        false => None,
    };
    System::new()
        .block_on(async move {
            let mut bus = launched.connect(&recovery).await?;
            let (mirror_endpoint, buddy) = mirror.map(RoleMirror::serve_at).transpose()?.unzip();
            let rings = StageRings {
                config: launched.config.clone(),
                rank,
                credentials: launched.credentials.clone(),
                breaker,
                mirror: mirror_endpoint,
            };
            let generation = rings.join(&mut bus, listener, data_endpoint).await?;
            // The stage's own line for checkpoints and rollbacks; `bus` gathers the outcomes after.
            let stage_bus = launched.another_line().await?;
            let in_place = orders.map(|orders| StageInPlace {
                orders,
                rejoin: rings.rejoin(),
                buddy,
            });
            let training = async {
                let mut actor = stage_actor(job, rank, generation, stage_bus, recovery, options, trace);
                actor.in_place = in_place;
                let outcome = train(actor).await?;
                // Rank 0 holds only its own stage, and the outputs need every stage's parameters
                // and the last stage's losses: replica 0's ranks of part 0 (holding the whole
                // parameters) hand it their outcomes. The gather is the end-of-training barrier
                // too, so no rank leaves while another still needs it.
                let part = match reporting.contains(&rank) {
                    true => outcome.to_bytes()?,
                    false => Bytes::new(),
                };
                let parts = bus.gather(rank, "stage outcomes of replica 0", part).await?;
                if rank != 0 {
                    return Ok(None);
                }
                let replica0 = reporting
                    .iter()
                    .map(|&rank| {
                        let bytes = parts.get(rank).cloned().unwrap_or_default();
                        StageOutcome::from_bytes(bytes)
                    })
                    .collect::<Result<Vec<_>>>()
                    .context("rank 0: gathering the stage outcomes of replica 0")?;
                let outcome = summarise(job, &replica0, "multi-process")?;
                // Written before rank 0 leaves the job: until then its loss is a death the
                // coordinator recovers from.
                outcome.write(&options.run_dir, job)?;
                Ok(Some(outcome))
            };
            launched.watched(training).await
        })
        .map_err(refused_if_mismatched)
}

/// What a launched pipeline rank joins a generation with.
#[derive(Clone)]
struct StageRings {
    config: std::sync::Arc<JobConfig>,
    rank: usize,
    credentials: Credentials,
    /// Where the connected rings' sockets go, so a rollback order can break them.
    breaker: RingBreaker,
    /// The rank's checkpoint mirror, announced with each join.
    mirror: Option<String>,
}

impl StageRings {
    /// Joins the coordinator's next generation with `data_endpoint` (bound to `listener`) and
    /// connects the rank's rings.
    async fn join(
        &self,
        bus: &mut ControlBus,
        listener: TcpListener,
        data_endpoint: String,
    ) -> Result<StageGeneration> {
        let (config, rank) = (&self.config, self.rank);
        let roster = bus
            .join(
                rank,
                config.world_size(),
                data_endpoint,
                self.mirror.clone(),
                config.shared_settings(),
            )
            .await?;
        let abandoned = self.breaker.abandons(roster.generation);
        let (link, data_parallel, layers) = stage_rings::connect(
            bus,
            config,
            rank,
            &roster,
            listener,
            self.credentials.clone(),
            abandoned,
        )
        .await?;
        let mut sockets: Vec<_> = data_parallel.link_breaks();
        sockets.extend(layers.iter().flat_map(Communicator::link_breaks));
        if let StageLinks::Rings { forward, backward } = &link {
            sockets.extend(forward.link_break());
            sockets.extend(backward.link_break());
        }
        self.breaker.arm(sockets);
        Ok(StageGeneration {
            roster: Some(roster),
            link,
            data_parallel,
            layers,
        })
    }

    /// Joins each next generation from a new data endpoint.
    fn rejoin(&self) -> Rejoin {
        let rings = self.clone();
        Box::new(move |bus: &mut ControlBus| -> BoxFuture<'_, Result<StageGeneration>> {
            let rings = rings.clone();
            Box::pin(async move {
                let (listener, endpoint) = bind_data_endpoint(&rings.config, rings.rank)?;
                rings.join(bus, listener, endpoint).await
            })
        })
    }
}

/// Rank `rank`'s stage actor with its own device actor, starting with `generation`'s links and
/// `bus` to the coordinator; the rank of replica 0's last stage (its part 0), which sees the
/// loss, reports.
/// Must run inside an actix system.
fn stage_actor(
    job: &TrainingJob,
    rank: usize,
    generation: StageGeneration,
    bus: ControlBus,
    recovery: Recovery,
    options: &RunOptions,
    trace: Option<TraceTarget>,
) -> StageActor {
    let hybrid = &job.config.strategy.hybrid_configs;
    let last = hybrid.stages_of(0, 0).pop();
    let monitor = (Some(rank) == last).then(|| options.monitor(&job.config, rank, "stage"));
    StageActor {
        parts: job.rank_parts(rank, recovery, monitor, trace),
        generation: Some(generation),
        bus: Some(bus),
        in_place: None,
        inbox: None,
    }
}

/// Trains `actor` to its end; an error names its rank, stage and replica.
async fn train(actor: StageActor) -> Result<StageOutcome> {
    let rank = actor.parts.rank;
    let name = actor.parts.job.strategy.hybrid_configs.name_of(rank);
    actor
        .start()
        .send(TrainStage)
        .await
        .map_err(|e| anyhow!("rank {rank}: stage actor stopped: {e}"))?
        .map_err(|e| e.context(name))
}

/// The run's outcome from replica 0's stages, part 0 of each (replicas hold equal parameters,
/// and part 0 the whole of its stage's): found among `outcomes` by rank.
fn summarise(job: &TrainingJob, outcomes: &[StageOutcome], cluster: &str) -> Result<RunOutcome> {
    let config = &job.config;
    let reporting = config.strategy.hybrid_configs.stages_of(0, 0);
    let replica0: Vec<&StageOutcome> = reporting
        .iter()
        .map(|&rank| outcomes.iter().find(|o| o.rank == rank))
        .collect::<Option<_>>()
        .context("an outcome of replica 0's stages is missing")?;
    let last = replica0.last().context("a pipeline needs at least one stage")?;
    let holder = replica0
        .iter()
        .find(|o| o.evaluated.is_some())
        .context("no stage held the last virtual stage")?;
    let held_out = holder
        .evaluated
        .unwrap_or_default()
        .held_out(config.train.resolved_loss()?);
    let parameters: Vec<(String, Vec<f32>)> = replica0.iter().flat_map(|o| o.parameters.clone()).collect();
    Ok(RunOutcome {
        summary: Summary {
            strategy: "pipeline".to_string(),
            world_size: config.world_size(),
            cluster: cluster.to_string(),
            steps: last.steps,
            samples_per_sec: last.samples_per_sec,
            final_loss: holder.losses.last().copied().unwrap_or(f32::NAN),
            test_accuracy: held_out.accuracy,
            test_mse: held_out.mse,
            test_loss: held_out.loss,
            test_samples: held_out.samples,
            comm_time_ratio: holder.allreduce_ratio,
            exposed_comm_ratio: holder.exposed_allreduce_ratio,
            param_checksum: ParamChecksum::of_values(&parameters).to_string(),
            matrix_kernel: Precision::of(config).matrix_kernel().to_string(),
            peak_activation_bytes: Some(replica0.iter().map(|o| o.peak_activation_bytes).collect()),
            state_bytes: Some(replica0[0].state_bytes),
            bubble_fraction: Some(replica0.iter().map(|o| o.bubble_fraction).sum::<f64>() / replica0.len() as f64),
        },
        losses: holder.losses.clone(),
        parameters,
    })
}
