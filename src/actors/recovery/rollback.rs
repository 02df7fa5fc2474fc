//! How a rank of a job that recovers in place hears the coordinator's rollback orders: each is a
//! [`RollbackOrder`] message to the rank's actor — sent by a coordinator in the same process, or
//! handed on by the heartbeat that heard it from one in another. The actor's [`OrderInbox`]
//! breaks the ring the rank may be blocked in (so it leaves the collective at once, not after
//! the link timeout) and tells the training loop ([`Orders`]), which rolls back inside this
//! process.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::future::Future;

use actix::prelude::*;
use anyhow::{anyhow, Result};
use tokio::sync::{watch, Notify};

use crate::engines::comm::RingBreaker;
pub use crate::net::protocol::RollbackOrder;
use crate::net::protocol::{Membership, Roster};
use crate::net::ControlBus;

/// How often a failed rank asks for a heartbeat while it waits to hear of a rollback.
const ASK_EVERY: Duration = Duration::from_millis(20);

/// The heartbeat side: where the orders it hears go (to the rank's actor).
#[derive(Clone)]
pub struct OrderLine {
    actor: ActorSlot,
    inbox: OrderInbox,
    member_of: MemberOf,
    asked: Arc<Notify>,
}

/// The rank's actor, once it started and if it takes orders (a shard's generation loop is no
/// actor: its inbox takes them directly).
#[derive(Clone, Default)]
struct ActorSlot(Arc<Mutex<Option<Recipient<RollbackOrder>>>>);

/// The actor's side: what taking an order does.
#[derive(Clone)]
pub struct OrderInbox {
    ring: RingBreaker,
    orders: Arc<watch::Sender<Option<RollbackOrder>>>,
}

impl OrderInbox {
    /// The coordinator ordered the rollback in `order`: breaks the ring in use (once per
    /// generation) and tells the training loop.
    pub fn take(&self, order: RollbackOrder) {
        if self.ring.break_for(order.generation) {
            tracing::warn!(generation = order.generation, "rollback ordered: {}", order.reason);
            self.orders.send_replace(Some(order));
        }
    }
}

/// The generation the rank last joined and who trains in it (none yet before its first
/// roster), shared by both sides.
#[derive(Clone, Default)]
struct MemberOf(Arc<Mutex<Option<Membership>>>);

/// The training side: where orders come out.
pub struct Orders {
    orders: watch::Receiver<Option<RollbackOrder>>,
    /// How long after a failure an order may still come (the coordinator's detection, then a
    /// heartbeat to carry it).
    grace: Duration,
    /// The newest generation this rank rolled back to.
    acted_on: u64,
    member_of: MemberOf,
    /// Tells the heartbeat side to beat now: a failed rank wants its answer at once.
    asked: Arc<Notify>,
    inbox: OrderInbox,
    actor: ActorSlot,
}

/// Interrupts work when an order to a generation newer than the one the rank acted on comes.
pub struct Interruption {
    acted_on: u64,
    orders: watch::Receiver<Option<RollbackOrder>>,
}

impl Interruption {
    /// Runs `work` until it ends or the order comes; then it is dropped where it waits, and
    /// fails with the order's reason (which [`Orders::explain`] then finds at once).
    pub async fn of<T>(mut self, work: impl Future<Output = Result<T>>) -> Result<T> {
        let acted_on = self.acted_on;
        tokio::pin!(work);
        let heard = tokio::select! {
            outcome = &mut work => return outcome,
            heard = self.orders.wait_for(|o| o.as_ref().is_some_and(|o| o.generation > acted_on)) => {
                heard.map(|order| order.clone())
            }
        };
        match heard {
            Ok(Some(order)) => Err(anyhow!("interrupted by the coordinator: {}", order.reason)),
            // No more orders can come (the heartbeats ended): the work goes on alone.
            _ => work.await,
        }
    }
}

/// A line for orders and its receiving end; `grace` bounds how long a failed rank waits to hear
/// whether its failure was a peer's death.
pub fn order_line(grace: Duration) -> (OrderLine, Orders) {
    let (tx, rx) = watch::channel(None);
    let member_of = MemberOf::default();
    let asked = Arc::new(Notify::new());
    let actor = ActorSlot::default();
    let inbox = OrderInbox {
        ring: RingBreaker::default(),
        orders: Arc::new(tx),
    };
    let line = OrderLine {
        actor: actor.clone(),
        inbox: inbox.clone(),
        member_of: member_of.clone(),
        asked: asked.clone(),
    };
    (
        line,
        Orders {
            orders: rx,
            grace,
            acted_on: 0,
            member_of,
            asked,
            inbox,
            actor,
        },
    )
}

impl OrderLine {
    /// A heartbeat heard the coordinator order `order`: it goes to the rank's actor, or straight
    /// to the inbox of a role that has none (yet).
    pub fn order(&self, order: RollbackOrder) {
        let actor = self.actor.0.lock().map_or(None, |slot| slot.clone());
        match actor {
            Some(actor) => actor.do_send(order),
            None => self.inbox.take(order),
        }
    }

