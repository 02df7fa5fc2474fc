//! Forward and backward over a run of a model's blocks, cut into segments.
//!
//! A segment is the unit of backward: its input is a fresh variable, so the backward of a
//! segment stops there and hands the input's gradient to the segment before it. A *kept*
//! segment holds its autograd graph (every block output) from forward to backward; a
//! *recomputed* one keeps only its input and runs its forward again during backward
//! (activation recomputation: compute traded for memory). Both engines use this: data
//! parallelism cuts per block, so each block's gradients can be all-reduced while earlier
//! blocks are still in backward; a pipeline stage keeps a whole chunk as one segment.

use std::ops::Range;

use anyhow::{Context as _, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::models::Block;

/// How a run of blocks is cut into segments, by block index within the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segments {
    ranges: Vec<Range<usize>>,
    recompute: bool,
}

impl Segments {
    /// The whole run as one kept segment.
    pub fn whole(blocks: usize) -> Self {
        Self {
            ranges: std::iter::once(0..blocks).collect(),
            recompute: false,
        }
    }

    /// One kept segment per block.
    pub fn per_block(blocks: usize) -> Self {
        Self {
            ranges: (0..blocks).map(|b| b..b + 1).collect(),
            recompute: false,
        }
    }

    /// Recomputed segments, each ending after one of the `checkpoints` (block indices within
    /// the run, whose outputs are the only activations kept) or at the end of the run.
    pub fn recomputed(blocks: usize, checkpoints: &[usize]) -> Self {
        let mut ends: Vec<usize> = checkpoints.iter().map(|c| c + 1).filter(|&e| e < blocks).collect();
        ends.push(blocks);
        ends.sort_unstable();
        ends.dedup();
        let mut start = 0;
        let ranges = ends
            .into_iter()
            .map(|end| {
                let range = start..end;
                start = end;
                range
            })
            .collect();
        Self {
            ranges,
            recompute: true,
        }
    }

    /// The segments' block ranges, in forward order.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }
}

/// What a forward pass keeps for its backward.
pub struct Forward {
    records: Vec<Record>,
    output: Tensor,
    held_bytes: usize,
}

struct Record {
    /// The segment's input: the run's input for the first segment, else a fresh variable
    /// holding the previous segment's output.
    input: Tensor,
    /// The segment's output with its graph; `None` when the segment is recomputed.
    output: Option<Tensor>,
}

impl Forward {
    /// The run's output (with its graph attached only while the last segment is kept).
    pub fn output(&self) -> &Tensor {
        &self.output
    }

    /// Bytes of activations held from forward to backward: every block output of kept
    /// segments, the inputs of recomputed segments after the first.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }
}

fn bytes_of(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// Runs the blocks of `range` on `input`; returns the output and the bytes of every block
/// output on the way.
fn run(blocks: &[Box<dyn Block>], range: Range<usize>, input: &Tensor) -> Result<(Tensor, usize)> {
    let mut bytes = 0;
    let mut h = input.clone();
    for block in &blocks[range] {
        h = block
            .forward(&h)
            .with_context(|| format!("forward of block {}", block.name()))?;
        bytes += bytes_of(&h);
    }
    Ok((h, bytes))
}

/// A pass over a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Its forward.
    Forward,
    /// Its backward (with the forward again where it is recomputed).
    Backward,
}

/// What runs around each segment's passes: nothing, or (sharded parameters) the gathers that
/// hold a segment's parameters while it runs and the releases after.
pub trait AroundSegments {
    /// Before `pass` over the blocks of `range`.
    fn entering(&mut self, range: &Range<usize>, pass: Pass) -> Result<()>;
    /// After it (in backward, once the segment's gradients were handed on).
    fn leaving(&mut self, range: &Range<usize>, pass: Pass) -> Result<()>;
}

impl AroundSegments for () {
    fn entering(&mut self, _: &Range<usize>, _: Pass) -> Result<()> {
        Ok(())
    }

    fn leaving(&mut self, _: &Range<usize>, _: Pass) -> Result<()> {
        Ok(())
    }
}

/// Forward of `blocks` cut as `segments`. Pass a variable as `input` to get its gradient back
/// from [`backward`].
pub fn forward(blocks: &[Box<dyn Block>], segments: &Segments, input: Tensor) -> Result<Forward> {
    forward_around(blocks, segments, input, &mut ())
}

/// [`forward`], with `around` run around each segment.
pub fn forward_around(
    blocks: &[Box<dyn Block>],
    segments: &Segments,
    input: Tensor,
    around: &mut dyn AroundSegments,
) -> Result<Forward> {
    let mut records = Vec::with_capacity(segments.ranges.len());
    let mut held_bytes = 0;
    let mut h = input;
    for (k, range) in segments.ranges.iter().enumerate() {
        let segment_input = if k == 0 {
            h
        } else {
            Var::from_tensor(&h.detach())?.as_tensor().clone()
        };
        around.entering(range, Pass::Forward)?;
        let (output, bytes) = run(blocks, range.clone(), &segment_input)?;
        around.leaving(range, Pass::Forward)?;
        if segments.recompute {
            if k > 0 {
                held_bytes += bytes_of(&segment_input);
            }
            h = output.detach();
            records.push(Record {
                input: segment_input,
                output: None,
            });
        } else {
            held_bytes += bytes;
            h = output.clone();
            records.push(Record {
                input: segment_input,
                output: Some(output),
            });
        }
    }
    Ok(Forward {
        records,
        output: h,
        held_bytes,
    })
}

