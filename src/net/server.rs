//! The coordinator's TCP endpoint: each connection's frames become actor
//! messages, and the actor's answers go back as frames. A malformed frame,
//! one above the cap or an unexpected message closes that connection with a
//! log line; the server keeps serving the others. An answer above the cap
//! (a large gather) goes back as a refusal that says so. A connection speaks for one rank, the
//! first it names: a message for another rank closes it, so no process can send heartbeats, a
//! leave or a barrier arrival in another rank's name.

use std::sync::atomic::{AtomicU64, Ordering};

use actix::MailboxError;
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use super::auth::Credentials;
use super::frame::{codec, encode_with, ControlMessage, Frame};
use super::listen::accept_authenticated;
use super::protocol::{
    Acknowledge, Barrier, Beat, ConnectionLost, CoordinatorLine, Gather, Heartbeat, Join, JoinRefused, Leave, ListDead,
    Roster,
};
use crate::checkpoint::{CommitRecord, HeldFile};

/// Numbers the control connections of this process, so that a rank's heartbeat line is told
/// apart from the line of the process it replaced.
static LINES: AtomicU64 = AtomicU64::new(1);

/// Accepts control connections until the actor system stops; a connection that fails the
/// cluster-token handshake is dropped before any frame is read.
pub async fn serve(
    listener: TcpListener,
    coordinator: CoordinatorLine,
    max_frame_bytes: usize,
    credentials: Credentials,
) {
    accept_authenticated(listener, credentials, "control", move |stream| {
        handle_connection(stream, coordinator.clone(), max_frame_bytes)
    })
    .await
}

async fn handle_connection(
    stream: TcpStream,
    coordinator: CoordinatorLine,
    max_frame_bytes: usize,
) -> Result<(), String> {
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let mut framed = Framed::new(stream, codec(max_frame_bytes));
    let mut connection = Connection {
        coordinator,
        line: LINES.fetch_add(1, Ordering::Relaxed),
        heartbeats_of: None,
        speaks_for: None,
    };
    let served = connection.serve_frames(&mut framed, max_frame_bytes).await;
    if let Some(rank) = connection.heartbeats_of {
        let line = connection.line;
        connection
            .coordinator
            .connection_lost
            .do_send(ConnectionLost { rank, line });
    }
    served
}

/// An answer's header and the parts its payload carries back to back; or the refusal that goes
/// back instead.
type Answer = Result<(ControlMessage, Vec<Bytes>), ControlMessage>;

/// One control connection, and what it has said so far.
struct Connection {
    coordinator: CoordinatorLine,
    /// This connection's number.
    line: u64,
    /// The rank whose heartbeats this connection carries: if it ends before the rank left, the
    /// rank's process is gone.
    heartbeats_of: Option<usize>,
    /// The rank this connection speaks for: the first it named.
    speaks_for: Option<usize>,
}

impl Connection {
    /// Decodes each frame, has the coordinator answer it, and sends the answer back.
    async fn serve_frames(
        &mut self,
        framed: &mut Framed<TcpStream, LengthDelimitedCodec>,
        max_frame_bytes: usize,
    ) -> Result<(), String> {
        while let Some(body) = framed.next().await {
            let body = body.map_err(|e| format!("bad frame: {e}"))?;
            let frame: Frame = Frame::decode(body.freeze()).map_err(|e| e.to_string())?;
            if let Err(reason) = self.speaks_for(&frame) {
                // Told, so the sender does not take the closed line for a lost coordinator.
                let refusal = Frame::control(ControlMessage::Refused { reason: reason.clone() })
                    .encode()
                    .map_err(|e| e.to_string())?;
                let _ = framed.send(refusal).await;
                return Err(reason);
            }
            let (header, parts) = self
                .answer(frame)
                .await?
                .unwrap_or_else(|refusal| (refusal, Vec::new()));
            let encoded = encode_answer(&header, &parts, max_frame_bytes)?;
            framed
                .send(encoded)
                .await
                .map_err(|e| format!("sending the answer: {e}"))?;
        }
        Ok(())
    }

    /// Refuses a frame for another rank than the one this connection speaks for.
    fn speaks_for(&mut self, frame: &Frame) -> Result<(), String> {
        let Some(claimed) = frame.header.rank() else {
            return Ok(());
        };
        match *self.speaks_for.get_or_insert(claimed) {
            own if own == claimed => Ok(()),
            own => Err(format!("a connection of rank {own} sent a message for rank {claimed}")),
        }
    }

