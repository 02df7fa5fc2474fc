//! One rank of a pipeline job, on its device thread: its stage of one replica of the
//! pipeline, the optimizer of the stage's parameters, and the data-parallel ring among the
//! stage's replicas (hybrid data × pipeline parallelism).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use candle_core::{Device, Tensor};

use super::link::{Signals, StageLink};
use super::partition::{balanced, explicit};
use super::schedule::ScheduleKind;
use super::stage::{Chunk, Stage, StageStep};
use crate::collective::rank_figures::{JobFigures, RankFigures};
use crate::collective::tensor_parallel::RingGroup;
use crate::collective::{
    preemption, sum_over_ranks, Averaged, GradientSync, Held, RankReplica, ReplicaOptimizer, StepReport,
};
use crate::config::{JobConfig, LossKind, ScheduleMode};
use crate::data::{Batch, Pieces};
use crate::engines::comm::{CommWorker, Communicator};
use crate::models::parallel::{Alone, Group};
use crate::models::{Block, Logits, Model, NamedParam, Score};
use crate::optim::LrPolicy;
use crate::refusal::Refusal;
use crate::telemetry::metrics::peak_rss_bytes;
use crate::telemetry::timeline::{record, Timeline};

/// A rank's stage, optimizer and links.
pub struct PipelineReplica {
    stage: Stage,
    params: Vec<NamedParam>,
    optimizer: ReplicaOptimizer,
    lr_policy: LrPolicy,
    link: Box<dyn StageLink>,
    /// The ring among the stage's replicas, on its own thread (with NCCL beside it on GPUs).
    data_parallel: CommWorker,
    /// Longest an NCCL collective among the replicas may take.
    collective_timeout: Duration,
    /// All-reduce each bucket of gradients as soon as they are final (else all of them after
    /// the schedule).
    overlap_allreduce: bool,
    /// Averages the stage's gradients over its replicas.
    gradients: GradientSync,
    /// The order the schedule finishes the stage's gradients in ([`Stage::gradient_order`]),
    /// worked out once: the order they are handed over in when not overlapping.
    gradient_order: Vec<usize>,
    device: Device,
    micro_batches: usize,
    /// The loss trained, which also says how evaluation scores.
    loss: LossKind,
    /// How the last virtual stage's outputs train and score (a slice of the vocabulary's
    /// logits where the layers are split).
    logits: Logits,
    holds_loss: bool,
    /// On the ranks holding the loss: whether some rank of the job was asked to stop during the
    /// last step, which this step's backward messages tell the other stages.
    stop_decided: bool,
    /// Batches trained.
    step: usize,
    /// Spans of the schedule, all-reduces and optimizer steps, when tracing.
    timeline: Option<Timeline>,
    /// The ranks that split the stage's layers with this one (tensor parallelism), over a ring
    /// of their own; `None`: the layers are whole.
    layer_ring: Option<Arc<RingGroup>>,
    /// The same group as the layers see it ([`Alone`] where they are whole).
    layers: Group,
}

/// The schedule `job` asks for.
pub fn schedule_kind(job: &JobConfig) -> ScheduleKind {
    let configs = &job.strategy.pipeline_configs;
    match (configs.schedule_mode, configs.virtual_pipeline_stages) {
        (ScheduleMode::FThenB, _) => ScheduleKind::FThenB,
        (ScheduleMode::OneFOneB, v) if v > 1 => ScheduleKind::Interleaved { virtual_stages: v },
        (ScheduleMode::OneFOneB, _) => ScheduleKind::OneFOneB,
    }
}

/// The model's blocks cut into `pp_degree × virtual stages` runs, by parameter count or at
/// the configured boundaries.
fn cut_into_stages(job: &JobConfig, kind: ScheduleKind, model: &Model) -> Result<Vec<Range<usize>>> {
    let configs = &job.strategy.pipeline_configs;
    let p = job.strategy.hybrid_configs.pp_degree;
    let virtual_stages = p * kind.virtual_stages();
    let weights: Vec<usize> = model
        .blocks()
        .iter()
        .map(|b| b.parameters().iter().map(|(_, v)| v.elem_count()).sum())
        .collect();
    // The config was valid without the model; a cut the model's blocks cannot take is still
    // the user's input, which no restart changes.
    if configs.stage_boundaries.is_empty() {
        balanced(&weights, virtual_stages).with_context(|| {
            format!(
                "strategy.hybrid_configs.pp_degree × strategy.pipeline_configs.virtual_pipeline_stages = \
                 {p} × {}: cutting the model into stages",
                kind.virtual_stages()
            )
        })
    } else {
        explicit(&configs.stage_boundaries, weights.len(), virtual_stages).with_context(|| {
            format!(
                "strategy.pipeline_configs.stage_boundaries = {:?}: cutting the model into stages",
                configs.stage_boundaries
            )
        })
    }
    .map_err(Refusal::wrap)
}

