//! The coordinator's TCP endpoint: each connection's frames are decoded into the coordinator's
//! [`Call`]s, and the actor's replies go back as frames. A malformed frame or one above the cap
//! closes that connection with a log line; the server keeps serving the others. An answer above
//! the cap (a large gather) goes back as a refusal that says so. A connection speaks for one rank, the
//! first it names: a message for another rank closes it, so no process can send heartbeats, a
//! leave or a barrier arrival in another rank's name.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use super::auth::Credentials;
use super::frame::{codec, encode_with, Frame};
use super::listen::accept_authenticated;
use super::protocol::{Answer, Call, ConnectionLost, CoordinatorLine, Reply, Request};

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
    /// Decodes each frame, hands it to the coordinator, and sends the answer back.
    async fn serve_frames(
        &mut self,
        framed: &mut Framed<TcpStream, LengthDelimitedCodec>,
        max_frame_bytes: usize,
    ) -> Result<(), String> {
        while let Some(body) = framed.next().await {
            let body = body.map_err(|e| format!("bad frame: {e}"))?;
            let frame: Frame<Request> = Frame::decode(body.freeze()).map_err(|e| e.to_string())?;
            if let Err(reason) = self.speaks_for(&frame.header) {
                // Told, so the sender does not take the closed line for a lost coordinator.
                let refusal = Frame::control(Answer::Refused { reason: reason.clone() })
                    .encode()
                    .map_err(|e| e.to_string())?;
                let _ = framed.send(refusal).await;
                return Err(reason);
            }
            let reply = self.call(frame).await;
            let encoded = encode_reply(&reply, max_frame_bytes)?;
            framed
                .send(encoded)
                .await
                .map_err(|e| format!("sending the answer: {e}"))?;
        }
        Ok(())
    }

    /// Refuses a request for another rank than the one this connection speaks for.
    fn speaks_for(&mut self, request: &Request) -> Result<(), String> {
        let Some(claimed) = request.rank() else {
            return Ok(());
        };
        match *self.speaks_for.get_or_insert(claimed) {
            own if own == claimed => Ok(()),
            own => Err(format!("a connection of rank {own} sent a message for rank {claimed}")),
        }
    }

    /// The coordinator's reply to `frame`, on this connection's line; a heartbeat makes this the
    /// line of its rank's heartbeats, until the rank leaves on it.
    async fn call(&mut self, frame: Frame<Request>) -> Reply {
        if let Request::Heartbeat(beat) = &frame.header {
            self.heartbeats_of = Some(beat.rank);
        }
        let leaves = matches!(frame.header, Request::Leave { .. });
        let call = Call {
            request: frame.header,
            part: frame.payload,
            line: self.line,
        };
        let reply = match self.coordinator.call.send(call).await {
            Ok(reply) => reply,
            Err(e) => return Reply::refused(format!("coordinator unavailable: {e}")),
        };
        if leaves && !matches!(reply.answer, Answer::Refused { .. }) {
            self.heartbeats_of = None;
        }
        reply
    }
}

/// `reply` as a frame, its parts back to back as the payload; a reply above the cap goes back
/// as a refusal that says so.
fn encode_reply(reply: &Reply, max_frame_bytes: usize) -> Result<Bytes, String> {
    let payload_len = reply.parts.iter().map(Bytes::len).sum();
    let encoded = encode_with(&reply.answer, payload_len, |out| {
        reply.parts.iter().for_each(|p| out.extend_from_slice(p))
    })
    .map_err(|e| e.to_string())?;
    if encoded.len() <= max_frame_bytes {
        return Ok(encoded);
    }
    let reason = format!(
        "the coordinator's answer of {} bytes exceeds cluster.max_frame_mb ({max_frame_bytes} bytes)",
        encoded.len()
    );
    Frame::control(Answer::Refused { reason })
        .encode()
        .map_err(|e| e.to_string())
}
