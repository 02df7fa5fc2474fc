//! `flotilla bench pipeline`: the measured bubble of a schedule against the theory, with
//! stages of equal, known cost — `stages × virtual` identical blocks (a `width × width` linear
//! layer with ReLU each, one per virtual stage), real stage actors and transfers in one
//! process — trained for a few steps on synthetic data.

use anyhow::Result;
use serde::Serialize;

use crate::config::JobConfig;
use crate::job::{RunOptions, TrainingJob};

/// Arguments of `flotilla bench pipeline`.
#[derive(Debug, Clone, clap::Args)]
pub struct PipelineBenchArgs {
    /// Pipeline stages (`p`).
    #[arg(long, default_value_t = 4)]
    pub stages: usize,
    /// Micro-batches per step (`m`).
    #[arg(long = "micro-batches", default_value_t = 8)]
    pub micro_batches: usize,
    /// `FThenB` or `1F1B`.
    #[arg(long, default_value = "1F1B")]
    pub schedule: String,
    /// Model chunks per stage (`v`); more than 1 interleaves 1F1B.
    #[arg(long = "virtual", default_value_t = 1)]
    pub virtual_stages: usize,
    /// Width of every block; its cost is `batch / m × width²` multiply-adds per micro-batch.
    #[arg(long, default_value_t = 512)]
    pub width: usize,
    /// Global batch (samples per step).
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    /// Timed steps (after one warm-up run of the same length).
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// One JSON object instead of a line of text.
    #[arg(long)]
    pub json: bool,
}

/// One run's figures.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineFigures {
    /// Stages.
    pub stages: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Schedule.
    pub schedule: String,
    /// Model chunks per stage.
    pub virtual_stages: usize,
    /// Measured: time stages waited for neighbours over the schedule's time, mean over stages.
    pub bubble_share: f64,
    /// Measured, in Megatron's terms: idle time over compute time, `share / (1 − share)`.
    pub bubble: f64,
    /// Theory for equal stages: `(p − 1) / (v·m)`.
    pub theory: f64,
    /// Theory as a share of the step: `(p − 1) / (v·m + p − 1)`.
    pub theory_share: f64,
    /// Per stage, the most bytes of activations held for backward.
    pub peak_activation_bytes: Vec<usize>,
}

/// Runs the benchmark and prints its figures.
pub fn run(args: &PipelineBenchArgs) -> Result<()> {
    let (p, v, m) = (args.stages, args.virtual_stages, args.micro_batches);
    let blocks = p * v;
    let hidden = vec![args.width.to_string(); blocks - 1].join(", ");
    let text = format!(
        "[cluster]\nnproc_per_node = {p}\n\
         [strategy]\npipeline = true\n\
         [strategy.hybrid_configs]\npp_degree = {p}\n\
         [strategy.pipeline_configs]\nschedule_mode = {:?}\naccumulate_steps = {m}\nvirtual_pipeline_stages = {v}\n\
         [train]\ndataset = \"synthetic\"\nsynthetic_samples = {}\nsynthetic_features = {w}\nsynthetic_classes = {w}\n\
         hidden_sizes = [{hidden}]\nsteps = {}\nbatch_size = {}\ntest_fraction = 0.5\nlog_every = 1000000\n",
        args.schedule,
        4 * args.batch,
        args.steps,
        args.batch,
        w = args.width,
    );
    let config = JobConfig::from_toml_str(&text, "bench pipeline", &|_| None, &[])?;
    let dir = std::env::temp_dir().join(format!("flotilla-bench-pipeline-{}", std::process::id()));
    let options = RunOptions {
        run_dir: dir.clone(),
        show_progress: false,
    };
    let job = TrainingJob::builtin(config)?;
    job.run_simulated(&options)?; // warm-up: first-touch allocations and thread start-up
    let summary = job.run_simulated(&options)?.summary;
    let _ = std::fs::remove_dir_all(&dir);
    let share = summary.bubble_fraction.unwrap_or(f64::NAN);
    let theory = (p - 1) as f64 / (v * m) as f64;
    let figures = PipelineFigures {
        stages: p,
        micro_batches: m,
        schedule: args.schedule.clone(),
        virtual_stages: v,
        bubble_share: share,
        bubble: share / (1.0 - share),
        theory,
        theory_share: theory / (1.0 + theory),
        peak_activation_bytes: summary.peak_activation_bytes.unwrap_or_default(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&figures)?);
    } else {
        println!(
            "p={p} m={m} {} v={v}: bubble {:.3} (theory {:.3}), share of step {:.3} (theory {:.3}), peak activations {:?} bytes",
            figures.schedule, figures.bubble, figures.theory, figures.bubble_share, figures.theory_share,
            figures.peak_activation_bytes
        );
    }
    Ok(())
}
