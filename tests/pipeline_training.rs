//! Pipeline training of whole runs in a simulated cluster: every schedule, alone and with data
//! parallelism across replicas of the pipeline, against one process on the global batch.

mod common;

use common::{config, max_abs_diff, run_error, train_in_process};
use flotilla::job::RunOutcome;

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
        (2, 2, "pp_allreduce_in_optimize=true"),
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

/// A stage's replicas average through the one gradient path of collective replicas: buckets cut
/// in the order the schedule finishes the gradients, each all-reduced while the schedule goes
/// on. With two replicas every element is one addition of two values, which commutes, so how the
/// buckets are cut and when they go cannot change a bit: many small buckets, one bucket, and
/// all of them after the schedule (`pp_allreduce_in_optimize`) end with the same parameters —
/// for 1F1B and for the interleaved schedule, whose chunks finish out of parameter order. With
/// bfloat16 on the wire they stay within the wire's bound (`engines/comm/wire.rs`) of f32.
#[test]
fn a_stages_replicas_average_alike_whatever_the_buckets_and_the_wire() {
    for schedule in ["schedule_mode=\"1F1B\"", "virtual_pipeline_stages=2"] {
        let schedule = format!("strategy.pipeline_configs.{schedule}");
        let run = |extra: &[&str]| {
            let mut overrides = vec![
                STEPS,
                MODEL,
                "strategy.pipeline=true",
                "strategy.pipeline_configs.accumulate_steps=4",
                "cluster.nproc_per_node=4",
                "strategy.hybrid_configs.dp_degree=2",
                "strategy.hybrid_configs.pp_degree=2",
                schedule.as_str(),
            ];
            overrides.extend_from_slice(extra);
            train_in_process(config(&overrides)).parameters
        };
        let one_bucket = run(&[]);
        for extra in [
            &["strategy.fuse_grad_size_in_MB=0.0005"][..],
            &["strategy.pipeline_configs.pp_allreduce_in_optimize=true"][..],
        ] {
            let diff = max_abs_diff(&one_bucket, &run(extra));
            assert_eq!(diff, 0.0, "{schedule} {extra:?}: max |Δparam| = {diff:e}");
        }
        let diff = max_abs_diff(&one_bucket, &run(&["strategy.fp16_allreduce=true"]));
        assert!(diff > 0.0 && diff < 0.04, "{schedule} bf16: max |Δparam| = {diff:e}");
    }
}

/// Evaluation scores every held-out row under every layout, in pieces of `eval_batch_size`
/// rows: the digits' 359 held-out rows split over 2 replicas (179 and 180 rows), each in pieces
/// of 50 rows (the last 29 or 30) of 4 micro-batches, where whole micro-batches per replica
/// scored 352 before; pieces of 3 rows through an interleaved pipeline; 7-row pieces on 3 ranks.
/// The pipelines' parameters agree with one process's to f32 rounding, so their predictions —
/// and the accuracy — are the single process's (the 3-rank run trains another global batch).
#[test]
fn every_held_out_row_is_scored_in_pieces_under_every_layout() {
    let reference = train_in_process(config(&[STEPS, MODEL, "cluster.nproc_per_node=1"]));
    let rows = reference.summary.test_samples;
    assert!(rows > 300, "{rows} held-out rows");
    let layouts: [&[&str]; 3] = [
        &[
            "cluster.nproc_per_node=3",
            "train.batch_size=66",
            "train.eval_batch_size=7",
        ],
        &[
            "cluster.nproc_per_node=4",
            "strategy.pipeline=true",
            "strategy.pipeline_configs.accumulate_steps=4",
            "strategy.hybrid_configs.dp_degree=2",
            "strategy.hybrid_configs.pp_degree=2",
            "train.eval_batch_size=50",
        ],
        &[
            "cluster.nproc_per_node=2",
            "strategy.pipeline=true",
            "strategy.pipeline_configs.virtual_pipeline_stages=2",
            "strategy.pipeline_configs.accumulate_steps=2",
            "strategy.hybrid_configs.pp_degree=2",
            "train.eval_batch_size=3",
        ],
    ];
    for layout in layouts {
        let outcome = train_in_process(config(&[&[STEPS, MODEL][..], layout].concat()));
        assert_eq!(outcome.summary.test_samples, rows, "{layout:?}");
        if !layout.contains(&"train.batch_size=66") {
            let (accuracy, want) = (accuracy_of(&outcome), accuracy_of(&reference));
            assert!(
                (accuracy - want).abs() <= 1.0 / rows as f64,
                "{layout:?}: {accuracy} vs {want}"
            );
        }
    }
}

#[test]
fn more_stages_than_blocks_is_an_error_naming_both() {
    let err = run_error(config(&[
        "train.hidden_sizes=[16]",
        "strategy.pipeline=true",
        "cluster.nproc_per_node=4",
        "strategy.hybrid_configs.pp_degree=4",
    ]));
    assert!(
        err.contains("4 pipeline stages need at least 4 blocks, the model has 2"),
        "{err}"
    );
}

#[test]
fn a_character_gpt_trains_in_a_hybrid_pipeline_like_one_process() {
    let gpt = [&common::TINY_GPT[..], &["train.steps=4", "train.test_fraction=0.002"]].concat();
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
    // Next-character accuracy over every position of the held-out windows.
    let (accuracy, want) = (accuracy_of(&outcome), accuracy_of(&reference));
    assert!(
        (accuracy - want).abs() < 0.02 && accuracy > 0.05,
        "{accuracy} vs {want}"
    );
}

