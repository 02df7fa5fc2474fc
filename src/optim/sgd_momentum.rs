//! SGD with momentum, which candle-nn's SGD lacks; PyTorch's semantics, so
//! results can be compared with a PyTorch run: `v ← μ·v + (g + λ·p)`,
//! `p ← p − lr·v`, with `v` starting at zero.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::Optimizer;

use super::in_place::{Accumulate, Descend};
use super::{check_state_entry, OptimizerState};

/// The state slot of one parameter: its velocity.
pub(super) const SLOTS: &[&str] = &["momentum"];

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
    /// Updates applied: SGD's arithmetic needs no count, but a checkpoint says how far it got.
    steps: u64,
}

impl Optimizer for SgdMomentum {
    type Config = SgdMomentumConfig;

    fn new(vars: Vec<Var>, config: SgdMomentumConfig) -> candle_core::Result<Self> {
        Ok(Self {
            params: vars.into_iter().map(|v| (v, None)).collect(),
            config,
            steps: 0,
        })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        let SgdMomentumConfig {
            lr,
            momentum,
            weight_decay,
        } = self.config;
        self.steps += 1;
        for (var, velocity) in &mut self.params {
            let Some(grad) = grads.get(var) else { continue };
            let p = var.as_tensor();
            if !p.device().is_cpu() {
                composed_step(var, velocity, grad, self.config)?;
                continue;
            }
            // On the CPU each update is one pass over the parameter, in place.
            let grad = &grad.contiguous()?;
            let decay = weight_decay as f32;
            if momentum == 0.0 {
                p.inplace_op2(grad, &Descend { lr: lr as f32, decay })?;
                continue;
            }
            let v = match velocity {
                Some(v) => v,
                None => velocity.insert(grad.zeros_like()?),
            };
            let momentum = momentum as f32;
            v.inplace_op3(grad, p, &Accumulate { momentum, decay })?;
            p.inplace_op2(
                v,
                &Descend {
                    lr: lr as f32,
                    decay: 0.0,
                },
            )?;
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

/// The step of one parameter from candle's ops (on a GPU): the same arithmetic as the CPU's
/// passes below, in the same order.
fn composed_step(
    var: &Var,
    velocity: &mut Option<Tensor>,
    grad: &Tensor,
    config: SgdMomentumConfig,
) -> candle_core::Result<()> {
    let mut g = grad.clone();
    if config.weight_decay != 0.0 {
        g = (g + (var.as_tensor() * config.weight_decay)?)?;
    }
    if config.momentum != 0.0 {
        g = match velocity.take() {
            Some(v) => ((v * config.momentum)? + g)?,
            None => g,
        };
        *velocity = Some(g.clone());
    }
    var.set(&(var.as_tensor() - (g * config.lr)?)?)
}

impl SgdMomentum {
    /// Copies of the velocities (a parameter that has none yet exports nothing) and the count
    /// of updates applied.
    pub fn state(&self) -> candle_core::Result<OptimizerState> {
        let mut tensors = Vec::new();
        for (index, (_, velocity)) in self.params.iter().enumerate() {
            if let Some(velocity) = velocity {
                tensors.push((index, "momentum".to_string(), velocity.copy()?.detach()));
            }
        }
        Ok(OptimizerState {
            steps: self.steps,
            tensors,
        })
    }

    /// Replaces the whole state with `state` (a parameter it lacks has no velocity yet); checks
    /// every entry before changing anything.
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
        self.steps = state.steps;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_in_place_cpu_steps_equal_the_composed_ones_bitwise() -> anyhow::Result<()> {
        for (momentum, weight_decay) in [(0.0, 0.0), (0.0, 0.01), (0.9, 0.0), (0.9, 0.01)] {
            let config = SgdMomentumConfig {
                lr: 0.05,
                momentum,
                weight_decay,
            };
            let start = Tensor::randn(0f32, 1.0, (7, 5), &Device::Cpu)?;
            let (fused, composed) = (Var::from_tensor(&start.copy()?)?, Var::from_tensor(&start.copy()?)?);
            let mut opt = SgdMomentum::new(vec![fused.clone()], config)?;
            let mut velocity = None;
            for _ in 0..3 {
                let grad = Tensor::randn(0f32, 1.0, (7, 5), &Device::Cpu)?;
                // d/dp Σ p·g = g, exactly.
                let grads = (fused.as_tensor() * &grad)?.sum_all()?.backward()?;
                opt.step(&grads)?;
                composed_step(&composed, &mut velocity, &grad, config)?;
            }
            let bits = |v: &Var| -> anyhow::Result<Vec<u32>> {
                Ok(v.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())
            };
            assert_eq!(
                bits(&fused)?,
                bits(&composed)?,
                "momentum {momentum}, decay {weight_decay}"
            );
        }
        Ok(())
    }

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
