//! Sharded optimizer states (ZeRO stages 1 to 3; Paddle's `sharding`): every rank of the ring
//! owns one shard of each fusion bucket — the part whose sums its reduce-scatter finishes
//! ([`crate::engines::comm::Communicator::shard_of`]) — and keeps the optimizer's states of
//! that shard alone, `1/n` of them. A step updates the shard's parameters from the shard's
//! averaged gradients, then (stages 1 and 2) all-gathers every bucket's parameters, so all ranks
//! hold the whole model again. With sharded parameters (stage 3) the shards are the parameters'
//! only lasting copy: a bucket is one block's parameters, gathered where the block runs
//! ([`ShardedStates::gather`], [`ShardedStates::hold`]) and released after. The optimizer is the
//! replicas' own, one per bucket over the bucket's flat shard: its arithmetic is element-wise, so
//! the parameters of stages 1 and 2 are bit for bit those of plain data parallelism (the
//! reduce-scatter sums in the all-reduce's order; stage 3's buckets, cut by block, in another).
//!
//! Checkpoints stay in the replica's layout (model-named tensors, every optimizer slot whole):
//! saving gathers the slots of every shard, restoring takes this rank's shard of them, so a
//! checkpoint resumes on any number of ranks, sharded or not.

use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};

use super::tensor_parallel::{clip_split_by_global_norm, sum_over_group};
use super::{AveragedGradients, BucketPlan, Replicated};
use crate::config::{ShardingStage, TrainConfig};
use crate::engines::comm::{CommWorker, Pending, Wire};
use crate::models::parallel::Group;
use crate::models::{NamedParam, NamedValues};
use crate::optim::{Optimizer, OptimizerState};
use crate::telemetry::timeline::{Lane, Timeline};

/// A bucket's values gathered from every rank, with when the communication thread started and
/// ended the all-gather.
pub(super) type Gathered = (Vec<f32>, Instant, Instant);

/// A fusion bucket and this rank's shard of it.
struct ShardedBucket {
    /// Indices into the replica's parameters, in fill order.
    params: Vec<usize>,
    /// Values in the bucket.
    len: usize,
    /// This rank's part of them.
    shard: Range<usize>,
}

/// A replica's optimizer over this rank's shards of the parameters.
pub struct ShardedStates {
    buckets: Vec<ShardedBucket>,
    /// One flat variable per bucket, holding this rank's shard of its parameters.
    shards: Vec<Var>,
    /// One optimizer per bucket, over its shard: a bucket's update can go to its all-gather
    /// before the next one's is done. (Each steps once a step, as one over all would.)
    optimizers: Vec<Optimizer>,
    train: TrainConfig,
    /// What is sharded besides the optimizer's states.
    stage: ShardingStage,
}

impl ShardedStates {
    /// The optimizer of `train` at sharding `stage` over this rank's shards (on `comm`'s ring)
    /// of `plan`'s buckets of `params`, starting at learning rate `lr`.
    pub fn new(
        (train, stage): (&TrainConfig, ShardingStage),
        plan: &BucketPlan,
        params: &[NamedParam],
        comm: &CommWorker,
        lr: f64,
    ) -> Result<Self> {
        let lens: Vec<usize> = plan.buckets.iter().map(|b| b.len).collect();
        let ranges = comm.run(move |c| Ok(lens.iter().map(|&len| c.shard_of(len)).collect::<Vec<_>>()))?;
        let buckets: Vec<ShardedBucket> = plan
            .buckets
            .iter()
            .zip(ranges)
            .map(|(bucket, shard)| ShardedBucket {
                params: bucket.params.clone(),
                len: bucket.len,
                shard,
            })
            .collect();
        let device = params.first().map_or(Device::Cpu, |p| p.param.device().clone());
        let shards = buckets
            .iter()
            .map(|b| Var::zeros(b.shard.len(), candle_core::DType::F32, &device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        ensure!(
            !shards.is_empty(),
            "a sharded optimizer over a model without parameters"
        );
        let optimizers = shards
            .iter()
            .map(|shard| Optimizer::new(train, vec![shard.clone()], lr))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            buckets,
            shards,
            optimizers,
            train: train.clone(),
            stage,
        })
    }

