//! `strategy.sharding` and `[strategy.sharding_configs]` (Paddle's names; ZeRO's stages): the
//! data-parallel ranks split the optimizer's states (stage 1), the averaged gradients too
//! (stage 2) and the parameters too (stage 3) instead of each holding all of them — all the
//! ranks, or (`hybrid_configs`' `sharding_degree = nproc_per_node`, `dp_degree = nnodes`) each
//! node's ranks, the nodes holding replicas of the same shards.

use serde::{Deserialize, Serialize};

use super::{FieldError, JobConfig};

/// `[strategy.sharding_configs]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ShardingConfigs {
    /// What the data-parallel ranks split between them: 1, the optimizer's states (each rank
    /// updates its shard of the parameters, then all-gathers them); 2, the averaged gradients
    /// too (each bucket is reduce-scattered instead of all-reduced, half the traffic, and a rank
    /// keeps only its shard); 3, the parameters too (each block's are all-gathered just before
    /// its forward and again before its backward, which recomputes the block's forward, and
    /// released after; between steps a rank holds only its shards). Stage 3 is built for
    /// collective data parallelism, not yet inside pipeline stages.
    pub stage: u8,
}

impl Default for ShardingConfigs {
    fn default() -> Self {
        Self { stage: 1 }
    }
}

/// What a sharded job splits over its data-parallel ranks (`sharding_configs.stage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardingStage {
    /// Stage 1: the optimizer's states; gradients are all-reduced whole.
    OptimizerStates,
    /// Stage 2: the averaged gradients as well, reduce-scattered.
    Gradients,
    /// Stage 3: the parameters as well, gathered a block at a time where they are used.
    Parameters,
}

impl ShardingStage {
    /// The stage's number, as `sharding_configs.stage` spells it.
    pub fn number(self) -> u8 {
        match self {
            Self::OptimizerStates => 1,
            Self::Gradients => 2,
            Self::Parameters => 3,
        }
    }

    /// Whether each bucket of gradients is reduce-scattered (this rank keeps its shard alone).
    pub fn scatters_gradients(self) -> bool {
        self != Self::OptimizerStates
    }
}

impl JobConfig {
    /// Whether sharded states split each node's ranks alone, every node holding the same shards
    /// (`hybrid_configs.sharding_degree` = `cluster.nproc_per_node` of several nodes).
    pub fn shards_within_nodes(&self) -> bool {
        let split = self.strategy.pipeline || self.mp_degree() > 1;
        self.strategy.sharding
            && !split
            && (2..self.world_size()).contains(&self.strategy.hybrid_configs.sharding_degree)
    }

    /// Whether the model is made released, each rank drawing only its shard of the initial
    /// parameters (sharded parameters of layers that are not split: splitting cuts the whole
    /// values).
    pub fn defers_parameters(&self) -> bool {
        self.strategy.sharding_stage() == Some(ShardingStage::Parameters) && self.mp_degree() == 1
    }

    /// The ranks among which each sharded state is split: the world, each node's ranks, every
    /// data-parallel rank of a layer part, or every replica of a pipeline stage's part.
    pub fn sharding_ranks(&self) -> usize {
        if self.strategy.pipeline {
            self.strategy.hybrid_configs.replicas()
        } else if self.shards_within_nodes() {
            self.strategy.hybrid_configs.sharding_degree
        } else {
            self.data_parallel_replicas()
        }
    }

    /// Whether the all-reduce runs on two levels of rings: `strategy.use_hierarchical_allreduce`,
    /// or `true` where shards stay within the nodes (they are those levels' node rings).
    pub fn hierarchical_setting(&self) -> Option<bool> {
        match self.shards_within_nodes() {
            true => Some(true),
            false => self.strategy.use_hierarchical_allreduce,
        }
    }
}

/// Checks the sharding keys against the rest of the job: collective data parallelism, stages 1
/// and 2, sharded over every rank (`hybrid_configs.sharding_degree` the world size, or left at 1)
/// or inside each node of several (`sharding_degree = nproc_per_node`, `dp_degree = nnodes`).
pub(super) fn check_sharding(config: &JobConfig) -> Result<(), FieldError> {
    let strategy = &config.strategy;
    let degree = strategy.hybrid_configs.sharding_degree;
    if !strategy.sharding {
        if strategy.sharding_configs != ShardingConfigs::default() || degree > 1 {
            return Err(FieldError::new(
                "strategy.sharding",
                "sharding_configs / hybrid_configs.sharding_degree are set but strategy.sharding is false: \
                 set it to true",
            ));
        }
        return Ok(());
    }
    if config.cluster.is_parameter_server() {
        return Err(FieldError::new(
            "strategy.sharding",
            "splits the optimizer states of collective training; a parameter-server job (cluster.server_num > 0) \
             keeps them on its servers already",
        ));
    }
    check_stage(config)?;
    check_degrees(config)
}

