//! One rank's replica: the model, its optimizer and the communicator, and
//! the data-parallel training step over them. Runs on the device thread.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};

use super::evaluation::{score_pieces, sum_over_ranks};
use super::preemption;
use super::rank_figures::{JobFigures, RankFigures};
use super::rank_replica::{save_whole, whole_parameters, whole_replicated, Held, RankReplica, Replicated, StepReport};
use super::sharded_checkpoint::save_streamed;
use super::sharded_parameters::{score_pieces_sharded, BlockGathers, Holding};
use super::tensor_parallel::RingGroup;
use super::training_state::RunRecord;
use super::{Averaged, GradientSync, ParamChecksum, ReplicaOptimizer};
use crate::config::{JobConfig, LossKind};
use crate::data::{Batch, Pieces};
use crate::engines::comm::CommWorker;
use crate::engines::compute::segments::{self, AroundSegments, Segments};
use crate::models::export::ModelInfo;
use crate::models::parallel::{Alone, Group};
use crate::models::{Model, NamedParam, NamedValues, Score};
use crate::optim::LrPolicy;
use crate::telemetry::metrics::peak_rss_bytes;
use crate::telemetry::timeline::{record, Timeline};

/// A model replica that trains in lockstep with the other ranks.
pub struct Replica {
    model: Model,
    params: Vec<NamedParam>,
    gradients: GradientSync,
    optimizer: ReplicaOptimizer,
    lr_policy: LrPolicy,
    comm: CommWorker,
    /// The ranks that split the model's layers with this one (tensor parallelism), over a ring
    /// of their own; `None`: the layers are whole.
    layer_ring: Option<Arc<RingGroup>>,
    /// The same group as the layers see it ([`Alone`] where they are whole).
    layers: Group,
    device: Device,
    /// How forward and backward cut the model: per block (each block's gradients go to their
    /// buckets as soon as they are done), or recomputed segments.
    segments: Segments,
    /// The model as one segment, where nothing keeps it cut (no recomputation): what a replica
    /// alone uses, with no all-reduce to overlap and so no passes between segments to pay.
    whole: Option<Segments>,
    /// What is held of sharded parameters (stage 3; whole otherwise).
    holding: Holding,
    /// The loss trained, which also says how evaluation scores.
    loss: LossKind,
    /// Clip the averaged gradients to this global norm (0: never).
    grad_clip_norm: f64,
    /// Batches trained.
    step: usize,
    /// Spans of the steps, when tracing.
    timeline: Option<Timeline>,
}

