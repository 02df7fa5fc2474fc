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
    train_with(run_dir, ranks, steps, &[]);
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
        // Finished at step 20, with the checkpoint of its last step, then trained on to 30.
        let run_dir = dir.path().join(format!("to-{ranks}"));
        train(&run_dir, 4, 20);
        let resumed = resume(&run_dir, ranks, 30, &[]);
        assert!(resumed.success, "{}", resumed.stderr);
        assert!(
            resumed.stderr.contains(&format!(
                "resharding: the checkpoint continues on another layout step=20 written_by=4 ranks={ranks}"
            )),
            "{}",
            resumed.stderr
        );
        let diff = max_abs_diff(&expected, &read_params(&run_dir.join("params.safetensors")));
        assert!(diff <= 1e-5, "4 → {ranks} ranks: max |Δparam| = {diff:e}");
        eprintln!("4 → {ranks} ranks: max |Δparam| = {diff:e}");
    }
}

#[test]
fn a_resharding_that_would_change_the_learning_rate_is_refused() {
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
}

#[test]
fn a_checkpoint_of_another_model_is_refused_naming_the_tensor_and_both_shapes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let run_dir = dir.path().join("run");
    train(&run_dir, 2, 20);
    // The run's config, and the sealed copy `--resume` holds an edit to, now say another model
    // than its checkpoint holds: the checkpoint's own check is what is left to catch it.
    for name in ["config.toml", ".config.sealed.toml"] {
        let config = run_dir.join(name);
        let text = std::fs::read_to_string(&config).expect("the run's config");
        assert!(text.contains("hidden_sizes = [128]"), "{text}");
        std::fs::write(&config, text.replace("hidden_sizes = [128]", "hidden_sizes = [96]")).expect("rewritten");
    }
    let refused = resume(&run_dir, 2, 30, &[]);
    assert!(!refused.success);
    assert!(
        refused.stderr.contains(
            "restoring the state after step 20 from disk: parameter fc0.bias: the file's is F32 [128], the model's \
             F32 [96]"
        ),
        "{}",
        refused.stderr
    );
}

/// A pipeline of `stages` stages over as many ranks, of a model of four blocks.
fn pipeline(stages: usize) -> Vec<String> {
    [
        "strategy.pipeline=true".to_string(),
        format!("strategy.hybrid_configs.pp_degree={stages}"),
        "train.hidden_sizes=[64, 64, 64]".to_string(),
    ]
    .into_iter()
    .flat_map(|set| ["--set".to_string(), set])
    .collect()
}

/// Trains `ranks` ranks of the job `extra` says for `steps` steps into `run_dir`.
fn train_with(run_dir: &Path, ranks: usize, steps: usize, extra: &[String]) {
    let (ranks, steps) = (
        format!("cluster.nproc_per_node={ranks}"),
        format!("train.steps={steps}"),
    );
    let mut args = vec!["train", "--run-dir", run_dir.to_str().expect("utf-8")];
    args.extend(JOB);
    args.extend(["--set", &ranks, "--set", &steps]);
    args.extend(extra.iter().map(String::as_str));
    let out = flotilla(&args, &[], 120);
    assert!(out.success, "{}", out.stderr);
}

/// Tolerance as above. Another cut into stages changes which process computes a block, not the
/// order of any sum (measured 0 for 2 → 4 stages); one stage over two data-parallel ranks sums
/// each gradient over the ranks' halves of the batch (measured 2.6e-8 for 4 → 1). A parameter
/// lost or restored into the wrong block moves the parameters by far more.
#[test]
fn a_pipeline_checkpoint_is_cut_anew_into_four_stages_and_into_one_as_the_uninterrupted_run() {
    let dir = tempfile::tempdir().expect("temp dir");
    for (from, to) in [(2, 4), (4, 1)] {
        let uninterrupted = dir.path().join(format!("uninterrupted-{from}"));
        train_with(&uninterrupted, from, 30, &pipeline(from));
        let expected = read_params(&uninterrupted.join("params.safetensors"));
        // Finished at step 20 with the checkpoint of its last step, cut into `from` stages.
        let run_dir = dir.path().join(format!("{from}-to-{to}"));
        train_with(&run_dir, from, 20, &pipeline(from));
        let layout: Vec<String> = match to {
            1 => [
                "strategy.pipeline=false",
                "strategy.hybrid_configs.pp_degree=1",
                "train.hidden_sizes=[64, 64, 64]",
            ]
            .iter()
            .flat_map(|set| ["--set".to_string(), set.to_string()])
            .collect(),
            stages => pipeline(stages),
        };
        let ranks = if to == 1 { 2 } else { to };
        let layout: Vec<&str> = layout.iter().map(String::as_str).collect();
        let resumed = resume(&run_dir, ranks, 30, &layout);
        assert!(resumed.success, "{}", resumed.stderr);
        assert!(
            resumed
                .stderr
                .contains("merged the checkpoint's files into the whole model, to cut it anew"),
            "{}",
            resumed.stderr
        );
        let diff = max_abs_diff(&expected, &read_params(&run_dir.join("params.safetensors")));
        assert!(diff <= 1e-5, "pp {from} → {to}: max |Δparam| = {diff:e}");
        eprintln!("pp {from} → {to}: max |Δparam| = {diff:e}");
    }
}

