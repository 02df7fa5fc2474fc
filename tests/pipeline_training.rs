//! Pipeline training of whole runs in a simulated cluster: every schedule, alone and with data
//! parallelism across replicas of the pipeline, against one process on the global batch.

mod common;

use common::{config, max_abs_diff, train_in_process};

const STEPS: &str = "train.steps=20";
const MODEL: &str = "train.hidden_sizes=[64, 32, 32]";

/// After 20 steps of SGD with momentum, parameters agree to f32 rounding: the stages sum
/// micro-batch means and the replicas average, where the reference takes one mean (the same
/// bound, for the same reason, as the data-parallel equivalence tests).
const TOLERANCE: f32 = 1e-5;

#[test]
fn pipelines_and_hybrid_pipelines_train_like_one_process() {
    let reference = train_in_process(config(&[STEPS, MODEL, "cluster.nproc_per_node=1"]));
    // (dp_degree, pp_degree, schedule)
    for (dp, pp, schedule) in [
        (1, 2, "schedule_mode=\"FThenB\""),
        (1, 4, "schedule_mode=\"1F1B\""),
        (1, 2, "virtual_pipeline_stages=2"),
        (2, 2, "schedule_mode=\"1F1B\""),
        (2, 2, "schedule_mode=\"FThenB\""),
    ] {
        let layout = [
            format!("cluster.nproc_per_node={}", dp * pp),
            format!("strategy.hybrid_configs.dp_degree={dp}"),
            format!("strategy.hybrid_configs.pp_degree={pp}"),
            format!("strategy.pipeline_configs.{schedule}"),
        ];
        let mut overrides = vec![
            STEPS,
            MODEL,
            "strategy.pipeline=true",
            "strategy.pipeline_configs.accumulate_steps=4",
        ];
        overrides.extend(layout.iter().map(String::as_str));
        let outcome = train_in_process(config(&overrides));
        assert_eq!(outcome.summary.strategy, "pipeline");
        let diff = max_abs_diff(&reference.parameters, &outcome.parameters);
        assert!(diff <= TOLERANCE, "{layout:?}: max |Δparam| = {diff:e}");
        let (loss, want) = (outcome.summary.final_loss, reference.summary.final_loss);
        assert!((loss - want).abs() <= 1e-4, "{layout:?}: final loss {loss} vs {want}");
    }
}

#[test]
fn more_stages_than_blocks_is_an_error_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let options = flotilla::job::RunOptions {
        run_dir: dir.path().to_path_buf(),
        show_progress: false,
    };
    let job = flotilla::job::TrainingJob::builtin(config(&[
        "train.hidden_sizes=[16]",
        "strategy.pipeline=true",
        "cluster.nproc_per_node=4",
        "strategy.hybrid_configs.pp_degree=4",
    ]))
    .unwrap();
    let err = format!("{:#}", job.run_simulated(&options).unwrap_err());
    assert!(
        err.contains("4 pipeline stages need at least 4 blocks, the model has 2"),
        "{err}"
    );
}

#[test]
fn a_character_gpt_trains_in_a_hybrid_pipeline_like_one_process() {
    let gpt = [
        "train.model=\"gpt\"",
        "train.dataset=\"text\"",
        "train.gpt.n_layer=2",
        "train.gpt.n_head=2",
        "train.gpt.n_embd=16",
        "train.gpt.block_size=16",
        "train.batch_size=16",
        "train.steps=4",
        "train.test_fraction=0.002",
    ];
    let mut single = gpt.to_vec();
    single.push("cluster.nproc_per_node=1");
    let reference = train_in_process(config(&single));
    let mut hybrid = gpt.to_vec();
    hybrid.extend([
        "strategy.pipeline=true",
        "cluster.nproc_per_node=4",
        "strategy.hybrid_configs.dp_degree=2",
        "strategy.hybrid_configs.pp_degree=2",
        "strategy.pipeline_configs.accumulate_steps=2",
    ]);
    let outcome = train_in_process(config(&hybrid));
    let diff = max_abs_diff(&reference.parameters, &outcome.parameters);
    assert!(diff <= TOLERANCE, "max |Δparam| = {diff:e}");
    // Next-character accuracy over every position of the held-out windows (the pipeline
    // evaluates whole micro-batches per replica, so it may leave out a few windows).
    let (accuracy, want) = (outcome.summary.test_accuracy, reference.summary.test_accuracy);
    assert!(
        (accuracy - want).abs() < 0.02 && accuracy > 0.05,
        "{accuracy} vs {want}"
    );
}
