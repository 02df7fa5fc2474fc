//! Pipeline jobs across processes: `flotilla launch` of a hybrid pipeline (2 replicas × 2
//! stages), its stages linked by rings over TCP or shared memory, against the same job in one
//! process and against one process on the global batch.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use common::{
    config, flotilla, free_port_range, max_abs_diff, read_params, start_flotilla, train_in_process, PIPELINE_2X2,
};
use flotilla::net::auth::{ClusterToken, Credentials};
use flotilla::net::ControlBus;

const STEPS: &str = "train.steps=20";

#[test]
fn a_launched_pipeline_over_shared_memory_equals_in_process_and_single_process_training() {
    launched_pipeline_matches_ground_truth("cluster.shared_memory=true");
}

#[test]
fn a_launched_pipeline_over_tcp_equals_in_process_and_single_process_training() {
    launched_pipeline_matches_ground_truth("cluster.shared_memory=false");
}

fn launched_pipeline_matches_ground_truth(transport: &str) {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let trace = dir.path().join("trace");
    let port = free_port_range(5).to_string();
    let mut args = vec![
        "launch",
        "--nproc_per_node",
        "4",
        "--started_port",
        &port,
        "--",
        "train",
        "--config",
        "config.toml",
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
    ];
    for set in PIPELINE_2X2.iter().chain([&STEPS, &transport]) {
        args.extend(["--set", *set]);
    }
    let finished = flotilla(&args, &[], 180);
    finished.assert_success(&format!("{transport}: launch failed"));
    let summary: serde_json::Value = common::read_summary(&run_dir);
    assert_eq!(summary["strategy"], "pipeline");
    assert_eq!(summary["world_size"], 4);
    assert_eq!(summary["cluster"], "multi-process");
    assert_eq!(summary["steps"], 20);
    // Each rank writes its own timeline, measured on its own clock.
    for rank in 0..4 {
        let path = trace.join(format!("rank-{rank}.json"));
        let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let spans = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X");
        assert_eq!(
            spans.filter(|e| e["cat"] == "forward").count(),
            20 * 4,
            "{}",
            path.display()
        );
    }

    // Merged onto the coordinator's clock, a micro-batch's forward on stage 1 starts after
    // stage 0's forward of it ended, in every step.
    let merged = dir.path().join("merged.json");
    let merging = flotilla(
        &[
            "trace",
            "merge",
            trace.to_str().unwrap(),
            "-o",
            merged.to_str().unwrap(),
        ],
        &[],
        60,
    );
    assert!(merging.success, "{}", merging.stderr);
    let merged: serde_json::Value = serde_json::from_slice(&std::fs::read(&merged).unwrap()).unwrap();
    let forwards = |pid: u64| common::trace_spans(&merged, pid, |n| n == "F0");
    let (stage0, stage1) = (forwards(0), forwards(1));
    assert_eq!((stage0.len(), stage1.len()), (20, 20));
    for (step, ((_, end0), (start1, _))) in stage0.iter().zip(&stage1).enumerate() {
        assert!(
            start1 >= end0,
            "step {step}: stage 1's F0 starts at {start1} µs, before stage 0's ended at {end0} µs"
        );
    }

    // Same stages, same ring all-reduce: bit-identical to the pipeline in one process.
    let mut overrides = PIPELINE_2X2.to_vec();
    overrides.push(STEPS);
    let in_process = train_in_process(config(&overrides));
    assert_eq!(summary["param_checksum"], in_process.summary.param_checksum.as_str());
    let launched = read_params(&run_dir.join("params.safetensors"));
    assert_eq!(max_abs_diff(&in_process.parameters, &launched), 0.0);
    let final_loss = summary["final_loss"].as_f64().unwrap() as f32;
    assert_eq!(
        final_loss, in_process.summary.final_loss,
        "{transport}: the last stage's loss"
    );
    assert_eq!(
        Some(summary["test_accuracy"].clone()),
        in_process.summary.test_accuracy.map(Into::into)
    );
    assert_eq!(
        summary["peak_activation_bytes"],
        serde_json::json!(in_process.summary.peak_activation_bytes)
    );

    // And within f32 rounding of one process on the global batch (see pipeline_training.rs).
    let reference = train_in_process(config(&[STEPS, "cluster.nproc_per_node=1"]));
    let diff = max_abs_diff(&reference.parameters, &launched);
    assert!(diff <= 1e-5, "{transport}: max |Δparam| = {diff:e}");
}

