//! The vocabulary split over a [`LayerGroup`] (Megatron's vocabulary-parallel embedding and
//! cross-entropy): each rank holds the token table's rows, and computes the logits, of its slice
//! of the vocabulary. The cross-entropy never gathers the logits — per position the ranks agree
//! on the largest logit and on the sum of the exponentials (two collectives of one value per
//! position), and backward needs none.

use std::ops::Range;
use std::sync::Mutex;

use anyhow::{ensure, Result};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, D};

use super::tensor_parallel::{leave, LayerGroup};
use crate::cpu_values::{cpu_values, with_cpu_values};

/// The slice of a vocabulary of `vocab` tokens rank `rank` of `group` holds: equal slices
/// (checked to divide).
pub fn vocab_slice(vocab: usize, group: &LayerGroup) -> Result<Range<usize>> {
    let parts = group.size();
    ensure!(
        vocab.is_multiple_of(parts),
        "a vocabulary of {vocab} tokens does not split into {parts} equal slices"
    );
    let size = vocab / parts;
    Ok(group.rank() * size..(group.rank() + 1) * size)
}

/// The embeddings of token `ids` (u32, any shape) from `table`, this rank's rows `slice` of the
/// whole token table: each rank looks up the ids in its slice (zeros elsewhere) and the group
/// sums them, so every rank gets every embedding; each table row's gradient stays on its rank.
pub fn embed(ids: &Tensor, table: &Tensor, slice: &Range<usize>, group: &LayerGroup) -> candle_core::Result<Tensor> {
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
    group: &LayerGroup,
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

/// Each position's cross-entropy from its slice of the logits: `log Σ exp(l) − l[target]` over
/// the whole vocabulary.
struct SplitCrossEntropy {
    targets: Vec<u32>,
    slice: Range<usize>,
    group: LayerGroup,
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
        let max = self.group.max(local_max, "all-gather of the logits' largest values")?;
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
        let sums = self.group.sum(sums, "all-reduce of the softmax's sums")?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::comm::{memory, CommWorker, Communicator};
    use candle_core::{Device, Var};

    const VOCAB: usize = 12;

    fn logits() -> candle_core::Result<Tensor> {
        let v: Vec<f32> = (0..2 * 3 * VOCAB)
            .map(|i| ((i * 29) as f32 * 0.37).sin() * 4.0)
            .collect();
        Tensor::from_vec(v, (2, 3, VOCAB), &Device::Cpu)
    }

    fn targets() -> candle_core::Result<Tensor> {
        Tensor::new(&[[0u32, 5, 11], [7, 3, 6]], &Device::Cpu)
    }

    /// `work` on every rank of a group of `size` in memory: each rank's result.
    fn on_every_rank<T: Send>(size: usize, work: impl Fn(&LayerGroup) -> Result<T> + Sync) -> Result<Vec<T>> {
        let rings = memory::ring(size, std::time::Duration::from_secs(10));
        std::thread::scope(|s| {
            let handles: Vec<_> = rings
                .into_iter()
                .map(|ring| {
                    let work = &work;
                    s.spawn(move || work(&LayerGroup::new(CommWorker::spawn(Communicator::new(Box::new(ring)))?)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    fn close(what: &str, a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}[{i}]: {x} vs {y}");
        }
    }

    /// The split cross-entropy is the whole one, and each rank's gradient its slice of the whole
    /// gradient, on 1, 2, 3 and 4 ranks.
    #[test]
    fn the_split_cross_entropy_and_its_gradient_are_the_whole_ones() -> Result<()> {
        let whole = Var::from_tensor(&logits()?)?;
        let loss = crate::models::cross_entropy(whole.as_tensor(), &targets()?)?;
        let grads = loss.backward()?;
        let whole_grad = grads.get(whole.as_tensor()).expect("a gradient").clone();
        for size in [1, 2, 3, 4] {
            let results = on_every_rank(size, |group| {
                let slice = vocab_slice(VOCAB, group)?;
                let part = Var::from_tensor(&logits()?.narrow(2, slice.start, slice.len())?.contiguous()?)?;
                let loss = cross_entropy(part.as_tensor(), &targets()?, &slice, group)?;
                let grads = loss.backward()?;
                let grad = grads.get(part.as_tensor()).expect("a gradient").clone();
                Ok((slice, loss.to_scalar::<f32>()?, grad))
            })?;
            for (slice, part_loss, grad) in results {
                close("loss", &[part_loss], &[loss.to_scalar::<f32>()?]);
                let expected = whole_grad.narrow(2, slice.start, slice.len())?;
                close(
                    "gradient",
                    &grad.flatten_all()?.to_vec1()?,
                    &expected.flatten_all()?.to_vec1()?,
                );
            }
        }
        Ok(())
    }

    /// The split embedding gives every rank every token's row, and each table slice the
    /// gradient of its rows alone.
    #[test]
    fn the_split_embedding_looks_up_every_token_and_keeps_its_rows_gradients() -> Result<()> {
        let table: Vec<f32> = (0..VOCAB * 4).map(|i| i as f32 * 0.5 - 3.0).collect();
        let table = Tensor::from_vec(table, (VOCAB, 4), &Device::Cpu)?;
        let ids = targets()?;
        let upstream = Tensor::from_vec(
            (0..24).map(|i| i as f32 * 0.1).collect::<Vec<_>>(),
            (2, 3, 4),
            &Device::Cpu,
        )?;
        let whole_table = Var::from_tensor(&table)?;
        let whole = whole_table
            .as_tensor()
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((2, 3, 4))?;
        let whole_grad = (&whole * &upstream)?.sum_all()?.backward()?;
        let whole_grad = whole_grad.get(whole_table.as_tensor()).expect("a gradient").clone();
        for size in [1, 2, 4] {
            let results = on_every_rank(size, |group| {
                let slice = vocab_slice(VOCAB, group)?;
                let part = Var::from_tensor(&table.narrow(0, slice.start, slice.len())?.contiguous()?)?;
                let embedded = embed(&ids, part.as_tensor(), &slice, group)?;
                let grads = (&embedded * &upstream)?.sum_all()?.backward()?;
                let grad = grads.get(part.as_tensor()).expect("a gradient").clone();
                Ok((slice, embedded, grad))
            })?;
            for (slice, embedded, grad) in results {
                close(
                    "embeddings",
                    &embedded.flatten_all()?.to_vec1()?,
                    &whole.flatten_all()?.to_vec1()?,
                );
                let expected = whole_grad.narrow(0, slice.start, slice.len())?;
                close(
                    "table gradient",
                    &grad.flatten_all()?.to_vec1()?,
                    &expected.flatten_all()?.to_vec1()?,
                );
            }
        }
        let refusals = on_every_rank(4, |group| Ok(vocab_slice(10, group).err().map(|e| e.to_string())))?;
        for refusal in refusals {
            assert_eq!(
                refusal.as_deref(),
                Some("a vocabulary of 10 tokens does not split into 4 equal slices")
            );
        }
        Ok(())
    }
}
