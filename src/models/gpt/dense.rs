//! The affine maps inside the GPT blocks.

use candle_core::{DType, Tensor, Var};

use crate::models::affine::affine;
use crate::models::parallel::{Group, Split, SplitAffine};
use crate::models::{Activation, ParamInit};

/// Standard deviation of GPT-2's initial weights.
pub(super) const INIT_STD: f32 = 0.02;

/// Uniform bound with standard deviation `std` (a uniform on [−b, b) has
/// standard deviation b/√3): GPT-2's scale from the seeded uniform
/// [`ParamInit`] draws, since only the scale, not the bell shape, matters at
/// this size.
pub(super) fn uniform_bound(std: f32) -> f32 {
    std * 3f32.sqrt()
}

/// `y = x W + b` on rows, `W` stored (in, out) like [`crate::models::Linear`]
/// so no gradient goes through a transposed view. Unlike `Linear` it starts
/// GPT-2's way: weights of a chosen standard deviation, bias zero. Under
/// tensor parallelism a rank holds its part of it ([`Dense::split`]).
pub(super) enum Dense {
    /// The whole map.
    Whole { weight: Var, bias: Var },
    /// This rank's part of a map split over a layer group.
    Split(SplitAffine),
}

impl Dense {
    /// A map `inputs → outputs` whose weights, named `"{name}.weight"`, have
    /// standard deviation `std`.
    pub(super) fn new(
        name: &str,
        inputs: usize,
        outputs: usize,
        std: f32,
        init: &ParamInit,
    ) -> candle_core::Result<Self> {
        Ok(Self::Whole {
            weight: init.uniform(&format!("{name}.weight"), &[inputs, outputs], uniform_bound(std))?,
            bias: Var::zeros(outputs, DType::F32, init.device())?,
        })
    }

    /// This rank's part of the whole map, split as `split` over `group`.
    pub(super) fn split(self, split: Split, group: &Group) -> anyhow::Result<Self> {
        let (weight, bias) = self.weight_and_bias();
        let part = SplitAffine::from_whole(weight.as_tensor(), bias.as_tensor(), Activation::Identity, split, group)?;
        Ok(Self::Split(part))
    }

    /// `x` of shape (rows, inputs) → (rows, outputs): this rank's slice of the outputs of a map
    /// split by columns.
    pub(super) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Whole { weight, bias } => affine(x, weight.as_tensor(), bias.as_tensor(), Activation::Identity),
            Self::Split(part) => part.forward(x),
        }
    }

    /// The weight and bias this rank holds.
    fn weight_and_bias(&self) -> (&Var, &Var) {
        match self {
            Self::Whole { weight, bias } => (weight, bias),
            Self::Split(part) => (&part.weight, &part.bias),
        }
    }

    /// `"{prefix}.weight"`, `"{prefix}.bias"`.
    pub(super) fn parameters(&self, prefix: &str) -> Vec<(String, Var)> {
        let (weight, bias) = self.weight_and_bias();
        vec![
            (format!("{prefix}.weight"), weight.clone()),
            (format!("{prefix}.bias"), bias.clone()),
        ]
    }
}
