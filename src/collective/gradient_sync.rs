//! The one way a replica's gradients are averaged over its data-parallel peers, for collective
//! and pipeline replicas alike: gradients are handed over in the order backward finishes them,
//! gathered into fusion buckets of about `fuse_grad_size_in_MB`, and each bucket is all-reduced
//! on the communication thread as soon as it is full, while backward goes on — by NCCL on GPUs
//! (the bucket stays on the device), by the ring elsewhere, in f32 or, with
//! `strategy.fp16_allreduce`, in bfloat16 on the wire. With gradient merge the buckets of k
//! batches are summed first and all-reduced once. With sharded gradients
//! (`sharding_configs.stage` 2 and 3) each bucket is reduce-scattered instead, and a rank keeps
//! the averaged values of its shard alone; with sharded parameters (stage 3) a bucket is one
//! block's parameters, the unit they are gathered in.

use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};

use super::gradient_bucket::{gradient_of, BucketFill, BucketValues};
use super::BucketPlan;
use crate::config::{JobConfig, ShardingStage};
use crate::engines::comm::{CommWorker, Pending, Wire};
use crate::models::{NamedParam, Param};
use crate::optim::GradientMerge;
use crate::telemetry::timeline::{record, Lane, Timeline};

/// A replica's gradient averaging: its buckets, merge and wire format.
pub struct GradientSync {
    params: Vec<Param>,
    plan: BucketPlan,
    /// The bucket and the place in it of the n-th gradient handed over.
    slots: Vec<(usize, usize)>,
    merge: GradientMerge<BucketValues>,
    wire: Wire,
    device: Device,
    /// Whether a replica alone may hand its gradients to the optimizer as backward made them: it
    /// merges nothing, and its optimizer steps on whole gradients (sharded parameters are
    /// released once their gradients are handed over, so they step on their shards).
    direct_when_alone: bool,
    /// Whether each bucket is reduce-scattered (sharded gradients) rather than all-reduced.
    scatters: bool,
}

/// What a step's averaging leaves this rank.
pub enum AveragedGradients {
    /// The gradient of every parameter.
    Whole(GradStore),
    /// This rank's shard of each bucket's averaged values, in bucket order (sharded gradients).
    Shards(Vec<Vec<f32>>),
}

/// The averaged gradients of a step, ready for the optimizer.
pub struct Averaged {
    /// The gradients.
    pub grads: AveragedGradients,
    /// Time compute waited after backward while an all-reduce ran: what backward did not hide.
    /// Counted only while a collective ran (not the hand-over between the threads), so it is
    /// part of the communication time and never exceeds it.
    pub exposed: Duration,
}

impl AveragedGradients {
    /// Every parameter's gradient; an error for shards, which only a sharded optimizer steps on.
    pub fn into_whole(self) -> Result<GradStore> {
        match self {
            Self::Whole(grads) => Ok(grads),
            Self::Shards(_) => bail!("sharded gradients reached an optimizer of whole parameters"),
        }
    }
}

impl GradientSync {
    /// The averaging of `params`' gradients over the replicas, as `job` configures it; backward
    /// hands the gradients over in `arrival` order (indices into `params`, each once), the order the
    /// buckets are cut in.
    pub fn new(job: &JobConfig, params: &[NamedParam], arrival: &[usize], device: &Device) -> Result<Self> {
        let mut seen = vec![false; params.len()];
        for &index in arrival {
            ensure!(
                index < params.len() && !std::mem::replace(&mut seen[index], true),
                "the gradient order names parameter {index} twice or beyond the {} parameters",
                params.len()
            );
        }
        ensure!(
            arrival.len() == params.len(),
            "the gradient order names {} of the {} parameters",
            arrival.len(),
            params.len()
        );
        let stage = job.strategy.sharding_stage();
        let plan = if stage == Some(ShardingStage::Parameters) {
            let sized: Vec<_> = (arrival.iter())
                .map(|&i| (i, params[i].param.elem_count(), params[i].block))
                .collect();
            BucketPlan::per_block(&sized)
        } else {
            let sized: Vec<_> = arrival.iter().map(|&i| (i, params[i].param.elem_count())).collect();
            BucketPlan::new(&sized, job.strategy.fuse_grad_size_bytes())
        };
        let wire = if job.strategy.fp16_allreduce {
            Wire::Bf16
        } else {
            Wire::F32
        };
        let slots = plan
            .buckets
            .iter()
            .enumerate()
            .flat_map(|(b, bucket)| (0..bucket.params.len()).map(move |position| (b, position)))
            .collect();
        Ok(Self {
            params: params.iter().map(|p| p.param.clone()).collect(),
            slots,
            merge: GradientMerge::new(&job.strategy, plan.buckets.len()),
            plan,
            wire,
            device: device.clone(),
            direct_when_alone: job.strategy.merge_steps() == 1 && stage != Some(ShardingStage::Parameters),
            scatters: stage.is_some_and(ShardingStage::scatters_gradients),
        })
    }

