//! The TCP connections between ring neighbours, shared by the transports:
//! each rank connects to its right neighbour and accepts its left one,
//! checking a hello that names the connecting ring position. Errors name
//! global ranks, which on a pipeline's sub-rings are not the positions.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::{Abandoned, LinkBreak, RingPlace};
use crate::net::auth::{self, Credentials};

const HELLO_MAGIC: &[u8; 8] = b"FLOTHELO";

/// Connects the member at `place` to its right neighbour and accepts its left
/// one (`endpoints` by position), within `timeout`, each connection opened by
/// the cluster-token handshake; returns `(to_right, from_left)`, with no-delay
/// and the timeout set on both, and clones of both for breaking them.
pub(super) fn connect_ring_links(
    place: &RingPlace,
    endpoints: &[SocketAddr],
    listener: &TcpListener,
    timeout: Duration,
    credentials: &Credentials,
    abandoned: &Abandoned,
) -> Result<(TcpStream, TcpStream, LinkBreak)> {
    let world_size = place.world_size();
    anyhow::ensure!(
        world_size >= 2,
        "a ring between processes needs two ranks or more, got {world_size}"
    );
    anyhow::ensure!(
        endpoints.len() == world_size,
        "{place}: the ring has {world_size} members but {} endpoints",
        endpoints.len()
    );
    let deadline = Instant::now() + timeout;
    let (to_right, from_left) = thread::scope(|s| {
        let accepting = s.spawn(|| accept_left(listener, place, deadline, credentials, abandoned));
        let connected = connect_right(endpoints[place.right()], place, deadline, credentials, abandoned);
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
    let sockets = LinkBreak::of(&to_right, &from_left)?;
    Ok((to_right, from_left, sockets))
}

/// An I/O error on the link to the neighbour at position `peer` as an error naming the
/// operation and the neighbour's rank.
pub(super) fn link_error(op: &str, peer: usize, place: &RingPlace, timeout: Duration, e: io::Error) -> anyhow::Error {
    let peer = place.rank_at(peer);
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => anyhow::anyhow!(
            "{op}: timed out after {:.1}s waiting for rank {peer} ({place})",
            timeout.as_secs_f64()
        ),
        io::ErrorKind::InvalidData => anyhow::anyhow!("{e}"),
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
            anyhow::anyhow!("{op}: rank {peer} closed its ring link ({e})")
        }
        _ => anyhow::anyhow!("{op}: ring link to rank {peer}: {e}"),
    }
}

fn connect_right(
    addr: SocketAddr,
    place: &RingPlace,
    deadline: Instant,
    credentials: &Credentials,
    abandoned: &Abandoned,
) -> Result<TcpStream> {
    let (rank, right) = (place.rank(), place.rank_at(place.right()));
    let mut last_error = None;
    while Instant::now() < deadline {
        if abandoned.is_given_up() {
            bail!("rank {rank}: stopped connecting to rank {right} at {addr}: {GIVEN_UP}");
        }
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(mut stream) => match introduce(&mut stream, place, credentials) {
                Ok(()) => return Ok(stream),
                // A peer that proves a different token will not change its mind.
                Err(e) if e.root_cause().downcast_ref::<io::Error>().is_none() => {
                    return Err(e).with_context(|| format!("rank {rank}: handshake with rank {right} at {addr}"))
                }
                // A connection the neighbour closed or left unanswered (its endpoint busy with
                // strangers, or not listening yet) is tried again.
                Err(e) => last_error = Some(format!("{e:#}")),
            },
            Err(e) => last_error = Some(e.to_string()),
        }
        thread::sleep(Duration::from_millis(20));
    }
    bail!(
        "rank {rank}: could not connect to rank {right} at {addr} before the timeout: {}",
        last_error.unwrap_or_else(|| "no attempt finished".to_string())
    )
}

/// The connecting side of one connection: the cluster-token handshake, then the ring hello
/// naming this member's position.
fn introduce(stream: &mut TcpStream, place: &RingPlace, credentials: &Credentials) -> Result<()> {
    auth::connect_sync(stream, credentials)?;
    let mut hello = HELLO_MAGIC.to_vec();
    hello.extend_from_slice(&(place.position() as u64).to_le_bytes());
    hello.extend_from_slice(&(place.world_size() as u64).to_le_bytes());
    stream.write_all(&hello).context("sending the ring hello")
}

/// Why a ring's connecting stopped before its deadline.
const GIVEN_UP: &str = "the coordinator ordered a rollback while the ring connected";

/// Handshakes running at once on one ring endpoint; a connection beyond them is closed at once.
/// Honest peers are one left neighbour (and its retries), so only a flood of strangers meets
/// the bound, and the neighbour then retries until the deadline.
const MAX_PENDING_HANDSHAKES: usize = 64;

