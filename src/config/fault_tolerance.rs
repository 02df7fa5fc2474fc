//! `[fault_tolerance]`: deadlines that turn a hung peer into an error instead of a hang, plus
//! the keys of the later fault-tolerance release (checkpointing, restarts, heartbeats) that are
//! recognised but not built yet.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{FieldError, UnsupportedKey};

/// Keys of `[fault_tolerance]` from a later release, rejected with "not supported yet" before
/// deserialization (same mechanism as the strategy list).
pub(crate) const UNSUPPORTED_KEYS: &[UnsupportedKey] = &[
    unsupported("checkpoint_every", "checkpointing"),
    unsupported("keep_checkpoints", "checkpointing"),
    unsupported("checkpoint_dir", "checkpointing"),
    unsupported("max_restarts", "elastic restart"),
    unsupported("heartbeat_interval_ms", "heartbeats"),
    unsupported("heartbeat_misses", "heartbeats"),
];

/// Entry of [`UNSUPPORTED_KEYS`] in the `[fault_tolerance]` section.
const fn unsupported(key: &'static str, reason: &'static str) -> UnsupportedKey {
    UnsupportedKey {
        section: "fault_tolerance",
        key,
        reason,
    }
}

/// `[fault_tolerance]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultToleranceConfig {
    /// Deadline in seconds of every collective and of rendezvous; a peer that does not answer
    /// within it fails the job instead of hanging it.
    pub timeout_s: f64,
    /// Times a parameter-server pull or push that failed at the network level (connection
    /// refused or reset) is retried, with exponential backoff, before the job fails naming the
    /// unreachable server.
    pub retry: usize,
}

impl Default for FaultToleranceConfig {
    fn default() -> Self {
        Self {
            timeout_s: 1800.0,
            retry: 3,
        }
    }
}

impl FaultToleranceConfig {
    /// [`FaultToleranceConfig::timeout_s`] as a `Duration` (saturating; validation keeps it in
    /// range).
    pub fn timeout(&self) -> Duration {
        Duration::try_from_secs_f64(self.timeout_s).unwrap_or(Duration::MAX)
    }

    /// Range checks of the section.
    pub(crate) fn check(&self) -> Result<(), FieldError> {
        let t = self.timeout_s;
        if !(t > 0.0 && Duration::try_from_secs_f64(t).is_ok()) {
            return Err(FieldError::new(
                "fault_tolerance.timeout_s",
                format!("must be a positive, finite number of seconds, got {t}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::tests::{err_text, load_str};

    #[test]
    fn later_release_keys_are_not_supported_yet() {
        let msg = err_text(load_str("[fault_tolerance]\nmax_restarts = 3\n"));
        assert_eq!(
            msg,
            "config.toml: fault_tolerance.max_restarts: not supported yet (elastic restart)"
        );
        let msg = err_text(load_str("[fault_tolerance]\ncheckpoint_dir = \"ckpt\"\n"));
        assert!(
            msg.contains("fault_tolerance.checkpoint_dir: not supported yet"),
            "{msg}"
        );
    }

    #[test]
    fn timeout_must_be_positive() {
        let msg = err_text(load_str("[fault_tolerance]\ntimeout_s = 0\n"));
        assert!(msg.starts_with("config.toml: fault_tolerance.timeout_s: "), "{msg}");
        let msg = err_text(load_str("[fault_tolerance]\ntimeout_s = inf\n"));
        assert!(msg.starts_with("config.toml: fault_tolerance.timeout_s: "), "{msg}");
        let config = load_str("[fault_tolerance]\ntimeout_s = 2.5\n").unwrap();
        assert_eq!(config.fault_tolerance.timeout(), Duration::from_millis(2500));
    }
}
