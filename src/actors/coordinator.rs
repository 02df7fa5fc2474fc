//! The coordinator: hands out the roster of data endpoints once every rank
//! has joined, and releases barriers — gathers too, which are barriers where
//! each rank hands rank 0 a part (a launched pipeline's stage outcomes). All
//! wait at most the job's timeout; on expiry every waiting rank gets an
//! error naming the ranks that never arrived, never a silent hang.
//!
//! It also watches the ranks' heartbeats: a rank silent for longer than the heartbeat deadline,
//! or whose heartbeat connection breaks before it said goodbye, is declared dead, and from then
//! on every waiting rank and every heartbeat is answered with the reason, so every process of
//! the job stops (and its launcher restarts them from the last checkpoint).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use actix::prelude::*;
use bytes::Bytes;
use tokio::sync::oneshot;

use crate::net::protocol::{Barrier, ConnectionLost, Gather, Heartbeat, Join, Leave};

type Waiter<T> = oneshot::Sender<Result<T, String>>;
/// A rank waiting at a barrier or gather: its part (empty at a barrier), and where its answer goes.
type Arrival = (Bytes, Waiter<Vec<Bytes>>);

/// Rendezvous and barriers for one job.
pub struct Coordinator {
    world_size: usize,
    timeout: Duration,
    joined: BTreeMap<usize, (String, Waiter<Vec<String>>)>,
    roster: Option<Vec<String>>,
    /// Ranks waiting at each barrier or gather.
    barriers: HashMap<String, BTreeMap<usize, Arrival>>,
    /// How long a rank may go without a heartbeat; `None` when ranks share this process.
    heartbeat_deadline: Option<Duration>,
    /// When each rank that heartbeats was last heard from.
    last_heard: HashMap<usize, Instant>,
    /// Ranks that finished and stopped heartbeating.
    left: HashSet<usize>,
    /// Why the job was aborted, once a rank was declared dead.
    aborted: Option<String>,
    /// What to call each rank in messages (`rank N` when not given).
    names: Vec<String>,
}

impl Coordinator {
    /// A coordinator for `world_size` ranks that waits at most `timeout`
    /// for a rendezvous or a barrier to fill.
    pub fn new(world_size: usize, timeout: Duration) -> Self {
        Self {
            world_size,
            timeout,
            joined: BTreeMap::new(),
            roster: None,
            barriers: HashMap::new(),
            heartbeat_deadline: None,
            last_heard: HashMap::new(),
            left: HashSet::new(),
            aborted: None,
            names: Vec::new(),
        }
    }

    /// Calls rank `r` `names[r]` in its messages (a parameter-server job's "server 1").
    pub fn with_names(mut self, names: Vec<String>) -> Self {
        self.names = names;
        self
    }

    fn name(&self, rank: usize) -> String {
        self.names.get(rank).cloned().unwrap_or_else(|| format!("rank {rank}"))
    }

    /// Declares a rank dead once it has been silent for `deadline` since its last heartbeat
    /// (ranks are watched from their first heartbeat on).
    pub fn with_heartbeat_deadline(mut self, deadline: Duration) -> Self {
        self.heartbeat_deadline = Some(deadline);
        self
    }

    /// Declares `rank` dead for `why`: the job is aborted, and every rank waiting here is told.
    fn declare_dead(&mut self, rank: usize, why: &str) {
        if self.aborted.is_some() || self.left.contains(&rank) {
            return;
        }
        let reason = format!("{} declared dead: {why}; the job is stopped", self.name(rank));
        tracing::error!("{reason}");
        for (_, waiting) in self.barriers.drain() {
            for (_, (_, waiter)) in waiting {
                let _ = waiter.send(Err(reason.clone()));
            }
        }
        for (_, (_, waiter)) in std::mem::take(&mut self.joined) {
            let _ = waiter.send(Err(reason.clone()));
        }
        self.aborted = Some(reason);
    }

