//! In-place recovery of launched jobs of every strategy — data parallel, pipeline, parameter
//! servers in sync, async and geo mode: the coordinator runs as a process of its own; when a
//! role is lost (killed, or stopped and declared dead by its missed heartbeats) only that role
//! is restarted, the survivors roll back inside their own processes to the newest committed
//! checkpoint, and the job ends bitwise equal to a run that was never interrupted (async and geo:
//! with every trainer's update of every step applied exactly once). A lost coordinator is
//! restarted alone while the roles train on; one stopped for seconds (SIGSTOP, then SIGCONT)
//! wakes to the same job, nobody taken for dead; one that stays stopped is replaced by its
//! launcher.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{
    children_of, config, end_leftovers, free_port_range, pick, ps_matches_uninterrupted, role_pids, start_flotilla,
    start_launched_training, train_in_process, trainer_ranks, wait_for_commit, PIPELINE_2X2,
};

/// A launched job that recovers in place, and the settings of its uninterrupted in-process twin.
struct Job {
    /// The launcher and its process counts.
    launcher: &'static [&'static str],
    config: &'static str,
    /// The roles as the launcher names them (the coordinator aside).
    roles: &'static [&'static str],
    settings: &'static [&'static str],
    steps: usize,
    /// Its checkpoint interval.
    every: usize,
}

/// Three data-parallel ranks, a few seconds of training.
const DATA_PARALLEL: Job = Job {
    launcher: &["launch", "--nproc_per_node", "3"],
    config: "config.toml",
    roles: &["rank 0", "rank 1", "rank 2"],
    settings: &["cluster.nproc_per_node=3", "train.batch_size=48"],
    steps: 4000,
    every: 500,
};

/// The same ranks with sharded states: each keeps a third of AdamW's moments and of the
/// averaged gradients (stage 2).
const SHARDED: Job = Job {
    settings: &[
        "cluster.nproc_per_node=3",
        "train.batch_size=48",
        "train.optimizer=\"adamw\"",
        "train.lr=0.001",
        "strategy.sharding=true",
        "strategy.sharding_configs.stage=2",
    ],
    ..DATA_PARALLEL
};

/// The same ranks with sharded parameters (stage 3): between steps each keeps a third of the
/// parameters besides, gathered a layer at a time where the step runs it.
const SHARDED_PARAMETERS: Job = Job {
    settings: &[
        "cluster.nproc_per_node=3",
        "train.batch_size=48",
        "train.optimizer=\"adamw\"",
        "train.lr=0.001",
        "strategy.sharding=true",
        "strategy.sharding_configs.stage=3",
    ],
    ..DATA_PARALLEL
};

/// Two replicas of an MLP whose layers two ranks split (tensor parallelism).
const SPLIT_LAYERS: Job = Job {
    launcher: &["launch", "--nproc_per_node", "4"],
    roles: &["rank 0", "rank 1", "rank 2", "rank 3"],
    settings: &[
        "cluster.nproc_per_node=4",
        "train.batch_size=48",
        "strategy.hybrid_configs.dp_degree=2",
        "strategy.hybrid_configs.mp_degree=2",
    ],
    steps: 2000,
    every: 250,
    ..DATA_PARALLEL
};

/// Two pipeline replicas of two stages (1F1B, 4 micro-batches).
const PIPELINE: Job = Job {
    launcher: &["launch", "--nproc_per_node", "4"],
    config: "config.toml",
    roles: &["rank 0", "rank 1", "rank 2", "rank 3"],
    settings: &PIPELINE_2X2,
    steps: 1500,
    every: 250,
};

/// Two parameter-server shards and two trainers, in `mode`'s settings.
const fn parameter_servers(settings: &'static [&'static str], every: usize) -> Job {
    Job {
        launcher: &["launch-ps", "--server_num", "2", "--worker_num", "2"],
        config: "examples/ctr_ps.toml",
        roles: &["server 0", "server 1", "trainer 0", "trainer 1"],
        settings,
        steps: 240,
        every,
    }
}

