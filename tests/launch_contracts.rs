//! Ranks started without our launcher, by the contracts other launchers use: each process reads
//! its rank, the job's size and the coordinator from torchrun's variables, or from Open MPI's or
//! MPICH's when their `mpirun` (Debian's `openmpi-bin` and `mpich`, which CI installs) starts
//! them, and the job trains as the in-process cluster does.

mod common;

use common::{config, free_port_range, installed, start_flotilla, start_program, train_in_process};

const STEPS: &str = "train.steps=20";

#[test]
fn ranks_started_with_torchruns_variables_train_as_the_in_process_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port_range(1).to_string();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let env = [
                ("RANK", rank.to_string()),
                ("LOCAL_RANK", rank.to_string()),
                ("WORLD_SIZE", "2".to_string()),
                ("LOCAL_WORLD_SIZE", "2".to_string()),
                ("MASTER_ADDR", "127.0.0.1".to_string()),
                ("MASTER_PORT", port.clone()),
                ("FLOTILLA_RUN_DIR", dir.path().display().to_string()),
            ];
            let args = ["run", "--role", "trainer", "--config", "config.toml", "--set", STEPS];
            start_flotilla(&args, &env)
        })
        .collect();
    for (rank, finished) in ranks.into_iter().map(|started| started.finish(120)).enumerate() {
        finished.assert_success(&format!("rank {rank}"));
    }
    let summary: serde_json::Value = common::read_summary(dir.path());
    assert_eq!(summary["world_size"], 2);
    assert_eq!(summary["cluster"], "multi-process");
    let simulated = train_in_process(config(&[STEPS]));
    assert_eq!(summary["param_checksum"], simulated.summary.param_checksum.as_str());
    assert_eq!(
        summary["matrix_kernel"],
        flotilla::models::cpu_matrix_kernel(),
        "the kernel recorded"
    );
}

/// An engine (Slurm, Kubernetes) ending a job sends each of its processes one SIGTERM. Ranks
/// still in their rendezvous end with it; the coordinator, which outlives a first SIGTERM so
/// that the checkpoint the ranks stop at can be committed, then awaits no replacement for them
/// and ends too, instead of waiting for the engine's SIGKILL.
#[test]
fn a_coordinator_process_ends_with_the_ranks_a_sigterm_ended_in_their_rendezvous() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port_range(1).to_string();
    let env = |rank: Option<usize>| {
        let mut env = vec![
            ("WORLD_SIZE", "2".to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", port.clone()),
            ("FLOTILLA_RUN_DIR", dir.path().display().to_string()),
            ("FLOTILLA_COORDINATOR_PROCESS", "1".to_string()),
        ];
        env.extend(rank.map(|rank| ("RANK", rank.to_string())));
        env
    };
    // Far longer than the test waits for the coordinator: only the SIGTERM can end it in time.
    let timeout = "fault_tolerance.timeout_s=300";
    let args = |role| ["run", "--role", role, "--config", "config.toml", "--set", timeout];
    let coordinator = start_flotilla(&args("coordinator"), &env(None));
    // Rank 0 of two waits in the rendezvous for rank 1, which never comes. Whether the SIGTERM
    // finds it joined or not yet connected, the coordinator must not wait for it.
    let rank = start_flotilla(&args("trainer"), &env(Some(0)));
    std::thread::sleep(std::time::Duration::from_secs(1));
    for pid in [coordinator.child.id(), rank.child.id()] {
        // SAFETY: a process this test started.
        unsafe {
            libc::kill(pid as i32, libc::SIGTERM);
        }
    }
    let rank = rank.finish(30);
    assert!(!rank.success, "rank 0 ends with the signal");
    let coordinator = coordinator.finish(30);
    assert!(
        coordinator.stderr.contains("no rank of the job runs on"),
        "{}",
        coordinator.stderr
    );
}

