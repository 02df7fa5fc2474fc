//! The `head` block: final LayerNorm and the projection to logits.

use anyhow::Context as _;
use candle_core::{Tensor, Var};

use super::dense::{uniform_bound, INIT_STD};
use super::norm::LayerNorm;
use crate::models::parallel::{enter, vocab, Flow, Group};
use crate::models::{Block, Param, ParamInit};

/// Where the head's (C → vocab) projection lives.
enum Projection {
    /// Its own (C, vocab) weight, `"head.weight"`.
    Own(Param),
    /// The embedding's (vocab, C) token table, used transposed; reported by
    /// the `embed` block only.
    Tied(Param),
    /// This rank's columns of its own weight, those of its slice of the vocabulary, over a
    /// layer group.
    Split { weight: Param, group: Group },
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
    pub(super) fn tied(token_table: &Param, n_embd: usize, init: &ParamInit) -> candle_core::Result<Self> {
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
            Projection::Own(weight) => rows.matmul(weight.var()?.as_tensor())?,
            // The one transposed operand left: the table is shared, and the
            // embedding needs it (vocab, C) for its row lookups.
            Projection::Tied(table) => rows.matmul(&table.var()?.as_tensor().t()?)?,
            Projection::Split { weight, group } => enter(&rows, group)?.matmul(weight.var()?.as_tensor())?,
        };
        let vocab = logits.dim(1)?;
        logits.reshape((b, t, vocab))
    }

    fn transposed_parameters(&self) -> &'static [&'static str] {
        &["weight"]
    }

    fn parameters(&self) -> Vec<(String, Param)> {
        let mut params = self.ln.parameters("ln");
        if let Projection::Own(weight) | Projection::Split { weight, .. } = &self.projection {
            params.push(("weight".to_string(), weight.clone()));
        }
        params
    }

    /// The projection split by columns over the vocabulary: hands on this rank's slice of the
    /// logits, which the split cross-entropy scores without gathering them.
    fn split(self: Box<Self>, group: &Group, _input: &Flow, _last: bool) -> anyhow::Result<(Box<dyn Block>, Flow)> {
        let Projection::Own(weight) = self.projection else {
            anyhow::bail!("a head tied to the embedding is not split over a layer group");
        };
        let slice = vocab::vocab_slice(weight.dims()[1], group)
            .context("strategy.hybrid_configs.mp_degree splits the GPT's vocabulary")?;
        let whole = weight.var()?;
        let weight = Var::from_tensor(&whole.narrow(1, slice.start, slice.len())?.contiguous()?)?.into();
        let part = Self {
            ln: self.ln,
            projection: Projection::Split {
                weight,
                group: group.clone(),
            },
        };
        Ok((Box::new(part), Flow::Sliced(slice)))
    }

    fn split_parameters(&self) -> Vec<(String, usize)> {
        match self.projection {
            Projection::Split { .. } => vec![("weight".to_string(), 1)],
            _ => Vec::new(),
        }
    }
}
