//! A program of your own, trained by flotilla: your model as blocks, your
//! dataset, a `DistributedStrategy` in code — what a Paddle user writes in
//! `train.py` around `fleet.init(strategy)`.
//!
//! In one process (a simulated cluster of 2 ranks):
//!
//!     cargo run --release --example custom_model -- --run-dir runs/custom_model
//!
//! As 2 real processes over TCP, started by flotilla's launcher:
//!
//!     cargo build --release --example custom_model
//!     cargo run --release -- launch --nproc_per_node 2 -- target/release/examples/custom_model --set train.epochs=5

use anyhow::Result;
use candle_core::Tensor;

use flotilla::cli::{standard_command_line, DefaultConfig};
use flotilla::data::Dataset;
use flotilla::job::TrainingJob;
use flotilla::models::{Activation, Block, Linear, Model, Param, ParamInit};

/// A block flotilla has never heard of: `x + relu(x W + b)`, a residual layer.
struct Residual {
    name: String,
    inner: Linear,
}

impl Block for Residual {
    fn name(&self) -> &str {
        &self.name
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x + self.inner.forward(x)?
    }

    fn parameters(&self) -> Vec<(String, Param)> {
        self.inner.parameters()
    }
}

fn model(init: &ParamInit) -> Result<Model> {
    let width = 96;
    Model::new(vec![
        Box::new(Linear::new("embed", 64, width, Activation::Relu, init)?),
        Box::new(Residual {
            name: "res0".into(),
            inner: Linear::new("res0", width, width, Activation::Relu, init)?,
        }),
        Box::new(Residual {
            name: "res1".into(),
            inner: Linear::new("res1", width, width, Activation::Relu, init)?,
        }),
        Box::new(Linear::new("head", width, 10, Activation::Identity, init)?),
    ])
}

/// The strategy in code, in the same TOML words as a config file; `--config` replaces it, and
/// `--set` and the launcher's environment (PADDLE_*) override it.
const CONFIG: &str = r#"
        [cluster]
        nproc_per_node = 2

        [strategy]
        fuse_grad_size_in_MB = 1
        check_every = 20

        [train]
        epochs = 15
        batch_size = 64
        optimizer = "adamw"
        lr = 0.002
        "#;

fn main() -> Result<()> {
    // `flotilla train`'s command line: --config, --set, --run-dir, --trace, --resume, …
    let (config, options) = standard_command_line(&DefaultConfig {
        local_file: None,
        toml: CONFIG,
        name: "custom_model.rs",
    })?;
    let (train, test) = Dataset::digits()?.split(0.2, config.train.seed)?;
    let job = TrainingJob::new(config, model, train, test)?;
    if let Some(outcome) = job.run(&options)? {
        println!(
            "test accuracy {:.4} after {} steps",
            outcome.summary.test_accuracy.unwrap_or_default(),
            outcome.summary.steps
        );
    }
    Ok(())
}
