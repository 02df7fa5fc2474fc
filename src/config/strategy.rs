//! `[strategy]`: Paddle `DistributedStrategy`-style knobs of collective data parallelism and of
//! the parameter server's update mode, plus the list of Paddle strategies that are recognised
//! but not built yet.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::amp::AmpConfigs;
use super::memory::{GradientMergeConfigs, RecomputeConfigs};
use super::pipeline::{HybridConfigs, PipelineConfigs};
use super::sharding::{ShardingConfigs, ShardingStage};
use super::sparse_tables::SparseTableConfig;
use super::FieldError;

/// How a job spreads over its ranks: the one value the runtime decides by, resolved from the
/// config ([`super::JobConfig::resolved_strategy`]) instead of its flags being asked one by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Every rank holds the whole model; gradients are all-reduced.
    DataParallel,
    /// The model is cut into stages (`strategy.pipeline`), with data parallelism across the
    /// stage groups.
    Pipeline,
    /// Shards hold the parameters (`cluster.server_num` > 0); trainers pull and push.
    ParameterServer,
}

/// `[strategy]` section: how gradients are synchronised between data-parallel replicas.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct DistributedStrategy {
    /// Size of one gradient fusion bucket in MiB: gradients are all-reduced in buckets of about
    /// this size, trading message count against overlap. TOML key `fuse_grad_size_in_MB`
    /// (Paddle's name; also `FLAGS_fuse_parameter_groups_size`).
    #[serde(rename = "fuse_grad_size_in_MB")]
    pub fuse_grad_size_in_mb: f64,
    /// Collective and pipeline data parallelism on CPU rings: gradient buckets travel as
    /// bfloat16, half the bytes, and are summed in f32 on arrival; each averaged gradient is
    /// then within 2⁻⁸ of the sum of the replicas' magnitudes of the exact mean. Paddle's key
    /// (which casts to fp16; bfloat16 keeps f32's range, so no loss scaling is needed). NCCL
    /// jobs carry f32 and refuse it.
    pub fp16_allreduce: bool,
    /// Steps between cross-replica parameter checksum comparisons, which catch replicas that
    /// silently diverged; 0 disables the check.
    pub check_every: usize,
    /// Parameter server only: `false` is sync mode (a shard applies step t once every
    /// trainer's gradients of step t have arrived, so the result equals one process training the
    /// global batch); `true` is async mode (each push applied on arrival, trainers never wait for
    /// each other), or geo mode when `a_sync_configs.k_steps > 0`.
    pub a_sync: bool,
    /// Parameter server only: settings of the asynchronous modes.
    pub a_sync_configs: AsyncConfigs,
    /// Parameter server only: the row policy of sparse tables, by table name
    /// (`[strategy.sparse_table_configs.<table>]`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub sparse_table_configs: BTreeMap<String, SparseTableConfig>,
    /// Parameter server only: steps per pass (Paddle's "day"). At the end of each pass the
    /// shards shrink the tables that have a policy: counts decay, rows scored below
    /// `delete_threshold` or unseen for `delete_after_unseen_days` passes go. 0: no passes.
    pub sparse_pass_steps: usize,
    /// Pipeline parallelism: the model's blocks cut into `hybrid_configs.pp_degree` stages,
    /// micro-batches streamed through them.
    pub pipeline: bool,
    /// Schedule and micro-batching of the pipeline.
    pub pipeline_configs: PipelineConfigs,
    /// Pipeline stages × data-parallel replicas of the pipeline, and the sharding degree.
    pub hybrid_configs: HybridConfigs,
    /// Sharded states (ZeRO): the data-parallel ranks split the optimizer's states, with
    /// `sharding_configs.stage = 2` the averaged gradients and with 3 the parameters too,
    /// instead of each holding them all. Stages 1 and 2 end each step with the same parameters
    /// on every rank, bit for bit those of plain data parallelism on an f32 wire without
    /// clipping (the global norm is summed from the shards, in another order); stage 3 within
    /// 1e-5 of them (its buckets are cut by block, so its sums run in another order).
    pub sharding: bool,
    /// What sharding splits.
    pub sharding_configs: ShardingConfigs,
    /// Activation recomputation: only the outputs of `recompute_configs.checkpoints` are kept
    /// from forward to backward; the rest is recomputed in backward.
    pub recompute: bool,
    /// Which activations recomputation keeps.
    pub recompute_configs: RecomputeConfigs,
    /// Gradients of `gradient_merge_configs.k_steps` batches are accumulated (and all-reduced
    /// once) before one optimizer step: a larger batch in the memory of a smaller one.
    pub gradient_merge: bool,
    /// How many batches merge, and whether their gradients are averaged or summed.
    pub gradient_merge_configs: GradientMergeConfigs,
    /// Collective data parallelism: all-reduce in two levels — reduce-scatter inside each
    /// node, all-reduce across nodes, all-gather inside — so that a node's ranks send
    /// `nproc_per_node` times less over the network. Unset: whenever the ranks' hosts hold equal
    /// runs of several ranks; `false`: always the flat ring; `true`: always (in one process or
    /// on one host, over the config's `cluster.nnodes` × `nproc_per_node`). Its sums are
    /// associated differently, so it differs from the flat ring in the last bits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub use_hierarchical_allreduce: Option<bool>,
    /// Mixed precision: on CPUs with AVX-512 BF16 the dense layers' products take bfloat16
    /// operands and sum in f32 (forward and backward); parameters, optimizer and checkpoints
    /// stay f32.
    pub amp: bool,
    /// How mixed precision computes (Paddle's keys).
    pub amp_configs: AmpConfigs,
}

