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
};
use crate::checkpoint::HeldFile;

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
    let line = LINES.fetch_add(1, Ordering::Relaxed);
    // The rank whose heartbeats this connection carries: if it ends before the rank left, the
    // rank's process is gone.
    let mut heartbeats_of = None;
    let mut speaks_for = None;
    let served = serve_frames(
        &mut framed,
        &coordinator,
        max_frame_bytes,
        line,
        &mut heartbeats_of,
        &mut speaks_for,
    )
    .await;
    if let Some(rank) = heartbeats_of {
        coordinator.connection_lost.do_send(ConnectionLost { rank, line });
    }
    served
}

async fn serve_frames(
    framed: &mut Framed<TcpStream, LengthDelimitedCodec>,
    coordinator: &CoordinatorLine,
    max_frame_bytes: usize,
    line: u64,
    heartbeats_of: &mut Option<usize>,
    speaks_for: &mut Option<usize>,
) -> Result<(), String> {
    while let Some(body) = framed.next().await {
        let body = body.map_err(|e| format!("bad frame: {e}"))?;
        let frame: Frame = Frame::decode(body.freeze()).map_err(|e| e.to_string())?;
        if let Some(claimed) = frame.header.rank() {
            match *speaks_for.get_or_insert(claimed) {
                own if own == claimed => {}
                own => {
                    // Told, so the sender does not take the closed line for a lost coordinator.
                    let reason = format!("a connection of rank {own} sent a message for rank {claimed}");
                    let refusal = Frame::control(ControlMessage::Refused { reason: reason.clone() })
                        .encode()
                        .map_err(|e| e.to_string())?;
                    let _ = framed.send(refusal).await;
                    return Err(reason);
                }
            }
        }
        // The answer's header, and the parts its payload carries back to back.
        let answer: Result<(ControlMessage, Vec<Bytes>), ControlMessage> = match frame.header {
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
                match coordinator.join.send(join).await {
                    Ok(Ok(roster)) => Ok((ControlMessage::Roster(Box::new(roster)), Vec::new())),
                    Ok(Err(JoinRefused::Mismatch(reason))) => Err(ControlMessage::Mismatched { reason }),
                    Ok(Err(JoinRefused::Failed(reason))) => Err(ControlMessage::Refused { reason }),
                    Err(e) => Err(ControlMessage::Refused {
                        reason: format!("coordinator unavailable: {e}"),
                    }),
                }
            }
            ControlMessage::Barrier { rank, name } => answered(
                coordinator
                    .barrier
                    .send(Barrier {
                        rank,
                        name: name.clone(),
                    })
                    .await,
            )
            .map(|()| (ControlMessage::Released { name }, Vec::new())),
            ControlMessage::Gather { rank, name } => answered(
                coordinator
                    .gather
                    .send(Gather {
                        rank,
                        name: name.clone(),
                        part: frame.payload,
                    })
                    .await,
            )
            .map(|parts| {
                let lengths = parts.iter().map(|p| p.len() as u64).collect();
                let payload = if rank == 0 { parts } else { Vec::new() };
                (ControlMessage::Gathered { name, lengths }, payload)
            }),
            ControlMessage::Acknowledge { rank, step } => {
                let files: Vec<HeldFile> = serde_json::from_slice(&frame.payload)
                    .map_err(|e| format!("rank {rank}'s acknowledgement of step {step}: {e}"))?;
                answered(coordinator.acknowledge.send(Acknowledge { rank, step, files }).await).and_then(|record| {
                    let record = serde_json::to_vec(&record).map_err(|e| ControlMessage::Refused {
                        reason: format!("the commit of step {step}: {e}"),
                    })?;
                    Ok((ControlMessage::Committed { step }, vec![Bytes::from(record)]))
                })
            }
            ControlMessage::Heartbeat { rank, pid, member_of } => {
                *heartbeats_of = Some(rank);
                let beat = Heartbeat {
                    rank,
                    pid,
                    member_of,
                    line,
                };
                answered(coordinator.heartbeat.send(beat).await).map(|beat| (ControlMessage::Alive(beat), Vec::new()))
            }
            ControlMessage::Leave { rank } => {
                let left = answered(coordinator.leave.send(Leave { rank, line }).await);
                if left.is_ok() {
                    *heartbeats_of = None;
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
        };
        let (header, parts) = answer.unwrap_or_else(|refusal| (refusal, Vec::new()));
        let payload_len = parts.iter().map(Bytes::len).sum();
        let mut encoded = encode_with(&header, payload_len, |out| {
            parts.iter().for_each(|p| out.extend_from_slice(p))
        })
        .map_err(|e| e.to_string())?;
        if encoded.len() > max_frame_bytes {
            let reason = format!(
                "the coordinator's answer of {} bytes exceeds cluster.max_frame_mb ({max_frame_bytes} bytes)",
                encoded.len()
            );
            encoded = Frame::control(ControlMessage::Refused { reason })
                .encode()
                .map_err(|e| e.to_string())?;
        }
        framed
            .send(encoded)
            .await
            .map_err(|e| format!("sending the answer: {e}"))?;
    }
    Ok(())
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
