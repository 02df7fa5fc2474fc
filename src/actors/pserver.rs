//! The parameter-server shard actor: owns one [`Shard`] and answers trainers' requests. Pulls
//! that sync mode must hold back (the step is not complete yet) wait here, not on the trainer's
//! connection, and are answered as soon as the shard applies the step.
//!
//! Start it on its own arbiter (a dedicated thread): the optimizer runs inside its handlers.

use actix::prelude::*;
use anyhow::{anyhow, Result};
use futures::channel::oneshot;

use crate::ps::wire::{PullRequest, PulledRows, Reply, Request};
use crate::ps::Shard;

/// A request from a trainer; every request gets an answer, a refusal carrying the reason.
#[derive(Message)]
#[rtype(result = "Result<Reply>")]
pub struct ShardCall(pub Request);

/// The shard actor.
pub struct PServer {
    shard: Shard,
    waiting: Vec<(PullRequest, oneshot::Sender<Result<PulledRows>>)>,
    all_left: Option<oneshot::Sender<()>>,
}

impl PServer {
    /// The actor of `shard`; `all_left` fires once every trainer has left, so the process
    /// hosting the shard can exit.
    pub fn new(shard: Shard, all_left: oneshot::Sender<()>) -> Self {
        Self {
            shard,
            waiting: Vec::new(),
            all_left: Some(all_left),
        }
    }

    /// Answers the held pulls that the shard can answer now.
    fn answer_waiting(&mut self) {
        let waiting = std::mem::take(&mut self.waiting);
        for (pull, answer) in waiting {
            if self.shard.can_answer(&pull) {
                // The trainer may have given up (timeout); nothing to do then.
                let _ = answer.send(self.shard.pull(&pull));
            } else {
                self.waiting.push((pull, answer));
            }
        }
    }
}

impl Actor for PServer {
    type Context = Context<Self>;
}

impl Handler<ShardCall> for PServer {
    type Result = ResponseFuture<Result<Reply>>;

    fn handle(&mut self, ShardCall(request): ShardCall, _: &mut Context<Self>) -> Self::Result {
        let index = self.shard.spec().index;
        let outcome = match request {
            Request::Pull(pull) if !self.shard.can_answer(&pull) => {
                let (answer, later) = oneshot::channel();
                self.waiting.push((pull, answer));
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
        };
        let outcome = outcome.map_err(|e| e.context(format!("parameter server {index}")));
        Box::pin(async move { outcome })
    }
}
