//! Ring links between threads of one process: the simulated cluster's
//! transport. Sends never block (unbounded channels), receives wait up to
//! the collective timeout.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use anyhow::{bail, Result};

use super::transport::{MessageHeader, RingTransport};

type Message = (MessageHeader, Vec<u8>);

/// One rank's end of an in-memory ring.
pub struct MemoryTransport {
    rank: usize,
    world_size: usize,
    to_right: Sender<Message>,
    from_left: Receiver<Message>,
    sent: u64,
    received: u64,
    timeout: Duration,
}

/// Builds the links of a ring of `world_size` ranks; element `r` belongs to
/// rank `r`.
pub fn ring(world_size: usize, timeout: Duration) -> Vec<MemoryTransport> {
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..world_size).map(|_| channel::<Message>()).unzip();
    // Channel r carries messages *into* rank r, from its left neighbour.
    let mut receivers: Vec<Option<Receiver<Message>>> = receivers.into_iter().map(Some).collect();
    (0..world_size)
        .map(|rank| MemoryTransport {
            rank,
            world_size,
            to_right: senders[(rank + 1) % world_size].clone(),
            from_left: receivers[rank].take().expect("each receiver is taken once"),
            sent: 0,
            received: 0,
            timeout,
        })
        .collect()
}

impl RingTransport for MemoryTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    /// Copies at once: an in-memory send never waits.
    unsafe fn send_queued(&mut self, op: &str, bytes: &[u8]) -> Result<()> {
        let header = MessageHeader {
            seq: self.sent,
            len: bytes.len() as u64,
        };
        self.sent += 1;
        if self.to_right.send((header, bytes.to_vec())).is_err() {
            bail!(
                "{op}: rank {} has left the ring (its end of the link is closed)",
                self.right()
            );
        }
        Ok(())
    }

    fn recv(&mut self, op: &str, len: usize, on_recv: &mut dyn FnMut(usize, &[u8])) -> Result<()> {
        let expected = MessageHeader {
            seq: self.received,
            len: len as u64,
        };
        let (header, payload) = match self.from_left.recv_timeout(self.timeout) {
            Ok(message) => message,
            Err(RecvTimeoutError::Timeout) => bail!(
                "{op}: timed out after {:.1}s waiting for rank {} (rank {} of {})",
                self.timeout.as_secs_f64(),
                self.left(),
                self.rank,
                self.world_size
            ),
            Err(RecvTimeoutError::Disconnected) => {
                bail!("{op}: rank {} has left the ring", self.left())
            }
        };
        MessageHeader::check(&header.encode(), expected, op, self.left())?;
        self.received += 1;
        on_recv(0, &payload);
        Ok(())
    }
}
