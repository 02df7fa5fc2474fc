//! Faults injected into real jobs: a launched trainer, pipeline stage or parameter-server shard
//! killed (SIGKILL), or a trainer stalled (SIGSTOP), in the middle of a run is found, every process is restarted from the last committed checkpoint,
//! and the job's final parameters equal those of a run that was never interrupted; damaged
//! checkpoints — and ones whose manifest names a path, or whose parameters are not finite
//! under a valid checksum — are skipped for the one before.

mod common;

use std::path::{Path, PathBuf};

use common::{
    children_of, config, end_leftovers, flotilla, free_port_range, pick, ps_matches_uninterrupted,
    start_launched_training, train_in_process, wait_for_commit, wait_for_training, PIPELINE_2X2,
};
use flotilla::job::{Resume, RunOptions, TrainingJob};

/// A launched job to hurt: how it is launched, its settings, how long it runs and how often it
/// checkpoints (long enough, a few seconds launched, that a fault lands mid-run), and which of
/// its processes may be hit (the first `victims`, in start order).
struct Job {
    launcher: &'static [&'static str],
    config: &'static str,
    processes: usize,
    victims: usize,
    settings: &'static [&'static str],
    steps: usize,
    every: usize,
}

const DATA_PARALLEL: Job = Job {
    launcher: &["launch", "--nproc_per_node", "2"],
    config: "config.toml",
    processes: 2,
    victims: 2,
    settings: &[],
    steps: 3000,
    every: 500,
};

const PIPELINE: Job = Job {
    launcher: &["launch", "--nproc_per_node", "4"],
    config: "config.toml",
    processes: 4,
    victims: 4,
    settings: &PIPELINE_2X2,
    steps: 1500,
    every: 250,
};

/// Sync parameter servers; the victim is one of the two shards (started first).
const PARAMETER_SERVER: Job = Job {
    launcher: &["launch-ps", "--server_num", "2", "--worker_num", "2"],
    config: "examples/ctr_ps.toml",
    processes: 4,
    victims: 2,
    settings: &[],
    steps: 240,
    every: 60,
};

/// Launches `job`, which checkpoints every `job.every` steps and may restart once, sends
/// `signal` to one of its processes after a checkpoint, and checks that the job finishes with
/// the outcome of an uninterrupted run. Returns the launcher's stderr.
fn survive(job: &Job, signal: i32, extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, checkpoints) = (dir.path().join("run"), dir.path().join("checkpoints"));
    let port = free_port_range(job.processes as u16 + 1);
    let mut settings: Vec<String> = job.settings.iter().chain(extra).map(|s| s.to_string()).collect();
    settings.extend([
        format!("train.steps={}", job.steps),
        format!("fault_tolerance.checkpoint_every={}", job.every),
        format!("fault_tolerance.checkpoint_dir={}", checkpoints.display()),
        "fault_tolerance.max_restarts=1".to_string(),
        // Whole-job restarts: in-place recovery, the default of launched data-parallel and
        // pipeline jobs, is tested in `in_place_recovery.rs`.
        "fault_tolerance.recovery=restart".to_string(),
    ]);
    let launcher = start_launched_training(job.launcher, port, job.config, &run_dir, &settings);
    let (victim, at) = (pick(job.victims), job.every * (1 + pick(2)));
    eprintln!("signal {signal} to process {victim} (in start order) after the checkpoint of step {at}");
    wait_for_commit(&checkpoints, at);
    let children = children_of(launcher.child.id());
    assert_eq!(children.len(), job.processes, "the launcher's processes: {children:?}");
    // Children start in order, so their pids ascend.
    let mut sorted = children.clone();
    sorted.sort_unstable();
    // SAFETY: a pid of a process this test's launcher started and still supervises.
    unsafe {
        libc::kill(sorted[victim], signal);
    }
    let finished = launcher.finish(180);
    end_leftovers(children);
    finished.assert_success("the job did not survive");
    let restarted = format!("restarting all {} processes (restart 1 of 1)", job.processes);
    assert!(finished.stderr.contains(&restarted), "{}", finished.stderr);
    assert!(
        finished.stderr.contains("resuming from checkpoint step="),
        "{}",
        finished.stderr
    );

    let summary: serde_json::Value = common::read_summary(&run_dir);
    assert_eq!(summary["steps"], job.steps);
    let mut reference: Vec<&str> = job.settings.to_vec();
    let steps = format!("train.steps={}", job.steps);
    reference.push(&steps);
    // Same rings or shards, same summation order, resumed at a step boundary with every
    // optimizer state: bit-identical to an uninterrupted run.
    if job.launcher[0] == "launch-ps" {
        ps_matches_uninterrupted(&reference, &summary, &run_dir);
    } else {
        let uninterrupted = train_in_process(config(&reference));
        assert_eq!(summary["param_checksum"], uninterrupted.summary.param_checksum.as_str());
        let final_loss = summary["final_loss"].as_f64().unwrap();
        assert_eq!(
            final_loss as f32, uninterrupted.summary.final_loss,
            "the loss history is restored too"
        );
    }
    finished.stderr
}

