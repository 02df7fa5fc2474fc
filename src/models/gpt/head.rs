//! The `head` block: final LayerNorm and the projection to logits.

use candle_core::{Tensor, Var};

use super::dense::{uniform_bound, INIT_STD};
use super::norm::LayerNorm;
use crate::models::{Block, ParamInit};

/// Where the head's (C → vocab) projection lives.
enum Projection {
    /// Its own (C, vocab) weight, `"head.weight"`.
    Own(Var),
    /// The embedding's (vocab, C) token table, used transposed; reported by
    /// the `embed` block only.
    Tied(Var),
}

/// `ln_f(x) · W` without bias (as GPT-2), giving next-token logits.
pub(super) struct Head {
    ln: LayerNorm,
    projection: Projection,
}

impl Head {
    /// A head with its own projection weight.
    pub(super) fn untied(vocab: usize, n_embd: usize, init: &ParamInit) -> candle_core::Result<Self> {
        let weight = init.uniform("head.weight", &[n_embd, vocab], uniform_bound(INIT_STD))?;
        Ok(Self {
            ln: LayerNorm::new(n_embd, init)?,
            projection: Projection::Own(weight),
        })
    }

    /// A head projecting with `token_table` (vocab, C), the embedding's.
    pub(super) fn tied(token_table: &Var, n_embd: usize, init: &ParamInit) -> candle_core::Result<Self> {
        Ok(Self {
            ln: LayerNorm::new(n_embd, init)?,
            projection: Projection::Tied(token_table.clone()),
        })
    }
}

impl Block for Head {
    fn name(&self) -> &str {
        "head"
    }

    /// (B, T, C) → (B, T, vocab) logits.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let rows = self.ln.forward(x)?.reshape((b * t, c))?;
        let logits = match &self.projection {
            Projection::Own(weight) => rows.matmul(weight.as_tensor())?,
            // The one transposed operand left: the table is shared, and the
            // embedding needs it (vocab, C) for its row lookups.
            Projection::Tied(table) => rows.matmul(&table.as_tensor().t()?)?,
        };
        let vocab = logits.dim(1)?;
        logits.reshape((b, t, vocab))
    }

    fn transposed_parameters(&self) -> &'static [&'static str] {
        &["weight"]
    }

    fn parameters(&self) -> Vec<(String, Var)> {
        let mut params = self.ln.parameters("ln");
        if let Projection::Own(weight) = &self.projection {
            params.push(("weight".to_string(), weight.clone()));
        }
        params
    }
}
