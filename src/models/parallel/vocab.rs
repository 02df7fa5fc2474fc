//! The vocabulary split over a [`super::LayerGroup`] (Megatron's vocabulary-parallel embedding and
//! cross-entropy): each rank holds the token table's rows, and computes the logits, of its slice
//! of the vocabulary. The cross-entropy never gathers the logits — per position the ranks agree
//! on the largest logit and on the sum of the exponentials (two collectives of one value per
//! position), and backward needs none.

use std::ops::Range;
use std::sync::Mutex;

use anyhow::Result;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, D};

use super::{balanced_slice, collective, leave, Group};
use crate::cpu_values::{cpu_values, with_cpu_values};
use crate::models::Score;

/// The slice of a vocabulary of `vocab` tokens rank `rank` of `group` holds: equal slices, the
/// first ranks one token more where the group does not divide the vocabulary (a character
/// vocabulary is what the text makes it).
pub fn vocab_slice(vocab: usize, group: &Group) -> Result<Range<usize>> {
    anyhow::ensure!(
        vocab >= group.size(),
        "a vocabulary of {vocab} tokens does not split over {} ranks",
        group.size()
    );
    Ok(balanced_slice(vocab, group.size(), group.rank()))
}

/// The embeddings of token `ids` (u32, any shape) from `table`, this rank's rows `slice` of the
/// whole token table: each rank looks up the ids in its slice (zeros elsewhere) and the group
/// sums them, so every rank gets every embedding; each table row's gradient stays on its rank.
pub fn embed(ids: &Tensor, table: &Tensor, slice: &Range<usize>, group: &Group) -> candle_core::Result<Tensor> {
    let local = ids.to_dtype(DType::I64)?.affine(1.0, -(slice.start as f64))?;
    let inside = local.ge(0i64)?.mul(&local.lt(slice.len() as i64)?)?;
    // Outside the slice: row 0, then masked to zero.
    let rows = local.mul(&inside.to_dtype(DType::I64)?)?.to_dtype(DType::U32)?;
    let looked_up = table.index_select(&rows.flatten_all()?, 0)?;
    let mask = inside.flatten_all()?.to_dtype(table.dtype())?.unsqueeze(1)?;
    let mut dims = ids.dims().to_vec();
    dims.push(table.dim(1)?);
    leave(&looked_up.broadcast_mul(&mask)?.reshape(dims)?, group)
}

/// The mean cross-entropy of logits split over `group` — `logits` (…, V/n) this rank's slice
/// `slice` of the vocabulary — against `targets` (u32, the logits' shape without the last
/// dimension): every rank gets the same loss, and backward gives each its slice's gradient.
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    slice: &Range<usize>,
    group: &Group,
) -> candle_core::Result<Tensor> {
    let width = logits.dim(D::Minus1)?;
    let logits = logits.reshape(((), width))?;
    let targets = targets.flatten_all()?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
    let losses = logits.apply_op1(SplitCrossEntropy {
        targets,
        slice: slice.clone(),
        group: group.clone(),
        log_sums: Mutex::new(Vec::new()),
    })?;
    losses.mean_all()
}

/// The score of logits split over `group` (as [`cross_entropy`] takes them) against `targets`:
/// the mean cross-entropy, and the positions whose most likely token — the first of ties over
/// the whole vocabulary — is the target, agreed on from each rank's largest logit and its place.
pub fn score(logits: &Tensor, targets: &Tensor, slice: &Range<usize>, group: &Group) -> candle_core::Result<Score> {
    let count = targets.elem_count();
    let mean_loss = cross_entropy(logits, targets, slice, group)?.to_scalar::<f32>()?;
    let width = logits.dim(D::Minus1)?;
    let rows = logits.reshape(((), width))?;
    // Per position, this slice's largest logit and its token (the first of ties).
    let best: Vec<(f32, u32)> = with_cpu_values(&rows.contiguous()?, "a vocabulary slice's logits", |values| {
        values
            .chunks_exact(width)
            .map(|row| {
                let i = crate::models::argmax(row);
                (row[i], (slice.start + i) as u32)
            })
            .collect()
    })?;
    let mine: Vec<u8> = best
        .iter()
        .flat_map(|&(v, i)| [v.to_le_bytes(), i.to_le_bytes()])
        .flatten()
        .collect();
    let all = collective(group.gather(mine, "all-gather of the slices' most likely tokens"))?;
    // The ranks' slices are in token order, so the first rank holding the largest logit holds
    // the first of its ties.
    let mut best = best;
    for theirs in all {
        let pairs = theirs.chunks_exact(8).map(|b| {
            let value = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            (value, u32::from_le_bytes([b[4], b[5], b[6], b[7]]))
        });
        for (mine, (value, token)) in best.iter_mut().zip(pairs) {
            if value > mine.0 || (value == mine.0 && token < mine.1) {
                *mine = (value, token);
            }
        }
    }
    let targets = targets.flatten_all()?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
    let correct = best
        .iter()
        .zip(&targets)
        .filter(|((_, token), target)| token == *target)
        .count();
    Ok(Score {
        total: correct as f64,
        loss_total: f64::from(mean_loss) * count as f64,
        count,
    })
}