#[test]
fn a_killed_trainer_is_restarted_from_the_checkpoint_and_the_run_equals_an_uninterrupted_one() {
    let stderr = survive(&DATA_PARALLEL, libc::SIGKILL, &[]);
    assert!(stderr.contains("signal: 9 (SIGKILL)"), "{stderr}");
}

#[test]
fn a_killed_parameter_server_shard_is_restarted_from_the_checkpoint_and_the_run_equals_an_uninterrupted_one() {
    let stderr = survive(&PARAMETER_SERVER, libc::SIGKILL, &[]);
    assert!(stderr.contains("signal: 9 (SIGKILL)"), "{stderr}");
}

#[test]
fn a_stalled_parameter_server_shard_is_declared_dead_by_its_missed_heartbeats() {
    let stderr = survive(
        &PARAMETER_SERVER,
        libc::SIGSTOP,
        &[
            "fault_tolerance.heartbeat_interval_ms=200",
            "fault_tolerance.heartbeat_misses=5",
        ],
    );
    // Server 1 stalled is declared dead by the coordinator server 0 hosts; server 0 stalled
    // takes the coordinator with it, which the others find out by their own deadline.
    assert!(
        stderr.contains("server 1 declared dead: no heartbeat for") || stderr.contains("the coordinator at 127.0.0.1"),
        "{stderr}"
    );
}

#[test]
fn a_killed_pipeline_stage_is_restarted_from_the_checkpoint_and_the_run_equals_an_uninterrupted_one() {
    let stderr = survive(&PIPELINE, libc::SIGKILL, &[]);
    assert!(stderr.contains("signal: 9 (SIGKILL)"), "{stderr}");
}

#[test]
fn a_stalled_trainer_is_named_by_the_deadline_and_the_job_rolls_back() {
    let stderr = survive(&DATA_PARALLEL, libc::SIGSTOP, &["fault_tolerance.timeout_s=2"]);
    // A stalled rank 1 is named by rank 0's all-reduce deadline. Rank 0 hosts the coordinator:
    // stopped between committing the checkpoint and answering rank 1's acknowledgement, it
    // leaves rank 1 waiting on the coordinator, not in an all-reduce, and rank 1 finds the
    // coordinator silent by its heartbeat or request deadline.
    let coordinator_silent = ["has not answered a heartbeat", "did not answer within"];
    assert!(
        stderr.contains("timed out after 2.0s waiting for rank")
            || coordinator_silent.iter().any(|s| stderr.contains(s)),
        "{stderr}"
    );
}

#[test]
fn a_stalled_trainer_is_declared_dead_by_its_missed_heartbeats_and_the_job_rolls_back() {
    let stderr = survive(
        &DATA_PARALLEL,
        libc::SIGSTOP,
        &[
            "fault_tolerance.heartbeat_interval_ms=200",
            "fault_tolerance.heartbeat_misses=5",
        ],
    );
    // A stalled rank 1 is declared dead by the coordinator; a stalled rank 0 takes the
    // coordinator with it, which rank 1 finds out by its own deadline.
    assert!(
        stderr.contains("rank 1 declared dead: no heartbeat for") || stderr.contains("the coordinator at 127.0.0.1"),
        "{stderr}"
    );
}

#[test]
fn a_second_run_refused_by_the_first_runs_checkpoints_stops_instead_of_resuming_them() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoints = format!(
        "fault_tolerance.checkpoint_dir={}",
        dir.path().join("checkpoints").display()
    );
    // README's fault-tolerance launch, twice with the same checkpoint directory.
    let launch = |name: &str| {
        let run_dir = dir.path().join(name);
        let port = free_port_range(3).to_string();
        #[rustfmt::skip]
        let args = ["launch", "--nproc_per_node", "2", "--started_port", &port, "--", "train",
            "--run-dir", run_dir.to_str().unwrap(), "--set", "fault_tolerance.checkpoint_every=500",
            "--set", "fault_tolerance.max_restarts=3", "--set", "train.steps=3000", "--set", &checkpoints];
        (flotilla(&args, &[], 180), run_dir)
    };
    let (first, _) = launch("first");
    assert!(first.success, "{}", first.stderr);
    let (second, run_dir) = launch("second");
    let stderr = &second.stderr;
    assert!(
        !second.success,
        "the second run resumed the first's checkpoints:\n{stderr}"
    );
    assert!(
        stderr.contains("already holds checkpoints of an earlier run") && stderr.contains("no restart can help"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("restarting all") && !stderr.contains("resuming from checkpoint"),
        "{stderr}"
    );
    assert!(!run_dir.join("summary.json").exists());
}

