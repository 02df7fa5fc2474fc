//! Per-step metrics: one JSON object per training step in `RUN_DIR/metrics.jsonl`, written by
//! the rank that writes the run's outputs, read back by `flotilla report`.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use serde::{Deserialize, Deserializer, Serialize};

use crate::models::HeldOut;

/// The file's name inside a run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// What one training step measured, over the whole job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Steps done after this one (1 for the first).
    pub step: usize,
    /// Seconds since the training loop started (or resumed).
    #[serde(deserialize_with = "nan_if_null")]
    pub elapsed_s: f64,
    /// Wall time of this step.
    #[serde(deserialize_with = "nan_if_null")]
    pub step_time_s: f64,
    /// Global batch over step time.
    #[serde(deserialize_with = "nan_if_null")]
    pub samples_per_sec: f64,
    /// Time in communication over step time (the reporting rank's; overlapped or not).
    #[serde(deserialize_with = "nan_if_null")]
    pub comm_time_ratio: f64,
    /// Time the compute thread was blocked on communication over step time: the part that
    /// nothing hid.
    #[serde(deserialize_with = "nan_if_null")]
    pub exposed_comm_ratio: f64,
    /// Pipeline jobs: time stages waited for their neighbours over the schedule's time.
    pub bubble_fraction: Option<f64>,
    /// The largest resident set any process of the job has had so far, in bytes.
    pub peak_rss_bytes: u64,
    /// GPU jobs: device memory in use on the reporting process's GPUs (NVML), in bytes.
    pub gpu_memory_bytes: Option<u64>,
    /// GPU jobs: share of time a kernel ran on the reporting process's GPUs (NVML), in percent.
    pub gpu_utilization: Option<f64>,
    /// Learning rate the step used.
    #[serde(deserialize_with = "nan_if_null")]
    pub lr: f64,
    /// Mean loss over the global batch.
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f32,
    /// Largest minus smallest of the ranks' local losses: ranks that stop agreeing show here.
    /// Parameter-server jobs, whose trainers exchange no losses, leave it out.
    pub loss_spread: Option<f32>,
    /// Parameter-server jobs with row policies, at progress-log steps: each policed table's
    /// rows over all shards and what its policy did so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sparse_tables: Option<Vec<SparseTableMetrics>>,
    /// At the steps that scored the held-out split (`train.eval_every`): its figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<HeldOut>,
}

/// One sparse table's rows over all shards, and what its row policy did so far.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SparseTableMetrics {
    /// The table.
    pub table: String,
    /// Rows held.
    pub rows: u64,
    /// Rows stored by the entry rule.
    pub admitted: u64,
    /// Rows evicted for the memory cap.
    pub evicted: u64,
    /// Rows deleted at pass ends.
    pub deleted: u64,
}

/// JSON has no NaN or infinity: serde_json writes them as null (a diverged loss, a step too short
/// to time), read back as NaN so such a line still reads.
fn nan_if_null<'de, D: Deserializer<'de>, F: Deserialize<'de> + From<f32>>(deserializer: D) -> Result<F, D::Error> {
    Ok(Option::<F>::deserialize(deserializer)?.unwrap_or_else(|| F::from(f32::NAN)))
}

/// Appends one line per step to `metrics.jsonl`, flushed per line so that a run that dies keeps
/// every step it finished.
pub struct MetricsLog {
    path: PathBuf,
    out: BufWriter<File>,
}

impl MetricsLog {
    /// Opens `run_dir/metrics.jsonl` for a run starting after `first_step` steps: a fresh run
    /// starts an empty file; a resumed one keeps the lines of the steps it does not repeat.
    pub fn open(run_dir: &Path, first_step: usize) -> Result<Self> {
        std::fs::create_dir_all(run_dir).with_context(|| format!("creating run directory {}", run_dir.display()))?;
        let path = run_dir.join(METRICS_FILE);
        let kept = if first_step > 0 && path.exists() {
            read_metrics(&path)?
                .into_iter()
                .filter(|m| m.step <= first_step)
                .collect()
        } else {
            Vec::new()
        };
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut log = Self {
            path,
            out: BufWriter::new(file),
        };
        for metrics in &kept {
            log.append(metrics)?;
        }
        Ok(log)
    }

