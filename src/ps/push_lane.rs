//! Async mode's pushes, sent without waiting for the shards to apply them. A task of the
//! trainer's sends them over connections of their own (so a pull never queues behind a push),
//! with at most `send_queue_size` waiting; up to `max_merge_var_num` waiting pushes go out as
//! one, each row's gradients summed. The pull of step t first waits until the shards applied
//! the pushes of the steps before `t - max_staleness`: staleness is bounded, and so is what a
//! lost trainer leaves unapplied.

use anyhow::{anyhow, Context as _, Result};
use tokio::sync::{mpsc, watch};

use super::client::PsClient;
use super::shard::sum_rows;
use super::wire::UpdateKind;
use super::worker::ShardUpdate;
use crate::config::AsyncConfigs;

/// One step's update, by shard.
struct Pending {
    step: u64,
    updates: Vec<ShardUpdate>,
}

/// The trainer's side of its push task.
pub struct PushLane {
    queue: Option<mpsc::Sender<Pending>>,
    /// The newest step whose push every shard applied.
    applied: watch::Receiver<Option<u64>>,
    task: Option<tokio::task::JoinHandle<Result<()>>>,
    max_staleness: u64,
    /// The first step this lane pushes (the generation resumed after the ones before).
    first: u64,
    /// The newest step handed over.
    last_sent: Option<u64>,
}

impl PushLane {
    /// Starts the task that pushes trainer `trainer`'s updates (gradients) through `client`,
    /// from step `first` on.
    pub fn start(client: PsClient, trainer: usize, configs: &AsyncConfigs, first: u64) -> Self {
        let (queue, waiting) = mpsc::channel(configs.send_queue_size);
        let (applied_tx, applied) = watch::channel(None);
        // On the trainer's runtime (the client's futures are not `Send`).
        let task = actix::spawn(send_pushes(
            client,
            trainer,
            waiting,
            applied_tx,
            configs.max_merge_var_num,
        ));
        Self {
            queue: Some(queue),
            applied,
            task: Some(task),
            max_staleness: configs.max_staleness as u64,
            first,
            last_sent: None,
        }
    }

    /// Hands over step `step`'s update; waits only while `send_queue_size` pushes wait already.
    pub async fn send(&mut self, step: u64, updates: Vec<ShardUpdate>) -> Result<()> {
        let queue = self.queue.as_ref().context("the push lane was closed")?;
        if queue.send(Pending { step, updates }).await.is_err() {
            return Err(self.failure().await);
        }
        self.last_sent = Some(step);
        Ok(())
    }

    /// Waits until the pull of step `step` may go: the pushes of the steps before
    /// `step - max_staleness` are applied (those this lane sent).
    pub async fn ready_to_pull(&mut self, step: u64) -> Result<()> {
        match step.checked_sub(self.max_staleness + 1) {
            Some(needed) if needed >= self.first => self.applied_up_to(needed).await,
            _ => Ok(()),
        }
    }

    /// Waits until every push handed over is applied (a checkpoint, the end of training).
    pub async fn flush(&mut self) -> Result<()> {
        match self.last_sent {
            Some(step) => self.applied_up_to(step).await,
            None => Ok(()),
        }
    }

    /// Waits until the push of step `step` (and of every step before it) is applied.
    async fn applied_up_to(&mut self, step: u64) -> Result<()> {
        if self
            .applied
            .wait_for(|applied| applied.is_some_and(|applied| applied >= step))
            .await
            .is_err()
        {
            return Err(self.failure().await);
        }
        Ok(())
    }

    /// Why the task stopped.
    async fn failure(&mut self) -> anyhow::Error {
        match self.task.take() {
            Some(task) => match task.await {
                Ok(Err(e)) => e,
                Ok(Ok(())) => anyhow!("the push lane stopped"),
                Err(e) => anyhow!("the push lane failed: {e}"),
            },
            None => anyhow!("the push lane stopped"),
        }
    }
}

