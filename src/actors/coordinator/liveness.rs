//! Who lives: heartbeats, a rank declared dead (the job stops, or rolls back in place to a new
//! generation), the rollback orders to the survivors — messages to the rank actors this
//! coordinator reaches, or answers to the others' heartbeats — and ranks that leave.

use std::time::{Duration, Instant};

use actix::prelude::*;

use super::{Coordinator, JobAskedToStop};
use crate::net::protocol::{Beat, ConnectionLost, Heartbeat, ReachRank, RollbackOrder};

impl Coordinator {
    /// Rank `msg.rank` is alive, heard on line `line`: go on, or roll back; refused with the
    /// reason once the job is stopped.
    pub(super) fn heartbeat(&mut self, msg: Heartbeat, line: u64) -> Result<Beat, String> {
        if let Some(reason) = &self.stopped {
            return Err(reason.clone());
        }
        // Another process beating for a member whose own process beats still (one started for
        // another job, or a replacement before the old one was found dead) speaks for nothing:
        // its silence, or its line's loss, must not count as the member's.
        let other_process = self
            .last_heard
            .get(&msg.rank)
            .is_some_and(|&(_, _, pid)| pid != msg.pid && self.members.contains_key(&msg.rank));
        if other_process {
            return Ok(Beat::Alive);
        }
        self.last_heard.insert(msg.rank, (Instant::now(), line, msg.pid));
        self.reannounced(&msg);
        // A rank whose actor this coordinator reaches has its order already.
        Ok(if self.behind(msg.rank) && !self.reached.contains_key(&msg.rank) {
            Beat::RollBack {
                generation: self.generation,
                reason: self.rolled_back.clone(),
            }
        } else {
            Beat::Alive
        })
    }

    /// Rank `rank` has finished, said on line `line`: its silence from now on is not a death.
    pub(super) fn leave(&mut self, rank: usize, line: u64) -> Result<(), String> {
        // Only the line that carries a rank's heartbeats may end them: a leave on another one
        // (a stale process of the job, or the same command started twice) would switch off the
        // failure detection of a rank that still trains.
        if let Some(&(_, beats_on, pid)) = self.last_heard.get(&rank) {
            if beats_on != line {
                let reason = format!(
                    "{} may leave only on the connection that carries its heartbeats (those of pid {pid}): \
                     a leave from another connection is refused",
                    self.name(rank)
                );
                tracing::warn!("{reason}");
                return Err(reason);
            }
        }
        self.left.insert(rank);
        self.finish_if_over();
        Ok(())
    }
}

impl Handler<JobAskedToStop> for Coordinator {
    type Result = ();

    fn handle(&mut self, _: JobAskedToStop, _: &mut Self::Context) {
        tracing::info!("the job was asked to stop: a rank lost from now on is not replaced");
        self.asked_to_stop = true;
        // A rank awaited for a generation that has not formed yet (never heard from, or lost
        // just before) ended with the signal: the ranks waiting for it would wait in vain.
        let awaited = self.expected.iter().copied().find(|&rank| !self.lives_on(rank));
        if let Some(rank) = awaited.filter(|_| self.forming()) {
            self.stop(format!(
                "the job was asked to stop while {} was awaited; the job is stopped",
                self.name(rank)
            ));
        }
        self.finish_if_over();
    }
}

impl Handler<ReachRank> for Coordinator {
    type Result = ();

    fn handle(&mut self, msg: ReachRank, _: &mut Self::Context) {
        self.reached.insert(msg.rank, msg.actor);
        self.send_order(msg.rank);
    }
}

impl Handler<ConnectionLost> for Coordinator {
    type Result = ();

    fn handle(&mut self, msg: ConnectionLost, ctx: &mut Self::Context) {
        // The line of a process already replaced (or declared dead) says nothing new.
        if self
            .last_heard
            .get(&msg.rank)
            .is_some_and(|&(_, line, _)| line == msg.line)
        {
            self.declare_dead(msg.rank, "its heartbeat connection broke (the process is gone)", ctx);
        }
    }
}

