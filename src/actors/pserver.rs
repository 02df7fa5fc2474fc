//! The parameter-server shard actor: owns one [`Shard`] and answers trainers' requests. Pulls
//! that sync mode must hold back (the step is not complete yet) wait here, not on the trainer's
//! connection, and are answered as soon as the shard applies the step.
//!
//! A held pull, or a trainer's scores waiting for the others' to evaluate, is answered with an
//! error after the job's timeout, naming the trainers the shard still waits for, so a trainer
//! that died or stalled is named rather than waited on forever.
//!
//! In a job that recovers in place the shard serves one *generation* at a time: on a rollback
//! order it refuses everything it holds with the reason, and takes no request until it has
//! restored the committed checkpoint's state — from the copy it kept in memory, or from its
//! node's disk. A request stamped with an older generation is refused (it was sent before the
//! rollback and must not be applied after it); one stamped with a newer generation waits until
//! the shard has restored that generation's state.
//!
//! A shard writes only in the directories it was started with ([`PServer::writing_in`]): a
//! request names a step or nothing, never a path, so a peer holding the cluster token cannot
//! have it write anywhere else.
//!
//! Start it on its own arbiter (a dedicated thread): the optimizer runs inside its handlers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use anyhow::{anyhow, Context as _, Result};
use futures::channel::oneshot;
use tokio::sync::mpsc;

use super::recovery::kept::Kept;
use crate::checkpoint::{CheckpointStore, FileRecord};
use crate::collective::preemption;
use crate::metrics::auc;
use crate::ps::snapshot::shard_file_name;
use crate::ps::wire::{PullRequest, PulledRows, Reply, Request, ShardCall};
use crate::ps::Shard;
use crate::telemetry::timeline::{Span, Timeline};

/// Hands over the shard's timeline spans recorded so far (none unless tracing).
#[derive(Message)]
#[rtype(result = "Vec<Span>")]
pub struct TakeShardSpans;

/// The coordinator ordered a rollback to `generation`: everything held is refused with `reason`.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RollBack {
    /// The generation the job rolls back to.
    pub generation: u64,
    /// Why (which role was lost).
    pub reason: String,
}

/// Whether the shard kept the state after `0` steps in memory.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct KeepsState(pub u64);

/// Brings the shard to the state after `step` steps and serves `generation` from then on:
/// `bytes` (read from disk), or the copy it kept when `None`.
#[derive(Message)]
#[rtype(result = "Result<()>")]
pub struct RestoreState {
    /// The generation to serve.
    pub generation: u64,
    /// The checkpoint's step.
    pub step: u64,
    /// The checkpoint's shard file, unless the shard kept it.
    pub bytes: Option<Arc<Vec<u8>>>,
    /// The trainers of the generation.
    pub trainers: usize,
}

/// The checkpoint of `0` was committed: the copy kept of it is the one to roll back to.
#[derive(Message)]
#[rtype(result = "()")]
pub struct CheckpointCommitted(pub u64);

/// A checkpoint file the shard wrote, for its process to acknowledge (and copy to its buddy).
pub struct WrittenCheckpoint {
    /// The checkpoint's step.
    pub step: u64,
    /// The file's record.
    pub record: FileRecord,
    /// Its contents.
    pub bytes: Arc<Vec<u8>>,
}

/// The shard actor.
pub struct PServer {
    shard: Shard,
    /// Spans of the requests it served, when tracing.
    timeline: Option<Timeline>,
    waiting: Vec<Waiting>,
    /// The checkpoint the trainers are asking for, until every one of them has.
    checkpoint: Option<PendingCheckpoint>,
    /// Shard 0: the trainers' scores of their shares of the held-out data, by trainer, until
    /// every one has sent its share.
    evaluation: BTreeMap<usize, EvaluatedShare>,
    all_left: Option<oneshot::Sender<()>>,
    timeout: Duration,
    /// The generation served.
    generation: u64,
    /// Whether the shard holds its generation's state (not between a rollback and the restore).
    ready: bool,
    /// Requests of a generation whose state the shard has not restored yet.
    early: Vec<Early>,
    /// In a job that recovers in place: the states to roll back to, and where the shard's
    /// checkpoint files go to be acknowledged to the coordinator.
    in_place: Option<(Kept, mpsc::UnboundedSender<WrittenCheckpoint>)>,
    /// Where [`Request::Save`] writes the shard's tables: the run directory.
    run_dir: Option<PathBuf>,
    /// The job's checkpoint directory on the shard's node, where [`Request::Checkpoint`] writes
    /// the shard's file; `None` when the job takes no checkpoints.
    checkpoint_dir: Option<PathBuf>,
}

