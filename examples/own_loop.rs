//! Your own training loop, data parallel: the loop, the loss and the optimizer are this
//! program's; flotilla averages the gradients — what a PyTorch user writes with
//! `init_process_group` + `DDP(model)`, or a Paddle user with `fleet.init` +
//! `fleet.distributed_model`. The program gets `flotilla train`'s command line (`--config`,
//! `--set`, `--run-dir`, …) from one call.
//!
//! It fits a regression with a Huber loss and hand-written SGD with momentum; each rank trains
//! on its share of every global batch, so any number of ranks trains the same model as one
//! process. Rank 0 writes the model file `params.safetensors` and `summary.json` into the run
//! directory.
//!
//!     cargo build --release --example own_loop
//!     target/release/flotilla launch --nproc_per_node 2 -- target/release/examples/own_loop --run-dir runs/own_loop
//!
//! or alone: `target/release/examples/own_loop --set train.steps=500`.

use std::ops::Range;

use anyhow::{ensure, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};

use flotilla::cli::{standard_command_line, DefaultConfig};
use flotilla::collective::preemption::PREEMPTED_EXIT_CODE;
use flotilla::job::{write_params, DistributedModel, ProcessGroup};
use flotilla::models::export::ModelInfo;
use flotilla::models::{ModelSpec, ParamInit};

const CONFIG: &str = "[cluster]\nnproc_per_node = 1\n\n[train]\nsteps = 300\nbatch_size = 64\nlr = 0.05\nseed = 3\n";
const FEATURES: usize = 4;
/// Rows of the held-out set.
const TEST_ROWS: usize = 512;

fn main() -> Result<()> {
    let default = DefaultConfig {
        local_file: None,
        toml: CONFIG,
        name: "own_loop.rs",
    };
    let (config, options) = standard_command_line(&default)?;
    let group = ProcessGroup::init(&config)?;
    let (rank, world) = (group.rank(), group.world_size());
    let train = config.train.clone();
    ensure!(
        train.batch_size % world == 0,
        "train.batch_size = {} does not split evenly over {world} ranks",
        train.batch_size
    );
    // The data never ends: the run is as long as its steps.
    let steps = train
        .steps
        .context("own_loop trains for train.steps batches, not epochs")?;
    let share = train.batch_size / world;
    let mine = rank * share..(rank + 1) * share;

    // A shape flotilla knows, so that `flotilla predict` can read the model file too.
    let spec = ModelSpec::Mlp {
        inputs: FEATURES,
        hidden: vec![32, 32],
        outputs: 1,
    };
    let model = spec.build(&ParamInit::new(train.seed, Device::Cpu))?;
    let mut model = DistributedModel::new(model, group)?;
    let mut optimizer = Momentum::new(model.parameters()?, train.lr, 0.9);
    for step in 0..steps {
        let (x, y) = rows(train.seed, step as u64, mine.clone())?;
        let output = model.forward(&x)?;
        let loss = huber(output.tensor(), &y, 1.0)?;
        if let Some(gradients) = model.backward(output, &loss)? {
            optimizer.step(&gradients)?;
        }
        if step % 50 == 0 || step + 1 == steps {
            let mean = model
                .group()
                .all_reduce_mean("the mean loss", vec![loss.to_scalar::<f32>()?])?;
            tracing::info!(step, loss = mean[0], "training");
        }
        // Preemption (a SIGTERM to any rank): every rank learns it at the same step, rank 0
        // keeps the model so far, and all stop as the cluster asked.
        if step % PREEMPTION_CHECK == PREEMPTION_CHECK - 1 && model.group().stop_asked()? {
            if rank == 0 {
                let path = write_params(&options.run_dir, model.model(), &model_info(&spec))?;
                eprintln!(
                    "stopped on SIGTERM after step {}; the model so far is in {}",
                    step + 1,
                    path.display()
                );
            }
            model.finish()?;
            std::process::exit(i32::from(PREEMPTED_EXIT_CODE));
        }
    }

    // Each rank scores its share of the held-out rows; the mean of the shares is the whole's.
    let test = TEST_ROWS / world * rank..TEST_ROWS / world * (rank + 1);
    let (x, y) = rows(train.seed, u64::MAX, test)?;
    let squared = model.model().forward(&x)?.broadcast_sub(&y)?.sqr()?.mean_all()?;
    let test_mse = model
        .group()
        .all_reduce_mean("the test error", vec![squared.to_scalar::<f32>()?])?[0];
    if rank == 0 {
        let path = write_params(&options.run_dir, model.model(), &model_info(&spec))?;
        let summary = serde_json::json!({ "world_size": world, "steps": steps, "test_mse": test_mse });
        std::fs::write(options.run_dir.join("summary.json"), format!("{summary:#}\n"))?;
        println!("test mse {test_mse:.5}; the model is in {}", path.display());
    }
    model.finish()?;
    Ok(())
}

