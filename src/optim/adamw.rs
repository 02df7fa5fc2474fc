//! AdamW with exportable state. candle-nn's `AdamW` keeps its moments and step counter private,
//! but checkpoints must save and restore them; this is the same algorithm with the same
//! arithmetic in the same order (so results are bit-identical to candle-nn 0.11.1's), plus
//! [`AdamW::state`] and [`AdamW::load_state`]. On the CPU the update runs as three in-place
//! passes ([`super::in_place`]) instead of a dozen tensor ops with their temporaries.

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Var};
use candle_nn::{Optimizer, ParamsAdamW};

use super::in_place::{AdamWStep, Moment};
use super::{check_state_entry, OptimizerState};

/// The state slots of one parameter: first and second moment.
pub(super) const SLOTS: &[&str] = &["m", "v"];

/// One parameter and its moments; `None` for a non-float parameter, which (as in candle-nn) is
/// never updated.
struct Param {
    var: Var,
    moments: Option<(Var, Var)>,
}

/// AdamW over a fixed set of variables.
pub struct AdamW {
    params: Vec<Param>,
    step_t: usize,
    config: ParamsAdamW,
}

impl Optimizer for AdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, config: ParamsAdamW) -> Result<Self> {
        let params = vars
            .into_iter()
            .map(|var| {
                let moments = if var.dtype().is_float() {
                    let zeros = || Var::zeros(var.shape(), var.dtype(), var.device());
                    Some((zeros()?, zeros()?))
                } else {
                    None
                };
                Ok(Param { var, moments })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            params,
            step_t: 0,
            config,
        })
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step_t += 1;
        let lr = self.config.lr;
        let lambda = self.config.weight_decay;
        let lr_lambda = lr * lambda;
        let beta1 = self.config.beta1;
        let beta2 = self.config.beta2;
        let scale_m = 1f64 / (1f64 - beta1.powi(self.step_t as i32));
        let scale_v = 1f64 / (1f64 - beta2.powi(self.step_t as i32));
        for param in &self.params {
            let theta = &param.var;
            let Some((m, v)) = &param.moments else { continue };
            let Some(g) = grads.get(theta) else { continue };
            if theta.device().is_cpu() && theta.dtype() == DType::F32 {
                // One pass per moment and one over the parameter, in place.
                let g = &g.contiguous()?;
                for (moment, beta, squared) in [(m, beta1, false), (v, beta2, true)] {
                    let rest = (1.0 - beta) as f32;
                    let beta = beta as f32;
                    moment.inplace_op2(g, &Moment { beta, rest, squared })?;
                }
                let step = AdamWStep {
                    lr: lr as f32,
                    decay: (1.0 - lr_lambda) as f32,
                    scale_m: scale_m as f32,
                    scale_v: scale_v as f32,
                    eps: self.config.eps as f32,
                };
                theta.inplace_op3(m.as_tensor(), v.as_tensor(), &step)?;
                continue;
            }
            let next_m = ((m.as_tensor() * beta1)? + (g * (1.0 - beta1))?)?;
            let next_v = ((v.as_tensor() * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            let next_theta = (theta.as_tensor() * (1f64 - lr_lambda))?;
            let adjusted_grad = (m_hat / (v_hat.sqrt()? + self.config.eps)?)?;
            let next_theta = (next_theta - (adjusted_grad * lr)?)?;
            m.set(&next_m)?;
            v.set(&next_v)?;
            theta.set(&next_theta)?;
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

impl AdamW {
    /// Copies of the step counter and of every float parameter's "m" and "v".
    pub fn state(&self) -> Result<OptimizerState> {
        let mut tensors = Vec::new();
        for (index, param) in self.params.iter().enumerate() {
            if let Some((m, v)) = &param.moments {
                // `Var::set` overwrites the storage in place: copy, or later steps would show.
                tensors.push((index, "m".to_string(), m.as_tensor().copy()?.detach()));
                tensors.push((index, "v".to_string(), v.as_tensor().copy()?.detach()));
            }
        }
        Ok(OptimizerState {
            steps: self.step_t as u64,
            tensors,
        })
    }

    /// Replaces the whole state with `state` (moments it lacks restart at zero); checks every
    /// entry before changing anything.
    pub fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        let Ok(step_t) = usize::try_from(state.steps) else {
            candle_core::bail!("adamw state: step count {} out of range", state.steps)
        };
        for (index, slot, tensor) in &state.tensors {
            let param = self.params.get(*index);
            check_state_entry(
                "adamw",
                SLOTS,
                self.params.len(),
                param.map(|p| &p.var),
                *index,
                slot,
                tensor,
            )?;
            if param.is_some_and(|p| p.moments.is_none()) {
                candle_core::bail!("adamw state entry ({index}, {slot:?}): parameter {index} is not a float, adamw keeps no state for it")
            }
        }
        for (m, v) in self.params.iter().filter_map(|p| p.moments.as_ref()) {
            m.zero_set()?;
            v.zero_set()?;
        }
        for (index, slot, tensor) in state.tensors {
            // Every entry was checked above: a float parameter within range.
            if let Some((m, v)) = self.params.get(index).and_then(|p| p.moments.as_ref()) {
                let moment = if slot == "m" { m } else { v };
                moment.set(&tensor.to_device(moment.device())?)?;
            }
        }
        self.step_t = step_t;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// A deterministic, irregular gradient for `var` at `step`.
    fn gradient(var: &Var, step: usize, salt: usize) -> candle_core::Result<Tensor> {
        let values: Vec<f32> = (0..var.elem_count())
            .map(|k| ((k * 7 + step * 13 + salt * 29) as f32 * 0.37).sin() * (1.0 + step as f32))
            .collect();
        Tensor::from_vec(values, var.shape(), var.device())
    }

    #[test]
    fn bit_identical_to_candle_nn_adamw() -> anyhow::Result<()> {
        let device = Device::Cpu;
        let init = [
            Tensor::new(&[[0.5f32, -1.25, 2.0], [0.125, -0.75, 3.5]], &device)?,
            Tensor::new(&[1.0f32, -2.0, 0.25, 4.0], &device)?,
        ];
        let ours_vars: Vec<Var> = init.iter().map(Var::from_tensor).collect::<candle_core::Result<_>>()?;
        let theirs_vars: Vec<Var> = init.iter().map(Var::from_tensor).collect::<candle_core::Result<_>>()?;
        let config = ParamsAdamW {
            lr: 0.01,
            weight_decay: 0.1,
            ..ParamsAdamW::default()
        };
        let mut ours = AdamW::new(ours_vars.clone(), config.clone())?;
        let mut theirs = candle_nn::AdamW::new(theirs_vars.clone(), config)?;
        for step in 0..5 {
            if step == 3 {
                ours.set_learning_rate(0.003);
                theirs.set_learning_rate(0.003);
            }
            let (mut ours_grads, mut theirs_grads) = (GradStore::default(), GradStore::default());
            for (salt, (o, t)) in ours_vars.iter().zip(&theirs_vars).enumerate() {
                // The second parameter gets no gradient at step 2.
                if step == 2 && salt == 1 {
                    continue;
                }
                let g = gradient(o, step, salt)?;
                ours_grads.insert(o, g.clone());
                theirs_grads.insert(t, g);
            }
            ours.step(&ours_grads)?;
            theirs.step(&theirs_grads)?;
        }
        for (o, t) in ours_vars.iter().zip(&theirs_vars) {
            let (o, t) = (o.flatten_all()?.to_vec1::<f32>()?, t.flatten_all()?.to_vec1::<f32>()?);
            assert_eq!(o, t);
        }
        assert_ne!(
            ours_vars[0].flatten_all()?.to_vec1::<f32>()?,
            init[0].flatten_all()?.to_vec1::<f32>()?
        );
        Ok(())
    }
}