/// Launches `job` for its steps into `run_dir`, with `settings`, and waits until it trains.
fn launch_training(job: &Job, run_dir: &Path, settings: &[&str]) -> common::Started {
    // Its processes and the coordinator's.
    let port = free_port_range(job.processes as u16 + 1);
    let steps = format!("train.steps={}", job.steps);
    let settings: Vec<&str> = [steps.as_str()]
        .into_iter()
        .chain(job.settings.iter().chain(settings).copied())
        .collect();
    let launcher = start_launched_training(job.launcher, port, job.config, run_dir, &settings);
    wait_for_training(run_dir);
    launcher
}

#[test]
fn a_restarted_job_without_checkpoints_says_it_starts_again_at_step_0() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let settings = ["fault_tolerance.max_restarts=1", "fault_tolerance.recovery=restart"];
    let launcher = launch_training(&DATA_PARALLEL, &run_dir, &settings);
    let children = children_of(launcher.child.id());
    assert_eq!(children.len(), 2, "the launcher's processes: {children:?}");
    // SAFETY: a pid of a process this test's launcher started and still supervises.
    unsafe {
        libc::kill(children[pick(2)], libc::SIGKILL);
    }
    let finished = launcher.finish(180);
    end_leftovers(children);
    let stderr = &finished.stderr;
    assert!(finished.success, "{stderr}");
    assert!(
        stderr.contains("restarting all 2 processes (restart 1 of 1)"),
        "{stderr}"
    );
    assert!(!stderr.contains("from the last checkpoint"), "{stderr}");
    assert!(
        stderr.contains(
            "no checkpoint to resume from (fault_tolerance.checkpoint_every = 0): training starts again at step 0"
        ),
        "{stderr}"
    );
}

/// Where a preemption test sends its SIGTERM.
enum SigtermTo {
    /// The launcher, which forwards it to every process.
    Launcher,
    /// One of the job's processes, picked at random: the others learn it from the job.
    OneProcess,
}

/// Preemption: a SIGTERM to the launcher reaches every process; the ranks all stop after the
/// same step, commit its checkpoint and exit; `train --resume` then ends as a run never stopped.
#[test]
fn a_sigterm_stops_every_rank_at_a_checkpoint_and_the_resumed_run_equals_an_uninterrupted_one() {
    preempted_run_resumes_as_an_uninterrupted_one(&DATA_PARALLEL, SigtermTo::Launcher);
}

/// A pipeline of two stages, replicated twice: a SIGTERM to any one rank reaches the others on
/// the step's own messages (forward to the stage holding the loss, over the replicas in the
/// gather of the losses, backward to every stage the step after), so all stop after one step.
#[test]
fn a_sigterm_to_one_pipeline_rank_stops_every_stage_at_a_checkpoint_and_the_resumed_run_equals_an_uninterrupted_one() {
    preempted_run_resumes_as_an_uninterrupted_one(&PIPELINE, SigtermTo::OneProcess);
}

/// Sync parameter servers: a SIGTERM to any trainer or shard reaches every trainer in the
/// shards' answers to the next step's pulls; the trainers checkpoint there and leave, and the
/// shards, which outlive their first SIGTERM, go when all have left.
#[test]
fn a_sigterm_to_one_parameter_server_process_stops_every_trainer_at_a_checkpoint_and_the_resumed_run_equals_an_uninterrupted_one(
) {
    preempted_run_resumes_as_an_uninterrupted_one(&PARAMETER_SERVER, SigtermTo::OneProcess);
}

