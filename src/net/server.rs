//! The coordinator's TCP endpoint: each connection's frames become actor
//! messages, and the actor's answers go back as frames. A malformed frame,
//! one above the cap or an unexpected message closes that connection with a
//! log line; the server keeps serving the others.

use actix::Addr;
use futures::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::Framed;

use super::frame::{codec, ControlMessage, Frame};
use crate::actors::coordinator::{Barrier, Coordinator, Join};

/// Accepts control connections until the actor system stops.
pub async fn serve(listener: TcpListener, coordinator: Addr<Coordinator>, max_frame_bytes: usize) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let coordinator = coordinator.clone();
                actix::spawn(async move {
                    if let Err(reason) = handle_connection(stream, coordinator, max_frame_bytes).await {
                        tracing::warn!(%peer, "closed control connection: {reason}");
                    }
                });
            }
            Err(e) => tracing::warn!("accepting a control connection failed: {e}"),
        }
    }
}

async fn handle_connection(
    stream: TcpStream,
    coordinator: Addr<Coordinator>,
    max_frame_bytes: usize,
) -> Result<(), String> {
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let mut framed = Framed::new(stream, codec(max_frame_bytes));
    while let Some(body) = framed.next().await {
        let body = body.map_err(|e| format!("bad frame: {e}"))?;
        let frame = Frame::decode(body.freeze()).map_err(|e| e.to_string())?;
        let answer = match frame.header {
            ControlMessage::Join {
                rank,
                world_size,
                data_endpoint,
            } => {
                match coordinator
                    .send(Join {
                        rank,
                        world_size,
                        data_endpoint,
                    })
                    .await
                {
                    Ok(Ok(endpoints)) => ControlMessage::Roster { endpoints },
                    Ok(Err(reason)) => ControlMessage::Refused { reason },
                    Err(e) => ControlMessage::Refused {
                        reason: format!("coordinator unavailable: {e}"),
                    },
                }
            }
            ControlMessage::Barrier { rank, name } => match coordinator
                .send(Barrier {
                    rank,
                    name: name.clone(),
                })
                .await
            {
                Ok(Ok(())) => ControlMessage::Released { name },
                Ok(Err(reason)) => ControlMessage::Refused { reason },
                Err(e) => ControlMessage::Refused {
                    reason: format!("coordinator unavailable: {e}"),
                },
            },
            other => return Err(format!("unexpected message {other:?}")),
        };
        let encoded = Frame::control(answer).encode().map_err(|e| e.to_string())?;
        framed
            .send(encoded)
            .await
            .map_err(|e| format!("sending the answer: {e}"))?;
    }
    Ok(())
}
