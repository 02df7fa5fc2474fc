//! Gradient merge: the gradients of `k` consecutive batches are accumulated on each rank and
//! all-reduced once, before one optimizer step — the step of a k-times larger batch, in the
//! memory of one batch and with a k-th of the communication.

use anyhow::{ensure, Result};

use crate::config::DistributedStrategy;

/// A gradient buffer that merges: host floats, or a flat tensor on the compute device.
pub trait MergeBuffer: Sized {
    /// The elementwise sum of two buffers of one length.
    fn plus(self, other: Self) -> Result<Self>;
    /// Every element divided by `k`.
    fn divided_by(self, k: f32) -> Result<Self>;
}

impl MergeBuffer for Vec<f32> {
    fn plus(mut self, other: Self) -> Result<Self> {
        self.iter_mut().zip(&other).for_each(|(s, v)| *s += v);
        Ok(self)
    }

    fn divided_by(self, k: f32) -> Result<Self> {
        Ok(self.into_iter().map(|g| g / k).collect())
    }
}

/// Accumulators of a rank's gradient buffers (one per fusion bucket, or one for all).
pub struct GradientMerge<B = Vec<f32>> {
    k: usize,
    avg: bool,
    sums: Vec<Option<B>>,
}

impl<B: MergeBuffer> GradientMerge<B> {
    /// Merging as `strategy` says, over `buffers` gradient buffers.
    pub fn new(strategy: &DistributedStrategy, buffers: usize) -> Self {
        Self {
            k: strategy.merge_steps(),
            avg: strategy.gradient_merge_configs.avg,
            sums: (0..buffers).map(|_| None).collect(),
        }
    }

    /// Drops the batches merged so far (a rollback abandons them).
    pub fn clear(&mut self) {
        self.sums.iter_mut().for_each(|sum| *sum = None);
    }

    /// Whether batch `batch` (counted from 0) completes a merge, so its optimizer step runs.
    pub fn completes(&self, batch: usize) -> bool {
        (batch + 1).is_multiple_of(self.k)
    }

    /// The optimizer step that batch `batch` belongs to (what the learning rate follows).
    pub fn optimizer_step(&self, batch: usize) -> usize {
        batch / self.k
    }

    /// Adds batch `batch`'s gradients of buffer `index`. On the batch that completes the
    /// merge, returns the merged buffer (the mean of the k batches', or their sum) and starts
    /// a new merge of that buffer.
    pub fn add(&mut self, batch: usize, index: usize, values: B) -> Result<Option<B>> {
        let sum = match self.sums[index].take() {
            None => values,
            Some(sum) => sum.plus(values)?,
        };
        if !self.completes(batch) {
            self.sums[index] = Some(sum);
            return Ok(None);
        }
        Ok(Some(if self.avg && self.k > 1 {
            sum.divided_by(self.k as f32)?
        } else {
            sum
        }))
    }
}

/// A run of `steps` batches must end on a merge boundary, or its last batches would never step.
pub fn check_run_length(strategy: &DistributedStrategy, steps: usize) -> Result<()> {
    let k = strategy.merge_steps();
    ensure!(
        steps.is_multiple_of(k),
        "the run has {steps} batches, not a multiple of strategy.gradient_merge_configs.k_steps = {k}: \
         the last {} would never reach an optimizer step",
        steps % k
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strategy(k: usize, avg: bool) -> DistributedStrategy {
        let mut s = DistributedStrategy {
            gradient_merge: true,
            ..DistributedStrategy::default()
        };
        s.gradient_merge_configs.k_steps = k;
        s.gradient_merge_configs.avg = avg;
        s
    }

    #[test]
    fn merges_k_batches_into_their_mean_or_sum() -> Result<()> {
        let mut mean = GradientMerge::new(&strategy(3, true), 1);
        let mut sum = GradientMerge::new(&strategy(3, false), 1);
        for batch in 0..6 {
            let values = vec![batch as f32, 1.0];
            let (m, s) = (mean.add(batch, 0, values.clone())?, sum.add(batch, 0, values)?);
            match batch {
                2 => assert_eq!((m.unwrap(), s.unwrap()), (vec![1.0, 1.0], vec![3.0, 3.0])),
                5 => assert_eq!(m.unwrap(), vec![4.0, 1.0]),
                _ => assert!(m.is_none() && s.is_none()),
            }
        }
        assert_eq!(mean.optimizer_step(5), 1);
        let mut off = GradientMerge::new(&DistributedStrategy::default(), 2);
        assert_eq!(off.add(0, 1, vec![2.0])?, Some(vec![2.0]));
        Ok(())
    }

    #[test]
    fn a_run_must_end_on_a_boundary() {
        assert!(check_run_length(&strategy(4, true), 8).is_ok());
        let msg = check_run_length(&strategy(4, true), 10).unwrap_err().to_string();
        assert!(msg.contains("k_steps = 4") && msg.contains("last 2"), "{msg}");
    }
}
