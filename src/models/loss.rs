//! The training losses and the held-out scores of every model: cross-entropy of logits over
//! their last dimension, against one target per row (classification, `(N, C)` logits) or per
//! position (a language model, `(B, T, V)` logits and `(B, T)` next tokens); squared or absolute
//! error against values (regression, `(N, K)` predictions and targets).

use candle_core::{DType, Tensor, D};

use crate::config::LossKind;

/// The mean `kind` loss of `outputs` against `targets`.
pub fn training_loss(kind: LossKind, outputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    match kind {
        LossKind::CrossEntropy => cross_entropy(outputs, targets),
        LossKind::Mse => outputs.sub(&same_shape(outputs, targets)?)?.sqr()?.mean_all(),
        LossKind::Mae => outputs.sub(&same_shape(outputs, targets)?)?.abs()?.mean_all(),
    }
}

/// `targets` as values of `outputs`' shape, or an error saying what did not fit.
fn same_shape(outputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    if targets.dtype() != DType::F32 || outputs.dims() != targets.dims() {
        candle_core::bail!(
            "a regression needs f32 targets of the predictions' shape {:?}, got {:?} {:?}",
            outputs.dims(),
            targets.dtype(),
            targets.dims()
        );
    }
    Ok(targets.clone())
}

impl std::ops::AddAssign for Score {
    fn add_assign(&mut self, other: Self) {
        self.total += other.total;
        self.loss_total += other.loss_total;
        self.count += other.count;
    }
}

/// The held-out figures of some predictions, as sums over them that ranks add together:
/// correct predictions (classification) or squared errors (regression), and the loss trained.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Score {
    /// Correct predictions, or the sum of squared errors.
    pub total: f64,
    /// The training loss summed over the predictions (its mean times their number).
    pub loss_total: f64,
    /// Predictions scored: rows, positions of a sequence, or regressed values.
    pub count: usize,
}

impl Score {
    /// The score of `outputs` against `targets` under a job trained with `kind`.
    pub fn of(kind: LossKind, outputs: &Tensor, targets: &Tensor) -> candle_core::Result<Self> {
        let count = targets.elem_count();
        let total = if kind.is_regression() {
            let errors = outputs.sub(&same_shape(outputs, targets)?)?;
            errors.sqr()?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?
        } else {
            correct_predictions(outputs, targets)? as f64
        };
        let mean_loss = training_loss(kind, outputs, targets)?.to_scalar::<f32>()?;
        Ok(Self {
            total,
            loss_total: f64::from(mean_loss) * count as f64,
            count,
        })
    }

    /// Accuracy or mean squared error (0 of nothing).
    pub fn mean(self) -> f64 {
        self.per_prediction(self.total)
    }

    /// The mean training loss (0 of nothing).
    pub fn mean_loss(self) -> f64 {
        self.per_prediction(self.loss_total)
    }

    /// The figures of these predictions under a job trained with `kind`.
    pub fn held_out(self, kind: LossKind) -> HeldOut {
        let loss = self.mean_loss();
        let classes = !kind.is_regression();
        HeldOut {
            loss,
            accuracy: classes.then(|| self.mean()),
            perplexity: classes.then(|| loss.exp()),
            mse: (!classes).then(|| self.mean()),
            samples: self.count,
        }
    }

    fn per_prediction(self, sum: f64) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            sum / self.count as f64
        }
    }
}

/// The figures of a held-out split, at the end of a run or every `train.eval_every` steps.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HeldOut {
    /// The mean training loss.
    pub loss: f64,
    /// Classification: the share predicted right.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<f64>,
    /// Classification: e to the mean cross-entropy (a language model's perplexity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perplexity: Option<f64>,
    /// Regression: the mean squared error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mse: Option<f64>,
    /// Predictions scored.
    pub samples: usize,
}

/// Logits flattened to `(positions, classes)` and targets to `(positions)`, checking that the
/// targets have the logits' leading shape.
fn positions(logits: &Tensor, targets: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let dims = logits.dims();
    let Some((&classes, leading)) = dims.split_last() else {
        candle_core::bail!("logits must have a class dimension, got a scalar");
    };
    if leading.is_empty() || targets.dims() != leading {
        candle_core::bail!("targets of shape {:?} for logits of shape {dims:?}", targets.dims());
    }
    let n = leading.iter().product::<usize>();
    Ok((logits.reshape((n, classes))?, targets.flatten_all()?))
}

/// Mean cross-entropy over every position.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let (logits, targets) = positions(logits, targets)?;
    candle_nn::loss::cross_entropy(&logits, &targets)
}