/// `[strategy.a_sync_configs]`, Paddle's name for the asynchronous parameter-server settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AsyncConfigs {
    /// Geo mode when `> 0` (with `a_sync = true`): trainers train on local copies and send the
    /// parameter deltas every `k_steps` steps, trading staleness for far fewer messages.
    pub k_steps: usize,
    /// Async mode: pushes a trainer may have waiting to be sent while it trains on; one more
    /// waits for room (Paddle's name and default).
    pub send_queue_size: usize,
    /// Async mode: up to this many waiting pushes go out as one, the gradients of each row
    /// summed (for SGD the same as applying them one after the other; Paddle's name; 1 merges
    /// nothing).
    pub max_merge_var_num: usize,
    /// Async mode: the pull of step t waits until the shards applied this trainer's pushes of
    /// the steps before `t - max_staleness` (as Persia bounds staleness). At least 1: the pull
    /// of step t runs while step t - 1 computes.
    pub max_staleness: usize,
}

impl Default for AsyncConfigs {
    fn default() -> Self {
        Self {
            k_steps: 0,
            send_queue_size: 16,
            max_merge_var_num: 1,
            max_staleness: 16,
        }
    }
}

/// How parameter-server shards apply trainers' updates, from `a_sync` and `k_steps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PsMode {
    /// Step t is applied once every trainer's push of step t is in; deterministic.
    Sync,
    /// Each push is applied on arrival.
    Async,
    /// Trainers send parameter deltas every `k_steps` local steps.
    Geo {
        /// Local steps between delta pushes.
        k_steps: usize,
    },
}

impl PsMode {
    /// The mode's name in summaries and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Sync => "sync",
            Self::Async => "async",
            Self::Geo { .. } => "geo",
        }
    }
}

impl Default for DistributedStrategy {
    fn default() -> Self {
        Self {
            fuse_grad_size_in_mb: 32.0,
            fp16_allreduce: false,
            check_every: 10,
            a_sync: false,
            a_sync_configs: AsyncConfigs::default(),
            sparse_table_configs: BTreeMap::new(),
            sparse_pass_steps: 0,
            pipeline: false,
            pipeline_configs: PipelineConfigs::default(),
            hybrid_configs: HybridConfigs::default(),
            sharding: false,
            sharding_configs: ShardingConfigs::default(),
            recompute: false,
            recompute_configs: RecomputeConfigs::default(),
            gradient_merge: false,
            gradient_merge_configs: GradientMergeConfigs::default(),
            use_hierarchical_allreduce: None,
            amp: false,
            amp_configs: AmpConfigs::default(),
        }
    }
}