    /// Declares dead every watched rank silent for longer than the deadline.
    fn check_heartbeats(&mut self) {
        let Some(deadline) = self.heartbeat_deadline else {
            return;
        };
        let silent: Vec<(usize, Duration)> = self
            .last_heard
            .iter()
            .filter(|(rank, _)| !self.left.contains(rank))
            .map(|(&rank, heard)| (rank, heard.elapsed()))
            .filter(|(_, silence)| *silence > deadline)
            .collect();
        for (rank, silence) in silent {
            self.declare_dead(
                rank,
                &format!(
                    "no heartbeat for {:.1}s (deadline {:.1}s)",
                    silence.as_secs_f64(),
                    deadline.as_secs_f64()
                ),
            );
        }
    }

    fn missing<T>(&self, present: &BTreeMap<usize, T>) -> String {
        let missing: Vec<String> = (0..self.world_size)
            .filter(|r| !present.contains_key(r))
            .map(|r| r.to_string())
            .collect();
        format!(
            "rank{} {}",
            if missing.len() == 1 { "" } else { "s" },
            missing.join(", ")
        )
    }

    /// `rank` arrives at barrier `name` with `part`: the answer comes once every rank has
    /// arrived (rank 0 gets all parts, by rank), or with an error naming the missing ranks
    /// once the timeout has passed since the first arrival.
    fn arrive(
        &mut self,
        rank: usize,
        name: String,
        part: Bytes,
        ctx: &mut Context<Self>,
    ) -> oneshot::Receiver<Result<Vec<Bytes>, String>> {
        let (tx, rx) = oneshot::channel();
        if let Some(reason) = &self.aborted {
            let _ = tx.send(Err(reason.clone()));
            return rx;
        }
        if rank >= self.world_size {
            let _ = tx.send(Err(format!("rank {rank} is outside world size {}", self.world_size)));
            return rx;
        }
        let waiting = self.barriers.entry(name.clone()).or_default();
        if waiting.is_empty() {
            let name = name.clone();
            ctx.run_later(self.timeout, move |coordinator, _| {
                let Some(waiting) = coordinator.barriers.remove(&name) else {
                    return;
                };
                let reason = format!(
                    "barrier {name:?} timed out after {:.1}s: {} never arrived",
                    coordinator.timeout.as_secs_f64(),
                    coordinator.missing(&waiting)
                );
                tracing::error!("{reason}");
                for (_, (_, waiter)) in waiting {
                    let _ = waiter.send(Err(reason.clone()));
                }
            });
        }
        waiting.insert(rank, (part, tx));
        if waiting.len() == self.world_size {
            let arrived = self.barriers.remove(&name).unwrap_or_default();
            let parts: Vec<Bytes> = arrived.values().map(|(part, _)| part.clone()).collect();
            for (_, (_, waiter)) in arrived {
                let _ = waiter.send(Ok(parts.clone()));
            }
        }
        rx
    }
}

impl Actor for Coordinator {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        if let Some(deadline) = self.heartbeat_deadline {
            // Checked ten times per deadline (a walk over the ranks), so a death is found
            // within a tenth of the deadline of being due.
            ctx.run_interval(deadline / 10, |coordinator, _| coordinator.check_heartbeats());
        }
    }
}

impl Coordinator {
    /// Fails the rendezvous `timeout` after its first arrival unless every rank has joined by
    /// then. (Roles that only heartbeat, as a parameter-server job's, never join.)
    fn expire_rendezvous(&mut self, ctx: &mut Context<Self>) {
        ctx.run_later(self.timeout, |coordinator, _| {
            if coordinator.roster.is_some() {
                return;
            }
            let reason = format!(
                "rendezvous timed out after {:.1}s: {} never joined (world size {})",
                coordinator.timeout.as_secs_f64(),
                coordinator.missing(&coordinator.joined),
                coordinator.world_size
            );
            tracing::error!("{reason}");
            for (_, (_, waiter)) in std::mem::take(&mut coordinator.joined) {
                let _ = waiter.send(Err(reason.clone()));
            }
        });
    }
}

