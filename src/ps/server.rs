//! A parameter-server shard's TCP endpoint: each connection's frames become shard calls and
//! the answers go back as frames. A malformed frame or one above the cap closes that
//! connection with a log line; the shard keeps serving the others.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use actix::Recipient;
use tokio::io::{BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};

use super::wire::{read_request, write_reply, ShardCall};
use crate::net::auth::Credentials;
use crate::net::listen::accept_authenticated;

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

/// Requests of one connection read ahead while earlier ones are served: a large update or
/// pull arrives as several parts, and the shard works on one while the line carries the next.
const READ_AHEAD: usize = 16;

/// Reads requests and hands them to the shard in order while a second half writes the answers
/// back in the same order, so reading, the shard's work and writing overlap.
async fn handle_connection(
    stream: TcpStream,
    shard: Recipient<ShardCall>,
    max_frame_bytes: usize,
) -> Result<(), String> {
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let (input, output) = stream.into_split();
    let (mut input, mut output) = (BufReader::new(input), BufWriter::new(output));
    let (answers, mut pending) = tokio::sync::mpsc::channel(READ_AHEAD);
    let read = async move {
        while let Some(call) = read_request(&mut input, max_frame_bytes)
            .await
            .map_err(|e| format!("bad frame: {e}"))?
        {
            // The actor's mailbox takes the call now, so calls reach the shard in order.
            if answers.send(shard.send(call)).await.is_err() {
                break; // the writing half failed and reported why
            }
        }
        Ok::<_, String>(())
    };
    let write = async move {
        while let Some(answer) = pending.recv().await {
            let answer = match answer.await {
                Ok(answer) => answer,
                Err(e) => Err(anyhow::anyhow!("parameter server unavailable: {e}")),
            };
            write_reply(&mut output, &answer, max_frame_bytes)
                .await
                .map_err(|e| format!("sending the answer: {e}"))?;
        }
        Ok::<_, String>(())
    };
    let (read, write) = futures::join!(read, write);
    read.and(write)
}
