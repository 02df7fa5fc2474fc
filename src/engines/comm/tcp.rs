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

/// A rank's TCP connections to its two ring neighbours, just made: what a
/// transport's data path is set up over.
pub struct ConnectedLinks {
    pub(super) place: RingPlace,
    pub(super) to_right: TcpStream,
    pub(super) from_left: TcpStream,
    pub(super) timeout: Duration,
    /// Clones of the two sockets, for breaking the links from another thread.
    pub(super) sockets: LinkBreak,
}

impl ConnectedLinks {
    /// The links of `place` that `connect_ring_links` made within `timeout`.
    pub(super) fn new(
        place: RingPlace,
        (to_right, from_left, sockets): (TcpStream, TcpStream, LinkBreak),
        timeout: Duration,
    ) -> Self {
        Self {
            place,
            to_right,
            from_left,
            timeout,
            sockets,
        }
    }
}

/// How a [`ProcessTransport`] receives from its left neighbour.
pub trait ReceiveLeft: Send + Sized {
    /// Sets up both links' data paths over `links`.
    fn open(links: ConnectedLinks) -> Result<ProcessTransport<Self>>;

    /// Receives the `incoming` message, handing it to `on_recv(offset, piece)`
    /// piece by piece as it arrives.
    fn recv(&mut self, incoming: &Incoming, on_recv: &mut dyn FnMut(usize, &[u8])) -> Result<()>;

    /// Receives the `incoming` message into `target`.
    fn recv_into(&mut self, incoming: &Incoming, target: &mut [u8]) -> Result<()> {
        self.recv(incoming, &mut |offset, piece| {
            target[offset..offset + piece.len()].copy_from_slice(piece)
        })
    }
}

/// The message a receive expects from the left neighbour, and what its errors name.
pub struct Incoming<'a> {
    /// The header it must carry.
    pub(super) header: MessageHeader,
    /// The collective receiving it.
    pub(super) op: &'a str,
    place: &'a RingPlace,
    timeout: Duration,
}

impl Incoming<'_> {
    /// The left neighbour's global rank.
    pub(super) fn left_rank(&self) -> usize {
        self.place.rank_at(self.place.left())
    }

    /// An I/O error on the link from the left neighbour.
    pub(super) fn error(&self, e: io::Error) -> anyhow::Error {
        link_error(self.op, self.place.left(), self.place, self.timeout, e)
    }
}

/// One rank's two links to its ring neighbours in other processes: a
/// send-queue thread writes to the right one while `Left` receives from the
/// left one, over TCP ([`TcpTransport`]) or shared memory
/// ([`super::shm::ShmTransport`]).
pub struct ProcessTransport<Left> {
    place: RingPlace,
    to_right: SendQueue,
    from_left: Left,
    /// Messages received so far: the next one's sequence number.
    received: u64,
    timeout: Duration,
    /// Clones of the two sockets, for breaking the links from another thread.
    sockets: LinkBreak,
}

/// One rank's two TCP links.
pub type TcpTransport = ProcessTransport<TcpLeft>;

impl<Left: ReceiveLeft> ProcessTransport<Left> {
    /// Joins the ring at `place`: connects to the right neighbour's endpoint
    /// and accepts the left neighbour on `listener` (this rank's own endpoint,
    /// bound before the rendezvous so that every peer can already connect),
    /// then sets up `Left`'s data path over the links.
    pub fn connect(
        place: RingPlace,
        endpoints: &[SocketAddr],
        listener: &TcpListener,
        timeout: Duration,
        credentials: &Credentials,
        abandoned: &Abandoned,
    ) -> Result<Self> {
        let streams = connect_ring_links(&place, endpoints, listener, timeout, credentials, abandoned)?;
        Left::open(ConnectedLinks::new(place, streams, timeout))
    }
}

