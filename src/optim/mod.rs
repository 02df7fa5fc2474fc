//! Optimizers and the learning-rate policy.

mod adamw;
mod clip;
mod gradient_merge;
mod in_place;
mod lr_policy;
mod sgd_momentum;

pub use adamw::AdamW;
pub use clip::{clip_by_global_norm, scale_to_norm, sum_of_squares};
pub use gradient_merge::{check_run_length, GradientMerge, MergeBuffer};
pub use lr_policy::LrPolicy;
pub use sgd_momentum::{SgdMomentum, SgdMomentumConfig};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::{Optimizer as _, ParamsAdamW};

use crate::config::{OptimizerKind, TrainConfig};

/// The optimizer a job trains with, chosen by `train.optimizer`.
pub enum Optimizer {
    /// SGD with (PyTorch-style) momentum and weight decay.
    Sgd(SgdMomentum),
    /// AdamW, bit-identical to candle-nn's.
    AdamW(AdamW),
}

/// Everything an optimizer carries between steps besides the parameters.
#[derive(Debug, Clone)]
pub struct OptimizerState {
    /// Updates applied so far (AdamW's bias-correction counter; SGD's only record of them).
    pub steps: u64,
    /// State tensors by parameter index (the order of the vars given to `new`) and slot name,
    /// e.g. (3, "momentum") for SGD, (3, "m") and (3, "v") for AdamW.
    pub tensors: Vec<(usize, String, Tensor)>,
}

impl Optimizer {
    /// The optimizer of `train` over `vars`, starting at learning rate `lr`.
    pub fn new(train: &TrainConfig, vars: Vec<Var>, lr: f64) -> candle_core::Result<Self> {
        Ok(match train.optimizer {
            OptimizerKind::Sgd => Self::Sgd(SgdMomentum::new(
                vars,
                SgdMomentumConfig {
                    lr,
                    momentum: train.momentum,
                    weight_decay: train.weight_decay,
                },
            )?),
            OptimizerKind::Adamw => Self::AdamW(AdamW::new(
                vars,
                ParamsAdamW {
                    lr,
                    weight_decay: train.weight_decay,
                    ..ParamsAdamW::default()
                },
            )?),
            OptimizerKind::Adagrad | OptimizerKind::Adam => {
                return Err(candle_core::Error::Msg(format!(
                    "train.optimizer = {:?} runs on parameter servers, not on a replica",
                    train.optimizer
                )))
            }
        })
    }

    /// The optimizer's kind, for a checkpoint to refuse the state of another: "sgd" or "adamw".
    pub fn name(&self) -> &'static str {
        match self {
            Self::Sgd(_) => "sgd",
            Self::AdamW(_) => "adamw",
        }
    }

    /// The state slots it keeps per parameter.
    pub fn slots(&self) -> &'static [&'static str] {
        match self {
            Self::Sgd(_) => sgd_momentum::SLOTS,
            Self::AdamW(_) => adamw::SLOTS,
        }
    }

    /// The learning rate of the next step.
    pub fn learning_rate(&self) -> f64 {
        match self {
            Self::Sgd(o) => o.learning_rate(),
            Self::AdamW(o) => o.learning_rate(),
        }
    }

    /// A copy of the state, unaffected by later steps.
    pub fn state(&self) -> candle_core::Result<OptimizerState> {
        match self {
            Self::Sgd(o) => o.state(),
            Self::AdamW(o) => o.state(),
        }
    }

    /// Replaces the state with `state` (as exported by [`Optimizer::state`] of an optimizer of
    /// the same kind over parameters of the same shapes), so the following steps are those of
    /// the optimizer that exported it. Fails, changing nothing, on an entry whose index is out
    /// of range, whose slot this optimizer does not know or whose shape or dtype differs from
    /// the parameter's.
    pub fn load_state(&mut self, state: OptimizerState) -> candle_core::Result<()> {
        match self {
            Self::Sgd(o) => o.load_state(state),
            Self::AdamW(o) => o.load_state(state),
        }
    }

    /// Applies one update from `grads`.
    pub fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        match self {
            Self::Sgd(o) => o.step(grads),
            Self::AdamW(o) => o.step(grads),
        }
    }

    /// Sets the learning rate of the next step.
    pub fn set_learning_rate(&mut self, lr: f64) {
        match self {
            Self::Sgd(o) => o.set_learning_rate(lr),
            Self::AdamW(o) => o.set_learning_rate(lr),
        }
    }
}

