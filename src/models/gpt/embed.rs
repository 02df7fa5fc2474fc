//! The `embed` block: token ids to vectors.

use candle_core::{Tensor, Var};

use super::dense::{uniform_bound, INIT_STD};
use crate::models::{Block, ParamInit};

/// Token embedding plus learned position embedding.
pub(super) struct Embedding {
    token: Var,
    position: Var,
}

impl Embedding {
    /// Tables `"embed.token"` (vocab, C) and `"embed.position"`
    /// (block_size, C), GPT-2's standard deviation 0.02.
    pub(super) fn new(vocab: usize, block_size: usize, n_embd: usize, init: &ParamInit) -> candle_core::Result<Self> {
        let bound = uniform_bound(INIT_STD);
        Ok(Self {
            token: init.uniform("embed.token", &[vocab, n_embd], bound)?,
            position: init.uniform("embed.position", &[block_size, n_embd], bound)?,
        })
    }

    /// The token table, which a tied head shares.
    pub(super) fn token_table(&self) -> &Var {
        &self.token
    }
}

impl Block for Embedding {
    fn name(&self) -> &str {
        "embed"
    }

    /// (B, T) u32 token ids, T at most the block size → (B, T, C) f32.
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let (block_size, c) = self.position.dims2()?;
        if t > block_size {
            candle_core::bail!("sequence of {t} tokens is longer than the block size {block_size}");
        }
        let tokens = self.token.index_select(&ids.flatten_all()?, 0)?.reshape((b, t, c))?;
        tokens.broadcast_add(&self.position.narrow(0, 0, t)?)
    }

    fn parameters(&self) -> Vec<(String, Var)> {
        vec![
            ("token".to_string(), self.token.clone()),
            ("position".to_string(), self.position.clone()),
        ]
    }
}
