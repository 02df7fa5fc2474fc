//! The coordinator's one message: each [`Request`] to the concern that answers it, and its
//! answer as the protocol's [`Reply`] — the same whether the request came from a role in this
//! process or, decoded from a frame, from the server.

use actix::prelude::*;
use bytes::Bytes;
use futures::FutureExt;

use super::membership::JoinRefused;
use super::Coordinator;
use crate::net::protocol::{Answer, Beat, Call, Reply, Request};

impl Handler<Call> for Coordinator {
    type Result = ResponseFuture<Reply>;

    fn handle(&mut self, call: Call, ctx: &mut Self::Context) -> Self::Result {
        let receives_parts = call.request.receives_parts();
        match call.request {
            Request::Join(join) => Box::pin(self.join(join, ctx).map(|joined| match joined {
                Ok(roster) => Reply::bare(Answer::Roster(Box::new(roster))),
                Err(JoinRefused::Mismatch(reason)) => Reply::bare(Answer::Mismatched { reason }),
                Err(JoinRefused::Failed(reason)) => Reply::refused(reason),
            })),
            Request::Barrier { rank, name } => {
                let released = Answer::Released { name: name.clone() };
                let arrived = self.gather(rank, name, Bytes::new(), ctx);
                Box::pin(arrived.map(|arrived| answered(arrived.map(|_| released))))
            }
            Request::Gather { rank, name } => {
                let gathered = self.gather(rank, name.clone(), call.part, ctx);
                Box::pin(gathered.map(move |gathered| match gathered {
                    Ok(parts) => Reply {
                        answer: Answer::Gathered {
                            name,
                            lengths: parts.iter().map(|p| p.len() as u64).collect(),
                        },
                        parts: if receives_parts { parts } else { Vec::new() },
                    },
                    Err(reason) => Reply::refused(reason),
                }))
            }
            Request::Acknowledge { rank, step, files } => {
                let committed = self.acknowledge(rank, step, &files, ctx);
                Box::pin(committed.map(|committed| answered(committed.map(Answer::Committed))))
            }
            Request::Heartbeat(beat) => ready(self.heartbeat(beat, call.line).map(Answer::Alive)),
            Request::Leave { rank } => ready(self.leave(rank, call.line).map(|()| Answer::Alive(Beat::Alive))),
            Request::ListDead => ready(Ok(Answer::Dead {
                processes: self.dead.clone(),
            })),
            Request::ClockProbe => ready(Ok(Answer::Clock {
                unix_us: crate::telemetry::clock::unix_now_us(),
            })),
        }
    }
}

/// The reply to a request answered at once.
fn ready(answer: Result<Answer, String>) -> ResponseFuture<Reply> {
    let reply = answered(answer);
    Box::pin(async move { reply })
}

/// `answer`, or the refusal that says why not.
fn answered(answer: Result<Answer, String>) -> Reply {
    answer.map_or_else(Reply::refused, Reply::bare)
}
