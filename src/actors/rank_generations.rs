//! A rank's generations, written once for every strategy: train a generation from the step it
//! resumes after (restoring that step's state, then the steps, then the outcome); on a failure
//! the coordinator explains with a rollback order, join the next generation and train it; a
//! preemption, or a failure no order explains, ends the run. What a generation is — the
//! replica's steps, a pipeline stage's, a parameter-server trainer's pulls and pushes — and how
//! a rank rejoins (a new ring, new stage links, a new place among the trainers) is the
//! strategy's [`RankGenerations`].

use anyhow::Result;

use super::recovery::rollback::Orders;
use crate::collective::preemption::is_preemption;
use crate::net::protocol::Roster;

/// What a strategy's rank does in each generation.
pub(crate) trait RankGenerations {
    /// What outlives a rollback: the batches, the monitor, the losses so far.
    type Run;
    /// What the run ends with.
    type Outcome;

    /// The rank, for the logs.
    fn rank(&self) -> usize;

    /// Says that the rank joined `roster`'s generation after a rollback.
    fn rejoined(&self, roster: &Roster) {
        let (rank, generation) = (self.rank(), roster.generation);
        let resume_step = roster.resume_step.unwrap_or(0);
        tracing::info!(rank, generation, resume_step, "rejoined");
    }

    /// Trains the generation from the state after step `first` to the end of the run.
    async fn generation(&mut self, run: &mut Self::Run, first: usize) -> Result<Self::Outcome>;

    /// The coordinator's rollback orders to this rank; `None` where a lost rank stops the job.
    fn orders(&mut self) -> Option<&mut Orders>;

    /// Joins the next generation after a rollback order: its roster.
    async fn rejoin(&mut self, run: &mut Self::Run) -> Result<Roster>;

    /// Called when a preemption stopped every rank after the same step, before the run ends.
    async fn preempted(&mut self, _run: &mut Self::Run) {}
}

/// Trains `rank`'s generations from the state after step `first` until the run ends. Each pass
/// is one generation; a new one starts only on a rollback order to a newer generation, so the
/// passes are bounded by the ranks the job loses.
pub(crate) async fn train_generations<R: RankGenerations>(
    rank: &mut R,
    run: &mut R::Run,
    mut first: usize,
) -> Result<R::Outcome> {
    loop {
        let failure = match rank.generation(run, first).await {
            Ok(outcome) => return Ok(outcome),
            // Every rank stopped after the same step: nothing to recover.
            Err(e) if is_preemption(&e) => {
                rank.preempted(run).await;
                return Err(e);
            }
            Err(e) => e,
        };
        first = roll_back(rank, run, failure).await?;
    }
}

/// After `failure`: the coordinator's rollback order that explains it, and the next generation
/// joined; returns the step it resumes after. Without an order, `failure` stands.
async fn roll_back<R: RankGenerations>(rank: &mut R, run: &mut R::Run, mut failure: anyhow::Error) -> Result<usize> {
    loop {
        let Some(orders) = rank.orders() else {
            return Err(failure);
        };
        orders.explain(failure).await?;
        match rank.rejoin(run).await {
            Ok(roster) => {
                if let Some(orders) = rank.orders() {
                    orders.joined(&roster);
                }
                rank.rejoined(&roster);
                return Ok(roster.resume_step.unwrap_or(0));
            }
            Err(e) => failure = e,
        }
    }
}