/// One trainer's scores and labels of its share of the held-out data, and where its answer goes.
struct EvaluatedShare {
    scores: Vec<f32>,
    labels: Vec<f32>,
    answer: oneshot::Sender<Result<Reply>>,
    /// When the share stops waiting for the others'.
    deadline: Instant,
}

/// The checkpoint of step `step`: the trainers that asked for it, with their files, and where
/// their answers go.
struct PendingCheckpoint {
    step: u64,
    asked: Vec<(usize, Vec<FileRecord>, oneshot::Sender<Result<Reply>>)>,
}

/// A pull held until the shard can answer it.
struct Waiting {
    pull: PullRequest,
    answer: oneshot::Sender<Result<PulledRows>>,
    deadline: Instant,
}

/// A request held until the shard serves its generation.
struct Early {
    call: ShardCall,
    answer: oneshot::Sender<Result<Reply>>,
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
            checkpoint: None,
            evaluation: BTreeMap::new(),
            all_left: Some(all_left),
            timeout,
            generation: 0,
            ready: true,
            early: Vec::new(),
            in_place: None,
            run_dir: None,
            checkpoint_dir: None,
        }
    }

    /// Writes its tables in `run_dir` when told to save them, and its checkpoint files in
    /// `checkpoint_dir` (`None`: the job takes no checkpoints) — on its own node, which in a
    /// job that recovers in place keeps its own copy.
    pub fn writing_in(mut self, run_dir: &Path, checkpoint_dir: Option<&Path>) -> Self {
        self.run_dir = Some(run_dir.to_path_buf());
        self.checkpoint_dir = checkpoint_dir.map(Path::to_path_buf);
        self
    }

    /// Records a timeline of the requests it serves, measured from `origin`.
    pub fn traced_from(mut self, origin: Option<Instant>) -> Self {
        self.timeline = origin.map(Timeline::new);
        self
    }

    /// Rolls back in place: keeps the state after `step` steps (where it starts) and every
    /// checkpoint's in memory, and hands each checkpoint file it writes to `acknowledge` (its
    /// process tells the coordinator). It serves nothing until told which generation
    /// ([`RestoreState`]).
    pub fn recovering_in_place(
        mut self,
        step: u64,
        acknowledge: mpsc::UnboundedSender<WrittenCheckpoint>,
    ) -> Result<Self> {
        let mut kept = Kept::default();
        kept.taken(step as usize, Arc::new(self.shard.snapshot_bytes()?));
        kept.committed();
        self.in_place = Some((kept, acknowledge));
        self.ready = false;
        Ok(self)
    }

    /// Answers the held pulls that the shard can answer now, and refuses those past their
    /// deadline with what they still wait for (as it refuses an evaluation that waited too long
    /// for some trainers' scores).
    fn answer_waiting(&mut self) {
        let index = self.shard.spec().index;
        let now = Instant::now();
        self.take_checkpoint_if_ready();
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
        if self.evaluation.values().any(|share| now >= share.deadline) {
            let missing: Vec<usize> = (0..self.shard.spec().trainers)
                .filter(|t| !self.evaluation.contains_key(t))
                .collect();
            for share in std::mem::take(&mut self.evaluation).into_values() {
                let _ = share.answer.send(Err(anyhow!(
                    "parameter server {index}: the evaluation waited {:.0?} for the scores of trainers {missing:?}",
                    self.timeout
                )));
            }
        }
        for held in std::mem::take(&mut self.early) {
            if now >= held.deadline {
                let _ = held.answer.send(Err(anyhow!(
                    "parameter server {index}: a request of generation {} waited {:.0?} for the shard, which serves generation {}{}",
                    held.call.generation,
                    self.timeout,
                    self.generation,
                    if self.ready { "" } else { " and has not restored its state" }
                )));
            } else {
                self.early.push(held);
            }
        }
    }

    /// Takes the pending checkpoint once every trainer asked for it and the shard is at its
    /// step, and answers them all.
    fn take_checkpoint_if_ready(&mut self) {
        let Some((step, asked)) = self.checkpoint.as_ref().map(|p| (p.step, p.asked.len())) else {
            return;
        };
        let outcome = match self.shard.checkpoint_ready(step) {
            Ok(false) => return,
            Ok(true) if asked < self.shard.spec().trainers => return,
            Ok(true) => self.write_checkpoint(step),
            Err(e) => Err(e),
        };
        let Some(pending) = self.checkpoint.take() else {
            return;
        };
        let outcome = outcome.map(|shard| {
            let trainers = pending.asked.iter().flat_map(|(_, files, _)| files.iter().cloned());
            std::iter::once(shard).chain(trainers).collect::<Vec<_>>()
        });
        for (_, _, answer) in pending.asked {
            let _ = answer.send(
                outcome
                    .as_ref()
                    .map(|files| Reply::Checkpointed(files.clone()))
                    .map_err(|e| anyhow!("{e:#}")),
            );
        }
    }

    /// Writes the shard's file of step `step`'s checkpoint in its checkpoint directory; in
    /// place, keeps the state and hands the file to be acknowledged.
    fn write_checkpoint(&mut self, step: u64) -> Result<FileRecord> {
        let index = self.shard.spec().index;
        let dir = self.checkpoint_dir.as_ref().with_context(|| {
            format!("parameter server {index} was asked for the checkpoint of step {step}, but the job takes none")
        })?;
        let bytes = Arc::new(self.shard.snapshot_bytes()?);
        // The shard's own store only writes files; the commit is the coordinator's (in place)
        // or the ordering trainer's.
        let record = CheckpointStore::new(dir, 1).write(step as usize, &shard_file_name(index), &bytes)?;
        if let Some((kept, acknowledge)) = &mut self.in_place {
            kept.taken(step as usize, bytes.clone());
            let written = WrittenCheckpoint {
                step,
                record: record.clone(),
                bytes,
            };
            acknowledge
                .send(written)
                .map_err(|_| anyhow!("parameter server {index}: its process no longer acknowledges checkpoints"))?;
        }
        Ok(record)
    }

    /// Saves the shard's tables and dense slice as `ps-shard-<index>.safetensors` in its run
    /// directory.
    fn save_tables(&self) -> Result<()> {
        let index = self.shard.spec().index;
        let dir = self.run_dir.as_ref().with_context(|| {
            format!("parameter server {index} was told to save its tables, but has no run directory")
        })?;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        self.shard.save(&dir.join(shard_file_name(index)))
    }

    /// Trainer `trainer` asks for the checkpoint of `step` (once it pushed its steps before it).
    fn ask_checkpoint(
        &mut self,
        step: u64,
        trainer: usize,
        files: Vec<FileRecord>,
    ) -> oneshot::Receiver<Result<Reply>> {
        let (answer, later) = oneshot::channel();
        let index = self.shard.spec().index;
        match &mut self.checkpoint {
            Some(pending) if pending.step != step => {
                let _ = answer.send(Err(anyhow!(
                    "parameter server {index}: trainer {trainer} asked for the checkpoint of step {step} while others wait for step {}",
                    pending.step
                )));
                return later;
            }
            Some(pending) => pending.asked.push((trainer, files, answer)),
            None => {
                self.checkpoint = Some(PendingCheckpoint {
                    step,
                    asked: vec![(trainer, files, answer)],
                })
            }
        }
        self.take_checkpoint_if_ready();
        later
    }

    /// Trainer `trainer` sends its share of the held-out scores; once every trainer has (a
    /// retried share replaces the first), all are answered with the AUC over the whole set,
    /// the shares joined in trainer order.
    fn gather_evaluation(
        &mut self,
        trainer: usize,
        scores: Vec<f32>,
        labels: Vec<f32>,
    ) -> oneshot::Receiver<Result<Reply>> {
        let (answer, later) = oneshot::channel();
        let spec = self.shard.spec();
        if trainer >= spec.trainers || scores.len() != labels.len() {
            let _ = answer.send(Err(anyhow!(
                "parameter server {}: an evaluation share of trainer {trainer} ({} scores, {} labels) in a job of {} trainers",
                spec.index,
                scores.len(),
                labels.len(),
                spec.trainers
            )));
            return later;
        }
        let deadline = Instant::now() + self.timeout;
        self.evaluation.insert(
            trainer,
            EvaluatedShare {
                scores,
                labels,
                answer,
                deadline,
            },
        );
        if self.evaluation.len() == spec.trainers {
            let shares = std::mem::take(&mut self.evaluation);
            let scores: Vec<f32> = shares.values().flat_map(|share| share.scores.iter().copied()).collect();
            let labels: Vec<f32> = shares.values().flat_map(|share| share.labels.iter().copied()).collect();
            let reply = Reply::Evaluation {
                auc: auc(&scores, &labels),
                samples: scores.len() as u64,
            };
            for share in shares.into_values() {
                let _ = share.answer.send(Ok(reply.clone()));
            }
        }
        later
    }

    /// Serves `request` of the generation the shard serves.
    fn serve(&mut self, request: Request, ctx: &mut Context<Self>) -> ResponseFuture<Result<Reply>> {
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
                let rows = self.answer_later(later, ctx);
                return Box::pin(async move { rows.await.map(Reply::Rows) });
            }
            Request::Pull(pull) => self.shard.pull(&pull).map(Reply::Rows),
            Request::Push(push) => {
                if preemption::asked() {
                    self.shard.ask_to_stop();
                }
                self.shard.push(push).map(|applied| {
                    if applied {
                        self.answer_waiting();
                    }
                    Reply::Done
                })
            }
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
            Request::Save => self.save_tables().map(|()| Reply::Done),
            Request::Stats => Ok(Reply::Stats(self.shard.stats())),
            Request::Checkpoint { step, trainer, files } => {
                let later = self.ask_checkpoint(step, trainer, files);
                return Box::pin(async move {
                    later
                        .await
                        .map_err(|_| anyhow!("parameter server {index} stopped before checkpointing"))?
                });
            }
            Request::Evaluated {
                trainer,
                scores,
                labels,
            } => {
                let later = self.gather_evaluation(trainer, scores, labels);
                return self.answer_later(later, ctx);
            }
        };
        if let (Some(timeline), Some((name, category))) = (&mut self.timeline, span) {
            timeline.record(name, category, started);
        }
        let outcome = outcome.map_err(|e| e.context(format!("parameter server {index}")));
        Box::pin(async move { outcome })
    }

    /// The answer a held request gets on `later`: when the shard can give it, or a refusal once
    /// it has waited the timeout (checked then).
    fn answer_later<T: 'static>(
        &self,
        later: oneshot::Receiver<Result<T>>,
        ctx: &mut Context<Self>,
    ) -> ResponseFuture<Result<T>> {
        let index = self.shard.spec().index;
        ctx.run_later(self.timeout, |shard, _| shard.answer_waiting());
        Box::pin(async move {
            later
                .await
                .map_err(|_| anyhow!("parameter server {index} stopped before answering"))?
        })
    }

    /// Serves the held requests of the generation now served.
    fn serve_early(&mut self, ctx: &mut Context<Self>) {
        for held in std::mem::take(&mut self.early) {
            if held.call.generation > self.generation {
                self.early.push(held);
                continue;
            }
            let answer = self.call(held.call, ctx);
            actix::spawn(async move {
                let _ = held.answer.send(answer.await);
            });
        }
    }

    /// Answers `call` by its generation: refused when older than the one served, held when newer
    /// (or while the shard restores), served otherwise.
    fn call(&mut self, call: ShardCall, ctx: &mut Context<Self>) -> ResponseFuture<Result<Reply>> {
        let index = self.shard.spec().index;
        if call.generation < self.generation {
            let refusal = anyhow!(
                "parameter server {index}: a request of generation {} after the job rolled back to generation {}",
                call.generation,
                self.generation
            );
            return Box::pin(async move { Err(refusal) });
        }
        if call.generation > self.generation || !self.ready {
            let (answer, later) = oneshot::channel();
            self.early.push(Early {
                call,
                answer,
                deadline: Instant::now() + self.timeout,
            });
            return self.answer_later(later, ctx);
        }
        self.serve(call.request, ctx)
    }
}