impl Replica {
    /// A replica of `model` for `job`, talking to the other replicas through `comm`, in a run
    /// of `steps` batches; its layers split over `layer_ring` where it is given.
    pub fn new(
        model: Model,
        job: &JobConfig,
        (comm, layer_ring): (CommWorker, Option<Arc<RingGroup>>),
        device: Device,
        steps: usize,
    ) -> Result<Self> {
        let layers: Group = match &layer_ring {
            Some(ring) => ring.clone(),
            None => Arc::new(Alone),
        };
        let model = model
            .split(&layers)
            .context("splitting the model over its layer group (strategy.hybrid_configs.mp_degree)")?;
        let params = model.parameters();
        let gradients = GradientSync::new(job, &params, &backward_order(&model, &params), &device)?;
        // The job's replicas, not this generation's: with elastic membership the global batch,
        // and so its learning rate, stays the same on fewer ranks.
        let lr_policy = LrPolicy::new(
            &job.train,
            job.data_parallel_replicas(),
            gradients.optimizer_step(steps),
        );
        let optimizer = ReplicaOptimizer::new(job, gradients.plan(), &params, &comm, lr_policy.at(0))?;
        let blocks = model.blocks().len();
        let (segments, whole) = if optimizer.parameter_shards().is_some() {
            // Sharded parameters: each block gathered for its forward and again for its
            // backward, which recomputes it.
            let every_block: Vec<usize> = (0..blocks).collect();
            (Segments::recomputed(blocks, &every_block), None)
        } else if job.strategy.recompute {
            let names: Vec<&str> = model.blocks().iter().map(|b| b.name()).collect();
            let recomputed = Segments::recomputed(blocks, &job.strategy.recompute_configs.resolve(&names)?);
            (recomputed, None)
        } else {
            (Segments::per_block(blocks), Some(Segments::whole(blocks)))
        };
        tracing::debug!(
            rank = comm.rank(),
            buckets = gradients.buckets(),
            params = model.parameter_count(),
            sharding_stage = job.strategy.sharding_stage().map(|s| s.number()),
            "replica ready"
        );
        Ok(Self {
            holding: Holding::of(&params),
            model,
            params,
            gradients,
            optimizer,
            lr_policy,
            comm,
            layer_ring,
            layers,
            device,
            segments,
            whole,
            loss: job.train.resolved_loss()?,
            grad_clip_norm: job.train.grad_clip_norm,
            step: 0,
            timeline: None,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks training together.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Goes on over the ring `comm` and the layer group's `layer_comm` (a rollback rebuilt
    /// them): the collectives in flight on the old ones and the batches merged so far are
    /// dropped; sharded states are cut anew for the ring (it may have another number of ranks).
    /// The state comes from a snapshot next.
    pub fn relink(&mut self, comm: CommWorker, layer_comm: Option<CommWorker>) -> Result<()> {
        match (&self.layer_ring, layer_comm) {
            (Some(ring), Some(comm)) => ring.relink(comm),
            (None, None) => {}
            _ => anyhow::bail!("a relink changed whether the layers are split"),
        }
        self.optimizer.recut(self.gradients.plan(), &self.params, &comm)?;
        if self.holding == Holding::Shards {
            self.holding = Holding::Lost;
        }
        self.comm = comm;
        self.gradients.clear();
        Ok(())
    }

    /// Makes every rank start from rank 0's parameters; parameters made released need nothing:
    /// every rank draws their values from the same recipes.
    pub fn broadcast_parameters(&mut self) -> Result<()> {
        if self.holding == Holding::Deferred {
            return Ok(());
        }
        broadcast_parameters(&self.comm, &self.params)
    }

    /// The optimizer's step on step `step`'s `averaged` gradients, clipped to the global norm
    /// where the job asks; a sharded one then all-gathers the parameters, and answers the time
    /// it waited for them.
    fn apply(&mut self, averaged: Averaged, step: usize) -> Result<Duration> {
        let stepping = Instant::now();
        let (clip, rings) = ((self.grad_clip_norm, step), (&self.comm, &self.layers));
        let waited = self
            .optimizer
            .step(&self.params, averaged.grads, clip, rings, &mut self.timeline)?;
        settle_for_trace(&self.timeline, &self.device)?;
        record(
            &mut self.timeline,
            || format!("optimizer {step}"),
            "optimizer",
            stepping,
        );
        Ok(waited)
    }

    /// The gathers of step `step`'s sharded parameters (stage 3), the shards alone kept first;
    /// `None` where the parameters are whole.
    fn begin_gathers(&mut self, step: usize) -> Result<Option<BlockGathers>> {
        let Some(states) = self.optimizer.parameter_shards() else {
            return Ok(None);
        };
        self.holding.keep_shards(states, &self.params)?;
        Ok(Some(BlockGathers::new(
            states,
            &self.params,
            self.model.blocks().len(),
            step,
        )))
    }

    /// Every rank's loss (this one's `loss`), peak RSS and stop request at step `step`.
    fn gather_figures(&mut self, loss: f32, step: usize) -> Result<JobFigures> {
        let gathering = Instant::now();
        let mine = RankFigures {
            loss,
            peak_rss_bytes: peak_rss_bytes(),
            stop: preemption::asked(),
        };
        let figures = self
            .comm
            .run(move |c| mine.gather(c, &format!("gather of the losses of step {step}")))?;
        record(&mut self.timeline, || format!("loss gather {step}"), "wait", gathering);
        Ok(figures)
    }

    /// On a GPU, kernels run after the calls that launch them return: a traced step waits for
    /// them at the end of each compute span, so that the span is the GPU's time (untraced steps
    /// never wait).
    fn settle_for_trace(&self) -> Result<()> {
        settle_for_trace(&self.timeline, &self.device)
    }

    /// Saves the state to `out`, or joins the save another rank writes where `None`: streamed
    /// bucket by bucket where the parameters are sharded over whole layers (split layers are
    /// gathered whole over their group first).
    fn save_or_join(
        &mut self,
        out: Option<&mut dyn std::io::Write>,
        export: &ModelInfo,
        run: &RunRecord,
    ) -> Result<()> {
        match self.optimizer.parameter_shards() {
            Some(states) if self.layers.size() == 1 => {
                self.holding.keep_shards(states, &self.params)?;
                save_streamed((states, &self.params), &self.comm, out, (export, run, self.step))
            }
            _ => save_whole(self, out, export, run),
        }
    }

    /// The checksum of this replica's parameters.
    pub fn checksum(&self) -> Result<ParamChecksum> {
        Ok(ParamChecksum::of(&self.params)?)
    }
}

/// The hook around a pass's segments: the gathers of sharded parameters, or nothing.
fn around<'a>(
    gathers: &'a mut Option<BlockGathers>,
    (optimizer, params): (&'a ReplicaOptimizer, &'a [NamedParam]),
    comm: &'a CommWorker,
    timeline: &'a mut Option<Timeline>,
) -> Box<dyn AroundSegments + 'a> {
    match (gathers, optimizer.parameter_shards()) {
        (Some(gathers), Some(states)) => Box::new(gathers.around((states, params), comm, timeline)),
        _ => Box::new(()),
    }
}

impl RankReplica for Replica {
    fn hold_parameters(&mut self, from_peers: bool) -> Result<()> {
        match self.optimizer.parameter_shards() {
            Some(states) => {
                let at = (self.step, from_peers);
                self.holding.hold_whole((states, &self.params), &self.comm, at)
            }
            None => Ok(()),
        }
    }

