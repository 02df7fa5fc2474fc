//! Scoring held-out rows: piece by piece on one replica, then summed over the ranks.

use anyhow::Result;
use candle_core::Device;

use crate::config::LossKind;
use crate::data::Batch;
use crate::engines::comm::CommWorker;
use crate::models::{Model, Score};

/// The score of `pieces` of held-out rows under `model` (trained with `loss`), one forward pass
/// a piece, so that evaluation's memory does not grow with the rows.
pub fn score_pieces(
    model: &Model,
    pieces: impl Iterator<Item = anyhow::Result<Batch>>,
    loss: LossKind,
    device: &Device,
) -> anyhow::Result<Score> {
    let mut score = Score::default();
    for piece in pieces {
        let (x, y) = piece?.tensors(device)?;
        score += model.score(loss, &model.forward(&x)?, &y)?;
    }
    Ok(score)
}

/// `score` summed over the ranks of `comm`'s ring. Counts below 2^24 are exact in f32, and a
/// sum of squared errors keeps f32's relative precision.
pub(crate) fn sum_over_ranks(comm: &CommWorker, score: Score) -> Result<Score> {
    let mut sums = [score.total as f32, score.loss_total as f32, score.count as f32];
    let sums = comm.run(move |c| {
        c.all_reduce_sum("all-reduce of evaluation scores", &mut sums)?;
        Ok(sums)
    })?;
    Ok(Score {
        total: f64::from(sums[0]),
        loss_total: f64::from(sums[1]),
        count: sums[2] as usize,
    })
}
