//! Bad configs are rejected before anything starts, naming the key and its
//! source.

mod common;

use common::flotilla;

fn train_with(toml: &str, extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.toml");
    std::fs::write(&path, toml).unwrap();
    let mut args = vec![
        "train",
        "--config",
        path.to_str().unwrap(),
        "--run-dir",
        dir.path().to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let finished = flotilla(&args, &[], 60);
    assert!(!finished.success, "should fail:\n{}", finished.stdout);
    finished.stderr
}

#[test]
fn unknown_key_is_named_with_the_file() {
    let err = train_with("[strategy]\nfuse_grad_size = 3\n", &[]);
    assert!(err.contains("job.toml") && err.contains("fuse_grad_size"), "{err}");
}

#[test]
fn type_error_is_named() {
    let err = train_with("[train]\nbatch_size = \"big\"\n", &[]);
    assert!(err.contains("train.batch_size"), "{err}");
}

#[test]
fn world_size_contradiction_is_named() {
    let err = train_with("[cluster]\nnproc_per_node = 2\nworld_size = 3\n", &[]);
    assert!(err.contains("cluster.world_size") && err.contains("3"), "{err}");
}

#[test]
fn strategies_not_built_yet_say_so() {
    let err = train_with("", &["--set", "strategy.sharding=true"]);
    assert!(
        err.contains("strategy.sharding") && err.contains("not supported yet"),
        "{err}"
    );
}

#[test]
fn parameter_server_keys_on_a_collective_job_say_what_they_need() {
    let err = train_with("", &["--set", "strategy.a_sync=true"]);
    assert!(
        err.contains("strategy.a_sync: applies to the parameter-server strategy: set cluster.server_num"),
        "{err}"
    );
}

#[test]
fn trainer_role_without_a_launcher_says_how_to_start_it() {
    let finished = flotilla(&["run", "--role", "trainer"], &[], 30);
    assert!(
        !finished.success && finished.stderr.contains("flotilla launch"),
        "{}",
        finished.stderr
    );
}

#[test]
fn a_role_with_a_token_too_short_to_be_a_secret_is_refused() {
    let finished = flotilla(
        &["run", "--role", "trainer", "--config", "config.toml"],
        &[
            ("PADDLE_TRAINER_ID", "0".to_string()),
            ("PADDLE_MASTER", "127.0.0.1:9".to_string()),
            ("FLOTILLA_TOKEN", "short".to_string()),
        ],
        30,
    );
    assert!(
        !finished.success && finished.stderr.contains("cluster.token") && finished.stderr.contains("16 characters"),
        "{}",
        finished.stderr
    );
}

/// A build without the `cuda` feature, asked for a GPU by the config or by a benchmark, says how
/// to get one.
#[test]
#[cfg(not(feature = "cuda"))]
fn a_gpu_in_a_build_without_cuda_says_to_rebuild() {
    let err = train_with("[cluster]\ndevice = \"gpu\"\n", &[]);
    assert!(
        err.contains("cluster.device") && err.contains("built without CUDA support; rebuild with --features cuda"),
        "{err}"
    );
    let bench = flotilla(
        &[
            "bench",
            "allreduce",
            "--backend",
            "nccl",
            "--nproc",
            "1",
            "--size-mb",
            "1",
        ],
        &[],
        60,
    );
    assert!(!bench.success, "should fail:\n{}", bench.stdout);
    assert!(
        bench.stderr.contains("rebuild with --features cuda"),
        "{}",
        bench.stderr
    );
}