    /// Writes one step's line.
    pub fn append(&mut self, metrics: &StepMetrics) -> Result<()> {
        serde_json::to_writer(&mut self.out, metrics)?;
        self.out.write_all(b"\n")?;
        self.out
            .flush()
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// Every step's metrics in `path`, in file order; a malformed line is an error naming it, except
/// a last line cut short (no newline: the run was killed while writing it), which is skipped.
pub fn read_metrics(path: &Path) -> Result<Vec<StepMetrics>> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut reader = BufReader::new(file);
    let (mut steps, mut line, mut number) = (Vec::new(), String::new(), 0usize);
    loop {
        line.clear();
        if reader
            .read_line(&mut line)
            .with_context(|| format!("reading {}", path.display()))?
            == 0
        {
            return Ok(steps);
        }
        number += 1;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(&line) {
            Ok(metrics) => steps.push(metrics),
            Err(e) if !line.ends_with('\n') => {
                tracing::warn!(file = %path.display(), line = number, "skipping a torn last line: {e}");
            }
            Err(e) => return Err(e).with_context(|| format!("{} line {number}: not a step's metrics", path.display())),
        }
    }
}

/// The largest resident set this process has had, in bytes (0 where the OS does not say).
pub fn peak_rss_bytes() -> u64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF is always valid.
    let usage = unsafe {
        if libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) != 0 {
            return 0;
        }
        usage.assume_init()
    };
    // Linux reports kibibytes.
    u64::try_from(usage.ru_maxrss).unwrap_or(0) * 1024
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: usize) -> StepMetrics {
        StepMetrics {
            step,
            elapsed_s: step as f64 * 0.1,
            step_time_s: 0.1,
            samples_per_sec: 640.0,
            comm_time_ratio: 0.2,
            exposed_comm_ratio: 0.05,
            bubble_fraction: None,
            peak_rss_bytes: 1 << 20,
            gpu_memory_bytes: None,
            gpu_utilization: None,
            lr: 0.1,
            loss: 2.0 / step as f32,
            loss_spread: Some(0.01),
            sparse_tables: None,
            eval: None,
        }
    }

    #[test]
    fn a_resumed_run_keeps_the_steps_it_does_not_repeat() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let mut log = MetricsLog::open(dir.path(), 0)?;
        for s in 1..=5 {
            log.append(&step(s))?;
        }
        drop(log);
        let mut resumed = MetricsLog::open(dir.path(), 3)?;
        resumed.append(&step(4))?;
        let steps: Vec<usize> = read_metrics(&dir.path().join(METRICS_FILE))?
            .iter()
            .map(|m| m.step)
            .collect();
        assert_eq!(steps, [1, 2, 3, 4]);
        drop(resumed);
        MetricsLog::open(dir.path(), 0)?;
        assert!(read_metrics(&dir.path().join(METRICS_FILE))?.is_empty());
        Ok(())
    }

    #[test]
    fn a_malformed_line_is_named() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join(METRICS_FILE);
        std::fs::write(&path, format!("{}\n{{\"step\": \n", serde_json::to_string(&step(1))?))?;
        let error = format!("{:#}", read_metrics(&path).unwrap_err());
        assert!(error.contains("line 2"), "{error}");
        Ok(())
    }

    #[test]
    fn a_torn_last_line_is_skipped() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join(METRICS_FILE);
        let whole = format!(
            "{}\n{}\n",
            serde_json::to_string(&step(1))?,
            serde_json::to_string(&step(2))?
        );
        std::fs::write(&path, format!("{whole}{{\"step\": 3, \"elaps"))?;
        let steps: Vec<usize> = read_metrics(&path)?.iter().map(|m| m.step).collect();
        assert_eq!(steps, vec![1, 2]);
        Ok(())
    }

    #[test]
    fn a_diverged_step_reads_back_as_nan() -> Result<()> {
        let diverged = StepMetrics {
            loss: f32::NAN,
            exposed_comm_ratio: f64::INFINITY,
            samples_per_sec: f64::INFINITY,
            ..step(1)
        };
        let line = serde_json::to_string(&diverged)?;
        assert!(line.contains("\"loss\":null"), "{line}");
        let back: StepMetrics = serde_json::from_str(&line)?;
        assert!(back.loss.is_nan() && back.exposed_comm_ratio.is_nan() && back.samples_per_sec.is_nan());
        assert_eq!(back.step, 1);
        Ok(())
    }

    #[test]
    fn peak_rss_is_measured() {
        assert!(peak_rss_bytes() > 1 << 20);
    }
}
