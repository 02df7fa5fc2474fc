//! `[strategy]`: Paddle `DistributedStrategy`-style knobs of collective data parallelism, plus
//! the list of Paddle strategies that are recognised but not built yet.

use serde::{Deserialize, Serialize};

use super::{FieldError, UnsupportedKey};

/// Keys of `[strategy]` that belong to strategies of a later release, with the strategy named in
/// the "not supported yet" error. Checked before deserialization so these never surface as a
/// misleading "unknown field".
pub(crate) const UNSUPPORTED_KEYS: &[UnsupportedKey] = &[
    unsupported("a_sync", "parameter server"),
    unsupported("a_sync_configs", "parameter server"),
    unsupported("pipeline", "pipeline parallel"),
    unsupported("pipeline_configs", "pipeline parallel"),
    unsupported("hybrid_configs", "pipeline parallel"),
    unsupported("recompute", "recompute"),
    unsupported("recompute_configs", "recompute"),
    unsupported("gradient_merge", "gradient merge"),
    unsupported("gradient_merge_configs", "gradient merge"),
    unsupported("sharding", "sharding"),
    unsupported("sharding_configs", "sharding"),
    unsupported("amp", "mixed precision"),
    unsupported("amp_configs", "mixed precision"),
];

/// Entry of [`UNSUPPORTED_KEYS`] in the `[strategy]` section.
const fn unsupported(key: &'static str, reason: &'static str) -> UnsupportedKey {
    UnsupportedKey {
        section: "strategy",
        key,
        reason,
    }
}

/// `[strategy]` section: how gradients are synchronised between data-parallel replicas.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DistributedStrategy {
    /// Size of one gradient fusion bucket in MiB: gradients are all-reduced in buckets of about
    /// this size, trading message count against overlap. TOML key `fuse_grad_size_in_MB`
    /// (Paddle's name; also `FLAGS_fuse_parameter_groups_size`).
    #[serde(rename = "fuse_grad_size_in_MB")]
    pub fuse_grad_size_in_mb: f64,
    /// Steps between cross-replica parameter checksum comparisons, which catch replicas that
    /// silently diverged; 0 disables the check.
    pub check_every: usize,
}

impl Default for DistributedStrategy {
    fn default() -> Self {
        Self {
            fuse_grad_size_in_mb: 32.0,
            check_every: 10,
        }
    }
}

impl DistributedStrategy {
    /// Fusion bucket size in bytes (at least 1), rounded down.
    pub fn fuse_grad_size_bytes(&self) -> usize {
        // Float-to-int `as` saturates, and validation keeps the value positive and finite.
        ((self.fuse_grad_size_in_mb * (1u64 << 20) as f64) as usize).max(1)
    }

    /// Range checks of the section.
    pub(crate) fn check(&self) -> Result<(), FieldError> {
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
    fn unsupported_strategies_are_rejected_with_the_reason() {
        let msg = err_text(load_str("[strategy]\na_sync = true\n"));
        assert_eq!(
            msg,
            "config.toml: strategy.a_sync: not supported yet (parameter server)"
        );
        let msg = err_text(load_str("[strategy.sharding_configs]\nstage = 2\n"));
        assert_eq!(
            msg,
            "config.toml: strategy.sharding_configs: not supported yet (sharding)"
        );
        let msg = err_text(load_with("", &[], &["strategy.a_sync_configs.k_steps=4"]));
        assert_eq!(
            msg,
            "--set: strategy.a_sync_configs: not supported yet (parameter server)"
        );
        let msg = err_text(load_str("[strategy]\namp = false\n"));
        assert!(msg.ends_with("not supported yet (mixed precision)"), "{msg}");
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
