//! Tensor (model) parallelism's layers, Megatron's layout: a column-parallel affine map splits
//! its outputs over the ranks of a [`LayerGroup`], a row-parallel one its inputs, so that a pair —
//! column then row, as an MLP's two layers or attention's projections in and out — needs one
//! all-reduce forward (of the row-parallel layer's partial outputs) and one backward (of the
//! column-parallel layer's input gradient), and nothing between them. The two collectives are
//! autograd ops: [`enter`] (identity forward, all-reduce of the gradient backward; Megatron's
//! `f`) and [`leave`] (all-reduce forward, identity backward; Megatron's `g`), so backward through
//! any model built of these layers runs them in the right places. They run on the group's own
//! communication thread, called from the device thread in forward and backward order, which is
//! the same on every rank of the group. CPU tensors only, in f32.

use std::sync::Arc;

use anyhow::{ensure, Result};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor, Var};

use crate::cpu_values::cpu_values;
use crate::engines::comm::CommWorker;
use crate::models::{affine, Activation};

/// The ranks that split a layer between them, over a ring of their own.
#[derive(Clone)]
pub struct LayerGroup {
    comm: Arc<CommWorker>,
}

impl LayerGroup {
    /// The group of the ranks of `comm`'s ring.
    pub fn new(comm: CommWorker) -> Self {
        Self { comm: Arc::new(comm) }
    }

    /// This rank's place in the group.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.comm.world_size()
    }

    /// The largest of the ranks' `values`, element by element (all pass as many).
    pub(super) fn max(&self, values: Vec<f32>, what: &'static str) -> candle_core::Result<Vec<f32>> {
        let all = self
            .comm
            .run(move |c| c.all_gather(what, bytemuck::cast_slice(&values)))
            .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
        let mut largest: Vec<f32> = Vec::new();
        for bytes in all {
            let values: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
            if largest.is_empty() {
                largest = values;
            } else {
                largest.iter_mut().zip(values).for_each(|(l, v)| *l = l.max(v));
            }
        }
        Ok(largest)
    }

    /// `values` summed over the group.
    pub(super) fn sum(&self, values: Vec<f32>, what: &'static str) -> candle_core::Result<Vec<f32>> {
        self.comm
            .run(move |c| {
                let mut values = values;
                c.all_reduce_sum(what, &mut values)?;
                Ok(values)
            })
            .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
    }
}

/// The autograd op of [`enter`]: identity forward, all-reduce of the gradient backward.
struct Enter(LayerGroup);

/// The autograd op of [`leave`]: all-reduce forward, identity backward.
struct Leave(LayerGroup);

impl CustomOp1 for Enter {
    fn name(&self) -> &'static str {
        "enter-layer-group"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let values = cpu_values(storage, layout, "a tensor-parallel layer's input")?;
        Ok((CpuStorage::F32(values.to_vec()), layout.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let values = grad.flatten_all()?.to_vec1::<f32>()?;
        let summed = self
            .0
            .sum(values, "all-reduce of a tensor-parallel layer's input gradient")?;
        Tensor::from_vec(summed, grad.shape(), grad.device()).map(Some)
    }
}

impl CustomOp1 for Leave {
    fn name(&self) -> &'static str {
        "leave-layer-group"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let values = cpu_values(storage, layout, "a row-parallel layer's partial output")?.to_vec();
        let summed = self
            .0
            .sum(values, "all-reduce of a row-parallel layer's partial outputs")?;
        Ok((CpuStorage::F32(summed), layout.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.clone()))
    }
}

/// `x`, where a group's layers begin: the same values, whose gradient is summed over the group
/// (each rank's part of the layers contributes its share of it).
pub fn enter(x: &Tensor, group: &LayerGroup) -> candle_core::Result<Tensor> {
    x.apply_op1(Enter(group.clone()))
}

/// The sum over the group of the ranks' partial outputs `x`, where a group's layers end; the
/// gradient passes back to every rank as it is.
pub fn leave(x: &Tensor, group: &LayerGroup) -> candle_core::Result<Tensor> {
    x.apply_op1(Leave(group.clone()))
}

