//! Tensor parallelism's layer groups over rings: the collectives of the split layers
//! ([`crate::models::parallel`]) on a communication thread of their own, one ring per group of
//! ranks that split the same layers.

use std::sync::{PoisonError, RwLock};

use anyhow::{Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::engines::comm::{CommWorker, Communicator};
use crate::models::parallel::{balanced_slice, Group, LayerGroup};
use crate::models::NamedParam;
use crate::optim::{scale_to_norm, sum_of_squares};

/// The ranks of a ring, splitting layers between them. The ring is replaced in place when the
/// job rolls back (the split layers keep the group).
pub struct RingGroup {
    comm: RwLock<CommWorker>,
}

impl RingGroup {
    /// The group of the ranks of `comm`'s ring.
    pub fn new(comm: CommWorker) -> Self {
        Self {
            comm: RwLock::new(comm),
        }
    }

    /// Goes on over `comm`, the next generation's ring of the same ranks.
    pub fn relink(&self, comm: CommWorker) {
        *self.comm.write().unwrap_or_else(PoisonError::into_inner) = comm;
    }

    /// `work` on the ring's communication thread.
    fn run<T: Send + 'static>(&self, work: impl FnOnce(&mut Communicator) -> Result<T> + Send + 'static) -> Result<T> {
        self.comm.read().unwrap_or_else(PoisonError::into_inner).run(work)
    }
}

impl LayerGroup for RingGroup {
    fn rank(&self) -> usize {
        self.comm.read().unwrap_or_else(PoisonError::into_inner).rank()
    }

    fn size(&self) -> usize {
        self.comm.read().unwrap_or_else(PoisonError::into_inner).world_size()
    }

    fn sum(&self, values: Vec<f32>, what: &'static str) -> Result<Vec<f32>> {
        self.run(move |c| {
            let mut values = values;
            c.all_reduce_sum(what, &mut values)?;
            Ok(values)
        })
    }

    fn gather(&self, bytes: Vec<u8>, what: &'static str) -> Result<Vec<Vec<u8>>> {
        self.run(move |c| c.all_gather_sized(what, &bytes))
    }
}

/// The whole tensors of which each rank of `group` holds `parts` — each `(dim, part)` this
/// rank's slice along `dim` ([`balanced_slice`]), in rank order — in one gather.
pub fn gather_parts(group: &Group, parts: Vec<(usize, Tensor)>) -> Result<Vec<Tensor>> {
    if group.size() == 1 || parts.is_empty() {
        return Ok(parts.into_iter().map(|(_, part)| part).collect());
    }
    // Each part's length along its split dimension (slices may differ by one), then its values.
    let mut mine = Vec::new();
    for (dim, part) in &parts {
        mine.push(f32::from_bits(u32::try_from(part.dim(*dim)?)?));
        mine.extend(part.flatten_all()?.to_vec1::<f32>()?);
    }
    let all = group.gather(bytemuck::cast_slice(&mine).to_vec(), "all-gather of split parameters")?;
    let mut ranks: Vec<(Vec<f32>, usize)> = all
        .iter()
        .map(|bytes| (bytemuck::pod_collect_to_vec(bytes), 0))
        .collect();
    let mut whole = Vec::with_capacity(parts.len());
    for (dim, part) in &parts {
        let slices = ranks
            .iter_mut()
            .map(|(values, offset)| {
                let length = values
                    .get(*offset)
                    .context("a rank gathered fewer split parts")?
                    .to_bits() as usize;
                let mut dims = part.dims().to_vec();
                dims[*dim] = length;
                let n: usize = dims.iter().product();
                let slice = values
                    .get(*offset + 1..*offset + 1 + n)
                    .context("a rank gathered fewer split values")?;
                *offset += 1 + n;
                Ok(Tensor::from_slice(slice, dims, part.device())?)
            })
            .collect::<Result<Vec<_>>>()?;
        whole.push(Tensor::cat(&slices, *dim)?);
    }
    Ok(whole)
}

/// This rank's part of `whole`, split over `group` along `dim` as [`gather_parts`] joins it.
pub fn part_of(group: &Group, dim: usize, whole: &Tensor) -> Result<Tensor> {
    let slice = balanced_slice(whole.dim(dim)?, group.size(), group.rank());
    Ok(whole.narrow(dim, slice.start, slice.len())?.contiguous()?)
}