#[test]
fn the_trace_shows_each_stage_on_its_own_track_in_schedule_order() {
    let dir = tempfile::tempdir().unwrap();
    let trace_dir = dir.path().join("trace");
    let options = flotilla::job::RunOptions {
        trace: Some(trace_dir.clone()),
        ..flotilla::job::RunOptions::new(dir.path().join("run"))
    };
    let job = flotilla::job::TrainingJob::builtin(config(&[
        MODEL,
        "train.steps=2",
        "strategy.pipeline=true",
        "cluster.nproc_per_node=4",
        "strategy.hybrid_configs.dp_degree=2",
        "strategy.hybrid_configs.pp_degree=2",
        "strategy.pipeline_configs.accumulate_steps=4",
    ]))
    .unwrap();
    job.run_simulated(&options).unwrap();
    // One file per rank, and the in-process job's merge of them.
    for rank in 0..4 {
        assert!(trace_dir.join(format!("rank-{rank}.json")).exists(), "rank {rank}");
    }
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(trace_dir.join("trace.json")).unwrap()).unwrap();
    let tracks = common::trace_tracks(&trace);
    assert_eq!(
        tracks
            .iter()
            .map(|(pid, name)| (*pid, name.as_str()))
            .collect::<Vec<_>>(),
        [
            (0, "rank 0: stage 0 (replica 0)"),
            (1, "rank 1: stage 1 (replica 0)"),
            (2, "rank 2: stage 0 (replica 1)"),
            (3, "rank 3: stage 1 (replica 1)")
        ]
    );
    // (rank, name) → (start, end) of its spans, in time order.
    let spans = |pid: u64, name: &str| common::trace_spans(&trace, pid, |n| n == name);
    for pid in 0..4 {
        // Two steps: each runs every micro-batch and waits for its one gradient bucket.
        for (span, count) in [
            ("F0", 2),
            ("F3", 2),
            ("B0", 2),
            ("B3", 2),
            ("wait for bucket 0", 2),
            ("optimizer 1", 1),
        ] {
            assert_eq!(spans(pid, span).len(), count, "{pid} {span}");
        }
    }
    // A micro-batch's forward on stage 1 starts after stage 0 sent it, and its backward on
    // stage 0 after stage 1's backward of it ended.
    let ((_, f0_end), (f1, _)) = (spans(0, "F0")[0], spans(1, "F0")[0]);
    assert!(f1 >= f0_end, "stage 1 F0 at {f1} µs, stage 0 F0 ended at {f0_end}");
    let ((_, b1_end), (b0, _)) = (spans(1, "B2")[0], spans(0, "B2")[0]);
    assert!(b0 >= b1_end, "stage 0 B2 at {b0} µs, stage 1 B2 ended at {b1_end}");
}

#[test]
fn the_gpt_example_trains_and_its_loss_falls() {
    let overrides = ["train.steps=6".to_string(), "train.test_fraction=0.002".to_string()];
    let config = flotilla::config::JobConfig::from_toml_str(
        include_str!("../examples/gpt_pipeline.toml"),
        "examples/gpt_pipeline.toml",
        &|_| None,
        &overrides,
    )
    .unwrap();
    // The model file carries the characters the tokens stand for, in token order.
    let job = flotilla::job::TrainingJob::builtin(config.clone()).unwrap();
    let vocab: String = serde_json::from_str(&job.export.extra["vocab"]).unwrap();
    assert_eq!(vocab.chars().count(), 78);
    assert!(vocab.starts_with("\n !"), "{vocab:?}");
    let outcome = train_in_process(config);
    assert_eq!(
        (outcome.summary.strategy.as_str(), outcome.summary.world_size),
        ("pipeline", 4)
    );
    let (first, last) = (outcome.losses[0], *outcome.losses.last().unwrap());
    // From ln 78 ≈ 4.36 (uniform over the characters) down within a few AdamW steps.
    assert!(first > 4.0 && last < first - 0.3, "loss {first} → {last}");
}

/// Evaluation holds no more than a training step does unless told to: `examples/gpt_pipeline.toml`
/// as a process peaks within 3× of the same run scoring one window at a time, where scoring 256
/// windows a forward pass (the old default) peaked at 15× (1.26 GB against 83 MB).
#[test]
fn gpt_evaluation_peaks_near_training_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let peak = |name: &str, extra: &[&str]| {
        let run_dir = dir.path().join(name);
        let mut args = vec![
            "train",
            "--config",
            "examples/gpt_pipeline.toml",
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--set",
            "train.steps=20",
        ];
        for setting in extra {
            args.extend(["--set", setting]);
        }
        let (succeeded, stderr, peak) = common::flotilla_peak_rss(&args, 300);
        assert!(succeeded, "{stderr}");
        peak
    };
    let training = peak("one-window", &["train.eval_batch_size=1"]);
    let by_default = peak("default", &[]);
    assert!(
        by_default < 3 * training,
        "peak resident set {by_default} B by default against {training} B scoring one window at a time"
    );
}

/// The held-out accuracy of a classification run.
fn accuracy_of(outcome: &RunOutcome) -> f64 {
    outcome
        .summary
        .test_accuracy
        .expect("a classification run reports its accuracy")
}