#[test]
fn interleaved_deep_and_one_stage_pipelines_launch_bit_identical_to_in_process() {
    // (dp_degree, pp_degree, schedule): the forward ring's wrap from the last stage to the
    // first (interleaving), four stages in a chain, and one stage looping to itself.
    for (dp, pp, schedule) in [
        (1, 2, "virtual_pipeline_stages=2"),
        (1, 4, "schedule_mode=\"FThenB\""),
        (2, 1, "schedule_mode=\"1F1B\""),
    ] {
        let overrides = [
            STEPS.to_string(),
            "train.hidden_sizes=[64, 32, 32]".to_string(),
            "strategy.pipeline=true".to_string(),
            "strategy.pipeline_configs.accumulate_steps=4".to_string(),
            format!("cluster.nproc_per_node={}", dp * pp),
            format!("strategy.hybrid_configs.dp_degree={dp}"),
            format!("strategy.hybrid_configs.pp_degree={pp}"),
            format!("strategy.pipeline_configs.{schedule}"),
        ];
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("run");
        let (port, nproc) = (free_port_range(dp * pp + 1).to_string(), (dp * pp).to_string());
        let mut args = vec![
            "launch",
            "--nproc_per_node",
            &nproc,
            "--started_port",
            &port,
            "--",
            "train",
        ];
        args.extend(["--config", "config.toml", "--run-dir", run_dir.to_str().unwrap()]);
        for set in &overrides {
            args.extend(["--set", set]);
        }
        let finished = flotilla(&args, &[], 180);
        finished.assert_success(&format!("{overrides:?}: launch failed"));
        let summary: serde_json::Value = common::read_summary(&run_dir);
        let overrides: Vec<&str> = overrides.iter().map(String::as_str).collect();
        let in_process = train_in_process(config(&overrides));
        assert_eq!(
            summary["param_checksum"],
            in_process.summary.param_checksum.as_str(),
            "{overrides:?}"
        );
    }
}

#[test]
fn a_stage_peer_that_never_connects_is_named_by_the_rank_waiting_for_it() {
    // Rank 1 joins the rendezvous announcing an endpoint nobody listens on, then goes silent.
    let master = format!("127.0.0.1:{}", free_port_range(1));
    let run_dir = tempfile::tempdir().unwrap();
    let silent = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    #[rustfmt::skip]
    let rank0 = start_flotilla(
        &[
            "run", "--role", "trainer", "--config", "config.toml", "--set", STEPS,
            "--set", "fault_tolerance.timeout_s=3", "--set", "strategy.pipeline=true",
            "--set", "strategy.hybrid_configs.pp_degree=2",
        ],
        &[
            ("PADDLE_TRAINER_ID", "0".to_string()),
            ("PADDLE_TRAINERS_NUM", "2".to_string()),
            ("PADDLE_MASTER", master.clone()),
            ("FLOTILLA_RUN_DIR", run_dir.path().display().to_string()),
        ],
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (_bus, roster) = runtime.block_on(async {
        let credentials = Credentials::new(ClusterToken::new(common::TEST_TOKEN).unwrap(), Duration::from_secs(30));
        let mut bus = ControlBus::connect(&master, Duration::from_secs(30), 1 << 20, &credentials)
            .await
            .expect("rank 0 hosts the coordinator");
        let roster = bus.join(1, 2, silent.clone(), None, Default::default()).await;
        (bus, roster)
    });
    assert_eq!(roster.unwrap().endpoints[1], silent);
    let finished = rank0.finish(60);
    assert!(!finished.success, "rank 0 cannot train without stage 1");
    assert!(
        finished
            .stderr
            .contains("rank 0 (stage 0 of replica 0): connecting the forward stage ring of replica 0 (ranks [0, 1])")
            && finished.stderr.contains(&silent),
        "{}",
        finished.stderr
    );
}

#[test]
fn a_stage_larger_than_a_frame_hands_its_parameters_to_rank_0_in_pieces() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let port = free_port_range(3).to_string();
    // About 2.4 MB of parameters over two stages, with 1 MiB frames: the final gather of the
    // stages' outcomes cannot travel in one frame.
    let settings = [
        "strategy.pipeline=true",
        "cluster.nproc_per_node=2",
        "strategy.hybrid_configs.pp_degree=2",
        "train.hidden_sizes=[1024, 512]",
        "train.steps=3",
        "cluster.max_frame_mb=1",
    ];
    #[rustfmt::skip]
    let mut args = vec!["launch", "--nproc_per_node", "2", "--started_port", &port, "--", "train", "--config", "config.toml", "--run-dir", run_dir.to_str().unwrap()];
    for set in &settings {
        args.extend(["--set", *set]);
    }
    let finished = flotilla(&args, &[], 180);
    finished.assert_success("launch failed");
    let summary: serde_json::Value = common::read_summary(&run_dir);
    let in_process = train_in_process(config(&settings));
    assert_eq!(summary["param_checksum"], in_process.summary.param_checksum.as_str());
    let launched = read_params(&run_dir.join("params.safetensors"));
    assert_eq!(max_abs_diff(&in_process.parameters, &launched), 0.0);
}
