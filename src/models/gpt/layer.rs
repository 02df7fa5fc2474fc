//! One pre-LayerNorm transformer layer: the `h{i}` blocks.

use candle_core::Tensor;

use super::attention::CausalSelfAttention;
use super::dense::{dense, INIT_STD};
use super::norm::LayerNorm;
use crate::models::parallel::{AffineMap, Flow, Group, Split};
use crate::models::{Block, Param, ParamInit};

/// `x + attn(ln1(x))`, then `x + mlp(ln2(x))`; the MLP is C → 4C → C with
/// the exact (erf) GELU, PyTorch's `nn.GELU()` default.
pub(super) struct TransformerLayer {
    name: String,
    ln1: LayerNorm,
    attn: CausalSelfAttention,
    ln2: LayerNorm,
    fc: AffineMap,
    proj: AffineMap,
}

impl TransformerLayer {
    /// Layer `name` of a model with `n_layer` layers (which sets the
    /// residual projections' initial scale).
    pub(super) fn new(
        name: &str,
        n_embd: usize,
        n_head: usize,
        n_layer: usize,
        init: &ParamInit,
    ) -> candle_core::Result<Self> {
        let residual_scale = 1.0 / ((2 * n_layer) as f32).sqrt();
        Ok(Self {
            name: name.to_string(),
            ln1: LayerNorm::new(n_embd, init)?,
            attn: CausalSelfAttention::new(&format!("{name}.attn"), n_embd, n_head, residual_scale, init)?,
            ln2: LayerNorm::new(n_embd, init)?,
            fc: dense(&format!("{name}.mlp.fc"), n_embd, 4 * n_embd, INIT_STD, init)?,
            proj: dense(
                &format!("{name}.mlp.proj"),
                4 * n_embd,
                n_embd,
                INIT_STD * residual_scale,
                init,
            )?,
        })
    }
}

impl Block for TransformerLayer {
    fn name(&self) -> &str {
        &self.name
    }

    /// (B, T, C) → (B, T, C).
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let x = (x + self.attn.forward(&self.ln1.forward(x)?)?)?;
        let hidden = self.fc.forward(&self.ln2.forward(&x)?.reshape((b * t, c))?)?;
        // Split over a layer group, this rank holds its slice of the hidden width.
        let hidden = if x.device().is_cpu() {
            super::fused::gelu(&hidden)?
        } else {
            hidden.gelu_erf()?
        };
        x + self.proj.forward(&hidden)?.reshape((b, t, c))?
    }

    fn transposed_parameters(&self) -> &'static [&'static str] {
        &[
            "attn.q.weight",
            "attn.k.weight",
            "attn.v.weight",
            "attn.proj.weight",
            "mlp.fc.weight",
            "mlp.proj.weight",
        ]
    }

    /// Attention split by heads, the MLP's first map by columns and its second by rows; the
    /// LayerNorms whole on every rank. Takes and hands on the whole residual stream.
    fn split(self: Box<Self>, group: &Group, input: &Flow, _last: bool) -> anyhow::Result<(Box<dyn Block>, Flow)> {
        anyhow::ensure!(
            *input == Flow::Whole,
            "layer {} takes the whole residual stream",
            self.name
        );
        let Self {
            name,
            ln1,
            attn,
            ln2,
            fc,
            proj,
        } = *self;
        let layer = Box::new(Self {
            name,
            ln1,
            attn: attn.split(group)?,
            ln2,
            fc: fc.split(Split::Columns, group)?,
            proj: proj.split(Split::Rows, group)?,
        });
        Ok((layer, Flow::Whole))
    }

    fn split_parameters(&self) -> Vec<(String, usize)> {
        let mut split = self.attn.split_parameters("attn");
        split.extend(self.fc.split_parameters("mlp.fc"));
        split.extend(self.proj.split_parameters("mlp.proj"));
        split
    }

    fn parameters(&self) -> Vec<(String, Param)> {
        let mut params = self.ln1.parameters("ln1");
        params.extend(self.attn.parameters("attn"));
        params.extend(self.ln2.parameters("ln2"));
        params.extend(self.fc.parameters("mlp.fc"));
        params.extend(self.proj.parameters("mlp.proj"));
        params
    }
}