impl Drop for PushLane {
    /// A lane dropped mid-generation (a rollback) sends nothing more.
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// The task: takes each waiting push, merged with up to `merge - 1` more waiting behind it,
/// sends it to every shard and announces its step applied.
async fn send_pushes(
    mut client: PsClient,
    trainer: usize,
    mut waiting: mpsc::Receiver<Pending>,
    applied: watch::Sender<Option<u64>>,
    merge: usize,
) -> Result<()> {
    while let Some(first) = waiting.recv().await {
        let mut merged = vec![first];
        while merged.len() < merge {
            match waiting.try_recv() {
                Ok(next) => merged.push(next),
                Err(_) => break,
            }
        }
        let (first_step, Pending { step, updates }) = (merged[0].step, merge_pushes(merged));
        let what = match first_step == step {
            true => format!("push of step {step}"),
            false => format!("push of steps {first_step}..={step}"),
        };
        let requests = updates
            .into_iter()
            .map(|update| update.into_push(trainer, step, UpdateKind::Gradients, false))
            .collect();
        client.call_all(requests, &what).await?;
        applied.send_replace(Some(step));
    }
    Ok(())
}

/// One push of the newest step of `pushes` holding all their gradients: each shard's dense
/// slices and each table's rows summed.
fn merge_pushes(mut pushes: Vec<Pending>) -> Pending {
    if pushes.len() == 1 {
        return pushes.remove(0);
    }
    let step = pushes.iter().map(|p| p.step).max().unwrap_or_default();
    let shards = pushes[0].updates.len();
    let updates = (0..shards)
        .map(|shard| {
            let parts: Vec<&ShardUpdate> = pushes.iter().map(|p| &p.updates[shard]).collect();
            let mut dense = parts[0].dense.clone();
            for part in &parts[1..] {
                for (sum, g) in dense.iter_mut().zip(&part.dense) {
                    *sum += g;
                }
            }
            let (ids, values) = (0..parts[0].ids.len())
                .map(|table| {
                    let width = match parts.iter().find(|p| !p.ids[table].is_empty()) {
                        Some(p) => p.values[table].len() / p.ids[table].len(),
                        None => 1,
                    };
                    sum_rows(parts.iter().map(|p| (&p.ids[table][..], &p.values[table][..])), width)
                })
                .unzip();
            // Tables with a policy: the same ids in the same order, shows and clicks summed.
            let counts = (0..parts[0].counts.len())
                .map(|table| {
                    let counted = parts.iter().filter(|p| !p.counts[table].is_empty());
                    sum_rows(counted.map(|p| (&p.ids[table][..], &p.counts[table][..])), 2).1
                })
                .collect();
            ShardUpdate {
                ids,
                values,
                counts,
                dense,
            }
        })
        .collect();
    Pending { step, updates }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(ids: &[u64], values: &[f32], dense: &[f32]) -> ShardUpdate {
        ShardUpdate {
            ids: vec![ids.to_vec()],
            values: vec![values.to_vec()],
            counts: vec![Vec::new()],
            dense: dense.to_vec(),
        }
    }

    #[test]
    fn merged_pushes_sum_each_rows_gradients_and_the_dense_slices_under_the_newest_step() {
        let pushes = vec![
            Pending {
                step: 4,
                updates: vec![update(&[7, 9], &[1.0, 2.0, 3.0, 4.0], &[0.5])],
            },
            Pending {
                step: 5,
                updates: vec![update(&[9, 11], &[10.0, 20.0, 30.0, 40.0], &[0.25])],
            },
        ];
        let merged = merge_pushes(pushes);
        assert_eq!(merged.step, 5);
        assert_eq!(
            merged.updates,
            vec![update(&[7, 9, 11], &[1.0, 2.0, 13.0, 24.0, 30.0, 40.0], &[0.75])]
        );
    }
}
