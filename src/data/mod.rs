//! Datasets and the sharded loader each trainer reads its part from.
//!
//! A [`Dataset`] is a dense classification set held in memory; the
//! [`ShardedLoader`] cuts each global batch into one slice per rank, so that
//! `world_size` ranks together see exactly the batches one process would.

pub mod ctr;
mod digits;
mod loader;
mod synthetic;
pub mod text;

pub use loader::{Batch, ShardedLoader};

use anyhow::{ensure, Result};

use crate::rng::SplitMix64;

/// A dense classification dataset: `len()` rows of `dim` features and a
/// label in `0..classes` each.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// Row-major features, `len() * dim` values.
    pub features: Vec<f32>,
    /// One class index per row.
    pub labels: Vec<u32>,
    /// Features per row.
    pub dim: usize,
    /// Number of classes (labels are below it).
    pub classes: usize,
}

impl Dataset {
    /// Builds a dataset, checking that the shapes agree.
    pub fn new(features: Vec<f32>, labels: Vec<u32>, dim: usize, classes: usize) -> Result<Self> {
        ensure!(dim > 0, "a dataset needs at least one feature per row");
        ensure!(
            features.len() == labels.len() * dim,
            "dataset has {} feature values for {} rows of {dim}",
            features.len(),
            labels.len()
        );
        if let Some(bad) = labels.iter().find(|&&l| l as usize >= classes) {
            anyhow::bail!("label {bad} is not below the class count {classes}");
        }
        Ok(Self {
            features,
            labels,
            dim,
            classes,
        })
    }

    /// The UCI handwritten digits (1,797 8×8 images), pixels scaled to [0, 1].
    pub fn digits() -> Result<Self> {
        digits::load()
    }

    /// `rows` samples of a planted linear teacher: learnable, of any size.
    pub fn synthetic(rows: usize, dim: usize, classes: usize, seed: u64) -> Result<Self> {
        synthetic::generate(rows, dim, classes, seed)
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when the dataset has no rows.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The rows at `indices`, in that order.
    pub fn select(&self, indices: &[usize]) -> Batch {
        let mut features = Vec::with_capacity(indices.len() * self.dim);
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            features.extend_from_slice(&self.features[i * self.dim..(i + 1) * self.dim]);
            labels.push(self.labels[i]);
        }
        Batch {
            features,
            labels,
            dim: self.dim,
        }
    }

    /// A deterministic shuffled split into (train, test), `test_fraction` of
    /// the rows going to test.
    pub fn split(&self, test_fraction: f64, seed: u64) -> Result<(Dataset, Dataset)> {
        let test_rows = ((self.len() as f64) * test_fraction).round() as usize;
        ensure!(
            test_rows > 0 && test_rows < self.len(),
            "test fraction {test_fraction} leaves an empty train or test set of {} rows",
            self.len()
        );
        let mut order: Vec<usize> = (0..self.len()).collect();
        SplitMix64::for_stream(seed, "split", 0).shuffle(&mut order);
        let (test, train) = order.split_at(test_rows);
        let to_set = |idx: &[usize]| {
            let b = self.select(idx);
            Dataset {
                features: b.features,
                labels: b.labels,
                dim: self.dim,
                classes: self.classes,
            }
        };
        Ok((to_set(train), to_set(test)))
    }
}

/// Every loader's precondition: `rank` is in the world and the global batch splits into equal,
/// non-empty rank batches (so ranks together read exactly the batch one process would).
pub(crate) fn check_rank_batch(global_batch: usize, rank: usize, world_size: usize) -> Result<()> {
    ensure!(
        world_size > 0 && rank < world_size,
        "rank {rank} is outside world size {world_size}"
    );
    ensure!(
        global_batch > 0 && global_batch.is_multiple_of(world_size),
        "global batch {global_batch} does not divide into {world_size} equal rank batches"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_load_with_expected_shape() -> anyhow::Result<()> {
        let d = Dataset::digits()?;
        assert_eq!(d.len(), 1797);
        assert_eq!(d.dim, 64);
        assert_eq!(d.classes, 10);
        assert!(d.features.iter().all(|&x| (0.0..=1.0).contains(&x)));
        Ok(())
    }

    #[test]
    fn split_is_deterministic_and_disjoint_in_size() -> anyhow::Result<()> {
        let d = Dataset::digits()?;
        let (a, b) = d.split(0.2, 1)?;
        let (a2, _) = d.split(0.2, 1)?;
        assert_eq!(a, a2);
        assert_eq!(a.len() + b.len(), d.len());
        assert_eq!(b.len(), 359);
        Ok(())
    }

    #[test]
    fn bad_shapes_are_rejected() {
        assert!(Dataset::new(vec![0.0; 5], vec![0, 1], 2, 2).is_err());
        assert!(Dataset::new(vec![0.0; 4], vec![0, 2], 2, 2).is_err());
    }
}