impl Actor for PServer {
    type Context = Context<Self>;
}

impl Handler<ShardCall> for PServer {
    type Result = ResponseFuture<Result<Reply>>;

    fn handle(&mut self, call: ShardCall, ctx: &mut Context<Self>) -> Self::Result {
        self.call(call, ctx)
    }
}

impl Handler<RollBack> for PServer {
    type Result = ();

    fn handle(&mut self, order: RollBack, _: &mut Context<Self>) {
        if order.generation <= self.generation {
            return;
        }
        tracing::warn!(
            shard = self.shard.spec().index,
            generation = order.generation,
            "rolling back: {}",
            order.reason
        );
        self.generation = order.generation;
        self.ready = false;
        let reason = &order.reason;
        for held in std::mem::take(&mut self.waiting) {
            let _ = held.answer.send(Err(anyhow!("{reason}")));
        }
        for (_, _, answer) in self.checkpoint.take().into_iter().flat_map(|p| p.asked) {
            let _ = answer.send(Err(anyhow!("{reason}")));
        }
        for share in std::mem::take(&mut self.evaluation).into_values() {
            let _ = share.answer.send(Err(anyhow!("{reason}")));
        }
        for held in std::mem::take(&mut self.early) {
            if held.call.generation < self.generation {
                let _ = held.answer.send(Err(anyhow!("{reason}")));
            } else {
                self.early.push(held);
            }
        }
    }
}

