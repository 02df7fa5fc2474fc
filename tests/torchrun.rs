//! Ranks started by PyTorch's real `torchrun` (from the test venv `.ci/run` makes):
//! `torchrun --no-python … flotilla run --role trainer`. torchrun's agent holds
//! `MASTER_ADDR:MASTER_PORT` with a store of its own; the ranks meet their coordinator through
//! it, on one node (`--standalone`) and on two (`--rdzv-backend c10d`, two network namespaces),
//! start again from the newest checkpoint when the agent restarts them (`--max-restarts`), and
//! end as the in-process run.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::hosts::Hosts;
use common::{children_of, config, end_leftovers, installed, start_program, train_in_process, Started};

const STEPS: &str = "train.steps=20";

/// A run long enough to lose a worker in, checkpointed every 500 steps, whose ranks notice a
/// dead peer within a second.
const RESTARTED: [&str; 4] = [
    "train.steps=4000",
    "train.batch_size=48",
    "fault_tolerance.checkpoint_every=500",
    "fault_tolerance.heartbeat_interval_ms=200",
];

/// The environment of a rank torchrun starts: the cluster token every rank needs.
fn token() -> Vec<(&'static str, String)> {
    vec![("FLOTILLA_TOKEN", common::TEST_TOKEN.to_string())]
}

/// `torchrun ARGS --no-python flotilla run --role trainer --config config.toml --run-dir RUN
/// --set …` with `env` (after `prefix`, a program that runs torchrun on a host).
fn torchrun(prefix: &[&str], torchrun_args: &[&str], run_dir: &Path, sets: &[&str], env: &[(&str, String)]) -> Started {
    torchrun_job(prefix, torchrun_args, "config.toml", run_dir, sets, env)
}

/// [`torchrun`] of the job in the config file `config`.
fn torchrun_job(
    prefix: &[&str],
    torchrun_args: &[&str],
    config: &str,
    run_dir: &Path,
    sets: &[&str],
    env: &[(&str, String)],
) -> Started {
    let mut args: Vec<&str> = prefix.to_vec();
    args.push("torchrun");
    args.extend(torchrun_args);
    #[rustfmt::skip]
    args.extend(["--no-python", env!("CARGO_BIN_EXE_flotilla"), "run", "--role", "trainer",
        "--config", config, "--run-dir", run_dir.to_str().unwrap()]);
    for set in sets {
        args.extend(["--set", set]);
    }
    let (program, args) = args.split_first().unwrap();
    start_program(program, args, env)
}

fn succeeded(finished: &common::Finished, what: &str) {
    finished.assert_success(&format!("{what} failed"));
}

/// Ends with the checksum of the in-process run of `sets`.
fn ends_as_in_process(run_dir: &Path, world_size: usize, sets: &[&str]) {
    let summary = common::read_summary(run_dir);
    assert_eq!(summary["world_size"], world_size);
    assert_eq!(summary["cluster"], "multi-process");
    let simulated = train_in_process(config(sets));
    assert_eq!(summary["param_checksum"], simulated.summary.param_checksum.as_str());
}