    /// Number of fusion buckets.
    pub fn buckets(&self) -> usize {
        self.plan.buckets.len()
    }

    /// The fusion buckets.
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// The optimizer step that batch `batch` belongs to (the learning rate follows it).
    pub fn optimizer_step(&self, batch: usize) -> usize {
        self.merge.optimizer_step(batch)
    }

    /// Drops the batches merged so far (a rollback abandons them).
    pub fn clear(&mut self) {
        self.merge.clear();
    }

    /// Starts handing over the gradients of batch `step`, whose all-reduces go to `comm`. A
    /// replica alone (elastic membership may shrink a job to one) that merges nothing hands its
    /// gradients to the optimizer as backward made them.
    pub fn begin<'a>(&'a mut self, step: usize, comm: &'a CommWorker) -> StepGradients<'a> {
        StepGradients {
            direct: self.direct_when_alone && comm.world_size() == 1,
            filling: BucketFill::new(&self.device),
            sync: self,
            comm,
            step,
            next: 0,
            reducing: Vec::new(),
            kept: GradStore::default(),
        }
    }
}

/// One batch's gradients on their way to being averaged.
pub struct StepGradients<'a> {
    sync: &'a mut GradientSync,
    comm: &'a CommWorker,
    step: usize,
    filling: BucketFill,
    /// Gradients handed over so far: the position in the arrival order of the next one.
    next: usize,
    reducing: Vec<Pending<ReducedBucket>>,
    /// The gradients go straight to the optimizer (a replica alone that merges nothing).
    direct: bool,
    /// The gradients kept when `direct`.
    kept: GradStore,
}

impl StepGradients<'_> {
    /// Hands over the final gradient of parameter `index`; a bucket it completes goes to the
    /// communication thread at once.
    pub fn add(&mut self, index: usize, grad: &Tensor) -> Result<()> {
        let sync = &mut *self.sync;
        let &(bucket_index, position) = sync.slots.get(self.next).with_context(|| {
            format!(
                "step {}: parameter {index}'s gradient came after all the others",
                self.step
            )
        })?;
        let bucket = &sync.plan.buckets[bucket_index];
        if bucket.params[position] != index {
            bail!(
                "step {}: the gradient of parameter {index} came where parameter {}'s was expected \
                 (backward finished them in another order than the buckets were cut in)",
                self.step,
                bucket.params[position]
            );
        }
        self.next += 1;
        if self.direct {
            self.kept.insert(sync.params[index].var()?.as_tensor(), grad.clone());
            return Ok(());
        }
        self.filling.push(grad, bucket.len)?;
        if position + 1 == bucket.params.len() {
            if let Some(merged) = sync.merge.add(self.step, bucket_index, self.filling.take()?)? {
                let reduction = Reduction {
                    step: self.step,
                    bucket: bucket_index,
                    wire: sync.wire,
                    scatters: sync.scatters,
                };
                self.reducing.push(reduction.submit(self.comm, merged));
            }
        }
        Ok(())
    }

    /// Once a collective of the communication thread failed the step is lost: an error, that
    /// collective's, so backward stops early.
    pub fn stop_if_failed(&mut self) -> Result<()> {
        if !self.comm.failed() {
            return Ok(());
        }
        for reduced in self.reducing.drain(..) {
            reduced.wait()?;
        }
        bail!(
            "step {}: a collective failed, so the step stops before the rest of backward",
            self.step
        )
    }

    /// Hands over, from `grads`, the gradients of the `params` (the replica's, in model order)
    /// of the blocks in `blocks`: the last block first, as backward finishes them. Stops first
    /// if an all-reduce failed: that collective's error dooms the step (a rollback may follow).
    pub fn add_blocks(&mut self, params: &[NamedParam], blocks: Range<usize>, grads: &GradStore) -> Result<()> {
        self.stop_if_failed()?;
        for block in blocks.rev() {
            for (index, param) in params.iter().enumerate().filter(|(_, p)| p.block == block) {
                let grad = grads
                    .get(param.param.var()?.as_tensor())
                    .with_context(|| format!("no gradient for {}", param.name))?;
                self.add(index, grad)?;
            }
        }
        Ok(())
    }

    /// Waits for the step's all-reduces and returns the averaged gradients, or nothing on a
    /// batch that only merges. Every parameter's gradient must have been handed over.
    pub fn finish(self, timeline: &mut Option<Timeline>) -> Result<Option<Averaged>> {
        let sync = self.sync;
        let arrived = self.next;
        let expected = sync.params.len();
        if arrived < expected {
            // Wait for what is in flight, so no collective is left behind, then report.
            for reduced in self.reducing {
                reduced.wait()?;
            }
            bail!(
                "step {}: backward handed over {arrived} of the {expected} parameters' gradients",
                self.step
            );
        }
        if self.direct {
            return Ok(Some(Averaged {
                grads: AveragedGradients::Whole(self.kept),
                exposed: Duration::ZERO,
            }));
        }
        if self.reducing.is_empty() {
            return Ok(None);
        }
        let mut grads = GradStore::default();
        let mut shards = Vec::new();
        let (mut waits, mut collectives) = (Vec::new(), Vec::new());
        for (index, (bucket, reduced)) in sync.plan.buckets.iter().zip(self.reducing).enumerate() {
            let waiting = Instant::now();
            let ReducedBucket { values, started, ended } = reduced.wait()?;
            waits.push((waiting, Instant::now()));
            collectives.push((started, ended));
            record(timeline, || format!("wait for bucket {index}"), "wait", waiting);
            if let Some(timeline) = timeline {
                let collective = if sync.scatters { "reduce-scatter" } else { "all-reduce" };
                let name = format!(
                    "{collective} bucket {index} ({} KiB)",
                    bucket.len * sync.wire.width() / 1024
                );
                timeline.record_between(Lane::Communication, name, "allreduce", started, ended);
            }
            if sync.scatters {
                let BucketValues::Host(shard) = values else {
                    bail!("step {}: bucket {index}'s shard came back on the device", self.step)
                };
                shards.push(shard);
                continue;
            }
            let flat = values.into_flat(&sync.device)?;
            let mut offset = 0;
            for &param in &bucket.params {
                let param = &sync.params[param];
                grads.insert(param.var()?.as_tensor(), gradient_of(&flat, offset, param.shape())?);
                offset += param.elem_count();
            }
        }
        let grads = match sync.scatters {
            true => AveragedGradients::Shards(shards),
            false => AveragedGradients::Whole(grads),
        };
        Ok(Some(Averaged {
            grads,
            exposed: overlap(&waits, &collectives),
        }))
    }
}

