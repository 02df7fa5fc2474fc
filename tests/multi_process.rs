//! Real trainer processes over TCP on loopback, started by `flotilla launch`.

mod common;

use common::{
    config, flotilla, free_port_range, local_launch, max_abs_diff, read_params, start_flotilla, train_in_process,
};

const STEPS: &str = "train.steps=20";

#[test]
fn launched_processes_over_shared_memory_equal_in_process_and_single_process_training() {
    launched_job_matches_ground_truth("cluster.shared_memory=true");
}

#[test]
fn launched_processes_over_tcp_equal_in_process_and_single_process_training() {
    launched_job_matches_ground_truth("cluster.shared_memory=false");
}

fn launched_job_matches_ground_truth(transport: &str) {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let port = free_port_range(3).to_string();
    #[rustfmt::skip]
    let args = [
        "launch", "--nnodes", "1", "--nproc_per_node", "2", "--node_ip", "127.0.0.1", "--cluster_node_ips", "127.0.0.1",
        "--started_port", &port, "--", "train", "--config", "config.toml", "--set", STEPS, "--set", transport,
        "--run-dir", run_dir.to_str().unwrap(),
    ];
    let finished = flotilla(&args, &[], 120);
    finished.assert_success("launch failed");
    common::assert_says(&finished.stdout, "[rank 0]", "output is prefixed by rank");
    let summary: serde_json::Value = common::read_summary(&run_dir);
    assert_eq!(summary["world_size"], 2);
    assert_eq!(summary["cluster"], "multi-process");

    // Same ring, same reduction order: bit-identical to the simulated cluster.
    let simulated = train_in_process(config(&[STEPS]));
    assert_eq!(summary["param_checksum"], simulated.summary.param_checksum.as_str());

    // And within the stated tolerance of one process on the global batch
    // (see data_parallel_equivalence.rs for why 1e-5).
    let reference = train_in_process(config(&[STEPS, "cluster.nproc_per_node=1"]));
    let diff = max_abs_diff(&reference.parameters, &read_params(&run_dir.join("params.safetensors")));
    assert!(diff <= 1e-5, "{transport}: max |Δparam| = {diff:e}");
}

#[test]
fn a_launch_without_nproc_per_node_starts_the_configs_ranks_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    #[rustfmt::skip]
    let args = ["launch", "--", "train", "--config", "config.toml", "--set", STEPS, "--run-dir", run_dir.to_str().unwrap()];
    let finished = flotilla(&args, &[], 120);
    assert!(finished.success, "launch failed:\n{}", finished.stderr);
    assert!(
        finished
            .stderr
            .contains("--nproc_per_node not given: 2 process(es) on this node"),
        "{}",
        finished.stderr
    );
    let summary: serde_json::Value = common::read_summary(&run_dir);
    assert_eq!(summary["world_size"], 2, "config.toml's cluster.nproc_per_node");
}

#[test]
fn a_bad_config_is_refused_by_the_launcher_before_anything_starts() {
    let port = free_port_range(3).to_string();
    #[rustfmt::skip]
    let args = ["launch", "--nproc_per_node", "2", "--started_port", &port, "--", "train", "--config", "no-such-file.toml"];
    let finished = flotilla(&args, &[], 60);
    assert!(!finished.success);
    assert!(finished.stderr.contains("no-such-file.toml"), "{}", finished.stderr);
    assert!(
        !finished.stderr.contains("started"),
        "no process was started:\n{}",
        finished.stderr
    );
}

#[test]
fn a_failing_rank_stops_the_launch_with_its_error() {
    let port = free_port_range(3).to_string();
    // Rank 1 fails at once; rank 0 would run for a minute if not stopped.
    let script = r#"if [ "$PADDLE_TRAINER_ID" = 1 ]; then echo "rank one gives up" >&2; exit 3; fi; exec sleep 60"#;
    let started = std::time::Instant::now();
    #[rustfmt::skip]
    let args = ["launch", "--nproc_per_node", "2", "--started_port", &port, "--", "/bin/sh", "-c", script];
    let finished = flotilla(&args, &[], 60);
    assert!(!finished.success);
    assert!(
        finished.stderr.contains("rank 1 failed (exit status: 3)") && finished.stderr.contains("rank one gives up"),
        "{}",
        finished.stderr
    );
    assert!(started.elapsed().as_secs() < 30, "rank 0 was stopped, not waited for");
}

