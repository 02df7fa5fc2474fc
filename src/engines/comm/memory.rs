//! Ring links between threads of one process: the simulated cluster's
//! transport. Sends never block (unbounded channels), receives wait up to
//! the collective timeout. A link can be broken from another thread (a
//! rollback order), and the rings of a simulated cluster can carry faults: one
//! link that delays its messages, or loses one and breaks.

use std::collections::BTreeMap;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};

use super::transport::{MessageHeader, RingTransport};
use super::LinkBreak;

type Message = (MessageHeader, Vec<u8>);

/// What arrives on a link: a message, or word that the link broke, and why.
type Delivery = Result<Message, String>;

/// Where a rank's link from its left neighbour can be told it broke.
#[derive(Clone)]
pub struct Inbox(Sender<Delivery>);

impl Inbox {
    /// The rank's next receive on this link fails with `reason`.
    pub fn break_link(&self, reason: &str) {
        let _ = self.0.send(Err(reason.to_string()));
    }
}

/// A fault on one rank's link to its right neighbour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkFault {
    /// Every message waits this long before it is handed over.
    Delay(Duration),
    /// Message number `message` (counted from 0 on this link) is lost, and the link breaks with
    /// it, as a reset connection does.
    Drop {
        /// The lost message's number.
        message: u64,
    },
}

/// One rank's end of an in-memory ring.
pub struct MemoryTransport {
    rank: usize,
    world_size: usize,
    to_right: Sender<Delivery>,
    from_left: Receiver<Delivery>,
    /// This rank's own inbox, kept only on rings a rollback order can break: held here, it
    /// keeps the link open after the left neighbour's end is dropped.
    breakable: Option<Inbox>,
    fault: Option<LinkFault>,
    /// Why the link broke, once it has: like a shut-down socket, it fails every operation
    /// after, so no collective queued behind the one that saw the break waits out the timeout.
    broken: Option<String>,
    sent: u64,
    received: u64,
    timeout: Duration,
}

/// Builds the links of a ring of `world_size` ranks; element `r` belongs to
/// rank `r`.
pub fn ring(world_size: usize, timeout: Duration) -> Vec<MemoryTransport> {
    build_ring(world_size, timeout, false)
}

/// A ring whose ends are `breakable` from another thread, or not.
fn build_ring(world_size: usize, timeout: Duration, breakable: bool) -> Vec<MemoryTransport> {
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..world_size).map(|_| channel::<Delivery>()).unzip();
    // Channel r carries messages *into* rank r, from its left neighbour.
    let mut receivers: Vec<Option<Receiver<Delivery>>> = receivers.into_iter().map(Some).collect();
    (0..world_size)
        .map(|rank| MemoryTransport {
            rank,
            world_size,
            to_right: senders[(rank + 1) % world_size].clone(),
            from_left: receivers[rank].take().expect("each receiver is taken once"),
            breakable: breakable.then(|| Inbox(senders[rank].clone())),
            fault: None,
            broken: None,
            sent: 0,
            received: 0,
            timeout,
        })
        .collect()
}

/// A ring's ends by position, each handed out once.
type RingEnds = Vec<Option<MemoryTransport>>;

/// The rings of a simulated cluster that recovers in place: each generation has its own,
/// named by what they join (the ranks, a replica's stages, a stage's replicas), each made when
/// its first member asks for its end, every end breakable. The faults ride on generation 0's
/// rings only, so that they strike once and the rolled-back job runs clean.
pub struct MemoryRings {
    timeout: Duration,
    /// Faults by ring and by the position whose link to its right neighbour carries them.
    faults: Vec<(String, usize, LinkFault)>,
    /// The ends not handed out yet, by generation and ring.
    rings: Mutex<BTreeMap<(u64, String), RingEnds>>,
}

impl MemoryRings {
    /// Rings whose receives wait at most `timeout`, with `faults` — `(ring, position, fault)` —
    /// on the first generation's.
    pub fn new(timeout: Duration, faults: Vec<(String, usize, LinkFault)>) -> Self {
        Self {
            timeout,
            faults,
            rings: Mutex::new(BTreeMap::new()),
        }
    }

    /// The end at `position` of generation `generation`'s ring `ring` of `size` members. Older
    /// generations' rings are dropped: their members have all moved on or died.
    pub fn take(&self, generation: u64, ring: &str, size: usize, position: usize) -> Result<MemoryTransport> {
        let mut rings = self.rings.lock().unwrap_or_else(PoisonError::into_inner);
        rings.retain(|(g, _), _| *g >= generation);
        let newer = rings.keys().any(|(g, _)| *g > generation);
        let end = (!newer)
            .then(|| {
                rings
                    .entry((generation, ring.to_string()))
                    .or_insert_with(|| {
                        build_ring(size, self.timeout, true)
                            .into_iter()
                            .map(|mut end| {
                                end.fault = self
                                    .faults
                                    .iter()
                                    .find(|(on, at, _)| generation == 0 && on == ring && *at == end.rank)
                                    .map(|&(_, _, fault)| fault);
                                Some(end)
                            })
                            .collect()
                    })
                    .get_mut(position)
                    .and_then(Option::take)
            })
            .flatten();
        end.ok_or_else(|| {
            anyhow!(
                "no end {position} of generation {generation}'s {ring} ring is left (taken before, or the \
                 ring was dropped for a newer generation's)"
            )
        })
    }
}