/// The time `waits` and `collectives` (each a set of disjoint intervals: one compute thread
/// waits, one communication thread runs) have in common.
fn overlap(waits: &[(Instant, Instant)], collectives: &[(Instant, Instant)]) -> Duration {
    waits
        .iter()
        .flat_map(|&(w0, w1)| {
            collectives
                .iter()
                .map(move |&(c0, c1)| w1.min(c1).saturating_duration_since(w0.max(c0)))
        })
        .sum()
}

/// A bucket's averaged gradients and when the communication thread worked on them.
struct ReducedBucket {
    values: BucketValues,
    started: Instant,
    ended: Instant,
}

/// How one bucket of one step is averaged.
struct Reduction {
    step: usize,
    bucket: usize,
    wire: Wire,
    /// Reduce-scattered (sharded gradients), leaving this rank its shard; else all-reduced.
    scatters: bool,
}

impl Reduction {
    /// Hands the bucket's gradients `values` to the communication thread, which averages them
    /// over the ranks.
    fn submit(self, comm: &CommWorker, values: BucketValues) -> Pending<ReducedBucket> {
        comm.submit(move |c| {
            let started = Instant::now();
            let Self {
                step,
                bucket,
                wire,
                scatters,
            } = self;
            let values = if scatters {
                let op = format!("reduce-scatter of gradient bucket {bucket} at step {step}");
                BucketValues::Host(values.reduce_scatter_mean(c, &op, wire)?)
            } else {
                let op = format!("all-reduce of gradient bucket {bucket} at step {step}");
                values.all_reduce_mean(c, &op, wire)?
            };
            Ok(ReducedBucket {
                values,
                started,
                ended: Instant::now(),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposure_counts_only_waiting_while_a_collective_runs() {
        let t = Instant::now();
        let at = |ms: u64| t + Duration::from_millis(ms);
        // Collectives 0–10 and 12–20 ms; compute waits 5–11 (the last ms is the hand-over
        // after the first ended) and 15–25 (5 ms after the second ended).
        let collectives = [(at(0), at(10)), (at(12), at(20))];
        let waits = [(at(5), at(11)), (at(15), at(25))];
        assert_eq!(overlap(&waits, &collectives), Duration::from_millis(10));
        assert_eq!(overlap(&[], &collectives), Duration::ZERO);
        assert_eq!(overlap(&[(at(30), at(40))], &collectives), Duration::ZERO);
    }
}