#[test]
fn restarts_resume_from_the_checkpoint_until_they_are_used_up() {
    let port = free_port_range(3).to_string();
    // Every start fails; each says whether it was asked to resume.
    let script = r#"echo "rank $PADDLE_TRAINER_ID resume=${FLOTILLA_RESUME:-no}" >&2; exit 3"#;
    #[rustfmt::skip]
    let args = ["launch", "--nproc_per_node", "2", "--started_port", &port, "--max_restarts", "2", "--", "/bin/sh", "-c", script];
    let finished = flotilla(&args, &[], 60);
    assert!(!finished.success);
    let err = &finished.stderr;
    for expected in [
        "rank 0 resume=no",
        "(restart 1 of 2)",
        "rank 0 resume=1",
        "(restart 2 of 2)",
        "gave up after 2 restart(s)",
    ] {
        assert!(err.contains(expected), "{expected:?} missing:\n{err}");
    }
    assert!(!err.contains("restart 3"), "{err}");
}

#[test]
fn a_rank_that_never_arrives_is_named_by_the_timeout() {
    let port = free_port_range(1);
    let run_dir = tempfile::tempdir().unwrap();
    let finished = flotilla(
        &[
            "run",
            "--role",
            "trainer",
            "--config",
            "config.toml",
            "--set",
            "fault_tolerance.timeout_s=2",
            "--set",
            STEPS,
        ],
        &[
            ("PADDLE_TRAINER_ID", "0".to_string()),
            ("PADDLE_TRAINERS_NUM", "2".to_string()),
            ("FLOTILLA_RUN_DIR", run_dir.path().display().to_string()),
            ("PADDLE_MASTER", format!("127.0.0.1:{port}")),
        ],
        60,
    );
    assert!(!finished.success);
    assert!(finished.stderr.contains("rank 1 never joined"), "{}", finished.stderr);
}

#[test]
fn a_port_in_use_is_reported_with_its_address() {
    let run_dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let master = format!("127.0.0.1:{}", free_port_range(1));
    let finished = flotilla(
        &["run", "--role", "trainer", "--config", "config.toml", "--set", STEPS],
        &[
            ("PADDLE_TRAINER_ID", "0".to_string()),
            ("PADDLE_TRAINERS_NUM", "2".to_string()),
            ("FLOTILLA_RUN_DIR", run_dir.path().display().to_string()),
            ("PADDLE_MASTER", master.clone()),
            ("PADDLE_TRAINER_ENDPOINTS", format!("{addr},127.0.0.1:1")),
        ],
        60,
    );
    assert!(!finished.success);
    assert!(
        finished
            .stderr
            .contains(&format!("cannot bind its data endpoint {addr}")),
        "{}",
        finished.stderr
    );

    let finished = flotilla(
        &["run", "--role", "trainer", "--config", "config.toml", "--set", STEPS],
        &[
            ("PADDLE_TRAINER_ID", "0".to_string()),
            ("PADDLE_TRAINERS_NUM", "2".to_string()),
            ("FLOTILLA_RUN_DIR", run_dir.path().display().to_string()),
            ("PADDLE_MASTER", addr.clone()),
        ],
        60,
    );
    assert!(!finished.success);
    assert!(
        finished
            .stderr
            .contains(&format!("cannot bind the coordinator endpoint {addr}")),
        "{}",
        finished.stderr
    );
}

/// Pids of the ranks a launcher reported starting.
fn started_pids(launcher_stderr: &str) -> Vec<i32> {
    launcher_stderr
        .lines()
        .filter_map(|line| line.split("pid=").nth(1))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .collect()
}