/// The gradient of the run's output that backward starts from: `loss(output)` and the
/// gradient of that loss with respect to `output`, taken on a detached copy so the loss's
/// graph is gone once this returns.
pub fn loss_gradient(
    output: &Tensor,
    loss: impl FnOnce(&Tensor) -> candle_core::Result<Tensor>,
) -> Result<(f32, Tensor)> {
    let seed = Var::from_tensor(&output.detach())?;
    let loss = loss(seed.as_tensor())?;
    let grads = loss.backward()?;
    let gradient = grads
        .get(seed.as_tensor())
        .context("the loss does not depend on the model's output")?
        .clone();
    Ok((loss.to_scalar::<f32>()?, gradient))
}

/// What a backward pass gives back.
pub struct Backward {
    /// The gradient of the run's input, when the input is a variable.
    pub input_gradient: Option<Tensor>,
    /// The most bytes of block outputs that recomputation materialised at once.
    pub recomputed_bytes: usize,
}

/// Backward of `forward` from `upstream`, the gradient of the run's output: segment by segment
/// from the last, calling `on_segment(range, gradients)` as each segment's gradients are ready.
pub fn backward(
    blocks: &[Box<dyn Block>],
    segments: &Segments,
    forward: Forward,
    upstream: &Tensor,
    on_segment: &mut dyn FnMut(Range<usize>, &GradStore) -> Result<()>,
) -> Result<Backward> {
    backward_around(blocks, segments, (forward, upstream), on_segment, &mut ())
}

/// [`backward`], with `around` run around each segment.
pub fn backward_around(
    blocks: &[Box<dyn Block>],
    segments: &Segments,
    (forward, upstream): (Forward, &Tensor),
    on_segment: &mut dyn FnMut(Range<usize>, &GradStore) -> Result<()>,
    around: &mut dyn AroundSegments,
) -> Result<Backward> {
    let mut upstream = upstream.clone();
    let mut recomputed_bytes = 0;
    let mut input_gradient = None;
    for (range, record) in segments.ranges.iter().zip(forward.records).rev() {
        around.entering(range, Pass::Backward)?;
        let output = match record.output {
            Some(kept) => kept,
            None => {
                let (output, bytes) = run(blocks, range.clone(), &record.input)?;
                recomputed_bytes = recomputed_bytes.max(bytes);
                output
            }
        };
        let grads = (output * &upstream)?.sum_all()?.backward()?;
        on_segment(range.clone(), &grads)?;
        input_gradient = grads.get(&record.input).map(Tensor::detach);
        drop(grads);
        around.leaving(range, Pass::Backward)?;
        if range.start > 0 {
            upstream = input_gradient.clone().with_context(|| {
                format!(
                    "backward of block {}: no gradient for its input",
                    blocks[range.start].name()
                )
            })?;
        }
    }
    Ok(Backward {
        input_gradient,
        recomputed_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{mlp, ParamInit};
    use candle_core::Device;

    fn gradients(segments: &Segments) -> (Vec<Vec<f32>>, Vec<f32>, usize) {
        let model = mlp(5, &[7, 6, 4], 3, &ParamInit::new(11, Device::Cpu)).unwrap();
        let blocks = model.into_blocks();
        let x = Tensor::arange(0f32, 20.0, &Device::Cpu)
            .unwrap()
            .reshape((4, 5))
            .unwrap();
        let x = Var::from_tensor(&(x / 20.0).unwrap()).unwrap().as_tensor().clone();
        let y = Tensor::new(&[0u32, 2, 1, 2], &Device::Cpu).unwrap();
        let forward = forward(&blocks, segments, x).unwrap();
        let held = forward.held_bytes();
        let (_, upstream) = loss_gradient(forward.output(), |o| candle_nn::loss::cross_entropy(o, &y)).unwrap();
        let vars: Vec<Var> = blocks
            .iter()
            .flat_map(|b| b.parameters())
            .map(|(_, p)| p.var().unwrap())
            .collect();
        let mut sums = vec![Vec::new(); vars.len()];
        let done = backward(&blocks, segments, forward, &upstream, &mut |_, grads| {
            for (var, sum) in vars.iter().zip(sums.iter_mut()) {
                if let Some(g) = grads.get(var.as_tensor()) {
                    *sum = g.flatten_all()?.to_vec1::<f32>()?;
                }
            }
            Ok(())
        })
        .unwrap();
        let input = done.input_gradient.unwrap().flatten_all().unwrap().to_vec1().unwrap();
        (sums, input, held)
    }

    #[test]
    fn recomputation_and_every_cut_give_the_gradients_of_one_graph() {
        let (whole, whole_input, whole_held) = gradients(&Segments::whole(4));
        for segments in [
            Segments::per_block(4),
            Segments::recomputed(4, &[]),
            Segments::recomputed(4, &[1]),
            Segments::recomputed(4, &[0, 1, 2, 3]),
        ] {
            let (sums, input, held) = gradients(&segments);
            assert_eq!(sums, whole, "{segments:?}");
            assert_eq!(input, whole_input, "{segments:?}");
            if segments.recompute {
                assert!(held < whole_held, "{segments:?} holds {held} of {whole_held} bytes");
            }
        }
    }

    #[test]
    fn checkpoints_end_segments() {
        assert_eq!(Segments::recomputed(5, &[1, 3]).ranges(), &[0..2, 2..4, 4..5]);
        assert_eq!(Segments::recomputed(3, &[2, 0, 0]).ranges(), &[0..1, 1..3]);
        assert_eq!(Segments::recomputed(2, &[]).ranges(), Segments::whole(2).ranges());
    }
}
