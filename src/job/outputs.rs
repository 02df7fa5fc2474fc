//! What a run leaves behind: `summary.json` (the figures), the final
//! parameters as `params.safetensors`, and the resolved `config.toml`.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use serde::Serialize;

use crate::actors::trainer::RankOutcome;
use crate::config::JobConfig;

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
    /// Accuracy on the held-out split.
    pub test_accuracy: f64,
    /// Time in collectives over step time (rank 0).
    pub comm_time_ratio: f64,
    /// Communication not hidden behind backward, over step time (rank 0).
    pub exposed_comm_ratio: f64,
    /// SHA-256 of every parameter's bytes in name order.
    pub param_checksum: String,
    /// Pipeline jobs: per stage, the most bytes of activations held for backward at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_activation_bytes: Option<Vec<usize>>,
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
    pub(super) fn from_rank0(rank0: RankOutcome, world_size: usize, cluster: &str) -> Self {
        Self {
            summary: Summary {
                strategy: "collective".to_string(),
                world_size,
                cluster: cluster.to_string(),
                steps: rank0.steps,
                samples_per_sec: rank0.samples_per_sec,
                final_loss: rank0.final_loss,
                test_accuracy: rank0.test_accuracy,
                comm_time_ratio: rank0.comm_time_ratio,
                exposed_comm_ratio: rank0.exposed_comm_ratio,
                param_checksum: rank0.param_checksum.to_string(),
                peak_activation_bytes: None,
                bubble_fraction: None,
            },
            parameters: rank0.parameters,
            losses: rank0.losses,
        }
    }

    /// Writes `summary.json`, `params.safetensors` and `config.toml` into
    /// `run_dir` (created if needed).
    pub fn write(&self, run_dir: &Path, config: &JobConfig) -> Result<()> {
        std::fs::create_dir_all(run_dir).with_context(|| format!("creating run directory {}", run_dir.display()))?;
        let summary = serde_json::to_string_pretty(&self.summary)?;
        std::fs::write(run_dir.join("summary.json"), summary + "\n")
            .with_context(|| format!("writing {}/summary.json", run_dir.display()))?;
        let tensors = self
            .parameters
            .iter()
            .map(|(name, values)| Ok((name.clone(), Tensor::from_slice(values, values.len(), &Device::Cpu)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        candle_core::safetensors::save(&tensors, run_dir.join("params.safetensors"))
            .with_context(|| format!("writing {}/params.safetensors", run_dir.display()))?;
        std::fs::write(run_dir.join("config.toml"), config.to_toml_string()?)
            .with_context(|| format!("writing {}/config.toml", run_dir.display()))?;
        Ok(())
    }
}
