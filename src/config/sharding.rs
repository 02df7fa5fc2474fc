//! `strategy.sharding` and `[strategy.sharding_configs]` (Paddle's names; ZeRO's stages): the
//! data-parallel ranks split the optimizer's states (stage 1) and the averaged gradients too
//! (stage 2) instead of each holding all of them.

use serde::{Deserialize, Serialize};

use super::{FieldError, JobConfig};

/// `[strategy.sharding_configs]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ShardingConfigs {
    /// What the data-parallel ranks split between them: 1, the optimizer's states (each rank
    /// updates its shard of the parameters, then all-gathers them); 2, the averaged gradients
    /// too (each bucket is reduce-scattered instead of all-reduced, half the traffic, and a rank
    /// keeps only its shard). 3, the parameters too, is not built yet.
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
}

impl ShardingStage {
    /// The stage's number, as `sharding_configs.stage` spells it.
    pub fn number(self) -> u8 {
        match self {
            Self::OptimizerStates => 1,
            Self::Gradients => 2,
        }
    }
}

/// Checks the sharding keys against the rest of the job: collective data parallelism over
/// every rank (`hybrid_configs.sharding_degree` the world size, or left at 1), stages 1 and 2.
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
    if strategy.pipeline {
        return Err(FieldError::new(
            "strategy.sharding",
            "not supported with strategy.pipeline yet: shard the states of a data-parallel job",
        ));
    }
    match strategy.sharding_configs.stage {
        1 | 2 => {}
        3 => {
            return Err(FieldError::new(
                "strategy.sharding_configs.stage",
                "3 (the parameters sharded too) is not supported yet: use 1 (optimizer states) or 2 \
                 (and gradients)",
            ))
        }
        other => {
            return Err(FieldError::new(
                "strategy.sharding_configs.stage",
                format!("must be 1 (optimizer states), 2 (and gradients) or 3 (and parameters), got {other}"),
            ))
        }
    }
    let world = config.world_size();
    if degree == 0 {
        return Err(FieldError::new(
            "strategy.hybrid_configs.sharding_degree",
            "must be at least 1, got 0",
        ));
    }
    if degree > 1 && degree != world {
        return Err(FieldError::new(
            "strategy.hybrid_configs.sharding_degree",
            format!(
                "{degree}: the states are split over all {world} data-parallel ranks (leave it 1 or set {world}); \
                 replicas across sharding groups are not supported yet"
            ),
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
    fn stages_one_and_two_load_and_the_rest_is_refused_naming_the_key() {
        for stage in [1, 2] {
            let stage = format!("strategy.sharding_configs.stage={stage}");
            let config = load_with("", &[], &["cluster.nproc_per_node=4", "strategy.sharding=true", &stage]);
            assert!(config.is_ok(), "{:?}", config.err());
        }
        let msg = refusal(&["strategy.sharding=true", "strategy.sharding_configs.stage=3"]);
        assert!(
            msg.contains("strategy.sharding_configs.stage: 3 (the parameters sharded too) is not supported yet"),
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
            msg.contains("strategy.hybrid_configs.sharding_degree: 2: the states are split over all 4"),
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
            "strategy.hybrid_configs.pp_degree=2",
            "strategy.hybrid_configs.dp_degree=2",
        ]);
        assert!(
            msg.contains("strategy.sharding: not supported with strategy.pipeline yet"),
            "{msg}"
        );
    }
}
