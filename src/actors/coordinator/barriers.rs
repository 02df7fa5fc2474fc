//! Barriers, gathers and checkpoint commits: ranks wait here until every expected one has
//! arrived (or the job's timeout names those that never did); a checkpoint is committed once
//! every rank acknowledged its files.

use std::collections::BTreeMap;

use actix::prelude::*;
use bytes::Bytes;
use tokio::sync::oneshot;

use super::{reply, Coordinator, Waiter};
use crate::checkpoint::{CommitRecord, HeldFile};

/// A rank waiting at a barrier or gather: its part (empty at a barrier), and where its answer goes.
pub(super) type Arrival = (Bytes, Waiter<Vec<Bytes>>);

/// The ranks waiting at one barrier, gather or checkpoint acknowledgement.
#[derive(Default)]
pub(super) struct Waiting {
    arrivals: BTreeMap<usize, Arrival>,
    /// The step whose checkpoint is committed once all have arrived (an acknowledgement).
    commits: Option<usize>,
}

impl Coordinator {
    /// Rank `rank` arrives at barrier or gather `name`, handing over `part`: answered with every
    /// rank's part, by rank, once all have arrived.
    pub(super) fn gather(
        &mut self,
        rank: usize,
        name: String,
        part: Bytes,
        ctx: &mut Context<Self>,
    ) -> ResponseFuture<Result<Vec<Bytes>, String>> {
        reply(self.arrive(rank, name, part, None, ctx))
    }

    /// Rank `rank` wrote `files` for the checkpoint of step `step`: answered with the commit's
    /// record once every rank has acknowledged it.
    pub(super) fn acknowledge(
        &mut self,
        rank: usize,
        step: usize,
        files: &[HeldFile],
        ctx: &mut Context<Self>,
    ) -> ResponseFuture<Result<CommitRecord, String>> {
        // Committed already: the rank's answer was lost (a coordinator that died committing).
        if let Some(record) = self.record.as_ref().filter(|r| r.step == step) {
            let record = record.clone();
            tracing::info!(rank, step, "acknowledged again: already committed");
            return Box::pin(async move { Ok(record) });
        }
        let part = match serde_json::to_vec(files) {
            Ok(json) => Bytes::from(json),
            Err(e) => return Box::pin(async move { Err(format!("rank {rank}'s file records: {e}")) }),
        };
        let name = format!("checkpoint of step {step}");
        let answer = reply(self.arrive(rank, name, part, Some(step), ctx));
        Box::pin(async move {
            let parts = answer.await?;
            let record = parts.first().ok_or("a commit without its record")?;
            serde_json::from_slice(record).map_err(|e| format!("the record of a commit: {e}"))
        })
    }
}

impl Coordinator {
    /// Answers every rank waiting at a barrier with `reason`.
    pub(super) fn fail_barriers(&mut self, reason: &str) {
        for (_, waiting) in self.barriers.drain() {
            for (_, (_, waiter)) in waiting.arrivals {
                let _ = waiter.send(Err(reason.to_string()));
            }
        }
    }

