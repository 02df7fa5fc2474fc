//! Bad configs are rejected before anything starts, naming the key and its
//! source.

mod common;

use common::{flotilla, free_port_range, Finished};

/// The parameter-server example, as a job of a few steps.
const PS_JOB: &str = include_str!("../examples/ctr_ps.toml");

/// `flotilla train` of a config file holding `toml`, with `extra` arguments, to its end.
fn train_on(toml: &str, extra: &[&str]) -> Finished {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.toml");
    std::fs::write(&path, toml).unwrap();
    let run_dir = dir.path().join("run");
    let mut args = vec![
        "train",
        "--config",
        path.to_str().unwrap(),
        "--run-dir",
        run_dir.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    flotilla(&args, &[], 60)
}

fn train_with(toml: &str, extra: &[&str]) -> String {
    let finished = train_on(toml, extra);
    assert!(!finished.success, "should fail:\n{}", finished.stdout);
    finished.stderr
}

/// The stderr of a process that must have refused to start: exit status 78, no panic.
fn refusal(finished: Finished) -> String {
    assert_eq!(
        finished.code,
        Some(78),
        "should be refused:\n{}\n{}",
        finished.stdout,
        finished.stderr
    );
    assert!(!finished.stderr.contains("panicked"), "{}", finished.stderr);
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
    // Paddle's amp defaults to float16, which runs on GPUs and is not built yet.
    let err = train_with("", &["--set", "strategy.amp=true"]);
    assert!(
        err.contains("strategy.amp_configs.use_bf16") && err.contains("float16") && err.contains("not built yet"),
        "{err}"
    );
    let err = train_with(
        "",
        &[
            "--set",
            "strategy.sharding=true",
            "--set",
            "strategy.sharding_configs.stage=3",
            "--set",
            "strategy.pipeline=true",
            "--set",
            "strategy.hybrid_configs.pp_degree=2",
        ],
    );
    assert!(
        err.contains(
            "strategy.sharding_configs.stage: 3 (the parameters sharded too) inside pipeline stages \
             (strategy.pipeline = true) is not supported yet: use 1"
        ),
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
    let run_dir = tempfile::tempdir().unwrap();
    let finished = flotilla(
        &["run", "--role", "trainer"],
        &[("FLOTILLA_RUN_DIR", run_dir.path().display().to_string())],
        30,
    );
    assert!(
        !finished.success && finished.stderr.contains("flotilla launch"),
        "{}",
        finished.stderr
    );
}

#[test]
fn a_role_with_a_token_too_short_to_be_a_secret_is_refused() {
    let run_dir = tempfile::tempdir().unwrap();
    let finished = flotilla(
        &["run", "--role", "trainer", "--config", "config.toml"],
        &[
            ("FLOTILLA_RUN_DIR", run_dir.path().display().to_string()),
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

/// Values that pass a type check but would overflow a deadline or abort on an allocation are
/// refused naming the key and the allowed range, in a collective and an in-process
/// parameter-server job alike.
#[test]
fn durations_past_the_clock_and_models_past_memory_are_refused_by_key() {
    for job in ["", PS_JOB] {
        for (sets, expected) in [
            (
                &["fault_tolerance.timeout_s=1.8e19"][..],
                "fault_tolerance.timeout_s: must be in (0, 2592000] seconds",
            ),
            (
                &[
                    "fault_tolerance.heartbeat_interval_ms=9223372036854775807",
                    "fault_tolerance.heartbeat_misses=4294967295",
                ][..],
                "fault_tolerance.heartbeat_interval_ms: must be in [10, 2592000000] ms",
            ),
            (
                &["fault_tolerance.heartbeat_misses=4294967295"][..],
                "fault_tolerance.heartbeat_misses: heartbeat_interval_ms × heartbeat_misses",
            ),
            (
                &["train.hidden_sizes=[4000000000]"][..],
                "train.hidden_sizes: the job needs at least",
            ),
        ] {
            let mut args = vec!["--set", "train.steps=2"];
            for set in sets {
                args.extend(["--set", set]);
            }
            let err = train_with(job, &args);
            assert!(err.contains(expected), "{sets:?}: {err}");
            assert!(!err.contains("panicked"), "{sets:?}: {err}");
        }
    }
}

/// A run length in epochs too long to count in steps is refused by key, in a collective, a
/// pipeline and a parameter-server job, instead of wrapping or reserving a record for it.
#[test]
fn epochs_beyond_any_step_count_are_refused_by_key() {
    let pipeline = ["strategy.pipeline=true", "strategy.hybrid_configs.pp_degree=2"];
    for (job, extra) in [("", &[][..]), ("", &pipeline[..]), (PS_JOB, &[][..])] {
        let mut args = vec!["--set", "train.epochs=9223372036854775807"];
        for set in extra {
            args.extend(["--set", set]);
        }
        let err = refusal(train_on(job, &args));
        assert!(
            err.contains("train.epochs = 9223372036854775807: with"),
            "{extra:?}: {err}"
        );
    }
}

#[test]
fn an_integer_too_large_for_set_is_out_of_range() {
    let err = train_with("", &["--set", "train.steps=99999999999999999999"]);
    assert!(
        err.contains("--set: train.steps: 99999999999999999999 is out of range for a 64-bit integer"),
        "{err}"
    );
}

/// `launch-ps --worker_num` is an environment variable to the roles, and the environment
/// outranks the file's `cluster.nproc_per_node`.
#[test]
fn launch_ps_worker_num_outranks_the_files_trainers_per_node() {
    let dir = tempfile::tempdir().unwrap();
    let (config, run_dir) = (dir.path().join("job.toml"), dir.path().join("run"));
    std::fs::write(&config, PS_JOB.replace("server_num = 2\n", "nproc_per_node = 2\n")).unwrap();
    let port = free_port_range(6).to_string();
    #[rustfmt::skip]
    let args = [
        "launch-ps", "--server_num", "1", "--worker_num", "3", "--started_port", &port, "--",
        "train", "--config", config.to_str().unwrap(), "--set", "train.steps=3",
        "--set", "train.batch_size=48", "--set", "train.synthetic_samples=2000",
        "--run-dir", run_dir.to_str().unwrap(),
    ];
    let finished = flotilla(&args, &[], 240);
    assert!(finished.success, "launch-ps failed:\n{}", finished.stderr);
    let summary: serde_json::Value = common::read_summary(&run_dir);
    assert_eq!(summary["trainers"].as_u64(), Some(3));
}

/// More roles on a node than the host has threads or open files for are refused by key and
/// limit before any starts, in a collective and a parameter-server job. Ten million of either
/// is past any host: the kernel gives out at most 4194304 pids.
#[test]
fn roles_past_the_host_s_limits_are_refused_by_key_and_limit() {
    for key in ["cluster.nproc_per_node", "cluster.server_num"] {
        let err = refusal(train_on("", &["--set", &format!("{key}=10000000")]));
        assert!(
            err.contains(&format!("--set: {key}: the roles of one node need at least"))
                && err.contains("threads")
                && err.contains("this host allows ("),
            "{err}"
        );
    }
}

/// A config file is read up to 1 MiB: a larger one, or one without end, is refused naming it.
#[test]
fn a_config_file_past_a_mebibyte_or_endless_is_refused_naming_it() {
    let comment = format!("#{}\n", " ".repeat(1 << 20));
    let err = refusal(train_on(&comment, &["--set", "train.steps=1"]));
    assert!(
        err.contains("job.toml: cannot read config file: more than 1 MiB"),
        "{err}"
    );
    let err = refusal(flotilla(&["train", "--config", "/dev/zero"], &[], 60));
    assert!(
        err.contains("/dev/zero: cannot read config file: more than 1 MiB"),
        "{err}"
    );
}

/// Paddle's `--devices` names GPUs: a build without CUDA refuses it, naming the flag, instead
/// of training on the CPU.
#[test]
#[cfg(not(feature = "cuda"))]
fn launch_devices_in_a_build_without_cuda_is_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    #[rustfmt::skip]
    let args = [
        "launch", "--devices", "0,1", "--", "train", "--set", "train.steps=2",
        "--run-dir", run_dir.to_str().unwrap(),
    ];
    let err = refusal(flotilla(&args, &[], 60));
    assert!(
        err.contains(
            "--devices 0,1 sets cluster.device = \"gpu\": built without CUDA support; rebuild with --features cuda"
        ),
        "{err}"
    );
}

/// A world size on the command line outranks the file's `nproc_per_node` (as a launcher's
/// `PADDLE_TRAINERS_NUM` does) and says so, naming both values and their sources.
#[test]
fn a_world_size_set_over_the_files_nproc_per_node_says_which_wins() {
    let finished = flotilla(&["config", "--set", "cluster.world_size=4"], &[], 60);
    assert!(finished.success, "{}", finished.stderr);
    assert!(finished.stdout.contains("nproc_per_node = 4"), "{}", finished.stdout);
    assert!(
        finished
            .stderr
            .contains("cluster.world_size = 4 (--set) sets cluster.nproc_per_node to 4 over 2 (config.toml)"),
        "{}",
        finished.stderr
    );
}

/// What the data or the model refuse once the config is valid — a batch larger than the data
/// set, a recompute checkpoint the model has no block for, a cell that is not a number, a loss
/// of the other kind, settings of a sparse table the model lacks — is a refusal (78), which a
/// launcher does not restart.
#[test]
fn inputs_found_wrong_after_validation_are_refusals_not_failures() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("bad.csv");
    std::fs::write(&csv, "a,b,label\n1,2,0\n1,x,1\n").unwrap();
    let csv_files = format!("train.train_files=[{:?}]", csv.to_str().unwrap());
    let cases: [(&str, Vec<&str>, &str); 5] = [
        (
            "",
            vec!["--set", "train.batch_size=100000"],
            "train.batch_size = 100000",
        ),
        (
            "",
            vec![
                "--set",
                "strategy.recompute=true",
                "--set",
                "strategy.recompute_configs.checkpoints=[\"nosuch\"]",
            ],
            "the model has no block \"nosuch\"",
        ),
        (
            "",
            vec!["--set", "train.dataset=\"csv\"", "--set", &csv_files],
            "\"x\" is not a number",
        ),
        (
            "",
            vec!["--set", "train.loss=\"mse\""],
            "does not fit a data set of class targets",
        ),
        (
            PS_JOB,
            vec!["--set", "strategy.sparse_table_configs.nosuch.count_filter=2"],
            "the model has no sparse table `nosuch`",
        ),
    ];
    for (toml, extra, says) in cases {
        let err = refusal(train_on(toml, &extra));
        assert!(err.contains(says), "{extra:?}: {err}");
    }
}

/// A pipeline cut the model's blocks cannot take — more stages than blocks, boundaries past the
/// last block — is found only once the model is built, and is a refusal (78) naming the key.
#[test]
fn a_stage_cut_the_model_cannot_take_is_a_refusal_naming_the_key() {
    // An MLP of one hidden layer: 2 blocks.
    let two_blocks = "[train]\nhidden_sizes = [8]\nsteps = 2\nbatch_size = 12\n[strategy]\npipeline = true\n";
    let cases: [(&[&str], &str); 2] = [
        (
            &[
                "--set",
                "cluster.nproc_per_node=2",
                "--set",
                "strategy.hybrid_configs.pp_degree=2",
                "--set",
                "strategy.pipeline_configs.stage_boundaries=[7]",
            ],
            "strategy.pipeline_configs.stage_boundaries = [7]",
        ),
        (
            &[
                "--set",
                "cluster.nproc_per_node=3",
                "--set",
                "strategy.hybrid_configs.pp_degree=3",
            ],
            "strategy.hybrid_configs.pp_degree × strategy.pipeline_configs.virtual_pipeline_stages = 3 × 1",
        ),
    ];
    for (extra, key) in cases {
        let err = refusal(train_on(two_blocks, extra));
        assert!(
            err.contains(key) && err.contains("cutting the model into stages"),
            "{extra:?}: {err}"
        );
    }
}

/// A model file that is not there is named as missing, not as a directory without a manifest.
#[test]
fn predict_with_a_missing_model_file_says_no_such_file() {
    let finished = flotilla(
        &[
            "predict",
            "--model",
            "nosuch.safetensors",
            "--data",
            "data/digits/digits.csv",
            "--out",
            "out.csv",
        ],
        &[],
        60,
    );
    assert!(!finished.success);
    assert!(
        finished
            .stderr
            .contains("--model nosuch.safetensors: no such file or directory"),
        "{}",
        finished.stderr
    );
    assert!(!finished.stderr.contains("manifest.json"), "{}", finished.stderr);
}
