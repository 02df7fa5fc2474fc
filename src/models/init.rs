//! Seeded parameter initialisation: every rank, and the single-process
//! reference, builds bit-identical initial parameters from the job's seed.
//!
//! Each parameter's values are a [`Recipe`] of its name: a rank that keeps only a shard of the
//! parameters (sharded parameters) draws its shard's values alone, and never builds the whole
//! model ([`ParamInit::deferring`]).

use std::ops::Range;

use candle_core::{DType, Device, Var};

use super::{Param, Precision};
use crate::rng::SplitMix64;

/// How a parameter's first values are made.
#[derive(Debug, Clone)]
pub enum Recipe {
    /// Uniform in `[-bound, bound)`, drawn from the stream of the parameter's name.
    Uniform {
        /// The job's seed.
        seed: u64,
        /// The parameter's name.
        name: String,
        /// The bound.
        bound: f32,
    },
    /// Every value the same.
    Constant(f32),
}

impl Recipe {
    /// The values at `range` of the parameter's flat (row-major) values, the others not drawn.
    pub fn values(&self, range: Range<usize>) -> Vec<f32> {
        match self {
            Self::Uniform { seed, name, bound } => {
                let mut rng = SplitMix64::for_stream(*seed, name, 0);
                rng.skip(range.start as u64);
                range.map(|_| rng.uniform(-bound, *bound)).collect()
            }
            Self::Constant(value) => vec![*value; range.len()],
        }
    }
}

/// Creates parameters from a seed; each parameter's values depend only on
/// the seed and its name. It also tells the layers it builds how to compute their products.
#[derive(Debug, Clone)]
pub struct ParamInit {
    seed: u64,
    device: Device,
    products: Precision,
    /// Parameters are made released, their values drawn where a shard of them is taken.
    deferred: bool,
}

impl ParamInit {
    /// Initialiser for `seed`, placing tensors on `device`; the layers compute in f32.
    pub fn new(seed: u64, device: Device) -> Self {
        Self {
            seed,
            device,
            products: Precision::F32,
            deferred: false,
        }
    }

    /// The same, the layers' products computed in `products` (`strategy.amp`).
    pub fn with_products(self, products: Precision) -> Self {
        Self { products, ..self }
    }

    /// The same, where `deferred`, making every parameter released: its values are drawn from
    /// its recipe where a rank takes its shard of them (sharded parameters), so no rank holds
    /// the whole model at the start.
    pub fn deferring(self, deferred: bool) -> Self {
        Self { deferred, ..self }
    }

    /// What the layers' products are computed in.
    pub fn products(&self) -> Precision {
        self.products
    }

    /// The device parameters are placed on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Uniform in `[-bound, bound)`.
    pub fn uniform(&self, name: &str, shape: &[usize], bound: f32) -> candle_core::Result<Param> {
        let recipe = Recipe::Uniform {
            seed: self.seed,
            name: name.to_string(),
            bound,
        };
        self.make(shape, recipe)
    }

    /// Kaiming-uniform for a layer of `fan_in` inputs, as PyTorch's `Linear`
    /// does: bound `1/sqrt(fan_in)`.
    pub fn fan_in_uniform(&self, name: &str, shape: &[usize], fan_in: usize) -> candle_core::Result<Param> {
        self.uniform(name, shape, 1.0 / (fan_in.max(1) as f32).sqrt())
    }

    /// Every value `value`.
    pub fn constant(&self, shape: &[usize], value: f32) -> candle_core::Result<Param> {
        self.make(shape, Recipe::Constant(value))
    }

    fn make(&self, shape: &[usize], recipe: Recipe) -> candle_core::Result<Param> {
        if self.deferred {
            return Ok(Param::deferred(shape, DType::F32, &self.device, recipe));
        }
        let count = shape.iter().product();
        Ok(Param::new(Var::from_vec(recipe.values(0..count), shape, &self.device)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deferred_parameter_draws_any_range_of_the_values_a_whole_one_holds() -> candle_core::Result<()> {
        let init = ParamInit::new(3, Device::Cpu);
        let whole = init.uniform("w", &[4, 5], 0.5)?;
        let deferred = init.clone().deferring(true).uniform("w", &[4, 5], 0.5)?;
        assert!(!deferred.is_held());
        let all = whole.var()?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(deferred.values(7..13)?.to_vec1::<f32>()?, all[7..13]);
        assert_eq!(whole.values(7..13)?.to_vec1::<f32>()?, all[7..13]);
        let ones = init.deferring(true).constant(&[3], 1.0)?;
        assert_eq!(ones.values(0..3)?.to_vec1::<f32>()?, vec![1.0; 3]);
        Ok(())
    }
}
