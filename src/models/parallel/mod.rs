//! Tensor (model) parallelism's layers, Megatron's layout: a layer's weights split over the ranks
//! of a [`LayerGroup`]. An affine map split by columns computes its slice of the outputs from the
//! whole input, one split by rows its part of the outputs from its slice of the input, so a pair
//! — columns then rows, as an MLP's two maps or attention's projections in and out — needs one
//! collective forward (the sum of the row-split map's partial outputs) and one backward (the sum
//! of the column-split map's input gradients), and nothing between. Both collectives are
//! autograd ops ([`enter`], [`leave`]), so backward through any model built of these layers runs
//! them where they belong. The vocabulary splits the same way ([`vocab`]): the token table's rows
//! and the logits, whose cross-entropy is never gathered.
//!
//! The layers see the group through [`LayerGroup`], which the collective layer implements over a
//! ring of its own; the group's collectives are called from the device thread in forward and
//! backward order, the same on every rank of the group. CPU tensors only, in f32.

mod affine;
mod ops;
pub mod vocab;

use std::sync::Arc;

pub use affine::{AffineMap, Split, SplitAffine};
pub use ops::{enter, leave};

/// The ranks that split a layer between them, as the layers see them.
pub trait LayerGroup: Send + Sync {
    /// This rank's place in the group.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn size(&self) -> usize;

    /// `values` summed over the group, element by element (every rank passes as many); `what`
    /// names the collective in errors.
    fn sum(&self, values: Vec<f32>, what: &'static str) -> anyhow::Result<Vec<f32>>;

    /// Every rank's `bytes`, in rank order (each rank may pass another length).
    fn gather(&self, bytes: Vec<u8>, what: &'static str) -> anyhow::Result<Vec<Vec<u8>>>;

    /// The largest of the ranks' `values`, element by element.
    fn max(&self, values: Vec<f32>, what: &'static str) -> anyhow::Result<Vec<f32>> {
        let mut largest = values.clone();
        for bytes in self.gather(bytemuck::cast_slice(&values).to_vec(), what)? {
            let theirs: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
            anyhow::ensure!(
                theirs.len() == largest.len(),
                "{what}: a rank passed another number of values"
            );
            largest.iter_mut().zip(theirs).for_each(|(l, v)| *l = l.max(v));
        }
        Ok(largest)
    }
}

/// The group of a rank that splits nothing: every layer whole, every collective the identity.
pub struct Alone;

impl LayerGroup for Alone {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn sum(&self, values: Vec<f32>, _: &'static str) -> anyhow::Result<Vec<f32>> {
        Ok(values)
    }

    fn gather(&self, bytes: Vec<u8>, _: &'static str) -> anyhow::Result<Vec<Vec<u8>>> {
        Ok(vec![bytes])
    }
}

/// What a block of a model split over a group takes in or hands on: whole on every rank, or
/// each rank's slice `range` of the last dimension (a column-split map's outputs, a
/// vocabulary's logits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Flow {
    /// Every rank holds all of it.
    Whole,
    /// This rank holds `range` of the last dimension.
    Sliced(std::ops::Range<usize>),
}

/// A layer group, shared by the layers it splits.
pub type Group = Arc<dyn LayerGroup>;

/// The part `rank` of `parts` holds of `len` values: equal slices (checked to divide).
pub fn slice_of(len: usize, parts: usize, rank: usize, what: &str) -> anyhow::Result<std::ops::Range<usize>> {
    anyhow::ensure!(
        parts > 0 && len.is_multiple_of(parts),
        "{what}: {len} does not split into {parts} equal parts"
    );
    Ok(balanced_slice(len, parts, rank))
}

/// The part `rank` of `parts` holds of `len` values, in order: the first `len % parts` ranks one
/// more than the others (equal slices where `parts` divides `len`).
pub fn balanced_slice(len: usize, parts: usize, rank: usize) -> std::ops::Range<usize> {
    let (size, more) = (len / parts, len % parts);
    let start = rank * size + rank.min(more);
    start..start + size + usize::from(rank < more)
}

/// A group's collective, as candle's error (inside autograd ops).
fn collective<T>(result: anyhow::Result<T>) -> candle_core::Result<T> {
    result.map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
}