#[test]
fn paddles_and_torchruns_variables_that_disagree_are_refused_naming_both() {
    let args = ["run", "--role", "trainer", "--config", "config.toml", "--set", STEPS];
    let env = [
        ("RANK", "0".to_string()),
        ("WORLD_SIZE", "2".to_string()),
        ("PADDLE_TRAINERS_NUM", "4".to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", "6170".to_string()),
    ];
    let finished = start_flotilla(&args, &env).finish(60);
    assert!(!finished.success);
    assert!(
        finished
            .stderr
            .contains("WORLD_SIZE: 2 contradicts PADDLE_TRAINERS_NUM = 4"),
        "{}",
        finished.stderr
    );
    let env = [("RANK", "1".to_string()), ("PADDLE_TRAINER_ID", "0".to_string())];
    let finished = start_flotilla(&args, &env).finish(60);
    assert!(!finished.success);
    assert!(
        finished.stderr.contains("RANK = 1 contradicts PADDLE_TRAINER_ID = 0"),
        "{}",
        finished.stderr
    );
}

#[test]
fn ranks_started_by_open_mpis_mpirun_train_as_the_in_process_cluster() {
    #[rustfmt::skip]
    let flags = ["--allow-run-as-root", "--oversubscribe", "-x", "FLOTILLA_TOKEN", "-x", "FLOTILLA_RUN_DIR"];
    ranks_started_by("mpirun.openmpi", "openmpi-bin", &flags);
}

#[test]
fn ranks_started_by_mpichs_mpirun_train_as_the_in_process_cluster() {
    // Hydra passes the whole environment on.
    ranks_started_by("mpirun.mpich", "mpich", &[]);
}

/// `mpirun -np 4` of `package` (with its `flags`) starts four ranks that read their places
/// from its variables and train as the in-process cluster does.
fn ranks_started_by(mpirun: &str, package: &str, flags: &[&str]) {
    if !installed(mpirun, package) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().display().to_string();
    #[rustfmt::skip]
    let rank = [
        "-np", "4",
        env!("CARGO_BIN_EXE_flotilla"), "run", "--role", "trainer", "--config", "config.toml", "--set", STEPS,
    ];
    let env = [
        ("FLOTILLA_TOKEN", common::TEST_TOKEN.to_string()),
        ("FLOTILLA_RUN_DIR", run_dir),
    ];
    let finished = start_program(mpirun, &[flags, &rank].concat(), &env).finish(180);
    finished.assert_success(&format!("{mpirun} failed"));
    let summary: serde_json::Value = common::read_summary(dir.path());
    assert_eq!(summary["world_size"], 4);
    let simulated = train_in_process(config(&[STEPS, "cluster.nproc_per_node=4"]));
    assert_eq!(summary["param_checksum"], simulated.summary.param_checksum.as_str());
}

/// torchrun's way to a multi-node job: each node's launcher knows only its index and the
/// coordinator's address; the ranks announce their endpoints when they join. Two such
/// launchers on one host are two nodes.
#[test]
fn launchers_given_a_node_rank_and_the_coordinator_train_as_the_in_process_cluster() {
    let port = free_port_range(1).to_string();
    let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let nodes: Vec<_> = (0..2)
        .map(|node| {
            let (node, run_dir) = (node.to_string(), dirs[node].path().join("run"));
            #[rustfmt::skip]
            let args = [
                "launch", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", &node,
                "--master-addr", "127.0.0.1", "--master-port", &port, "--",
                "train", "--config", "config.toml", "--set", STEPS, "--run-dir", run_dir.to_str().unwrap(),
            ];
            let env = [
                ("FLOTILLA_TOKEN", common::TEST_TOKEN.to_string()),
                ("FLOTILLA_JOB_ID", "two nodes by index".to_string()),
            ];
            start_flotilla(&args, &env)
        })
        .collect();
    for (node, finished) in nodes.into_iter().map(|node| node.finish(120)).enumerate() {
        finished.assert_success(&format!("node {node}"));
    }
    let summary: serde_json::Value = common::read_summary(&dirs[0].path().join("run"));
    assert_eq!(summary["world_size"], 2);
    let simulated = train_in_process(config(&[STEPS]));
    assert_eq!(summary["param_checksum"], simulated.summary.param_checksum.as_str());
}

#[test]
fn paddles_run_mode_ps_launches_servers_and_trainers_as_launch_ps_does() {
    let dir = tempfile::tempdir().unwrap();
    let steps = "train.steps=40";
    #[rustfmt::skip]
    let args = [
        "launch", "--run_mode", "ps", "--server_num", "2", "--trainer_num", "2", "--",
        "train", "--config", "examples/ctr_ps.toml", "--set", steps, "--run-dir", dir.path().to_str().unwrap(),
    ];
    let finished = start_flotilla(&args, &[]).finish(240);
    assert!(finished.success, "{}\n{}", finished.stdout, finished.stderr);
    assert!(finished.stderr.contains("[server 1]"), "{}", finished.stderr);
    let summary: serde_json::Value = common::read_summary(dir.path());
    common::ps_matches_uninterrupted(&[steps], &summary, dir.path());
}
