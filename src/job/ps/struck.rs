//! A simulated parameter-server cluster struck by faults, recovering in place through the path
//! a launched one takes: each shard and trainer joins every generation through the
//! coordinator and heartbeats to it; a role struck dead (or stalled until the coordinator
//! declares it dead) is replaced alone, and the others roll back in place — a shard restores
//! the committed checkpoint from memory, its replacement from disk.
//!
//! Trainers reach the shards through in-memory links that find each shard's running
//! incarnation. A link can delay its messages, or lose one — a request before the shard sees
//! it, or the answer after the shard applied it — which the trainer's client retries as over a
//! fresh connection; the shard's idempotent pushes make that safe, so a lost message costs no
//! rollback.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use actix::prelude::*;
use anyhow::{bail, Context as _, Result};
use futures::channel::oneshot;
use futures::future::BoxFuture;
use tokio::sync::mpsc;

use super::shard_generations::ShardGenerations;
use super::{start_shard, ParameterServerJob, PsSummary};
use crate::actors::ps_trainer::{PsInPlace, PsOutcome};
use crate::actors::pserver::PServer;
use crate::actors::recovery::faults::RoleFaults;
use crate::config::JobConfig;
use crate::engines::comm::memory::LinkFault;
use crate::job::outputs::{write_config, write_summary};
use crate::job::simulated::{run_struck, FaultPlan, FaultReport, Incarnation};
use crate::job::{Recovery, RunOptions};
use crate::net::ControlBus;
use crate::ps::client::{InProcessShard, Lost, PsClient, ShardLink};
use crate::ps::wire::{Reply, Request, ShardCall};

/// Every shard and trainer of `job` in this process, struck by `plan`: answers the summary, as
/// the run without faults writes it, and the replacements each role needed.
pub(super) fn run_with_faults(
    job: &ParameterServerJob,
    options: &RunOptions,
    plan: &FaultPlan,
) -> Result<(PsSummary, FaultReport)> {
    let config = &job.config;
    write_config(&options.run_dir, config)?;
    let recovery = Recovery::plan(config, &options.run_dir, &options.resume)?;
    let servers = config.cluster.server_num;
    check_links(config, plan)?;
    let shards = Arc::new(RunningShards(Mutex::new(vec![None; servers])));
    let (outcomes, report) = run_struck(config, &recovery, plan, Vec::new(), |incarnation| {
        let (shards, recovery) = (shards.clone(), &recovery);
        async move {
            match incarnation.rank.checked_sub(servers) {
                None => serve(job, incarnation, &shards, &options.run_dir, recovery)
                    .await
                    .map(|()| None),
                Some(trainer) => train(job, trainer, incarnation, shards, plan, options, recovery)
                    .await
                    .map(Some),
            }
        }
    })?;
    let rank0 = outcomes
        .into_iter()
        .flatten()
        .next()
        .context("a job needs at least one trainer")?;
    let summary = job.summary(rank0, "in-process")?;
    write_summary(&options.run_dir, &summary)?;
    Ok((summary, report))
}

/// Refuses a link fault between two roles that exchange no messages: each trainer is linked with
/// each server, and with nothing else.
fn check_links(config: &JobConfig, plan: &FaultPlan) -> Result<()> {
    let servers = config.cluster.server_num;
    for &(from, to, _) in &plan.links {
        if (from < servers) == (to < servers) {
            bail!(
                "no link carries messages from {} to {}: each trainer is linked with each server",
                config.role_name(from),
                config.role_name(to)
            );
        }
    }
    Ok(())
}

/// One incarnation of shard `incarnation.rank`: its actor on a thread of its own (stopped when
/// the incarnation ends, as its process would), found by the trainers' links, serving each
/// generation until every trainer has left.
async fn serve(
    job: &ParameterServerJob,
    incarnation: Incarnation,
    shards: &RunningShards,
    run_dir: &Path,
    recovery: &Recovery,
) -> Result<()> {
    let (config, index) = (&job.config, incarnation.rank);
    let (acknowledge, acks) = mpsc::unbounded_channel();
    let (all_left, done) = oneshot::channel();
    let server = PServer::new(
        start_shard(job, index, recovery)?,
        all_left,
        config.fault_tolerance.timeout(),
    )
    .writing_in(run_dir, recovery.store.as_ref().map(|store| store.root()))
    .recovering_in_place(recovery.start_step().unwrap_or(0) as u64, acknowledge)?;
    let thread = StoppedWhenDropped(Arbiter::new());
    let actor = PServer::start_in_arbiter(&thread.0.handle(), move |_| server);
    shards.run(index, actor.clone().recipient(), incarnation.faults);
    let generations = ShardGenerations {
        index,
        job,
        actor,
        bus: ControlBus::InMemory(incarnation.line),
        orders: incarnation.orders,
        endpoint: format!("memory:server {index}"),
        mirror: None,
        recovery,
        joined: false,
    };
    generations.serve(acks, done).await
}