fn preempted_run_resumes_as_an_uninterrupted_one(job: &Job, to: SigtermTo) {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let launcher = launch_training(job, &run_dir, &["fault_tolerance.checkpoint_every=1000"]);
    let children = children_of(launcher.child.id());
    let target = match to {
        SigtermTo::Launcher => launcher.child.id() as i32,
        SigtermTo::OneProcess => {
            let mut roles: Vec<(String, i32)> = common::role_pids(launcher.child.id()).into_iter().collect();
            roles.sort();
            let (role, pid) = roles.swap_remove(pick(roles.len()));
            eprintln!("SIGTERM to {role}");
            pid
        }
    };
    // SAFETY: the launcher this test started, or a process it supervises.
    unsafe {
        libc::kill(target, libc::SIGTERM);
    }
    let finished = launcher.finish(60);
    end_leftovers(children);
    let stderr = &finished.stderr;
    assert!(!finished.success, "{stderr}");
    if let SigtermTo::Launcher = to {
        assert!(stderr.contains("forwarding SIGTERM"), "{stderr}");
    }
    assert!(
        stderr.contains("error: the processes stopped on SIGTERM (preemption), all after the same step"),
        "{stderr}"
    );
    let stopped = "stopped on SIGTERM after step ";
    let steps: Vec<&str> = stderr
        .lines()
        .filter_map(|line| line.split_once(stopped))
        .map(|(_, rest)| rest.split(',').next().unwrap())
        .collect();
    let ranks = job.processes - usize::from(job.launcher[0] == "launch-ps") * 2;
    assert_eq!(steps.len(), ranks, "every rank stops: {stderr}");
    assert!(steps.iter().all(|s| *s == steps[0]), "after the same step: {stderr}");
    let step: usize = steps[0].parse().unwrap();
    assert!((1..job.steps).contains(&step), "{stderr}");
    assert!(
        run_dir
            .join(format!("checkpoints/step-{step:08}/manifest.json"))
            .exists(),
        "the step's checkpoint is committed"
    );
    assert!(!run_dir.join("summary.json").exists());

    let resumed = match job.launcher[0] {
        // The shards and trainers go on where they stopped, as processes again.
        "launch-ps" => {
            let port = free_port_range(job.processes as u16 + 1).to_string();
            let mut args = job.launcher.to_vec();
            args.extend([
                "--started_port",
                &port,
                "--",
                "train",
                "--resume",
                run_dir.to_str().unwrap(),
            ]);
            flotilla(&args, &[], 180)
        }
        _ => flotilla(&["train", "--resume", run_dir.to_str().unwrap()], &[], 120),
    };
    assert!(resumed.success, "{}", resumed.stderr);
    assert!(
        resumed
            .stderr
            .contains(&format!("resuming from checkpoint step={step}")),
        "{}",
        resumed.stderr
    );
    let summary = common::read_summary(&run_dir);
    let steps = format!("train.steps={}", job.steps);
    let mut reference = vec![steps.as_str()];
    reference.extend(job.settings);
    if job.launcher[0] == "launch-ps" {
        ps_matches_uninterrupted(&reference, &summary, &run_dir);
    } else {
        let uninterrupted = train_in_process(config(&reference));
        assert_eq!(summary["param_checksum"], uninterrupted.summary.param_checksum.as_str());
    }
}

/// An in-process 2-rank run of 20 steps with checkpoints every 5 in `checkpoints`.
fn run_with_checkpoints(checkpoints: &Path, run_dir: PathBuf, resume: Resume) -> anyhow::Result<String> {
    let dir = format!("fault_tolerance.checkpoint_dir={}", checkpoints.display());
    let job = TrainingJob::builtin(config(&["train.steps=20", "fault_tolerance.checkpoint_every=5", &dir]))?;
    let outcome = job.run_simulated(&RunOptions {
        resume,
        ..RunOptions::new(run_dir)
    })?;
    Ok(outcome.summary.param_checksum)
}

#[test]
fn a_damaged_checkpoint_is_skipped_for_the_one_before() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoints = dir.path().join("checkpoints");
    let whole = run_with_checkpoints(&checkpoints, dir.path().join("whole"), Resume::Fresh).unwrap();
    let step = |s: usize| checkpoints.join(format!("step-{s:08}")).join("replica.safetensors");

    // One byte flipped in the newest checkpoint, the one before it truncated: the run resumes
    // from step 5 and still ends where the uninterrupted one did.
    let mut bytes = std::fs::read(step(15)).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(step(15), &bytes).unwrap();
    let truncated = std::fs::read(step(10)).unwrap();
    std::fs::write(step(10), &truncated[..truncated.len() - 1]).unwrap();
    let resumed = run_with_checkpoints(
        &checkpoints,
        dir.path().join("resumed"),
        Resume::From(checkpoints.clone()),
    )
    .unwrap();
    assert_eq!(resumed, whole);
    assert!(
        checkpoints.join("step-00000015").exists(),
        "the resumed run checkpoints again"
    );

    // A fresh run does not write into a directory holding another run's checkpoints.
    let err = run_with_checkpoints(&checkpoints, dir.path().join("fresh"), Resume::Fresh).unwrap_err();
    assert!(err.to_string().contains("already holds checkpoints"), "{err}");

    // Nothing intact to resume from is an error, not a fresh start.
    let empty = dir.path().join("empty");
    let err = run_with_checkpoints(&empty, dir.path().join("none"), Resume::From(empty.clone())).unwrap_err();
    assert!(err.to_string().contains("no intact checkpoint"), "{err}");
}

