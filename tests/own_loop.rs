//! A training loop of the program's own (`examples/own_loop.rs`: its loss, its optimizer, its
//! data) with flotilla's process group and gradient averaging, under `flotilla launch`.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{flotilla, free_port_range, max_abs_diff, read_params, read_summary, start_flotilla, trainer_ranks};

/// The example's binary, which `cargo test` builds beside the tests.
fn own_loop() -> PathBuf {
    let deps = std::env::current_exe().unwrap();
    let profile = deps.parent().and_then(Path::parent).unwrap();
    let program = profile.join("examples").join("own_loop");
    assert!(program.exists(), "{} is not built", program.display());
    program
}

fn summary_mse(run_dir: &Path) -> f64 {
    read_summary(run_dir)["test_mse"].as_f64().unwrap()
}

#[test]
fn the_own_loop_on_two_processes_equals_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let program = own_loop();
    let steps = "train.steps=200";
    let (alone, launched) = (dir.path().join("alone"), dir.path().join("launched"));
    let finished = common::start_program(
        program.to_str().unwrap(),
        &["--run-dir", alone.to_str().unwrap(), "--set", steps],
        &[],
    )
    .finish(60);
    assert!(finished.success, "{}", finished.stderr);

    let port = free_port_range(3).to_string();
    #[rustfmt::skip]
    let args = [
        "launch", "--nproc_per_node", "2", "--started_port", &port, "--",
        program.to_str().unwrap(), "--run-dir", launched.to_str().unwrap(), "--set", steps,
    ];
    let finished = flotilla(&args, &[], 120);
    finished.assert_success("launch failed");
    assert_eq!(read_summary(&launched)["world_size"], 2);
    assert!(
        finished.stderr.contains("[rank 1]") && finished.stderr.contains("joined the process group rank=1"),
        "{}",
        finished.stderr
    );

    // Each rank's loss is the mean over its half of the global batch, and the averaged gradient
    // is the mean of the halves': the gradient of the whole batch's mean, summed in another
    // order, so within 1e-5 per parameter (the tolerance of data_parallel_equivalence.rs).
    let params = |run_dir: &Path| read_params(&run_dir.join("params.safetensors"));
    let diff = max_abs_diff(&params(&alone), &params(&launched));
    assert!(diff <= 1e-5, "max |Δparam| = {diff:e}");
    let (mse, want) = (summary_mse(&launched), summary_mse(&alone));
    assert!((mse - want).abs() <= 1e-4 * want, "test mse {mse} against {want}");
    // It learned: the planted target's variance is about 0.7.
    assert!(mse < 0.05, "test mse {mse}");
}

/// The same loop started by PyTorch's real torchrun (the ranks meet through its agent's store)
/// ends as the loop in one process.
#[test]
fn the_own_loop_under_torchrun_equals_one_process() {
    if !common::installed("torchrun", "PyTorch, in the venv .ci/run makes") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let program = own_loop();
    let steps = "train.steps=200";
    let (alone, launched) = (dir.path().join("alone"), dir.path().join("torchrun"));
    let run = |program: &str, args: &[&str], run_dir: &Path| {
        let mut args = args.to_vec();
        args.extend(["--run-dir", run_dir.to_str().unwrap(), "--set", steps]);
        let env = [("FLOTILLA_TOKEN", common::TEST_TOKEN.to_string())];
        let finished = common::start_program(program, &args, &env).finish(120);
        finished.assert_success(program);
    };
    run(program.to_str().unwrap(), &[], &alone);
    #[rustfmt::skip]
    run("torchrun", &["--standalone", "--nproc-per-node", "2", "--no-python", program.to_str().unwrap()], &launched);
    assert_eq!(read_summary(&launched)["world_size"], 2);
    // As under our launcher: within 1e-5 per parameter.
    let params = |run_dir: &Path| read_params(&run_dir.join("params.safetensors"));
    let diff = max_abs_diff(&params(&alone), &params(&launched));
    assert!(diff <= 1e-5, "max |Δparam| = {diff:e}");
}

/// Launches the example on two ranks into `run_dir` for far more steps than a test waits, and
/// returns once both train: the launcher and the ranks' pids.
fn launch_long_run(run_dir: &Path) -> (common::Started, std::collections::HashMap<usize, i32>) {
    let program = own_loop();
    let port = free_port_range(3).to_string();
    // Heartbeats every 200 ms, a peer dead after 2 s of silence.
    #[rustfmt::skip]
    let args = [
        "launch", "--nproc_per_node", "2", "--started_port", &port, "--",
        program.to_str().unwrap(), "--run-dir", run_dir.to_str().unwrap(), "--set", "train.steps=2000000",
        "--set", "fault_tolerance.heartbeat_interval_ms=200", "--set", "fault_tolerance.heartbeat_misses=10",
    ];
    let launcher = start_flotilla(&args, &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let ranks = loop {
        let ranks = trainer_ranks(launcher.child.id());
        if ranks.len() == 2 || Instant::now() > deadline {
            break ranks;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(ranks.len(), 2, "the ranks started: {ranks:?}");
    // In the middle of training.
    std::thread::sleep(Duration::from_secs(1));
    (launcher, ranks)
}

#[test]
fn a_rank_that_dies_stops_the_others_with_its_name_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let (launcher, ranks) = launch_long_run(&run_dir);
    // SAFETY: a signal to a process this test started.
    unsafe { libc::kill(ranks[&1], libc::SIGKILL) };
    let finished = launcher.finish(60);
    assert!(!finished.success, "{}", finished.stderr);
    common::assert_says(&finished.stderr, "rank 1", "the error names the dead rank");
    assert!(!run_dir.join("params.safetensors").exists());
}

#[test]
fn a_sigterm_stops_both_ranks_after_the_same_step_with_the_model_so_far() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let (launcher, _) = launch_long_run(&run_dir);
    // SAFETY: the launcher this test started; it forwards the signal to both ranks.
    unsafe { libc::kill(launcher.child.id() as i32, libc::SIGTERM) };
    let finished = launcher.finish(60);
    assert!(!finished.success, "{}", finished.stderr);
    assert!(finished.stderr.contains("forwarding SIGTERM"), "{}", finished.stderr);
    assert!(
        finished.stderr.contains("stopped on SIGTERM after step ")
            && finished
                .stderr
                .contains("error: the processes stopped on SIGTERM (preemption)"),
        "{}",
        finished.stderr
    );
    assert!(run_dir.join("params.safetensors").exists());
    assert!(!run_dir.join("summary.json").exists(), "the run did not end");
}

#[test]
fn a_group_of_two_started_without_a_launcher_says_how_to_start_it() {
    let dir = tempfile::tempdir().unwrap();
    let program = own_loop();
    let finished = common::start_program(
        program.to_str().unwrap(),
        &[
            "--set",
            "cluster.nproc_per_node=2",
            "--run-dir",
            "/nonexistent/never-written",
        ],
        &[],
    )
    .finish(30);
    assert!(!finished.success);
    assert!(
        finished
            .stderr
            .contains("a process group of 2 ranks needs this process's rank (PADDLE_TRAINER_ID or RANK)")
            && finished
                .stderr
                .contains("flotilla launch --nproc_per_node 2 -- PROGRAM"),
        "{}",
        finished.stderr
    );
    assert!(!dir.path().join("run").join("params.safetensors").exists());
}