impl Coordinator {
    /// Declares `rank` dead for `why`: the job stops, or (in place) rolls back to a new
    /// generation; every rank waiting here is told at once.
    pub(super) fn declare_dead(&mut self, rank: usize, why: &str, ctx: &mut Context<Self>) {
        if self.left.contains(&rank) {
            return;
        }
        // Once the job was asked to stop, no replacement comes: the job stops, and is over once
        // no rank lives on.
        if self.asked_to_stop {
            self.forget(rank);
            if self.stopped.is_none() {
                self.stop(format!(
                    "{} declared dead after the job was asked to stop: {why}; the job is stopped",
                    self.name(rank)
                ));
            }
            self.finish_if_over();
            return;
        }
        if self.stopped.is_some() {
            return;
        }
        // A rank that waits to be admitted (or was dropped) trains in no generation: it is
        // forgotten, and nobody rolls back.
        if self.elastic().is_some() && !self.active.contains(&rank) {
            tracing::warn!("{} declared dead while outside the job: {why}", self.name(rank));
            self.forget(rank);
            if let Some((_, _, waiter)) = self.joining.remove(&rank) {
                let _ = waiter.send(Err(format!("{} declared dead: {why}", self.name(rank))));
            }
            self.expected.remove(&rank);
            self.try_form();
            return;
        }
        // Once a rank has left, training is over: there is nothing to roll back to.
        if !self.in_place || !self.left.is_empty() {
            self.stop(format!("{} declared dead: {why}; the job is stopped", self.name(rank)));
            return;
        }
        self.generation += 1;
        // The lost rank's replacement is awaited (with elastic membership, for a while).
        self.expected = self.active.iter().copied().collect();
        let resume = match self.committed {
            Some(step) => format!("the checkpoint of step {step}"),
            None => "step 0".to_string(),
        };
        let reason = format!(
            "{} declared dead: {why}; generation {} resumes from {resume} once its replacement joins",
            self.name(rank),
            self.generation
        );
        tracing::warn!("{reason}");
        self.fail_barriers(&reason);
        // Its replacement is a new member; the ranks already joining wait on for the new roster.
        self.forget(rank);
        if let Some((_, _, waiter)) = self.joining.remove(&rank) {
            let _ = waiter.send(Err(reason.clone()));
        }
        self.rolled_back = reason;
        let reached: Vec<usize> = self.reached.keys().copied().collect();
        for rank in reached {
            self.send_order(rank);
        }
        // Ranks that joined the generation this one replaces wait on for its roster: its
        // deadlines run from now.
        if !self.joining.is_empty() {
            self.start_forming(ctx);
        }
    }

    /// Whether `rank` is a member of a generation older than the one forming or running.
    pub(super) fn behind(&self, rank: usize) -> bool {
        self.members.get(&rank).is_some_and(|&joined| joined < self.generation)
    }

    /// Declares dead every watched rank silent for longer than the deadline. A check that comes
    /// late by half a deadline or more measures this process's own silence (it was stopped,
    /// swapped out or starved of CPU), not the ranks': their heartbeats wait unread on its
    /// lines, so every rank's deadline runs again from now instead.
    pub(super) fn check_heartbeats(&mut self, ctx: &mut Context<Self>) {
        let Some(deadline) = self.heartbeat_deadline else {
            return;
        };
        let now = Instant::now();
        let stalled = now.saturating_duration_since(std::mem::replace(&mut self.last_check, now));
        if stalled > deadline / 2 {
            tracing::warn!(
                stalled_s = stalled.as_secs_f64(),
                "the coordinator itself did not run for {:.1}s: every rank's heartbeat deadline \
                 runs again from now rather than the ranks being taken for dead",
                stalled.as_secs_f64()
            );
            for (heard, _, _) in self.last_heard.values_mut() {
                *heard = now;
            }
            return;
        }
        let silent: Vec<(usize, Duration)> = self
            .last_heard
            .iter()
            .filter(|(rank, _)| !self.left.contains(rank))
            .map(|(&rank, (heard, _, _))| (rank, heard.elapsed()))
            .filter(|(_, silence)| *silence > deadline)
            .collect();
        for (rank, silence) in silent {
            let why = format!(
                "no heartbeat for {:.1}s (deadline {:.1}s)",
                silence.as_secs_f64(),
                deadline.as_secs_f64()
            );
            self.declare_dead(rank, &why, ctx);
        }
    }

    /// Sends a reached rank that trains in an older generation the order to roll back to this
    /// one; one whose actor is gone is not reached any more (its heartbeats carry the order).
    pub(super) fn send_order(&mut self, rank: usize) {
        if !self.behind(rank) {
            return;
        }
        let Some(actor) = self.reached.get(&rank) else {
            return;
        };
        let order = RollbackOrder {
            generation: self.generation,
            reason: self.rolled_back.clone(),
        };
        if actor.try_send(order).is_err() {
            self.reached.remove(&rank);
        }
    }
}
