//! The parameter-server shard actor: owns one [`Shard`] and answers trainers' requests. Pulls
//! that sync mode must hold back (the step is not complete yet) wait here, not on the trainer's
//! connection, and are answered as soon as the shard applies the step.
//!
//! A held pull is answered with an error after the job's timeout, naming the trainers the shard
//! still waits for, so a trainer that died or stalled is named rather than waited on forever.
//!
//! Start it on its own arbiter (a dedicated thread): the optimizer runs inside its handlers.

use std::time::{Duration, Instant};

use actix::prelude::*;
use anyhow::{anyhow, Result};
use futures::channel::oneshot;

use crate::checkpoint::{CheckpointStore, FileRecord};
use crate::ps::snapshot::shard_file_name;
use crate::ps::wire::{PullRequest, PulledRows, Reply, Request};
use crate::ps::Shard;
use crate::telemetry::timeline::{Span, Timeline};

use crate::ps::wire::ShardCall;

/// Hands over the shard's timeline spans recorded so far (none unless tracing).
#[derive(Message)]
#[rtype(result = "Vec<Span>")]
pub struct TakeShardSpans;

/// The shard actor.
pub struct PServer {
    shard: Shard,
    /// Spans of the requests it served, when tracing.
    timeline: Option<Timeline>,
    waiting: Vec<Waiting>,
    /// Checkpoint orders held until the shard has applied their step.
    checkpoints: Vec<HeldCheckpoint>,
    all_left: Option<oneshot::Sender<()>>,
    timeout: Duration,
}

/// A checkpoint of step `step` into `dir`, held until the shard has applied that step.
struct HeldCheckpoint {
    dir: String,
    step: u64,
    answer: oneshot::Sender<Result<FileRecord>>,
}

/// A pull held until the shard can answer it.
struct Waiting {
    pull: PullRequest,
    answer: oneshot::Sender<Result<PulledRows>>,
    deadline: Instant,
}

impl PServer {
    /// The actor of `shard`; `all_left` fires once every trainer has left, so the process
    /// hosting the shard can exit. A pull is held at most `timeout`.
    pub fn new(shard: Shard, all_left: oneshot::Sender<()>, timeout: Duration) -> Self {
        Self {
            shard,
            timeline: None,
            waiting: Vec::new(),
            checkpoints: Vec::new(),
            all_left: Some(all_left),
            timeout,
        }
    }

    /// Records a timeline of the requests it serves, measured from `origin`.
    pub fn traced_from(mut self, origin: Option<Instant>) -> Self {
        self.timeline = origin.map(Timeline::new);
        self
    }

    /// Answers the held pulls that the shard can answer now, and refuses those past their
    /// deadline with what they still wait for.
    fn answer_waiting(&mut self) {
        let index = self.shard.spec().index;
        let now = Instant::now();
        for held in std::mem::take(&mut self.checkpoints) {
            if self.shard.applied() >= held.step {
                let _ = held.answer.send(self.checkpoint(&held.dir, held.step));
            } else {
                self.checkpoints.push(held);
            }
        }
        for held in std::mem::take(&mut self.waiting) {
            // A trainer that gave up no longer listens; nothing to do then.
            if self.shard.can_answer(&held.pull) {
                let _ = held.answer.send(self.shard.pull(&held.pull));
            } else if now >= held.deadline {
                let _ = held.answer.send(Err(anyhow!(
                    "parameter server {index}: no answer to trainer {}'s pull within {:.0?}: {}",
                    held.pull.trainer,
                    self.timeout,
                    self.shard.waiting_for(&held.pull)
                )));
            } else {
                self.waiting.push(held);
            }
        }
    }
}