/// A row of a parameter-server table: the table, the id, the values and the optimizer state.
type TableRow = (usize, u64, Vec<f32>, Vec<f32>);

/// A parameter-server job's rows and dense floats, gathered from its `servers` shard files in
/// `run_dir`: every row by (table, id) with its values and optimizer state, and the dense
/// parameters in order.
fn ps_state(run_dir: &Path, servers: usize) -> (Vec<TableRow>, Vec<f32>) {
    let config = flotilla::config::JobConfig::from_file(
        &run_dir.join("config.toml"),
        &|_| None,
        &[format!("cluster.server_num={servers}")],
    )
    .expect("the run's config");
    let (mut rows, mut dense) = (Vec::new(), Vec::new());
    for index in 0..servers {
        let mut shard = common::fresh_shard(&config, index);
        shard
            .load(&run_dir.join(format!("ps-shard-{index}.safetensors")))
            .expect("its file");
        for (table, rows_of) in shard.tables().iter().enumerate() {
            rows.extend(rows_of.rows().map(|(id, v, s)| (table, id, v.to_vec(), s.to_vec())));
        }
        dense.extend_from_slice(shard.dense().values());
    }
    rows.sort_unstable_by_key(|row| (row.0, row.1));
    (rows, dense)
}

/// Sync mode sums a row's pushes in trainer order whichever server holds it, so re-hashing
/// changes no sum: bitwise.
#[test]
fn a_parameter_server_checkpoint_of_two_servers_continues_on_three_as_the_uninterrupted_run() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ctr = |run_dir: &Path, steps: usize, extra: &[&str]| {
        let steps = format!("train.steps={steps}");
        #[rustfmt::skip]
        let mut args = vec![
            "train", "--config", "examples/ctr_ps.toml", "--run-dir", run_dir.to_str().expect("utf-8"),
            "--set", "train.synthetic_samples=20000", "--set", "fault_tolerance.checkpoint_every=10", "--set", &steps,
        ];
        args.extend(extra);
        let out = flotilla(&args, &[], 300);
        assert!(out.success, "{}", out.stderr);
    };
    let uninterrupted = dir.path().join("uninterrupted");
    ctr(&uninterrupted, 30, &[]);
    let run_dir = dir.path().join("two-to-three");
    ctr(&run_dir, 20, &[]);
    #[rustfmt::skip]
    let args = [
        "train", "--resume", run_dir.to_str().expect("utf-8"), "--set", "cluster.server_num=3", "--set", "train.steps=30",
    ];
    let resumed = flotilla(&args, &[], 300);
    assert!(resumed.success, "{}", resumed.stderr);
    assert!(
        resumed
            .stderr
            .contains("re-hashed the checkpoint's rows and dense slices onto this many servers"),
        "{}",
        resumed.stderr
    );
    let (expected, resumed) = (ps_state(&uninterrupted, 2), ps_state(&run_dir, 3));
    assert!(!expected.0.is_empty());
    assert_eq!(expected.0.len(), resumed.0.len(), "every row found once");
    assert!(
        expected == resumed,
        "the rows, their optimizer state and the dense parameters differ"
    );
    let (a, b) = (common::read_summary(&uninterrupted), common::read_summary(&run_dir));
    assert_eq!(a["final_loss"], b["final_loss"]);
}

/// The largest difference between two parameter-server states of the same rows, or `None` when
/// their rows differ.
fn ps_state_diff(a: &(Vec<TableRow>, Vec<f32>), b: &(Vec<TableRow>, Vec<f32>)) -> Option<f32> {
    let same_rows = a.0.len() == b.0.len() && a.0.iter().zip(&b.0).all(|(x, y)| (x.0, x.1) == (y.0, y.1));
    same_rows.then(|| {
        let rows = a.0.iter().zip(&b.0).flat_map(|(x, y)| {
            let values = x.2.iter().zip(&y.2);
            values.chain(x.3.iter().zip(&y.3)).map(|(p, q)| (p - q).abs())
        });
        rows.chain(a.1.iter().zip(&b.1).map(|(p, q)| (p - q).abs()))
            .fold(0.0, f32::max)
    })
}

