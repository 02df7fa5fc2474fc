//! The link between a rank and its two ring neighbours.

use anyhow::{bail, Result};

/// Every message on a ring link starts with this header, so a receiver that
/// fell out of step (a torn stream, a peer running another collective) gets
/// an error instead of misreading bytes as floats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageHeader {
    /// Messages sent on this link so far; both ends count.
    pub seq: u64,
    /// Payload bytes that follow.
    pub len: u64,
}

impl MessageHeader {
    /// Bytes on the wire.
    pub const SIZE: usize = 24;
    const MAGIC: u64 = u64::from_le_bytes(*b"FLOTRING");

    /// Encodes the header, little-endian.
    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut out = [0u8; Self::SIZE];
        out[..8].copy_from_slice(&Self::MAGIC.to_le_bytes());
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decodes a header and checks it is the one expected next; `peer` is
    /// the sender's rank, for errors.
    pub fn check(bytes: &[u8; Self::SIZE], expected: MessageHeader, op: &str, peer: usize) -> Result<()> {
        let word = |i: usize| u64::from_le_bytes(bytes[i * 8..(i + 1) * 8].try_into().unwrap_or_default());
        if word(0) != Self::MAGIC {
            bail!("{op}: corrupt message from rank {peer}: bad magic (stream torn or not a flotilla peer)");
        }
        let got = MessageHeader {
            seq: word(1),
            len: word(2),
        };
        if got != expected {
            bail!(
                "{op}: rank {peer} sent message #{} of {} bytes, expected #{} of {} bytes (ranks out of step)",
                got.seq,
                got.len,
                expected.seq,
                expected.len
            );
        }
        Ok(())
    }
}

/// Sends to the right neighbour and receives from the left one.
///
/// `op` names the collective in errors ("all-reduce of bucket 3", …), so a
/// timeout says what was stuck and on which peer.
pub trait RingTransport: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the ring.
    fn world_size(&self) -> usize;

    /// What breaks this link from another thread (none for a link that cannot hang).
    fn link_break(&self) -> Option<super::LinkBreak> {
        None
    }
    /// Queues one message for the right neighbour and may return before it
    /// is sent; messages leave in the order queued.
    ///
    /// # Safety
    /// `bytes` must stay valid and must not be written to until the next
    /// [`RingTransport::flush`] has returned.
    unsafe fn send_queued(&mut self, op: &str, bytes: &[u8]) -> Result<()>;
    /// Waits until every queued message has been sent.
    fn flush(&mut self, _op: &str) -> Result<()> {
        Ok(())
    }
    /// Sends one message to the right neighbour and waits until it is sent.
    fn send(&mut self, op: &str, bytes: &[u8]) -> Result<()> {
        // SAFETY: `bytes` is borrowed until the flush below has returned.
        unsafe { self.send_queued(op, bytes)? };
        self.flush(op)
    }
    /// Receives one message of exactly `len` bytes from the left neighbour,
    /// handing it to `on_recv(offset, piece)` piece by piece as it arrives.
    fn recv(&mut self, op: &str, len: usize, on_recv: &mut dyn FnMut(usize, &[u8])) -> Result<()>;
    /// Receives one message of exactly `target.len()` bytes straight into
    /// `target` (no staging copy where the transport allows it).
    fn recv_into(&mut self, op: &str, target: &mut [u8]) -> Result<()> {
        let len = target.len();
        self.recv(op, len, &mut |offset, piece| {
            target[offset..offset + piece.len()].copy_from_slice(piece)
        })
    }
    /// Sends and receives at the same time: the send is queued, the
    /// message from the left is received, then the send is waited for.
    fn exchange(
        &mut self,
        op: &str,
        send: &[u8],
        recv_len: usize,
        on_recv: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        // SAFETY: `send` is borrowed for this whole call, which flushes
        // before it returns, on every path.
        unsafe { self.send_queued(op, send)? };
        let received = self.recv(op, recv_len, on_recv);
        let flushed = self.flush(op);
        received.and(flushed)
    }
    /// The left neighbour's rank.
    fn left(&self) -> usize {
        (self.rank() + self.world_size() - 1) % self.world_size()
    }
    /// The right neighbour's rank.
    fn right(&self) -> usize {
        (self.rank() + 1) % self.world_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_mismatch() {
        let h = MessageHeader { seq: 3, len: 12 };
        assert!(MessageHeader::check(&h.encode(), h, "op", 1).is_ok());
        let err = MessageHeader::check(&h.encode(), MessageHeader { seq: 4, len: 12 }, "all-reduce", 2).unwrap_err();
        assert!(err.to_string().contains("rank 2"), "{err}");
        let mut bad = h.encode();
        bad[0] ^= 1;
        assert!(MessageHeader::check(&bad, h, "op", 1)
            .unwrap_err()
            .to_string()
            .contains("magic"));
    }
}