/// The replicas of each part of a pipeline stage shard its states, counted as dp_degree or as
/// sharding_degree; the pipeline's keys check the product.
fn check_pipeline_degree(config: &JobConfig) -> Result<(), FieldError> {
    let hybrid = &config.strategy.hybrid_configs;
    let (degree, dp) = (hybrid.sharding_degree, hybrid.dp_degree);
    if degree > 1 && dp > 1 {
        return Err(FieldError::new(
            "strategy.hybrid_configs.sharding_degree",
            format!(
                "{degree} with dp_degree = {dp}: a pipeline's shards span every replica of a stage (count them as \
                 dp_degree or as sharding_degree, the other 1); sharding groups inside the replicas are not \
                 supported yet"
            ),
        ));
    }
    Ok(())
}

/// Stages 1, 2 and 3; the third outside pipelines.
fn check_stage(config: &JobConfig) -> Result<(), FieldError> {
    let key = "strategy.sharding_configs.stage";
    match config.strategy.sharding_configs.stage {
        1 | 2 => Ok(()),
        3 if config.strategy.pipeline => Err(FieldError::new(
            key,
            "3 (the parameters sharded too) inside pipeline stages (strategy.pipeline = true) is not supported yet: \
             use 1 (optimizer states) or 2 (and gradients)",
        )),
        3 => Ok(()),
        other => Err(FieldError::new(
            key,
            format!("must be 1 (optimizer states), 2 (and gradients) or 3 (and parameters), got {other}"),
        )),
    }
}

