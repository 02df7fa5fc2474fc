//! SGD with momentum, which candle-nn's SGD lacks; PyTorch's semantics, so
//! results can be compared with a PyTorch run: `v ← μ·v + (g + λ·p)`,
//! `p ← p − lr·v`, with `v` starting at zero.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::Optimizer;

use super::{check_state_entry, OptimizerState};

/// The state slot of one parameter: its velocity.
const SLOTS: &[&str] = &["momentum"];

/// Hyper-parameters of [`SgdMomentum`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdMomentumConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor μ (0 gives plain SGD).
    pub momentum: f64,
    /// L2 weight decay λ, added to the gradient.
    pub weight_decay: f64,
}

/// SGD with momentum over a fixed set of variables.
pub struct SgdMomentum {
    params: Vec<(Var, Option<Tensor>)>,
    config: SgdMomentumConfig,
}

impl Optimizer for SgdMomentum {
    type Config = SgdMomentumConfig;

    fn new(vars: Vec<Var>, config: SgdMomentumConfig) -> candle_core::Result<Self> {
        Ok(Self {
            params: vars.into_iter().map(|v| (v, None)).collect(),
            config,
        })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        let SgdMomentumConfig {
            lr,
            momentum,
            weight_decay,
        } = self.config;
        for (var, velocity) in &mut self.params {
            let Some(grad) = grads.get(var) else { continue };
            let mut g = grad.clone();
            if weight_decay != 0.0 {
                g = (g + (var.as_tensor() * weight_decay)?)?;
            }
            if momentum != 0.0 {
                g = match velocity.take() {
                    Some(v) => ((v * momentum)? + g)?,
                    None => g,
                };
                *velocity = Some(g.clone());
            }
            var.set(&(var.as_tensor() - (g * lr)?)?)?;
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}

impl SgdMomentum {
    /// Copies of the velocities; a parameter that has none yet exports nothing, and the step
    /// count is 0 (SGD keeps none).
    pub fn state(&self) -> candle_core::Result<OptimizerState> {
        let mut tensors = Vec::new();
        for (index, (_, velocity)) in self.params.iter().enumerate() {
            if let Some(velocity) = velocity {
                tensors.push((index, "momentum".to_string(), velocity.copy()?.detach()));
            }
        }
        Ok(OptimizerState { steps: 0, tensors })
    }

    /// Replaces the whole state with `state` (a parameter it lacks has no velocity yet); checks
    /// every entry before changing anything. The step count is ignored.
    pub fn load_state(&mut self, state: OptimizerState) -> candle_core::Result<()> {
        for (index, slot, tensor) in &state.tensors {
            let param = self.params.get(*index).map(|(var, _)| var);
            check_state_entry("sgd", SLOTS, self.params.len(), param, *index, slot, tensor)?;
        }
        for (_, velocity) in &mut self.params {
            *velocity = None;
        }
        for (index, _, tensor) in state.tensors {
            let (var, velocity) = &mut self.params[index];
            *velocity = Some(tensor.to_device(var.device())?.copy()?.detach());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_hand_computed_momentum_steps() -> anyhow::Result<()> {
        let var = Var::new(&[1.0f32, -2.0], &Device::Cpu)?;
        let mut opt = SgdMomentum::new(
            vec![var.clone()],
            SgdMomentumConfig {
                lr: 0.1,
                momentum: 0.5,
                weight_decay: 0.0,
            },
        )?;
        for _ in 0..2 {
            let mut grads = GradStore::default();
            grads.insert(&var, Tensor::new(&[1.0f32, 1.0], &Device::Cpu)?);
            opt.step(&grads)?;
        }
        // v1 = 1, p = 0.9; v2 = 1.5, p = 0.75.
        let p = var.to_vec1::<f32>()?;
        assert!((p[0] - 0.75).abs() < 1e-6 && (p[1] + 2.25).abs() < 1e-6, "{p:?}");
        Ok(())
    }
}