    /// With sharded parameters over whole layers, gathered and written a bucket at a time: no
    /// rank holds the whole model or its optimizer state.
    fn save_state(&mut self, out: &mut dyn std::io::Write, export: &ModelInfo, run: &RunRecord) -> Result<()> {
        self.save_or_join(Some(out), export, run)
    }

    fn join_save(&mut self) -> Result<()> {
        self.save_or_join(None, &ModelInfo::default(), &RunRecord::default())
    }

    /// With sharded parameters over whole layers, gathered a bucket at a time: only the rank
    /// that keeps them holds the whole model.
    fn parameters(&mut self, keep: bool) -> Result<Option<NamedValues>> {
        match self.optimizer.parameter_shards() {
            Some(states) if self.layers.size() == 1 => {
                self.holding.keep_shards(states, &self.params)?;
                states.whole_values(&self.params, &self.comm, (self.step, keep))
            }
            _ => whole_parameters(self, keep),
        }
    }

    /// With sharded parameters, this rank's shards, which only the ranks holding the same shards
    /// hold alike (the replicas across nodes of shards within nodes; none where the shards span
    /// every rank): no rank gathers the whole model to be checked.
    fn replicated(&mut self) -> Result<Replicated> {
        match self.optimizer.parameter_shards() {
            Some(states) => {
                self.holding.keep_shards(states, &self.params)?;
                states.shard_pieces(&self.params)
            }
            None => whole_replicated(&self.held()),
        }
    }

    fn held(&mut self) -> Held<'_> {
        Held {
            params: &self.params,
            optimizer: self.optimizer.held(),
            step: &mut self.step,
            ring: &self.comm,
            layers: &self.layers,
            timeline: &mut self.timeline,
        }
    }

    /// The device the replica computes on.
    fn device(&self) -> &Device {
        &self.device
    }

