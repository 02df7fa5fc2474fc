//! Leaving a collective at once: a rank blocked in a ring operation on a peer that will never
//! answer (dead, or stopped) would wait out the link timeout. The coordinator's rollback order
//! reaches the rank on another thread, which breaks the ring's links through a
//! [`RingBreaker`]: it shuts their sockets down (every blocked read and write on them then
//! fails at once), or, on a ring in memory, tells the rank's inbox the link broke. The rank
//! then goes on to roll back.

use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex, PoisonError};

use super::memory::Inbox;

/// What breaks one ring member's link from another thread.
#[derive(Clone)]
pub enum LinkBreak {
    /// Clones of its two sockets (to its right and from its left neighbour).
    Sockets(Arc<[TcpStream; 2]>),
    /// The inbox of its link in memory.
    Inbox(Inbox),
}

impl LinkBreak {
    /// Clones of `to_right` and `from_left`.
    pub fn of(to_right: &TcpStream, from_left: &TcpStream) -> std::io::Result<Self> {
        Ok(Self::Sockets(Arc::new([to_right.try_clone()?, from_left.try_clone()?])))
    }

    fn shut(&self) {
        match self {
            Self::Sockets(sockets) => {
                for socket in sockets.iter() {
                    let _ = socket.shutdown(Shutdown::Both);
                }
            }
            Self::Inbox(inbox) => inbox.break_link("the coordinator ordered a rollback"),
        }
    }
}

/// Whether the ring being connected for one generation was given up: the coordinator has
/// ordered a rollback past that generation (a rank died while the ring connected), so the
/// neighbour waited for may never come. Connecting checks it between its attempts.
#[derive(Clone, Default)]
pub struct Abandoned(Option<(RingBreaker, u64)>);

impl Abandoned {
    /// A ring no rollback order gives up (a job that does not recover in place).
    pub fn never() -> Self {
        Self(None)
    }

    /// Whether the ring was given up.
    pub fn is_given_up(&self) -> bool {
        self.0.as_ref().is_some_and(|(breaker, generation)| {
            breaker.0.lock().unwrap_or_else(PoisonError::into_inner).broken_for > *generation
        })
    }
}

/// The ring of the running generation, as the thread that hears rollback orders sees it.
#[derive(Clone, Default)]
pub struct RingBreaker(Arc<Mutex<BreakerState>>);

#[derive(Default)]
struct BreakerState {
    /// The links of the rings in use (none before they are connected).
    links: Vec<LinkBreak>,
    /// The newest generation whose order broke the ring.
    broken_for: u64,
}

impl RingBreaker {
    /// A ring just connected uses `links` (a pipeline stage's rings each arm theirs).
    pub fn arm(&self, links: impl IntoIterator<Item = LinkBreak>) {
        let mut state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        state.links.extend(links);
    }

    /// What tells whether the ring of `generation` being connected was given up.
    pub fn abandons(&self, generation: u64) -> Abandoned {
        Abandoned(Some((self.clone(), generation)))
    }

    /// Breaks the ring in use for the rollback to `generation`, once per generation: returns
    /// whether this call did.
    pub fn break_for(&self, generation: u64) -> bool {
        let mut state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if generation <= state.broken_for {
            return false;
        }
        state.broken_for = generation;
        for link in std::mem::take(&mut state.links) {
            link.shut();
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    #[test]
    fn a_read_blocked_on_a_silent_peer_fails_at_once_when_broken() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let to_right = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_silent_peer, _) = listener.accept().unwrap();
        let from_left = to_right.try_clone().unwrap();
        from_left.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let breaker = RingBreaker::default();
        breaker.arm(Some(LinkBreak::of(&to_right, &from_left).unwrap()));
        let started = Instant::now();
        let reader = std::thread::spawn(move || (&from_left).read(&mut [0u8; 8]));
        std::thread::sleep(Duration::from_millis(100));
        assert!(breaker.break_for(1));
        assert!(!breaker.break_for(1), "one break per generation");
        let read = reader.join().unwrap();
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    }
}