fn reply<T: Send + 'static>(rx: oneshot::Receiver<Result<T, String>>) -> ResponseFuture<Result<T, String>> {
    Box::pin(async move { rx.await.unwrap_or_else(|_| Err("the coordinator stopped".to_string())) })
}

impl Handler<Join> for Coordinator {
    type Result = ResponseFuture<Result<Vec<String>, String>>;

    fn handle(&mut self, msg: Join, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        let refusal = if msg.world_size != self.world_size {
            Some(format!(
                "rank {} was started for world size {}, the job has {}",
                msg.rank, msg.world_size, self.world_size
            ))
        } else if msg.rank >= self.world_size {
            Some(format!("rank {} is outside world size {}", msg.rank, self.world_size))
        } else if self.roster.is_some() || self.joined.contains_key(&msg.rank) {
            Some(format!("rank {} joined twice", msg.rank))
        } else {
            None
        };
        if let Some(reason) = refusal {
            let _ = tx.send(Err(reason));
            return reply(rx);
        }
        tracing::debug!(rank = msg.rank, endpoint = %msg.data_endpoint, "rank joined");
        if self.joined.is_empty() {
            self.expire_rendezvous(ctx);
        }
        self.joined.insert(msg.rank, (msg.data_endpoint, tx));
        if self.joined.len() == self.world_size {
            let joined = std::mem::take(&mut self.joined);
            let roster: Vec<String> = joined.values().map(|(endpoint, _)| endpoint.clone()).collect();
            tracing::info!(world_size = self.world_size, "rendezvous complete");
            for (_, (_, waiter)) in joined {
                let _ = waiter.send(Ok(roster.clone()));
            }
            self.roster = Some(roster);
        }
        reply(rx)
    }
}

impl Handler<Heartbeat> for Coordinator {
    type Result = Result<(), String>;

    fn handle(&mut self, msg: Heartbeat, _: &mut Self::Context) -> Self::Result {
        if let Some(reason) = &self.aborted {
            return Err(reason.clone());
        }
        self.last_heard.insert(msg.rank, Instant::now());
        Ok(())
    }
}

impl Handler<Leave> for Coordinator {
    type Result = ();

    fn handle(&mut self, msg: Leave, _: &mut Self::Context) {
        self.left.insert(msg.rank);
    }
}

impl Handler<ConnectionLost> for Coordinator {
    type Result = ();

    fn handle(&mut self, msg: ConnectionLost, _: &mut Self::Context) {
        self.declare_dead(msg.rank, "its heartbeat connection broke (the process is gone)");
    }
}

impl Handler<Barrier> for Coordinator {
    type Result = ResponseFuture<Result<(), String>>;

    fn handle(&mut self, msg: Barrier, ctx: &mut Self::Context) -> Self::Result {
        let answer = reply(self.arrive(msg.rank, msg.name, Bytes::new(), ctx));
        Box::pin(async move { answer.await.map(|_| ()) })
    }
}

impl Handler<Gather> for Coordinator {
    type Result = ResponseFuture<Result<Vec<Bytes>, String>>;

