//! A data-parallel checkpoint resumes on another number of ranks: its one replica file holds
//! the whole state, and every rank reads its share of the same global batches at each step, so
//! the resumed run continues the uninterrupted one's sample stream.
//!
//! Tolerance: max |Δparam| ≤ 1e-5 after 20 more steps against the uninterrupted run, as in
//! `data_parallel_equivalence.rs` — the ranks' mean gradients are summed in another order
//! (measured ~6e-8); a lost share of the batch or a wrong average moves parameters by ~1e-3.

mod common;

use std::path::Path;

use common::{flotilla, max_abs_diff, read_params};

/// A global batch that 4, 3 and 2 ranks divide.
const JOB: [&str; 6] = [
    "--set",
    "train.batch_size=48",
    "--set",
    "strategy.check_every=5",
    "--set",
    "fault_tolerance.checkpoint_every=10",
];

/// Trains `ranks` ranks for `steps` steps into `run_dir`.
fn train(run_dir: &Path, ranks: usize, steps: usize) {
    let (ranks, steps) = (
        format!("cluster.nproc_per_node={ranks}"),
        format!("train.steps={steps}"),
    );
    let mut args = vec!["train", "--run-dir", run_dir.to_str().expect("utf-8")];
    args.extend(JOB);
    args.extend(["--set", &ranks, "--set", &steps]);
    let out = flotilla(&args, &[], 120);
    assert!(out.success, "{}", out.stderr);
}

/// Resumes the run in `run_dir` on `ranks` ranks until step `steps`, with `extra` flags.
fn resume(run_dir: &Path, ranks: usize, steps: usize, extra: &[&str]) -> common::Finished {
    let (ranks, steps) = (
        format!("cluster.nproc_per_node={ranks}"),
        format!("train.steps={steps}"),
    );
    #[rustfmt::skip]
    let args = ["train", "--resume", run_dir.to_str().expect("utf-8"), "--set", &ranks, "--set", &steps];
    flotilla(&[&args[..], extra].concat(), &[], 120)
}

#[test]
fn a_checkpoint_of_four_ranks_continues_on_two_and_on_three_as_the_uninterrupted_run() {
    let dir = tempfile::tempdir().expect("temp dir");
    let uninterrupted = dir.path().join("uninterrupted");
    train(&uninterrupted, 4, 30);
    let expected = read_params(&uninterrupted.join("params.safetensors"));
    for ranks in [2, 3] {
        // Stopped after step 20, its newest checkpoint that of step 10.
        let run_dir = dir.path().join(format!("to-{ranks}"));
        train(&run_dir, 4, 20);
        let resumed = resume(&run_dir, ranks, 30, &[]);
        assert!(resumed.success, "{}", resumed.stderr);
        assert!(
            resumed
                .stderr
                .contains(&format!("resharding: the data-parallel checkpoint continues on another number of ranks step=10 written_by=4 ranks={ranks}")),
            "{}",
            resumed.stderr
        );
        let diff = max_abs_diff(&expected, &read_params(&run_dir.join("params.safetensors")));
        assert!(diff <= 1e-5, "4 → {ranks} ranks: max |Δparam| = {diff:e}");
        eprintln!("4 → {ranks} ranks: max |Δparam| = {diff:e}");
    }
}

#[test]
fn a_resharding_that_would_change_the_learning_rate_or_a_pipelines_layout_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let scaled = dir.path().join("scaled");
    let mut args = vec!["train", "--run-dir", scaled.to_str().expect("utf-8")];
    args.extend(JOB);
    args.extend([
        "--set",
        "train.steps=20",
        "--set",
        "train.lr_scaling=\"linear\"",
        "--set",
        "cluster.nproc_per_node=4",
    ]);
    assert!(flotilla(&args, &[], 120).success);
    let refused = resume(&scaled, 2, 30, &[]);
    assert!(!refused.success);
    assert!(
        refused.stderr.contains(
            "was written by 4 ranks: train.lr_scaling scales the learning rate by the world size, so resuming on 2 \
             would change it; resume on 4 ranks"
        ),
        "{}",
        refused.stderr
    );
    // A pipeline's checkpoint is cut into stages: its layout stays.
    let pipeline = dir.path().join("pipeline");
    #[rustfmt::skip]
    let args = [
        "train", "--run-dir", pipeline.to_str().expect("utf-8"), "--set", "strategy.pipeline=true",
        "--set", "strategy.hybrid_configs.pp_degree=2", "--set", "train.steps=10",
        "--set", "fault_tolerance.checkpoint_every=5",
    ];
    assert!(flotilla(&args, &[], 120).success);
    let refused = resume(&pipeline, 4, 20, &["--set", "strategy.hybrid_configs.dp_degree=2"]);
    assert!(!refused.success);
    assert!(
        refused
            .stderr
            .contains("cluster.nproc_per_node was 2, --set makes it 4"),
        "{}",
        refused.stderr
    );
}

#[test]
fn a_checkpoint_of_another_model_is_refused_naming_the_tensor_and_both_shapes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let run_dir = dir.path().join("run");
    train(&run_dir, 2, 20);
    // The run's config now says another model than its checkpoint holds.
    let config = run_dir.join("config.toml");
    let text = std::fs::read_to_string(&config).expect("the run's config");
    assert!(text.contains("hidden_sizes = [128]"), "{text}");
    std::fs::write(&config, text.replace("hidden_sizes = [128]", "hidden_sizes = [96]")).expect("rewritten");
    let refused = resume(&run_dir, 2, 30, &[]);
    assert!(!refused.success);
    assert!(
        refused.stderr.contains(
            "restoring the state after step 10 from disk: parameter fc0.bias: the checkpoint's shape is [128], the \
             model's [96]"
        ),
        "{}",
        refused.stderr
    );
}