/// An accepted connection that passed the handshake and sent its ring hello.
struct Greeted {
    stream: TcpStream,
    peer: SocketAddr,
    /// The ring position the hello names.
    from: usize,
}

fn accept_left(
    listener: &TcpListener,
    place: &RingPlace,
    deadline: Instant,
    credentials: &Credentials,
    abandoned: &Abandoned,
) -> Result<TcpStream> {
    let (rank, left) = (place.rank(), place.left());
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    // Each connection's handshake runs on a thread of its own, so a silent or slow stranger
    // costs the real neighbour nothing; the threads end by themselves within the handshake's
    // deadline.
    let (greeted, greetings) = mpsc::channel::<Greeted>();
    let pending = Arc::new(AtomicUsize::new(0));
    loop {
        if let Ok(Greeted { stream, peer, from }) = greetings.try_recv() {
            if from != left {
                bail!(
                    "rank {rank}: rank {} connected from {peer}, but the left neighbour is rank {}",
                    place.rank_at(from),
                    place.rank_at(left)
                );
            }
            return Ok(stream);
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                if pending.load(Ordering::Acquire) >= MAX_PENDING_HANDSHAKES {
                    tracing::warn!(%peer, "closed a connection to ring endpoint {local}: {MAX_PENDING_HANDSHAKES} handshakes are already pending");
                    continue;
                }
                pending.fetch_add(1, Ordering::AcqRel);
                let (greeted, pending, credentials) = (greeted.clone(), pending.clone(), credentials.clone());
                thread::Builder::new()
                    .name(format!("ring-accept-rank{rank}"))
                    .spawn(move || {
                        match greet(stream, deadline, &credentials) {
                            Ok((stream, from)) => {
                                let _ = greeted.send(Greeted { stream, peer, from });
                            }
                            Err(e) => tracing::warn!(%peer, "dropped a connection to ring endpoint {local}: {e:#}"),
                        }
                        pending.fetch_sub(1, Ordering::AcqRel);
                    })
                    .context("starting a ring handshake thread")?;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if abandoned.is_given_up() {
                    bail!(
                        "rank {rank}: stopped waiting for rank {} on {local}: {GIVEN_UP}",
                        place.rank_at(left)
                    );
                }
                if Instant::now() >= deadline {
                    bail!(
                        "rank {rank}: rank {} never connected to {local} before the timeout",
                        place.rank_at(left)
                    );
                }
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e).with_context(|| format!("accepting on ring endpoint {local}")),
        }
    }
}

/// The accepting side of one connection: the cluster-token handshake, then the ring hello;
/// returns the stream and the ring position it names.
fn greet(mut stream: TcpStream, deadline: Instant, credentials: &Credentials) -> Result<(TcpStream, usize)> {
    stream.set_nonblocking(false)?;
    auth::accept_sync(&mut stream, credentials).context("before any frame")?;
    stream.set_read_timeout(Some(
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(100)),
    ))?;
    let mut hello = [0u8; 24];
    stream.read_exact(&mut hello).context("no ring hello")?;
    anyhow::ensure!(&hello[..8] == HELLO_MAGIC, "not a ring hello");
    let from = u64::from_le_bytes(hello[8..16].try_into()?) as usize;
    Ok((stream, from))
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
        let deadline = Instant::now() + Duration::from_secs(2);
        let place = RingPlace::identity(0, 2);
        let err = connect_right(
            silent.local_addr()?,
            &place,
            deadline,
            &credentials,
            &Abandoned::never(),
        )
        .unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("could not connect to rank 1"), "{text}");
        assert!(text.contains("the peer sent nothing for 0.2s"), "{text}");
        assert!(!text.contains("os error"), "{text}");
        Ok(())
    }

    #[test]
    fn a_rollback_order_while_the_ring_connects_stops_the_connecting_at_once() -> Result<()> {
        // Rank 1 never comes: without the order, both sides would wait out the 60-s timeout.
        let (listener, absent) = (TcpListener::bind("127.0.0.1:0")?, TcpListener::bind("127.0.0.1:0")?);
        let endpoints = [listener.local_addr()?, absent.local_addr()?];
        drop(absent);
        let credentials = Credentials::new(
            ClusterToken::new("a token of sixteen characters")?,
            Duration::from_secs(1),
        );
        let breaker = crate::engines::comm::RingBreaker::default();
        let abandoned = breaker.abandons(1);
        let started = Instant::now();
        let ordering = thread::spawn(move || {
            thread::sleep(Duration::from_millis(200));
            breaker.break_for(2);
        });
        let place = RingPlace::identity(0, 2);
        let timeout = Duration::from_secs(60);
        let Err(err) = connect_ring_links(&place, &endpoints, &listener, timeout, &credentials, &abandoned) else {
            panic!("connected to an absent rank");
        };
        ordering.join().expect("the ordering thread");
        let text = format!("{err:#}");
        assert!(text.contains(GIVEN_UP), "{text}");
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
        Ok(())
    }
}
