//! The simulated cluster: every rank's trainer and device actor in this
//! process, the coordinator reached by actor messages, ring links in memory.
//!
//! With a [`FaultPlan`] the cluster recovers in place the way a launched job does, through the
//! same path: each rank heartbeats to the coordinator, a rank struck by a fault (killed, or
//! stalled until the coordinator declares it dead) is replaced alone — as its launcher
//! replaces a process — and the survivors hear the coordinator's rollback order, leave the
//! collective they wait in, restore the committed checkpoint from memory and go on with the
//! replacement over the next generation's ring. A link that delays its messages changes
//! nothing; one that loses a message breaks, and the rank that was to receive it is replaced.

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use actix::prelude::*;
use anyhow::{anyhow, ensure, Result};

use super::{Recovery, RunOptions, RunOutcome, TrainingJob};
use crate::actors::recovery::faults::{RoleFault, RoleFaults, RoleSwitch};
use crate::actors::recovery::heartbeat::{watched, CoordinatorAt};
use crate::actors::recovery::rollback::{order_line, Orders};
use crate::actors::ring_link::{RingLink, RANKS_RING};
use crate::actors::trainer::{InPlace, RankOutcome};
use crate::actors::Coordinator;
use crate::config::{JobConfig, Strategy};
use crate::engines::comm::hierarchy::{self, NodeLayout};
use crate::engines::comm::memory::{LinkFault, MemoryRings};
use crate::engines::comm::RingBreaker;
use crate::net::protocol::CoordinatorLine;
use crate::net::ControlBus;

/// Faults to inject into a simulated cluster. Each strikes once: a role's first incarnation,
/// a link of the first generation's rings.
///
/// Roles are numbered as the coordinator numbers them: ranks, or a parameter-server job's
/// servers first, then its trainers.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// `(role, step, fault)`: the role is struck just before it takes step `step` (from 0); a
    /// parameter server, before it serves the first push of that step.
    pub roles: Vec<(usize, usize, RoleFault)>,
    /// `(from, to, fault)`: a fault on the messages role `from` sends to role `to`.
    pub links: Vec<(usize, usize, LinkFault)>,
}

impl FaultPlan {
    /// Whether the plan injects nothing.
    pub fn is_empty(&self) -> bool {
        self.roles.is_empty() && self.links.is_empty()
    }

    /// The faults planned for `rank`'s first incarnation, by step.
    pub(super) fn of_rank(&self, rank: usize) -> Vec<(usize, RoleFault)> {
        self.roles
            .iter()
            .filter(|&&(r, _, _)| r == rank)
            .map(|&(_, step, fault)| (step, fault))
            .collect()
    }

    /// Checks the plan against a cluster of `roles` roles.
    pub(super) fn check(&self, roles: usize) -> Result<()> {
        let struck = self
            .roles
            .iter()
            .map(|&(role, _, _)| role)
            .chain(self.links.iter().flat_map(|&(from, to, _)| [from, to]));
        for role in struck {
            ensure!(
                role < roles,
                "a fault is planned for role {role} of a cluster of {roles}"
            );
        }
        Ok(())
    }

    /// The link faults as faults of ring positions: `carrier(from, to)` names the ring whose
    /// position's link to its right neighbour carries `from`'s messages to `to`, if one does.
    pub(super) fn on_rings(
        &self,
        carrier: impl Fn(usize, usize) -> Option<(String, usize)>,
    ) -> Result<Vec<(String, usize, LinkFault)>> {
        self.links
            .iter()
            .map(|&(from, to, fault)| {
                let (ring, position) = carrier(from, to)
                    .ok_or_else(|| anyhow!("no ring carries messages from rank {from} to rank {to}"))?;
                Ok((ring, position, fault))
            })
            .collect()
    }
}

/// What the faults cost: the replacements each rank needed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultReport {
    /// By rank, how many times it was replaced.
    pub replaced: Vec<usize>,
}

/// The nodes a simulated job's all-reduce is hierarchical over: only when asked for (its ranks
/// share one process, so no hosts tell).
fn in_process_layout(config: &JobConfig) -> Result<Option<NodeLayout>> {
    hierarchy::choose(config.hierarchical_setting(), None, NodeLayout::configured(config))
}