impl RingTransport for MemoryTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn link_break(&self) -> Option<LinkBreak> {
        self.breakable.clone().map(LinkBreak::Inbox)
    }

    /// Copies at once: an in-memory send never waits (unless its link is made slow).
    unsafe fn send_queued(&mut self, op: &str, bytes: &[u8]) -> Result<()> {
        if let Some(reason) = &self.broken {
            bail!("{op}: the link to rank {} is broken: {reason}", self.right());
        }
        let header = MessageHeader {
            seq: self.sent,
            len: bytes.len() as u64,
        };
        self.sent += 1;
        let delivery = match self.fault {
            Some(LinkFault::Drop { message }) if message == header.seq => {
                self.fault = None;
                Err(format!("message #{message} from rank {} was lost", self.rank))
            }
            fault => {
                if let Some(LinkFault::Delay(delay)) = fault {
                    thread::sleep(delay);
                }
                Ok((header, bytes.to_vec()))
            }
        };
        if self.to_right.send(delivery).is_err() {
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
        if let Some(reason) = &self.broken {
            bail!("{op}: the link from rank {} broke: {reason}", self.left());
        }
        let (header, payload) = match self.from_left.recv_timeout(self.timeout) {
            Ok(Ok(message)) => message,
            Ok(Err(reason)) => {
                let failure = anyhow!("{op}: the link from rank {} broke: {reason}", self.left());
                self.broken = Some(reason);
                return Err(failure);
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    const RING: &str = "test";

    /// The end at `position` of generation `generation`'s ring of two.
    fn take(rings: &MemoryRings, generation: u64, position: usize) -> MemoryTransport {
        rings.take(generation, RING, 2, position).unwrap()
    }

    fn send(end: &mut MemoryTransport, bytes: &[u8]) -> Result<()> {
        end.send("test", bytes)
    }

    fn recv(end: &mut MemoryTransport) -> Result<Vec<u8>> {
        let mut got = Vec::new();
        end.recv("test", 1, &mut |_, b| got.extend_from_slice(b))?;
        Ok(got)
    }

    #[test]
    fn a_lost_message_breaks_the_link_and_the_receiver_says_which() {
        let rings = MemoryRings::new(
            Duration::from_secs(5),
            vec![(RING.into(), 0, LinkFault::Drop { message: 1 })],
        );
        let (mut zero, mut one) = (take(&rings, 0, 0), take(&rings, 0, 1));
        send(&mut zero, &[7]).unwrap();
        send(&mut zero, &[8]).unwrap();
        assert_eq!(recv(&mut one).unwrap(), vec![7]);
        let error = recv(&mut one).unwrap_err().to_string();
        assert!(
            error.contains("link from rank 0 broke: message #1 from rank 0 was lost"),
            "{error}"
        );
        // The next generation's ring carries no fault.
        let (mut zero, mut one) = (take(&rings, 1, 0), take(&rings, 1, 1));
        send(&mut zero, &[7]).unwrap();
        send(&mut zero, &[8]).unwrap();
        assert_eq!((recv(&mut one).unwrap(), recv(&mut one).unwrap()), (vec![7], vec![8]));
        assert!(rings.take(1, RING, 2, 1).is_err(), "an end is handed out once");
        assert!(rings.take(0, RING, 2, 0).is_err(), "an older generation's ring is gone");
    }

    #[test]
    fn a_delayed_link_delivers_every_message_late_and_in_order() {
        let delay = Duration::from_millis(30);
        let rings = MemoryRings::new(Duration::from_secs(5), vec![(RING.into(), 1, LinkFault::Delay(delay))]);
        let (mut zero, mut one) = (take(&rings, 0, 0), take(&rings, 0, 1));
        let started = Instant::now();
        send(&mut one, &[1]).unwrap();
        send(&mut one, &[2]).unwrap();
        assert!(started.elapsed() >= 2 * delay);
        assert_eq!((recv(&mut zero).unwrap(), recv(&mut zero).unwrap()), (vec![1], vec![2]));
    }

    #[test]
    fn a_receive_blocked_on_a_silent_neighbour_leaves_when_its_link_is_broken() {
        let rings = MemoryRings::new(Duration::from_secs(60), Vec::new());
        let (_silent, mut one) = (take(&rings, 0, 0), take(&rings, 0, 1));
        let Some(LinkBreak::Inbox(inbox)) = one.link_break() else {
            panic!("a ring of the simulated cluster is breakable");
        };
        let breaking = thread::spawn(move || {
            thread::sleep(Duration::from_millis(50));
            inbox.break_link("rank 0 declared dead");
        });
        let error = recv(&mut one).unwrap_err().to_string();
        assert!(error.contains("rank 0 declared dead"), "{error}");
        breaking.join().unwrap();
        // Broken for good, as a shut-down socket: the collective queued next fails at once.
        let again = recv(&mut one).unwrap_err().to_string();
        assert!(again.contains("rank 0 declared dead"), "{again}");
        assert!(send(&mut one, &[1]).is_err());
        assert!(
            ring(2, Duration::from_secs(1))[0].link_break().is_none(),
            "a plain ring keeps no inbox"
        );
    }
}
