//! Causal multi-head self-attention.

use candle_core::{Tensor, D};

use super::dense::{dense, INIT_STD};
use crate::models::parallel::{slice_of, AffineMap, Group, Split};
use crate::models::{Param, ParamInit};

/// Heads attend, each over its own `n_embd / n_head` slice, to the positions
/// at or before their own; the heads' outputs are concatenated and projected.
/// Split over a layer group, a rank holds its share of the heads: their
/// columns of q, k and v and their rows of the output projection.
pub(super) struct CausalSelfAttention {
    q: AffineMap,
    k: AffineMap,
    v: AffineMap,
    proj: AffineMap,
    /// Heads this rank computes.
    n_head: usize,
    /// Width of each head.
    head_dim: usize,
}

impl CausalSelfAttention {
    /// Projections named `"{name}.q"`, `.k`, `.v`, `.proj`; the output
    /// projection starts smaller by `residual_scale` (GPT-2's 1/√(2·layers)),
    /// so the residual stream's variance does not grow with depth.
    pub(super) fn new(
        name: &str,
        n_embd: usize,
        n_head: usize,
        residual_scale: f32,
        init: &ParamInit,
    ) -> candle_core::Result<Self> {
        let dense = |part: &str, std| dense(&format!("{name}.{part}"), n_embd, n_embd, std, init);
        Ok(Self {
            q: dense("q", INIT_STD)?,
            k: dense("k", INIT_STD)?,
            v: dense("v", INIT_STD)?,
            proj: dense("proj", INIT_STD * residual_scale)?,
            n_head,
            head_dim: n_embd / n_head,
        })
    }

    /// This rank's share of the heads over `group`: one all-reduce forward (after the output
    /// projection) and one backward (of the input's gradient).
    pub(super) fn split(self, group: &Group) -> anyhow::Result<Self> {
        let heads = slice_of(self.n_head, group.size(), group.rank(), "attention heads")?;
        Ok(Self {
            q: self.q.split(Split::Columns, group)?,
            k: self.k.split(Split::Columns, group)?,
            v: self.v.split(Split::Columns, group)?,
            proj: self.proj.split(Split::Rows, group)?,
            n_head: heads.len(),
            head_dim: self.head_dim,
        })
    }

    /// `x` of shape (B, T, C) → (B, T, C).
    pub(super) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let (h, d) = (self.n_head, self.head_dim);
        let rows = x.reshape((b * t, c))?;
        // Each layout is made contiguous once, so matmuls and their gradients
        // never run on strided views: q, v as (B, H, T, D), k as (B, H, D, T).
        let q = (self.q.forward(&rows)? * (1.0 / (d as f64).sqrt()))?
            .reshape((b, t, h, d))?
            .transpose(1, 2)?
            .contiguous()?;
        let k = self
            .k
            .forward(&rows)?
            .reshape((b, t, h, d))?
            .permute((0, 2, 3, 1))?
            .contiguous()?;
        let v = self
            .v
            .forward(&rows)?
            .reshape((b, t, h, d))?
            .transpose(1, 2)?
            .contiguous()?;
        let scores = q.matmul(&k)?;
        let probs = if x.device().is_cpu() {
            super::fused::causal_softmax(&scores)?
        } else {
            softmax_last_dim(&scores.broadcast_add(&causal_mask(t, x.device())?)?)?
        };
        let y = probs.matmul(&v)?; // (B, H, T, D)
        let y = y.transpose(1, 2)?.contiguous()?.reshape((b * t, h * d))?;
        self.proj.forward(&y)?.reshape((b, t, c))
    }

    /// The projections' parameters under `prefix`.
    pub(super) fn parameters(&self, prefix: &str) -> Vec<(String, Param)> {
        self.projections()
            .flat_map(|(part, map)| map.parameters(&format!("{prefix}.{part}")))
            .collect()
    }

    /// The parameters of [`parameters`](Self::parameters) split over a layer group, with the
    /// dimension each is split along.
    pub(super) fn split_parameters(&self, prefix: &str) -> Vec<(String, usize)> {
        self.projections()
            .flat_map(|(part, map)| map.split_parameters(&format!("{prefix}.{part}")))
            .collect()
    }

    fn projections(&self) -> impl Iterator<Item = (&'static str, &AffineMap)> {
        [("q", &self.q), ("k", &self.k), ("v", &self.v), ("proj", &self.proj)].into_iter()
    }
}

/// (T, T): 0 where key position ≤ query position, −∞ above the diagonal, so
/// a later token gets exactly zero weight (and the diagonal keeps every row's
/// maximum finite).
fn causal_mask(t: usize, device: &candle_core::Device) -> candle_core::Result<Tensor> {
    let mask: Vec<f32> = (0..t)
        .flat_map(|query| (0..t).map(move |key| if key <= query { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(mask, (t, t), device)
}

/// Softmax over the last dimension from differentiable ops: candle-nn's
/// `softmax_last_dim` is registered without a backward and would silently
/// stop gradients. The max is subtracted for stability and detached, since
/// softmax does not depend on it.
fn softmax_last_dim(x: &Tensor) -> candle_core::Result<Tensor> {
    let shifted = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?.exp()?;
    shifted.broadcast_div(&shifted.sum_keepdim(D::Minus1)?)
}
