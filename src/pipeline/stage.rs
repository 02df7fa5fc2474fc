//! One pipeline stage's step: its model chunks, run in the order its schedule gives, with
//! activations and gradients exchanged through a [`StageLink`]. Each chunk's input (but the
//! data's) is a fresh variable, so backward stops at the chunk boundary and hands the input's
//! gradient to the previous stage; parameter gradients are summed over the micro-batches, so
//! the caller's optimizer step sees the gradient of the whole batch.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use super::link::StageLink;
use super::schedule::{stage_ops, Op, ScheduleKind};
use crate::engines::compute::segments::{self, Backward, Forward, Segments};
use crate::models::{Block, NamedParam, Param};
use crate::telemetry::timeline::{record, Timeline};

/// A contiguous run of a model's blocks on one stage, and how its backward is cut.
pub struct Chunk {
    blocks: Vec<Box<dyn Block>>,
    segments: Segments,
    /// The blocks' parameters, block by block.
    params: Vec<Param>,
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
            params.extend(block.parameters().into_iter().map(|(_, param)| param));
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
        let last = self.last_virtual_stage();
        let mut outputs = Vec::new();
        for micro in 0..micro_batches {
            for (chunk, Chunk { blocks, .. }) in self.chunks.iter().enumerate() {
                let virtual_stage = chunk * p + s;
                let what = format!("evaluation forward of micro-batch {micro} into virtual stage {virtual_stage}");
                let input = if virtual_stage == 0 {
                    self.data_input(inputs, micro)?
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
        let chunk_first = self.chunk_firsts();
        let mut run = StepRun {
            link,
            timeline,
            backwards_left: vec![self.micro_batches; self.chunks.len()],
            sums: self.chunks.iter().map(|c| vec![None; c.params.len()]).collect(),
            stash: HashMap::new(),
            loss_sum: 0.0,
            peak: 0,
            held_bytes: 0,
            peak_bytes: 0,
            waiting: Duration::ZERO,
        };
        let started = Instant::now();
        for &op in &self.schedule {
            match op {
                Op::Forward { micro, chunk } => self.run_forward(&mut run, micro, chunk, inputs, loss)?,
                Op::Backward { micro, chunk } => {
                    let first = chunk_first[chunk];
                    self.run_backward(&mut run, micro, chunk, &mut |start, sums| finished(first + start, sums))?
                }
            }
        }
        self.step_result(run, started)
    }

    /// The last virtual stage, whose output goes into the loss.
    fn last_virtual_stage(&self) -> usize {
        self.chunks.len() * self.stages - 1
    }

    /// Micro-batch `micro`'s data, the input of virtual stage 0.
    fn data_input(&self, inputs: &[Tensor], micro: usize) -> Result<Tensor> {
        let s = self.index;
        Ok(inputs
            .get(micro)
            .with_context(|| format!("stage {s}: no input for micro-batch {micro}"))?
            .clone())
    }

    /// The forward of micro-batch `micro` through `chunk`: its input from the data or the
    /// previous stage, its output to the next stage or, on the last virtual stage, into the
    /// loss; the pass is stashed for its backward.
    fn run_forward(
        &self,
        run: &mut StepRun,
        micro: usize,
        chunk: usize,
        inputs: &[Tensor],
        loss: &dyn Fn(usize, &Tensor) -> candle_core::Result<Tensor>,
    ) -> Result<()> {
        let (s, m) = (self.index, self.micro_batches);
        let virtual_stage = chunk * self.stages + s;
        let what = format!("forward of micro-batch {micro} into virtual stage {virtual_stage}");
        let input = if virtual_stage == 0 {
            self.data_input(inputs, micro)?
        } else {
            let received = run.receive(|| format!("recv activation {micro}"), |link| link.recv_forward(&what))?;
            // A fresh variable: backward stops here and yields the input's gradient.
            Var::from_tensor(&received)?.as_tensor().clone()
        };
        let computing = Instant::now();
        let Chunk { blocks, segments, .. } = &self.chunks[chunk];
        let forward = segments::forward(blocks, segments, input).with_context(|| format!("stage {s}: {what}"))?;
        let loss_gradient = if virtual_stage == self.last_virtual_stage() {
            // Each micro-batch's mean loss weighs 1/m of the batch's.
            let (l, g) = segments::loss_gradient(forward.output(), |out| loss(micro, out)? / m as f64)?;
            run.loss_sum += l;
            Some(g)
        } else {
            None
        };
        record(
            run.timeline,
            || span_name('F', micro, chunk, self.chunks.len()),
            "forward",
            computing,
        );
        if loss_gradient.is_none() {
            run.send(
                || format!("send activation {micro}"),
                |link| link.send_forward(&what, forward.output().detach()),
            )?;
        }
        run.stash(micro, chunk, Stashed { forward, loss_gradient });
        Ok(())
    }

    /// The backward of micro-batch `micro` through `chunk`: from the loss's gradient or the
    /// next stage's, its parameters' gradients summed (`finished` gets a segment's final sums,
    /// indexed within the chunk, at the chunk's last backward), its input's gradient sent to
    /// the previous stage.
    fn run_backward(
        &self,
        run: &mut StepRun,
        micro: usize,
        chunk: usize,
        finished: &mut dyn FnMut(usize, &[Tensor]) -> Result<()>,
    ) -> Result<()> {
        let s = self.index;
        let virtual_stage = chunk * self.stages + s;
        let what = format!("backward of micro-batch {micro} out of virtual stage {virtual_stage}");
        let stashed = run
            .stash
            .remove(&(micro, chunk))
            .with_context(|| format!("stage {s}: {what} before its forward"))?;
        let upstream = match stashed.loss_gradient {
            Some(g) => g,
            None => run.receive(|| format!("recv gradient {micro}"), |link| link.recv_backward(&what))?,
        };
        let computing = Instant::now();
        let forward_bytes = stashed.forward.held_bytes();
        run.backwards_left[chunk] -= 1;
        let last_backward = run.backwards_left[chunk] == 0;
        let done = self.chunks[chunk]
            .backward_summed(
                stashed.forward,
                &upstream,
                &mut run.sums[chunk],
                last_backward,
                finished,
            )
            .with_context(|| format!("stage {s}: {what}"))?;
        record(
            run.timeline,
            || span_name('B', micro, chunk, self.chunks.len()),
            "backward",
            computing,
        );
        run.peak_bytes = run.peak_bytes.max(run.held_bytes + done.recomputed_bytes);
        run.held_bytes -= forward_bytes;
        if virtual_stage > 0 {
            let g = done
                .input_gradient
                .with_context(|| format!("stage {s}: {what}: no gradient for the input"))?;
            run.send(|| format!("send gradient {micro}"), |link| link.send_backward(&what, g))?;
        }
        Ok(())
    }

    /// What the finished step produced: every parameter's summed gradient (zeros for one no
    /// micro-batch reached), the loss where it was computed, and the step's figures.
    fn step_result(&self, run: StepRun, started: Instant) -> Result<StageStep> {
        let gradients = self
            .chunks
            .iter()
            .zip(&run.sums)
            .map(|(chunk, sums)| sums_or_zeros(sums, &chunk.params))
            .collect::<candle_core::Result<Vec<_>>>()?
            .concat();
        Ok(StageStep {
            gradients,
            loss: (self.last_virtual_stage() % self.stages == self.index).then_some(run.loss_sum),
            peak_activations: run.peak,
            peak_activation_bytes: run.peak_bytes,
            waiting: run.waiting,
            elapsed: started.elapsed(),
        })
    }
}

impl Chunk {
    /// Backward of one micro-batch's `forward` from `upstream`, adding every parameter's
    /// gradient to `sums`. On the chunk's `last` backward, `finished(first, sums)` gets each
    /// segment's final sums as soon as they are ready, `first` indexed within the chunk.
    fn backward_summed(
        &self,
        forward: Forward,
        upstream: &Tensor,
        sums: &mut [Option<Tensor>],
        last: bool,
        finished: &mut dyn FnMut(usize, &[Tensor]) -> Result<()>,
    ) -> Result<Backward> {
        segments::backward(&self.blocks, &self.segments, forward, upstream, &mut |range, grads| {
            add_gradients(&self.params, sums, grads)?;
            if last {
                let (start, end) = (self.block_first[range.start], self.block_first[range.end]);
                finished(start, &sums_or_zeros(&sums[start..end], &self.params[start..end])?)?;
            }
            Ok(())
        })
    }
}

/// A step in progress: the link and timeline it uses, and what it accumulates as the
/// schedule runs.
struct StepRun<'a> {
    link: &'a mut dyn StageLink,
    timeline: &'a mut Option<Timeline>,
    /// Per chunk, the backwards still to run: its gradients are final after the last.
    backwards_left: Vec<usize>,
    /// Per chunk, each parameter's gradient summed over the micro-batches so far.
    sums: Vec<Vec<Option<Tensor>>>,
    /// The forwards awaiting their backward, by micro-batch and chunk.
    stash: HashMap<(usize, usize), Stashed>,
    loss_sum: f32,
    peak: usize,
    held_bytes: usize,
    peak_bytes: usize,
    waiting: Duration,
}

impl StepRun<'_> {
    /// Receives from a neighbour: the wait is the stage's share of the bubble.
    fn receive(
        &mut self,
        span: impl FnOnce() -> String,
        recv: impl FnOnce(&mut dyn StageLink) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let asked = Instant::now();
        let received = recv(&mut *self.link)?;
        self.waiting += asked.elapsed();
        record(self.timeline, span, "recv", asked);
        Ok(received)
    }

