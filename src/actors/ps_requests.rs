//! A parameter-server trainer's requests to the shards: pulls (when the push lane allows, for
//! training or after it), pushes of its updates, and the shards' table statistics.

use std::time::Instant;

use anyhow::Result;

use crate::collective::preemption;
use crate::config::{JobConfig, PsMode};
use crate::models::SparseModelDef;
use crate::ps::client::PsClient;
use crate::ps::push_lane::PushLane;
use crate::ps::wire::{PullRequest, PulledRows, Reply, Request, ShardStats, TableStats, UpdateKind};
use crate::ps::worker::{PullPlan, ShardUpdate};
use crate::telemetry::metrics::SparseTableMetrics;

/// The policed tables' rows and policy tallies, summed over the shards' `stats`.
pub(super) fn sparse_table_metrics(
    job: &JobConfig,
    model: &SparseModelDef,
    stats: &[ShardStats],
) -> Vec<SparseTableMetrics> {
    model
        .tables()
        .iter()
        .enumerate()
        .filter(|(_, spec)| job.strategy.sparse_table_configs.contains_key(&spec.name))
        .map(|(table, spec)| {
            let total = TableStats::total(stats, table);
            SparseTableMetrics {
                table: spec.name.clone(),
                rows: total.rows,
                admitted: total.admitted,
                evicted: total.evicted,
                deleted: total.deleted,
            }
        })
        .collect()
}

/// Each shard's statistics.
pub(super) async fn shard_stats(client: &mut PsClient) -> Result<Vec<ShardStats>> {
    let replies = client
        .call_all(vec![Request::Stats; client.server_num()], "table statistics")
        .await?;
    replies
        .into_iter()
        .enumerate()
        .map(|(shard, reply)| match reply {
            Reply::Stats(stats) => Ok(stats),
            other => anyhow::bail!("parameter server {shard} answered the statistics request with {other:?}"),
        })
        .collect()
}

/// Rows pulled for a step, and when the pull ran.
pub(super) struct Pulled {
    pub(super) rows: Vec<PulledRows>,
    pub(super) started: Instant,
    pub(super) finished: Instant,
}

/// Pulls `plan` for step `step` from every shard at once, once the push `lane` (async mode)
/// says the staleness bound allows it.
pub(super) async fn pull_when_ready(
    client: &mut PsClient,
    lane: Option<&mut PushLane>,
    trainer: usize,
    step: u64,
    plan: PullPlan,
) -> Result<Pulled> {
    if let Some(lane) = lane {
        lane.ready_to_pull(step).await?;
    }
    let started = Instant::now();
    let rows = pull(client, trainer, step, plan, &format!("pull of step {step}")).await?;
    Ok(Pulled {
        rows,
        started,
        finished: Instant::now(),
    })
}

/// Pulls `plan` from every shard at once, for training.
async fn pull(
    client: &mut PsClient,
    trainer: usize,
    version: u64,
    plan: PullPlan,
    what: &str,
) -> Result<Vec<PulledRows>> {
    pull_rows(client, trainer, version, false, plan, what).await
}

/// Pulls `plan` from every shard at once; with `after_training`, once every trainer has ended.
pub(super) async fn pull_rows(
    client: &mut PsClient,
    trainer: usize,
    version: u64,
    after_training: bool,
    plan: PullPlan,
    what: &str,
) -> Result<Vec<PulledRows>> {
    let requests = plan
        .ids
        .into_iter()
        .map(|ids| {
            Request::Pull(PullRequest {
                trainer,
                version,
                after_training,
                training: plan.training,
                ids,
                dense: plan.dense,
            })
        })
        .collect();
    client
        .call_all(requests, what)
        .await?
        .into_iter()
        .enumerate()
        .map(|(shard, reply)| match reply {
            Reply::Rows(rows) => Ok(rows),
            _ => anyhow::bail!("parameter server {shard} answered the {what} without rows"),
        })
        .collect()
}

/// Pushes each shard its part of an update.
pub(super) async fn push(
    client: &mut PsClient,
    trainer: usize,
    step: u64,
    job: &JobConfig,
    updates: Vec<ShardUpdate>,
    what: &str,
) -> Result<()> {
    let kind = match job.strategy.ps_mode() {
        PsMode::Geo { .. } => UpdateKind::Deltas,
        _ => UpdateKind::Gradients,
    };
    // Sync mode: the shards tell every trainer, at the next step, that one was asked to stop.
    let stop = preemption::asked();
    let requests = updates
        .into_iter()
        .map(|update| update.into_push(trainer, step, kind, stop))
        .collect();
    client.call_all(requests, what).await.map(drop)
}
