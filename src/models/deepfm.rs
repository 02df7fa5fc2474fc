//! DeepFM (Guo et al. 2017; PaddleRec's second flagship CTR model) over Criteo's 26 sparse slots
//! and 13 dense features.
//!
//! Every one of the 39 fields has a factor vector of width `embedding_dim`: a sparse slot's is
//! its id's row of the `embedding` table, a dense feature's is its value times a learned vector
//! (the `dense_factors` block). Then
//! `logit = first order + FM + deep`, where the first order is `Σ first_order rows + w·dense + b`,
//! the FM term is `½ Σ_k [(Σ_f v_fk)² − Σ_f v_fk²]` over the fields' factors (every pairwise
//! inner product, in linear time), and the deep tower reads the fields' factors concatenated.

use anyhow::{ensure, Result};
use candle_core::{Tensor, Var};

use super::sparse::{Lookup, SparseModel, SparseTableSpec};
use super::tower::{run_tower, tower};
use super::{Activation, Block, Linear, ParamInit, DENSE_FEATURES, SPARSE_SLOTS};

/// DeepFM. Tables: `embedding` (width `embedding_dim`, read by every slot) and `first_order`
/// (width 1, read by every slot).
pub struct DeepFm {
    dense_factors: DenseFactors,
    first_order_dense: Linear,
    deep: Vec<Linear>,
    embedding_dim: usize,
}

impl DeepFm {
    /// A model with factors of width `embedding_dim` and deep layers `hidden`, its dense
    /// parameters drawn from `init`.
    pub fn new(embedding_dim: usize, hidden: &[usize], init: &ParamInit) -> Result<Self> {
        ensure!(embedding_dim > 0, "the embedding width must be at least 1");
        let fields = SPARSE_SLOTS + DENSE_FEATURES;
        Ok(Self {
            dense_factors: DenseFactors {
                weight: init.uniform(
                    "dense_factors.weight",
                    &[DENSE_FEATURES, embedding_dim],
                    1.0 / (embedding_dim as f32).sqrt(),
                )?,
            },
            first_order_dense: Linear::new("first_order_dense", DENSE_FEATURES, 1, Activation::Identity, init)?,
            deep: tower("deep", fields * embedding_dim, hidden, init)?,
            embedding_dim,
        })
    }
}

impl SparseModel for DeepFm {
    fn tables(&self) -> Vec<SparseTableSpec> {
        let width = self.embedding_dim;
        vec![
            SparseTableSpec::new("embedding", width, 1.0 / (width as f32).sqrt(), 0..SPARSE_SLOTS),
            SparseTableSpec::new("first_order", 1, 0.01, 0..SPARSE_SLOTS),
        ]
    }

    fn blocks(&self) -> Vec<&dyn Block> {
        let mut blocks: Vec<&dyn Block> = vec![&self.dense_factors, &self.first_order_dense];
        blocks.extend(self.deep.iter().map(|layer| layer as &dyn Block));
        blocks
    }

    fn logits(&self, dense: &Tensor, lookups: &[Lookup<'_>]) -> candle_core::Result<Tensor> {
        let [embedding, first_order] = lookups else {
            candle_core::bail!("DeepFM reads 2 tables, given {}", lookups.len());
        };
        let batch = dense.dim(0)?;
        let first = (first_order
            .embedded(batch)?
            .reshape((batch, SPARSE_SLOTS))?
            .sum_keepdim(1)?
            + self.first_order_dense.forward(dense)?)?;
        // (batch, 39, width): the sparse fields' factors, then the dense ones'.
        let factors = Tensor::cat(&[&embedding.embedded(batch)?, &self.dense_factors.forward(dense)?], 1)?;
        let fm = pairwise_interactions(&factors)?;
        let fields = SPARSE_SLOTS + DENSE_FEATURES;
        let deep = run_tower(&self.deep, factors.reshape((batch, fields * self.embedding_dim))?)?;
        ((first + fm)? + deep)?.squeeze(1)
    }
}

/// The FM term of `(batch, fields, width)` factors, `(batch, 1)`: the sum over field pairs of
/// their factors' inner products, as `½ Σ_k [(Σ_f v_fk)² − Σ_f v_fk²]`.
fn pairwise_interactions(factors: &Tensor) -> candle_core::Result<Tensor> {
    let square_of_sum = factors.sum(1)?.sqr()?;
    let sum_of_squares = factors.sqr()?.sum(1)?;
    (square_of_sum - sum_of_squares)?.sum_keepdim(1)? * 0.5
}

/// The dense features' factor vectors: `(batch, 13)` values to `(batch, 13, width)` factors,
/// each feature's value times its learned vector.
struct DenseFactors {
    weight: Var,
}

impl Block for DenseFactors {
    fn name(&self) -> &str {
        "dense_factors"
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.unsqueeze(2)?.broadcast_mul(&self.weight.as_tensor().unsqueeze(0)?)
    }

    fn parameters(&self) -> Vec<(String, Var)> {
        vec![("weight".to_string(), self.weight.clone())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::wide_deep::tests::logits_of_ones;
    use candle_core::{DType, Device};

    #[test]
    fn the_fm_term_sums_every_pairwise_inner_product() -> Result<()> {
        let init = ParamInit::new(3, Device::Cpu);
        let width = 3;
        let model = DeepFm::new(width, &[4], &init)?;
        let factors = init.uniform("probe", &[2, SPARSE_SLOTS + DENSE_FEATURES, width], 1.0)?;
        let fast = pairwise_interactions(factors.as_tensor())?;
        let values: Vec<Vec<Vec<f32>>> = factors.as_tensor().to_vec3()?;
        for (sample, got) in values.iter().zip(fast.flatten_all()?.to_vec1::<f32>()?) {
            let mut pairs = 0.0f64;
            for i in 0..sample.len() {
                for j in i + 1..sample.len() {
                    pairs += sample[i]
                        .iter()
                        .zip(&sample[j])
                        .map(|(a, b)| f64::from(a * b))
                        .sum::<f64>();
                }
            }
            assert!((f64::from(got) - pairs).abs() < 1e-4, "{got} vs {pairs}");
        }
        assert_eq!(logits_of_ones(&model, 3)?.dims(), &[3]);
        let names: Vec<String> = model.parameters().into_iter().map(|(n, _)| n).collect();
        assert!(names.contains(&"dense_factors.weight".to_string()), "{names:?}");
        let zeros = Tensor::zeros((1, DENSE_FEATURES), DType::F32, &Device::Cpu)?;
        assert_eq!(model.dense_factors.forward(&zeros)?.dims(), &[1, DENSE_FEATURES, width]);
        Ok(())
    }
}
