//! Datasets and the sharded loader each trainer reads its part from.
//!
//! A [`Dataset`] is held in memory: rows of dense features with a class
//! each, or windows of token ids with the next token of every position; the
//! [`ShardedLoader`] cuts each global batch into one slice per rank, so that
//! `world_size` ranks together see exactly the batches one process would.

pub mod ctr;
mod digits;
mod loader;
pub(crate) mod parts;
mod synthetic;
pub mod table;
mod targets;
pub mod text;

pub(crate) use loader::RankBatches;
pub use loader::{Batch, Pieces, RowSource, ShardedLoader};
pub use parts::DataPosition;
pub use targets::Targets;

use anyhow::{ensure, Result};

use crate::rng::SplitMix64;

/// A model's inputs, row-major.
#[derive(Debug, Clone, PartialEq)]
pub enum Inputs {
    /// Dense features.
    Features(Vec<f32>),
    /// Token ids.
    Tokens(Vec<u32>),
}

impl Inputs {
    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            Self::Features(v) => v.len(),
            Self::Tokens(v) => v.len(),
        }
    }

    /// True when no values are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows `indices` of `width` values each, in that order.
    fn select(&self, indices: &[usize], width: usize) -> Self {
        match self {
            Self::Features(v) => Self::Features(select_rows(v, indices, width)),
            Self::Tokens(v) => Self::Tokens(select_rows(v, indices, width)),
        }
    }
}

/// Rows `indices` of row-major `values`, `width` each, in that order: what inputs and targets
/// both select.
fn select_rows<T: Copy>(values: &[T], indices: &[usize], width: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(indices.len() * width);
    for &i in indices {
        out.extend_from_slice(&values[i * width..(i + 1) * width]);
    }
    out
}

/// `len()` rows of `dim` inputs each, with a class in `0..outputs` per row (classification) or
/// per input (the next token after each of a window's tokens), or `outputs` values per row
/// (regression).
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// Row-major inputs, `len() * dim` values.
    pub inputs: Inputs,
    /// One class per row, `dim` next tokens per row, or `outputs` values per row.
    pub targets: Targets,
    /// Inputs per row.
    pub dim: usize,
    /// The width of a model's output: the number of classes (the vocabulary for tokens), or of
    /// values regressed per row.
    pub outputs: usize,
}

impl Dataset {
    /// A classification dataset of dense features, checking that the shapes agree.
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
            inputs: Inputs::Features(features),
            targets: Targets::Classes(labels),
            dim,
            outputs: classes,
        })
    }

    /// A regression dataset: `dim` features and `outputs` values per row.
    pub fn regression(features: Vec<f32>, values: Vec<f32>, dim: usize, outputs: usize) -> Result<Self> {
        ensure!(
            dim > 0 && outputs > 0,
            "a dataset needs at least one feature and one target per row"
        );
        let rows = features.len() / dim;
        ensure!(
            features.len() == rows * dim && values.len() == rows * outputs,
            "dataset has {} feature values and {} targets, not rows of {dim} and {outputs}",
            features.len(),
            values.len()
        );
        Ok(Self {
            inputs: Inputs::Features(features),
            targets: Targets::Values(values),
            dim,
            outputs,
        })
    }

    /// Language-model windows over `tokens` (ids below `vocab`): row `i` is the `block_size`
    /// tokens from `i · stride`, its labels the token after each of them.
    pub fn token_windows(tokens: &[u32], block_size: usize, stride: usize, vocab: usize) -> Result<Self> {
        ensure!(block_size > 0 && stride > 0, "windows need a block size and a stride");
        ensure!(
            tokens.len() > block_size,
            "{} tokens cannot hold a window of {block_size} inputs and its last target",
            tokens.len()
        );
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            anyhow::bail!("token {bad} is not below the vocabulary size {vocab}");
        }
        let starts: Vec<usize> = (0..tokens.len() - block_size).step_by(stride).collect();
        let (mut inputs, mut labels) = (Vec::new(), Vec::new());
        for &start in &starts {
            inputs.extend_from_slice(&tokens[start..start + block_size]);
            labels.extend_from_slice(&tokens[start + 1..start + block_size + 1]);
        }
        Ok(Self {
            inputs: Inputs::Tokens(inputs),
            targets: Targets::Classes(labels),
            dim: block_size,
            outputs: vocab,
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
        self.inputs.len() / self.dim
    }

    /// True when the dataset has no rows.
    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }

    /// The rows at `indices`, in that order.
    pub fn select(&self, indices: &[usize]) -> Batch {
        let per_row = self.targets.len() / self.len().max(1);
        Batch {
            inputs: self.inputs.select(indices, self.dim),
            targets: self.targets.select(indices, per_row),
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
                inputs: b.inputs,
                targets: b.targets,
                dim: self.dim,
                outputs: self.outputs,
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
        assert_eq!(d.outputs, 10);
        let Inputs::Features(pixels) = &d.inputs else {
            anyhow::bail!("digits are dense features")
        };
        assert!(pixels.iter().all(|&x| (0.0..=1.0).contains(&x)));
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
    fn windows_hold_their_next_tokens() -> anyhow::Result<()> {
        let tokens: Vec<u32> = (0..10).collect();
        let d = Dataset::token_windows(&tokens, 4, 2, 10)?;
        // Starts 0, 2, 4: the last window needs a target after it.
        assert_eq!((d.len(), d.dim), (3, 4));
        let b = d.select(&[2, 0]);
        assert_eq!(b.inputs, Inputs::Tokens(vec![4, 5, 6, 7, 0, 1, 2, 3]));
        assert_eq!(b.targets, Targets::Classes(vec![5, 6, 7, 8, 1, 2, 3, 4]));
        assert!(Dataset::token_windows(&tokens, 10, 1, 10).is_err());
        assert!(Dataset::token_windows(&tokens, 4, 1, 9).is_err());
        Ok(())
    }

    #[test]
    fn bad_shapes_are_rejected() {
        assert!(Dataset::new(vec![0.0; 5], vec![0, 1], 2, 2).is_err());
        assert!(Dataset::new(vec![0.0; 4], vec![0, 2], 2, 2).is_err());
    }
}