    /// The same states cut for the ring `comm` (a rollback rebuilt it, perhaps with another
    /// number of ranks): empty, as a restore fills them next.
    pub fn recut(&self, plan: &BucketPlan, params: &[NamedParam], comm: &CommWorker) -> Result<Self> {
        let lr = self.first().learning_rate();
        Self::new((&self.train, self.stage), plan, params, comm, lr)
    }

    /// The first bucket's optimizer: all are of one kind, at one learning rate and count.
    fn first(&self) -> &Optimizer {
        &self.optimizers[0]
    }

    /// What is sharded.
    pub fn stage(&self) -> ShardingStage {
        self.stage
    }

    /// The optimizer's kind, as a checkpoint names it.
    pub fn name(&self) -> &'static str {
        self.first().name()
    }

    /// Sets the learning rate of the next step.
    pub fn set_learning_rate(&mut self, lr: f64) {
        for optimizer in &mut self.optimizers {
            optimizer.set_learning_rate(lr);
        }
    }

    /// One step: this rank's shard of `params` updated from `averaged` (clipped to the global
    /// norm `clip_norm` when positive), then every bucket's parameters all-gathered over `comm`
    /// — each bucket's as soon as its shard is updated, while the next one's update runs.
    /// Answers the time compute waited for the all-gathers, whose spans go to `timeline` when
    /// tracing.
    pub fn step(
        &mut self,
        params: &[NamedParam],
        averaged: AveragedGradients,
        (clip_norm, step): (f64, usize),
        (comm, layers): (&CommWorker, &Group),
        timeline: &mut Option<Timeline>,
    ) -> Result<Duration> {
        let grads = self.shard_gradients(params, averaged, (clip_norm, step), (comm, layers))?;
        let whole_afterwards = self.stage != ShardingStage::Parameters;
        if whole_afterwards {
            // The shards start from the parameters every rank holds (the last all-gather's, a
            // broadcast's or a restore's).
            self.take_shards(params)?;
        }
        let mut gathers = Vec::with_capacity(self.buckets.len());
        for (index, (shard, grad)) in self.shards.iter().zip(grads).enumerate() {
            let mut store = GradStore::default();
            store.insert(shard.as_tensor(), grad);
            self.optimizers[index].step(&store)?;
            if whole_afterwards {
                gathers.push(self.gather(index, comm, step)?);
            }
        }
        let mut waited = Duration::ZERO;
        for (index, gathered) in gathers.into_iter().enumerate() {
            waited += self.hold(index, gathered, params, timeline)?;
        }
        Ok(waited)
    }

    /// Takes this rank's shards from `params`, held whole (built, broadcast, restored, or
    /// gathered by the last step).
    pub fn take_shards(&self, params: &[NamedParam]) -> Result<()> {
        for (bucket, shard) in self.buckets.iter().zip(&self.shards) {
            shard.set(&bucket.slice(shard.device(), params, |i, range| Ok(params[i].param.values(range)?))?)?;
        }
        Ok(())
    }

    /// Starts the all-gather over `comm` of bucket `index`'s parameters from every rank's shard
    /// of them (for step `step`).
    pub fn gather(&self, index: usize, comm: &CommWorker, step: usize) -> Result<Pending<Gathered>> {
        let op = format!("all-gather of parameter bucket {index} at step {step}");
        self.buckets[index].gather(self.shards[index].as_tensor(), comm, op)
    }

    /// Holds bucket `index`'s `params` once their all-gather is done; answers the time waited
    /// for it, and records its span on `timeline` when tracing.
    pub fn hold(
        &self,
        index: usize,
        gathered: Pending<Gathered>,
        params: &[NamedParam],
        timeline: &mut Option<Timeline>,
    ) -> Result<Duration> {
        let bucket = &self.buckets[index];
        let waiting = Instant::now();
        let (whole, started, ended) = gathered.wait()?;
        let waited = waiting.elapsed();
        if let Some(timeline) = timeline {
            let name = format!("all-gather parameter bucket {index} ({} KiB)", bucket.len * 4 / 1024);
            timeline.record_between(Lane::Communication, name, "allgather", started, ended);
        }
        bucket.scatter_into(&whole, params)?;
        Ok(waited)
    }

    /// Releases bucket `index`'s `params` (sharded parameters: the shard stays).
    pub fn release(&self, index: usize, params: &[NamedParam]) {
        for &param in &self.buckets[index].params {
            params[param].param.release();
        }
    }

    /// Gathers every bucket's `params` over `comm` (every rank of the ring calling together), so
    /// the whole model is held, as for a checkpoint or an evaluation.
    pub fn gather_all(&self, params: &[NamedParam], comm: &CommWorker, step: usize) -> Result<()> {
        let what = format!("the parameters at step {step}");
        self.each_gathered(
            comm,
            &what,
            |index| Ok(self.parameter_shard(index)),
            |index, whole| self.buckets[index].scatter_into(&whole, params),
        )
    }

    /// The whole model's values of `params` by name, where `keep` (else `None`): gathered over
    /// `comm` a bucket at a time, every rank of the ring calling together, so that no rank but
    /// the one keeping them holds the whole model.
    pub fn whole_values(
        &self,
        params: &[NamedParam],
        comm: &CommWorker,
        (step, keep): (usize, bool),
    ) -> Result<Option<NamedValues>> {
        let mut values: Vec<Option<Vec<f32>>> = vec![None; params.len()];
        let what = format!("the parameters at step {step}");
        self.each_gathered(
            comm,
            &what,
            |index| Ok(self.parameter_shard(index)),
            |index, whole| {
                if keep {
                    for (param, range) in self.buckets[index].spans(params) {
                        values[param] = Some(whole[range].to_vec());
                    }
                }
                Ok(())
            },
        )?;
        if !keep {
            return Ok(None);
        }
        let named = params
            .iter()
            .zip(values)
            .map(|(p, values)| {
                Ok((
                    p.name.clone(),
                    values.with_context(|| format!("{} is in no bucket", p.name))?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(Some(named))
    }

    /// All-gathers over `comm`, bucket after bucket, what `shard(index)` gives of each (this
    /// rank's shard of its parameters or of an optimizer slot, named `what` in the collective's
    /// name), handing each bucket's whole values to `each`: the next bucket's gather runs while
    /// `each` works, and no more than two buckets are held at once. Every rank of the ring calls
    /// it together.
    pub(super) fn each_gathered(
        &self,
        comm: &CommWorker,
        what: &str,
        shard: impl Fn(usize) -> Result<Tensor>,
        mut each: impl FnMut(usize, Vec<f32>) -> Result<()>,
    ) -> Result<()> {
        let start = |index: usize| -> Result<Pending<Gathered>> {
            let op = format!("all-gather of {what} in bucket {index}");
            self.buckets[index].gather(&shard(index)?, comm, op)
        };
        let mut next = Some(start(0)?);
        for index in 0..self.buckets.len() {
            let pending = next.take().context("a bucket's gather was never started")?;
            if index + 1 < self.buckets.len() {
                next = Some(start(index + 1)?);
            }
            let (whole, ..) = pending.wait()?;
            each(index, whole)?;
        }
        Ok(())
    }

    /// This rank's shard of each parameter of `params` it holds a piece of, named
    /// `"{name}[start..end]"` (the piece's range of the parameter's flat values), keyed by the
    /// shards' ranges: the ranks holding the same ones (replicas of them) have the same key.
    pub fn shard_pieces(&self, params: &[NamedParam]) -> Result<Replicated> {
        let mut key = Vec::new();
        let mut pieces = Vec::new();
        for (bucket, shard) in self.buckets.iter().zip(&self.shards) {
            key.extend(
                [bucket.shard.start, bucket.shard.end]
                    .map(|b| (b as u64).to_le_bytes())
                    .concat(),
            );
            let values = shard.as_tensor().to_vec1::<f32>()?;
            for (param, own, held) in bucket.pieces(params) {
                let name = format!("{}[{}..{}]", params[param].name, own.start, own.end);
                pieces.push((name, values[held].to_vec()));
            }
        }
        Ok(Replicated { key, values: pieces })
    }

    /// The bucket holding each of `blocks` blocks' parameters (`None` for a block without any),
    /// where a bucket is one block's (sharded parameters).
    pub fn bucket_of_blocks(&self, params: &[NamedParam], blocks: usize) -> Vec<Option<usize>> {
        let mut of_block = vec![None; blocks];
        for (index, bucket) in self.buckets.iter().enumerate() {
            for &param in &bucket.params {
                of_block[params[param].block] = Some(index);
            }
        }
        of_block
    }

    /// This rank's shard of each bucket's averaged gradients, clipped to the global norm
    /// `clip_norm` when positive (the norm of the whole model's, split layers' parts summed over
    /// `layers`).
    fn shard_gradients(
        &self,
        params: &[NamedParam],
        averaged: AveragedGradients,
        (clip_norm, step): (f64, usize),
        (comm, layers): (&CommWorker, &Group),
    ) -> Result<Vec<Tensor>> {
        match averaged {
            AveragedGradients::Whole(mut whole) => {
                if clip_norm > 0.0 {
                    clip_split_by_global_norm(&mut whole, params, layers, clip_norm)?;
                }
                self.buckets
                    .iter()
                    .zip(&self.shards)
                    .map(|(bucket, shard)| {
                        bucket.slice(shard.device(), params, |i, range| {
                            let var = params[i].param.var()?;
                            let grad = (whole.get(var.as_tensor()))
                                .with_context(|| format!("no gradient for {}", params[i].name))?;
                            Ok(grad.flatten_all()?.narrow(0, range.start, range.len())?)
                        })
                    })
                    .collect()
            }
            AveragedGradients::Shards(values) => {
                ensure!(
                    values.len() == self.buckets.len(),
                    "step {step}: {} gradient shards for {} buckets",
                    values.len(),
                    self.buckets.len()
                );
                let mut tensors = Vec::with_capacity(values.len());
                for ((bucket, shard), values) in self.buckets.iter().zip(&self.shards).zip(values) {
                    ensure!(
                        values.len() == bucket.shard.len(),
                        "step {step}: a gradient shard of {} values where this rank owns {}",
                        values.len(),
                        bucket.shard.len()
                    );
                    let len = values.len();
                    tensors.push(Tensor::from_vec(values, len, shard.device())?);
                }
                if clip_norm <= 0.0 {
                    return Ok(tensors);
                }
                let mut squares = [0f64; 2];
                for (bucket, grad) in self.buckets.iter().zip(&tensors) {
                    let [split, whole] = bucket.squares(grad, params)?;
                    squares = [squares[0] + split, squares[1] + whole];
                }
                let total = sum_of_shards(squares, (comm, layers), step)?;
                let scale = clip_norm / (total.sqrt() + 1e-6);
                if scale >= 1.0 {
                    return Ok(tensors);
                }
                Ok(tensors
                    .into_iter()
                    .map(|g| g.affine(scale, 0.0))
                    .collect::<candle_core::Result<_>>()?)
            }
        }
    }

    /// The whole optimizer state by parameter (as [`Optimizer::state`] of an unsharded replica
    /// gives it): every rank's shards gathered over `comm`. Every rank of the ring calls it.
    pub fn state(&self, params: &[NamedParam], comm: &CommWorker) -> Result<OptimizerState> {
        let steps = self.optimizer_steps()?;
        let mut tensors = Vec::new();
        for &slot in self.slots_saved()? {
            let what = format!("optimizer slot {slot}");
            self.each_gathered(
                comm,
                &what,
                |index| self.slot_shard(index, slot),
                |index, whole| {
                    for (param, range) in self.buckets[index].spans(params) {
                        let p = &params[param].param;
                        let values = Tensor::from_slice(&whole[range], p.shape(), p.device())?;
                        tensors.push((param, slot.to_string(), values));
                    }
                    Ok(())
                },
            )?;
        }
        Ok(OptimizerState { steps, tensors })
    }

    /// The optimizer's update count.
    pub(super) fn optimizer_steps(&self) -> Result<u64> {
        Ok(self.first().state()?.steps)
    }

    /// The optimizer slots a saved state holds: none before the first update (no slot holds
    /// anything yet, on every rank alike; SGD has no velocity), else every slot of every
    /// parameter.
    pub(super) fn slots_saved(&self) -> Result<&'static [&'static str]> {
        Ok(match self.optimizer_steps()? {
            0 => &[],
            _ => self.first().slots(),
        })
    }

    /// This rank's shard of optimizer slot `slot` of bucket `index` (zeros where the optimizer
    /// has not set it).
    pub(super) fn slot_shard(&self, index: usize, slot: &str) -> Result<Tensor> {
        let state = self.optimizers[index].state()?;
        match state.tensors.into_iter().find(|(_, s, _)| s == slot) {
            Some((_, _, tensor)) => Ok(tensor),
            None => Ok(Tensor::zeros(
                self.buckets[index].shard.len(),
                candle_core::DType::F32,
                &Device::Cpu,
            )?),
        }
    }

    /// This rank's shard of bucket `index`'s parameters.
    pub(super) fn parameter_shard(&self, index: usize) -> Tensor {
        self.shards[index].as_tensor().clone()
    }

    /// Each bucket's parameters (of `params`) with their ranges of the bucket's flat values, in
    /// bucket order and each bucket's fill order.
    pub(super) fn bucket_spans<'a>(
        &'a self,
        params: &'a [NamedParam],
    ) -> impl Iterator<Item = Vec<(usize, Range<usize>)>> + 'a {
        self.buckets.iter().map(|b| b.spans(params).collect())
    }

    /// Takes this rank's shards of `state` (whole, by parameter of `params`); checks every entry
    /// and cuts every shard before changing anything.
    pub fn load_state(&mut self, state: OptimizerState, params: &[NamedParam]) -> Result<()> {
        let mut by_param = std::collections::HashMap::new();
        for (index, slot, tensor) in state.tensors {
            let param = params
                .get(index)
                .with_context(|| format!("optimizer state of parameter {index}, beyond the {}", params.len()))?;
            ensure!(
                tensor.dims() == param.param.dims(),
                "optimizer slot {slot} of {}: shape {:?}, the parameter's is {:?}",
                param.name,
                tensor.dims(),
                param.param.dims()
            );
            by_param.insert((index, slot), tensor);
        }
        let slots = self.first().slots();
        let mut by_bucket = Vec::with_capacity(self.buckets.len());
        for (bucket, var) in self.buckets.iter().zip(&self.shards) {
            let mut tensors = Vec::new();
            for &slot in slots {
                if !bucket
                    .params
                    .iter()
                    .any(|&i| by_param.contains_key(&(i, slot.to_string())))
                {
                    continue;
                }
                let shard = bucket.slice(var.device(), params, |i, range| {
                    match by_param.get(&(i, slot.to_string())) {
                        Some(tensor) => Ok(tensor.flatten_all()?.narrow(0, range.start, range.len())?),
                        None => Ok(Tensor::zeros(range.len(), candle_core::DType::F32, var.device())?),
                    }
                })?;
                tensors.push((0, slot.to_string(), shard));
            }
            by_bucket.push(tensors);
        }
        for (optimizer, tensors) in self.optimizers.iter_mut().zip(by_bucket) {
            optimizer.load_state(OptimizerState {
                steps: state.steps,
                tensors,
            })?;
        }
        Ok(())
    }

    /// The values of parameters, averaged gradients and optimizer state (its slots, and the
    /// shard of the parameters it updates where the parameters are held whole too) this rank
    /// holds between steps, of a model of `params` values.
    pub fn held_values(&self, params: usize) -> [usize; 3] {
        let shard: usize = self.buckets.iter().map(|b| b.shard.len()).sum();
        let slots = self.first().slots().len();
        match self.stage {
            ShardingStage::OptimizerStates => [params, params, shard * (slots + 1)],
            ShardingStage::Gradients => [params, shard, shard * (slots + 1)],
            ShardingStage::Parameters => [shard, shard, shard * slots],
        }
    }
}