impl Handler<KeepsState> for PServer {
    type Result = bool;

    fn handle(&mut self, KeepsState(step): KeepsState, _: &mut Context<Self>) -> bool {
        self.in_place
            .as_ref()
            .is_some_and(|(kept, _)| kept.at(step as usize).is_some())
    }
}

impl Handler<RestoreState> for PServer {
    type Result = Result<()>;

    fn handle(&mut self, restore: RestoreState, ctx: &mut Context<Self>) -> Result<()> {
        let index = self.shard.spec().index;
        let (kept, _) = self
            .in_place
            .as_mut()
            .with_context(|| format!("parameter server {index} does not roll back in place"))?;
        let bytes = match restore.bytes {
            Some(bytes) => {
                kept.taken(restore.step as usize, bytes.clone());
                kept.committed();
                bytes
            }
            None => kept
                .at(restore.step as usize)
                .with_context(|| format!("parameter server {index} kept no state of step {}", restore.step))?,
        };
        self.shard.set_trainers(restore.trainers);
        self.shard.resume(&bytes, restore.step)?;
        self.generation = restore.generation;
        self.ready = true;
        self.serve_early(ctx);
        Ok(())
    }
}

impl Handler<CheckpointCommitted> for PServer {
    type Result = ();

    fn handle(&mut self, CheckpointCommitted(step): CheckpointCommitted, _: &mut Context<Self>) {
        if let Some((kept, _)) = &mut self.in_place {
            if kept.pending_step() == Some(step as usize) {
                kept.committed();
            }
        }
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
