//! An affine map `act(x W + b)` whose weight is split over a layer group.

use candle_core::{Tensor, Var};

use crate::models::Param;

use super::{enter, leave, slice_of, Group};
use crate::models::affine::{affine, Precision};
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
    pub weight: Param,
    /// This rank's slice of `b` (by columns), or the whole `b` (by rows).
    pub bias: Param,
    activation: Activation,
    /// What its products are computed in.
    products: Precision,
    split: Split,
    group: Group,
}

impl SplitAffine {
    /// This rank's part, split as `split`, of the map of whole weight `weight` (in, out) and
    /// bias `bias` (out), computing as `activation` and `products` say; a map split by rows applies its activation
    /// after the sum.
    pub fn from_whole(
        (weight, bias): (&Tensor, &Tensor),
        (activation, products): (Activation, Precision),
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
                let slice = slice_of(weight.dim(0)?, parts, rank, "a row-split map's inputs")?;
                (weight.narrow(0, slice.start, slice.len())?, bias.clone())
            }
        };
        Ok(Self {
            weight: Param::new(Var::from_tensor(&weight.contiguous()?)?),
            bias: Param::new(Var::from_tensor(&bias.contiguous()?)?),
            activation,
            products,
            split,
            group: group.clone(),
        })
    }

    /// The outputs for `x` (…, in): this rank's slice of them (split by columns), or all of
    /// them from this rank's slice of the input (by rows).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (weight, bias) = (self.weight.var()?, self.bias.var()?);
        let (weight, bias) = (weight.as_tensor(), bias.as_tensor());
        match self.split {
            Split::Columns => affine(&enter(x, &self.group)?, weight, bias, (self.activation, self.products)),
            Split::Rows => {
                let no_bias = bias.zeros_like()?;
                let partial = affine(x, weight, &no_bias, (Activation::Identity, self.products))?;
                let y = leave(&partial, &self.group)?.broadcast_add(bias)?;
                match self.activation {
                    Activation::Identity => Ok(y),
                    Activation::Relu => y.relu(),
                }
            }
        }
    }

    /// The dimensions along which the group splits the weight and the bias (`None`: whole).
    pub fn split_dims(&self) -> (Option<usize>, Option<usize>) {
        match self.split {
            Split::Columns => (Some(1), Some(0)),
            Split::Rows => (Some(0), None),
        }
    }
}

/// An affine map, whole or this rank's part of one split over a layer group.
pub enum AffineMap {
    /// The whole map `act(x W + b)`, `W` stored (in, out).
    Whole {
        /// `W`.
        weight: Param,
        /// `b`.
        bias: Param,
        /// `act`.
        activation: Activation,
        /// What its products are computed in.
        products: Precision,
    },
    /// This rank's part of the map.
    Split(SplitAffine),
}

impl AffineMap {
    /// This rank's part of the whole map, split as `split` over `group`.
    pub fn split(self, split: Split, group: &Group) -> anyhow::Result<Self> {
        let Self::Whole {
            weight,
            bias,
            activation,
            products,
        } = self
        else {
            anyhow::bail!("an affine map is split once");
        };
        let (weight, bias) = (weight.var()?, bias.var()?);
        let part = SplitAffine::from_whole(
            (weight.as_tensor(), bias.as_tensor()),
            (activation, products),
            split,
            group,
        )?;
        Ok(Self::Split(part))
    }

    /// The outputs for `x` (…, in); split by columns, this rank's slice of them.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Whole {
                weight,
                bias,
                activation,
                products,
            } => affine(
                x,
                weight.var()?.as_tensor(),
                bias.var()?.as_tensor(),
                (*activation, *products),
            ),
            Self::Split(part) => part.forward(x),
        }
    }

    /// `("{prefix}.weight", W)` and `("{prefix}.bias", b)` (`"weight"`, `"bias"` under an empty
    /// prefix), as this rank holds them.
    pub fn parameters(&self, prefix: &str) -> [(String, Param); 2] {
        let (weight, bias) = match self {
            Self::Whole { weight, bias, .. } => (weight, bias),
            Self::Split(part) => (&part.weight, &part.bias),
        };
        [
            (named(prefix, "weight"), weight.clone()),
            (named(prefix, "bias"), bias.clone()),
        ]
    }

    /// The parameters of [`parameters`](Self::parameters) the group splits, with the dimension
    /// it splits them along.
    pub fn split_parameters(&self, prefix: &str) -> Vec<(String, usize)> {
        let Self::Split(part) = self else {
            return Vec::new();
        };
        let (weight, bias) = part.split_dims();
        [("weight", weight), ("bias", bias)]
            .into_iter()
            .filter_map(|(name, dim)| dim.map(|dim| (named(prefix, name), dim)))
            .collect()
    }
}

/// `"{prefix}.{name}"`, or `name` alone under no prefix.
fn named(prefix: &str, name: &str) -> String {
    match prefix {
        "" => name.to_string(),
        _ => format!("{prefix}.{name}"),
    }
}