/// The shards span every rank, or each node's ranks with the nodes as replicas.
fn check_degrees(config: &JobConfig) -> Result<(), FieldError> {
    let strategy = &config.strategy;
    let degree = strategy.hybrid_configs.sharding_degree;
    let world = config.world_size();
    let (nodes, per_node) = (config.cluster.nnodes, config.cluster.nproc_per_node);
    if degree == 0 {
        return Err(FieldError::new(
            "strategy.hybrid_configs.sharding_degree",
            "must be at least 1, got 0",
        ));
    }
    if strategy.pipeline {
        return check_pipeline_degree(config);
    }
    if config.mp_degree() > 1 {
        // Every data-parallel rank's shards: the layout is checked with mp_degree.
        let ranks = world / config.mp_degree();
        if degree > 1 && degree != ranks {
            return Err(FieldError::new(
                "strategy.hybrid_configs.sharding_degree",
                format!(
                    "{degree}: with strategy.hybrid_configs.mp_degree, shards span every data-parallel rank ({ranks}, or \
                     leave it 1); sharding inside the nodes is not supported yet"
                ),
            ));
        }
        return Ok(());
    }
    let within_nodes = degree > 1 && degree != world;
    if within_nodes && (degree != per_node || nodes < 2) {
        return Err(FieldError::new(
            "strategy.hybrid_configs.sharding_degree",
            format!(
                "{degree}: shards span every rank (the world size {world}, or leave it 1) or each node's ranks \
                 (cluster.nproc_per_node = {per_node} of several nodes, the nodes holding replicas); other sharding \
                 groups are not supported yet"
            ),
        ));
    }
    let dp_degree = strategy.hybrid_configs.dp_degree;
    let replicas = if within_nodes { nodes } else { 1 };
    if dp_degree != replicas {
        return Err(FieldError::new(
            "strategy.hybrid_configs.dp_degree",
            format!(
                "{dp_degree}: dp_degree × sharding_degree must be the world size {world}; with sharding_degree = \
                 {degree} there are {replicas} replica(s) of the shards"
            ),
        ));
    }
    if within_nodes && strategy.use_hierarchical_allreduce == Some(false) {
        return Err(FieldError::new(
            "strategy.use_hierarchical_allreduce",
            format!(
                "false, but sharding inside the nodes (hybrid_configs.sharding_degree = {degree}) runs on the two \
                 levels of rings: leave it unset"
            ),
        ));
    }
    if within_nodes && config.cluster.min_nnodes.is_some() {
        return Err(FieldError::new(
            "cluster.min_nnodes",
            "elastic membership with sharding inside the nodes is not supported yet: shard over every rank \
             (hybrid_configs.sharding_degree = 1)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{err_text, load_with};

    /// The refusal of a 4-rank job with `settings`.
    fn refusal(settings: &[&str]) -> String {
        err_text(load_with("", &[], &[&["cluster.nproc_per_node=4"], settings].concat()))
    }

    #[test]
    fn stages_one_to_three_load_and_the_rest_is_refused_naming_the_key() {
        for stage in [1, 2, 3] {
            let stage = format!("strategy.sharding_configs.stage={stage}");
            let config = load_with("", &[], &["cluster.nproc_per_node=4", "strategy.sharding=true", &stage]);
            assert!(config.is_ok(), "{:?}", config.err());
        }
        let msg = refusal(&[
            "strategy.sharding=true",
            "strategy.sharding_configs.stage=3",
            "strategy.pipeline=true",
            "strategy.hybrid_configs.pp_degree=2",
            "strategy.hybrid_configs.dp_degree=2",
        ]);
        assert!(
            msg.contains("strategy.sharding_configs.stage: 3 (the parameters sharded too) inside pipeline stages"),
            "{msg}"
        );
        let msg = refusal(&["strategy.sharding=true", "strategy.sharding_configs.stage=4"]);
        assert!(
            msg.contains("must be 1 (optimizer states), 2 (and gradients) or 3 (and parameters), got 4"),
            "{msg}"
        );
        let msg = refusal(&["strategy.sharding_configs.stage=2"]);
        assert!(msg.contains("strategy.sharding: sharding_configs"), "{msg}");
    }

    #[test]
    fn shards_within_nodes_take_nproc_per_node_ranks_and_the_nodes_are_replicas() {
        let nodes = [
            "cluster.nnodes=2",
            "strategy.sharding=true",
            "strategy.hybrid_configs.sharding_degree=2",
        ];
        let config = load_with(
            "",
            &[],
            &[
                &nodes[..],
                &["cluster.nproc_per_node=2", "strategy.hybrid_configs.dp_degree=2"],
            ]
            .concat(),
        )
        .expect("sharding inside 2 nodes of 2");
        assert!(config.shards_within_nodes());
        assert_eq!(config.hierarchical_setting(), Some(true));
        let msg = err_text(load_with(
            "",
            &[],
            &[&nodes[..], &["cluster.nproc_per_node=2"]].concat(),
        ));
        assert!(
            msg.contains("strategy.hybrid_configs.dp_degree: 1: dp_degree × sharding_degree must be the world size 4"),
            "{msg}"
        );
        let msg = err_text(load_with(
            "",
            &[],
            &[
                &nodes[..],
                &[
                    "cluster.nproc_per_node=2",
                    "strategy.hybrid_configs.dp_degree=2",
                    "strategy.use_hierarchical_allreduce=false",
                ],
            ]
            .concat(),
        ));
        assert!(
            msg.contains("strategy.use_hierarchical_allreduce: false, but sharding inside the nodes"),
            "{msg}"
        );
        let every =
            load_with("", &[], &["cluster.nproc_per_node=4", "strategy.sharding=true"]).expect("sharding over all");
        assert!(!every.shards_within_nodes());
        assert_eq!(every.hierarchical_setting(), None);
    }

    #[test]
    fn the_degree_is_the_world_and_the_strategy_collective() {
        let config = load_with(
            "",
            &[],
            &[
                "cluster.nproc_per_node=4",
                "strategy.sharding=true",
                "strategy.hybrid_configs.sharding_degree=4",
            ],
        );
        assert!(config.is_ok(), "{:?}", config.err());
        let msg = refusal(&["strategy.sharding=true", "strategy.hybrid_configs.sharding_degree=2"]);
        assert!(
            msg.contains("strategy.hybrid_configs.sharding_degree: 2: shards span every rank"),
            "{msg}"
        );
        let msg = refusal(&["strategy.hybrid_configs.sharding_degree=4"]);
        assert!(msg.contains("but strategy.sharding is false"), "{msg}");
        let msg = refusal(&[
            "strategy.sharding=true",
            "cluster.server_num=1",
            "train.model=\"wide_deep\"",
            "train.dataset=\"criteo_synthetic\"",
            "train.optimizer=\"sgd\"",
        ]);
        assert!(
            msg.contains("strategy.sharding: splits the optimizer states of collective training"),
            "{msg}"
        );
        let msg = refusal(&[
            "strategy.sharding=true",
            "strategy.pipeline=true",
            "cluster.nproc_per_node=8",
            "strategy.hybrid_configs.pp_degree=2",
            "strategy.hybrid_configs.dp_degree=2",
            "strategy.hybrid_configs.sharding_degree=2",
        ]);
        assert!(
            msg.contains("strategy.hybrid_configs.sharding_degree: 2 with dp_degree = 2: a pipeline's shards span"),
            "{msg}"
        );
        // Each stage's replicas shard its states, counted either way.
        for replicas in [
            "strategy.hybrid_configs.dp_degree=2",
            "strategy.hybrid_configs.sharding_degree=2",
        ] {
            let pipeline = [
                "strategy.sharding=true",
                "strategy.pipeline=true",
                "strategy.hybrid_configs.pp_degree=2",
                replicas,
            ];
            let loaded = load_with("", &[], &[&["cluster.nproc_per_node=4"], &pipeline[..]].concat());
            assert!(loaded.is_ok(), "{replicas}: {:?}", loaded.err());
        }
    }
}
