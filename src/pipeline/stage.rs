//! One pipeline stage's step: its model chunks, run in the order its schedule gives, with
//! activations and gradients exchanged through a [`StageLink`]. Each chunk's input (but the
//! data's) is a fresh variable, so backward stops at the chunk boundary and hands the input's
//! gradient to the previous stage; parameter gradients are summed over the micro-batches, so
//! the caller's optimizer step sees the gradient of the whole batch.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use candle_core::{Tensor, Var};

use super::link::StageLink;
use super::schedule::{stage_ops, Op, ScheduleKind};
use crate::engines::compute::segments::{self, Forward, Segments};
use crate::models::{Block, NamedParam};
use crate::telemetry::timeline::{record, Timeline};

/// A contiguous run of a model's blocks on one stage, and how its backward is cut.
pub struct Chunk {
    blocks: Vec<Box<dyn Block>>,
    segments: Segments,
    /// The blocks' parameters, block by block.
    params: Vec<Var>,
    /// Where block `b`'s parameters start in `params`; one more entry for the end.
    block_first: Vec<usize>,
}

impl Chunk {
    /// `blocks` as one segment: every activation is held from forward to backward.
    pub fn new(blocks: Vec<Box<dyn Block>>) -> Self {
        let segments = Segments::whole(blocks.len());
        Self::cut(blocks, segments)
    }

    /// `blocks` cut per block, so the gradients of each block are final (and can be
    /// all-reduced) as soon as its last backward is done.
    pub fn per_block(blocks: Vec<Box<dyn Block>>) -> Self {
        let segments = Segments::per_block(blocks.len());
        Self::cut(blocks, segments)
    }

    /// `blocks` with activation recomputation: only the outputs of the blocks at `checkpoints`
    /// (indices within the chunk) and the chunk's input are held from forward to backward.
    pub fn recomputed(blocks: Vec<Box<dyn Block>>, checkpoints: &[usize]) -> Self {
        let segments = Segments::recomputed(blocks.len(), checkpoints);
        Self::cut(blocks, segments)
    }

    fn cut(blocks: Vec<Box<dyn Block>>, segments: Segments) -> Self {
        let (mut params, mut block_first) = (Vec::new(), Vec::with_capacity(blocks.len() + 1));
        for block in &blocks {
            block_first.push(params.len());
            params.extend(block.parameters().into_iter().map(|(_, var)| var));
        }
        block_first.push(params.len());
        Self {
            blocks,
            segments,
            params,
            block_first,
        }
    }
}

/// A stage: its chunks (chunk `c` is virtual stage `c·p + stage`) and its schedule.
pub struct Stage {
    index: usize,
    stages: usize,
    chunks: Vec<Chunk>,
    schedule: Vec<Op>,
    micro_batches: usize,
}

/// What one step of a stage produced.
pub struct StageStep {
    /// Gradient of the step's loss (the mean over micro-batches) for every parameter, in
    /// [`Stage::parameters`] order.
    pub gradients: Vec<Tensor>,
    /// The step's loss, on the stage holding the last virtual stage.
    pub loss: Option<f32>,
    /// The most micro-batch chunks whose activations were held at once.
    pub peak_activations: usize,
    /// The most bytes of block outputs held for backward at once (what autograd keeps of each
    /// forward until its backward).
    pub peak_activation_bytes: usize,
    /// Time spent waiting for a neighbour's activation or gradient: the stage's share of the
    /// pipeline bubble.
    pub waiting: Duration,
    /// Wall time of the whole step.
    pub elapsed: Duration,
}

/// A forward pass whose backward has not run yet.
struct Stashed {
    forward: Forward,
    /// The gradient of the micro-batch's loss with respect to the output, on the last virtual
    /// stage; elsewhere it comes from the next stage.
    loss_gradient: Option<Tensor>,
}

impl Stage {
    /// Stage `index` of `stages`, holding `chunks` (one per virtual stage of its own) and
    /// running `kind`'s schedule over `micro_batches` micro-batches.
    pub fn new(
        index: usize,
        stages: usize,
        chunks: Vec<Chunk>,
        kind: ScheduleKind,
        micro_batches: usize,
    ) -> Result<Self> {
        ensure!(
            chunks.len() == kind.virtual_stages(),
            "stage {index} holds {} model chunks, the schedule expects {}",
            chunks.len(),
            kind.virtual_stages()
        );
        ensure!(
            chunks.iter().all(|c| !c.blocks.is_empty()),
            "stage {index} has an empty model chunk"
        );
        Ok(Self {
            index,
            stages,
            chunks,
            schedule: stage_ops(kind, stages, micro_batches, index)?,
            micro_batches,
        })
    }

    /// This stage's index.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The stage's parameters, chunk by chunk, each block's in its own order, named
    /// `"{block}.{param}"` (their blocks numbered within the stage).
    pub fn parameters(&self) -> Vec<NamedParam> {
        self.chunks
            .iter()
            .flat_map(|chunk| &chunk.blocks)
            .enumerate()
            .flat_map(|(index, block)| block.named_parameters(index))
            .collect()
    }

