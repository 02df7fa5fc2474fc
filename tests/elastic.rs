//! Elastic membership over three nodes, one launcher each (`--nnodes 2:3`), each in a network
//! namespace of its own (`common::hosts`) with its own run directory (no shared filesystem). A
//! node lost for good is dropped once `fault_tolerance.elastic_timeout_s` passes without its
//! replacement: the two left go on from the last committed checkpoint, re-splitting the same
//! global batches. The lost node's machine comes back later, empty, and is admitted at the next
//! checkpoint: the job ends on three.
//!
//! Ground truth, bitwise: the same sample stream trained by in-process runs resumed from the
//! job's own checkpoints — two ranks from the one the job shrank at, until the checkpoint it grew
//! at, then three ranks from there to the end. Needs root and iproute2 (as CI has: there,
//! without them, the tests fail); skipped, saying why, elsewhere.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::hosts::Hosts;
use common::{children_of, end_leftovers, flotilla, lose_node, start_program, wait_for_commit};

/// Elastic timeout of the job, seconds.
const ELASTIC_TIMEOUT_S: u64 = 2;

/// A job long enough (steps of a few milliseconds) for a node to be lost and to come back, whose global batch two and three
/// ranks divide.
fn settings() -> Vec<String> {
    [
        "train.steps=3000",
        "train.batch_size=48",
        "train.hidden_sizes=[512, 512]",
        "train.log_every=500",
        "fault_tolerance.checkpoint_every=250",
        "fault_tolerance.keep_checkpoints=100",
        "fault_tolerance.heartbeat_interval_ms=200",
        "fault_tolerance.timeout_s=30",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("fault_tolerance.elastic_timeout_s={ELASTIC_TIMEOUT_S}")])
    .collect()
}

/// An elastic job: `--nnodes` and `--nproc_per_node` of each launcher, and `--set`s.
struct Job {
    nnodes: &'static str,
    per_node: usize,
    settings: Vec<String>,
}