/// The blocks whose outputs are kept for backward when the job recomputes activations
/// (indices in the whole model), `None` when it does not.
fn recompute_checkpoints(job: &JobConfig, model: &Model) -> Result<Option<Vec<usize>>> {
    if !job.strategy.recompute {
        return Ok(None);
    }
    let names: Vec<&str> = model.blocks().iter().map(|b| b.name()).collect();
    Ok(Some(job.strategy.recompute_configs.resolve(&names)?))
}

/// The chunks of `stage` (the runs `k` of `cuts` with `k mod p = stage`), taken from the
/// model's `blocks`, each cut for backward as the job asks: around the recomputation
/// `checkpoints`, per block when all-reduces overlap backward, else whole.
fn stage_chunks(
    blocks: Vec<Box<dyn Block>>,
    cuts: Vec<Range<usize>>,
    p: usize,
    stage: usize,
    checkpoints: Option<&[usize]>,
    overlap_allreduce: bool,
) -> Vec<Chunk> {
    let mut blocks: Vec<Option<Box<dyn Block>>> = blocks.into_iter().map(Some).collect();
    cuts.into_iter()
        .enumerate()
        .filter(|(k, _)| k % p == stage)
        .map(|(_, range)| {
            let chunk_blocks = range.clone().filter_map(|i| blocks[i].take()).collect();
            match checkpoints {
                None if overlap_allreduce => Chunk::per_block(chunk_blocks),
                None => Chunk::new(chunk_blocks),
                Some(all) => {
                    let within: Vec<usize> = all
                        .iter()
                        .filter(|c| range.contains(c))
                        .map(|c| c - range.start)
                        .collect();
                    Chunk::recomputed(chunk_blocks, &within)
                }
            }
        })
        .collect()
}

impl PipelineReplica {
    /// Stage `stage` of `model` (every rank builds the whole model from the seed, cuts it into
    /// stages as a whole, splits it over its layer group and keeps its chunks), linked to its
    /// neighbours by `link`, to its replicas by `data_parallel` and to the ranks splitting its
    /// layers by `layer_ring` where they are split, in a run of `steps` batches.
    pub fn new(
        job: &JobConfig,
        model: Model,
        (stage, link): (usize, Box<dyn StageLink>),
        (data_parallel, layer_ring): (Communicator, Option<Arc<RingGroup>>),
        device: Device,
        steps: usize,
    ) -> Result<Self> {
        let kind = schedule_kind(job);
        let configs = &job.strategy.pipeline_configs;
        let p = job.strategy.hybrid_configs.pp_degree;
        let virtual_stages = p * kind.virtual_stages();
        // Cut by the whole blocks' sizes: every part of a stage holds the same blocks, whatever
        // its share of an unevenly split vocabulary.
        let cuts = cut_into_stages(job, kind, &model)?;
        let dp = job.strategy.hybrid_configs.replicas();
        let overlap_allreduce = dp > 1 && !configs.pp_allreduce_in_optimize;
        let checkpoints = recompute_checkpoints(job, &model)?;
        let layers: Group = match &layer_ring {
            Some(ring) => ring.clone(),
            None => Arc::new(Alone),
        };
        let (blocks, logits) = model
            .split(&layers)
            .context("splitting the model over its layer group (strategy.hybrid_configs.mp_degree)")?
            .into_parts();
        let chunks = stage_chunks(blocks, cuts, p, stage, checkpoints.as_deref(), overlap_allreduce);
        let stage = Stage::new(stage, p, chunks, kind, configs.accumulate_steps)?;
        let params = stage.parameters();
        let gradient_order = stage.gradient_order();
        let gradients = GradientSync::new(job, &params, &gradient_order, &device)?;
        let lr_policy = LrPolicy::new(&job.train, dp, gradients.optimizer_step(steps));
        let data_parallel = CommWorker::spawn_on(data_parallel, &device, job.fault_tolerance.timeout())?;
        let optimizer = ReplicaOptimizer::new(job, gradients.plan(), &params, &data_parallel, lr_policy.at(0))?;
        Ok(Self {
            holds_loss: (virtual_stages - 1) % p == stage.index(),
            stop_decided: false,
            stage,
            params,
            optimizer,
            lr_policy,
            link,
            data_parallel,
            collective_timeout: job.fault_tolerance.timeout(),
            overlap_allreduce,
            gradients,
            gradient_order,
            device,
            micro_batches: configs.accumulate_steps,
            loss: job.train.resolved_loss()?,
            logits,
            step: 0,
            timeline: None,
            layer_ring,
            layers,
        })
    }