impl PServer {
    /// Writes the shard's file of step `step`'s checkpoint in `dir`.
    fn checkpoint(&self, dir: &str, step: u64) -> Result<FileRecord> {
        let spec = self.shard.spec();
        anyhow::ensure!(
            self.shard.applied() == step,
            "parameter server {}: asked for the checkpoint of step {step} at step {}",
            spec.index,
            self.shard.applied()
        );
        let bytes = self.shard.snapshot_bytes()?;
        // The shard's own store only writes files; the trainer that ordered it commits.
        CheckpointStore::new(dir, 1).write(step as usize, &shard_file_name(spec.index), &bytes)
    }
}

impl Actor for PServer {
    type Context = Context<Self>;
}

impl Handler<ShardCall> for PServer {
    type Result = ResponseFuture<Result<Reply>>;

    fn handle(&mut self, ShardCall(request): ShardCall, ctx: &mut Context<Self>) -> Self::Result {
        let index = self.shard.spec().index;
        let started = Instant::now();
        let span = self.timeline.as_ref().and_then(|_| span_of(&request));
        let outcome = match request {
            Request::Pull(pull) if !self.shard.can_answer(&pull) => {
                let (answer, later) = oneshot::channel();
                self.waiting.push(Waiting {
                    pull,
                    answer,
                    deadline: Instant::now() + self.timeout,
                });
                ctx.run_later(self.timeout, |shard, _| shard.answer_waiting());
                return Box::pin(async move {
                    later
                        .await
                        .map_err(|_| anyhow!("parameter server {index} stopped before answering"))?
                        .map(Reply::Rows)
                });
            }
            Request::Pull(pull) => self.shard.pull(&pull).map(Reply::Rows),
            Request::Push(push) => self.shard.push(push).map(|applied| {
                if applied {
                    self.answer_waiting();
                }
                Reply::Done
            }),
            Request::EndTraining { trainer } => self.shard.end_training(trainer).map(|all| {
                if all {
                    self.answer_waiting();
                }
                Reply::Done
            }),
            Request::Leave { trainer } => self.shard.leave(trainer).map(|all| {
                if all {
                    if let Some(all_left) = self.all_left.take() {
                        let _ = all_left.send(());
                    }
                }
                Reply::Done
            }),
            Request::Save { path } => self.shard.save(path.as_ref()).map(|()| Reply::Done),
            Request::Stats => Ok(Reply::Stats(self.shard.stats())),
            // Every trainer has pushed the step before: held until the shard applies it.
            Request::Checkpoint { dir, step } if self.shard.applied() < step => {
                let (answer, later) = oneshot::channel();
                self.checkpoints.push(HeldCheckpoint { dir, step, answer });
                return Box::pin(async move {
                    later
                        .await
                        .map_err(|_| anyhow!("parameter server {index} stopped before checkpointing"))?
                        .map(Reply::Checkpointed)
                });
            }
            Request::Checkpoint { dir, step } => self.checkpoint(&dir, step).map(Reply::Checkpointed),
        };
        if let (Some(timeline), Some((name, category))) = (&mut self.timeline, span) {
            timeline.record(name, category, started);
        }
        let outcome = outcome.map_err(|e| e.context(format!("parameter server {index}")));
        Box::pin(async move { outcome })
    }
}

impl Handler<TakeShardSpans> for PServer {
    type Result = Vec<Span>;

    fn handle(&mut self, _: TakeShardSpans, _: &mut Context<Self>) -> Vec<Span> {
        self.timeline.as_mut().map(Timeline::take).unwrap_or_default()
    }
}

/// The span a request's handling is recorded as: the work of the shard's thread (a held pull
/// is recorded when it is answered by the push that completes its step).
fn span_of(request: &Request) -> Option<(String, &'static str)> {
    match request {
        Request::Pull(pull) => Some((
            format!("pull of trainer {} (step {})", pull.trainer, pull.version),
            "pull",
        )),
        Request::Push(push) => Some((format!("push of trainer {} (step {})", push.trainer, push.step), "push")),
        Request::Checkpoint { step, .. } => Some((format!("checkpoint of step {step}"), "checkpoint")),
        _ => None,
    }
}