impl<Left> ProcessTransport<Left> {
    /// The transport of `place`, whose links were connected within `timeout`
    /// (and are broken through `sockets`), sending through `to_right`.
    pub(super) fn new(
        place: RingPlace,
        to_right: SendQueue,
        from_left: Left,
        timeout: Duration,
        sockets: LinkBreak,
    ) -> Self {
        Self {
            place,
            to_right,
            from_left,
            received: 0,
            timeout,
            sockets,
        }
    }

    fn link_error(&self, op: &str, peer: usize, e: io::Error) -> anyhow::Error {
        link_error(op, peer, &self.place, self.timeout, e)
    }

    /// The receiving half, and the next message it is to receive: `len` bytes for `op`.
    fn next_incoming<'a>(&'a mut self, op: &'a str, len: usize) -> (&'a mut Left, Incoming<'a>) {
        let header = MessageHeader {
            seq: self.received,
            len: len as u64,
        };
        self.received += 1;
        let incoming = Incoming {
            header,
            op,
            place: &self.place,
            timeout: self.timeout,
        };
        (&mut self.from_left, incoming)
    }
}

impl<Left: ReceiveLeft> RingTransport for ProcessTransport<Left> {
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
        let (from_left, incoming) = self.next_incoming(op, len);
        from_left.recv(&incoming, on_recv)
    }

    fn recv_into(&mut self, op: &str, target: &mut [u8]) -> Result<()> {
        let (from_left, incoming) = self.next_incoming(op, target.len());
        from_left.recv_into(&incoming, target)
    }
}

/// The receiving half of a TCP link: messages read from the socket itself.
pub struct TcpLeft {
    from_left: TcpStream,
    /// Reused receive buffer; `f32` so pieces can be viewed as floats
    /// without copying.
    scratch: Vec<f32>,
}

impl TcpLeft {
    /// Reads the next header from the left link and checks it is the one
    /// `incoming` expects; a wrong one comes back as `InvalidData` carrying
    /// the reason.
    fn read_header(&self, incoming: &Incoming) -> io::Result<()> {
        let mut header = [0u8; MessageHeader::SIZE];
        (&self.from_left).read_exact(&mut header)?;
        MessageHeader::check(&header, incoming.header, incoming.op, incoming.left_rank())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
    }

    /// Reads one message from the left link into `scratch`, piece by piece.
    fn read_message(&mut self, incoming: &Incoming, on_recv: &mut dyn FnMut(usize, &[u8])) -> io::Result<()> {
        self.read_header(incoming)?;
        let len = incoming.header.len as usize;
        let mut offset = 0;
        while offset < len {
            let piece = (len - offset).min(RECV_PIECE_BYTES);
            let buf = &mut bytemuck::cast_slice_mut::<f32, u8>(&mut self.scratch)[..piece];
            (&self.from_left).read_exact(buf)?;
            on_recv(offset, buf);
            offset += piece;
        }
        Ok(())
    }
}

impl ReceiveLeft for TcpLeft {
    fn open(links: ConnectedLinks) -> Result<TcpTransport> {
        let name = format!("ring-send-rank{}", links.place.rank());
        let to_right = SendQueue::new(links.to_right, name)?;
        let from_left = TcpLeft {
            from_left: links.from_left,
            scratch: vec![0.0; RECV_PIECE_BYTES / 4],
        };
        Ok(ProcessTransport::new(
            links.place,
            to_right,
            from_left,
            links.timeout,
            links.sockets,
        ))
    }

    fn recv(&mut self, incoming: &Incoming, on_recv: &mut dyn FnMut(usize, &[u8])) -> Result<()> {
        self.read_message(incoming, on_recv).map_err(|e| incoming.error(e))
    }

    fn recv_into(&mut self, incoming: &Incoming, target: &mut [u8]) -> Result<()> {
        self.read_header(incoming)
            .and_then(|()| (&self.from_left).read_exact(target))
            .map_err(|e| incoming.error(e))
    }
}