    /// Goes on over new links to the neighbour stages, a new ring among the stage's replicas
    /// and the layer group's `layer_comm` (a rollback rebuilt them): the batches merged so far
    /// are dropped; the state comes from a snapshot next.
    pub fn relink(
        &mut self,
        link: Box<dyn StageLink>,
        data_parallel: Communicator,
        layer_comm: Option<CommWorker>,
    ) -> Result<()> {
        match (&self.layer_ring, layer_comm) {
            (Some(ring), Some(comm)) => ring.relink(comm),
            (None, None) => {}
            _ => anyhow::bail!("a relink changed whether the layers are split"),
        }
        self.link = link;
        self.data_parallel = CommWorker::spawn_on(data_parallel, &self.device, self.collective_timeout)?;
        self.optimizer
            .recut(self.gradients.plan(), &self.params, &self.data_parallel)?;
        self.gradients.clear();
        self.stop_decided = false;
        Ok(())
    }

    /// `batch` cut into the step's micro-batches: inputs and labels.
    fn micro_batches(&self, batch: &Batch) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let m = self.micro_batches;
        let rows = batch.rows();
        anyhow::ensure!(
            rows.is_multiple_of(m) && rows > 0,
            "a batch of {rows} rows does not split into {m} micro-batches"
        );
        let (x, y) = batch.tensors(&self.device)?;
        let size = rows / m;
        let inputs = (0..m)
            .map(|i| x.narrow(0, i * size, size))
            .collect::<candle_core::Result<_>>()?;
        let labels = (0..m)
            .map(|i| y.narrow(0, i * size, size))
            .collect::<candle_core::Result<_>>()?;
        Ok((inputs, labels))
    }

    /// Preemption in two steps, on the step's own messages: a rank asked to stop says so
    /// forward, so the ranks holding the loss hear every stage of their replica and agree over
    /// the replicas in the gather of the losses; the next step's backward messages tell every
    /// stage, and all stop after that step. Returns whether this rank was asked, and whether
    /// the stop it tells backward was decided.
    fn signal_stop(&mut self) -> (bool, bool) {
        let asked_here = preemption::asked();
        let deciding = std::mem::take(&mut self.stop_decided);
        self.link.signal(Signals {
            forward: asked_here,
            backward: deciding,
        });
        (asked_here, deciding)
    }

    /// Runs the stage's schedule over the micro-batches and averages the gradients over the
    /// stage's replicas: overlapping, each bucket goes to the communication thread as soon as
    /// its last backward is done; otherwise the whole stage's go after the schedule, in the
    /// same order. No average on a batch merged into later ones.
    fn run_schedule(
        &mut self,
        at: usize,
        inputs: &[Tensor],
        labels: &[Tensor],
    ) -> Result<(StageStep, Option<Averaged>)> {
        let (kind, logits) = (self.loss, &self.logits);
        let loss = |i: usize, out: &Tensor| logits.loss(kind, out, &labels[i]);
        let overlap = self.overlap_allreduce;
        let mut gradients = self.gradients.begin(at, &self.data_parallel);
        let step = self.stage.step(
            self.link.as_mut(),
            inputs,
            &loss,
            &mut self.timeline,
            &mut |first, grads| {
                if overlap {
                    gradients.stop_if_failed()?;
                    for (index, grad) in (first..).zip(grads) {
                        gradients.add(index, grad)?;
                    }
                }
                Ok(())
            },
        )?;
        if !overlap {
            for &index in &self.gradient_order {
                gradients.add(index, &step.gradients[index])?;
            }
        }
        let averaged = gradients.finish(&mut self.timeline)?;
        Ok((step, averaged))
    }

    /// The job's figures of step `at`: only the ranks holding the loss gather them over the
    /// replicas (the other stages' rings carry no extra message), and keep the stop they agreed
    /// on for the next step to tell.
    fn gather_figures(&mut self, at: usize, loss: Option<f32>, stop: bool) -> Result<JobFigures> {
        let mine = RankFigures {
            loss: loss.unwrap_or(0.0),
            peak_rss_bytes: peak_rss_bytes(),
            stop,
        };
        if !self.holds_loss {
            return Ok(JobFigures::of(&[mine]));
        }
        let figures = self
            .data_parallel
            .run(move |c| mine.gather(c, &format!("gather of the losses of step {at}")))?;
        self.stop_decided = figures.stop;
        Ok(figures)
    }
}

