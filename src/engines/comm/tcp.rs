//! Ring links over TCP between processes.
//!
//! Each rank opens one connection to its right neighbour (it only writes
//! there, from its send-queue thread) and accepts one from its left
//! neighbour (it only reads there, on the calling thread), so sending and
//! receiving-and-reducing always run at the same time.

use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use anyhow::Result;

use super::links::{connect_ring_links, link_error};
use super::send_queue::SendQueue;
use super::transport::{MessageHeader, RingTransport};
use super::RingPlace;
use super::{Abandoned, LinkBreak};
use crate::net::auth::Credentials;

/// Pieces handed to `on_recv`: big enough to keep syscalls rare, small
/// enough that reducing one piece overlaps receiving the next.
const RECV_PIECE_BYTES: usize = 2 * 1024 * 1024;

/// One rank's two TCP links.
pub struct TcpTransport {
    place: RingPlace,
    to_right: SendQueue,
    from_left: TcpStream,
    received: u64,
    timeout: Duration,
    /// Clones of the two sockets, for breaking the links from another thread.
    sockets: LinkBreak,
    /// Reused receive buffer; `f32` so pieces can be viewed as floats
    /// without copying.
    scratch: Vec<f32>,
}

impl TcpTransport {
    /// Joins the ring at `place`: connects to the right neighbour's endpoint
    /// and accepts the left neighbour on `listener` (this rank's own endpoint,
    /// bound before the rendezvous so that every peer can already connect).
    pub fn connect(
        place: RingPlace,
        endpoints: &[SocketAddr],
        listener: &TcpListener,
        timeout: Duration,
        credentials: &Credentials,
        abandoned: &Abandoned,
    ) -> Result<Self> {
        let (to_right, from_left, sockets) =
            connect_ring_links(&place, endpoints, listener, timeout, credentials, abandoned)?;
        let to_right = SendQueue::new(to_right, format!("ring-send-rank{}", place.rank()))?;
        Ok(Self {
            place,
            to_right,
            from_left,
            received: 0,
            timeout,
            sockets,
            scratch: vec![0.0; RECV_PIECE_BYTES / 4],
        })
    }

    fn link_error(&self, op: &str, peer: usize, e: io::Error) -> anyhow::Error {
        link_error(op, peer, &self.place, self.timeout, e)
    }
}

/// Reads the next header from the left link (to rank `left`) and checks it
/// is `expected`; a wrong one comes back as `InvalidData` carrying the reason.
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
        self.place.position()
    }

    fn link_break(&self) -> Option<LinkBreak> {
        Some(self.sockets.clone())
    }

    fn world_size(&self) -> usize {
        self.place.world_size()
    }

    unsafe fn send_queued(&mut self, op: &str, bytes: &[u8]) -> Result<()> {
        // SAFETY: the caller keeps `bytes` valid and unchanged until `flush`.
        unsafe { self.to_right.push(bytes) }.map_err(|e| self.link_error(op, self.right(), e))
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
        read_message(
            &self.from_left,
            &mut self.scratch,
            expected,
            op,
            self.place.rank_at(left),
            on_recv,
        )
        .map_err(|e| self.link_error(op, left, e))
    }

    fn recv_into(&mut self, op: &str, target: &mut [u8]) -> Result<()> {
        let expected = MessageHeader {
            seq: self.received,
            len: target.len() as u64,
        };
        self.received += 1;
        let left = self.left();
        read_header(&self.from_left, expected, op, self.place.rank_at(left))
            .and_then(|()| (&self.from_left).read_exact(target))
            .map_err(|e| self.link_error(op, left, e))
    }
}