    /// Sends to a neighbour, the send on the timeline.
    fn send(
        &mut self,
        span: impl FnOnce() -> String,
        send: impl FnOnce(&mut dyn StageLink) -> Result<()>,
    ) -> Result<()> {
        let sending = Instant::now();
        send(&mut *self.link)?;
        record(self.timeline, span, "send", sending);
        Ok(())
    }

    /// Holds a forward pass until its backward, counting its activations toward the peaks.
    fn stash(&mut self, micro: usize, chunk: usize, stashed: Stashed) {
        self.held_bytes += stashed.forward.held_bytes();
        self.stash.insert((micro, chunk), stashed);
        self.peak = self.peak.max(self.stash.len());
        self.peak_bytes = self.peak_bytes.max(self.held_bytes);
    }
}

/// Adds the gradient `grads` holds for each parameter to its sum: every parameter a segment's
/// graph reached gets its share, so a weight used in two segments of a chunk (a tied head)
/// sums both.
fn add_gradients(params: &[Param], sums: &mut [Option<Tensor>], grads: &GradStore) -> candle_core::Result<()> {
    for (param, sum) in params.iter().zip(sums.iter_mut()) {
        if let Some(g) = grads.get(param.var()?.as_tensor()) {
            *sum = Some(match sum.take() {
                Some(acc) => (acc + g)?,
                None => g.clone(),
            });
        }
    }
    Ok(())
}

/// The summed gradients of `params`, zeros for those no backward reached.
fn sums_or_zeros(sums: &[Option<Tensor>], params: &[Param]) -> candle_core::Result<Vec<Tensor>> {
    sums.iter()
        .zip(params)
        .map(|(sum, param)| {
            sum.clone()
                .map_or_else(|| Tensor::zeros(param.shape(), param.dtype(), param.device()), Ok)
        })
        .collect()
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
