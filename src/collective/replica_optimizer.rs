//! A rank's optimizer over what it holds, whatever the strategy: the whole parameters, or its
//! shards of them (`strategy.sharding`), with the step that goes with each. Shared by the
//! data-parallel replica and the pipeline stage.

use std::time::Duration;

use anyhow::Result;

use super::rank_replica::HeldOptimizer;
use super::tensor_parallel::clip_split_by_global_norm;
use super::{AveragedGradients, BucketPlan, ShardedStates};
use crate::config::{JobConfig, ShardingStage};
use crate::engines::comm::CommWorker;
use crate::models::parallel::Group;
use crate::models::NamedParam;
use crate::optim::Optimizer;
use crate::telemetry::timeline::Timeline;

/// A replica's optimizer: over the whole parameters, or over this rank's shards of them.
pub enum ReplicaOptimizer {
    /// Every parameter's state on every rank.
    Whole(Optimizer),
    /// This rank's shard of each bucket's state, on the data-parallel ring.
    Sharded(Box<ShardedStates>),
}

impl ReplicaOptimizer {
    /// `job`'s optimizer of `params` (bucketed as `plan` says) at learning rate `lr`, sharded
    /// over `comm`'s ring where the job asks.
    pub fn new(job: &JobConfig, plan: &BucketPlan, params: &[NamedParam], comm: &CommWorker, lr: f64) -> Result<Self> {
        Ok(match job.strategy.sharding_stage() {
            None => {
                let vars = params
                    .iter()
                    .map(|p| p.param.var())
                    .collect::<candle_core::Result<_>>()?;
                Self::Whole(Optimizer::new(&job.train, vars, lr)?)
            }
            Some(stage) => Self::Sharded(Box::new(ShardedStates::new(
                (&job.train, stage),
                plan,
                params,
                comm,
                lr,
            )?)),
        })
    }

    /// The shards cut anew for the ring `comm` (a rollback rebuilt it, perhaps with another
    /// number of ranks); a whole optimizer stays as it is. The state comes from a snapshot next.
    pub fn recut(&mut self, plan: &BucketPlan, params: &[NamedParam], comm: &CommWorker) -> Result<()> {
        if let Self::Sharded(states) = self {
            **states = states.recut(plan, params, comm)?;
        }
        Ok(())
    }

    /// Sets the learning rate of the next step.
    pub fn set_learning_rate(&mut self, lr: f64) {
        match self {
            Self::Whole(optimizer) => optimizer.set_learning_rate(lr),
            Self::Sharded(states) => states.set_learning_rate(lr),
        }
    }

    /// The shards of the parameters themselves, where they are sharded (stage 3).
    pub fn parameter_shards(&self) -> Option<&ShardedStates> {
        match self {
            Self::Sharded(states) if states.stage() == ShardingStage::Parameters => Some(states),
            _ => None,
        }
    }

    /// The optimizer as a checkpoint takes and restores it.
    pub fn held(&mut self) -> HeldOptimizer<'_> {
        match self {
            Self::Whole(optimizer) => HeldOptimizer::Whole(optimizer),
            Self::Sharded(states) => HeldOptimizer::Sharded(states),
        }
    }

    /// The step of batch `step` on the `averaged` gradients of `params`, clipped to the global
    /// norm `clip_norm` where positive (split parameters' parts summed over `layers`); a
    /// sharded one then all-gathers the parameters over `comm` and answers the time it waited
    /// for them.
    pub fn step(
        &mut self,
        params: &[NamedParam],
        averaged: AveragedGradients,
        (clip_norm, step): (f64, usize),
        (comm, layers): (&CommWorker, &Group),
        timeline: &mut Option<Timeline>,
    ) -> Result<Duration> {
        match self {
            Self::Whole(optimizer) => {
                let mut grads = averaged.into_whole()?;
                if clip_norm > 0.0 {
                    clip_split_by_global_norm(&mut grads, params, layers, clip_norm)?;
                }
                optimizer.step(&grads)?;
                Ok(Duration::ZERO)
            }
            Self::Sharded(states) => states.step(params, averaged, (clip_norm, step), (comm, layers), timeline),
        }
    }
}
