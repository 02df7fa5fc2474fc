//! A parameter-server shard's TCP endpoint: each connection's frames become shard calls and
//! the answers go back as frames. A malformed frame or one above the cap closes that
//! connection with a log line; the shard keeps serving the others.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use actix::Recipient;
use futures::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::Framed;

use super::auth::Credentials;
use super::frame::codec;
use super::listen::accept_authenticated;
use crate::ps::wire::{decode_request, encode_reply, ShardCall};

/// Accepts trainer connections until the actor system stops; `open` counts the connections
/// being served, so the shard can let the last answers go out before it exits. A connection
/// that fails the cluster-token handshake is dropped before any frame is read.
pub async fn serve_shard(
    listener: TcpListener,
    shard: Recipient<ShardCall>,
    max_frame_bytes: usize,
    open: Arc<AtomicUsize>,
    credentials: Credentials,
) {
    accept_authenticated(listener, credentials, "parameter-server", move |stream| {
        let (shard, open) = (shard.clone(), open.clone());
        async move {
            open.fetch_add(1, Ordering::SeqCst);
            let served = handle_connection(stream, shard, max_frame_bytes).await;
            open.fetch_sub(1, Ordering::SeqCst);
            served
        }
    })
    .await
}

async fn handle_connection(
    stream: TcpStream,
    shard: Recipient<ShardCall>,
    max_frame_bytes: usize,
) -> Result<(), String> {
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let mut framed = Framed::new(stream, codec(max_frame_bytes));
    while let Some(body) = framed.next().await {
        let body = body.map_err(|e| format!("bad frame: {e}"))?;
        let call = decode_request(body.freeze()).map_err(|e| e.to_string())?;
        let answer = match shard.send(call).await {
            Ok(answer) => answer,
            Err(e) => Err(anyhow::anyhow!("parameter server unavailable: {e}")),
        };
        let encoded = encode_reply(&answer).map_err(|e| e.to_string())?;
        framed
            .send(encoded)
            .await
            .map_err(|e| format!("sending the answer: {e}"))?;
    }
    Ok(())
}