impl ShardedBucket {
    /// This rank's shard of the bucket of `params`: the flat values of the parameters in fill
    /// order, cut to the shard, each parameter's part of it asked of `of(index, range)` (the
    /// range of its flat values).
    fn slice(
        &self,
        device: &Device,
        params: &[NamedParam],
        of: impl Fn(usize, Range<usize>) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let filled: usize = self.params.iter().map(|&i| params[i].param.elem_count()).sum();
        ensure!(
            filled == self.len,
            "a bucket of {} values filled with {filled}",
            self.len
        );
        let mut pieces = (self.pieces(params))
            .map(|(param, own, _)| of(param, own))
            .collect::<Result<Vec<_>>>()?;
        Ok(match pieces.len() {
            0 => Tensor::zeros(0, candle_core::DType::F32, device)?,
            1 => pieces.remove(0).contiguous()?,
            _ => Tensor::cat(&pieces, 0)?,
        })
    }

    /// Hands `shard`, this rank's values, to the all-gather `op` of every rank's over `comm`:
    /// the whole bucket, and when the communication thread worked on it.
    fn gather(&self, shard: &Tensor, comm: &CommWorker, op: String) -> Result<Pending<Gathered>> {
        let mut whole = vec![0f32; self.len];
        whole[self.shard.clone()].copy_from_slice(&shard.to_vec1::<f32>()?);
        Ok(comm.submit(move |c| {
            let started = Instant::now();
            c.all_gather_shards_as(&op, &mut whole, Wire::F32)?;
            Ok((whole, started, Instant::now()))
        }))
    }

