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

pub use affine::{Split, SplitAffine};
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

    /// The largest of the ranks' `values`, element by element.
    fn max(&self, values: Vec<f32>, what: &'static str) -> anyhow::Result<Vec<f32>>;
}

/// A layer group, shared by the layers it splits.
pub type Group = Arc<dyn LayerGroup>;

/// The part `rank` of `parts` holds of `len` values: equal slices (checked to divide).
pub fn slice_of(len: usize, parts: usize, rank: usize, what: &str) -> anyhow::Result<std::ops::Range<usize>> {
    anyhow::ensure!(
        parts > 0 && len.is_multiple_of(parts),
        "{what}: {len} does not split into {parts} equal parts"
    );
    let size = len / parts;
    Ok(rank * size..(rank + 1) * size)
}

/// `sum` or `max` of a group, as candle's error (inside autograd ops).
fn collective(result: anyhow::Result<Vec<f32>>) -> candle_core::Result<Vec<f32>> {
    result.map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
}