    /// The generation the rank last joined and its members, for its heartbeats.
    pub fn member_of(&self) -> Option<Membership> {
        self.member_of.0.lock().map_or(None, |joined| joined.clone())
    }

    /// Resolves when the training side asks for a heartbeat now (it failed, and waits to hear
    /// whether a rollback explains it).
    pub async fn asked(&self) {
        self.asked.notified().await;
    }

    /// Where the rank's ring hands its sockets.
    pub fn breaker(&self) -> RingBreaker {
        self.inbox.ring.clone()
    }
}

impl Orders {
    /// The rank's actor, started in `ctx`, takes the orders from now on: those its heartbeat
    /// hears and, where the coordinator lives in this process (`bus`), the coordinator's own.
    /// Answers what the actor does with each.
    pub fn reach<A>(&self, rank: usize, bus: Option<&ControlBus>, ctx: &mut Context<A>) -> OrderInbox
    where
        A: Actor<Context = Context<A>> + Handler<RollbackOrder>,
    {
        let actor = ctx.address().recipient::<RollbackOrder>();
        if let Some(ControlBus::InMemory(coordinator)) = bus {
            coordinator.reach(rank, actor.clone());
        }
        if let Ok(mut slot) = self.actor.0.lock() {
            *slot = Some(actor);
        }
        self.inbox.clone()
    }

    /// The rank joined `roster`'s generation.
    pub fn joined(&self, roster: &Roster) {
        if let Ok(mut joined) = self.member_of.0.lock() {
            *joined = Some(Membership {
                generation: roster.generation,
                members: roster.members.clone(),
            });
        }
    }

    /// What interrupts work on an order to a generation this rank has not rolled back to yet
    /// ([`Interruption::of`]); it holds no borrow of the orders, so the work may borrow what
    /// holds them.
    pub fn interruption(&self) -> Interruption {
        Interruption {
            acted_on: self.acted_on,
            orders: self.orders.clone(),
        }
    }

    /// The rollback order that explains `failure`: one to a generation this rank has not rolled
    /// back to yet, given now or within the grace period. Without one, `failure` stands.
    pub async fn explain(&mut self, failure: anyhow::Error) -> Result<RollbackOrder> {
        let acted_on = self.acted_on;
        let newer = |order: &Option<RollbackOrder>| order.as_ref().is_some_and(|o| o.generation > acted_on);
        let deadline = tokio::time::Instant::now() + self.grace;
        let mut order = None;
        // Heartbeats asked for every ASK_EVERY carry the order as soon as the coordinator has
        // one, rather than at the next regular beat.
        while order.is_none() && tokio::time::Instant::now() < deadline {
            self.asked.notify_one();
            let wait = ASK_EVERY.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
            if let Ok(Ok(heard)) = tokio::time::timeout(wait, self.orders.wait_for(newer)).await {
                order = heard.clone();
            }
        }
        match order {
            Some(order) => {
                tracing::info!(generation = order.generation, "rolling back after: {failure:#}");
                self.acted_on = order.generation;
                Ok(order)
            }
            None => Err(failure),
        }
    }
}

/// Rank actor `$actor` takes the coordinator's rollback orders: when it starts in a job that
/// rolls back in place (its `in_place`, holding its `orders`), it is reached as the rank and
/// over the control line `$reach` answers (`$this` the actor); each order then goes to its
/// `inbox`.
macro_rules! takes_rollback_orders {
    ($actor:ty, |$this:ident, $in_place:ident| $reach:expr) => {
        impl actix::Actor for $actor {
            type Context = actix::Context<Self>;

            fn started(&mut self, ctx: &mut Self::Context) {
                let $this = &*self;
                if let Some($in_place) = &$this.in_place {
                    let (rank, bus) = $reach;
                    let inbox = $in_place.orders.reach(rank, bus, ctx);
                    self.inbox = Some(inbox);
                }
            }
        }

        impl actix::Handler<$crate::actors::recovery::rollback::RollbackOrder> for $actor {
            type Result = ();

            fn handle(&mut self, order: $crate::actors::recovery::rollback::RollbackOrder, _: &mut Self::Context) {
                if let Some(inbox) = &self.inbox {
                    inbox.take(order);
                }
            }
        }
    };
}
pub(crate) use takes_rollback_orders;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_failure_without_an_order_stands_and_one_with_an_order_rolls_back_once() {
        let (_, mut orders) = order_line(Duration::from_millis(100));
        let err = orders.explain(anyhow::anyhow!("a real bug")).await.unwrap_err();
        assert_eq!(err.to_string(), "a real bug");
        let order = |reason: &str| RollbackOrder {
            generation: 1,
            reason: reason.into(),
        };
        orders.inbox.take(order("rank 2 declared dead"));
        orders.inbox.take(order("the same order, heard again"));
        let order = orders.explain(anyhow::anyhow!("ring broke")).await.unwrap();
        assert_eq!(order.generation, 1);
        assert_eq!(order.reason, "rank 2 declared dead");
        let err = orders.explain(anyhow::anyhow!("later failure")).await.unwrap_err();
        assert_eq!(err.to_string(), "later failure", "an order is acted on once");
    }
}