    /// Where each chunk's parameters start in [`Stage::parameters`] order.
    fn chunk_firsts(&self) -> Vec<usize> {
        self.chunks
            .iter()
            .scan(0, |next, chunk| {
                let first = *next;
                *next += chunk.params.len();
                Some(first)
            })
            .collect()
    }

    /// The order in which [`Stage::step`] finishes the parameters' gradients (indices in
    /// [`Stage::parameters`] order): a chunk's once its last backward ran, the chunk's segments
    /// from the last, each segment's parameters in their order.
    pub fn gradient_order(&self) -> Vec<usize> {
        let chunk_first = self.chunk_firsts();
        let mut backwards_left = vec![self.micro_batches; self.chunks.len()];
        let mut order = Vec::new();
        for op in &self.schedule {
            let Op::Backward { chunk, .. } = *op else { continue };
            backwards_left[chunk] -= 1;
            if backwards_left[chunk] == 0 {
                let Chunk {
                    segments, block_first, ..
                } = &self.chunks[chunk];
                for range in segments.ranges().iter().rev() {
                    order.extend(
                        chunk_first[chunk] + block_first[range.start]..chunk_first[chunk] + block_first[range.end],
                    );
                }
            }
        }
        order
    }

    /// Forward passes only of `micro_batches` micro-batches, one after the other
    /// (evaluation): returns the outputs of the last virtual stage on the stage that holds it,
    /// nothing elsewhere. `inputs` is read by the stage holding virtual stage 0.
    pub fn forward_only(
        &mut self,
        link: &mut dyn StageLink,
        micro_batches: usize,
        inputs: &[Tensor],
    ) -> Result<Vec<Tensor>> {
        let (p, s) = (self.stages, self.index);
        let last = self.chunks.len() * p - 1;
        let mut outputs = Vec::new();
        for micro in 0..micro_batches {
            for (chunk, Chunk { blocks, .. }) in self.chunks.iter().enumerate() {
                let virtual_stage = chunk * p + s;
                let what = format!("evaluation forward of micro-batch {micro} into virtual stage {virtual_stage}");
                let input = if virtual_stage == 0 {
                    inputs
                        .get(micro)
                        .with_context(|| format!("stage {s}: no input for micro-batch {micro}"))?
                        .clone()
                } else {
                    link.recv_forward(&what)?
                };
                let output = blocks
                    .iter()
                    .try_fold(input, |h, block| block.forward(&h))
                    .with_context(|| format!("stage {s}: {what}"))?;
                if virtual_stage == last {
                    outputs.push(output);
                } else {
                    link.send_forward(&what, output)?;
                }
            }
        }
        Ok(outputs)
    }

