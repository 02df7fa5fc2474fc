//! The `embed` block: token ids to vectors.

use std::ops::Range;

use anyhow::Context as _;
use candle_core::{Tensor, Var};

use super::dense::{uniform_bound, INIT_STD};
use crate::models::parallel::{vocab, Flow, Group};
use crate::models::{Block, Param, ParamInit};

/// Token embedding plus learned position embedding.
pub(super) struct Embedding {
    token: Param,
    position: Param,
    /// The slice of the vocabulary whose rows `token` holds, where the table is split over a
    /// layer group.
    vocab_slice: Option<(Range<usize>, Group)>,
}

impl Embedding {
    /// Tables `"embed.token"` (vocab, C) and `"embed.position"`
    /// (block_size, C), GPT-2's standard deviation 0.02.
    pub(super) fn new(vocab: usize, block_size: usize, n_embd: usize, init: &ParamInit) -> candle_core::Result<Self> {
        let bound = uniform_bound(INIT_STD);
        Ok(Self {
            token: init.uniform("embed.token", &[vocab, n_embd], bound)?,
            position: init.uniform("embed.position", &[block_size, n_embd], bound)?,
            vocab_slice: None,
        })
    }

    /// The token table, which a tied head shares.
    pub(super) fn token_table(&self) -> &Param {
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
        let (token, position) = (self.token.var()?, self.position.var()?);
        let (block_size, c) = position.dims2()?;
        if t > block_size {
            candle_core::bail!("sequence of {t} tokens is longer than the block size {block_size}");
        }
        let tokens = match &self.vocab_slice {
            None => token.index_select(&ids.flatten_all()?, 0)?.reshape((b, t, c))?,
            Some((slice, group)) => vocab::embed(ids, &token, slice, group)?,
        };
        tokens.broadcast_add(&position.narrow(0, 0, t)?)
    }

    /// The token table split by rows over the vocabulary (Megatron's vocabulary-parallel
    /// embedding); the positions whole. Hands on every token's embedding.
    fn split(self: Box<Self>, group: &Group, _input: &Flow, _last: bool) -> anyhow::Result<(Box<dyn Block>, Flow)> {
        let slice = vocab::vocab_slice(self.token.dims()[0], group)
            .context("strategy.hybrid_configs.mp_degree splits the GPT's vocabulary")?;
        let table = self.token.var()?;
        let token = Var::from_tensor(&table.narrow(0, slice.start, slice.len())?.contiguous()?)?.into();
        let part = Self {
            token,
            position: self.position,
            vocab_slice: Some((slice, group.clone())),
        };
        Ok((Box::new(part), Flow::Whole))
    }

    fn split_parameters(&self) -> Vec<(String, usize)> {
        match self.vocab_slice {
            Some(_) => vec![("token".to_string(), 0)],
            None => Vec::new(),
        }
    }

    fn parameters(&self) -> Vec<(String, Param)> {
        vec![
            ("token".to_string(), self.token.clone()),
            ("position".to_string(), self.position.clone()),
        ]
    }
}