impl RankReplica for PipelineReplica {
    fn held(&mut self) -> Held<'_> {
        Held {
            params: &self.params,
            optimizer: self.optimizer.held(),
            step: &mut self.step,
            ring: &self.data_parallel,
            layers: &self.layers,
            timeline: &mut self.timeline,
        }
    }

    /// The device the stage computes on.
    fn device(&self) -> &Device {
        &self.device
    }

    /// One step on this replica's part of the global batch; with gradient merge, the optimizer
    /// steps (and gradients are all-reduced) on every k-th batch only.
    fn train_step(&mut self, batch: &Batch) -> Result<StepReport> {
        let started = Instant::now();
        let at = self.step;
        let lr = self.lr_policy.at(self.gradients.optimizer_step(at));
        self.optimizer.set_learning_rate(lr);
        let (inputs, labels) = self.micro_batches(batch)?;
        let comm_before = self.data_parallel.busy_time();
        let (asked_here, deciding) = self.signal_stop();
        let (step, averaged) = self.run_schedule(at, &inputs, &labels)?;
        let mut exposed = averaged.as_ref().map_or(Duration::ZERO, |a| a.exposed);
        if let Some(averaged) = averaged {
            let stepping = Instant::now();
            // No clipping: a pipeline's global norm would span every stage.
            let rings = (&self.data_parallel, &self.layers);
            exposed += self
                .optimizer
                .step(&self.params, averaged.grads, (0.0, at), rings, &mut self.timeline)?;
            record(&mut self.timeline, || format!("optimizer {at}"), "optimizer", stepping);
        }
        let heard = self.link.heard();
        let figures = self.gather_figures(at, step.loss, asked_here || heard.forward)?;
        self.step += 1;
        Ok(StepReport {
            loss: self.holds_loss.then_some(figures.mean_loss),
            loss_spread: self.holds_loss.then_some(figures.loss_spread),
            peak_rss_bytes: figures.peak_rss_bytes,
            lr,
            step_time: started.elapsed(),
            comm_time: self.data_parallel.busy_time().saturating_sub(comm_before),
            exposed_comm_time: exposed,
            peak_activations: step.peak_activations,
            peak_activation_bytes: step.peak_activation_bytes,
            pipeline: Some((step.waiting, step.elapsed)),
            stop_asked: deciding || heard.backward,
        })
    }

    /// The score of `share` (this replica's part of the held-out set), summed over replicas,
    /// on the ranks holding the last virtual stage. The rows go through the pipeline a piece at
    /// a time, each piece cut into up to `accumulate_steps` micro-batches of near-equal size;
    /// every stage of a replica reads the same share.
    fn evaluate(&mut self, share: Pieces) -> Result<Option<Score>> {
        let mut score = Score::default();
        for piece in share {
            let piece = piece?;
            let rows = piece.rows();
            let parts = self.micro_batches.min(rows);
            let tensors = (0..parts)
                .map(|i| {
                    piece
                        .piece(i * rows / parts..(i + 1) * rows / parts)
                        .tensors(&self.device)
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            let inputs: Vec<Tensor> = tensors.iter().map(|(x, _)| x.clone()).collect();
            let outputs = self.stage.forward_only(self.link.as_mut(), parts, &inputs)?;
            for (out, (_, y)) in outputs.iter().zip(&tensors) {
                score += self.logits.score(self.loss, out, y)?;
            }
        }
        if !self.holds_loss {
            return Ok(None);
        }
        sum_over_ranks(&self.data_parallel, score).map(Some)
    }
}