/// Positions whose most likely class is the target.
pub fn correct_predictions(logits: &Tensor, targets: &Tensor) -> candle_core::Result<usize> {
    let (logits, targets) = positions(logits, targets)?;
    let hits = logits.argmax(D::Minus1)?.eq(&targets)?;
    Ok(hits.to_dtype(candle_core::DType::U32)?.sum_all()?.to_scalar::<u32>()? as usize)
}

/// The index of the largest of `row`'s values, the first of ties (as evaluation counts a
/// prediction): a row's predicted class, or a language model's most likely next token.
pub fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |best, (i, &v)| if v > best.1 { (i, v) } else { best },
        )
        .0
}

/// Mean sigmoid cross-entropy of `logits` against 0/1 `labels`, in the numerically stable form
/// `max(x, 0) − x·y + ln(1 + e^(−|x|))`.
pub fn sigmoid_cross_entropy(logits: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
    let softplus = (logits.abs()?.neg()?.exp()? + 1.0)?.log()?;
    ((logits.relu()? - (logits * labels)?)? + softplus)?.mean(D::Minus1)
}

/// Click probabilities `sigmoid(logits)`.
pub fn click_probability(logits: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::ops::sigmoid(&logits.to_dtype(DType::F32)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn regression_losses_and_scores_follow_their_definitions() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let predicted = Tensor::new(&[[1f32, 2.0], [3.0, -1.0]], &dev)?;
        let targets = Tensor::new(&[[0f32, 2.0], [5.0, 0.0]], &dev)?;
        let mse = training_loss(LossKind::Mse, &predicted, &targets)?.to_scalar::<f32>()?;
        assert_eq!(mse, (1.0 + 0.0 + 4.0 + 1.0) / 4.0);
        let mae = training_loss(LossKind::Mae, &predicted, &targets)?.to_scalar::<f32>()?;
        assert_eq!(mae, (1.0 + 0.0 + 2.0 + 1.0) / 4.0);
        let score = Score::of(LossKind::Mae, &predicted, &targets)?;
        assert_eq!((score.total, score.count, score.mean()), (6.0, 4, 1.5));
        let err = training_loss(LossKind::Mse, &predicted, &targets.narrow(1, 0, 1)?).unwrap_err();
        assert!(err.to_string().contains("[2, 2]"), "{err}");
        let classes = Tensor::new(&[1u32, 1], &dev)?;
        assert!(training_loss(LossKind::Mse, &predicted, &classes).is_err());
        let hits = Score::of(LossKind::CrossEntropy, &predicted, &classes)?;
        assert_eq!((hits.total, hits.count), (1.0, 2));
        Ok(())
    }

    #[test]
    fn rows_and_positions_share_one_loss() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let logits = Tensor::new(
            &[[2f32, 0.0, 0.0], [0.0, 0.0, 3.0], [1.0, 2.0, 0.0], [0.0, 0.0, 0.0]],
            &dev,
        )?;
        let targets = Tensor::new(&[0u32, 1, 1, 2], &dev)?;
        let flat = cross_entropy(&logits, &targets)?.to_scalar::<f32>()?;
        let by_position = cross_entropy(&logits.reshape((2, 2, 3))?, &targets.reshape((2, 2))?)?;
        assert_eq!(flat, by_position.to_scalar::<f32>()?);
        // Row 3's tie goes to the first class (argmax), not the target 2.
        assert_eq!(correct_predictions(&logits, &targets)?, 2);
        assert!(cross_entropy(&logits.reshape((2, 2, 3))?, &targets).is_err());
        Ok(())
    }

    #[test]
    fn cross_entropy_matches_the_definition() -> candle_core::Result<()> {
        let logits = Tensor::new(&[-30.0f32, -1.0, 0.0, 2.5, 40.0], &Device::Cpu)?;
        let labels = Tensor::new(&[0.0f32, 1.0, 0.0, 1.0, 0.0], &Device::Cpu)?;
        let got = sigmoid_cross_entropy(&logits, &labels)?.to_scalar::<f32>()?;
        let expected: f64 = [(-30.0f64, 0.0f64), (-1.0, 1.0), (0.0, 0.0), (2.5, 1.0), (40.0, 0.0)]
            .iter()
            .map(|&(x, y)| {
                // ln σ(z), written per sign so neither branch overflows.
                let log_sigmoid = |z: f64| {
                    if z < 0.0 {
                        z - z.exp().ln_1p()
                    } else {
                        -(-z).exp().ln_1p()
                    }
                };
                -(y * log_sigmoid(x) + (1.0 - y) * log_sigmoid(-x))
            })
            .sum::<f64>()
            / 5.0;
        assert!((f64::from(got) - expected).abs() < 1e-4, "{got} vs {expected}");
        Ok(())
    }
}
