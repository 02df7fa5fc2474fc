//! The affine maps inside the GPT blocks.

use candle_core::{DType, Tensor, Var};

use crate::models::affine::affine;
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
/// GPT-2's way: weights of a chosen standard deviation, bias zero.
pub(super) struct Dense {
    weight: Var,
    bias: Var,
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
        Ok(Self {
            weight: init.uniform(&format!("{name}.weight"), &[inputs, outputs], uniform_bound(std))?,
            bias: Var::zeros(outputs, DType::F32, init.device())?,
        })
    }

    /// `x` of shape (rows, inputs) → (rows, outputs).
    pub(super) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        affine(x, self.weight.as_tensor(), self.bias.as_tensor(), Activation::Identity)
    }

    /// `"{prefix}.weight"`, `"{prefix}.bias"`.
    pub(super) fn parameters(&self, prefix: &str) -> Vec<(String, Var)> {
        vec![
            (format!("{prefix}.weight"), self.weight.clone()),
            (format!("{prefix}.bias"), self.bias.clone()),
        ]
    }
}