const PS_SYNC: Job = parameter_servers(&[], 40);
const PS_ASYNC: Job = parameter_servers(&["strategy.a_sync=true"], 40);
/// Geo pushes every 8 local steps; its checkpoints fall on pushes.
const PS_GEO: Job = parameter_servers(&["strategy.a_sync=true", "strategy.a_sync_configs.k_steps=8"], 40);

impl Job {
    /// Its settings and length as `--set` values.
    fn sets(&self) -> Vec<String> {
        let mut sets: Vec<String> = self.settings.iter().map(|s| s.to_string()).collect();
        sets.push(format!("train.steps={}", self.steps));
        sets
    }

    fn is_parameter_server(&self) -> bool {
        self.launcher[0] == "launch-ps"
    }

    /// A role picked at random.
    fn any_role(&self) -> &'static str {
        self.roles[pick(self.roles.len())]
    }
}

/// Which process is hurt.
#[derive(Clone, Copy, Debug)]
enum Victim {
    Role(&'static str),
    Coordinator,
}

/// How it is hurt.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// A signal that ends or stops it for good: the launcher replaces it.
    Signal(i32),
    /// SIGSTOP, then SIGCONT this much later (a paused VM, swap, a frozen cgroup): it wakes in
    /// its own process.
    Stall(Duration),
}

/// What a hurt launch left to check.
struct Hurt {
    stderr: String,
    summary: serde_json::Value,
    run_dir: std::path::PathBuf,
    /// The survivors' pids before the fault, by role, and the launcher's children once the lost
    /// process was replaced.
    survivors: HashMap<String, i32>,
    replaced: Vec<i32>,
    _dir: tempfile::TempDir,
}

/// The coordinator among the launcher's children: the one without a role.
fn coordinator_pid(launcher: u32) -> i32 {
    let roles = role_pids(launcher);
    let others: Vec<i32> = children_of(launcher)
        .into_iter()
        .filter(|pid| !roles.values().any(|p| p == pid))
        .collect();
    assert_eq!(
        others.len(),
        1,
        "one coordinator among the launcher's children: {others:?}"
    );
    others[0]
}

/// Waits (at most 60 s) until the launcher has `roles + 1` children again, none of them `gone`.
fn wait_for_replacement(launcher: u32, roles: usize, gone: i32) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let children = children_of(launcher);
        if children.len() == roles + 1 && !children.contains(&gone) {
            return children;
        }
        assert!(Instant::now() < deadline, "no replacement of pid {gone}: {children:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Launches `job` with `extra` settings, hurts `victim` by `fault` after the checkpoint of a
/// step picked at random, and waits for the job to end (at most 180 s).
fn launch_and_hurt(job: &Job, victim: Victim, fault: Fault, extra: &[&str]) -> Hurt {
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, checkpoints) = (dir.path().join("run"), dir.path().join("checkpoints"));
    let port = free_port_range(job.roles.len() as u16 + 1);
    let mut settings = job.sets();
    settings.extend(extra.iter().map(|s| s.to_string()));
    settings.extend([
        format!("fault_tolerance.checkpoint_every={}", job.every),
        format!("fault_tolerance.checkpoint_dir={}", checkpoints.display()),
        "fault_tolerance.max_restarts=2".to_string(),
        "fault_tolerance.heartbeat_interval_ms=200".to_string(),
    ]);
    let launcher = start_launched_training(job.launcher, port, job.config, &run_dir, &settings);
    let pid = launcher.child.id();
    let at = job.every * (1 + pick(3));
    eprintln!("{fault:?} of {victim:?} after the checkpoint of step {at}");
    wait_for_commit(&checkpoints, at);
    let roles = role_pids(pid);
    assert_eq!(roles.len(), job.roles.len(), "the launcher's roles: {roles:?}");
    let target = match victim {
        Victim::Role(role) => roles[role],
        Victim::Coordinator => coordinator_pid(pid),
    };
    let survivors: HashMap<String, i32> = roles.into_iter().filter(|&(_, p)| p != target).collect();
    let signal = |signal| {
        // SAFETY: a pid of a process this test's launcher started and still supervises.
        unsafe { libc::kill(target, signal) };
    };
    let replaced = match fault {
        Fault::Signal(number) => {
            signal(number);
            wait_for_replacement(pid, job.roles.len(), target)
        }
        Fault::Stall(pause) => {
            signal(libc::SIGSTOP);
            std::thread::sleep(pause);
            signal(libc::SIGCONT);
            children_of(pid)
        }
    };
    let started = children_of(pid);
    let finished = launcher.finish(180);
    end_leftovers(started);
    assert!(finished.success, "the job did not survive:\n{}", finished.stderr);
    let summary = common::read_summary(&run_dir);
    Hurt {
        stderr: finished.stderr,
        summary,
        run_dir,
        survivors,
        replaced,
        _dir: dir,
    }
}

