//! `[fault_tolerance]`: deadlines that turn a hung peer into an error instead of a hang,
//! retries of transient network errors, heartbeats that find dead or stalled roles, coordinated
//! checkpoints, and restarts from the last one.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::FieldError;

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
    /// Steps between coordinated checkpoints; 0 turns checkpointing off.
    pub checkpoint_every: usize,
    /// Committed checkpoints kept; older ones are deleted once a newer one is committed.
    pub keep_checkpoints: usize,
    /// Where checkpoints go, one `step-N` directory each (relative to the working directory);
    /// unset, `checkpoints` inside the run directory, so that two runs never meet each other's.
    pub checkpoint_dir: Option<PathBuf>,
    /// Times a launcher restarts the job's processes after one of them died, each time from
    /// the last committed checkpoint, before it gives up.
    pub max_restarts: usize,
    /// How often every role tells the coordinator it is alive, in milliseconds.
    pub heartbeat_interval_ms: u64,
    /// Heartbeat intervals a role may stay silent before the coordinator declares it dead.
    pub heartbeat_misses: u32,
}

impl Default for FaultToleranceConfig {
    fn default() -> Self {
        Self {
            timeout_s: 1800.0,
            retry: 3,
            checkpoint_every: 0,
            keep_checkpoints: 3,
            checkpoint_dir: None,
            max_restarts: 0,
            heartbeat_interval_ms: 1000,
            heartbeat_misses: 5,
        }
    }
}

impl FaultToleranceConfig {
    /// Where the checkpoints of a run writing into `run_dir` go.
    pub fn checkpoint_dir_of(&self, run_dir: &Path) -> PathBuf {
        self.checkpoint_dir
            .clone()
            .unwrap_or_else(|| run_dir.join("checkpoints"))
    }

    /// [`FaultToleranceConfig::timeout_s`] as a `Duration` (saturating; validation keeps it in
    /// range).
    pub fn timeout(&self) -> Duration {
        Duration::try_from_secs_f64(self.timeout_s).unwrap_or(Duration::MAX)
    }

    /// How long a role may stay silent before it is declared dead.
    pub fn heartbeat_deadline(&self) -> Duration {
        self.heartbeat_interval() * self.heartbeat_misses
    }

    /// [`FaultToleranceConfig::heartbeat_interval_ms`] as a `Duration`.
    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
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
        if self.keep_checkpoints == 0 {
            return Err(FieldError::new(
                "fault_tolerance.keep_checkpoints",
                "must be at least 1: a restart needs a checkpoint to return to",
            ));
        }
        if self.heartbeat_interval_ms < 10 {
            return Err(FieldError::new(
                "fault_tolerance.heartbeat_interval_ms",
                format!("must be at least 10 ms, got {}", self.heartbeat_interval_ms),
            ));
        }
        if self.heartbeat_misses == 0 {
            return Err(FieldError::new(
                "fault_tolerance.heartbeat_misses",
                "must be at least 1",
            ));
        }
        if self
            .checkpoint_dir
            .as_ref()
            .is_some_and(|dir| dir.as_os_str().is_empty())
        {
            return Err(FieldError::new(
                "fault_tolerance.checkpoint_dir",
                "must name a directory (leave it unset for the run directory's `checkpoints`)",
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
    fn every_key_is_settable_and_checked() {
        let config = load_str(
            "[fault_tolerance]\ncheckpoint_every = 5\nkeep_checkpoints = 2\ncheckpoint_dir = \"ckpt\"\n\
             max_restarts = 3\nheartbeat_interval_ms = 200\nheartbeat_misses = 4\n",
        )
        .unwrap();
        let ft = &config.fault_tolerance;
        assert_eq!((ft.checkpoint_every, ft.keep_checkpoints, ft.max_restarts), (5, 2, 3));
        assert_eq!(ft.checkpoint_dir_of("run".as_ref()), std::path::PathBuf::from("ckpt"));
        let default = load_str("").unwrap().fault_tolerance;
        assert_eq!(
            default.checkpoint_dir_of("run".as_ref()),
            std::path::Path::new("run").join("checkpoints")
        );
        assert_eq!(ft.heartbeat_deadline(), Duration::from_millis(800));
        let msg = err_text(load_str("[fault_tolerance]\nkeep_checkpoints = 0\n"));
        assert!(
            msg.contains("fault_tolerance.keep_checkpoints: must be at least 1"),
            "{msg}"
        );
        let msg = err_text(load_str("[fault_tolerance]\nheartbeat_misses = 0\n"));
        assert!(msg.contains("fault_tolerance.heartbeat_misses"), "{msg}");
        let msg = err_text(load_str("[fault_tolerance]\ncheckpoint_everyy = 5\n"));
        assert!(msg.contains("checkpoint_everyy"), "{msg}");
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