/// Each position's cross-entropy from its slice of the logits: `log Σ exp(l) − l[target]` over
/// the whole vocabulary.
struct SplitCrossEntropy {
    targets: Vec<u32>,
    slice: Range<usize>,
    group: Group,
    /// Per position, the log of the sum of the exponentials over the whole vocabulary, from
    /// forward: backward's softmax needs nothing from the other ranks.
    log_sums: Mutex<Vec<f32>>,
}

impl CustomOp1 for SplitCrossEntropy {
    fn name(&self) -> &'static str {
        "vocab-parallel-cross-entropy"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, width) = layout.shape().dims2()?;
        let logits = cpu_values(storage, layout, "a vocabulary slice's logits")?;
        if self.targets.len() != rows {
            candle_core::bail!("{} targets for {rows} positions", self.targets.len());
        }
        let local_max: Vec<f32> = logits
            .chunks_exact(width)
            .map(|row| row.iter().copied().fold(f32::NEG_INFINITY, f32::max))
            .collect();
        let max = collective(self.group.max(local_max, "all-gather of the logits' largest values"))?;
        // Per position: Σ exp(l − max) over this slice, and the target's shifted logit where
        // this slice holds it; summed over the group in one all-reduce.
        let mut sums = Vec::with_capacity(2 * rows);
        for ((row, &m), &target) in logits.chunks_exact(width).zip(&max).zip(&self.targets) {
            sums.push(row.iter().map(|&l| (l - m).exp()).sum::<f32>());
            let target = target as usize;
            sums.push(match self.slice.contains(&target) {
                true => row[target - self.slice.start] - m,
                false => 0.0,
            });
        }
        let sums = collective(self.group.sum(sums, "all-reduce of the softmax's sums"))?;
        let mut log_sums = Vec::with_capacity(rows);
        let mut losses = Vec::with_capacity(rows);
        for (pair, &m) in sums.chunks_exact(2).zip(&max) {
            let log_sum = pair[0].ln();
            log_sums.push(log_sum + m);
            losses.push(log_sum - pair[1]);
        }
        *self
            .log_sums
            .lock()
            .map_err(|_| candle_core::Error::Msg("a poisoned lock".into()))? = log_sums;
        Ok((CpuStorage::F32(losses), Shape::from(rows)))
    }

    fn bwd(&self, logits: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (rows, width) = logits.dims2()?;
        let log_sums = self
            .log_sums
            .lock()
            .map_err(|_| candle_core::Error::Msg("a poisoned lock".into()))?
            .clone();
        let upstream = grad.to_vec1::<f32>()?;
        let mut out = with_cpu_values(&logits.contiguous()?, "a vocabulary slice's logits", |values| {
            values
                .chunks_exact(width)
                .zip(&log_sums)
                .zip(&upstream)
                .flat_map(|((row, &log_sum), &g)| row.iter().map(move |&l| (l - log_sum).exp() * g))
                .collect::<Vec<f32>>()
        })?;
        for (row, (&target, &g)) in self.targets.iter().zip(&upstream).enumerate() {
            let target = target as usize;
            if self.slice.contains(&target) {
                out[row * width + target - self.slice.start] -= g;
            }
        }
        Tensor::from_vec(out, (rows, width), logits.device()).map(Some)
    }
}