#[test]
fn ctrl_c_reaches_every_rank_and_the_launch_stops() {
    let port = free_port_range(3).to_string();
    let dir = tempfile::tempdir().unwrap();
    let launcher = start_flotilla(
        &local_launch(
            "2",
            &port,
            &[
                "--config",
                "config.toml",
                "--set",
                "train.steps=1000000",
                "--run-dir",
                dir.path().to_str().unwrap(),
            ],
        ),
        &[],
    );
    std::thread::sleep(std::time::Duration::from_secs(2));
    // SAFETY: signalling the launcher this test started and has not reaped.
    unsafe { libc::kill(launcher.child.id() as i32, libc::SIGINT) };
    let finished = launcher.finish(30);
    let pids = started_pids(&finished.stderr);
    // SAFETY: signal 0 only asks whether the pid exists.
    let alive: Vec<i32> = pids
        .iter()
        .copied()
        .filter(|pid| unsafe { libc::kill(*pid, 0) } == 0)
        .collect();
    for pid in &alive {
        // SAFETY: a rank this test's launcher started; ended so no test leaks it.
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
    assert!(!finished.success);
    assert_eq!(
        pids.len(),
        3,
        "the coordinator and both ranks were started:\n{}",
        finished.stderr
    );
    assert!(alive.is_empty(), "ranks {alive:?} outlived the launcher");
    common::assert_says(&finished.stderr, "[rank 0] ", "rank 0 was training");
    assert!(finished.stderr.contains("interrupted"), "{}", finished.stderr);
}

#[test]
fn two_jobs_launched_on_one_host_without_ports_pick_their_own_and_both_finish() {
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let run_dir = |i: usize| dirs[i].path().join("run").display().to_string();
    #[rustfmt::skip]
    let jobs = [
        vec!["launch", "--nproc_per_node", "2", "--", "train", "--config", "config.toml", "--set", STEPS],
        vec!["launch", "--nproc_per_node", "2", "--", "train", "--config", "config.toml", "--set", STEPS],
        vec!["launch-ps", "--server_num", "1", "--worker_num", "1", "--", "train", "--config", "examples/ctr_ps.toml",
             "--set", STEPS],
        vec!["launch-ps", "--server_num", "1", "--worker_num", "1", "--", "train", "--config", "examples/ctr_ps.toml",
             "--set", STEPS],
    ];
    let started: Vec<_> = jobs
        .iter()
        .enumerate()
        .map(|(i, args)| {
            let dir = run_dir(i);
            let args: Vec<&str> = args.iter().copied().chain(["--run-dir", dir.as_str()]).collect();
            start_flotilla(&args, &[])
        })
        .collect();
    for (i, finished) in started.into_iter().map(|job| job.finish(180)).enumerate() {
        finished.assert_success(&format!("job {i}"));
        assert!(
            dirs[i].path().join("run/summary.json").exists(),
            "job {i} wrote no summary"
        );
    }
}

#[test]
fn log_dir_keeps_each_ranks_output_as_paddles_workerlog_files() {
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, logs) = (dir.path().join("run"), dir.path().join("logs"));
    #[rustfmt::skip]
    let args = [
        "launch", "--nproc_per_node", "2", "--log_dir", logs.to_str().unwrap(), "--",
        "train", "--config", "config.toml", "--set", STEPS, "--run-dir", run_dir.to_str().unwrap(),
    ];
    let finished = flotilla(&args, &[], 120);
    assert!(finished.success, "{}\n{}", finished.stdout, finished.stderr);
    let read = |name: &str| std::fs::read_to_string(logs.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(
        read("workerlog.0").contains("param_checksum"),
        "rank 0 prints the summary"
    );
    // Rank 1 prints nothing at the default level: its log exists, empty.
    assert!(logs.join("workerlog.1").is_file());
    assert!(!read("coordinatorlog").is_empty());
    assert!(
        !read("workerlog.0").contains("[rank 0]"),
        "the log holds the lines unprefixed"
    );
}