pub(super) fn run(job: &TrainingJob, options: &RunOptions) -> Result<RunOutcome> {
    let world = job.config.world_size();
    let recovery = Recovery::plan(&job.config, &options.run_dir, &options.resume)?;
    let timeout = job.config.fault_tolerance.timeout();
    let layout = in_process_layout(&job.config)?;
    let outcomes = System::new().block_on(async move {
        let coordinator = Coordinator::for_job(&job.config, &recovery).start();
        let rings = Arc::new(MemoryRings::new(timeout, Vec::new()));
        let links = (0..world).map(|rank| match world {
            1 => RingLink::Single,
            _ => RingLink::Simulated {
                rank,
                rings: rings.clone(),
                layout,
                breaker: RingBreaker::default(),
            },
        });
        let runs: Vec<_> = links
            .enumerate()
            .map(|(rank, link)| {
                let bus = ControlBus::InMemory(coordinator.clone().into());
                let trainer = job.trainer(rank, bus, link, format!("memory:{rank}"), options, recovery.clone());
                async move { trainer.train().await.map_err(|e| e.context(format!("rank {rank}"))) }
            })
            .collect();
        // The first rank to fail ends the run with its error, rather than
        // leaving it to wait for the others' timeouts.
        futures::future::try_join_all(runs).await
    })?;
    from_rank0(job, outcomes)
}

/// The run's outcome, as the rank at place 0 of the last generation tells it.
fn from_rank0(job: &TrainingJob, outcomes: Vec<RankOutcome>) -> Result<RunOutcome> {
    let rank0 = outcomes
        .into_iter()
        .find(|outcome| outcome.rank == 0)
        .ok_or_else(|| anyhow!("no rank trained at place 0"))?;
    RunOutcome::from_rank0(rank0, &job.config, "in-process")
}

/// The incarnation of each rank that runs now: its id (its "pid") and its switch.
type Running = Arc<Mutex<Vec<Option<(u32, RoleSwitch)>>>>;

/// One incarnation of a rank of a simulated cluster struck by faults: what its work is started
/// with.
pub(super) struct Incarnation {
    /// The rank.
    pub rank: usize,
    /// Its line to the coordinator.
    pub line: CoordinatorLine,
    /// The coordinator's rollback orders, as its training hears them.
    pub orders: Orders,
    /// Where its rings are handed, so that a rollback order breaks them.
    pub breaker: RingBreaker,
    /// The cluster's rings in memory, one set per generation.
    pub rings: Arc<MemoryRings>,
    /// The faults planned for it: its work runs under their switch.
    pub faults: Arc<RoleFaults>,
    /// Whether it is the role's first incarnation, whose links the plan's link faults strike.
    pub first: bool,
}

/// Runs every rank of `config`'s job — each incarnation's work started by `start` — struck by
/// `plan` (its link faults on the rings `link_faults` names), recovering in place: each rank
/// heartbeats to the coordinator, and an incarnation that dies is replaced alone, at most
/// `fault_tolerance.max_restarts` times, as a launcher replaces a process. Answers each rank's
/// outcome and the replacements it needed.
pub(super) fn run_struck<T, F, Fut>(
    config: &JobConfig,
    recovery: &Recovery,
    plan: &FaultPlan,
    link_faults: Vec<(String, usize, LinkFault)>,
    start: F,
) -> Result<(Vec<T>, FaultReport)>
where
    F: Fn(Incarnation) -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let roles = config.roles();
    plan.check(roles)?;
    ensure!(roles > 1, "faults need a cluster of at least 2 roles (it has {roles})");
    ensure!(
        config.recovers_in_place(),
        "faults are recovered from in place: fault_tolerance.recovery must be \"in_place\""
    );
    let ft = &config.fault_tolerance;
    let ranks = System::new().block_on(async move {
        let coordinator = Coordinator::for_job(config, recovery)
            .recovering_in_place()
            .with_heartbeat_deadline(ft.heartbeat_deadline())
            .start();
        let cluster = StruckCluster {
            config,
            coordinator: coordinator.into(),
            rings: Arc::new(MemoryRings::new(ft.timeout(), link_faults)),
            plan,
            running: Arc::new(Mutex::new(vec![None; roles])),
            next_id: AtomicU32::new(1),
        };
        let watch = actix::spawn(kill_the_declared_dead(
            cluster.coordinator.clone(),
            cluster.running.clone(),
            ft.heartbeat_interval(),
        ));
        let ranks = futures::future::try_join_all((0..roles).map(|rank| cluster.rank(rank, &start))).await;
        watch.abort();
        ranks
    })?;
    let replaced = ranks.iter().map(|(_, replaced)| *replaced).collect();
    Ok((
        ranks.into_iter().map(|(outcome, _)| outcome).collect(),
        FaultReport { replaced },
    ))
}