/// Another number of trainers splits the same global batches: the shards average their mean
/// gradients in another order, so the state matches the uninterrupted run's within float
/// rounding — max |Δ| ≤ 1e-5 over every row and the dense parameters after 10 more steps of SGD
/// (a lost or doubled part of the batch moves them by ~1e-3), as `parameter_server.rs` bounds
/// sync training. (Not Adagrad: its first step on a row moves it by ±lr whatever the gradient's
/// size, so a gradient that rounds to either side of 0 moves it by 2 × lr.)
#[test]
fn a_parameter_server_checkpoint_of_two_trainers_continues_on_four_and_on_one_as_the_uninterrupted_run() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ctr = |args: &[&str], trainers: usize, steps: usize| {
        let (trainers, steps) = (
            format!("cluster.nproc_per_node={trainers}"),
            format!("train.steps={steps}"),
        );
        #[rustfmt::skip]
        let settings = [
            "--set", "train.synthetic_samples=20000", "--set", "fault_tolerance.checkpoint_every=10",
            "--set", &trainers, "--set", &steps,
        ];
        let out = flotilla(&[args, &settings[..]].concat(), &[], 300);
        assert!(out.success, "{}", out.stderr);
        out
    };
    let fresh = |run_dir: &Path, steps: usize| {
        let run_dir = run_dir.to_str().expect("utf-8");
        #[rustfmt::skip]
        let args = [
            "train", "--config", "examples/ctr_ps.toml", "--run-dir", run_dir, "--set", "train.optimizer=sgd",
            "--set", "train.lr=0.1",
        ];
        ctr(&args, 2, steps);
    };
    let uninterrupted = dir.path().join("uninterrupted");
    fresh(&uninterrupted, 30);
    let expected = ps_state(&uninterrupted, 2);
    for trainers in [4, 1] {
        let run_dir = dir.path().join(format!("two-to-{trainers}"));
        fresh(&run_dir, 20);
        let resumed = ctr(&["train", "--resume", run_dir.to_str().expect("utf-8")], trainers, 30);
        assert!(
            resumed
                .stderr
                .contains("the parameter-server job continues on another layout"),
            "{}",
            resumed.stderr
        );
        assert_eq!(common::read_summary(&run_dir)["trainers"], trainers);
        let diff = ps_state_diff(&expected, &ps_state(&run_dir, 2)).expect("every row found once");
        eprintln!("2 -> {trainers} trainers: max |Δ| = {diff:e}");
        assert!(diff <= 1e-5, "2 -> {trainers} trainers: max |Δ| = {diff:e}");
    }
}

/// A geo checkpoint resumed on another number of trainers: the shards hold the model, and the
/// trainers' local optimizer states — each of its own part of the batch — start afresh, as the
/// log says; the run trains on to its end on the new number.
#[test]
fn a_geo_checkpoint_continues_on_another_number_of_trainers_with_fresh_local_states() {
    let dir = tempfile::tempdir().expect("temp dir");
    let run_dir = dir.path().join("geo");
    let run = run_dir.to_str().expect("utf-8");
    #[rustfmt::skip]
    let fresh = flotilla(&[
        "train", "--config", "examples/ctr_ps.toml", "--run-dir", run, "--set", "train.synthetic_samples=20000",
        "--set", "strategy.a_sync=true", "--set", "strategy.a_sync_configs.k_steps=5",
        "--set", "fault_tolerance.checkpoint_every=10", "--set", "cluster.nproc_per_node=2", "--set", "train.steps=20",
    ], &[], 300);
    assert!(fresh.success, "{}", fresh.stderr);
    #[rustfmt::skip]
    let resumed = flotilla(
        &["train", "--resume", run, "--set", "cluster.nproc_per_node=1", "--set", "train.steps=30"],
        &[],
        300,
    );
    assert!(resumed.success, "{}", resumed.stderr);
    assert!(
        resumed
            .stderr
            .contains("the checkpoint holds the local states of another number of trainers"),
        "{}",
        resumed.stderr
    );
    let summary = common::read_summary(&run_dir);
    assert_eq!(
        (summary["trainers"].as_u64(), summary["steps"].as_u64()),
        (Some(1), Some(30))
    );
    assert!(summary["final_loss"].as_f64().is_some_and(f64::is_finite), "{summary}");
}