    /// `rank` arrives at barrier `name` with `part`: the answer comes once every rank has
    /// arrived (rank 0 gets all parts, by rank), or with an error naming the missing ranks
    /// once the timeout has passed since the first arrival. An acknowledgement (`commits`)
    /// is answered once the checkpoint is committed.
    pub(super) fn arrive(
        &mut self,
        rank: usize,
        name: String,
        part: Bytes,
        commits: Option<usize>,
        ctx: &mut Context<Self>,
    ) -> oneshot::Receiver<Result<Vec<Bytes>, String>> {
        let (tx, rx) = oneshot::channel();
        if let Some(reason) = &self.stopped {
            let _ = tx.send(Err(reason.clone()));
            return rx;
        }
        if self.behind(rank) {
            let _ = tx.send(Err(self.rolled_back.clone()));
            return rx;
        }
        if rank >= self.world_size {
            let _ = tx.send(Err(format!("rank {rank} is outside world size {}", self.world_size)));
            return rx;
        }
        if !self.active.contains(&rank) {
            let _ = tx.send(Err(format!(
                "rank {rank} does not train in generation {}",
                self.generation
            )));
            return rx;
        }
        let waiting = self.barriers.entry(name.clone()).or_default();
        waiting.commits = commits;
        if waiting.arrivals.is_empty() {
            let name = name.clone();
            ctx.run_later(self.timeout, move |coordinator, _| {
                let Some(waiting) = coordinator.barriers.remove(&name) else {
                    return;
                };
                let reason = format!(
                    "barrier {name:?} timed out after {:.1}s: {} never arrived",
                    coordinator.timeout.as_secs_f64(),
                    coordinator.missing(coordinator.active.clone(), &waiting.arrivals)
                );
                tracing::error!("{reason}");
                for (_, (_, waiter)) in waiting.arrivals {
                    let _ = waiter.send(Err(reason.clone()));
                }
            });
        }
        waiting.arrivals.insert(rank, (part, tx));
        if waiting.arrivals.len() == self.active.len() {
            let arrived = self.barriers.remove(&name).unwrap_or_default();
            let parts: Vec<Bytes> = arrived.arrivals.values().map(|(part, _)| part.clone()).collect();
            // An acknowledgement is answered with the record of the commit.
            let answer = match arrived.commits {
                Some(step) => self
                    .commit(step, &parts)
                    .and_then(|record| serde_json::to_vec(&record).map_err(|e| e.to_string()))
                    .map(|record| vec![Bytes::from(record)]),
                None => Ok(parts),
            };
            for (_, (_, waiter)) in arrived.arrivals {
                let _ = waiter.send(answer.clone());
            }
            if let (Some(step), Ok(_)) = (arrived.commits, &answer) {
                self.admit_waiting(step, ctx);
            }
        }
        rx
    }

    /// Commits the checkpoint of `step` whose files every rank listed in its part. In place, each
    /// node keeps its own copy (no shared filesystem): the coordinator records which node holds
    /// which file, and each node commits its copy once told; otherwise the files are in the
    /// coordinator's directory, and it commits them there.
    pub(super) fn commit(&mut self, step: usize, parts: &[Bytes]) -> Result<CommitRecord, String> {
        let mut files: Vec<HeldFile> = Vec::new();
        // The parts come by rank, of the ranks that train.
        for (&rank, part) in self.active.iter().zip(parts) {
            let acknowledged: Vec<HeldFile> = serde_json::from_slice(part)
                .map_err(|e| format!("rank {rank}'s acknowledgement of step {step}: {e}"))?;
            let node = self
                .roster
                .as_ref()
                .map_or_else(String::new, |r| r.host_of(rank).to_string());
            for HeldFile { record, nodes: copies } in acknowledged {
                // Its writer's node, and those it stored copies on.
                let nodes = std::iter::once(node.clone()).chain(copies);
                match files.iter_mut().find(|held| held.record.name == record.name) {
                    Some(held) if held.record == record => {
                        for node in nodes {
                            if !held.nodes.contains(&node) {
                                held.nodes.push(node);
                            }
                        }
                    }
                    Some(held) => {
                        return Err(format!(
                            "checkpoint of step {step}: two copies of {} differ ({} bytes, CRC-32C {:08x}; {} bytes, {:08x})",
                            record.name, held.record.bytes, held.record.crc32c, record.bytes, record.crc32c
                        ))
                    }
                    None => files.push(HeldFile {
                        record,
                        nodes: nodes.collect(),
                    }),
                }
            }
        }
        let record = CommitRecord {
            step,
            world_size: self.active.len(),
            files,
        };
        if let Some(store) = &self.checkpoints {
            let committed = if self.in_place {
                store.record(&record)
            } else {
                let files = record.files.iter().map(|held| held.record.clone()).collect();
                store.commit(step, record.world_size, files)
            };
            committed.map_err(|e| format!("committing the checkpoint of step {step}: {e:#}"))?;
        }
        self.committed = Some(step);
        self.record = Some(record.clone());
        Ok(record)
    }
}
