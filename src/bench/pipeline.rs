//! `flotilla bench pipeline`: the measured bubble of a schedule against the theory, with
//! stages of equal, known cost — `stages × virtual` identical blocks, one per virtual stage,
//! real stage actors and transfers in one process — trained for a few steps on synthetic data.
//!
//! A block either takes a fixed time (`--cost-ms`: it sleeps that long in forward and twice
//! that in backward, the usual ratio), so stages cost exactly the same however many cores the
//! machine has and what remains of the bubble beyond the theory is the runtime's own overhead;
//! or it computes (`--cost-ms 0`: a `width × width` linear layer with ReLU), as a real model
//! does, which on a machine with fewer cores than stages also measures the contention.

use std::time::Duration;

use anyhow::Result;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor, Var};
use serde::Serialize;

use crate::config::JobConfig;
use crate::cpu_values::cpu_values;
use crate::data::Dataset;
use crate::job::{RunOptions, TrainingJob};
use crate::models::{mlp, Block, Model, Param, ParamInit};

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
    /// Milliseconds a block's forward takes (backward: twice that); 0 computes instead.
    #[arg(long = "cost-ms", default_value_t = 4.0)]
    pub cost_ms: f64,
    /// Width of the data and of every block; with `--cost-ms 0` a block's cost is
    /// `batch / m × width²` multiply-adds per micro-batch.
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
    /// Write the timed run's timeline (chrome-trace JSON, one track per stage) here.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<std::path::PathBuf>,
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
    let text = format!(
        "[cluster]\nnproc_per_node = {p}\n\
         [strategy]\npipeline = true\n\
         [strategy.hybrid_configs]\npp_degree = {p}\n\
         [strategy.pipeline_configs]\nschedule_mode = {:?}\naccumulate_steps = {m}\nvirtual_pipeline_stages = {v}\n\
         [train]\nsteps = {}\nbatch_size = {}\nlog_every = 1000000\n",
        args.schedule, args.steps, args.batch,
    );
    let config = JobConfig::from_toml_str(&text, "bench pipeline", &|_| None, &[])?;
    let w = args.width;
    let data = Dataset::synthetic(2 * args.batch, w, w, config.train.seed)?;
    let cost = Duration::from_secs_f64(args.cost_ms.max(0.0) / 1e3);
    let model = move |init: &ParamInit| -> Result<Model> {
        if cost.is_zero() {
            return mlp(w, &vec![w; blocks - 1], w, init);
        }
        let timed = (0..blocks)
            .map(|i| Ok(Box::new(TimedBlock::new(format!("timed{i}"), cost, init)?) as Box<dyn Block>))
            .collect::<Result<_>>()?;
        Model::new(timed)
    };
    let dir = std::env::temp_dir().join(format!("flotilla-bench-pipeline-{}", std::process::id()));
    let options = RunOptions::new(dir.clone());
    let (train, test) = data.split(0.5, 1)?;
    let job = TrainingJob::new(config, model, train, test)?;
    job.run_simulated(&options)?; // warm-up: first-touch allocations and thread start-up
    let traced = RunOptions {
        trace: args.trace.clone(),
        ..options
    };
    let summary = job.run_simulated(&traced)?.summary;
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

/// A block of known cost: `x · scale`, taking `cost` in forward and `2 · cost` in backward.
struct TimedBlock {
    name: String,
    scale: Param,
    cost: Duration,
}

impl TimedBlock {
    fn new(name: String, cost: Duration, init: &ParamInit) -> candle_core::Result<Self> {
        let scale = Var::from_tensor(&Tensor::ones(1, candle_core::DType::F32, init.device())?)?.into();
        Ok(Self { name, scale, cost })
    }
}

impl Block for TimedBlock {
    fn name(&self) -> &str {
        &self.name
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.broadcast_mul(self.scale.var()?.as_tensor())?
            .apply_op1(Delay(self.cost))
    }

    fn parameters(&self) -> Vec<(String, Param)> {
        vec![("scale".to_string(), self.scale.clone())]
    }
}

/// The identity, taking its time: `.0` in forward, twice that in backward.
struct Delay(Duration);

impl CustomOp1 for Delay {
    fn name(&self) -> &'static str {
        "delay"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        std::thread::sleep(self.0);
        let values = cpu_values(storage, layout, "delay")?;
        Ok((CpuStorage::F32(values.to_vec()), layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        std::thread::sleep(2 * self.0);
        Ok(Some(grad_res.clone()))
    }
}