/// The run ends as the same job — with the settings `extra` — uninterrupted in one process: the
/// same rings or shards, summation order and optimizer state, resumed at a step boundary, give
/// the same bits.
fn equals_uninterrupted(job: &Job, extra: &[&str], summary: &serde_json::Value, run_dir: &Path) {
    let sets = job.sets();
    let mut sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    sets.extend(extra);
    assert_eq!(summary["steps"], job.steps);
    if job.is_parameter_server() {
        ps_matches_uninterrupted(&sets, summary, run_dir);
        return;
    }
    let uninterrupted = train_in_process(config(&sets));
    assert_eq!(summary["param_checksum"], uninterrupted.summary.param_checksum.as_str());
    assert_eq!(
        summary["final_loss"].as_f64().unwrap() as f32,
        uninterrupted.summary.final_loss,
        "the loss history is restored too"
    );
}

/// Only the lost role was restarted: every survivor kept its process and rolled back in it.
fn survivors_rolled_back_in_place(hurt: &Hurt, lost: &str) {
    let stderr = &hurt.stderr;
    assert!(
        stderr.contains(&format!("restarting {lost} alone (restart 1 of 2)")),
        "{stderr}"
    );
    assert!(!stderr.contains("restarting all"), "{stderr}");
    for (role, pid) in &hurt.survivors {
        assert!(
            hurt.replaced.contains(pid),
            "{role} (pid {pid}) was restarted: {:?}",
            hurt.replaced
        );
        // A trainer or stage rejoins; a shard serves the new generation.
        let rolled_back = stderr.lines().any(|line| {
            line.starts_with(&format!("[{role}]"))
                && line.contains("generation=1")
                && (line.contains("rejoined") || line.contains("serving"))
        });
        assert!(rolled_back, "{role} did not roll back in place:\n{stderr}");
    }
    assert!(
        stderr.contains(&format!("[{lost}]")) && stderr.contains("resuming from checkpoint step="),
        "the replacement did not load the checkpoint:\n{stderr}"
    );
}

/// SIGKILL of a random role of `job`, which ends bitwise equal to the uninterrupted run.
fn kill_a_role(job: &Job) -> Hurt {
    let lost = job.any_role();
    let hurt = launch_and_hurt(job, Victim::Role(lost), Fault::Signal(libc::SIGKILL), &[]);
    assert!(
        hurt.stderr.contains(&format!("{lost} declared dead")),
        "{}",
        hurt.stderr
    );
    survivors_rolled_back_in_place(&hurt, lost);
    hurt
}

#[test]
fn a_killed_rank_is_replaced_alone_and_the_survivors_roll_back_in_their_processes() {
    let hurt = kill_a_role(&DATA_PARALLEL);
    equals_uninterrupted(&DATA_PARALLEL, &[], &hurt.summary, &hurt.run_dir);
}

#[test]
fn a_killed_rank_of_a_sharded_job_is_replaced_alone_and_the_run_ends_as_uninterrupted() {
    let hurt = kill_a_role(&SHARDED);
    equals_uninterrupted(&SHARDED, &[], &hurt.summary, &hurt.run_dir);
}

#[test]
fn a_killed_rank_of_a_job_sharding_its_parameters_is_replaced_alone_and_the_run_ends_as_uninterrupted() {
    let hurt = kill_a_role(&SHARDED_PARAMETERS);
    equals_uninterrupted(&SHARDED_PARAMETERS, &[], &hurt.summary, &hurt.run_dir);
}

