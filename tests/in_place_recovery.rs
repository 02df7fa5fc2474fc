//! In-place recovery of launched data-parallel and pipeline jobs: the coordinator runs as a process of its
//! own; when a rank is lost (killed, or stopped and declared dead by its missed heartbeats) only
//! that rank is restarted, the survivors roll back inside their own processes to the newest
//! committed checkpoint, and the job ends bitwise equal to a run that was never interrupted. A
//! lost coordinator is restarted alone while the trainers train on.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{
    children_of, config, end_leftovers, free_port_range, pick, start_flotilla, train_in_process, trainer_ranks,
    wait_for_commit, PIPELINE_2X2,
};

/// A launched job that recovers in place, and the settings of its uninterrupted in-process twin.
struct Job {
    ranks: usize,
    settings: &'static [&'static str],
    steps: usize,
    /// Its checkpoint interval.
    every: usize,
}

/// Three data-parallel ranks, a few seconds of training.
const DATA_PARALLEL: Job = Job {
    ranks: 3,
    settings: &["cluster.nproc_per_node=3", "train.batch_size=48"],
    steps: 4000,
    every: 500,
};

/// Two pipeline replicas of two stages (1F1B, 4 micro-batches).
const PIPELINE: Job = Job {
    ranks: 4,
    settings: &PIPELINE_2X2,
    steps: 1500,
    every: 250,
};

impl Job {
    /// Its settings and length as `--set` values.
    fn sets(&self) -> Vec<String> {
        let mut sets: Vec<String> = self.settings.iter().map(|s| s.to_string()).collect();
        sets.push(format!("train.steps={}", self.steps));
        sets
    }
}

/// Which process is hurt.
#[derive(Clone, Copy, Debug)]
enum Victim {
    Rank(usize),
    Coordinator,
}

/// What a hurt launch left to check.
struct Hurt {
    stderr: String,
    summary: serde_json::Value,
    /// The survivors' pids before the fault, and the launcher's children once the lost process
    /// was replaced.
    survivors: HashMap<usize, i32>,
    replaced: Vec<i32>,
}

/// The coordinator among the launcher's children: the one without a rank.
fn coordinator_pid(launcher: u32) -> i32 {
    let ranks = trainer_ranks(launcher);
    let others: Vec<i32> = children_of(launcher)
        .into_iter()
        .filter(|pid| !ranks.values().any(|p| p == pid))
        .collect();
    assert_eq!(
        others.len(),
        1,
        "one coordinator among the launcher's children: {others:?}"
    );
    others[0]
}

/// Waits (at most 60 s) until the launcher has `ranks + 1` children again, none of them `gone`.
fn wait_for_replacement(launcher: u32, ranks: usize, gone: i32) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let children = children_of(launcher);
        if children.len() == ranks + 1 && !children.contains(&gone) {
            return children;
        }
        assert!(Instant::now() < deadline, "no replacement of pid {gone}: {children:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Launches `job` with `extra` settings, sends `signal` to `victim` after the checkpoint of
/// a step picked at random, and waits for the job to end (at most 180 s).
fn launch_and_hurt(job: &Job, victim: Victim, signal: i32, extra: &[&str]) -> Hurt {
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, checkpoints) = (dir.path().join("run"), dir.path().join("checkpoints"));
    let port = free_port_range(job.ranks as u16 + 1).to_string();
    let mut settings = job.sets();
    settings.extend(extra.iter().map(|s| s.to_string()));
    settings.extend([
        format!("fault_tolerance.checkpoint_every={}", job.every),
        format!("fault_tolerance.checkpoint_dir={}", checkpoints.display()),
        "fault_tolerance.max_restarts=2".to_string(),
        "fault_tolerance.heartbeat_interval_ms=200".to_string(),
    ]);
    #[rustfmt::skip]
    let ranks = job.ranks.to_string();
    #[rustfmt::skip]
    let mut args = vec!["launch", "--nproc_per_node", &ranks, "--started_port", &port, "--", "train",
        "--run-dir", run_dir.to_str().unwrap()];
    for set in &settings {
        args.extend(["--set", set.as_str()]);
    }
    let launcher = start_flotilla(&args, &[]);
    let pid = launcher.child.id();
    let at = job.every * (1 + pick(3));
    eprintln!("signal {signal} to {victim:?} after the checkpoint of step {at}");
    wait_for_commit(&checkpoints, at);
    let ranks = trainer_ranks(pid);
    assert_eq!(ranks.len(), job.ranks, "the launcher's trainers: {ranks:?}");
    let target = match victim {
        Victim::Rank(rank) => ranks[&rank],
        Victim::Coordinator => coordinator_pid(pid),
    };
    let survivors: HashMap<usize, i32> = ranks.into_iter().filter(|&(_, p)| p != target).collect();
    // SAFETY: a pid of a process this test's launcher started and still supervises.
    unsafe {
        libc::kill(target, signal);
    }
    let replaced = wait_for_replacement(pid, job.ranks, target);
    let started = children_of(pid);
    let finished = launcher.finish(180);
    end_leftovers(started);
    assert!(finished.success, "the job did not survive:\n{}", finished.stderr);
    let summary = serde_json::from_str(&std::fs::read_to_string(run_dir.join("summary.json")).unwrap()).unwrap();
    Hurt {
        stderr: finished.stderr,
        summary,
        survivors,
        replaced,
    }
}