    /// The coordinator's answer to `frame`; an error for a message no rank sends.
    async fn answer(&mut self, frame: Frame) -> Result<Answer, String> {
        let coordinator = &self.coordinator;
        Ok(match frame.header {
            ControlMessage::Join {
                rank,
                world_size,
                data_endpoint,
                mirror,
                settings,
            } => {
                let join = Join {
                    rank,
                    world_size,
                    data_endpoint,
                    mirror,
                    settings,
                };
                joined(coordinator.join.send(join).await)
            }
            ControlMessage::Barrier { rank, name } => {
                let arrived = Barrier {
                    rank,
                    name: name.clone(),
                };
                answered(coordinator.barrier.send(arrived).await)
                    .map(|()| (ControlMessage::Released { name }, Vec::new()))
            }
            ControlMessage::Gather { rank, name } => {
                let part = Gather {
                    rank,
                    name: name.clone(),
                    part: frame.payload,
                };
                answered(coordinator.gather.send(part).await).map(|parts| gathered(rank, name, parts))
            }
            ControlMessage::Acknowledge { rank, step } => {
                let files: Vec<HeldFile> = serde_json::from_slice(&frame.payload)
                    .map_err(|e| format!("rank {rank}'s acknowledgement of step {step}: {e}"))?;
                answered(coordinator.acknowledge.send(Acknowledge { rank, step, files }).await)
                    .and_then(|record| committed(step, &record))
            }
            ControlMessage::Heartbeat { rank, pid, member_of } => {
                self.heartbeats_of = Some(rank);
                let beat = Heartbeat {
                    rank,
                    pid,
                    member_of,
                    line: self.line,
                };
                answered(coordinator.heartbeat.send(beat).await).map(|beat| (ControlMessage::Alive(beat), Vec::new()))
            }
            ControlMessage::Leave { rank } => {
                let left = answered(coordinator.leave.send(Leave { rank, line: self.line }).await);
                if left.is_ok() {
                    self.heartbeats_of = None;
                }
                left.map(|()| (ControlMessage::Alive(Beat::Alive), Vec::new()))
            }
            ControlMessage::ListDead => {
                let processes = coordinator
                    .list_dead
                    .send(ListDead)
                    .await
                    .map_err(|e| format!("coordinator unavailable: {e}"))?;
                Ok((ControlMessage::Dead { processes }, Vec::new()))
            }
            ControlMessage::ClockProbe => Ok((
                ControlMessage::Clock {
                    unix_us: crate::telemetry::clock::unix_now_us(),
                },
                Vec::new(),
            )),
            other => return Err(format!("unexpected message {other:?}")),
        })
    }
}

/// The answer to a join: the roster, or the refusal that says why not.
fn joined(sent: Result<Result<Roster, JoinRefused>, MailboxError>) -> Answer {
    match sent {
        Ok(Ok(roster)) => Ok((ControlMessage::Roster(Box::new(roster)), Vec::new())),
        Ok(Err(JoinRefused::Mismatch(reason))) => Err(ControlMessage::Mismatched { reason }),
        Ok(Err(JoinRefused::Failed(reason))) => Err(ControlMessage::Refused { reason }),
        Err(e) => Err(ControlMessage::Refused {
            reason: format!("coordinator unavailable: {e}"),
        }),
    }
}

/// The answer to a gather: every rank's part to rank 0, their lengths to every rank.
fn gathered(rank: usize, name: String, parts: Vec<Bytes>) -> (ControlMessage, Vec<Bytes>) {
    let lengths = parts.iter().map(|p| p.len() as u64).collect();
    let payload = if rank == 0 { parts } else { Vec::new() };
    (ControlMessage::Gathered { name, lengths }, payload)
}

/// The answer to an acknowledgement: the commit's record, as JSON.
fn committed(step: usize, record: &CommitRecord) -> Answer {
    let record = serde_json::to_vec(record).map_err(|e| ControlMessage::Refused {
        reason: format!("the commit of step {step}: {e}"),
    })?;
    Ok((ControlMessage::Committed { step }, vec![Bytes::from(record)]))
}

/// `header` with `parts` as its payload, as a frame; an answer above the cap goes back as a
/// refusal that says so.
fn encode_answer(header: &ControlMessage, parts: &[Bytes], max_frame_bytes: usize) -> Result<Bytes, String> {
    let payload_len = parts.iter().map(Bytes::len).sum();
    let encoded = encode_with(header, payload_len, |out| {
        parts.iter().for_each(|p| out.extend_from_slice(p))
    })
    .map_err(|e| e.to_string())?;
    if encoded.len() <= max_frame_bytes {
        return Ok(encoded);
    }
    let reason = format!(
        "the coordinator's answer of {} bytes exceeds cluster.max_frame_mb ({max_frame_bytes} bytes)",
        encoded.len()
    );
    Frame::control(ControlMessage::Refused { reason })
        .encode()
        .map_err(|e| e.to_string())
}

/// The coordinator's answer, or the refusal that goes back instead.
fn answered<T>(sent: Result<Result<T, String>, MailboxError>) -> Result<T, ControlMessage> {
    match sent {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(reason)) => Err(ControlMessage::Refused { reason }),
        Err(e) => Err(ControlMessage::Refused {
            reason: format!("coordinator unavailable: {e}"),
        }),
    }
}