/// A data-parallel job struck by `plan`.
pub(super) fn run_with_faults(
    job: &TrainingJob,
    options: &RunOptions,
    plan: &FaultPlan,
) -> Result<(RunOutcome, FaultReport)> {
    let recovery = Recovery::plan(&job.config, &options.run_dir, &options.resume)?;
    let world = job.config.world_size();
    let link_faults = plan.on_rings(|from, to| (to == (from + 1) % world).then(|| (RANKS_RING.to_string(), from)))?;
    let layout = in_process_layout(&job.config)?;
    let (outcomes, report) = run_struck(&job.config, &recovery, plan, link_faults, |incarnation| {
        let rank = incarnation.rank;
        let endpoint = format!("memory:{rank}");
        let (rings, breaker) = (incarnation.rings, incarnation.breaker);
        let link = move || RingLink::Simulated {
            rank,
            rings: rings.clone(),
            layout,
            breaker: breaker.clone(),
        };
        let bus = ControlBus::InMemory(incarnation.line);
        let mut trainer = job.trainer(rank, bus, link(), endpoint.clone(), options, recovery.clone());
        trainer.in_place = Some(InPlace {
            orders: incarnation.orders,
            relink: Box::new(move || Ok((link(), endpoint.clone()))),
        });
        trainer.parts.faults = Some(incarnation.faults);
        trainer.train()
    })?;
    Ok((from_rank0(job, outcomes)?, report))
}

/// Asks the coordinator every `interval` which incarnations it declared dead, and kills the
/// ones still running (stalled, or hung) — what a launcher's death watch does.
async fn kill_the_declared_dead(coordinator: CoordinatorLine, running: Running, interval: std::time::Duration) {
    let mut line = ControlBus::InMemory(coordinator);
    loop {
        if let Ok(dead) = line.list_dead(interval).await {
            let running = running.lock().unwrap_or_else(PoisonError::into_inner);
            for process in dead {
                if let Some(Some((id, switch))) = running.get(process.rank) {
                    if *id == process.pid {
                        switch.kill();
                    }
                }
            }
        }
        tokio::time::sleep(interval).await;
    }
}

/// What every incarnation of every rank of a struck cluster shares.
struct StruckCluster<'a> {
    config: &'a JobConfig,
    coordinator: CoordinatorLine,
    rings: Arc<MemoryRings>,
    plan: &'a FaultPlan,
    running: Running,
    next_id: AtomicU32,
}

impl StruckCluster<'_> {
    /// Runs rank `rank` to its end, replacing each incarnation that dies, at most
    /// `fault_tolerance.max_restarts` times; answers its outcome and its replacements.
    async fn rank<T, Fut>(&self, rank: usize, start: &impl Fn(Incarnation) -> Fut) -> Result<(T, usize)>
    where
        Fut: Future<Output = Result<T>>,
    {
        let max_restarts = self.config.fault_tolerance.max_restarts;
        let name = self.config.role_name(rank);
        let mut replaced = 0;
        loop {
            match self.incarnation(rank, replaced == 0, start).await {
                Ok(outcome) => return Ok((outcome, replaced)),
                Err(e) if replaced < max_restarts => {
                    replaced += 1;
                    tracing::warn!(
                        "{name} ended ({e:#}); replacing it alone (restart {replaced} of {max_restarts}): \
                         the others roll back in place"
                    );
                }
                Err(e) => {
                    return Err(e.context(format!(
                        "{name}: gave up after {max_restarts} restart(s) (fault_tolerance.max_restarts)"
                    )))
                }
            }
        }
    }

    /// One incarnation of rank `rank` — its `first`, which the plan strikes, or a replacement —:
    /// its work and its heartbeats, under one switch. When it ends in failure the coordinator
    /// hears that it is gone.
    async fn incarnation<T, Fut>(&self, rank: usize, first: bool, start: &impl Fn(Incarnation) -> Fut) -> Result<T>
    where
        Fut: Future<Output = Result<T>>,
    {
        let planned = if first { self.plan.of_rank(rank) } else { Vec::new() };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let switch = RoleSwitch::default();
        self.running.lock().unwrap_or_else(PoisonError::into_inner)[rank] = Some((id, switch.clone()));
        let line = self.coordinator.clone().for_incarnation(id);
        let ft = &self.config.fault_tolerance;
        let (orders_in, orders) = order_line(ft.heartbeat_deadline() + 2 * ft.heartbeat_interval());
        let work = start(Incarnation {
            rank,
            line: line.clone(),
            orders,
            breaker: orders_in.breaker(),
            rings: self.rings.clone(),
            faults: Arc::new(RoleFaults::new(switch.clone(), planned)),
            first,
        });
        // A rank's actor takes the coordinator's orders as messages: its heartbeats carry none
        // (one would stop it). A shard, driven by a loop beside its actor, hears them on its
        // heartbeats.
        let shard =
            self.config.resolved_strategy() == Strategy::ParameterServer && rank < self.config.cluster.server_num;
        let heard_on_heartbeats = shard.then_some(&orders_in);
        let ended = switch
            .govern(watched(
                work,
                rank,
                CoordinatorAt::InMemory(&line),
                self.config,
                heard_on_heartbeats,
            ))
            .await;
        if ended.is_err() {
            line.incarnation_gone(rank);
        }
        ended.map_err(|e| e.context(self.config.role_name(rank)))
    }
}
