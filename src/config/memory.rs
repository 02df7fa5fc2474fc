//! `[strategy]` keys that trade compute or steps for memory (Paddle's names): `recompute` with
//! `recompute_configs`, and `gradient_merge` with `gradient_merge_configs`.

use serde::{Deserialize, Serialize};

use super::FieldError;
use crate::refusal::Refusal;

/// A block of the model, by name or by index in the model's block list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
pub enum BlockRef {
    /// The block's index.
    Index(usize),
    /// The block's name.
    Name(String),
}

/// `[strategy.recompute_configs]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RecomputeConfigs {
    /// The blocks whose outputs are kept from forward to backward; everything between two of
    /// them is dropped after forward and recomputed in backward.
    pub checkpoints: Vec<BlockRef>,
}

impl RecomputeConfigs {
    /// The checkpoints as indices into `block_names` (the model's blocks, in order); a name or
    /// index that is not a block is a [`Refusal`] naming it: the config's, which no restart
    /// changes, found only once the model is built.
    pub fn resolve(&self, block_names: &[&str]) -> anyhow::Result<Vec<usize>> {
        self.checkpoints
            .iter()
            .map(|checkpoint| match checkpoint {
                BlockRef::Index(i) if *i < block_names.len() => Ok(*i),
                BlockRef::Index(i) => anyhow::bail!(
                    "strategy.recompute_configs.checkpoints: block {i} does not exist, the model has {} blocks",
                    block_names.len()
                ),
                BlockRef::Name(name) => block_names.iter().position(|b| b == name).ok_or_else(|| {
                    anyhow::anyhow!(
                        "strategy.recompute_configs.checkpoints: the model has no block {name:?}; its blocks are {}",
                        block_names.join(", ")
                    )
                }),
            })
            .collect::<anyhow::Result<_>>()
            .map_err(Refusal::wrap)
    }
}

/// `[strategy.gradient_merge_configs]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct GradientMergeConfigs {
    /// Batches whose gradients are accumulated before one optimizer step.
    pub k_steps: usize,
    /// Step with the mean of the k gradients (`true`) or their sum.
    pub avg: bool,
}

impl Default for GradientMergeConfigs {
    fn default() -> Self {
        Self { k_steps: 1, avg: true }
    }
}

/// Checks of the recompute and gradient-merge keys together with their switches.
pub(crate) fn check(
    recompute: bool,
    recompute_configs: &RecomputeConfigs,
    gradient_merge: bool,
    gradient_merge_configs: &GradientMergeConfigs,
) -> Result<(), FieldError> {
    if !recompute && *recompute_configs != RecomputeConfigs::default() {
        return Err(FieldError::new(
            "strategy.recompute",
            "recompute_configs is set but strategy.recompute is false: set it to true",
        ));
    }
    if recompute && recompute_configs.checkpoints.is_empty() {
        return Err(FieldError::new(
            "strategy.recompute_configs.checkpoints",
            "recompute needs the blocks whose outputs to keep (names or indices), e.g. checkpoints = [\"hidden1\"]",
        ));
    }
    if !gradient_merge && *gradient_merge_configs != GradientMergeConfigs::default() {
        return Err(FieldError::new(
            "strategy.gradient_merge",
            "gradient_merge_configs is set but strategy.gradient_merge is false: set it to true",
        ));
    }
    if gradient_merge_configs.k_steps == 0 {
        return Err(FieldError::new(
            "strategy.gradient_merge_configs.k_steps",
            "must be at least 1, got 0",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{err_text, load_str};

    #[test]
    fn checkpoints_are_names_or_indices() {
        let config =
            load_str("[strategy]\nrecompute = true\n[strategy.recompute_configs]\ncheckpoints = [\"hidden1\", 0]\n")
                .unwrap();
        let configs = &config.strategy.recompute_configs;
        assert_eq!(configs.resolve(&["hidden0", "hidden1", "output"]).unwrap(), vec![1, 0]);
        let msg = configs.resolve(&["a", "b"]).unwrap_err().to_string();
        assert!(msg.contains("no block \"hidden1\"") && msg.contains("a, b"), "{msg}");
        let msg = RecomputeConfigs {
            checkpoints: vec![BlockRef::Index(5)],
        }
        .resolve(&["a"])
        .unwrap_err()
        .to_string();
        assert!(msg.contains("block 5 does not exist"), "{msg}");
    }

    #[test]
    fn settings_need_their_switch_and_sane_values() {
        for (toml, key) in [
            (
                "[strategy.recompute_configs]\ncheckpoints = [1]\n",
                "strategy.recompute:",
            ),
            (
                "[strategy]\nrecompute = true\n",
                "strategy.recompute_configs.checkpoints:",
            ),
            (
                "[strategy.gradient_merge_configs]\nk_steps = 4\n",
                "strategy.gradient_merge:",
            ),
            (
                "[strategy]\ngradient_merge = true\n[strategy.gradient_merge_configs]\nk_steps = 0\n",
                "strategy.gradient_merge_configs.k_steps:",
            ),
        ] {
            let msg = err_text(load_str(toml));
            assert!(msg.starts_with(&format!("config.toml: {key}")), "{toml}: {msg}");
        }
        let config = load_str(
            "[strategy]\ngradient_merge = true\n[strategy.gradient_merge_configs]\nk_steps = 4\navg = false\n",
        )
        .unwrap();
        assert_eq!(
            config.strategy.gradient_merge_configs,
            GradientMergeConfigs { k_steps: 4, avg: false }
        );
    }
}
