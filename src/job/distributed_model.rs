//! A model whose gradients are averaged over a [`ProcessGroup`] — `DDP(model)` or
//! `fleet.distributed_model`: the program's loop owns the data, the loss and the optimizer;
//! backward hands each block's gradients to their fusion buckets as soon as they are done, and
//! the buckets are all-reduced on the communication thread while backward goes on — the
//! machinery of a [`super::TrainingJob`]'s replicas (`strategy.fuse_grad_size_in_MB`,
//! `fp16_allreduce`, gradient merge).

use anyhow::{Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use super::ProcessGroup;
use crate::collective::{backward_order, broadcast_parameters, GradientSync};
use crate::engines::compute::segments::{self, Forward, Segments};
use crate::models::{Model, NamedParam};

/// A model replica trained in lockstep with the other ranks of its group.
pub struct DistributedModel {
    model: Model,
    params: Vec<NamedParam>,
    gradients: GradientSync,
    /// One segment per block, so that each block's gradients leave as soon as they are done.
    segments: Segments,
    group: ProcessGroup,
    /// Backward passes done.
    batches: usize,
}

/// The output of a forward pass, holding what its backward needs.
pub struct Output {
    forward: Forward,
    /// The output, cut from the model's graph: the loss is taken of it, and backward starts
    /// from the loss's gradient with respect to it.
    seed: Var,
}

impl Output {
    /// The model's output: compute the loss from it.
    pub fn tensor(&self) -> &Tensor {
        self.seed.as_tensor()
    }
}

impl DistributedModel {
    /// Wraps `model` for `group`: every rank starts from rank 0's parameters.
    pub fn new(model: Model, group: ProcessGroup) -> Result<Self> {
        anyhow::ensure!(
            !group.config().strategy.sharding,
            "strategy.sharding: a program's own loop steps its own optimizer on whole gradients; sharded \
             states need the runtime's optimizer (`flotilla train`)"
        );
        anyhow::ensure!(
            group.config().mp_degree() == 1,
            "strategy.hybrid_configs.mp_degree: a program's own loop trains its own whole model; split layers need \
             the runtime's models (`flotilla train`)"
        );
        let params = model.parameters();
        let device = params
            .first()
            .context("the model has no parameters")?
            .param
            .device()
            .clone();
        let gradients = GradientSync::new(group.config(), &params, &backward_order(&model, &params), &device)?;
        group.explained(broadcast_parameters(group.comm(), &params))?;
        let segments = Segments::per_block(model.blocks().len());
        Ok(Self {
            model,
            params,
            gradients,
            segments,
            group,
            batches: 0,
        })
    }

    /// Forward of this rank's inputs `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Output> {
        let forward = segments::forward(self.model.blocks(), &self.segments, x.clone())?;
        let seed = Var::from_tensor(&forward.output().detach())?;
        Ok(Output { forward, seed })
    }

    /// Backward of `loss`, a scalar computed from `output`'s tensor, with the gradients averaged
    /// over the ranks: every rank gets the same, the gradient of the mean of the ranks' losses.
    /// `None` while gradient merge (`strategy.gradient_merge`) gathers batches: step the
    /// optimizer only when gradients come back.
    pub fn backward(&mut self, output: Output, loss: &Tensor) -> Result<Option<GradStore>> {
        let upstream = loss
            .backward()?
            .get(output.seed.as_tensor())
            .context("the loss does not depend on the model's output")?
            .clone();
        let params = &self.params;
        let mut gradients = self.gradients.begin(self.batches, self.group.comm());
        let backward = segments::backward(
            self.model.blocks(),
            &self.segments,
            output.forward,
            &upstream,
            &mut |range, grads| gradients.add_blocks(params, range, grads),
        );
        let averaged = backward.and_then(|_| gradients.finish(&mut None));
        self.batches += 1;
        let averaged = self.group.explained(averaged)?;
        averaged.map(|averaged| averaged.grads.into_whole()).transpose()
    }

    /// The model's parameters, for the program's optimizer.
    pub fn parameters(&self) -> Result<Vec<Var>> {
        Ok(self
            .params
            .iter()
            .map(|p| p.param.var())
            .collect::<candle_core::Result<_>>()?)
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Leaves the group once every rank is done ([`ProcessGroup::finish`]); gives the model
    /// back.
    pub fn finish(self) -> Result<Model> {
        self.group.finish()?;
        Ok(self.model)
    }
}