#[test]
fn a_killed_rank_of_a_job_splitting_its_layers_is_replaced_alone_and_the_run_ends_as_uninterrupted() {
    let hurt = kill_a_role(&SPLIT_LAYERS);
    equals_uninterrupted(&SPLIT_LAYERS, &[], &hurt.summary, &hurt.run_dir);
}

/// The rows of a planted regression, `y = 2a − b + c/2`, as CSV with a header.
fn regression_csv(rows: std::ops::Range<usize>) -> String {
    let mut text = String::from("a,b,c,y\n");
    for i in rows {
        let [a, b, c] = [(i * 37) % 101, (i * 53) % 97, (i * 71) % 89].map(|v| v as f32 / 50.0 - 1.0);
        text += &format!("{a},{b},{c},{}\n", 2.0 * a - b + 0.5 * c);
    }
    text
}

#[test]
fn a_killed_rank_streaming_its_parts_of_a_table_is_replaced_alone_and_ends_as_uninterrupted() {
    let data = tempfile::tempdir().unwrap();
    let file = |name: &str, rows| {
        let path = data.path().join(name);
        std::fs::write(&path, regression_csv(rows)).unwrap();
        path.display().to_string()
    };
    // One file cut by bytes into a part per rank, read in shuffled windows: the survivors seek
    // back to their marks, the replacement to the position of its part that the checkpoint
    // saved with the state.
    let (train, test) = (file("train.csv", 0..3000), file("test.csv", 5000..5300));
    let extra = [
        "train.dataset=\"csv\"".to_string(),
        format!("train.train_files=[{train:?}]"),
        format!("train.test_files=[{test:?}]"),
        "train.label_column=\"y\"".to_string(),
        "train.loss=\"mse\"".to_string(),
        "train.data_parts=3".to_string(),
        "train.shuffle_buffer=64".to_string(),
    ];
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let lost = DATA_PARALLEL.any_role();
    let hurt = launch_and_hurt(&DATA_PARALLEL, Victim::Role(lost), Fault::Signal(libc::SIGKILL), &extra);
    assert_eq!(hurt.summary["test_samples"], 300, "the table's held-out rows");
    assert!(hurt.summary["test_mse"].is_number(), "{}", hurt.summary);
    assert!(
        !hurt.stderr.contains("reading the data up to the step"),
        "{}",
        hurt.stderr
    );
    let newest = std::fs::read_dir(hurt.run_dir.with_file_name("checkpoints"))
        .unwrap()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.join("replica.safetensors").exists())
        .max()
        .expect("a committed checkpoint");
    let state = std::fs::read(newest.join("replica.safetensors")).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&state).unwrap();
    let saved = &header.metadata().as_ref().unwrap()["data_position"];
    let saved: serde_json::Value = serde_json::from_str(saved).unwrap();
    assert_eq!(
        saved["parts"].as_object().map(|parts| parts.len()),
        Some(3),
        "every rank's part: {saved}"
    );
    survivors_rolled_back_in_place(&hurt, lost);
    equals_uninterrupted(&DATA_PARALLEL, &extra, &hurt.summary, &hurt.run_dir);
}

#[test]
fn a_killed_pipeline_stage_is_replaced_alone_and_the_other_stages_roll_back_in_their_processes() {
    let hurt = kill_a_role(&PIPELINE);
    equals_uninterrupted(&PIPELINE, &[], &hurt.summary, &hurt.run_dir);
}

#[test]
fn a_killed_sync_shard_or_trainer_is_replaced_alone_and_the_others_roll_back_in_their_processes() {
    let hurt = kill_a_role(&PS_SYNC);
    equals_uninterrupted(&PS_SYNC, &[], &hurt.summary, &hurt.run_dir);
}

#[test]
fn a_killed_async_shard_or_trainer_is_replaced_alone_and_no_update_is_lost_or_applied_twice() {
    applied_once(&PS_ASYNC, &kill_a_role(&PS_ASYNC), PS_ASYNC.steps);
}