/// Steps between the ranks' agreements on whether to stop (each is one small all-reduce).
const PREEMPTION_CHECK: usize = 20;

/// What the model file says of the model besides its weights.
fn model_info(spec: &ModelSpec) -> ModelInfo {
    ModelInfo {
        spec: Some(spec.clone()),
        loss: Some("huber".to_string()),
        ..ModelInfo::default()
    }
}

/// Rows `range` of the global batch `batch`: features uniform in [-1, 1) and a target planted
/// in them, `y = sin(2a) + b·c − d/2`. Every rank computes the same rows from the same numbers.
fn rows(seed: u64, batch: u64, range: Range<usize>) -> Result<(Tensor, Tensor)> {
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for row in range.clone() {
        let f: Vec<f32> = (0..FEATURES as u64)
            .map(|col| uniform(seed, batch, row as u64, col))
            .collect();
        ys.push((2.0 * f[0]).sin() + f[1] * f[2] - 0.5 * f[3]);
        xs.extend(f);
    }
    let n = range.len();
    Ok((
        Tensor::from_vec(xs, (n, FEATURES), &Device::Cpu)?,
        Tensor::from_vec(ys, (n, 1), &Device::Cpu)?,
    ))
}

/// A number in [-1, 1) drawn from (seed, batch, row, column) by a 64-bit mix.
fn uniform(seed: u64, batch: u64, row: u64, col: u64) -> f32 {
    let mut z = seed ^ batch.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (row << 20) ^ (col << 52);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// The mean Huber loss: squared below `delta`, linear beyond it.
fn huber(prediction: &Tensor, target: &Tensor, delta: f64) -> candle_core::Result<Tensor> {
    let error = (prediction - target)?.abs()?;
    let quadratic = error.clamp(0.0, delta)?;
    let linear = (&error - &quadratic)?;
    ((quadratic.sqr()? * 0.5)? + (linear * delta)?)?.mean_all()
}

/// SGD with momentum: `v ← μv + g`, `w ← w − lr·v`.
struct Momentum {
    vars: Vec<Var>,
    velocities: Vec<Option<Tensor>>,
    lr: f64,
    momentum: f64,
}

impl Momentum {
    fn new(vars: Vec<Var>, lr: f64, momentum: f64) -> Self {
        let velocities = vec![None; vars.len()];
        Self {
            vars,
            velocities,
            lr,
            momentum,
        }
    }

    fn step(&mut self, gradients: &GradStore) -> Result<()> {
        for (var, velocity) in self.vars.iter().zip(&mut self.velocities) {
            let Some(gradient) = gradients.get(var.as_tensor()) else {
                continue;
            };
            let v = match velocity.take() {
                Some(v) => ((v * self.momentum)? + gradient)?,
                None => gradient.clone(),
            };
            var.set(&(var.as_tensor() - (&v * self.lr)?)?)?;
            *velocity = Some(v);
        }
        Ok(())
    }
}
