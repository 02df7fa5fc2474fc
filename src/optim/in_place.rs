//! The optimizers' updates on the CPU as single in-place passes over each parameter and its
//! state: no temporaries, one read and one write per value, with the arithmetic of the composed
//! candle ops in the same order (so the results are bit-identical; the optimizers' tests check).

use candle_core::{CpuStorage, InplaceOp2, InplaceOp3, Layout};

use crate::cpu_values::{cpu_values, cpu_values_mut};

/// `p ← p − lr·(g + λ·p)` (the decay term only when λ ≠ 0, as the composed step).
pub(super) struct Descend {
    pub(super) lr: f32,
    pub(super) decay: f32,
}

impl InplaceOp2 for Descend {
    fn name(&self) -> &'static str {
        "sgd-descend"
    }

    fn cpu_fwd(&self, p: &mut CpuStorage, p_l: &Layout, g: &CpuStorage, g_l: &Layout) -> candle_core::Result<()> {
        let g = cpu_values(g, g_l, self.name())?;
        let p = cpu_values_mut(p, p_l, g.len(), self.name())?;
        let Self { lr, decay } = *self;
        if decay == 0.0 {
            for (p, &g) in p.iter_mut().zip(g) {
                *p -= g * lr;
            }
        } else {
            for (p, &g) in p.iter_mut().zip(g) {
                *p -= (g + *p * decay) * lr;
            }
        }
        Ok(())
    }
}

/// `v ← μ·v + (g + λ·p)`.
pub(super) struct Accumulate {
    pub(super) momentum: f32,
    pub(super) decay: f32,
}

impl InplaceOp3 for Accumulate {
    fn name(&self) -> &'static str {
        "sgd-momentum"
    }

    fn cpu_fwd(
        &self,
        v: &mut CpuStorage,
        v_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
        p: &CpuStorage,
        p_l: &Layout,
    ) -> candle_core::Result<()> {
        let (g, p) = (cpu_values(g, g_l, self.name())?, cpu_values(p, p_l, self.name())?);
        let v = cpu_values_mut(v, v_l, g.len(), self.name())?;
        let Self { momentum, decay } = *self;
        for ((v, &g), &p) in v.iter_mut().zip(g).zip(p) {
            let g = if decay == 0.0 { g } else { g + p * decay };
            *v = *v * momentum + g;
        }
        Ok(())
    }
}

/// One of Adam's moments: `m ← β·m + (1 − β)·g` (the first), or of `g²` (the second).
pub(super) struct Moment {
    pub(super) beta: f32,
    /// `1 − β`, computed in f64 as the composed step does.
    pub(super) rest: f32,
    /// Of the squared gradient: the second moment.
    pub(super) squared: bool,
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(&self, m: &mut CpuStorage, m_l: &Layout, g: &CpuStorage, g_l: &Layout) -> candle_core::Result<()> {
        let g = cpu_values(g, g_l, self.name())?;
        let m = cpu_values_mut(m, m_l, g.len(), self.name())?;
        let (beta, rest) = (self.beta, self.rest);
        if self.squared {
            for (m, &g) in m.iter_mut().zip(g) {
                *m = *m * beta + (g * g) * rest;
            }
        } else {
            for (m, &g) in m.iter_mut().zip(g) {
                *m = *m * beta + g * rest;
            }
        }
        Ok(())
    }
}

/// AdamW's step from the updated moments: `θ ← θ·(1 − lr·λ) − lr·m̂ / (√v̂ + ε)`, with
/// `m̂ = m·scale_m` and `v̂ = v·scale_v` (the bias corrections).
pub(super) struct AdamWStep {
    pub(super) lr: f32,
    /// `1 − lr·λ`.
    pub(super) decay: f32,
    pub(super) scale_m: f32,
    pub(super) scale_v: f32,
    pub(super) eps: f32,
}

impl InplaceOp3 for AdamWStep {
    fn name(&self) -> &'static str {
        "adamw-step"
    }

    fn cpu_fwd(
        &self,
        theta: &mut CpuStorage,
        theta_l: &Layout,
        m: &CpuStorage,
        m_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> candle_core::Result<()> {
        let (m, v) = (cpu_values(m, m_l, self.name())?, cpu_values(v, v_l, self.name())?);
        let theta = cpu_values_mut(theta, theta_l, m.len(), self.name())?;
        let Self {
            lr,
            decay,
            scale_m,
            scale_v,
            eps,
        } = *self;
        for ((theta, &m), &v) in theta.iter_mut().zip(m).zip(v) {
            let adjusted = (m * scale_m) / ((v * scale_v).sqrt() + eps);
            *theta = *theta * decay - adjusted * lr;
        }
        Ok(())
    }
}
