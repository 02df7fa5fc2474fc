//! The affine maps inside the GPT blocks.

use crate::models::parallel::AffineMap;
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

/// A map `inputs → outputs`, `y = x W + b` on rows, `W` stored (in, out) like
/// [`crate::models::Linear`] so no gradient goes through a transposed view; named
/// `"{name}.weight"`. Unlike `Linear` it starts GPT-2's way: weights of standard deviation `std`,
/// bias zero. Under tensor parallelism a rank holds its part of it ([`AffineMap::split`]).
pub(super) fn dense(
    name: &str,
    inputs: usize,
    outputs: usize,
    std: f32,
    init: &ParamInit,
) -> candle_core::Result<AffineMap> {
    Ok(AffineMap::Whole {
        weight: init.uniform(&format!("{name}.weight"), &[inputs, outputs], uniform_bound(std))?,
        bias: init.constant(&[outputs], 0.0)?,
        activation: Activation::Identity,
        products: init.products(),
    })
}
