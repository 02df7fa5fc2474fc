//! A launched parameter-server shard of a job that recovers in place: it joins each generation
//! with the other roles, restores the state of the checkpoint the coordinator resumes from —
//! from the copy it kept in memory, else from its node's disk — and serves that generation until
//! every trainer has left or the coordinator orders a rollback. Between, it acknowledges each
//! checkpoint file its actor writes — first storing a copy on the next node, as no other node
//! holds a shard's state — and commits its node's copy once the coordinator has. A shard whose
//! node came back with an empty disk takes its file back from that copy.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use actix::Addr;
use anyhow::{anyhow, Context as _, Result};
use futures::channel::oneshot;
use tokio::sync::mpsc;

use super::ParameterServerJob;
use crate::actors::pserver::{CheckpointCommitted, KeepsState, PServer, RestoreState, RollBack, WrittenCheckpoint};
use crate::actors::recovery::buddy::Buddy;
use crate::actors::recovery::kept::commit_on_this_node;
use crate::actors::recovery::rollback::Orders;
use crate::checkpoint::HeldFile;
use crate::job::Recovery;
use crate::net::protocol::Roster;
use crate::net::ControlBus;
use crate::ps::snapshot::shard_file_name;

/// What a shard between requests hears.
enum Event {
    /// Every trainer has left (`false`: the actor stopped first).
    Left(bool),
    /// The actor wrote a checkpoint file (`None`: it stopped).
    Written(Option<WrittenCheckpoint>),
    /// The coordinator ordered a rollback.
    Interrupted(anyhow::Error),
}

/// Shard `index` of a job that recovers in place, between its generations.
pub(super) struct ShardGenerations<'a> {
    pub(super) index: usize,
    pub(super) job: &'a ParameterServerJob,
    pub(super) actor: Addr<PServer>,
    pub(super) bus: ControlBus,
    pub(super) orders: Orders,
    /// The shard's address, announced at each rendezvous (its node holds its files).
    pub(super) endpoint: String,
    /// Its checkpoint mirror's address, and how it reaches the next node's.
    pub(super) mirror: Option<(String, Buddy)>,
    pub(super) recovery: &'a Recovery,
    /// Whether the shard joined a generation before (a first join's state may have been read
    /// from disk when the process started).
    pub(super) joined: bool,
}

impl ShardGenerations<'_> {
    /// Serves generation after generation until every trainer has left (`done`), acknowledging
    /// the checkpoint files the actor hands over on `acks`.
    pub(super) async fn serve(
        mut self,
        mut acks: mpsc::UnboundedReceiver<WrittenCheckpoint>,
        mut done: oneshot::Receiver<()>,
    ) -> Result<()> {
        let index = self.index;
        let mut roster = self.join().await?;
        // Each pass ends with a rollback order to a newer generation, so the passes are bounded
        // by the roles the job loses.
        loop {
            let event = tokio::select! {
                left = &mut done => Event::Left(left.is_ok()),
                ack = acks.recv() => Event::Written(ack),
                interrupted = self.orders.interruption().of(std::future::pending::<Result<Infallible>>()) => {
                    Event::Interrupted(interrupted.map_or_else(|e| e, |never| match never {}))
                }
            };
            let failure = match event {
                Event::Left(true) => return Ok(()),
                Event::Left(false) => {
                    return Err(anyhow!("parameter server {index} stopped before every trainer left"))
                }
                Event::Written(None) => return Err(anyhow!("parameter server {index}: its actor stopped")),
                Event::Written(Some(written)) => match self.acknowledge(written, &roster).await {
                    Ok(()) => continue,
                    Err(e) => e,
                },
                Event::Interrupted(e) => e,
            };
            let order = self.orders.explain(failure).await?;
            self.actor
                .send(RollBack {
                    generation: order.generation,
                    reason: order.reason,
                })
                .await?;
            roster = self.join().await?;
        }
    }

    /// Acknowledges the shard's file of a checkpoint, once stored on the next node too; once the
    /// coordinator committed it, keeps its state as the one to roll back to and commits the
    /// node's copy.
    async fn acknowledge(&mut self, written: WrittenCheckpoint, roster: &Roster) -> Result<()> {
        let WrittenCheckpoint { step, record, bytes } = written;
        let mut held = HeldFile::here(record);
        if let Some((_, buddy)) = &self.mirror {
            let copy = buddy.copy(roster, self.index, step as usize, &held.record.name, &bytes);
            held.nodes.extend(copy.await?);
        }
        let commit = self.bus.acknowledge(self.index, step as usize, vec![held]).await?;
        self.actor.send(CheckpointCommitted(step)).await?;
        let store = self.recovery.store.as_ref().context("a checkpoint without a store")?;
        commit_on_this_node(store, commit, Some(roster), self.index).await
    }

    /// Roles of the job: servers, then trainers.
    fn roles(&self) -> usize {
        let config = &self.job.config;
        config.cluster.server_num + config.world_size()
    }

    /// Joins the forming generation and restores the state it resumes from.
    async fn join(&mut self) -> Result<Roster> {
        let index = self.index;
        let config = &self.job.config;
        let roster = self
            .bus
            .join(
                index,
                self.roles(),
                self.endpoint.clone(),
                self.mirror.as_ref().map(|(endpoint, _)| endpoint.clone()),
                config.shared_settings(),
            )
            .await?;
        self.recovery.check_joined(&roster)?;
        self.orders.joined(&roster);
        let step = roster.resume_step.unwrap_or(0);
        let started = Instant::now();
        let read_at_start = !self.joined && step > 0 && self.recovery.start_step() == Some(step);
        self.joined = true;
        let (bytes, from) = match self.actor.send(KeepsState(step as u64)).await? {
            true if read_at_start => (None, "disk".to_string()),
            true => (None, "memory".to_string()),
            false => {
                let (file, from) = self.read(&roster, step).await?;
                (Some(file), from)
            }
        };
        self.actor
            .send(RestoreState {
                generation: roster.generation,
                step: step as u64,
                bytes,
                trainers: roster.world_size() - config.cluster.server_num,
            })
            .await??;
        tracing::info!(
            shard = index,
            generation = roster.generation,
            step,
            from,
            seconds = started.elapsed().as_secs_f64(),
            "serving"
        );
        Ok(roster)
    }

    /// The shard's file of step `step`'s checkpoint: from its node's disk, else from the copy
    /// on the next node.
    async fn read(&self, roster: &Roster, step: usize) -> Result<(Arc<Vec<u8>>, String)> {
        let (index, name) = (self.index, shard_file_name(self.index));
        let disk = match self
            .recovery
            // Its file is the shard's whatever trainers wrote the rest.
            .read_committed(step, None, Some(roster), &name)
        {
            Ok(file) => return Ok((file, "disk".to_string())),
            Err(e) => e,
        };
        let Some((_, buddy)) = &self.mirror else {
            return Err(disk.context(format!(
                "parameter server {index}: restoring the checkpoint of step {step}"
            )));
        };
        let (bytes, from) = buddy.fetch(roster, index, step, &name).await.with_context(|| {
            format!("parameter server {index}: the checkpoint of step {step} is neither on this node's disk ({disk:#}) nor on the next node")
        })?;
        Ok((Arc::new(bytes), from))
    }
}