#[test]
fn ranks_torchrun_starts_on_one_node_train_as_the_in_process_cluster() {
    if !installed("torchrun", "PyTorch, in the venv .ci/run makes") {
        return;
    }
    for (name, sets) in [
        ("data parallel", vec![STEPS]),
        (
            "pipeline",
            vec![STEPS, "strategy.pipeline=true", "strategy.hybrid_configs.pp_degree=2"],
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("run");
        let args = ["--standalone", "--nproc-per-node", "2"];
        let finished = torchrun(&[], &args, &run_dir, &sets, &token()).finish(120);
        succeeded(&finished, name);
        common::assert_says(
            &finished.stderr,
            "met through torchrun's store",
            &format!("{name}: the ranks met through torchrun's store"),
        );
        ends_as_in_process(&run_dir, 2, &sets);
    }
}

#[test]
fn ranks_torchrun_restarts_after_a_worker_is_killed_resume_and_end_as_the_uninterrupted_run() {
    if !installed("torchrun", "PyTorch, in the venv .ci/run makes") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let sets = RESTARTED;
    let args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"];
    let started = torchrun(&[], &args, &run_dir, &sets, &token());
    let agent = started.child.id();
    common::wait_for_commit(&run_dir.join("checkpoints"), 500 * (1 + common::pick(3)));
    let workers = children_of(agent);
    assert_eq!(workers.len(), 2, "torchrun's two workers: {workers:?}");
    kill(workers[common::pick(2)]);
    let restarted = wait_for_new_workers(agent, &workers);
    let finished = started.finish(180);
    end_leftovers(workers.into_iter().chain(restarted));
    succeeded(&finished, "torchrun --max-restarts 1");
    common::assert_says(
        &finished.stderr,
        "resuming from checkpoint",
        "the restarted workers resumed",
    );
    ends_as_in_process(&run_dir, 2, &sets);
}

/// A parameter-server job's servers are no workers torchrun starts: its trainers refuse, saying
/// how to start the job, and torchrun does not restart a refusal's ranks into the same refusal.
#[test]
fn a_parameter_server_job_under_torchrun_is_refused_saying_how_to_start_it() {
    if !installed("torchrun", "PyTorch, in the venv .ci/run makes") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let args = ["--standalone", "--nproc-per-node", "2"];
    let started = torchrun_job(
        &[],
        &args,
        "examples/ctr_ps.toml",
        &dir.path().join("run"),
        &[],
        &token(),
    );
    let finished = started.finish(120);
    assert!(!finished.success);
    assert!(
        finished.stderr.contains("cannot be started by torchrun") && finished.stderr.contains("flotilla launch-ps"),
        "{}",
        finished.stderr
    );
}

/// The workers torchrun's agent `agent` starts in place of `before` (at most 60 s).
fn wait_for_new_workers(agent: u32, before: &[i32]) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = children_of(agent);
        if !now.is_empty() && now.iter().all(|pid| !before.contains(pid)) {
            return now;
        }
        assert!(Instant::now() < deadline, "torchrun started no new workers: {now:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Two nodes, one torchrun each, meeting at a c10d rendezvous on the first: torchrun numbers
/// the nodes, and the ranks find their coordinator (on whichever node got rank 0) through the
/// store of the agent of node 0.
#[test]
fn ranks_torchrun_starts_on_two_nodes_by_a_c10d_rendezvous_train_as_the_in_process_cluster() {
    if !installed("torchrun", "PyTorch, in the venv .ci/run makes") {
        return;
    }
    let Some(hosts) = Hosts::create_or_say_why(2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let nodes = start_two_nodes(&hosts, dir.path(), "two-nodes", &[], &[STEPS]);
    let workers: Vec<i32> = nodes.iter().flat_map(|node| workers_of(node.child.id())).collect();
    let finished: Vec<_> = nodes.into_iter().map(|node| node.finish(180)).collect();
    end_leftovers(workers);
    for (node, finished) in finished.iter().enumerate() {
        succeeded(finished, &format!("node {node}"));
    }
    ends_as_in_process(&rank0_run_dir(dir.path()), 2, &[STEPS]);
}

/// Two nodes under `--max-restarts 1`, their checkpoints in one directory both see: a worker
/// killed on either node makes both agents start their workers again (the healthy node's
/// without counting a restart), and every rank resumes from the newest checkpoint, ending as the
/// uninterrupted run.
#[test]
fn ranks_torchrun_restarts_on_two_nodes_resume_from_the_shared_checkpoints() {
    if !installed("torchrun", "PyTorch, in the venv .ci/run makes") {
        return;
    }
    let Some(hosts) = Hosts::create_or_say_why(2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let checkpoints = format!("fault_tolerance.checkpoint_dir={:?}", dir.path().join("checkpoints"));
    let sets = [&RESTARTED[..], &[checkpoints.as_str()]].concat();
    let restarts = ["--max-restarts", "1"];
    let nodes = start_two_nodes(&hosts, dir.path(), "two-nodes-restarted", &restarts, &sets);
    common::wait_for_commit(&dir.path().join("checkpoints"), 500 * (1 + common::pick(3)));
    let victim_node = common::pick(2);
    let workers: Vec<i32> = nodes.iter().flat_map(|node| workers_of(node.child.id())).collect();
    let victim = children_of(nodes[victim_node].child.id());
    assert_eq!(victim.len(), 1, "node {victim_node}'s one worker: {victim:?}");
    kill(victim[0]);
    let restarted: Vec<i32> = nodes
        .iter()
        .flat_map(|node| wait_for_new_workers(node.child.id(), &workers))
        .collect();
    let finished: Vec<_> = nodes.into_iter().map(|node| node.finish(240)).collect();
    end_leftovers(workers.into_iter().chain(restarted));
    for (node, finished) in finished.iter().enumerate() {
        succeeded(finished, &format!("node {node}"));
    }
    let resumed = finished
        .iter()
        .filter(|f| f.stderr.contains("resuming from checkpoint"))
        .count();
    assert_eq!(resumed, 2, "both nodes' workers resumed");
    ends_as_in_process(&rank0_run_dir(dir.path()), 2, &RESTARTED);
}

/// One torchrun on each of `hosts`' two nodes (after `extra` flags), meeting at a c10d
/// rendezvous `id` on the first, each training the job `sets` into `dir/node<i>`.
fn start_two_nodes(hosts: &Hosts, dir: &Path, id: &str, extra: &[&str], sets: &[&str]) -> Vec<Started> {
    let endpoint = format!("{}:29400", hosts.ips[0]);
    (0..2)
        .map(|node| {
            // The agent that serves the rendezvous store is told so: inside a namespace the
            // host's name does not resolve to the namespace's address.
            let is_host = format!("is_host={}", node == 0);
            #[rustfmt::skip]
            let args = [
                "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint,
                "--rdzv-id", id, "--rdzv-conf", &is_host, "--local-addr", &hosts.ips[node],
            ];
            let prefix = ["ip", "netns", "exec", hosts.names[node].as_str()];
            torchrun(
                &prefix,
                &[extra, &args].concat(),
                &dir.join(format!("node{node}")),
                sets,
                &token(),
            )
        })
        .collect()
}

/// The run directory of the node the rendezvous gave rank 0, which writes the outputs.
fn rank0_run_dir(dir: &Path) -> PathBuf {
    (0..2)
        .map(|node| dir.join(format!("node{node}")))
        .find(|run_dir| run_dir.join("summary.json").exists())
        .expect("a summary on one node")
}

/// SIGKILLs `pid`, a worker this test's torchrun started.
fn kill(pid: i32) {
    // SAFETY: kill(2) on a pid; no memory is shared.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
}

/// The workers torchrun's agent `agent` started, once it has (at most 60 s; none if it ended
/// first), so that the test ends them should the agent be killed.
fn workers_of(agent: u32) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let workers = children_of(agent);
        if !workers.is_empty() || Instant::now() >= deadline || !Path::new(&format!("/proc/{agent}")).exists() {
            return workers;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