impl DistributedStrategy {
    /// Fusion bucket size in bytes (at least 1), rounded down.
    pub fn fuse_grad_size_bytes(&self) -> usize {
        // Float-to-int `as` saturates, and validation keeps the value positive and finite.
        ((self.fuse_grad_size_in_mb * (1u64 << 20) as f64) as usize).max(1)
    }

    /// What the data-parallel ranks split between them, with `strategy.sharding` (the stage
    /// was checked when the config loaded).
    pub fn sharding_stage(&self) -> Option<ShardingStage> {
        match (self.sharding, self.sharding_configs.stage) {
            (false, _) => None,
            (true, 1) => Some(ShardingStage::OptimizerStates),
            (true, 2) => Some(ShardingStage::Gradients),
            (true, _) => Some(ShardingStage::Parameters),
        }
    }

    /// The parameter-server update mode these keys select.
    pub fn ps_mode(&self) -> PsMode {
        match (self.a_sync, self.a_sync_configs.k_steps) {
            (false, _) => PsMode::Sync,
            (true, 0) => PsMode::Async,
            (true, k_steps) => PsMode::Geo { k_steps },
        }
    }

    /// Batches per optimizer step: `gradient_merge_configs.k_steps` with gradient merge, else 1.
    pub fn merge_steps(&self) -> usize {
        if self.gradient_merge {
            self.gradient_merge_configs.k_steps
        } else {
            1
        }
    }

    /// Range checks of the section.
    pub(crate) fn check(&self) -> Result<(), FieldError> {
        super::memory::check(
            self.recompute,
            &self.recompute_configs,
            self.gradient_merge,
            &self.gradient_merge_configs,
        )?;
        if self.a_sync_configs.k_steps > 0 && !self.a_sync {
            return Err(FieldError::new(
                "strategy.a_sync_configs.k_steps",
                format!(
                    "k_steps = {} selects geo mode, which is asynchronous: set strategy.a_sync = true too",
                    self.a_sync_configs.k_steps
                ),
            ));
        }
        let configs = &self.a_sync_configs;
        for (key, value, why) in [
            (
                "send_queue_size",
                configs.send_queue_size,
                "a push must have room to wait",
            ),
            ("max_merge_var_num", configs.max_merge_var_num, "1 merges nothing"),
            (
                "max_staleness",
                configs.max_staleness,
                "the pull of step t runs while step t - 1 computes",
            ),
        ] {
            if value == 0 {
                return Err(FieldError::new(
                    format!("strategy.a_sync_configs.{key}"),
                    format!("must be at least 1 ({why})"),
                ));
            }
        }
        let size = self.fuse_grad_size_in_mb;
        if !(size.is_finite() && size > 0.0) {
            return Err(FieldError::new(
                "strategy.fuse_grad_size_in_MB",
                format!("must be a positive number of MiB, got {size}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{err_text, load_str, load_with};

    #[test]
    fn async_queue_merge_and_staleness_are_at_least_one() {
        let msg = err_text(load_with("", &[], &["strategy.a_sync_configs.max_staleness=0"]));
        assert_eq!(
            msg,
            "--set: strategy.a_sync_configs.max_staleness: must be at least 1 (the pull of step t runs while step t - 1 computes)"
        );
        let configs = load_str("[strategy.a_sync_configs]\nsend_queue_size = 4\n")
            .unwrap()
            .strategy
            .a_sync_configs;
        assert_eq!(
            (
                configs.send_queue_size,
                configs.max_merge_var_num,
                configs.max_staleness
            ),
            (4, 1, 16)
        );
    }

    #[test]
    fn fuse_size_must_be_positive() {
        let msg = err_text(load_str("[strategy]\nfuse_grad_size_in_MB = 0\n"));
        assert!(
            msg.starts_with("config.toml: strategy.fuse_grad_size_in_MB: must be a positive"),
            "{msg}"
        );
        let msg = err_text(load_str("[strategy]\nfuse_grad_size_in_MB = nan\n"));
        assert!(msg.contains("strategy.fuse_grad_size_in_MB"), "{msg}");
        let config = load_str("[strategy]\nfuse_grad_size_in_MB = 0.5\n").unwrap();
        assert_eq!(config.strategy.fuse_grad_size_bytes(), 512 * 1024);
    }
}
