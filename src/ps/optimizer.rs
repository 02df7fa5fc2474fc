//! The optimizer a PS shard applies to the rows and dense floats it holds.
//!
//! Updates are lazy: a row absent from a push is not touched at all — its
//! value, its momentum and, for Adam, its moments and step count stay as
//! they were. A row therefore follows PyTorch's optimizer exactly only while
//! it is pushed every step; a row pushed every tenth step takes ten Adam
//! steps' worth of bias correction over that time, not a hundred (as
//! Paddle's and TensorFlow's lazy sparse Adam do).

use crate::config::{JobConfig, LrScaling, OptimizerKind};
use crate::models::SparseTableSpec;

/// A per-row optimizer with its state stored next to the row.
///
/// State layout per row of `width`, after the row's value:
/// - `Sgd` with `momentum > 0`: the velocity `[width]`; no state otherwise.
/// - `Adagrad`: the squared-gradient sum `[width]`.
/// - `Adam`: first moment `[width]`, second moment `[width]`, then
///   `beta1^t` and `beta2^t` for the row's next step `t` (Paddle's
///   `Beta1Pow`/`Beta2Pow`), so each row corrects bias by its own step count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ServerOptimizer {
    /// PyTorch's SGD without dampening or Nesterov: `v = momentum·v + g`,
    /// `p -= lr·v`; the plain `p -= lr·g` (and no state) when `momentum` is 0.
    Sgd {
        /// Step size.
        lr: f32,
        /// Velocity decay; 0 keeps no per-row state.
        momentum: f32,
    },
    /// PyTorch's Adagrad without learning-rate decay: `s += g²`,
    /// `p -= lr·g / (sqrt(s) + epsilon)`.
    Adagrad {
        /// Step size.
        lr: f32,
        /// Keeps the first steps finite where `s` is still 0.
        epsilon: f32,
        /// The sum every new row starts from (PyTorch's
        /// `initial_accumulator_value`, Paddle's 0.1-style defaults).
        initial_accumulator: f32,
    },
    /// PyTorch's Adam without weight decay or AMSGrad.
    Adam {
        /// Step size.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the bias-corrected `sqrt(v)`, as in PyTorch.
        epsilon: f32,
    },
}

impl ServerOptimizer {
    /// The shards' optimizer of the dense parameters: `train.optimizer` at `train.lr` (scaled by
    /// `train.lr_scaling` with the trainer count), with `train.momentum`.
    pub fn for_job(job: &JobConfig) -> Self {
        Self::of(job, job.train.optimizer, job.train.lr)
    }

    /// The optimizer of sparse table `table`'s rows: the one the model declares for it, else
    /// the job's.
    pub fn for_table(job: &JobConfig, table: &SparseTableSpec) -> Self {
        Self::of(
            job,
            table.optimizer.unwrap_or(job.train.optimizer),
            table.lr.unwrap_or(job.train.lr),
        )
    }

    /// `kind` at `lr` scaled by `train.lr_scaling` with the trainer count.
    fn of(job: &JobConfig, kind: OptimizerKind, lr: f64) -> Self {
        let train = &job.train;
        let trainers = job.world_size() as f64;
        let lr = (lr
            * match train.lr_scaling {
                LrScaling::None => 1.0,
                LrScaling::Linear => trainers,
                LrScaling::Sqrt => trainers.sqrt(),
            }) as f32;
        match kind {
            OptimizerKind::Adagrad => Self::Adagrad {
                lr,
                epsilon: 1e-10,
                initial_accumulator: 0.0,
            },
            OptimizerKind::Adam => Self::Adam {
                lr,
                beta1: 0.9,
                beta2: 0.999,
                epsilon: 1e-8,
            },
            // Validation keeps AdamW off parameter servers.
            OptimizerKind::Sgd | OptimizerKind::Adamw => Self::Sgd {
                lr,
                momentum: train.momentum as f32,
            },
        }
    }

    /// Floats of state kept per row of `width`: sizes the row storage and is
    /// checked when a snapshot is loaded.
    pub fn state_len(&self, width: usize) -> usize {
        match *self {
            Self::Sgd { momentum: 0.0, .. } => 0,
            Self::Sgd { .. } | Self::Adagrad { .. } => width,
            Self::Adam { .. } => 2 * width + 2,
        }
    }

