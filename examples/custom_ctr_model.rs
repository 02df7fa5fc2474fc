//! A click-through model of your own on parameter servers: your sparse tables (which slots read
//! them, their widths and step sizes), your dense part as blocks, the parameter-server strategy
//! in the config — what a PaddleRec user writes as a model file and `config.yaml`.
//!
//! Every role in this process (2 shards, 2 trainers):
//!
//!     cargo run --release --example custom_ctr_model
//!
//! As real processes over TCP, started by flotilla's launcher:
//!
//!     cargo build --release --example custom_ctr_model
//!     cargo run --release -- launch-ps --server_num 2 --worker_num 2 -- target/release/examples/custom_ctr_model

use std::sync::Arc;

use anyhow::Result;
use candle_core::Tensor;

use flotilla::config::{process_env, JobConfig};
use flotilla::job::ps::ParameterServerJob;
use flotilla::job::RunOptions;
use flotilla::models::{Activation, Block, Linear, Lookup, ParamInit, SparseModel, SparseModelDef, SparseTableSpec};
use flotilla::telemetry::monitor::ProgressView;

/// Criteo's 26 slots split three ways: the first ten describe the user, the next ten the item,
/// the last six the context.
const TABLES: [(&str, usize, std::ops::Range<usize>); 3] =
    [("user", 8, 0..10), ("item", 8, 10..20), ("context", 4, 20..26)];

/// A two-tower-flavoured model: each table's rows summed over its slots (a bag of features),
/// the three sums and the dense features through an MLP, plus a learned dot product of the user
/// and item sums.
struct UserItemContext {
    hidden: Linear,
    out: Linear,
}

impl SparseModel for UserItemContext {
    fn tables(&self) -> Vec<SparseTableSpec> {
        TABLES
            .iter()
            .map(|(name, width, slots)| SparseTableSpec {
                // The context has few, frequent ids: a smaller step keeps them from swinging.
                lr: (*name == "context").then_some(0.01),
                ..SparseTableSpec::new(name, *width, 0.1, slots.clone())
            })
            .collect()
    }

    fn blocks(&self) -> Vec<&dyn Block> {
        vec![&self.hidden, &self.out]
    }

    fn logits(&self, dense: &Tensor, lookups: &[Lookup<'_>]) -> candle_core::Result<Tensor> {
        let batch = dense.dim(0)?;
        let bags = lookups
            .iter()
            .map(|table| table.embedded(batch)?.sum(1))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let affinity = (&bags[0] * &bags[1])?.sum_keepdim(1)?;
        let mut inputs = bags;
        inputs.push(dense.clone());
        let mlp = self.out.forward(&self.hidden.forward(&Tensor::cat(&inputs, 1)?)?)?;
        (mlp + affinity)?.squeeze(1)
    }
}

fn model(init: &ParamInit) -> Result<Box<dyn SparseModel>> {
    let inputs = TABLES.iter().map(|(_, width, _)| width).sum::<usize>() + 13;
    Ok(Box::new(UserItemContext {
        hidden: Linear::new("hidden", inputs, 64, Activation::Relu, init)?,
        out: Linear::new("out", 64, 1, Activation::Identity, init)?,
    }))
}

fn main() -> Result<()> {
    flotilla::telemetry::init_logging();
    // The launcher's environment (TRAINING_ROLE, PADDLE_*) overrides the cluster.
    let config = JobConfig::from_toml_str(
        r#"
        [cluster]
        server_num = 2
        nproc_per_node = 2

        [strategy.sparse_table_configs.item]
        count_filter = 2

        [train]
        model = "custom"
        dataset = "criteo_synthetic"
        synthetic_samples = 100000
        synthetic_vocab = 20000
        test_fraction = 0.1
        batch_size = 512
        steps = 300
        optimizer = "adagrad"
        lr = 0.05
        "#,
        "custom_ctr_model.rs",
        &process_env,
        &[],
    )?;
    let job = ParameterServerJob::new(config, SparseModelDef::new(Arc::new(model))?)?;
    let options = RunOptions {
        progress: ProgressView::from_environment(),
        ..RunOptions::new("runs/custom_ctr_model")
    };
    if let Some(summary) = job.run(&options)? {
        println!(
            "AUC {:.4} (the planted model's {:.4}) after {} steps; rows per table: {}",
            summary.auc,
            summary.planted_auc.unwrap_or(f64::NAN),
            summary.steps,
            summary
                .tables
                .iter()
                .map(|t| format!("{} {}", t.name, t.rows))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}
