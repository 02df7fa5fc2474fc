//! An affine map `act(x W + b)` whose weight is split over a layer group.

use candle_core::{Tensor, Var};

use super::{enter, leave, slice_of, Group};
use crate::models::affine::affine;
use crate::models::Activation;

/// How an affine map's weight `W` (in, out) is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// By outputs: each rank holds its columns of `W` and its slice of `b`, and computes its
    /// slice of the outputs from the whole input.
    Columns,
    /// By inputs: each rank holds its rows of `W` and the whole `b`, takes its slice of the input
    /// (a column-split map's outputs); the partial outputs are summed over the group and the
    /// bias added once.
    Rows,
}

/// This rank's part of an affine map split over a group.
pub struct SplitAffine {
    /// This rank's part of `W`: (in, out / n) split by columns, (in / n, out) by rows.
    pub weight: Var,
    /// This rank's slice of `b` (by columns), or the whole `b` (by rows).
    pub bias: Var,
    activation: Activation,
    split: Split,
    group: Group,
}

impl SplitAffine {
    /// This rank's part, split as `split`, of the map of whole weight `weight` (in, out) and
    /// bias `bias` (out); the activation must be element-wise on the outputs' slices, so a map
    /// split by rows takes none.
    pub fn from_whole(
        weight: &Tensor,
        bias: &Tensor,
        activation: Activation,
        split: Split,
        group: &Group,
    ) -> anyhow::Result<Self> {
        let (rank, parts) = (group.rank(), group.size());
        let (weight, bias) = match split {
            Split::Columns => {
                let slice = slice_of(weight.dim(1)?, parts, rank, "a column-split map's outputs")?;
                (
                    weight.narrow(1, slice.start, slice.len())?,
                    bias.narrow(0, slice.start, slice.len())?,
                )
            }
            Split::Rows => {
                anyhow::ensure!(
                    activation == Activation::Identity,
                    "a row-split map sums partial outputs: its activation comes after the sum"
                );
                let slice = slice_of(weight.dim(0)?, parts, rank, "a row-split map's inputs")?;
                (weight.narrow(0, slice.start, slice.len())?, bias.clone())
            }
        };
        Ok(Self {
            weight: Var::from_tensor(&weight.contiguous()?)?,
            bias: Var::from_tensor(&bias.contiguous()?)?,
            activation,
            split,
            group: group.clone(),
        })
    }

    /// The outputs for `x` (…, in): this rank's slice of them (split by columns), or all of
    /// them from this rank's slice of the input (by rows).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (weight, bias) = (self.weight.as_tensor(), self.bias.as_tensor());
        match self.split {
            Split::Columns => affine(&enter(x, &self.group)?, weight, bias, self.activation),
            Split::Rows => {
                let no_bias = bias.zeros_like()?;
                let partial = affine(x, weight, &no_bias, Activation::Identity)?;
                leave(&partial, &self.group)?.broadcast_add(bias)
            }
        }
    }
}
