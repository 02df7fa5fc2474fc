//! Layer normalisation with a backward.
//!
//! candle-nn's `ops::layer_norm` is a fused kernel registered without a
//! backward (`apply_op3_no_bwd`): gradients would silently stop at it. On the
//! CPU the normalisation is our fused kernel ([`super::fused::normalize`]);
//! elsewhere it is written from differentiable tensor ops.

use candle_core::{Tensor, D};

use crate::models::{Param, ParamInit};

const EPS: f64 = 1e-5;

/// `gain · (x − mean) / sqrt(var + ε) + bias` over the last dimension.
pub(super) struct LayerNorm {
    gain: Param,
    bias: Param,
}

impl LayerNorm {
    /// Gain 1 and bias 0, so the layer starts as a plain normalisation.
    pub(super) fn new(width: usize, init: &ParamInit) -> candle_core::Result<Self> {
        Ok(Self {
            gain: init.constant(&[width], 1.0)?,
            bias: init.constant(&[width], 0.0)?,
        })
    }

    pub(super) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (gain, bias) = (self.gain.var()?, self.bias.var()?);
        let (gain, bias) = (gain.as_tensor(), bias.as_tensor());
        if x.device().is_cpu() {
            return super::fused::scale_shift(&super::fused::normalize(x, EPS as f32)?, gain, bias);
        }
        let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
        let variance = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let normalized = centred.broadcast_mul(&(variance + EPS)?.sqrt()?.recip()?)?;
        normalized.broadcast_mul(gain)?.broadcast_add(bias)
    }

    /// `"{prefix}.gain"`, `"{prefix}.bias"`.
    pub(super) fn parameters(&self, prefix: &str) -> Vec<(String, Param)> {
        vec![
            (format!("{prefix}.gain"), self.gain.clone()),
            (format!("{prefix}.bias"), self.bias.clone()),
        ]
    }
}