    /// Runs one step. `inputs[i]` is micro-batch `i`'s data (read by the stage holding virtual
    /// stage 0); `loss(i, output)` is micro-batch `i`'s mean loss (called on the stage holding
    /// the last virtual stage). As soon as the gradients of a segment's parameters are summed
    /// over every micro-batch, `finished(first, gradients)` gets them: `first` is the index of
    /// the first in [`Stage::parameters`] order, the rest follow it.
    pub fn step(
        &mut self,
        link: &mut dyn StageLink,
        inputs: &[Tensor],
        loss: &dyn Fn(usize, &Tensor) -> candle_core::Result<Tensor>,
        timeline: &mut Option<Timeline>,
        finished: &mut dyn FnMut(usize, &[Tensor]) -> Result<()>,
    ) -> Result<StageStep> {
        let (p, s, m, v) = (self.stages, self.index, self.micro_batches, self.chunks.len());
        let last = v * p - 1;
        let chunk_first = self.chunk_firsts();
        let mut backwards_left = vec![m; v];
        let mut sums: Vec<Vec<Option<Tensor>>> = self.chunks.iter().map(|c| vec![None; c.params.len()]).collect();
        let mut stash: HashMap<(usize, usize), Stashed> = HashMap::new();
        let mut loss_sum = 0.0f32;
        let (mut peak, mut held_bytes, mut peak_bytes) = (0, 0usize, 0usize);
        let started = Instant::now();
        let mut waiting = Duration::ZERO;
        for op in self.schedule.clone() {
            match op {
                Op::Forward { micro, chunk } => {
                    let virtual_stage = chunk * p + s;
                    let what = format!("forward of micro-batch {micro} into virtual stage {virtual_stage}");
                    let input = if virtual_stage == 0 {
                        inputs
                            .get(micro)
                            .with_context(|| format!("stage {s}: no input for micro-batch {micro}"))?
                            .clone()
                    } else {
                        let asked = Instant::now();
                        let received = link.recv_forward(&what)?;
                        waiting += asked.elapsed();
                        record(timeline, || format!("recv activation {micro}"), "recv", asked);
                        Var::from_tensor(&received)?.as_tensor().clone()
                    };
                    let computing = Instant::now();
                    let Chunk { blocks, segments, .. } = &self.chunks[chunk];
                    let forward =
                        segments::forward(blocks, segments, input).with_context(|| format!("stage {s}: {what}"))?;
                    let loss_gradient = if virtual_stage == last {
                        // Each micro-batch's mean loss weighs 1/m of the batch's.
                        let (l, g) = segments::loss_gradient(forward.output(), |out| loss(micro, out)? / m as f64)?;
                        loss_sum += l;
                        Some(g)
                    } else {
                        None
                    };
                    record(timeline, || span_name('F', micro, chunk, v), "forward", computing);
                    if loss_gradient.is_none() {
                        let sending = Instant::now();
                        link.send_forward(&what, forward.output().detach())?;
                        record(timeline, || format!("send activation {micro}"), "send", sending);
                    }
                    held_bytes += forward.held_bytes();
                    stash.insert((micro, chunk), Stashed { forward, loss_gradient });
                    peak = peak.max(stash.len());
                    peak_bytes = peak_bytes.max(held_bytes);
                }
                Op::Backward { micro, chunk } => {
                    let virtual_stage = chunk * p + s;
                    let what = format!("backward of micro-batch {micro} out of virtual stage {virtual_stage}");
                    let stashed = stash
                        .remove(&(micro, chunk))
                        .with_context(|| format!("stage {s}: {what} before its forward"))?;
                    let upstream = match stashed.loss_gradient {
                        Some(g) => g,
                        None => {
                            let asked = Instant::now();
                            let upstream = link.recv_backward(&what)?;
                            waiting += asked.elapsed();
                            record(timeline, || format!("recv gradient {micro}"), "recv", asked);
                            upstream
                        }
                    };
                    let computing = Instant::now();
                    let forward_bytes = stashed.forward.held_bytes();
                    let Chunk { blocks, segments, .. } = &self.chunks[chunk];
                    let chunk_sums = &mut sums[chunk];
                    backwards_left[chunk] -= 1;
                    let last_backward = backwards_left[chunk] == 0;
                    let (firsts, chunk_params) = (&self.chunks[chunk].block_first, &self.chunks[chunk].params);
                    // Every parameter a segment's graph reached gets its share, so a weight
                    // used in two segments of the chunk (a tied head) sums both.
                    let done = segments::backward(blocks, segments, stashed.forward, &upstream, &mut |range, grads| {
                        for (var, sum) in chunk_params.iter().zip(chunk_sums.iter_mut()) {
                            if let Some(g) = grads.get(var.as_tensor()) {
                                *sum = Some(match sum.take() {
                                    Some(acc) => (acc + g)?,
                                    None => g.clone(),
                                });
                            }
                        }
                        if last_backward {
                            let (start, end) = (firsts[range.start], firsts[range.end]);
                            let final_sums = chunk_sums[start..end]
                                .iter()
                                .zip(&chunk_params[start..end])
                                .map(|(sum, var)| sum.clone().map_or_else(|| var.zeros_like(), Ok))
                                .collect::<candle_core::Result<Vec<_>>>()?;
                            finished(chunk_first[chunk] + start, &final_sums)?;
                        }
                        Ok(())
                    })
                    .with_context(|| format!("stage {s}: {what}"))?;
                    record(timeline, || span_name('B', micro, chunk, v), "backward", computing);
                    peak_bytes = peak_bytes.max(held_bytes + done.recomputed_bytes);
                    held_bytes -= forward_bytes;
                    if virtual_stage > 0 {
                        let g = done
                            .input_gradient
                            .with_context(|| format!("stage {s}: {what}: no gradient for the input"))?;
                        let sending = Instant::now();
                        link.send_backward(&what, g)?;
                        record(timeline, || format!("send gradient {micro}"), "send", sending);
                    }
                }
            }
        }
        let gradients = sums
            .into_iter()
            .zip(&self.chunks)
            .flat_map(|(sums, chunk)| sums.into_iter().zip(&chunk.params))
            .map(|(sum, var)| match sum {
                Some(g) => Ok(g),
                None => Ok(var.zeros_like()?),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(StageStep {
            gradients,
            loss: (last % p == s).then_some(loss_sum),
            peak_activations: peak,
            peak_activation_bytes: peak_bytes,
            waiting,
            elapsed: started.elapsed(),
        })
    }
}

/// A span's name on the timeline: `F3` is the forward of micro-batch 3, `B3.1` the backward
/// of micro-batch 3 through the stage's second model chunk (named only when interleaving).
fn span_name(pass: char, micro: usize, chunk: usize, chunks: usize) -> String {
    if chunks > 1 {
        format!("{pass}{micro}.{chunk}")
    } else {
        format!("{pass}{micro}")
    }
}
