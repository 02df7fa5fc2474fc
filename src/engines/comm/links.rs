//! The TCP connections between ring neighbours, shared by the transports:
//! each rank connects to its right neighbour and accepts its left one,
//! checking a hello that names the connecting rank.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::net::auth::{self, Credentials};

const HELLO_MAGIC: &[u8; 8] = b"FLOTHELO";

/// Connects `rank` to its right neighbour and accepts its left one, within
/// `timeout`, each connection opened by the cluster-token handshake; returns
/// `(to_right, from_left)`, with no-delay and the timeout set on both.
pub(super) fn connect_ring_links(
    rank: usize,
    endpoints: &[SocketAddr],
    listener: &TcpListener,
    timeout: Duration,
    credentials: &Credentials,
) -> Result<(TcpStream, TcpStream)> {
    let world_size = endpoints.len();
    anyhow::ensure!(
        world_size >= 2,
        "a ring between processes needs two ranks or more, got {world_size}"
    );
    let right = (rank + 1) % world_size;
    let left = (rank + world_size - 1) % world_size;
    let deadline = Instant::now() + timeout;
    let (to_right, from_left) = thread::scope(|s| {
        let accepting = s.spawn(|| accept_left(listener, rank, left, deadline, credentials));
        let connected = connect_right(endpoints[right], rank, world_size, right, deadline, credentials);
        let accepted = accepting
            .join()
            .map_err(|_| anyhow::anyhow!("ring accept thread panicked"))?;
        Ok::<_, anyhow::Error>((connected?, accepted?))
    })?;
    for stream in [&to_right, &from_left] {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
    }
    Ok((to_right, from_left))
}

/// An I/O error on a ring link as an error naming the operation and peer.
pub(super) fn link_error(
    op: &str,
    peer: usize,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    e: io::Error,
) -> anyhow::Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => anyhow::anyhow!(
            "{op}: timed out after {:.1}s waiting for rank {peer} (rank {} of {})",
            timeout.as_secs_f64(),
            rank,
            world_size
        ),
        io::ErrorKind::InvalidData => anyhow::anyhow!("{e}"),
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
            anyhow::anyhow!("{op}: rank {peer} closed its ring link ({e})")
        }
        _ => anyhow::anyhow!("{op}: ring link to rank {peer}: {e}"),
    }
}

/// A handshake read that timed out surfaces as "Resource temporarily unavailable (os error
/// 11)"; say that the peer did not answer in time instead.
fn handshake_error(e: anyhow::Error) -> anyhow::Error {
    let timed_out = e
        .root_cause()
        .downcast_ref::<io::Error>()
        .is_some_and(|io| matches!(io.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut));
    if timed_out {
        anyhow::anyhow!("{e}: no answer within the handshake timeout (fault_tolerance.timeout_s, at most 10 s)")
    } else {
        e
    }
}

fn connect_right(
    addr: SocketAddr,
    rank: usize,
    world_size: usize,
    right: usize,
    deadline: Instant,
    credentials: &Credentials,
) -> Result<TcpStream> {
    let mut last_error = None;
    while Instant::now() < deadline {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(mut stream) => {
                auth::connect_sync(&mut stream, credentials)
                    .map_err(handshake_error)
                    .with_context(|| format!("rank {rank}: handshake with rank {right} at {addr}"))?;
                let mut hello = HELLO_MAGIC.to_vec();
                hello.extend_from_slice(&(rank as u64).to_le_bytes());
                hello.extend_from_slice(&(world_size as u64).to_le_bytes());
                stream
                    .write_all(&hello)
                    .with_context(|| format!("sending ring hello to rank {right} at {addr}"))?;
                return Ok(stream);
            }
            Err(e) => last_error = Some(e),
        }
        thread::sleep(Duration::from_millis(20));
    }
    bail!(
        "could not connect to rank {right} at {addr} before the timeout: {}",
        last_error.map_or_else(|| "no attempt finished".to_string(), |e| e.to_string())
    )
}

fn accept_left(
    listener: &TcpListener,
    rank: usize,
    left: usize,
    deadline: Instant,
    credentials: &Credentials,
) -> Result<TcpStream> {
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    loop {
        match listener.accept() {
            Ok((mut stream, peer)) => {
                stream.set_nonblocking(false)?;
                if let Err(e) = auth::accept_sync(&mut stream, credentials) {
                    tracing::warn!(%peer, "dropped a connection to ring endpoint {local} before any frame: {e:#}");
                    continue;
                }
                stream.set_read_timeout(Some(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(100)),
                ))?;
                let mut hello = [0u8; 24];
                if stream.read_exact(&mut hello).is_err() || &hello[..8] != HELLO_MAGIC {
                    tracing::warn!(%peer, "dropped a connection to ring endpoint {local} that sent no ring hello");
                    continue;
                }
                let from = u64::from_le_bytes(hello[8..16].try_into()?) as usize;
                if from != left {
                    bail!("rank {rank}: rank {from} connected from {peer}, but the left neighbour is rank {left}");
                }
                return Ok(stream);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    bail!("rank {rank}: rank {left} never connected to {local} before the timeout");
                }
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e).with_context(|| format!("accepting on ring endpoint {local}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::auth::ClusterToken;

    #[test]
    fn a_peer_silent_in_the_handshake_is_a_timeout_not_an_os_error() -> Result<()> {
        // Connections queue in the backlog of a listener that never accepts: nobody answers.
        let silent = TcpListener::bind("127.0.0.1:0")?;
        let credentials = Credentials::new(
            ClusterToken::new("a token of sixteen characters")?,
            Duration::from_millis(200),
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        let err = connect_right(silent.local_addr()?, 0, 2, 1, deadline, &credentials).unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("handshake with rank 1"), "{text}");
        assert!(text.contains("no answer within the handshake timeout"), "{text}");
        assert!(!text.contains("os error"), "{text}");
        Ok(())
    }
}
