//! What every rank measured in a step, gathered over a ring: the global mean loss is the mean
//! of the ranks' losses, and how far apart they are (the spread) shows replicas that stopped
//! agreeing before the parameter checksums do. A rank asked to stop (preemption) says so here,
//! so that every rank stops after the same step.

use anyhow::{ensure, Result};

use crate::engines::comm::Communicator;

/// One rank's figures of a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankFigures {
    /// The loss of the rank's part of the batch.
    pub loss: f32,
    /// The rank's process's peak resident set, in bytes.
    pub peak_rss_bytes: u64,
    /// Whether the rank was asked to stop.
    pub stop: bool,
}

/// The figures of a step over all ranks of a ring.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobFigures {
    /// Mean of the ranks' losses, summed in rank order (the same bits on every rank).
    pub mean_loss: f32,
    /// Largest minus smallest rank loss.
    pub loss_spread: f32,
    /// The largest peak resident set of the ranks' processes.
    pub peak_rss_bytes: u64,
    /// Whether any rank was asked to stop.
    pub stop: bool,
}

const WIDTH: usize = 4 + 8 + 1;

impl RankFigures {
    /// Gathers every rank's figures over `comm` (one all-gather of 13 bytes per rank).
    pub fn gather(self, comm: &mut Communicator, op: &str) -> Result<JobFigures> {
        let mut mine = [0u8; WIDTH];
        mine[..4].copy_from_slice(&self.loss.to_le_bytes());
        mine[4..12].copy_from_slice(&self.peak_rss_bytes.to_le_bytes());
        mine[12] = u8::from(self.stop);
        let all = comm.all_gather(op, &mine)?;
        let ranks = all
            .iter()
            .map(|bytes| {
                ensure!(
                    bytes.len() == WIDTH,
                    "{op}: a rank sent {} bytes, not {WIDTH}",
                    bytes.len()
                );
                Ok(RankFigures {
                    loss: f32::from_le_bytes(bytes[..4].try_into()?),
                    peak_rss_bytes: u64::from_le_bytes(bytes[4..12].try_into()?),
                    stop: bytes[12] != 0,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(JobFigures::of(&ranks))
    }
}

impl JobFigures {
    /// The job's figures from each rank's, in rank order.
    pub fn of(ranks: &[RankFigures]) -> Self {
        let sum: f32 = ranks.iter().map(|r| r.loss).sum();
        let (low, high) = ranks.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), r| {
            (lo.min(r.loss), hi.max(r.loss))
        });
        Self {
            mean_loss: sum / ranks.len().max(1) as f32,
            loss_spread: if ranks.is_empty() { 0.0 } else { high - low },
            peak_rss_bytes: ranks.iter().map(|r| r.peak_rss_bytes).max().unwrap_or(0),
            stop: ranks.iter().any(|r| r.stop),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::comm::memory;
    use std::time::Duration;

    #[test]
    fn every_rank_learns_the_mean_the_spread_and_the_largest_memory() -> Result<()> {
        let ring = memory::ring(3, Duration::from_secs(5));
        let threads: Vec<_> = ring
            .into_iter()
            .enumerate()
            .map(|(rank, transport)| {
                std::thread::spawn(move || {
                    let mut comm = Communicator::new(Box::new(transport));
                    let mine = RankFigures {
                        loss: [1.0, 4.0, 2.5][rank],
                        peak_rss_bytes: [10, 30, 20][rank] << 20,
                        stop: rank == 1,
                    };
                    mine.gather(&mut comm, "test gather")
                })
            })
            .collect();
        for thread in threads {
            let figures = thread.join().expect("rank thread")?;
            assert_eq!(
                figures,
                JobFigures {
                    mean_loss: 7.5 / 3.0,
                    loss_spread: 3.0,
                    peak_rss_bytes: 30 << 20,
                    stop: true,
                }
            );
        }
        Ok(())
    }

    #[test]
    fn one_rank_has_no_spread() -> Result<()> {
        let mine = RankFigures {
            loss: 0.5,
            peak_rss_bytes: 7,
            stop: false,
        };
        let figures = mine.gather(&mut Communicator::single(), "single")?;
        assert_eq!(
            (figures.mean_loss, figures.loss_spread, figures.peak_rss_bytes),
            (0.5, 0.0, 7)
        );
        Ok(())
    }
}