    /// Writes the state of a row that has never been updated.
    pub fn init_state(&self, state: &mut [f32]) {
        match *self {
            Self::Sgd { .. } => state.fill(0.0),
            Self::Adagrad {
                initial_accumulator, ..
            } => state.fill(initial_accumulator),
            Self::Adam { beta1, beta2, .. } => {
                let (moments, pows) = state.split_at_mut(state.len().saturating_sub(2));
                moments.fill(0.0);
                if let [beta1_pow, beta2_pow] = pows {
                    *beta1_pow = beta1;
                    *beta2_pow = beta2;
                }
            }
        }
    }

    /// One step on one row (or a dense slice taken as one row), in place.
    ///
    /// # Panics
    ///
    /// If `grad` is not as long as `value` or `state` is not
    /// `state_len(value.len())` long: callers check sizes where they come
    /// from the wire, so a mismatch here is a bug.
    pub fn apply(&self, value: &mut [f32], state: &mut [f32], grad: &[f32]) {
        let width = value.len();
        assert_eq!(grad.len(), width, "gradient length differs from the row width");
        assert_eq!(state.len(), self.state_len(width), "optimizer state length differs");
        match *self {
            Self::Sgd { lr, momentum: 0.0 } => {
                for (p, &g) in value.iter_mut().zip(grad) {
                    *p -= lr * g;
                }
            }
            Self::Sgd { lr, momentum } => {
                for ((p, v), &g) in value.iter_mut().zip(state.iter_mut()).zip(grad) {
                    *v = momentum * *v + g;
                    *p -= lr * *v;
                }
            }
            Self::Adagrad { lr, epsilon, .. } => {
                for ((p, s), &g) in value.iter_mut().zip(state.iter_mut()).zip(grad) {
                    *s += g * g;
                    *p -= lr * g / (s.sqrt() + epsilon);
                }
            }
            Self::Adam {
                lr,
                beta1,
                beta2,
                epsilon,
            } => {
                let (m, rest) = state.split_at_mut(width);
                let (v, pows) = rest.split_at_mut(width);
                let [beta1_pow, beta2_pow] = pows else {
                    unreachable!("state length checked above");
                };
                // PyTorch's `lr/bc1 · m / (sqrt(v)/sqrt(bc2) + eps)`, rearranged
                // so the loop has one division and one square root.
                let bc2_sqrt = (1.0 - *beta2_pow).sqrt();
                let step = lr * bc2_sqrt / (1.0 - *beta1_pow);
                let eps = epsilon * bc2_sqrt;
                for (((p, m), v), &g) in value.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(grad) {
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    *p -= step * *m / (v.sqrt() + eps);
                }
                *beta1_pow *= beta1;
                *beta2_pow *= beta2;
            }
        }
    }

    /// A stable name, written into snapshots so a shard never loads state
    /// meant for another optimizer.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Sgd { .. } => "sgd",
            Self::Adagrad { .. } => "adagrad",
            Self::Adam { .. } => "adam",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    const WIDTH: usize = 5;
    const STEPS: usize = 6;

    /// Gradients for `STEPS` steps, of both signs and several magnitudes.
    fn gradients() -> Vec<Vec<f32>> {
        let mut rng = SplitMix64::new(11);
        (0..STEPS)
            .map(|step| (0..WIDTH).map(|_| rng.uniform(-1.0, 1.0) * (1 + step) as f32).collect())
            .collect()
    }

    /// Runs `opt` over `gradients()` from a fixed start.
    fn run(opt: ServerOptimizer) -> (Vec<f32>, Vec<f32>) {
        let mut value: Vec<f32> = (0..WIDTH).map(|i| 0.5 - i as f32 * 0.3).collect();
        let mut state = vec![f32::NAN; opt.state_len(WIDTH)];
        opt.init_state(&mut state);
        for grad in gradients() {
            opt.apply(&mut value, &mut state, &grad);
        }
        (value, state)
    }

    fn start64() -> Vec<f64> {
        (0..WIDTH).map(|i| 0.5 - i as f64 * 0.3).collect()
    }

    fn assert_close(got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!(
                (f64::from(*g) - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "got {got:?}, want {want:?}"
            );
        }
    }

