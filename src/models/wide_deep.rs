//! The wide&deep CTR model (Cheng et al. 2016, with PaddleRec's sizes) over a click log's sparse
//! slots and dense features (Criteo's 26 and 13, or a schema's).
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
use crate::data::ctr::CtrShape;

/// Wide&deep: `logit = deep(concat(embeddings of the slots, dense)) + Σ wide rows + w·dense`.
/// Tables: `embedding` (width `embedding_dim`, rows of norm about 1/√3, like a Kaiming-uniform
/// layer's) and `wide` (width 1, starting near 0, as a linear model's weights should), both read
/// by every slot. A log without dense columns has no `wide_dense` layer.
pub struct WideDeep {
    deep: Vec<Linear>,
    wide_dense: Option<Linear>,
    embedding_dim: usize,
    shape: CtrShape,
}

impl WideDeep {
    /// A model of `shape`d records with an embedding width of `embedding_dim` and deep layers
    /// `hidden`, its dense parameters drawn from `init`.
    pub fn new(shape: CtrShape, embedding_dim: usize, hidden: &[usize], init: &ParamInit) -> Result<Self> {
        ensure!(embedding_dim > 0, "the embedding width must be at least 1");
        ensure!(shape.slots > 0, "a CTR model needs at least one sparse slot");
        let wide_dense = (shape.dense > 0)
            .then(|| Linear::new("wide_dense", shape.dense, 1, Activation::Identity, init))
            .transpose()?;
        Ok(Self {
            deep: tower("deep", shape.slots * embedding_dim + shape.dense, hidden, init)?,
            wide_dense,
            embedding_dim,
            shape,
        })
    }
}

impl SparseModel for WideDeep {
    fn tables(&self) -> Vec<SparseTableSpec> {
        let width = self.embedding_dim;
        vec![
            SparseTableSpec::new("embedding", width, 1.0 / (width as f32).sqrt(), 0..self.shape.slots),
            SparseTableSpec::new("wide", 1, 0.01, 0..self.shape.slots),
        ]
    }

    fn blocks(&self) -> Vec<&dyn Block> {
        self.deep
            .iter()
            .chain(&self.wide_dense)
            .map(|layer| layer as &dyn Block)
            .collect()
    }

    fn logits(&self, dense: &Tensor, lookups: &[Lookup<'_>]) -> candle_core::Result<Tensor> {
        let [embedding, wide] = lookups else {
            candle_core::bail!("wide&deep reads 2 tables, given {}", lookups.len());
        };
        let batch = dense.dim(0)?;
        let slots = self.shape.slots;
        let embedded = embedding
            .embedded(batch)?
            .reshape((batch, slots * self.embedding_dim))?;
        let wide_sparse = wide.embedded(batch)?.reshape((batch, slots))?.sum_keepdim(1)?;
        let (deep_in, wide) = match &self.wide_dense {
            Some(wide_dense) => (
                Tensor::cat(&[&embedded, dense], 1)?,
                (wide_sparse + wide_dense.forward(dense)?)?,
            ),
            None => (embedded, wide_sparse),
        };
        (run_tower(&self.deep, deep_in)? + wide)?.squeeze(1)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// The logits of `model` for `batch` samples whose every table row is ones.
    pub(in crate::models) fn logits_of_ones(
        model: &dyn SparseModel,
        batch: usize,
        dense_width: usize,
    ) -> Result<Tensor> {
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
                segments: None,
                slots: t.slots.len(),
            })
            .collect();
        let dense = Tensor::zeros((batch, dense_width), DType::F32, &Device::Cpu)?;
        Ok(model.logits(&dense, &lookups)?)
    }

    #[test]
    fn parameters_are_sorted_and_shapes_fit() -> Result<()> {
        let init = ParamInit::new(7, Device::Cpu);
        let model = WideDeep::new(CtrShape::CRITEO, 4, &[8, 5], &init)?;
        let names: Vec<String> = model.parameters().into_iter().map(|(n, _)| n).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        assert!(names.contains(&"deep_out.weight".to_string()) && names.contains(&"wide_dense.bias".to_string()));
        assert_eq!(logits_of_ones(&model, 3, 13)?.dims(), &[3]);
        let sparse_only = WideDeep::new(CtrShape { dense: 0, slots: 2 }, 4, &[8], &init)?;
        assert_eq!(logits_of_ones(&sparse_only, 3, 0)?.dims(), &[3]);
        assert!(sparse_only
            .parameters()
            .iter()
            .all(|(n, _)| !n.starts_with("wide_dense")));
        Ok(())
    }
}
