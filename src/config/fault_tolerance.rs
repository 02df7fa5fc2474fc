//! `[fault_tolerance]`: deadlines that turn a hung peer into an error instead of a hang,
//! retries of transient network errors, heartbeats that find dead or stalled roles, coordinated
//! checkpoints, and restarts from the last one.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::FieldError;

/// Longest deadline any key may ask for, 30 days: far beyond any real wait, and far below the
/// point where a deadline overflows the clock.
const MAX_WAIT: Duration = Duration::from_secs(30 * 24 * 3600);
/// Most retries of a pull or push: the backoff doubles each time, and after 20 it already
/// waits for hours.
const MAX_RETRY: usize = 20;

/// The shortest silence a launcher takes for a hung coordinator.
const COORDINATOR_HANG_MIN: Duration = Duration::from_secs(20);

/// `[fault_tolerance]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
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
    /// How a launched job recovers from a lost process; unset, in place.
    pub recovery: Option<RecoveryMode>,
    /// With elastic membership (`cluster.min_nnodes`), seconds the coordinator waits for a lost
    /// machine's replacement — or, at the start, for every machine — before it goes on without
    /// it.
    pub elastic_timeout_s: f64,
}

/// How a launched job recovers from a lost process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryMode {
    /// Only the lost process is restarted; the others roll back to the last committed
    /// checkpoint inside their processes. The coordinator runs as a process of its own.
    InPlace,
    /// Every process is restarted, from the last committed checkpoint.
    Restart,
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
            recovery: None,
            elastic_timeout_s: 60.0,
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

    /// [`FaultToleranceConfig::timeout_s`] as a `Duration` (saturating; validation keeps it at
    /// most 30 days).
    pub fn timeout(&self) -> Duration {
        Duration::try_from_secs_f64(self.timeout_s).unwrap_or(Duration::MAX)
    }

    /// How long a role may stay silent before it is declared dead (saturating; validation keeps
    /// it at most 30 days).
    pub fn heartbeat_deadline(&self) -> Duration {
        self.heartbeat_interval()
            .checked_mul(self.heartbeat_misses)
            .unwrap_or(Duration::MAX)
    }

    /// How long a rank that recovers in place waits for a silent coordinator (a process of its
    /// own, which its launcher replaces when it hangs) before it presumes it dead: `timeout_s`,
    /// at least the heartbeat deadline.
    pub fn coordinator_patience(&self) -> Duration {
        self.timeout().max(self.heartbeat_deadline())
    }

    /// How long a launcher lets the coordinator process it started go without answering before
    /// it takes it for hung and replaces it: four heartbeat deadlines and at least 20 s (a loaded
    /// machine's slow answers are no hang; a coordinator stalled for seconds wakes and goes on),
    /// but no longer than the ranks wait for it ([`Self::coordinator_patience`]).
    pub fn coordinator_hang_limit(&self) -> Duration {
        self.heartbeat_deadline()
            .saturating_mul(4)
            .max(COORDINATOR_HANG_MIN)
            .min(self.coordinator_patience())
    }

    /// [`FaultToleranceConfig::elastic_timeout_s`] as a `Duration` (saturating; validation keeps
    /// it at most 30 days).
    pub fn elastic_timeout(&self) -> Duration {
        Duration::try_from_secs_f64(self.elastic_timeout_s).unwrap_or(Duration::MAX)
    }

    /// [`FaultToleranceConfig::heartbeat_interval_ms`] as a `Duration`.
    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }

    /// Range checks of the section.
    pub(crate) fn check(&self) -> Result<(), FieldError> {
        let (t, max_s) = (self.timeout_s, MAX_WAIT.as_secs());
        if !(t > 0.0 && t <= max_s as f64) {
            return Err(FieldError::new(
                "fault_tolerance.timeout_s",
                format!("must be in (0, {max_s}] seconds (at most 30 days), got {t}"),
            ));
        }
        let e = self.elastic_timeout_s;
        if !(e > 0.0 && e <= max_s as f64) {
            return Err(FieldError::new(
                "fault_tolerance.elastic_timeout_s",
                format!("must be in (0, {max_s}] seconds (at most 30 days), got {e}"),
            ));
        }
        if self.retry > MAX_RETRY {
            return Err(FieldError::new(
                "fault_tolerance.retry",
                format!(
                    "must be in [0, {MAX_RETRY}] (the backoff doubles each retry), got {}",
                    self.retry
                ),
            ));
        }
        if self.keep_checkpoints == 0 {
            return Err(FieldError::new(
                "fault_tolerance.keep_checkpoints",
                "must be at least 1: a restart needs a checkpoint to return to",
            ));
        }
        let (interval, misses, max_ms) = (self.heartbeat_interval_ms, self.heartbeat_misses, MAX_WAIT.as_millis());
        if !(10..=max_ms).contains(&u128::from(interval)) {
            return Err(FieldError::new(
                "fault_tolerance.heartbeat_interval_ms",
                format!("must be in [10, {max_ms}] ms (at most 30 days), got {interval}"),
            ));
        }
        if misses == 0 {
            return Err(FieldError::new(
                "fault_tolerance.heartbeat_misses",
                "must be at least 1",
            ));
        }
        if u128::from(interval) * u128::from(misses) > max_ms {
            return Err(FieldError::new(
                "fault_tolerance.heartbeat_misses",
                format!(
                    "heartbeat_interval_ms × heartbeat_misses = {interval} × {misses} ms must be at most {max_ms} ms \
                     (30 days)"
                ),
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
        let msg = err_text(load_str("[fault_tolerance]\ntimeout_s = 1.8e19\n"));
        assert!(
            msg.starts_with("config.toml: fault_tolerance.timeout_s: must be in (0, 2592000] seconds"),
            "{msg}"
        );
        load_str("[fault_tolerance]\ntimeout_s = 2592000\n").unwrap();
        let config = load_str("[fault_tolerance]\ntimeout_s = 2.5\n").unwrap();
        assert_eq!(config.fault_tolerance.timeout(), Duration::from_millis(2500));
    }

    #[test]
    fn heartbeats_and_retries_are_bounded() {
        let msg = err_text(load_str(
            "[fault_tolerance]\nheartbeat_interval_ms = 9223372036854775807\nheartbeat_misses = 4294967295\n",
        ));
        assert!(
            msg.starts_with("config.toml: fault_tolerance.heartbeat_interval_ms: must be in [10, 2592000000] ms"),
            "{msg}"
        );
        let msg = err_text(load_str("[fault_tolerance]\nheartbeat_misses = 4294967295\n"));
        assert!(
            msg.starts_with("config.toml: fault_tolerance.heartbeat_misses: heartbeat_interval_ms × heartbeat_misses"),
            "{msg}"
        );
        let msg = err_text(load_str("[fault_tolerance]\nretry = 64\n"));
        assert!(
            msg.starts_with("config.toml: fault_tolerance.retry: must be in [0, 20]"),
            "{msg}"
        );
    }
}
