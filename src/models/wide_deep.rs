//! The wide&deep CTR model (Cheng et al. 2016, with PaddleRec's sizes) over Criteo's 26 sparse
//! slots and 13 dense features.
//!
//! The sparse embedding tables do not live in the model: they live on the parameter servers, and
//! a step receives only the rows of the ids its batch touches (each id once), as plain tensors.
//! The model owns the dense parameters: the deep layers and the wide part's linear layer on the
//! dense features.

use anyhow::{ensure, Result};
use candle_core::Tensor;

use super::sparse::{Lookup, SparseModel, SparseTableSpec};
use super::tower::{run_tower, tower};
use super::{Activation, Block, Linear, ParamInit};

/// Sparse slots per sample (Criteo's categorical columns).
pub const SPARSE_SLOTS: usize = 26;
/// Dense features per sample (Criteo's integer columns).
pub const DENSE_FEATURES: usize = 13;

/// Wide&deep: `logit = deep(concat(embeddings of the 26 slots, dense)) + Σ wide rows + w·dense`.
/// Tables: `embedding` (width `embedding_dim`, rows of norm about 1/√3, like a Kaiming-uniform
/// layer's) and `wide` (width 1, starting near 0, as a linear model's weights should), both read
/// by every slot.
pub struct WideDeep {
    deep: Vec<Linear>,
    wide_dense: Linear,
    embedding_dim: usize,
}

impl WideDeep {
    /// A model with an embedding width of `embedding_dim` and deep layers `hidden`, its dense
    /// parameters drawn from `init`.
    pub fn new(embedding_dim: usize, hidden: &[usize], init: &ParamInit) -> Result<Self> {
        ensure!(embedding_dim > 0, "the embedding width must be at least 1");
        Ok(Self {
            deep: tower("deep", SPARSE_SLOTS * embedding_dim + DENSE_FEATURES, hidden, init)?,
            wide_dense: Linear::new("wide_dense", DENSE_FEATURES, 1, Activation::Identity, init)?,
            embedding_dim,
        })
    }
}

impl SparseModel for WideDeep {
    fn tables(&self) -> Vec<SparseTableSpec> {
        let width = self.embedding_dim;
        vec![
            SparseTableSpec::new("embedding", width, 1.0 / (width as f32).sqrt(), 0..SPARSE_SLOTS),
            SparseTableSpec::new("wide", 1, 0.01, 0..SPARSE_SLOTS),
        ]
    }

    fn blocks(&self) -> Vec<&dyn Block> {
        self.deep
            .iter()
            .chain(std::iter::once(&self.wide_dense))
            .map(|layer| layer as &dyn Block)
            .collect()
    }

    fn logits(&self, dense: &Tensor, lookups: &[Lookup<'_>]) -> candle_core::Result<Tensor> {
        let [embedding, wide] = lookups else {
            candle_core::bail!("wide&deep reads 2 tables, given {}", lookups.len());
        };
        let batch = dense.dim(0)?;
        let embedded = embedding
            .embedded(batch)?
            .reshape((batch, SPARSE_SLOTS * self.embedding_dim))?;
        let deep = run_tower(&self.deep, Tensor::cat(&[&embedded, dense], 1)?)?;
        let wide_sparse = wide.embedded(batch)?.reshape((batch, SPARSE_SLOTS))?.sum_keepdim(1)?;
        let wide = (wide_sparse + self.wide_dense.forward(dense)?)?;
        (deep + wide)?.squeeze(1)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// The logits of `model` for `batch` samples whose every table row is ones.
    pub(in crate::models) fn logits_of_ones(model: &dyn SparseModel, batch: usize) -> Result<Tensor> {
        let unique = 5;
        let tables = model.tables();
        let rows: Vec<Tensor> = tables
            .iter()
            .map(|t| Tensor::ones((unique, t.width), DType::F32, &Device::Cpu))
            .collect::<candle_core::Result<_>>()?;
        let indexes: Vec<Tensor> = tables
            .iter()
            .map(|t| {
                let index: Vec<u32> = (0..batch * t.slots.len()).map(|i| (i % unique) as u32).collect();
                Tensor::from_vec(index, batch * t.slots.len(), &Device::Cpu)
            })
            .collect::<candle_core::Result<_>>()?;
        let lookups: Vec<Lookup> = tables
            .iter()
            .zip(rows.iter().zip(&indexes))
            .map(|(t, (rows, index))| Lookup {
                rows,
                index,
                slots: t.slots.len(),
            })
            .collect();
        let dense = Tensor::zeros((batch, DENSE_FEATURES), DType::F32, &Device::Cpu)?;
        Ok(model.logits(&dense, &lookups)?)
    }

    #[test]
    fn parameters_are_sorted_and_shapes_fit() -> Result<()> {
        let init = ParamInit::new(7, Device::Cpu);
        let model = WideDeep::new(4, &[8, 5], &init)?;
        let names: Vec<String> = model.parameters().into_iter().map(|(n, _)| n).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        assert!(names.contains(&"deep_out.weight".to_string()) && names.contains(&"wide_dense.bias".to_string()));
        assert_eq!(logits_of_ones(&model, 3)?.dims(), &[3]);
        Ok(())
    }
}