    #[test]
    fn plain_sgd_keeps_no_state() {
        let opt = ServerOptimizer::Sgd { lr: 0.1, momentum: 0.0 };
        let (value, state) = run(opt);
        assert!(state.is_empty());
        let mut want = start64();
        for grad in gradients() {
            for (p, g) in want.iter_mut().zip(&grad) {
                *p -= 0.1 * f64::from(*g);
            }
        }
        assert_close(&value, &want);
    }

    #[test]
    fn sgd_momentum_matches_pytorch() {
        let (lr, momentum) = (0.05, 0.9);
        let (value, state) = run(ServerOptimizer::Sgd { lr, momentum });
        // torch.optim.SGD: buf = g at step 1, then buf = m·buf + g; p -= lr·buf.
        let mut want = start64();
        let mut buf: Option<Vec<f64>> = None;
        for grad in gradients() {
            let g: Vec<f64> = grad.iter().map(|&g| f64::from(g)).collect();
            let next = match buf {
                None => g,
                Some(b) => b.iter().zip(&g).map(|(b, g)| f64::from(momentum) * b + g).collect(),
            };
            for (p, b) in want.iter_mut().zip(&next) {
                *p -= f64::from(lr) * b;
            }
            buf = Some(next);
        }
        assert_close(&value, &want);
        assert_close(&state, &buf.unwrap_or_default());
    }

    #[test]
    fn adagrad_matches_pytorch() {
        // A large epsilon, so that where it is added shows in the result.
        let (lr, epsilon, initial_accumulator) = (0.1, 0.1, 0.1);
        let (value, state) = run(ServerOptimizer::Adagrad {
            lr,
            epsilon,
            initial_accumulator,
        });
        let mut want = start64();
        let mut sum = vec![f64::from(initial_accumulator); WIDTH];
        for grad in gradients() {
            for ((p, s), &g) in want.iter_mut().zip(sum.iter_mut()).zip(&grad) {
                let g = f64::from(g);
                *s += g * g;
                *p -= f64::from(lr) * g / (s.sqrt() + f64::from(epsilon));
            }
        }
        assert_close(&value, &want);
        assert_close(&state, &sum);
    }

    #[test]
    fn adam_matches_pytorch() {
        // A large epsilon, so that where it is added shows in the result.
        let (lr, beta1, beta2, epsilon) = (0.01f32, 0.9f32, 0.999f32, 0.1f32);
        let (value, state) = run(ServerOptimizer::Adam {
            lr,
            beta1,
            beta2,
            epsilon,
        });
        // torch.optim.Adam, written as its docs state it.
        let (lr, b1, b2, eps) = (f64::from(lr), f64::from(beta1), f64::from(beta2), f64::from(epsilon));
        let mut want = start64();
        let (mut m, mut v) = (vec![0.0f64; WIDTH], vec![0.0f64; WIDTH]);
        for (step, grad) in gradients().iter().enumerate() {
            let t = step as i32 + 1;
            let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
            for i in 0..WIDTH {
                let g = f64::from(grad[i]);
                m[i] = b1 * m[i] + (1.0 - b1) * g;
                v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                want[i] -= lr / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + eps);
            }
        }
        assert_close(&value, &want);
        let steps = STEPS as i32;
        let want_state: Vec<f64> = m
            .iter()
            .chain(&v)
            .copied()
            .chain([b1.powi(steps + 1), b2.powi(steps + 1)])
            .collect();
        assert_close(&state, &want_state);
    }

    #[test]
    fn state_lengths_and_names() {
        let adam = ServerOptimizer::Adam {
            lr: 1.0,
            beta1: 0.9,
            beta2: 0.99,
            epsilon: 1e-8,
        };
        assert_eq!(adam.state_len(9), 20);
        assert_eq!(ServerOptimizer::Sgd { lr: 1.0, momentum: 0.5 }.state_len(9), 9);
        assert_eq!(ServerOptimizer::Sgd { lr: 1.0, momentum: 0.0 }.state_len(9), 0);
        let names = [
            adam.name(),
            ServerOptimizer::Sgd { lr: 1.0, momentum: 0.0 }.name(),
            ServerOptimizer::Adagrad {
                lr: 1.0,
                epsilon: 0.0,
                initial_accumulator: 0.0,
            }
            .name(),
        ];
        assert_eq!(names, ["adam", "sgd", "adagrad"]);
    }
}