    /// The sums of squares of `grad`, this rank's shard of the bucket's gradients: of the
    /// elements of split parameters (tensor parallelism) and of the others.
    fn squares(&self, grad: &Tensor, params: &[NamedParam]) -> Result<[f64; 2]> {
        let sum = |t: &Tensor| -> Result<f64> {
            Ok(t.to_dtype(candle_core::DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?)
        };
        if self.params.iter().all(|&i| params[i].split.is_none()) {
            return Ok([0.0, sum(grad)?]);
        }
        let mut squares = [0f64; 2];
        for (param, _, held) in self.pieces(params) {
            let piece = grad.narrow(0, held.start, held.len())?;
            squares[usize::from(params[param].split.is_none())] += sum(&piece)?;
        }
        Ok(squares)
    }

    /// The parameters (of `params`) this rank's shard holds a piece of, in fill order: each with
    /// the piece's range of the parameter's flat values and of the shard's.
    fn pieces<'a>(
        &'a self,
        params: &'a [NamedParam],
    ) -> impl Iterator<Item = (usize, Range<usize>, Range<usize>)> + 'a {
        let mut offset = 0;
        self.params.iter().filter_map(move |&param| {
            let n = params[param].param.elem_count();
            let (start, end) = (self.shard.start.max(offset), self.shard.end.min(offset + n));
            let at = offset;
            offset += n;
            (start < end).then(|| {
                (
                    param,
                    start - at..end - at,
                    start - self.shard.start..end - self.shard.start,
                )
            })
        })
    }

    /// Each parameter of the bucket (an index into `params`) with its range of the bucket's
    /// flat values, in fill order.
    fn spans<'a>(&'a self, params: &'a [NamedParam]) -> impl Iterator<Item = (usize, Range<usize>)> + 'a {
        let mut offset = 0;
        self.params.iter().map(move |&param| {
            let n = params[param].param.elem_count();
            offset += n;
            (param, offset - n..offset)
        })
    }

    /// Holds each parameter of the bucket (of `params`) from its values in the whole bucket
    /// `values`.
    fn scatter_into(&self, values: &[f32], params: &[NamedParam]) -> Result<()> {
        for (param, range) in self.spans(params) {
            params[param].param.hold(&values[range])?;
        }
        Ok(())
    }
}

/// The squared global norm of the whole model's averaged gradients from each rank's sums of
/// squares of its shards — `[of split parameters' elements, of the others']` — added in rank order
/// on every rank of `comm`'s ring, so all scale alike; the split parameters' sums then over the
/// layer group (each holds its own parts), the others' counted once (every rank of the group holds
/// the same).
fn sum_of_shards(squares: [f64; 2], (comm, layers): (&CommWorker, &Group), step: usize) -> Result<f64> {
    let op = format!("all-gather of the gradient norm's parts at step {step}");
    let mine: Vec<u8> = squares.iter().flat_map(|s| s.to_le_bytes()).collect();
    let parts = comm.run(move |c| c.all_gather(&op, &mine))?;
    let [mut split, mut whole] = [0f64; 2];
    for part in parts {
        let bytes: [u8; 16] = part.as_slice().try_into().context("a norm part of another width")?;
        split += f64::from_le_bytes(bytes[..8].try_into()?);
        whole += f64::from_le_bytes(bytes[8..].try_into()?);
    }
    Ok(whole + sum_over_group(layers, split)?)
}