#[test]
fn a_killed_geo_shard_or_trainer_is_replaced_alone_and_no_update_is_lost_or_applied_twice() {
    // Each trainer pushes its local steps every k_steps = 8 steps.
    applied_once(&PS_GEO, &kill_a_role(&PS_GEO), PS_GEO.steps / 8);
}

/// Async and geo runs cannot be bitwise equal to an uninterrupted one (updates apply in arrival
/// order); what they guarantee is that every shard ends having applied each trainer's push of
/// each step exactly once — the rolled-back ones undone, then pushed again — and that the model
/// learned as well as without the fault.
fn applied_once(job: &Job, hurt: &Hurt, pushes_per_trainer: usize) {
    assert_eq!(hurt.summary["steps"], job.steps);
    let trainers = 2;
    let applied = hurt.summary["updates_applied"].as_array().unwrap();
    assert_eq!(applied.len(), 2, "{}", hurt.summary);
    for (shard, count) in applied.iter().enumerate() {
        assert_eq!(
            count.as_u64().unwrap() as usize,
            trainers * pushes_per_trainer,
            "shard {shard}: {}",
            hurt.summary
        );
    }
    let auc = hurt.summary["auc"].as_f64().unwrap();
    assert!(auc > 0.7, "{}", hurt.summary);
}

#[test]
fn a_stopped_rank_is_declared_dead_the_survivors_leave_their_collective_and_it_is_replaced() {
    stop_a_role(&DATA_PARALLEL);
}

#[test]
fn a_stopped_pipeline_stage_is_declared_dead_the_others_leave_their_receives_and_it_is_replaced() {
    stop_a_role(&PIPELINE);
}

#[test]
fn a_stopped_shard_or_trainer_is_declared_dead_the_others_leave_their_pulls_and_it_is_replaced() {
    stop_a_role(&PS_SYNC);
}

/// SIGSTOP of a random role of `job`, with the deadline of every operation (`timeout_s`) at 30
/// minutes: a survivor that waited it out, rather than leave its all-reduce, stage receive or
/// pull when the coordinator declared the death, would outlast the test.
fn stop_a_role(job: &Job) {
    let lost = job.any_role();
    let hurt = launch_and_hurt(
        job,
        Victim::Role(lost),
        Fault::Signal(libc::SIGSTOP),
        &["fault_tolerance.timeout_s=1800"],
    );
    let stderr = &hurt.stderr;
    assert!(
        stderr.contains(&format!("{lost} declared dead: no heartbeat for")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("{lost} (pid"))
            && stderr.contains("was declared dead by the coordinator but still runs"),
        "the launcher did not kill the stopped role:\n{stderr}"
    );
    survivors_rolled_back_in_place(&hurt, lost);
    equals_uninterrupted(job, &[], &hurt.summary, &hurt.run_dir);
}

#[test]
fn a_killed_coordinator_is_restarted_alone_and_costs_the_trainers_nothing() {
    kill_the_coordinator(&DATA_PARALLEL);
}

#[test]
fn a_pipelines_killed_coordinator_is_restarted_alone_and_costs_the_stages_nothing() {
    kill_the_coordinator(&PIPELINE);
}

#[test]
fn a_parameter_server_jobs_killed_coordinator_is_restarted_alone_and_costs_the_roles_nothing() {
    kill_the_coordinator(&PS_SYNC);
}

/// SIGKILL of `job`'s coordinator.
fn kill_the_coordinator(job: &Job) {
    let hurt = launch_and_hurt(job, Victim::Coordinator, Fault::Signal(libc::SIGKILL), &[]);
    let stderr = &hurt.stderr;
    assert!(
        stderr.contains("coordinator failed (signal: 9 (SIGKILL))")
            && stderr.contains("restarting coordinator alone (restart 1 of 2)"),
        "{stderr}"
    );
    roles_made_themselves_known(job, &hurt);
    equals_uninterrupted(job, &[], &hurt.summary, &hurt.run_dir);
}

#[test]
fn a_coordinator_stopped_for_10_s_wakes_and_the_trainers_train_on() {
    stall_the_coordinator(&DATA_PARALLEL);
}