/// The run ends as the same job uninterrupted in one process: the same rings, summation order
/// and optimizer state, resumed at a step boundary, give the same bits.
fn equals_uninterrupted(job: &Job, summary: &serde_json::Value) {
    let sets = job.sets();
    let uninterrupted = train_in_process(config(&sets.iter().map(String::as_str).collect::<Vec<_>>()));
    assert_eq!(summary["steps"], job.steps);
    assert_eq!(summary["param_checksum"], uninterrupted.summary.param_checksum.as_str());
    assert_eq!(
        summary["final_loss"].as_f64().unwrap() as f32,
        uninterrupted.summary.final_loss,
        "the loss history is restored too"
    );
}

/// Only the lost rank was restarted: every survivor kept its process and rolled back in it.
fn survivors_rolled_back_in_place(hurt: &Hurt, lost: usize) {
    let stderr = &hurt.stderr;
    assert!(
        stderr.contains(&format!("restarting rank {lost} alone (restart 1 of 2)")),
        "{stderr}"
    );
    assert!(!stderr.contains("restarting all"), "{stderr}");
    for (rank, pid) in &hurt.survivors {
        assert!(
            hurt.replaced.contains(pid),
            "rank {rank} (pid {pid}) was restarted: {:?}",
            hurt.replaced
        );
        assert!(
            stderr.contains(&format!("[rank {rank}]"))
                && stderr.contains(&format!("rejoined rank={rank} generation=1")),
            "rank {rank} did not roll back in place:\n{stderr}"
        );
    }
    assert!(
        stderr.contains(&format!("[rank {lost}]")) && stderr.contains("resuming from checkpoint step="),
        "the replacement did not load the checkpoint:\n{stderr}"
    );
}

#[test]
fn a_killed_rank_is_replaced_alone_and_the_survivors_roll_back_in_their_processes() {
    let lost = pick(DATA_PARALLEL.ranks);
    let hurt = launch_and_hurt(&DATA_PARALLEL, Victim::Rank(lost), libc::SIGKILL, &[]);
    assert!(
        hurt.stderr.contains(&format!("rank {lost} declared dead")),
        "{}",
        hurt.stderr
    );
    survivors_rolled_back_in_place(&hurt, lost);
    equals_uninterrupted(&DATA_PARALLEL, &hurt.summary);
}

#[test]
fn a_killed_pipeline_stage_is_replaced_alone_and_the_other_stages_roll_back_in_their_processes() {
    let lost = pick(PIPELINE.ranks);
    let hurt = launch_and_hurt(&PIPELINE, Victim::Rank(lost), libc::SIGKILL, &[]);
    assert!(
        hurt.stderr.contains(&format!("rank {lost} declared dead")),
        "{}",
        hurt.stderr
    );
    survivors_rolled_back_in_place(&hurt, lost);
    equals_uninterrupted(&PIPELINE, &hurt.summary);
}

#[test]
fn a_stopped_rank_is_declared_dead_the_survivors_leave_their_collective_and_it_is_replaced() {
    stop_a_rank(&DATA_PARALLEL);
}

#[test]
fn a_stopped_pipeline_stage_is_declared_dead_the_others_leave_their_receives_and_it_is_replaced() {
    stop_a_rank(&PIPELINE);
}

/// SIGSTOP of a random rank of `job`. The link timeout is the default 30 minutes: a survivor
/// that waited it out, rather than leave its all-reduce or stage receive when the coordinator
/// declared the death, would outlast the test.
fn stop_a_rank(job: &Job) {
    let lost = pick(job.ranks);
    let hurt = launch_and_hurt(job, Victim::Rank(lost), libc::SIGSTOP, &[]);
    let stderr = &hurt.stderr;
    assert!(
        stderr.contains(&format!("rank {lost} declared dead: no heartbeat for")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("rank {lost} (pid"))
            && stderr.contains("was declared dead by the coordinator but still runs"),
        "the launcher did not kill the stopped rank:\n{stderr}"
    );
    survivors_rolled_back_in_place(&hurt, lost);
    equals_uninterrupted(job, &hurt.summary);
}

#[test]
fn a_killed_coordinator_is_restarted_alone_and_costs_the_trainers_nothing() {
    kill_the_coordinator(&DATA_PARALLEL);
}

#[test]
fn a_pipelines_killed_coordinator_is_restarted_alone_and_costs_the_stages_nothing() {
    kill_the_coordinator(&PIPELINE);
}

