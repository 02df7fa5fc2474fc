//! The learning rate of each step: the base rate, scaled by the world size
//! (`train.lr_scaling`), ramped up linearly over `train.warmup_steps`.

use crate::config::{LrScaling, TrainConfig};

/// Learning rate as a function of the step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrPolicy {
    peak: f64,
    warmup_steps: usize,
}

impl LrPolicy {
    /// The policy of `train` for `world_size` ranks.
    pub fn new(train: &TrainConfig, world_size: usize) -> Self {
        let n = world_size as f64;
        let scale = match train.lr_scaling {
            LrScaling::None => 1.0,
            LrScaling::Linear => n,
            LrScaling::Sqrt => n.sqrt(),
        };
        Self {
            peak: train.lr * scale,
            warmup_steps: train.warmup_steps,
        }
    }

    /// The rate after warm-up.
    pub fn peak(&self) -> f64 {
        self.peak
    }

    /// The rate of `step` (0-based): `peak · (step+1)/warmup` during warm-up.
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            self.peak * (step + 1) as f64 / self.warmup_steps as f64
        } else {
            self.peak
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaling_and_warmup() {
        let mut train = TrainConfig {
            lr: 0.1,
            warmup_steps: 4,
            ..TrainConfig::default()
        };
        train.lr_scaling = LrScaling::Sqrt;
        let p = LrPolicy::new(&train, 4);
        assert!((p.peak() - 0.2).abs() < 1e-12);
        assert!((p.at(0) - 0.05).abs() < 1e-12);
        assert!((p.at(3) - 0.2).abs() < 1e-12 && (p.at(100) - 0.2).abs() < 1e-12);
        train.lr_scaling = LrScaling::Linear;
        assert!((LrPolicy::new(&train, 4).peak() - 0.4).abs() < 1e-12);
    }
}