/// One incarnation of trainer `trainer`, linked with every shard.
async fn train(
    job: &ParameterServerJob,
    trainer: usize,
    incarnation: Incarnation,
    shards: Arc<RunningShards>,
    plan: &FaultPlan,
    options: &RunOptions,
    recovery: &Recovery,
) -> Result<PsOutcome> {
    let config = &job.config;
    let role = incarnation.rank;
    let links = (0..config.cluster.server_num)
        .map(|index| {
            // A replacement's links are new: the faults struck the first incarnation's.
            let fault = |from, to| {
                let mut planned = plan.links.iter().filter(|_| incarnation.first);
                planned
                    .find(|&&(f, t, _)| (f, t) == (from, to))
                    .map(|&(_, _, fault)| fault)
            };
            ShardLink::Local(Arc::new(SimulatedShardLink {
                index,
                shards: shards.clone(),
                requests: fault(role, index),
                answers: fault(index, role),
                sent: AtomicU64::new(0),
            }))
        })
        .collect();
    let ft = &config.fault_tolerance;
    let client = PsClient::new(links, ft.retry, ft.timeout());
    let mut role_actor = job.trainer(trainer, client, options, None, recovery.clone());
    role_actor.in_place = Some(PsInPlace {
        bus: ControlBus::InMemory(incarnation.line),
        orders: incarnation.orders,
        endpoint: format!("memory:trainer {trainer}"),
        mirror: None,
    });
    role_actor.faults = Some(incarnation.faults);
    role_actor.train().await
}

/// The running incarnation of each shard, by index, as the trainers' links find it.
struct RunningShards(Mutex<Vec<Option<RunningShard>>>);

#[derive(Clone)]
struct RunningShard {
    actor: Recipient<ShardCall>,
    /// Its faults: they strike before the shard serves a push of their step.
    faults: Arc<RoleFaults>,
}

impl RunningShards {
    /// Shard `index` now runs as `actor`, struck by `faults`.
    fn run(&self, index: usize, actor: Recipient<ShardCall>, faults: Arc<RoleFaults>) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)[index] = Some(RunningShard { actor, faults });
    }

    fn get(&self, index: usize) -> Option<RunningShard> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)[index].clone()
    }
}

/// Stops a shard's thread, and with it its actor, when its incarnation ends or is killed.
struct StoppedWhenDropped(Arbiter);

impl Drop for StoppedWhenDropped {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// One trainer's link with shard `index`, struck by its faults: on the requests, on the answers.
struct SimulatedShardLink {
    index: usize,
    shards: Arc<RunningShards>,
    requests: Option<LinkFault>,
    answers: Option<LinkFault>,
    /// Requests sent so far: request `n`'s answer is answer `n`.
    sent: AtomicU64,
}

impl InProcessShard for SimulatedShardLink {
    fn call(&self, call: ShardCall) -> BoxFuture<'static, std::result::Result<Result<Reply>, Lost>> {
        let number = self.sent.fetch_add(1, Ordering::Relaxed);
        let (index, shard) = (self.index, self.shards.get(self.index));
        let (requests, answers) = (self.requests, self.answers);
        Box::pin(async move {
            let Some(shard) = shard else {
                return Err(gone(format!("parameter server {index} has not started")));
            };
            if strikes(requests, number).await {
                return Err(Lost {
                    reason: format!("request {number} lost on the link (a fault injected into the simulated cluster)"),
                    call: Some(Box::new(call)),
                });
            }
            // Only a request whose answer is to be lost is kept, to be sent again.
            let again = matches!(answers, Some(LinkFault::Drop { message }) if message == number)
                .then(|| Box::new(call.clone()));
            let push_step = match &call.request {
                Request::Push(push) => Some(push.step as usize),
                _ => None,
            };
            let faults = shard.faults.clone();
            let answered = RoleFaults::govern(Some(shard.faults), async move {
                if let Some(step) = push_step {
                    faults.before_step(&format!("server {index}"), step).await;
                }
                Ok(shard.actor.send(call).await)
            })
            .await;
            let reply = match answered {
                Ok(Ok(reply)) => reply,
                Ok(Err(e)) => return Err(gone(format!("parameter server {index} is gone: {e}"))),
                Err(killed) => return Err(gone(format!("parameter server {index}: {killed:#}"))),
            };
            if strikes(answers, number).await {
                return Err(Lost {
                    reason: format!(
                        "the answer to request {number} lost on the link (a fault injected into the simulated cluster)"
                    ),
                    call: again,
                });
            }
            Ok(reply)
        })
    }
}

/// Whether `fault` loses message `number` (after waiting out a delay it puts on every message).
async fn strikes(fault: Option<LinkFault>, number: u64) -> bool {
    match fault {
        Some(LinkFault::Delay(delay)) => {
            tokio::time::sleep(delay).await;
            false
        }
        Some(LinkFault::Drop { message }) => message == number,
        None => false,
    }
}

/// A shard no retry reaches.
fn gone(reason: String) -> Lost {
    Lost { reason, call: None }
}