/// `act(x W + b)` with `W`'s columns (the outputs) split over the group: this rank computes its
/// slice of the outputs from the whole input.
pub struct ColumnParallel {
    /// This rank's columns of `W`, (in, out / n).
    pub weight: Var,
    /// This rank's slice of `b`.
    pub bias: Var,
    activation: Activation,
    group: LayerGroup,
}

/// `x W + b` with `W`'s rows (the inputs) split over the group: this rank takes its slice of the
/// inputs (a column-parallel layer's outputs), the partial products are summed over the group,
/// and the bias, whole on every rank, is added once.
pub struct RowParallel {
    /// This rank's rows of `W`, (in / n, out).
    pub weight: Var,
    /// The whole `b`.
    pub bias: Var,
    group: LayerGroup,
}

/// The part `rank` of `parts` holds of `len` values: equal slices (checked to divide).
fn slice_of(len: usize, parts: usize, rank: usize, what: &str) -> Result<(usize, usize)> {
    ensure!(
        parts > 0 && len.is_multiple_of(parts),
        "{what}: {len} does not split into {parts} equal parts"
    );
    let size = len / parts;
    Ok((rank * size, size))
}

impl ColumnParallel {
    /// This rank's part of the layer of whole weight `weight` (in, out) and bias `bias` (out).
    pub fn from_whole(weight: &Tensor, bias: &Tensor, activation: Activation, group: &LayerGroup) -> Result<Self> {
        let (start, size) = slice_of(
            weight.dim(1)?,
            group.size(),
            group.rank(),
            "a column-parallel layer's outputs",
        )?;
        Ok(Self {
            weight: Var::from_tensor(&weight.narrow(1, start, size)?.contiguous()?)?,
            bias: Var::from_tensor(&bias.narrow(0, start, size)?.contiguous()?)?,
            activation,
            group: group.clone(),
        })
    }

    /// This rank's slice of the outputs for input `x` (…, in).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        affine(
            &enter(x, &self.group)?,
            self.weight.as_tensor(),
            self.bias.as_tensor(),
            self.activation,
        )
    }
}

impl RowParallel {
    /// This rank's part of the layer of whole weight `weight` (in, out) and bias `bias` (out).
    pub fn from_whole(weight: &Tensor, bias: &Tensor, group: &LayerGroup) -> Result<Self> {
        let (start, size) = slice_of(
            weight.dim(0)?,
            group.size(),
            group.rank(),
            "a row-parallel layer's inputs",
        )?;
        Ok(Self {
            weight: Var::from_tensor(&weight.narrow(0, start, size)?.contiguous()?)?,
            bias: Var::from_tensor(&bias.contiguous()?)?,
            group: group.clone(),
        })
    }

    /// The whole output for this rank's slice `x` (…, in / n) of the input.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let no_bias = Tensor::zeros(self.bias.dims(), self.bias.dtype(), self.bias.device())?;
        let partial = affine(x, self.weight.as_tensor(), &no_bias, Activation::Identity)?;
        leave(&partial, &self.group)?.broadcast_add(self.bias.as_tensor())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::comm::{memory, Communicator};
    use candle_core::Device;

