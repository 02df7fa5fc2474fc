//! What a run leaves behind: the resolved `config.toml`, written as it starts (so that a stopped
//! run can be resumed from its directory), and at its end the final parameters as
//! `params.safetensors`, then `summary.json` (the figures). Every file is written to a temporary
//! name and renamed, and the summary goes last: a run that could not write its parameters (a
//! full disk) leaves no summary claiming it finished.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::Device;
use serde::Serialize;

use super::TrainingJob;
use crate::actors::trainer::RankOutcome;
use crate::checkpoint::write_atomically;
use crate::collective::StateBytes;
use crate::config::JobConfig;
use crate::models::export::{write_model, write_values, ModelInfo};
use crate::models::{Model, ParamInit, Precision};

/// The resolved config of a run, in its run directory.
pub const CONFIG_FILE: &str = "config.toml";
/// The same config, kept apart from the one people read and may edit: what the run trains, as
/// it started, for `--resume` to hold a resumed run to.
pub(super) const SEALED_CONFIG_FILE: &str = ".config.sealed.toml";
/// The figures of a finished run, in its run directory: written last.
pub(super) const SUMMARY_FILE: &str = "summary.json";
const PARAMS_FILE: &str = "params.safetensors";

/// The figures of a run, as written to `summary.json`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Summary {
    /// Which strategy trained it.
    pub strategy: String,
    /// Ranks that trained.
    pub world_size: usize,
    /// Where the ranks ran: `in-process` or `multi-process`.
    pub cluster: String,
    /// Optimizer steps.
    pub steps: usize,
    /// Global samples per second over the training loop.
    pub samples_per_sec: f64,
    /// Global mean loss of the last step.
    pub final_loss: f32,
    /// Classification: accuracy on the held-out split.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_accuracy: Option<f64>,
    /// Regression: mean squared error on the held-out split.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_mse: Option<f64>,
    /// The mean training loss on the held-out split.
    pub test_loss: f64,
    /// Held-out predictions scored (rows, positions of a sequence model, or regressed values):
    /// every one of the split, under every strategy.
    pub test_samples: usize,
    /// Time in collectives over step time (rank 0).
    pub comm_time_ratio: f64,
    /// Communication not hidden behind backward, over step time (rank 0).
    pub exposed_comm_ratio: f64,
    /// SHA-256 of every parameter's bytes in name order.
    pub param_checksum: String,
    /// The CPU matrix kernel of rank 0's process's dense layers
    /// ([`crate::models::Precision::matrix_kernel`]): `avx512_bf16` under `strategy.amp`.
    pub matrix_kernel: String,
    /// Per stage, the most bytes of activations held for backward at once: a pipeline job's
    /// stages (replica 0's), or a data-parallel job's one stage, the whole model (rank 0's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_activation_bytes: Option<Vec<usize>>,
    /// The bytes of parameters, averaged gradients and optimizer state rank 0 holds (with
    /// `strategy.sharding`, its shards; in a pipeline, of its stage); none in parameter-server
    /// jobs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_bytes: Option<StateBytes>,
    /// Pipeline jobs: time stages waited for their neighbours over the time of the schedules,
    /// averaged over stages (the bubble's share of the pipeline's step).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bubble_fraction: Option<f64>,
}

/// Rank 0's view of a finished run.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The figures.
    pub summary: Summary,
    /// Final parameters by name.
    pub parameters: Vec<(String, Vec<f32>)>,
    /// Global mean loss of every step.
    pub losses: Vec<f32>,
}

impl RunOutcome {
    /// The outcome of a data-parallel run, as the rank at place 0 of its last generation tells
    /// it (`world_size`: the ranks that trained that generation).
    pub(super) fn from_rank0(rank0: RankOutcome, config: &JobConfig, cluster: &str) -> Result<Self> {
        let held_out = rank0.test_score.held_out(config.train.resolved_loss()?);
        let (parameters, param_checksum) = rank0.parameters.context("the rank at place 0 reported no parameters")?;
        Ok(Self {
            summary: Summary {
                strategy: "collective".to_string(),
                world_size: rank0.world_size,
                cluster: cluster.to_string(),
                steps: rank0.steps,
                samples_per_sec: rank0.samples_per_sec,
                final_loss: rank0.final_loss,
                test_accuracy: held_out.accuracy,
                test_mse: held_out.mse,
                test_loss: held_out.loss,
                test_samples: held_out.samples,
                comm_time_ratio: rank0.comm_time_ratio,
                exposed_comm_ratio: rank0.exposed_comm_ratio,
                param_checksum: param_checksum.to_string(),
                matrix_kernel: Precision::of(config).matrix_kernel().to_string(),
                peak_activation_bytes: Some(vec![rank0.peak_activation_bytes]),
                state_bytes: Some(rank0.state_bytes),
                bubble_fraction: None,
            },
            parameters,
            losses: rank0.losses,
        })
    }

    /// Writes `params.safetensors` (the model file of `job`'s model, [`crate::models::export`]),
    /// then `summary.json`, into `run_dir`.
    pub fn write(&self, run_dir: &Path, job: &TrainingJob) -> Result<()> {
        // The job's model's shapes, holding no values of their own: the trained ones are written
        // from where they are, so the host holds the whole model once.
        let shapes = (job.model)(&ParamInit::new(job.config.train.seed, Device::Cpu).deferring(true))?;
        write_output(run_dir, PARAMS_FILE, |out| {
            write_values(out, &shapes, &self.parameters, &job.export)
        })?;
        write_summary(run_dir, &self.summary)
    }
}

/// Writes `model` as `run_dir/params.safetensors`, the model file ([`crate::models::export`])
/// that `flotilla eval` and `predict` read and PyTorch loads by name; atomically, creating
/// `run_dir` if needed. Returns the file's path.
pub fn write_params(run_dir: &Path, model: &Model, info: &ModelInfo) -> Result<PathBuf> {
    write_output(run_dir, PARAMS_FILE, |out| write_model(out, model, info))?;
    Ok(run_dir.join(PARAMS_FILE))
}

/// Writes the resolved `config.toml` into `run_dir` (created if needed).
pub(crate) fn write_config(run_dir: &Path, config: &JobConfig) -> Result<()> {
    let cwd = std::env::current_dir().context("reading the working directory")?;
    let text = config.with_paths_from(&cwd).to_toml_string()?;
    write_output(run_dir, SEALED_CONFIG_FILE, |out| Ok(out.write_all(text.as_bytes())?))?;
    write_output(run_dir, CONFIG_FILE, |out| Ok(out.write_all(text.as_bytes())?))
}

/// Writes `summary.json` into `run_dir`: the last output of a run.
pub(crate) fn write_summary(run_dir: &Path, summary: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(summary)? + "\n";
    write_output(run_dir, SUMMARY_FILE, |out| Ok(out.write_all(text.as_bytes())?))
}

/// Writes what `contents` writes as `run_dir/name`, atomically.
fn write_output(run_dir: &Path, name: &str, contents: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating run directory {}", run_dir.display()))?;
    write_atomically(run_dir, name, |file| {
        let mut out = BufWriter::new(file);
        contents(&mut out)?;
        Ok(out.flush()?)
    })
    .with_context(|| format!("{}: cannot write the run's {name}", run_dir.display()))
}
