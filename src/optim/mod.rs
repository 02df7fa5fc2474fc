//! Optimizers and the learning-rate policy.

mod gradient_merge;
mod lr_policy;
mod sgd_momentum;

pub use gradient_merge::{check_run_length, GradientMerge};
pub use lr_policy::LrPolicy;
pub use sgd_momentum::{SgdMomentum, SgdMomentumConfig};

use candle_core::backprop::GradStore;
use candle_core::Var;
use candle_nn::{AdamW, Optimizer as _, ParamsAdamW};

use crate::config::{OptimizerKind, TrainConfig};

/// The optimizer a job trains with, chosen by `train.optimizer`.
pub enum Optimizer {
    /// SGD with (PyTorch-style) momentum and weight decay.
    Sgd(SgdMomentum),
    /// candle-nn's AdamW.
    AdamW(AdamW),
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