/// Starts node `node`'s launcher of `job`, writing into `run_dir`.
fn launch_on(hosts: &Hosts, node: usize, run_dir: &Path, job: &Job) -> common::Started {
    let cluster = hosts.ips.join(",");
    #[rustfmt::skip]
    let mut args = vec![
        "netns".to_string(), "exec".into(), hosts.names[node].clone(), env!("CARGO_BIN_EXE_flotilla").into(),
        "launch".into(), "--nnodes".into(), job.nnodes.into(), "--nproc_per_node".into(), job.per_node.to_string(),
        "--node_ip".into(), hosts.ips[node].clone(), "--cluster_node_ips".into(), cluster,
        "--started_port".into(), "6170".into(), "--".into(), "train".into(), "--config".into(), "config.toml".into(),
        "--run-dir".into(), run_dir.to_str().unwrap().into(),
    ];
    for set in &job.settings {
        args.extend(["--set".to_string(), set.clone()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    start_program("ip", &args, &[("FLOTILLA_TOKEN", common::TEST_TOKEN.to_string())])
}

/// The number after `key=` on the first line of `log` that holds `marker`.
fn logged_number(log: &str, marker: &str, key: &str) -> usize {
    let line = log
        .lines()
        .find(|line| line.contains(marker))
        .unwrap_or_else(|| panic!("no line with {marker:?}:\n{log}"));
    let after = line.split(key).nth(1).unwrap_or_else(|| panic!("no {key} in {line:?}"));
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no number after {key} in {line:?}"))
}

/// When the first line of `log` that holds `marker` was logged, in seconds of its UTC day.
fn logged_at(log: &str, marker: &str) -> f64 {
    let line = log
        .lines()
        .find(|line| line.contains(marker))
        .unwrap_or_else(|| panic!("no line with {marker:?}:\n{log}"));
    let stamp = line
        .split_whitespace()
        .find(|word| word.ends_with('Z') && word.contains('T'))
        .unwrap_or_else(|| panic!("no timestamp in {line:?}"));
    seconds_of_day(stamp.split('T').nth(1).unwrap_or_default().trim_end_matches('Z'))
}

/// `HH:MM:SS.ffffff` in seconds.
fn seconds_of_day(time: &str) -> f64 {
    time.split(':')
        .map(|part| part.parse::<f64>().unwrap_or_else(|_| panic!("not a time: {time:?}")))
        .fold(0.0, |seconds, part| seconds * 60.0 + part)
}

/// Now, in seconds of the UTC day.
fn now_of_day() -> f64 {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    (since_epoch.as_secs() % 86_400) as f64 + f64::from(since_epoch.subsec_micros()) / 1e6
}

/// A run directory holding `from`'s config and its committed checkpoint of `step` alone, for
/// an in-process run to resume.
fn resumable_copy(from: &Path, step: usize, to: PathBuf) -> PathBuf {
    let name = format!("step-{step:08}");
    let checkpoint = to.join("checkpoints").join(&name);
    std::fs::create_dir_all(&checkpoint).unwrap();
    std::fs::copy(from.join("config.toml"), to.join("config.toml")).unwrap();
    for file in std::fs::read_dir(from.join("checkpoints").join(&name)).unwrap() {
        let file = file.unwrap().path();
        std::fs::copy(&file, checkpoint.join(file.file_name().unwrap())).unwrap();
    }
    to
}

/// Resumes the run in `run_dir` in one process on `ranks` ranks until step `steps`, with `extra`
/// flags.
fn resume_in_process(run_dir: &Path, ranks: usize, steps: usize, extra: &[&str]) {
    let (per_node, world, steps) = (
        format!("cluster.nproc_per_node={ranks}"),
        format!("cluster.world_size={ranks}"),
        format!("train.steps={steps}"),
    );
    #[rustfmt::skip]
    let args = [
        "train", "--resume", run_dir.to_str().unwrap(), "--set", "cluster.nnodes=1", "--set", "cluster.min_nnodes=1",
        "--set", &per_node, "--set", &world, "--set", "cluster.endpoints=[]", "--set", &steps,
    ];
    let out = flotilla(&[&args[..], extra].concat(), &[], 300);
    assert!(out.success, "{}", out.stderr);
}

#[test]
fn a_node_lost_for_good_is_dropped_and_its_machine_coming_back_is_admitted() {
    let Some(hosts) = Hosts::create_or_say_why(3) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let job = Job {
        nnodes: "2:3",
        per_node: 1,
        settings: settings(),
    };
    let run_dirs: Vec<PathBuf> = (0..3).map(|node| dir.path().join(format!("node-{node}"))).collect();
    let nodes: Vec<common::Started> = (0..3)
        .map(|node| launch_on(&hosts, node, &run_dirs[node], &job))
        .collect();
    let mut nodes = nodes.into_iter();
    let (node_0, node_1, node_2) = (nodes.next().unwrap(), nodes.next().unwrap(), nodes.next().unwrap());
    wait_for_commit(&run_dirs[0].join("checkpoints"), 250);

    // The third node is lost for good: its launcher and its rank.
    let lost_at = now_of_day();
    lose_node(node_2);
    // Its machine comes back, empty, after the two others went on without it.
    std::thread::sleep(Duration::from_millis(ELASTIC_TIMEOUT_S * 1000 + 500));
    let back = dir.path().join("node-2-back");
    let came_back_at = now_of_day();
    let node_2 = launch_on(&hosts, 2, &back, &job);
    let started: Vec<i32> = [&node_0, &node_1, &node_2]
        .iter()
        .flat_map(|l| children_of(l.child.id()))
        .collect();
    let finished = [node_0.finish(300), node_1.finish(300), node_2.finish(300)];
    end_leftovers(started);
    if finished.iter().any(|f| !f.success) {
        let report: Vec<String> = finished
            .iter()
            .enumerate()
            .map(|(node, f)| format!("node {node} (success: {}):\n{}", f.success, f.stderr))
            .collect();
        panic!("a node failed:\n{}", report.join("\n"));
    }
    let log = &finished[0].stderr;
    assert!(log.contains("generation 1 goes on with 2 node(s)"), "{log}");
    let shrunk_at = logged_number(log, "rejoined rank=0 generation=1", "resume_step=");
    let grown_at = logged_number(log, "admitting rank 2 at the checkpoint of step", "step ");
    assert!(shrunk_at < grown_at, "shrank at {shrunk_at}, grew at {grown_at}");
    // The node that came back took the state from a peer, and the job ended on three.
    assert!(finished[2].stderr.contains("state restored"), "{}", finished[2].stderr);
    let summary = common::read_summary(&run_dirs[0]);
    assert_eq!(summary["world_size"], 3);
    // Figures (BENCHMARKS.md), from the logs' clocks: the namespaces share this host's.
    let trains_on_two = logged_at(&finished[1].stderr, "state restored rank=1 step=") - lost_at;
    let admitted = logged_at(&finished[2].stderr, "state restored rank=2 step=") - came_back_at;
    let regrouped = logged_at(&finished[2].stderr, "state restored rank=2 step=")
        - logged_at(log, "admitting rank 2 at the checkpoint");
    eprintln!(
        "elastic figures: node lost -> training on 2 nodes {trains_on_two:.3} s (elastic_timeout_s = \
         {ELASTIC_TIMEOUT_S}); machine back -> training on 3 nodes {admitted:.3} s, of which the regroup at the \
         checkpoint {regrouped:.3} s"
    );

    // Two ranks from the checkpoint it shrank at to the one it grew at (their last step) ...
    let two = resumable_copy(&run_dirs[0], shrunk_at, dir.path().join("two"));
    resume_in_process(&two, 2, grown_at, &[]);
    // ... then three from there to the end: bitwise the elastic job's parameters.
    resume_in_process(&two, 3, 3000, &[]);
    let reference = common::read_summary(&two);
    assert_eq!(summary["param_checksum"], reference["param_checksum"]);
}

/// A 2 × 2 pipeline, a replica per node (`--nnodes 1:2`): the second node is lost for good, and
/// the first goes on as the only replica, with every micro-batch of the global batch.
#[test]
fn a_pipelines_data_parallel_dimension_shrinks_when_a_node_is_lost_for_good() {
    let Some(hosts) = Hosts::create_or_say_why(2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut settings = settings();
    settings.extend(
        [
            "strategy.pipeline=true",
            "strategy.hybrid_configs.pp_degree=2",
            "strategy.hybrid_configs.dp_degree=2",
            "strategy.pipeline_configs.accumulate_steps=2",
        ]
        .map(String::from),
    );
    let job = Job {
        nnodes: "1:2",
        per_node: 2,
        settings,
    };
    let run_dirs: Vec<PathBuf> = (0..2).map(|node| dir.path().join(format!("node-{node}"))).collect();
    let node_0 = launch_on(&hosts, 0, &run_dirs[0], &job);
    let node_1 = launch_on(&hosts, 1, &run_dirs[1], &job);
    wait_for_commit(&run_dirs[0].join("checkpoints"), 250);
    lose_node(node_1);
    let started = children_of(node_0.child.id());
    let finished = node_0.finish(300);
    end_leftovers(started);
    assert!(finished.success, "{}", finished.stderr);
    let log = &finished.stderr;
    // Its two ranks are found dead one after the other: a generation each.
    assert!(log.contains("goes on with 1 node(s) (2 ranks)"), "{log}");
    let shrunk_at = logged_number(log, "rejoined rank=0 generation=", "resume_step=");
    // One replica of two stages from the checkpoint it shrank at: bitwise the job's parameters.
    let one = resumable_copy(&run_dirs[0], shrunk_at, dir.path().join("one"));
    resume_in_process(&one, 2, 3000, &["--set", "strategy.hybrid_configs.dp_degree=1"]);
    let (summary, reference) = (common::read_summary(&run_dirs[0]), common::read_summary(&one));
    assert_eq!(summary["param_checksum"], reference["param_checksum"]);
}

/// Starts node `node`'s `launch-ps` of a parameter-server job with both shards, the first
/// trainer and the coordinator on the first node and the second trainer on the second (a node
/// of one trainer each: `cluster.nproc_per_node = 1`, `--set cluster.min_nnodes=1`).
fn launch_ps_on(hosts: &Hosts, node: usize, run_dir: &Path) -> common::Started {
    let [a, b] = [&hosts.ips[0], &hosts.ips[1]];
    let (servers, workers, master) = (
        format!("{a}:6170,{a}:6171"),
        format!("{a}:6172,{b}:6172"),
        format!("{a}:6173"),
    );
    let elastic_timeout = format!("fault_tolerance.elastic_timeout_s={ELASTIC_TIMEOUT_S}");
    #[rustfmt::skip]
    let args = [
        "netns", "exec", hosts.names[node].as_str(), env!("CARGO_BIN_EXE_flotilla"),
        "launch-ps", "--host", &hosts.ips[node], "--servers", &servers, "--workers", &workers, "--master", &master,
        "--", "train", "--config", "examples/ctr_ps.toml", "--run-dir", run_dir.to_str().unwrap(),
        "--set", "cluster.nproc_per_node=1", "--set", "cluster.min_nnodes=1", "--set", &elastic_timeout,
        "--set", "train.steps=4000", "--set", "cluster.nnodes=2", "--set", "train.hidden_sizes=[64, 32]", "--set", "train.synthetic_samples=40000",
        "--set", "train.log_every=250", "--set", "fault_tolerance.checkpoint_every=100",
        "--set", "fault_tolerance.keep_checkpoints=100", "--set", "fault_tolerance.heartbeat_interval_ms=200",
        "--set", "fault_tolerance.timeout_s=30",
    ];
    start_program("ip", &args, &[("FLOTILLA_TOKEN", common::TEST_TOKEN.to_string())])
}

/// A parameter-server job's second trainer node is lost for good: the shards and the first
/// trainer go on from the last checkpoint, the trainer alone reading each whole global batch;
/// the machine comes back and its trainer is admitted at the next checkpoint. Ground truth,
/// bitwise: in-process runs resumed from the job's checkpoints — one trainer from the one it
/// shrank at, two from the one it grew at — end with the same rows, dense parameters and
/// optimizer state on every shard.
#[test]
fn a_parameter_server_jobs_trainer_node_lost_for_good_is_dropped_and_admitted_again() {
    let Some(hosts) = Hosts::create_or_say_why(2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let run_dirs: Vec<PathBuf> = (0..2).map(|node| dir.path().join(format!("node-{node}"))).collect();
    let node_0 = launch_ps_on(&hosts, 0, &run_dirs[0]);
    let node_1 = launch_ps_on(&hosts, 1, &run_dirs[1]);
    wait_for_commit(&run_dirs[0].join("checkpoints"), 100);
    lose_node(node_1);
    std::thread::sleep(Duration::from_millis(ELASTIC_TIMEOUT_S * 1000 + 500));
    let node_1 = launch_ps_on(&hosts, 1, &dir.path().join("node-1-back"));
    let started: Vec<i32> = [&node_0, &node_1]
        .iter()
        .flat_map(|l| children_of(l.child.id()))
        .collect();
    let finished = [node_0.finish(300), node_1.finish(300)];
    end_leftovers(started);
    for (node, f) in finished.iter().enumerate() {
        assert!(f.success, "node {node} failed:\n{}", f.stderr);
    }
    let log = &finished[0].stderr;
    assert!(
        log.contains("generation 1 goes on with 1 node(s) (1 ranks); trainer 1 did not join"),
        "{log}"
    );
    let shrunk_at = logged_number(log, "rejoined trainer=0 generation=1", "resume_step=");
    let grown_at = logged_number(log, "admitting trainer 1 at the checkpoint of step", "step ");
    assert!(shrunk_at < grown_at, "shrank at {shrunk_at}, grew at {grown_at}");
    assert_eq!(common::read_summary(&run_dirs[0])["trainers"], 2);

    let reference = resumable_copy(&run_dirs[0], shrunk_at, dir.path().join("reference"));
    let in_process_servers = ["--set", "cluster.pservers=[]"];
    resume_in_process(&reference, 1, grown_at, &in_process_servers);
    resume_in_process(&reference, 2, 4000, &in_process_servers);
    let config = flotilla::config::JobConfig::from_file(&run_dirs[0].join("config.toml"), &|_| None, &[]).unwrap();
    for index in 0..2 {
        assert!(
            common::saved_shard(&config, &run_dirs[0], index) == common::saved_shard(&config, &reference, index),
            "shard {index} differs from the in-process runs resumed from the job's checkpoints"
        );
    }
}
