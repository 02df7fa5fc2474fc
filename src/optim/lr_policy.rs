//! The learning rate of each optimizer step: the base rate, scaled by the world size
//! (`train.lr_scaling`), ramped up linearly over `train.warmup_steps`, then decayed by
//! `train.lr_schedule` over the rest of the run.

use crate::config::{LrScaling, LrSchedule, TrainConfig};

/// Learning rate as a function of the optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrPolicy {
    peak: f64,
    warmup_steps: usize,
    schedule: LrSchedule,
    /// Optimizer steps of the whole run: where `linear` and `cosine` reach `min`.
    total_steps: usize,
    min: f64,
    step_size: usize,
    gamma: f64,
}

impl LrPolicy {
    /// The policy of `train` for `world_size` ranks over a run of `total_steps` optimizer steps.
    pub fn new(train: &TrainConfig, world_size: usize, total_steps: usize) -> Self {
        let n = world_size as f64;
        let scale = match train.lr_scaling {
            LrScaling::None => 1.0,
            LrScaling::Linear => n,
            LrScaling::Sqrt => n.sqrt(),
        };
        Self {
            peak: train.lr * scale,
            warmup_steps: train.warmup_steps,
            schedule: train.lr_schedule,
            total_steps,
            min: train.lr_min,
            step_size: train.lr_step_size.max(1),
            gamma: train.lr_gamma,
        }
    }

    /// The rate after warm-up.
    pub fn peak(&self) -> f64 {
        self.peak
    }

    /// The rate of optimizer step `step` (0-based): `peak · (step+1)/warmup` during warm-up,
    /// then the schedule's.
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.peak * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let since = step - self.warmup_steps;
        // The share of the decay done: 0 at the first step after warm-up, 1 at the last.
        let done = || {
            let span = self.total_steps.saturating_sub(self.warmup_steps + 1).max(1);
            (since as f64 / span as f64).min(1.0)
        };
        match self.schedule {
            LrSchedule::Constant => self.peak,
            LrSchedule::Linear => self.min + (self.peak - self.min) * (1.0 - done()),
            LrSchedule::Cosine => {
                self.min + (self.peak - self.min) * (1.0 + (std::f64::consts::PI * done()).cos()) / 2.0
            }
            LrSchedule::Step => self.peak * self.gamma.powi((since / self.step_size) as i32),
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
        let p = LrPolicy::new(&train, 4, 100);
        assert!((p.peak() - 0.2).abs() < 1e-12);
        assert!((p.at(0) - 0.05).abs() < 1e-12);
        assert!((p.at(3) - 0.2).abs() < 1e-12 && (p.at(100) - 0.2).abs() < 1e-12);
        train.lr_scaling = LrScaling::Linear;
        assert!((LrPolicy::new(&train, 4, 100).peak() - 0.4).abs() < 1e-12);
    }

    #[test]
    fn schedules_decay_from_the_peak_after_warm_up_to_their_end() {
        let schedule = |schedule, warmup_steps| {
            let train = TrainConfig {
                lr: 1.0,
                lr_min: 0.1,
                warmup_steps,
                lr_schedule: schedule,
                lr_step_size: 3,
                lr_gamma: 0.5,
                ..TrainConfig::default()
            };
            LrPolicy::new(&train, 1, 11)
        };
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        // 11 steps: the decay runs over steps 0..=10, or from the first after warm-up.
        let linear = schedule(LrSchedule::Linear, 0);
        assert!(close(linear.at(0), 1.0) && close(linear.at(5), 0.55));
        assert!(close(linear.at(10), 0.1) && close(linear.at(50), 0.1));
        let warmed = schedule(LrSchedule::Cosine, 2);
        assert!(close(warmed.at(0), 0.5) && close(warmed.at(2), 1.0) && close(warmed.at(10), 0.1));
        let cosine = schedule(LrSchedule::Cosine, 0);
        assert!(close(cosine.at(0), 1.0) && close(cosine.at(5), 0.55) && close(cosine.at(10), 0.1));
        assert!(cosine.at(2) > 0.55 + (1.0 - 0.55) / 2.0, "cosine stays high early");
        let step = schedule(LrSchedule::Step, 0);
        let rates: Vec<f64> = (0..7).map(|s| step.at(s)).collect();
        assert_eq!(rates, [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]);
        assert!(close(schedule(LrSchedule::Constant, 0).at(10), 1.0));
    }
}