    fn handle(&mut self, msg: Gather, ctx: &mut Self::Context) -> Self::Result {
        reply(self.arrive(msg.rank, msg.name, msg.part, ctx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn join(c: &Addr<Coordinator>, rank: usize, world_size: usize) -> Result<Vec<String>, String> {
        let data_endpoint = format!("endpoint-{rank}");
        c.send(Join {
            rank,
            world_size,
            data_endpoint,
        })
        .await
        .expect("coordinator alive")
    }

    #[actix::test]
    async fn roster_is_handed_out_by_rank() {
        let c = Coordinator::new(2, Duration::from_secs(5)).start();
        let (late, early) = futures::join!(join(&c, 1, 2), join(&c, 0, 2));
        assert_eq!(late, Ok(vec!["endpoint-0".to_string(), "endpoint-1".to_string()]));
        assert_eq!(early, late);
    }

    #[actix::test]
    async fn a_rank_that_never_arrives_is_named() {
        let c = Coordinator::new(3, Duration::from_millis(200)).start();
        let err = join(&c, 0, 3).await.expect_err("ranks 1 and 2 are missing");
        assert!(err.contains("ranks 1, 2 never joined"), "{err}");
        let barrier = c
            .send(Barrier {
                rank: 2,
                name: "end".into(),
            })
            .await
            .expect("coordinator alive");
        let err = barrier.expect_err("ranks 0 and 1 never reach the barrier");
        assert!(err.contains("ranks 0, 1 never arrived"), "{err}");
    }

    #[actix::test]
    async fn a_gather_answers_every_rank_with_every_part_by_rank() {
        let c = Coordinator::new(3, Duration::from_secs(5)).start();
        let gather = |rank: usize, part: &'static [u8]| {
            c.send(Gather {
                rank,
                name: "outcomes".into(),
                part: Bytes::from_static(part),
            })
        };
        let (two, zero, one) = futures::join!(gather(2, b"c"), gather(0, b"a"), gather(1, b""));
        let zero = zero.expect("coordinator alive").expect("all arrived");
        assert_eq!(
            zero,
            vec![Bytes::from_static(b"a"), Bytes::new(), Bytes::from_static(b"c")]
        );
        // The parts are shared, not copied: the buses hand them to rank 0 alone.
        assert_eq!(one.expect("coordinator alive"), Ok(zero.clone()));
        assert_eq!(two.expect("coordinator alive"), Ok(zero));
    }

    #[actix::test]
    async fn a_silent_rank_is_declared_dead_and_everyone_is_told() {
        let c = Coordinator::new(2, Duration::from_secs(30))
            .with_heartbeat_deadline(Duration::from_millis(200))
            .start();
        for rank in 0..2 {
            c.send(Heartbeat { rank }).await.unwrap().unwrap();
        }
        let barrier = c.send(Barrier {
            rank: 0,
            name: "step".into(),
        });
        // Rank 0 keeps heartbeating; rank 1 falls silent.
        let beating = async {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let _ = c.send(Heartbeat { rank: 0 }).await;
            }
        };
        let (waited, ()) = futures::join!(barrier, beating);
        let err = waited.unwrap().expect_err("the barrier cannot complete");
        assert!(err.contains("rank 1 declared dead: no heartbeat for"), "{err}");
        let refused = c.send(Heartbeat { rank: 0 }).await.unwrap().unwrap_err();
        assert_eq!(refused, err, "every later heartbeat hears why the job stopped");
    }

    #[actix::test]
    async fn a_lost_connection_is_a_death_unless_the_rank_left() {
        let c = Coordinator::new(2, Duration::from_secs(30))
            .with_heartbeat_deadline(Duration::from_secs(30))
            .start();
        c.send(Leave { rank: 1 }).await.unwrap();
        c.send(ConnectionLost { rank: 1 }).await.unwrap();
        c.send(Heartbeat { rank: 0 })
            .await
            .unwrap()
            .expect("a rank that left is not dead");
        c.send(ConnectionLost { rank: 0 }).await.unwrap();
        let err = c.send(Heartbeat { rank: 1 }).await.unwrap().unwrap_err();
        assert!(
            err.contains("rank 0 declared dead: its heartbeat connection broke"),
            "{err}"
        );
    }

    #[actix::test]
    async fn wrong_world_size_and_duplicates_are_refused() {
        let c = Coordinator::new(2, Duration::from_millis(300)).start();
        let err = join(&c, 0, 3).await.expect_err("world size differs");
        assert!(err.contains("world size 3"), "{err}");
        let (first, twice) = futures::join!(join(&c, 1, 2), join(&c, 1, 2));
        assert!(twice.expect_err("same rank twice").contains("rank 1 joined twice"));
        assert!(first.expect_err("rank 0 never came").contains("rank 0 never joined"));
    }
}