/// Checks one entry `(index, slot, tensor)` of a state loaded into the optimizer `kind`, which
/// knows `slots` and has `count` parameters, `param` being the one at `index`.
fn check_state_entry(
    kind: &str,
    slots: &[&str],
    count: usize,
    param: Option<&Var>,
    index: usize,
    slot: &str,
    tensor: &Tensor,
) -> candle_core::Result<()> {
    let entry = format!("{kind} state entry ({index}, {slot:?})");
    let Some(param) = param else {
        candle_core::bail!("{entry}: index out of range, the optimizer has {count} parameters")
    };
    if !slots.contains(&slot) {
        candle_core::bail!("{entry}: unknown slot, {kind} has {slots:?}")
    }
    if tensor.dims() != param.dims() {
        candle_core::bail!("{entry}: expected shape {:?}, found {:?}", param.dims(), tensor.dims())
    }
    if tensor.dtype() != param.dtype() {
        candle_core::bail!(
            "{entry}: expected dtype {:?}, found {:?}",
            param.dtype(),
            tensor.dtype()
        )
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The optimizer `kind` (with weight decay, and momentum for SGD) over `vars`.
    fn optimizer(kind: OptimizerKind, vars: &[Var]) -> candle_core::Result<Optimizer> {
        let train = TrainConfig {
            optimizer: kind,
            momentum: 0.9,
            weight_decay: 0.01,
            ..TrainConfig::default()
        };
        Optimizer::new(&train, vars.to_vec(), 0.05)
    }

    /// Vars holding copies of `values`.
    fn vars(values: &[Tensor]) -> candle_core::Result<Vec<Var>> {
        values.iter().map(|t| Var::from_tensor(&t.copy()?)).collect()
    }

    /// Copies of the values of `vars`, flattened.
    fn values(vars: &[Var]) -> candle_core::Result<Vec<Vec<f32>>> {
        vars.iter().map(|v| v.flatten_all()?.to_vec1()).collect()
    }

    /// One step on deterministic, irregular gradients; the last var gets none before step 3.
    fn step(opt: &mut Optimizer, vars: &[Var], step: usize) -> candle_core::Result<()> {
        let mut grads = GradStore::default();
        for (i, var) in vars.iter().enumerate() {
            if i == vars.len() - 1 && step < 3 {
                continue;
            }
            let g: Vec<f32> = (0..var.elem_count())
                .map(|k| ((k * 5 + step * 11 + i * 17) as f32 * 0.41).cos())
                .collect();
            grads.insert(var, Tensor::from_vec(g, var.shape(), var.device())?);
        }
        opt.step(&grads)
    }

    #[test]
    fn a_loaded_state_continues_bit_identically() -> anyhow::Result<()> {
        let device = Device::Cpu;
        let init = [
            Tensor::new(&[[0.5f32, -1.25, 2.0], [0.125, -0.75, 3.5]], &device)?,
            Tensor::new(&[1.0f32, -2.0, 0.25], &device)?,
            Tensor::new(&[0.3f32, 0.6], &device)?,
        ];
        for (kind, name) in [(OptimizerKind::Sgd, "sgd"), (OptimizerKind::Adamw, "adamw")] {
            let original_vars = vars(&init)?;
            let mut original = optimizer(kind, &original_vars)?;
            assert_eq!(original.name(), name);
            for s in 0..3 {
                step(&mut original, &original_vars, s)?;
            }
            let state = original.state()?;
            let saved: Vec<Tensor> = original_vars
                .iter()
                .map(|v| v.as_tensor().copy())
                .collect::<Result<_, _>>()?;
            match kind {
                // The last var has had no gradient, so no velocity yet.
                OptimizerKind::Sgd => {
                    assert_eq!(state.steps, 3, "a checkpoint says how many updates SGD applied");
                    let slots: Vec<_> = state.tensors.iter().map(|(i, s, _)| (*i, s.as_str())).collect();
                    assert_eq!(slots, [(0, "momentum"), (1, "momentum")]);
                }
                _ => assert_eq!((state.steps, state.tensors.len()), (3, 6)),
            }
            // The original runs on before the state is loaded: the exported copies must not
            // follow it.
            for s in 3..6 {
                step(&mut original, &original_vars, s)?;
            }
            let resumed_vars = vars(&saved)?;
            let mut resumed = optimizer(kind, &resumed_vars)?;
            resumed.load_state(state)?;
            for s in 3..6 {
                step(&mut resumed, &resumed_vars, s)?;
            }
            assert_eq!(values(&resumed_vars)?, values(&original_vars)?, "{name}");
            assert_ne!(values(&resumed_vars)?, values(&vars(&saved)?)?, "{name}");
        }
        Ok(())
    }

    #[test]
    fn a_mismatched_state_is_refused_naming_the_entry() -> anyhow::Result<()> {
        let device = Device::Cpu;
        let init = [Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &device)?];
        for (kind, slot) in [(OptimizerKind::Sgd, "momentum"), (OptimizerKind::Adamw, "v")] {
            let mut opt = optimizer(kind, &vars(&init)?)?;
            let load = |opt: &mut Optimizer, index, slot: &str, tensor| {
                let state = OptimizerState {
                    steps: 0,
                    tensors: vec![(index, slot.to_string(), tensor)],
                };
                opt.load_state(state).unwrap_err().to_string()
            };
            let wrong_shape = load(&mut opt, 0, slot, Tensor::zeros(3, candle_core::DType::F32, &device)?);
            assert!(wrong_shape.contains(&format!("(0, {slot:?})")), "{wrong_shape}");
            assert!(
                wrong_shape.contains("expected shape [2, 2], found [3]"),
                "{wrong_shape}"
            );
            let unknown_slot = load(&mut opt, 0, "velocity", init[0].clone());
            assert!(
                unknown_slot.contains("(0, \"velocity\"): unknown slot"),
                "{unknown_slot}"
            );
            let out_of_range = load(&mut opt, 1, slot, init[0].clone());
            assert!(
                out_of_range.contains(&format!("(1, {slot:?}): index out of range")),
                "{out_of_range}"
            );
            let wrong_dtype = load(&mut opt, 0, slot, init[0].to_dtype(candle_core::DType::F64)?);
            assert!(wrong_dtype.contains("expected dtype F32, found F64"), "{wrong_dtype}");
        }
        Ok(())
    }
}