    /// One synchronous data-parallel step on this rank's `batch`; with gradient merge, the
    /// optimizer steps (and gradients are all-reduced) on every k-th batch only.
    fn train_step(&mut self, batch: &Batch) -> Result<StepReport> {
        let started = Instant::now();
        let step = self.step;
        let comm_before = self.comm.busy_time();
        let lr = self.lr_policy.at(self.gradients.optimizer_step(step));
        self.optimizer.set_learning_rate(lr);
        let (x, y) = batch.tensors(&self.device)?;
        record(&mut self.timeline, || format!("data {step}"), "data", started);

        let forwarding = Instant::now();
        let mut gathers = self.begin_gathers(step)?;
        let blocks = self.model.blocks();
        let cut = match &self.whole {
            Some(whole) if self.comm.world_size() == 1 => whole,
            _ => &self.segments,
        };
        let held = (&self.optimizer, &self.params[..]);
        let forward = segments::forward_around(
            blocks,
            cut,
            x,
            &mut *around(&mut gathers, held, &self.comm, &mut self.timeline),
        )?;
        let held_bytes = forward.held_bytes();
        let (local_loss, upstream) =
            segments::loss_gradient(forward.output(), |out| self.model.loss(self.loss, out, &y))?;
        self.settle_for_trace()?;
        record(&mut self.timeline, || format!("forward {step}"), "forward", forwarding);

        // Backward segment by segment from the last; every completed bucket is handed to the
        // communication thread at once (with gradient merge, only on the merge's last batch).
        let backwarding = Instant::now();
        let params = &self.params;
        let mut gradients = self.gradients.begin(step, &self.comm);
        let backward = segments::backward_around(
            blocks,
            cut,
            (forward, &upstream),
            &mut |range, grads| gradients.add_blocks(params, range, grads),
            &mut *around(&mut gathers, held, &self.comm, &mut self.timeline),
        )?;
        settle_for_trace(&self.timeline, &self.device)?;
        record(
            &mut self.timeline,
            || format!("backward {step}"),
            "backward",
            backwarding,
        );

        // What compute waited for: the parameters' gathers, the gradients' reductions, and a
        // sharded optimizer's all-gathers.
        let mut exposed_comm_time = gathers.map_or(Duration::ZERO, |g| g.waited);
        if let Some(averaged) = gradients.finish(&mut self.timeline)? {
            exposed_comm_time += averaged.exposed;
            exposed_comm_time += self.apply(averaged, step)?;
        }
        let figures = self.gather_figures(local_loss, step)?;
        self.step += 1;
        Ok(StepReport {
            loss: Some(figures.mean_loss),
            loss_spread: Some(figures.loss_spread),
            lr,
            step_time: started.elapsed(),
            comm_time: self.comm.busy_time().saturating_sub(comm_before),
            exposed_comm_time,
            peak_rss_bytes: figures.peak_rss_bytes,
            peak_activation_bytes: held_bytes + backward.recomputed_bytes,
            pipeline: None,
            peak_activations: 0,
            stop_asked: figures.stop,
        })
    }

    /// Scores this rank's share of the held-out rows, a piece at a time, and sums the scores
    /// of all ranks; with sharded parameters block by block, so no rank holds the whole model.
    fn evaluate(&mut self, share: Pieces) -> Result<Option<Score>> {
        let score = match self.optimizer.parameter_shards() {
            Some(states) => {
                self.holding.keep_shards(states, &self.params)?;
                let held = (states, &self.params[..]);
                score_pieces_sharded(
                    &self.model,
                    share,
                    (self.loss, &self.device),
                    held,
                    (&self.comm, self.step),
                )?
            }
            None => score_pieces(&self.model, share, self.loss, &self.device)?,
        };
        sum_over_ranks(&self.comm, score).map(Some)
    }
}

/// The order backward finishes `model`'s `params` in (indices into `params`): the blocks from
/// the last, each block's parameters in their order.
pub fn backward_order(model: &Model, params: &[NamedParam]) -> Vec<usize> {
    (0..model.blocks().len())
        .rev()
        .flat_map(|block| params.iter().enumerate().filter(move |(_, p)| p.block == block))
        .map(|(i, _)| i)
        .collect()
}

/// Sets `params` on every rank of `comm`'s ring to rank 0's values.
pub fn broadcast_parameters(comm: &CommWorker, params: &[NamedParam]) -> Result<()> {
    let flat = params
        .iter()
        .map(|p| p.param.var()?.flatten_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let flat = Tensor::cat(&flat, 0)?;
    let flat = comm.run(move |c| c.broadcast_tensor("broadcast of the initial parameters", flat, 0))?;
    let mut offset = 0;
    for p in params {
        let n = p.param.elem_count();
        p.param.set(&flat.narrow(0, offset, n)?.reshape(p.param.shape())?)?;
        offset += n;
    }
    Ok(())
}

/// See [`Replica::settle_for_trace`]; apart, for where the replica is partly borrowed.
fn settle_for_trace(timeline: &Option<Timeline>, device: &Device) -> Result<()> {
    if timeline.is_some() && device.is_cuda() {
        device.synchronize()?;
    }
    Ok(())
}
