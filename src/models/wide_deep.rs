//! The wide&deep CTR model (Cheng et al. 2016, with PaddleRec's sizes) over Criteo's 26 sparse
//! slots and 13 dense features.
//!
//! The sparse embedding tables do not live in the model: they live on the parameter servers, and
//! a step receives only the rows of the ids its batch touches (each id once), as plain tensors.
//! The model owns the dense parameters: the deep layers and the wide part's linear layer on the
//! dense features.

use anyhow::{ensure, Result};
use candle_core::{DType, Tensor, Var, D};

use super::{Activation, Block, Linear, ParamInit};

/// Sparse slots per sample (Criteo's categorical columns).
pub const SPARSE_SLOTS: usize = 26;
/// Dense features per sample (Criteo's integer columns).
pub const DENSE_FEATURES: usize = 13;

/// Wide&deep: `logit = deep(concat(embeddings of the 26 slots, dense)) + Σ wide rows + w·dense`.
pub struct WideDeep {
    deep: Vec<Linear>,
    wide_dense: Linear,
    embedding_dim: usize,
}

/// One batch's sparse side: the pulled rows of its unique ids and, per sample and slot, which
/// row it uses.
pub struct SparseRows<'a> {
    /// `(unique ids, embedding_dim)` rows of the shared deep table.
    pub deep: &'a Tensor,
    /// `(unique ids, 1)` rows of the wide table.
    pub wide: &'a Tensor,
    /// `(batch × 26,)` u32 positions into the unique rows, sample-major.
    pub index: &'a Tensor,
}

impl WideDeep {
    /// A model with an embedding width of `embedding_dim` and deep layers `hidden`, its dense
    /// parameters drawn from `init`.
    pub fn new(embedding_dim: usize, hidden: &[usize], init: &ParamInit) -> Result<Self> {
        ensure!(embedding_dim > 0, "the embedding width must be at least 1");
        let inputs = SPARSE_SLOTS * embedding_dim + DENSE_FEATURES;
        let widths: Vec<usize> = std::iter::once(inputs)
            .chain(hidden.iter().copied())
            .chain(std::iter::once(1))
            .collect();
        let layers = widths.len() - 1;
        let deep = (0..layers)
            .map(|i| {
                let (name, activation) = if i + 1 == layers {
                    ("deep_out".to_string(), Activation::Identity)
                } else {
                    (format!("deep{i}"), Activation::Relu)
                };
                Linear::new(&name, widths[i], widths[i + 1], activation, init)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let wide_dense = Linear::new("wide_dense", DENSE_FEATURES, 1, Activation::Identity, init)?;
        Ok(Self {
            deep,
            wide_dense,
            embedding_dim,
        })
    }

    /// Width of the deep embedding table.
    pub fn embedding_dim(&self) -> usize {
        self.embedding_dim
    }

    /// The dense parameters by name, sorted by name: the order in which they are flattened
    /// and split over the parameter servers.
    pub fn parameters(&self) -> Vec<(String, Var)> {
        let mut params: Vec<(String, Var)> = self
            .deep
            .iter()
            .chain(std::iter::once(&self.wide_dense))
            .flat_map(|layer| {
                let block = layer.name().to_string();
                layer
                    .parameters()
                    .into_iter()
                    .map(move |(name, var)| (format!("{block}.{name}"), var))
            })
            .collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        params
    }

    /// Click logits, shape `(batch,)`, for `dense` features `(batch, 13)` and the batch's
    /// sparse rows.
    pub fn logits(&self, dense: &Tensor, sparse: &SparseRows<'_>) -> candle_core::Result<Tensor> {
        let batch = dense.dim(0)?;
        let embedded = sparse
            .deep
            .index_select(sparse.index, 0)?
            .reshape((batch, SPARSE_SLOTS * self.embedding_dim))?;
        let mut h = Tensor::cat(&[&embedded, dense], 1)?;
        for layer in &self.deep {
            h = layer.forward(&h)?;
        }
        let wide_sparse = sparse
            .wide
            .index_select(sparse.index, 0)?
            .reshape((batch, SPARSE_SLOTS))?
            .sum_keepdim(1)?;
        let wide = (wide_sparse + self.wide_dense.forward(dense)?)?;
        (h + wide)?.squeeze(1)
    }
}

/// Mean sigmoid cross-entropy of `logits` against 0/1 `labels`, in the numerically stable form
/// `max(x, 0) − x·y + ln(1 + e^(−|x|))`.
pub fn sigmoid_cross_entropy(logits: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
    let softplus = (logits.abs()?.neg()?.exp()? + 1.0)?.log()?;
    ((logits.relu()? - (logits * labels)?)? + softplus)?.mean(D::Minus1)
}

/// Click probabilities `sigmoid(logits)`.
pub fn click_probability(logits: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::ops::sigmoid(&logits.to_dtype(DType::F32)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn parameters_are_sorted_and_shapes_fit() -> Result<()> {
        let init = ParamInit::new(7, Device::Cpu);
        let model = WideDeep::new(4, &[8, 5], &init)?;
        let names: Vec<String> = model.parameters().into_iter().map(|(n, _)| n).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        assert!(names.contains(&"deep_out.weight".to_string()) && names.contains(&"wide_dense.bias".to_string()));

        let batch = 3;
        let unique = 5;
        let deep = Tensor::ones((unique, 4), DType::F32, &Device::Cpu)?;
        let wide = Tensor::ones((unique, 1), DType::F32, &Device::Cpu)?;
        let index: Vec<u32> = (0..batch * SPARSE_SLOTS).map(|i| (i % unique) as u32).collect();
        let index = Tensor::from_vec(index, batch * SPARSE_SLOTS, &Device::Cpu)?;
        let dense = Tensor::zeros((batch, DENSE_FEATURES), DType::F32, &Device::Cpu)?;
        let logits = model.logits(
            &dense,
            &SparseRows {
                deep: &deep,
                wide: &wide,
                index: &index,
            },
        )?;
        assert_eq!(logits.dims(), &[batch]);
        Ok(())
    }

    #[test]
    fn cross_entropy_matches_the_definition() -> Result<()> {
        let logits = Tensor::new(&[-30.0f32, -1.0, 0.0, 2.5, 40.0], &Device::Cpu)?;
        let labels = Tensor::new(&[0.0f32, 1.0, 0.0, 1.0, 0.0], &Device::Cpu)?;
        let got = sigmoid_cross_entropy(&logits, &labels)?.to_scalar::<f32>()?;
        let expected: f64 = [(-30.0f64, 0.0f64), (-1.0, 1.0), (0.0, 0.0), (2.5, 1.0), (40.0, 0.0)]
            .iter()
            .map(|&(x, y)| {
                // ln σ(z), written per sign so neither branch overflows.
                let log_sigmoid = |z: f64| {
                    if z < 0.0 {
                        z - z.exp().ln_1p()
                    } else {
                        -(-z).exp().ln_1p()
                    }
                };
                -(y * log_sigmoid(x) + (1.0 - y) * log_sigmoid(-x))
            })
            .sum::<f64>()
            / 5.0;
        assert!((f64::from(got) - expected).abs() < 1e-4, "{got} vs {expected}");
        Ok(())
    }
}