#[test]
fn a_pipelines_coordinator_stopped_for_10_s_wakes_and_the_stages_train_on() {
    stall_the_coordinator(&PIPELINE);
}

#[test]
fn a_parameter_server_jobs_coordinator_stopped_for_10_s_wakes_and_the_roles_train_on() {
    stall_the_coordinator(&PS_SYNC);
}

/// SIGSTOP of `job`'s coordinator for 10 s, ten heartbeat deadlines and less than the
/// launcher's 20 s patience: no role is taken for dead, none presumes the coordinator dead, and
/// nothing is restarted or rolled back.
fn stall_the_coordinator(job: &Job) {
    let hurt = launch_and_hurt(job, Victim::Coordinator, Fault::Stall(Duration::from_secs(10)), &[]);
    let stderr = &hurt.stderr;
    assert!(
        stderr.contains("the coordinator itself did not run for"),
        "the coordinator did not notice its own stall:\n{stderr}"
    );
    assert!(
        stderr.contains("training on and waiting for it"),
        "no role noticed the silent coordinator:\n{stderr}"
    );
    for unwanted in ["declared dead", "presumed dead", "restarting", "rolling back"] {
        assert!(!stderr.contains(unwanted), "{unwanted:?}:\n{stderr}");
    }
    for (role, pid) in &hurt.survivors {
        assert!(hurt.replaced.contains(pid), "{role} (pid {pid}) was restarted");
    }
    equals_uninterrupted(job, &[], &hurt.summary, &hurt.run_dir);
}

#[test]
fn a_coordinator_that_stays_stopped_is_replaced_by_its_launcher() {
    let hurt = launch_and_hurt(&DATA_PARALLEL, Victim::Coordinator, Fault::Signal(libc::SIGSTOP), &[]);
    let stderr = &hurt.stderr;
    assert!(
        stderr.contains("coordinator (pid") && stderr.contains("has not answered for"),
        "the launcher did not take the stopped coordinator for hung:\n{stderr}"
    );
    assert!(
        stderr.contains("restarting coordinator alone (restart 1 of 2)"),
        "{stderr}"
    );
    roles_made_themselves_known(&DATA_PARALLEL, &hurt);
    equals_uninterrupted(&DATA_PARALLEL, &[], &hurt.summary, &hurt.run_dir);
}

/// Every role of `job` kept its process and told the replaced coordinator who it is.
fn roles_made_themselves_known(job: &Job, hurt: &Hurt) {
    let stderr = &hurt.stderr;
    assert_eq!(hurt.survivors.len(), job.roles.len());
    for (index, role) in job.roles.iter().enumerate() {
        let pid = hurt.survivors[*role];
        assert!(hurt.replaced.contains(&pid), "{role} was restarted");
        // The coordinator numbers the roles in the launcher's order (servers, then trainers).
        assert!(
            stderr.contains(&format!("a rank trains on in its generation rank={index}")),
            "{role} did not make itself known to the new coordinator:\n{stderr}"
        );
    }
    assert!(!stderr.contains("rolling back"), "{stderr}");
}

#[test]
fn without_checkpoints_the_survivors_roll_back_to_step_0_from_memory() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let port = free_port_range(DATA_PARALLEL.roles.len() as u16 + 1).to_string();
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
    let lost = pick(DATA_PARALLEL.roles.len());
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
    let summary = common::read_summary(&run_dir);
    equals_uninterrupted(&DATA_PARALLEL, &[], &summary, &run_dir);
}

#[test]
fn a_replacement_started_with_another_config_is_refused_naming_the_key_and_the_job_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, rogue_dir) = (dir.path().join("run"), dir.path().join("rogue"));
    let port = free_port_range(DATA_PARALLEL.roles.len() as u16 + 1);
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
        ("PADDLE_TRAINERS_NUM", DATA_PARALLEL.roles.len().to_string()),
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
    let summary = common::read_summary(&run_dir);
    equals_uninterrupted(&DATA_PARALLEL, &[], &summary, &run_dir);
}