/// Scales `grads` of `params` to a global norm of at most `max_norm` ([`scale_to_norm`]): the
/// norm of the whole model's gradients, each split parameter's parts summed over `layers`, the
/// whole ones (equal on every rank of the group) counted once.
pub(crate) fn clip_split_by_global_norm(
    grads: &mut GradStore,
    params: &[NamedParam],
    layers: &Group,
    max_norm: f64,
) -> Result<()> {
    let (split, whole): (Vec<&NamedParam>, Vec<&NamedParam>) = params.iter().partition(|p| p.split.is_some());
    let vars = |params: Vec<&NamedParam>| {
        params
            .into_iter()
            .map(|p| p.param.var())
            .collect::<candle_core::Result<Vec<Var>>>()
    };
    let split_squares = sum_of_squares(grads, &vars(split)?)?;
    let squares = sum_of_squares(grads, &vars(whole)?)? + sum_over_group(layers, split_squares)?;
    scale_to_norm(grads, &vars(params.iter().collect())?, squares.sqrt(), max_norm)?;
    Ok(())
}

/// The sum over `group` of each rank's part `mine` of a gradient norm's square, added in rank
/// order on every rank, so all scale alike.
pub(crate) fn sum_over_group(group: &Group, mine: f64) -> Result<f64> {
    let mut sum = 0f64;
    for bytes in group.gather(
        mine.to_le_bytes().to_vec(),
        "all-gather of the gradient norm's split parts",
    )? {
        let bytes: [u8; 8] = bytes.as_slice().try_into().context("a norm part of another width")?;
        sum += f64::from_le_bytes(bytes);
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::engines::comm::{memory, Communicator};
    use crate::models::parallel::vocab::{cross_entropy, embed, vocab_slice};
    use crate::models::parallel::{Group, Split, SplitAffine};
    use crate::models::{Activation, Precision};
    use candle_core::{Device, Tensor, Var};

    /// `work` on every rank of a group of `size` in memory: each rank's result.
    fn on_every_rank<T: Send>(size: usize, work: impl Fn(&Group) -> Result<T> + Sync) -> Result<Vec<T>> {
        let rings = memory::ring(size, std::time::Duration::from_secs(10));
        std::thread::scope(|s| {
            let handles: Vec<_> = rings
                .into_iter()
                .map(|ring| {
                    let work = &work;
                    s.spawn(move || {
                        let comm = CommWorker::spawn(Communicator::new(Box::new(ring)))?;
                        work(&(Arc::new(RingGroup::new(comm)) as Group))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    /// `a` and `b` agree to within f32 reassociation.
    fn close(what: &str, a: &Tensor, b: &Tensor) -> Result<()> {
        let (a, b) = (a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}[{i}]: {x} vs {y}");
        }
        Ok(())
    }

    /// A deterministic, irregular tensor of `dims`.
    fn values(dims: &[usize], salt: usize) -> candle_core::Result<Tensor> {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 37 + salt * 101) as f32 * 0.173).sin() * 0.5)
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu)
    }

    /// Columns then rows over 1, 2 and 4 ranks, as an MLP `relu(x W1 + b1) W2 + b2` (inputs 6,
    /// hidden 8, outputs 5, 2 × 3 rows, `loss = Σ y · r`): each rank's outputs, its parts'
    /// gradients (its slices of the whole maps') and the input's gradient are the unsplit
    /// MLP's, up to the order of the partial products' sum.
    #[test]
    fn a_column_then_row_split_pair_computes_the_whole_maps_and_their_gradients() -> Result<()> {
        let [w1, b1, w2, b2, x, r] = [
            values(&[6, 8], 1)?,
            values(&[8], 2)?,
            values(&[8, 5], 3)?,
            values(&[5], 4)?,
            values(&[2, 3, 6], 5)?,
            values(&[2, 3, 5], 6)?,
        ];
        let vars = [&w1, &b1, &w2, &b2, &x].map(|t| Var::from_tensor(t).expect("a variable"));
        let [w1v, b1v, w2v, b2v, xv] = vars.each_ref().map(Var::as_tensor);
        let hidden = xv.broadcast_matmul(w1v)?.broadcast_add(b1v)?.relu()?;
        let y = hidden.broadcast_matmul(w2v)?.broadcast_add(b2v)?;
        let whole = (&y * &r)?.sum_all()?.backward()?;
        let grads = vars
            .each_ref()
            .map(|v| whole.get(v.as_tensor()).cloned().expect("a gradient"));
        for size in [1, 2, 4] {
            let results = on_every_rank(size, |group| {
                let f32 = Precision::F32;
                let first = SplitAffine::from_whole((&w1, &b1), (Activation::Relu, f32), Split::Columns, group)?;
                let second = SplitAffine::from_whole((&w2, &b2), (Activation::Identity, f32), Split::Rows, group)?;
                let input = Var::from_tensor(&x)?;
                let y = second.forward(&first.forward(input.as_tensor())?)?;
                let part = (&y * &r)?.sum_all()?.backward()?;
                let grad = |v: &Var| part.get(v.as_tensor()).cloned().expect("a gradient");
                let held = [&first.weight, &first.bias, &second.weight, &second.bias].map(|p| p.var());
                let [w1, b1, w2, b2] = held.map(|v| v.expect("a held parameter"));
                let parts = [&w1, &b1, &w2, &b2, &input].map(grad);
                Ok((group.rank(), y, parts))
            })?;
            let part = 8 / size;
            for (rank, y_part, [w1_part, b1_part, w2_part, b2_part, x_part]) in results {
                close("y", &y_part, &y)?;
                close("dW1", &w1_part, &grads[0].narrow(1, rank * part, part)?)?;
                close("db1", &b1_part, &grads[1].narrow(0, rank * part, part)?)?;
                close("dW2", &w2_part, &grads[2].narrow(0, rank * part, part)?)?;
                close("db2", &b2_part, &grads[3])?;
                close("dx", &x_part, &grads[4])?;
            }
        }
        let refused = on_every_rank(4, |group| {
            Ok(SplitAffine::from_whole(
                (&values(&[6, 10], 1)?, &values(&[10], 2)?),
                (Activation::Relu, Precision::F32),
                Split::Columns,
                group,
            )
            .err()
            .map(|e| e.to_string()))
        })?;
        assert_eq!(
            refused[0].as_deref(),
            Some("a column-split map's outputs: 10 does not split into 4 equal parts")
        );
        Ok(())
    }

    /// A GPT layer (4 heads, width 16) split over 1, 2 and 4 ranks: each rank's output and input
    /// gradient are the whole layer's, and each parameter's gradient its part of the whole one —
    /// q, k, v and the MLP's first map by columns, the projections back by rows, the LayerNorms
    /// and the projections' biases whole.
    #[test]
    fn a_gpt_layer_split_by_heads_and_hidden_width_computes_the_whole_layer() -> Result<()> {
        use crate::models::{gpt, Block, GptConfig, ParamInit};
        let config = GptConfig {
            vocab: 12,
            block_size: 8,
            n_layer: 1,
            n_head: 4,
            n_embd: 16,
            tie_head: false,
        };
        let layer = || -> Result<Box<dyn Block>> {
            let mut blocks = gpt(&config, &ParamInit::new(7, Device::Cpu))?.into_blocks();
            Ok(blocks.remove(1))
        };
        let (x, r) = (values(&[2, 5, 16], 8)?, values(&[2, 5, 16], 9)?);
        /// The layer's output, and the gradients of its input and of its parameters by name.
        type Ran = (Tensor, Tensor, Vec<(String, Tensor)>);
        fn run(layer: &dyn Block, x: &Tensor, r: &Tensor) -> Result<Ran> {
            let input = Var::from_tensor(x)?;
            let y = layer.forward(input.as_tensor())?;
            let grads = (&y * r)?.sum_all()?.backward()?;
            let grad = |v: &Var| grads.get(v.as_tensor()).cloned().expect("a gradient");
            let params = layer
                .parameters()
                .into_iter()
                .map(|(name, param)| Ok((name, grad(&param.var()?))))
                .collect::<Result<_>>()?;
            Ok((y, grad(&input), params))
        }
        let (y, dx, whole) = run(layer()?.as_ref(), &x, &r)?;
        for size in [1, 2, 4] {
            let results = on_every_rank(size, |group| {
                let (part, _) = layer()?.split(group, &crate::models::parallel::Flow::Whole, false)?;
                Ok((group.rank(), run(part.as_ref(), &x, &r)?))
            })?;
            for (rank, (y_part, dx_part, params)) in results {
                close("y", &y_part, &y)?;
                close("dx", &dx_part, &dx)?;
                for ((name, grad), (whole_name, whole_grad)) in params.iter().zip(&whole) {
                    assert_eq!(name, whole_name);
                    let rows = name.ends_with("proj.weight");
                    let columns = !name.starts_with("ln") && !name.ends_with("proj.bias") && !rows;
                    let dim = match (rows, columns, name.ends_with("weight")) {
                        (true, _, _) => Some(0),
                        (_, true, true) => Some(1),
                        (_, true, false) => Some(0),
                        _ => None,
                    };
                    let expected = match dim {
                        Some(dim) => {
                            let len = whole_grad.dim(dim)? / size;
                            whole_grad.narrow(dim, rank * len, len)?
                        }
                        None => whole_grad.clone(),
                    };
                    close(name, grad, &expected)?;
                }
            }
        }
        Ok(())
    }

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

    /// The split cross-entropy is the whole one, and each rank's gradient its slice of the whole
    /// gradient, on 1, 2, 3 and 4 ranks.
    #[test]
    fn the_split_cross_entropy_and_its_gradient_are_the_whole_ones() -> Result<()> {
        let whole = Var::from_tensor(&logits()?)?;
        let loss = crate::models::cross_entropy(whole.as_tensor(), &targets()?)?;
        let grads = loss.backward()?;
        let whole_grad = grads.get(whole.as_tensor()).expect("a gradient").clone();
        // 5 ranks: slices of 3, 3, 2, 2, 2 tokens.
        for size in [1, 2, 3, 4, 5] {
            let results = on_every_rank(size, |group| {
                let slice = vocab_slice(VOCAB, group)?;
                let part = Var::from_tensor(&logits()?.narrow(2, slice.start, slice.len())?.contiguous()?)?;
                let loss = cross_entropy(part.as_tensor(), &targets()?, &slice, group)?;
                let grads = loss.backward()?;
                let grad = grads.get(part.as_tensor()).expect("a gradient").clone();
                Ok((slice, loss, grad))
            })?;
            for (slice, part_loss, grad) in results {
                close("loss", &part_loss, &loss)?;
                close("gradient", &grad, &whole_grad.narrow(2, slice.start, slice.len())?)?;
            }
        }
        Ok(())
    }

    /// Parts of unequal length (a vocabulary the group does not divide) gather into the whole
    /// tensors, in one gather of several, and the whole ones cut back into the same parts.
    #[test]
    fn parts_gather_into_the_whole_and_cut_back() -> Result<()> {
        let (rows, columns) = (values(&[10, 3], 1)?, values(&[4, 7], 2)?);
        let gathered = on_every_rank(4, |group| {
            let parts = vec![(0, part_of(group, 0, &rows)?), (1, part_of(group, 1, &columns)?)];
            let dims: Vec<Vec<usize>> = parts.iter().map(|(_, p)| p.dims().to_vec()).collect();
            Ok((dims, gather_parts(group, parts)?))
        })?;
        for (rank, (dims, whole)) in gathered.into_iter().enumerate() {
            let (r, c) = ([3, 3, 2, 2][rank], [2, 2, 2, 1][rank]);
            assert_eq!(dims, [vec![r, 3], vec![4, c]]);
            close("rows", &whole[0], &rows)?;
            close("columns", &whole[1], &columns)?;
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
        let upstream = values(&[2, 3, 4], 7)?;
        let whole_table = Var::from_tensor(&table)?;
        let whole = whole_table
            .as_tensor()
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((2, 3, 4))?;
        let whole_grad = (&whole * &upstream)?.sum_all()?.backward()?;
        let whole_grad = whole_grad.get(whole_table.as_tensor()).expect("a gradient").clone();
        for size in [1, 2, 4, 5] {
            let results = on_every_rank(size, |group| {
                let slice = vocab_slice(VOCAB, group)?;
                let part = Var::from_tensor(&table.narrow(0, slice.start, slice.len())?.contiguous()?)?;
                let embedded = embed(&ids, part.as_tensor(), &slice, group)?;
                let grads = (&embedded * &upstream)?.sum_all()?.backward()?;
                let grad = grads.get(part.as_tensor()).expect("a gradient").clone();
                Ok((slice, embedded, grad))
            })?;
            for (slice, embedded, grad) in results {
                close("embeddings", &embedded, &whole)?;
                close(
                    "table gradient",
                    &grad,
                    &whole_grad.narrow(0, slice.start, slice.len())?,
                )?;
            }
        }
        // A vocabulary the group does not divide: the first ranks hold one token more.
        let slices = on_every_rank(4, |group| vocab_slice(10, group))?;
        assert_eq!(slices, [0..3, 3..6, 6..8, 8..10]);
        Ok(())
    }
}
