//! Ring links over TCP between processes.
//!
//! Each rank opens one connection to its right neighbour (it only writes
//! there, from its send-queue thread) and accepts one from its left
//! neighbour (it only reads there, on the calling thread), so sending and
//! receiving-and-reducing always run at the same time.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::send_queue::SendQueue;
use super::transport::{MessageHeader, RingTransport};

/// Pieces handed to `on_recv`: big enough to keep syscalls rare, small
/// enough that reducing one piece overlaps receiving the next.
const RECV_PIECE_BYTES: usize = 2 * 1024 * 1024;
const HELLO_MAGIC: &[u8; 8] = b"FLOTHELO";

/// One rank's two TCP links.
pub struct TcpTransport {
    rank: usize,
    world_size: usize,
    to_right: SendQueue,
    from_left: TcpStream,
    sent: u64,
    received: u64,
    timeout: Duration,
    /// Reused receive buffer; `f32` so pieces can be viewed as floats
    /// without copying.
    scratch: Vec<f32>,
}

impl TcpTransport {
    /// Joins the ring: connects to the right neighbour's endpoint and accepts
    /// the left neighbour on `listener` (this rank's own endpoint, bound
    /// before the rendezvous so that every peer can already connect).
    pub fn connect(rank: usize, endpoints: &[SocketAddr], listener: &TcpListener, timeout: Duration) -> Result<Self> {
        let world_size = endpoints.len();
        anyhow::ensure!(world_size >= 2, "a TCP ring needs two ranks or more, got {world_size}");
        let right = (rank + 1) % world_size;
        let left = (rank + world_size - 1) % world_size;
        let deadline = Instant::now() + timeout;
        let (to_right, from_left) = thread::scope(|s| {
            let accepting = s.spawn(|| accept_left(listener, rank, left, deadline));
            let connected = connect_right(endpoints[right], rank, world_size, right, deadline);
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
        Ok(Self {
            rank,
            world_size,
            to_right: SendQueue::new(to_right, format!("ring-send-rank{rank}"))?,
            from_left,
            sent: 0,
            received: 0,
            timeout,
            scratch: vec![0.0; RECV_PIECE_BYTES / 4],
        })
    }

    fn link_error(&self, op: &str, peer: usize, e: io::Error) -> anyhow::Error {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => anyhow::anyhow!(
                "{op}: timed out after {:.1}s waiting for rank {peer} (rank {} of {})",
                self.timeout.as_secs_f64(),
                self.rank,
                self.world_size
            ),
            io::ErrorKind::InvalidData => anyhow::anyhow!("{e}"),
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
                anyhow::anyhow!("{op}: rank {peer} closed its ring link ({e})")
            }
            _ => anyhow::anyhow!("{op}: ring link to rank {peer}: {e}"),
        }
    }
}

fn connect_right(
    addr: SocketAddr,
    rank: usize,
    world_size: usize,
    right: usize,
    deadline: Instant,
) -> Result<TcpStream> {
    let mut last_error = None;
    while Instant::now() < deadline {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(mut stream) => {
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

fn accept_left(listener: &TcpListener, rank: usize, left: usize, deadline: Instant) -> Result<TcpStream> {
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    loop {
        match listener.accept() {
            Ok((mut stream, peer)) => {
                stream.set_nonblocking(false)?;
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

/// Reads the next header from the left link and checks it is `expected`;
/// a wrong one comes back as `InvalidData` carrying the reason.
fn read_header(from_left: &TcpStream, expected: MessageHeader, op: &str, left: usize) -> io::Result<()> {
    let mut header = [0u8; MessageHeader::SIZE];
    (&*from_left).read_exact(&mut header)?;
    MessageHeader::check(&header, expected, op, left)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
}

/// Reads one message from the left link into `scratch`, piece by piece.
fn read_message(
    from_left: &TcpStream,
    scratch: &mut [f32],
    expected: MessageHeader,
    op: &str,
    left: usize,
    on_recv: &mut dyn FnMut(usize, &[u8]),
) -> io::Result<()> {
    read_header(from_left, expected, op, left)?;
    let len = expected.len as usize;
    let mut offset = 0;
    while offset < len {
        let piece = (len - offset).min(RECV_PIECE_BYTES);
        let buf = &mut bytemuck::cast_slice_mut::<f32, u8>(scratch)[..piece];
        (&*from_left).read_exact(buf)?;
        on_recv(offset, buf);
        offset += piece;
    }
    Ok(())
}

impl RingTransport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn send(&mut self, op: &str, bytes: &[u8]) -> Result<()> {
        // SAFETY: `bytes` outlives the flush below, which waits for the write.
        unsafe { self.send_queued(op, bytes)? };
        self.flush(op)
    }

    unsafe fn send_queued(&mut self, op: &str, bytes: &[u8]) -> Result<()> {
        let header = MessageHeader {
            seq: self.sent,
            len: bytes.len() as u64,
        };
        self.sent += 1;
        // SAFETY: the caller keeps `bytes` valid and unchanged until `flush`.
        unsafe { self.to_right.push(header, bytes) }.map_err(|e| self.link_error(op, self.right(), e))
    }

    fn flush(&mut self, op: &str) -> Result<()> {
        self.to_right
            .wait_all()
            .map_err(|e| self.link_error(op, self.right(), e))
    }

    fn recv(&mut self, op: &str, len: usize, on_recv: &mut dyn FnMut(usize, &[u8])) -> Result<()> {
        let expected = MessageHeader {
            seq: self.received,
            len: len as u64,
        };
        self.received += 1;
        let left = self.left();
        read_message(&self.from_left, &mut self.scratch, expected, op, left, on_recv)
            .map_err(|e| self.link_error(op, left, e))
    }

    fn recv_into(&mut self, op: &str, target: &mut [u8]) -> Result<()> {
        let expected = MessageHeader {
            seq: self.received,
            len: target.len() as u64,
        };
        self.received += 1;
        let left = self.left();
        read_header(&self.from_left, expected, op, left)
            .and_then(|()| (&self.from_left).read_exact(target))
            .map_err(|e| self.link_error(op, left, e))
    }
}
