//! DeepFM (Guo et al. 2017; PaddleRec's second flagship CTR model) over a click log's sparse
//! slots and dense features (Criteo's 26 and 13, or a schema's).
//!
//! Every field (slot or dense feature) has a factor vector of width `embedding_dim`: a sparse slot's is
//! its id's row of the `embedding` table, a dense feature's is its value times a learned vector
//! (the `dense_factors` block). Then
//! `logit = first order + FM + deep`, where the first order is `Σ first_order rows + w·dense + b`,
//! the FM term is `½ Σ_k [(Σ_f v_fk)² − Σ_f v_fk²]` over the fields' factors (every pairwise
//! inner product, in linear time), and the deep tower reads the fields' factors concatenated.

use anyhow::{ensure, Result};
use candle_core::Tensor;

use super::sparse::{Lookup, SparseModel, SparseTableSpec};
use super::tower::{run_tower, tower};
use super::{Activation, Block, Linear, Param, ParamInit};
use crate::data::ctr::CtrShape;

/// DeepFM. Tables: `embedding` (width `embedding_dim`, read by every slot) and `first_order`
/// (width 1, read by every slot). A log without dense columns has no dense blocks.
pub struct DeepFm {
    /// The dense features' factors and first-order weights; `None` without dense features.
    dense: Option<(DenseFactors, Linear)>,
    deep: Vec<Linear>,
    embedding_dim: usize,
    shape: CtrShape,
}

impl DeepFm {
    /// A model of `shape`d records with factors of width `embedding_dim` and deep layers
    /// `hidden`, its dense parameters drawn from `init`.
    pub fn new(shape: CtrShape, embedding_dim: usize, hidden: &[usize], init: &ParamInit) -> Result<Self> {
        ensure!(embedding_dim > 0, "the embedding width must be at least 1");
        ensure!(shape.slots > 0, "a CTR model needs at least one sparse slot");
        let fields = shape.slots + shape.dense;
        let dense = (shape.dense > 0)
            .then(|| -> Result<_> {
                let bound = 1.0 / (embedding_dim as f32).sqrt();
                let weight = init.uniform("dense_factors.weight", &[shape.dense, embedding_dim], bound)?;
                let first_order = Linear::new("first_order_dense", shape.dense, 1, Activation::Identity, init)?;
                Ok((DenseFactors { weight }, first_order))
            })
            .transpose()?;
        Ok(Self {
            dense,
            deep: tower("deep", fields * embedding_dim, hidden, init)?,
            embedding_dim,
            shape,
        })
    }
}

impl SparseModel for DeepFm {
    fn tables(&self) -> Vec<SparseTableSpec> {
        let width = self.embedding_dim;
        vec![
            SparseTableSpec::new("embedding", width, 1.0 / (width as f32).sqrt(), 0..self.shape.slots),
            SparseTableSpec::new("first_order", 1, 0.01, 0..self.shape.slots),
        ]
    }

    fn blocks(&self) -> Vec<&dyn Block> {
        let mut blocks: Vec<&dyn Block> = Vec::new();
        if let Some((factors, first_order)) = &self.dense {
            blocks.extend([factors as &dyn Block, first_order]);
        }
        blocks.extend(self.deep.iter().map(|layer| layer as &dyn Block));
        blocks
    }

    fn logits(&self, dense: &Tensor, lookups: &[Lookup<'_>]) -> candle_core::Result<Tensor> {
        let [embedding, first_order] = lookups else {
            candle_core::bail!("DeepFM reads 2 tables, given {}", lookups.len());
        };
        let batch = dense.dim(0)?;
        let sparse_first = first_order
            .embedded(batch)?
            .reshape((batch, self.shape.slots))?
            .sum_keepdim(1)?;
        // (batch, fields, width): the sparse fields' factors, then the dense ones'.
        let (first, factors) = match &self.dense {
            Some((dense_factors, first_order_dense)) => (
                (sparse_first + first_order_dense.forward(dense)?)?,
                Tensor::cat(&[&embedding.embedded(batch)?, &dense_factors.forward(dense)?], 1)?,
            ),
            None => (sparse_first, embedding.embedded(batch)?),
        };
        let fm = pairwise_interactions(&factors)?;
        let fields = self.shape.slots + self.shape.dense;
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

/// The dense features' factor vectors: `(batch, dense)` values to `(batch, dense, width)` factors,
/// each feature's value times its learned vector.
struct DenseFactors {
    weight: Param,
}

impl Block for DenseFactors {
    fn name(&self) -> &str {
        "dense_factors"
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.unsqueeze(2)?
            .broadcast_mul(&self.weight.var()?.as_tensor().unsqueeze(0)?)
    }

    fn parameters(&self) -> Vec<(String, Param)> {
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
        let model = DeepFm::new(CtrShape::CRITEO, width, &[4], &init)?;
        let factors = init.uniform("probe", &[2, 39, width], 1.0)?;
        let factors = factors.var()?;
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
        assert_eq!(logits_of_ones(&model, 3, 13)?.dims(), &[3]);
        let names: Vec<String> = model.parameters().into_iter().map(|(n, _)| n).collect();
        assert!(names.contains(&"dense_factors.weight".to_string()), "{names:?}");
        let zeros = Tensor::zeros((1, 13), DType::F32, &Device::Cpu)?;
        let (dense_factors, _) = model.dense.as_ref().expect("dense blocks");
        assert_eq!(dense_factors.forward(&zeros)?.dims(), &[1, 13, width]);
        let sparse_only = DeepFm::new(CtrShape { dense: 0, slots: 3 }, width, &[4], &init)?;
        assert_eq!(logits_of_ones(&sparse_only, 2, 0)?.dims(), &[2]);
        Ok(())
    }
}