    /// A deterministic, irregular tensor of `dims`.
    fn values(dims: &[usize], salt: usize) -> candle_core::Result<Tensor> {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 37 + salt * 101) as f32 * 0.173).sin() * 0.5)
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu)
    }

    /// The MLP `relu(x W1 + b1) W2 + b2` and its weights: inputs 6, hidden 8, outputs 5, and
    /// `loss = Σ y · r` over 2 × 3 rows (a GPT's batch and positions).
    struct Mlp {
        w1: Tensor,
        b1: Tensor,
        w2: Tensor,
        b2: Tensor,
        x: Tensor,
        r: Tensor,
    }

    impl Mlp {
        fn new() -> candle_core::Result<Self> {
            Ok(Self {
                w1: values(&[6, 8], 1)?,
                b1: values(&[8], 2)?,
                w2: values(&[8, 5], 3)?,
                b2: values(&[5], 4)?,
                x: values(&[2, 3, 6], 5)?,
                r: values(&[2, 3, 5], 6)?,
            })
        }
    }

    /// `a` and `b` agree to within f32 reassociation.
    fn close(what: &str, a: &Tensor, b: &Tensor) -> candle_core::Result<()> {
        let (a, b) = (a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}[{i}]: {x} vs {y}");
        }
        Ok(())
    }

    /// Column- then row-parallel over 1, 2 and 4 ranks: each rank's outputs, its weights'
    /// gradients (its slices of the whole layer's) and the input's gradient are the unsplit
    /// MLP's, up to the order of the partial products' sum.
    #[test]
    fn a_column_then_row_parallel_pair_computes_the_whole_layers_and_their_gradients() -> Result<()> {
        let mlp = Mlp::new()?;
        let (w1, b1, w2, b2) = (
            Var::from_tensor(&mlp.w1)?,
            Var::from_tensor(&mlp.b1)?,
            Var::from_tensor(&mlp.w2)?,
            Var::from_tensor(&mlp.b2)?,
        );
        let x = Var::from_tensor(&mlp.x)?;
        let hidden = affine(x.as_tensor(), w1.as_tensor(), b1.as_tensor(), Activation::Relu)?;
        let y = affine(&hidden, w2.as_tensor(), b2.as_tensor(), Activation::Identity)?;
        let whole = (&y * &mlp.r)?.sum_all()?.backward()?;
        let grad = |v: &Var| whole.get(v.as_tensor()).cloned().expect("a gradient");
        let (g_w1, g_b1, g_w2, g_b2, g_x) = (grad(&w1), grad(&b1), grad(&w2), grad(&b2), grad(&x));
        for size in [1, 2, 4] {
            let rings = memory::ring(size, std::time::Duration::from_secs(10));
            std::thread::scope(|s| -> Result<()> {
                let handles: Vec<_> = rings
                    .into_iter()
                    .map(|ring| {
                        let mlp = &mlp;
                        s.spawn(move || -> Result<_> {
                            let group = LayerGroup::new(CommWorker::spawn(Communicator::new(Box::new(ring)))?);
                            let first = ColumnParallel::from_whole(&mlp.w1, &mlp.b1, Activation::Relu, &group)?;
                            let second = RowParallel::from_whole(&mlp.w2, &mlp.b2, &group)?;
                            let x = Var::from_tensor(&mlp.x)?;
                            let y = second.forward(&first.forward(x.as_tensor())?)?;
                            let grads = (&y * &mlp.r)?.sum_all()?.backward()?;
                            let grad = |v: &Var| grads.get(v.as_tensor()).cloned().expect("a gradient");
                            let part = [&first.weight, &first.bias, &second.weight, &second.bias, &x].map(grad);
                            Ok((group.rank(), y, part))
                        })
                    })
                    .collect();
                for handle in handles {
                    let (rank, y_part, [w1_part, b1_part, w2_part, b2_part, x_part]) =
                        handle.join().expect("rank thread")?;
                    let (cols, rows) = (8 / size, 8 / size);
                    close("y", &y_part, &y)?;
                    close("dW1", &w1_part, &g_w1.narrow(1, rank * cols, cols)?)?;
                    close("db1", &b1_part, &g_b1.narrow(0, rank * cols, cols)?)?;
                    close("dW2", &w2_part, &g_w2.narrow(0, rank * rows, rows)?)?;
                    close("db2", &b2_part, &g_b2)?;
                    close("dx", &x_part, &g_x)?;
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    #[test]
    fn a_layer_the_group_does_not_divide_is_refused() -> Result<()> {
        let group = LayerGroup::new(CommWorker::spawn(Communicator::single())?);
        let err = slice_of(10, 4, 0, "a column-parallel layer's outputs").unwrap_err();
        assert_eq!(
            err.to_string(),
            "a column-parallel layer's outputs: 10 does not split into 4 equal parts"
        );
        assert_eq!((group.rank(), group.size()), (0, 1));
        Ok(())
    }
}
