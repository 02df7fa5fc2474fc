//! Seeded parameter initialisation: every rank, and the single-process
//! reference, builds bit-identical initial parameters from the job's seed.

use candle_core::{Device, Tensor, Var};

use super::Precision;
use crate::rng::SplitMix64;

/// Creates parameters from a seed; each parameter's values depend only on
/// the seed and its name. It also tells the layers it builds how to compute their products.
#[derive(Debug, Clone)]
pub struct ParamInit {
    seed: u64,
    device: Device,
    products: Precision,
}

impl ParamInit {
    /// Initialiser for `seed`, placing tensors on `device`; the layers compute in f32.
    pub fn new(seed: u64, device: Device) -> Self {
        Self {
            seed,
            device,
            products: Precision::F32,
        }
    }

    /// The same, the layers' products computed in `products` (`strategy.amp`).
    pub fn with_products(self, products: Precision) -> Self {
        Self { products, ..self }
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
    pub fn uniform(&self, name: &str, shape: &[usize], bound: f32) -> candle_core::Result<Var> {
        let mut rng = SplitMix64::for_stream(self.seed, name, 0);
        let count = shape.iter().product();
        let values: Vec<f32> = (0..count).map(|_| rng.uniform(-bound, bound)).collect();
        Var::from_tensor(&Tensor::from_vec(values, shape, &self.device)?)
    }

    /// Kaiming-uniform for a layer of `fan_in` inputs, as PyTorch's `Linear`
    /// does: bound `1/sqrt(fan_in)`.
    pub fn fan_in_uniform(&self, name: &str, shape: &[usize], fan_in: usize) -> candle_core::Result<Var> {
        self.uniform(name, shape, 1.0 / (fan_in.max(1) as f32).sqrt())
    }
}