/// SIGKILL of `job`'s coordinator.
fn kill_the_coordinator(job: &Job) {
    let hurt = launch_and_hurt(job, Victim::Coordinator, libc::SIGKILL, &[]);
    let stderr = &hurt.stderr;
    assert!(
        stderr.contains("coordinator failed (signal: 9 (SIGKILL))")
            && stderr.contains("restarting coordinator alone (restart 1 of 2)"),
        "{stderr}"
    );
    assert_eq!(hurt.survivors.len(), job.ranks);
    for (rank, pid) in &hurt.survivors {
        assert!(hurt.replaced.contains(pid), "rank {rank} was restarted");
        assert!(
            stderr.contains(&format!("a rank trains on in its generation rank={rank}")),
            "rank {rank} did not make itself known to the new coordinator:\n{stderr}"
        );
    }
    assert!(!stderr.contains("rolling back"), "{stderr}");
    equals_uninterrupted(job, &hurt.summary);
}

#[test]
fn without_checkpoints_the_survivors_roll_back_to_step_0_from_memory() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let port = free_port_range(DATA_PARALLEL.ranks as u16 + 1).to_string();
    #[rustfmt::skip]
    let mut args = vec!["launch", "--nproc_per_node", "3", "--started_port", &port, "--", "train",
        "--run-dir", run_dir.to_str().unwrap(), "--set", "fault_tolerance.max_restarts=1",
        "--set", "fault_tolerance.heartbeat_interval_ms=200"];
    let sets = DATA_PARALLEL.sets();
    for set in &sets {
        args.extend(["--set", set]);
    }
    let launcher = start_flotilla(&args, &[]);
    common::wait_for_training(&run_dir);
    let ranks = trainer_ranks(launcher.child.id());
    let lost = pick(DATA_PARALLEL.ranks);
    // SAFETY: a pid of a process this test's launcher started and still supervises.
    unsafe {
        libc::kill(ranks[&lost], libc::SIGKILL);
    }
    let started = children_of(launcher.child.id());
    let finished = launcher.finish(180);
    end_leftovers(started);
    let stderr = &finished.stderr;
    assert!(finished.success, "{stderr}");
    assert!(stderr.contains("generation 1 resumes from step 0"), "{stderr}");
    assert!(
        stderr.contains("rejoined") && stderr.contains("resume_step=0"),
        "{stderr}"
    );
    let summary = serde_json::from_str(&std::fs::read_to_string(run_dir.join("summary.json")).unwrap()).unwrap();
    equals_uninterrupted(&DATA_PARALLEL, &summary);
}

#[test]
fn a_replacement_started_with_another_config_is_refused_naming_the_key_and_the_job_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, rogue_dir) = (dir.path().join("run"), dir.path().join("rogue"));
    let port = free_port_range(DATA_PARALLEL.ranks as u16 + 1);
    let started_port = port.to_string();
    let credentials = [
        ("FLOTILLA_TOKEN", common::TEST_TOKEN.to_string()),
        ("FLOTILLA_JOB_ID", "a job one process joins wrongly".to_string()),
    ];
    #[rustfmt::skip]
    let mut args = vec!["launch", "--nproc_per_node", "3", "--started_port", &started_port, "--", "train",
        "--run-dir", run_dir.to_str().unwrap(), "--set", "fault_tolerance.heartbeat_interval_ms=200"];
    let sets = DATA_PARALLEL.sets();
    for set in &sets {
        args.extend(["--set", set]);
    }
    let launcher = start_flotilla(&args, &credentials);
    common::wait_for_training(&run_dir);
    // Rank 1 again, with the job's token and id but another learning rate.
    #[rustfmt::skip]
    let mut rogue_args = vec!["run", "--role", "trainer", "--run-dir", rogue_dir.to_str().unwrap(),
        "--set", "train.lr=0.1"];
    for set in &sets {
        rogue_args.extend(["--set", set]);
    }
    let mut rogue_env = credentials.to_vec();
    rogue_env.extend([
        ("PADDLE_TRAINER_ID", "1".to_string()),
        ("PADDLE_TRAINERS_NUM", DATA_PARALLEL.ranks.to_string()),
        ("PADDLE_MASTER", format!("127.0.0.1:{port}")),
    ]);
    let rogue = start_flotilla(&rogue_args, &rogue_env).finish(60);
    let started = children_of(launcher.child.id());
    let finished = launcher.finish(180);
    end_leftovers(started);
    assert!(!rogue.success);
    assert!(
        rogue.stderr.contains("rank 1 was started for another job:")
            && rogue.stderr.contains("train.lr = 0.1, the job has 0.05"),
        "{}",
        rogue.stderr
    );
    let stderr = &finished.stderr;
    assert!(finished.success, "{stderr}");
    assert!(
        !stderr.contains("declared dead"),
        "the refused process cost the job a rank:\n{stderr}"
    );
    let summary = serde_json::from_str(&std::fs::read_to_string(run_dir.join("summary.json")).unwrap()).unwrap();
    equals_uninterrupted(&DATA_PARALLEL, &summary);
}