/// The default job trained by the binary for 20 steps into `run_dir`, checkpointing every 5 in
/// `run_dir/checkpoints` (the newest 3 kept: steps 10, 15 and 20).
fn train_with_checkpoints(run_dir: &Path) {
    let run_dir = run_dir.to_str().unwrap();
    #[rustfmt::skip]
    let trained = flotilla(
        &["train", "--run-dir", run_dir, "--set", "train.steps=20", "--set", "fault_tolerance.checkpoint_every=5"],
        &[],
        120,
    );
    assert!(trained.success, "{}", trained.stderr);
}

/// Rewrites the manifest of `step_dir` with `edit`.
fn edit_manifest(step_dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = step_dir.join("manifest.json");
    let mut manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut manifest);
    std::fs::write(&path, serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
}

/// `checkpoint inspect` of `checkpoints` (which must end within 30 s, whatever the manifests
/// name) and a resume of `run_dir` to step 25: both skip the newest checkpoint, step 20, for
/// the one of step 15, saying why with `why`.
fn inspect_and_resume_skip_step_20(run_dir: &Path, why: &str) {
    let checkpoints = run_dir.join("checkpoints");
    let inspected = flotilla(&["checkpoint", "inspect", checkpoints.to_str().unwrap()], &[], 30);
    assert!(inspected.success, "{}", inspected.stderr);
    assert!(inspected.stdout.contains("step 15,"), "{}", inspected.stdout);
    assert!(
        inspected.stdout.contains("skipped newer step 20") && inspected.stdout.contains(why),
        "{}",
        inspected.stdout
    );
    #[rustfmt::skip]
    let resumed = flotilla(&["train", "--resume", run_dir.to_str().unwrap(), "--set", "train.steps=25"], &[], 120);
    assert!(resumed.success, "{}", resumed.stderr);
    assert!(
        resumed.stderr.contains("resuming from checkpoint step=15"),
        "{}",
        resumed.stderr
    );
    assert!(resumed.stderr.contains(why), "{}", resumed.stderr);
}

#[test]
fn a_manifest_naming_a_path_outside_its_step_directory_is_skipped_naming_the_entry() {
    // A device that never ends, a file outside the job, and the same reached by `..`.
    for name in ["/dev/zero", "/etc/passwd", "../../../../../../../../../../etc/passwd"] {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("run");
        train_with_checkpoints(&run_dir);
        let newest = run_dir.join("checkpoints/step-00000020");
        edit_manifest(&newest, |manifest| manifest["files"][0]["name"] = name.into());
        let inspected = flotilla(&["checkpoint", "inspect", newest.to_str().unwrap()], &[], 30);
        assert!(!inspected.success, "{}", inspected.stdout);
        let why = format!("{name:?} is not a plain checkpoint file name");
        assert!(
            inspected.stderr.contains(&newest.display().to_string()) && inspected.stderr.contains(&why),
            "{}",
            inspected.stderr
        );
        inspect_and_resume_skip_step_20(&run_dir, &why);
    }
}

#[test]
fn a_checkpoint_with_a_nan_parameter_under_a_valid_checksum_is_refused_naming_the_tensor_and_step() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    train_with_checkpoints(&run_dir);
    let newest = run_dir.join("checkpoints/step-00000020");
    let file = newest.join("replica.safetensors");
    // One value of the first layer's weights made NaN where the safetensors header places it.
    let mut bytes = std::fs::read(&file).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let start = header["fc0.weight"]["data_offsets"][0].as_u64().unwrap() as usize + 8 + header_len;
    bytes[start + 4..start + 8].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    // Its checksum recomputed as the writer computes it: the file is what the manifest says.
    edit_manifest(&newest, |manifest| {
        let record = &mut manifest["files"][0];
        assert_eq!(record["name"], "replica.safetensors");
        record["crc32c"] = crc32c::crc32c(&bytes).into();
    });
    let inspected = flotilla(&["checkpoint", "inspect", newest.to_str().unwrap()], &[], 30);
    assert!(!inspected.success, "{}", inspected.stdout);
    assert!(
        inspected.stderr.contains("step 20: tensor fc0.weight of")
            && inspected.stderr.contains("holds NaN (element 1)"),
        "{}",
        inspected.stderr
    );
    inspect_and_resume_skip_step_20(&run_dir, "step 20: tensor fc0.weight of");
}
