//! Two nodes, one launcher each: two network namespaces on one switch
//! (`common::hosts`), made (and removed) by this test, so ranks on different "hosts"
//! rendezvous and run their ring over TCP between the namespaces' own
//! addresses; a rank lost on the second node is replaced by that node's
//! launcher while rank 0 rolls back in place. Needs root and iproute2 (as CI
//! has: there, without them, the tests fail); skipped, saying why, elsewhere.

mod common;

use common::hosts::Hosts;
use common::{children_of, config, end_leftovers, start_program, train_in_process, trainer_ranks, wait_for_commit};

const STEPS: &str = "train.steps=20";

/// Starts one launcher per node of `hosts`, each with one rank of the job `settings` writing
/// into `run_dir` (shared by the nodes, as a shared file system would be). The second node's
/// launcher may find the first's outputs there already: it is told to write beside them.
fn launch_on_both(hosts: &Hosts, run_dir: &std::path::Path, settings: &[&str]) -> Vec<common::Started> {
    vec![
        launch_on(hosts, 0, 1, run_dir, settings, &[]),
        launch_on(hosts, 1, 1, run_dir, settings, &["--overwrite"]),
    ]
}

/// Starts the launcher of node `node` of `hosts`, with `per_node` ranks of the job `settings`
/// writing into `run_dir`, passing `train` the flags `extra` too.
fn launch_on(
    hosts: &Hosts,
    node: usize,
    per_node: usize,
    run_dir: &std::path::Path,
    settings: &[&str],
    extra: &[&str],
) -> common::Started {
    let (cluster, per_node) = (hosts.ips.join(","), per_node.to_string());
    #[rustfmt::skip]
    let mut args = vec![
        "netns", "exec", hosts.names[node].as_str(), env!("CARGO_BIN_EXE_flotilla"),
        "launch", "--nnodes", "2", "--nproc_per_node", &per_node, "--node_ip", &hosts.ips[node],
        "--cluster_node_ips", &cluster, "--started_port", "6170", "--", "train", "--config", "config.toml",
        "--set", "fault_tolerance.timeout_s=30", "--run-dir", run_dir.to_str().unwrap(),
    ];
    for set in settings {
        args.extend(["--set", set]);
    }
    args.extend(extra);
    // The nodes of one job share a token; each launcher hands it to its processes.
    start_program("ip", &args, &[("FLOTILLA_TOKEN", common::TEST_TOKEN.to_string())])
}

/// Fails naming the nodes that failed, with every node's output: one node's failure is often
/// explained by what the other said.
fn every_node_succeeded(finished: &[common::Finished]) {
    if finished.iter().any(|f| !f.success) {
        let report: Vec<String> = finished
            .iter()
            .enumerate()
            .map(|(node, f)| format!("node {node} (success: {}):\n{}\n{}", f.success, f.stdout, f.stderr))
            .collect();
        panic!("a node failed:\n{}", report.join("\n"));
    }
}

/// A long job that checkpoints every 500 steps and beats every 200 ms.
const RECOVERABLE: [&str; 4] = [
    "train.steps=3000",
    "fault_tolerance.checkpoint_every=500",
    "fault_tolerance.max_restarts=1",
    "fault_tolerance.heartbeat_interval_ms=200",
];

#[test]
fn one_launcher_per_node_trains_like_the_in_process_cluster() {
    let Some(hosts) = Hosts::create_or_say_why(2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let launchers = launch_on_both(&hosts, &run_dir, &[STEPS]);
    let finished: Vec<_> = launchers.into_iter().map(|l| l.finish(120)).collect();
    every_node_succeeded(&finished);
    let summary: serde_json::Value = common::read_summary(&run_dir);
    assert_eq!(summary["world_size"], 2);
    assert_eq!(summary["cluster"], "multi-process");
    assert!(
        finished[0].stderr.contains("rendezvous complete"),
        "{}",
        finished[0].stderr
    );
    // Same ring, same reduction order, now over a network between hosts.
    let simulated = train_in_process(config(&[STEPS]));
    assert_eq!(summary["param_checksum"], simulated.summary.param_checksum.as_str());
}

#[test]
fn two_ranks_per_node_all_reduce_hierarchically_as_the_in_process_cluster_told_to_does() {
    let Some(hosts) = Hosts::create_or_say_why(2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let launchers = [
        launch_on(&hosts, 0, 2, &run_dir, &[STEPS], &[]),
        launch_on(&hosts, 1, 2, &run_dir, &[STEPS], &["--overwrite"]),
    ];
    let finished: Vec<_> = launchers.into_iter().map(|l| l.finish(120)).collect();
    every_node_succeeded(&finished);
    // Chosen from the hosts: shared memory in each node, TCP across.
    for node in &finished {
        assert!(
            node.stderr
                .contains("hierarchical all-reduce: node and rail rings connected"),
            "{}",
            node.stderr
        );
    }
    let summary: serde_json::Value = common::read_summary(&run_dir);
    assert_eq!(summary["world_size"], 4);
    // The same reduction order as one process told to all-reduce over 2 nodes of 2 ranks.
    let hierarchical = [
        "cluster.nnodes=2",
        "cluster.nproc_per_node=2",
        "strategy.use_hierarchical_allreduce=true",
    ];
    let simulated = train_in_process(config(&[&[STEPS][..], &hierarchical].concat()));
    assert_eq!(summary["param_checksum"], simulated.summary.param_checksum.as_str());
}

#[test]
fn a_rank_killed_on_the_second_node_is_replaced_there_and_rank_0_rolls_back_in_place() {
    let Some(hosts) = Hosts::create_or_say_why(2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let launchers = launch_on_both(&hosts, &run_dir, &RECOVERABLE);
    wait_for_commit(&run_dir.join("checkpoints"), 1000);
    let second = launchers[1].child.id();
    let rank_1 = trainer_ranks(second)[&1];
    // SAFETY: the pid of a process the second node's launcher started and still supervises.
    unsafe {
        libc::kill(rank_1, libc::SIGKILL);
    }
    let started: Vec<i32> = launchers.iter().flat_map(|l| children_of(l.child.id())).collect();
    let finished: Vec<_> = launchers.into_iter().map(|l| l.finish(180)).collect();
    end_leftovers(started);
    every_node_succeeded(&finished);
    assert!(
        finished[1].stderr.contains("restarting rank 1 alone (restart 1 of 1)"),
        "{}",
        finished[1].stderr
    );
    assert!(
        finished[0].stderr.contains("rejoined rank=0 generation=1"),
        "{}",
        finished[0].stderr
    );
    let summary: serde_json::Value = common::read_summary(&run_dir);
    let uninterrupted = train_in_process(config(&RECOVERABLE[..1]));
    assert_eq!(summary["param_checksum"], uninterrupted.summary.param_checksum.as_str());
}

/// The committed checkpoints in `dir`, by step.
fn committed_steps(dir: &std::path::Path) -> Vec<usize> {
    let mut steps: Vec<usize> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.path().join("manifest.json").exists())
        .filter_map(|entry| entry.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
        .collect();
    steps.sort_unstable();
    steps
}

#[test]
fn a_node_lost_with_its_disk_comes_back_empty_and_takes_the_state_from_the_other() {
    lose_the_second_node(Disk::Emptied);
}

#[test]
fn a_node_whose_launcher_is_started_again_resumes_from_its_own_disk() {
    lose_the_second_node(Disk::Kept);
}

/// What becomes of the lost node's disk.
#[derive(PartialEq)]
enum Disk {
    Kept,
    Emptied,
}

/// A job over two nodes without a shared filesystem: each node its own run directory,
/// checkpoints included, and its part of the job.
struct Separate {
    hosts: Hosts,
    _dir: tempfile::TempDir,
    run_dirs: [std::path::PathBuf; 2],
    layout: Layout,
    settings: Vec<String>,
}

/// What each node of a [`Separate`] job runs.
#[derive(Clone, Copy)]
enum Layout {
    /// `launch` with this many ranks per node.
    Ranks(usize),
    /// `launch-ps` of `examples/ctr_ps.toml` with one shard and one trainer per node; the first
    /// node runs the coordinator.
    ParameterServers,
}

/// Where a parameter-server job's roles run on the two nodes.
#[derive(Clone, Copy, PartialEq)]
enum PsPlacement {
    /// A shard and a trainer on each node.
    Mixed,
    /// Both shards on the first node, both trainers on the second.
    Apart,
}

/// Starts node `node`'s `launch-ps` of a job with two shards and two trainers placed on the
/// nodes of `hosts` as `placement` says, the coordinator on the first, with the job `settings`,
/// passing `train` the flags `extra`.
fn launch_ps_on(
    hosts: &Hosts,
    node: usize,
    placement: PsPlacement,
    run_dir: &std::path::Path,
    settings: &[&str],
    extra: &[&str],
) -> common::Started {
    let [a, b] = [&hosts.ips[0], &hosts.ips[1]];
    let (servers, workers) = match placement {
        PsPlacement::Mixed => (format!("{a}:6170,{b}:6170"), format!("{a}:6171,{b}:6171")),
        PsPlacement::Apart => (format!("{a}:6170,{a}:6171"), format!("{b}:6170,{b}:6171")),
    };
    let master = format!("{a}:6172");
    #[rustfmt::skip]
    let mut args = vec![
        "netns", "exec", hosts.names[node].as_str(), env!("CARGO_BIN_EXE_flotilla"),
        "launch-ps", "--host", &hosts.ips[node], "--servers", &servers, "--workers", &workers,
        "--master", &master, "--", "train", "--config", "examples/ctr_ps.toml",
        "--set", "fault_tolerance.timeout_s=30", "--run-dir", run_dir.to_str().unwrap(),
    ];
    for set in settings {
        args.extend(["--set", set]);
    }
    args.extend(extra);
    start_program("ip", &args, &[("FLOTILLA_TOKEN", common::TEST_TOKEN.to_string())])
}

impl Separate {
    /// Two hosts for a job of `per_node` ranks per node with `settings`, or `None` after saying
    /// why they cannot be made here.
    fn create_or_say_why(layout: Layout, settings: &[&str]) -> Option<Self> {
        let hosts = Hosts::create_or_say_why(2)?;
        let dir = tempfile::tempdir().unwrap();
        Some(Self {
            hosts,
            run_dirs: [dir.path().join("node-0"), dir.path().join("node-1")],
            _dir: dir,
            layout,
            settings: settings.iter().map(|s| s.to_string()).collect(),
        })
    }

    /// Starts node `node`'s launcher, passing `train` the flags `extra` too.
    fn launch(&self, node: usize, extra: &[&str]) -> common::Started {
        let (hosts, run_dir) = (&self.hosts, &self.run_dirs[node]);
        let settings: Vec<&str> = self.settings.iter().map(String::as_str).collect();
        match self.layout {
            Layout::Ranks(per_node) => launch_on(hosts, node, per_node, run_dir, &settings, extra),
            Layout::ParameterServers => launch_ps_on(hosts, node, PsPlacement::Mixed, run_dir, &settings, extra),
        }
    }

    /// Starts both nodes, waits until each committed its own copy of the checkpoint of step
    /// `first`, then loses the second node — its launcher (so nothing restarts), its ranks, and
    /// its disk unless `disk` is kept — and starts its launcher again (into its own run
    /// directory again, which may hold its part of this run). Returns both nodes' ends.
    fn lose_the_second_node(&self, first: usize, disk: Disk) -> [common::Finished; 2] {
        let run_dirs = &self.run_dirs;
        let node_0 = self.launch(0, &[]);
        let node_1 = self.launch(1, &[]);
        wait_for_commit(&run_dirs[1].join("checkpoints"), first);
        wait_for_commit(&run_dirs[0].join("checkpoints"), first);
        common::lose_node(node_1);
        if disk == Disk::Emptied {
            std::fs::remove_dir_all(&run_dirs[1]).unwrap();
        }
        let node_1 = self.launch(1, &["--overwrite"]);
        let started: Vec<i32> = [&node_0, &node_1]
            .iter()
            .flat_map(|l| children_of(l.child.id()))
            .collect();
        let finished = [node_0.finish(180), node_1.finish(180)];
        end_leftovers(started);
        every_node_succeeded(&finished);
        // The node holds checkpoints of its own again.
        assert!(!committed_steps(&run_dirs[1].join("checkpoints")).is_empty());
        finished
    }

    /// Where `rank` of the second node, started again, took its state from.
    fn restored_from(finished: &[common::Finished; 2], rank: usize) -> String {
        let stderr = &finished[1].stderr;
        let restored = stderr
            .lines()
            .find(|line| line.contains("state restored") && line.contains(&format!("rank={rank} ")))
            .unwrap_or_else(|| panic!("the new rank {rank} restored no state:\n{stderr}"));
        let from = restored.split("from=").nth(1).unwrap_or_default();
        from.split(" bytes=").next().unwrap_or_default().to_string()
    }

    /// The job's parameters equal those of the uninterrupted run of `twin`.
    fn ends_as(&self, twin: &[&str]) {
        let summary: serde_json::Value = common::read_summary(&self.run_dirs[0]);
        let uninterrupted = train_in_process(config(twin));
        assert_eq!(summary["param_checksum"], uninterrupted.summary.param_checksum.as_str());
    }
}

/// Loses the second node of a data-parallel job (one rank per node) after the first checkpoint
/// and starts it again; checks where its new rank took its state from, and that the job ends
/// bitwise equal to an uninterrupted run.
fn lose_the_second_node(disk: Disk) {
    let Some(job) = Separate::create_or_say_why(Layout::Ranks(1), &RECOVERABLE) else {
        return;
    };
    let expected = match disk {
        Disk::Emptied => "\"rank 0\"",
        Disk::Kept => "\"disk\"",
    };
    let finished = job.lose_the_second_node(500, disk);
    assert!(
        finished[0].stderr.contains("rejoined rank=0 generation=1"),
        "{}",
        finished[0].stderr
    );
    assert_eq!(Separate::restored_from(&finished, 1), expected);
    job.ends_as(&RECOVERABLE[..1]);
}

/// A pipeline of two stages and `dp_degree` replicas over the two nodes (`dp_degree` ranks
/// per node, in rank order), and its uninterrupted twin's settings (the first six).
fn pipeline_over_two_nodes(dp_degree: usize) -> Vec<String> {
    let replicas = format!("strategy.hybrid_configs.dp_degree={dp_degree}");
    [
        "strategy.pipeline=true",
        &replicas,
        "strategy.hybrid_configs.pp_degree=2",
        "strategy.pipeline_configs.schedule_mode=\"1F1B\"",
        "strategy.pipeline_configs.accumulate_steps=4",
        "train.steps=1500",
        "fault_tolerance.checkpoint_every=250",
        "fault_tolerance.max_restarts=1",
        "fault_tolerance.heartbeat_interval_ms=200",
    ]
    .map(str::to_string)
    .to_vec()
}

#[test]
fn a_pipeline_node_lost_with_its_disk_takes_its_stages_from_the_other_nodes_replica() {
    // Each node holds one whole replica (ranks 0–1 and 2–3).
    let settings = pipeline_over_two_nodes(2);
    let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
    let Some(job) = Separate::create_or_say_why(Layout::Ranks(2), &settings) else {
        return;
    };
    let finished = job.lose_the_second_node(250, Disk::Emptied);
    // Two ranks lost: one generation or two, as the coordinator declared them.
    for rank in [0, 1] {
        assert!(
            finished[0]
                .stderr
                .contains(&format!("rejoined rank={rank} generation=")),
            "{}",
            finished[0].stderr
        );
    }
    // Stage s of replica 1 (rank 2 + s) receives it from stage s of replica 0 (rank s).
    for (rank, source) in [(2, 0), (3, 1)] {
        assert_eq!(Separate::restored_from(&finished, rank), format!("\"rank {source}\""));
    }
    let mut twin: Vec<&str> = settings[..6].to_vec();
    twin.push("cluster.nproc_per_node=4");
    job.ends_as(&twin);
}

#[test]
fn a_stage_only_its_lost_node_held_comes_back_from_the_buddy_copy_on_the_other_node() {
    // Each node holds one stage, which no other node runs.
    let settings = pipeline_over_two_nodes(1);
    let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
    let Some(job) = Separate::create_or_say_why(Layout::Ranks(1), &settings) else {
        return;
    };
    let finished = job.lose_the_second_node(250, Disk::Emptied);
    assert!(
        finished[0].stderr.contains("rejoined rank=0 generation="),
        "{}",
        finished[0].stderr
    );
    // Stage 1 ran on the lost node only: its copy on the first node (rank 0's mirror) brings it back.
    assert_eq!(Separate::restored_from(&finished, 1), "\"buddy rank 0\"");
    let mut twin: Vec<&str> = settings[..6].to_vec();
    twin.push("cluster.nproc_per_node=2");
    job.ends_as(&twin);
}

#[test]
fn a_parameter_server_job_with_its_shards_on_one_node_and_its_trainers_on_the_other_trains_as_in_one_process() {
    let Some(hosts) = Hosts::create_or_say_why(2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let steps = "train.steps=40";
    let launchers = [
        launch_ps_on(&hosts, 0, PsPlacement::Apart, &run_dir, &[steps], &[]),
        launch_ps_on(&hosts, 1, PsPlacement::Apart, &run_dir, &[steps], &["--overwrite"]),
    ];
    let finished: Vec<_> = launchers.into_iter().map(|l| l.finish(180)).collect();
    every_node_succeeded(&finished);
    // The first node ran the shards (and the coordinator), the second the trainers.
    let started = |node: usize, process: &str| finished[node].stderr.contains(&format!("process={process} pid="));
    assert!(
        started(0, "server 1") && !started(0, "trainer 0"),
        "{}",
        finished[0].stderr
    );
    assert!(
        started(1, "trainer 1") && !started(1, "server 0"),
        "{}",
        finished[1].stderr
    );
    let summary: serde_json::Value = common::read_summary(&run_dir);
    common::ps_matches_uninterrupted(&[steps], &summary, &run_dir);
}

/// A sync parameter-server job over the two nodes: a shard and a trainer on each, whose
/// checkpoint files no other node holds.
const PARAMETER_SERVERS: [&str; 4] = [
    "train.steps=240",
    "fault_tolerance.checkpoint_every=40",
    "fault_tolerance.max_restarts=1",
    "fault_tolerance.heartbeat_interval_ms=200",
];

#[test]
fn a_shard_whose_node_was_lost_with_its_disk_comes_back_from_the_buddy_copy_on_the_other_node() {
    let Some(job) = Separate::create_or_say_why(Layout::ParameterServers, &PARAMETER_SERVERS) else {
        return;
    };
    let finished = job.lose_the_second_node(80, Disk::Emptied);
    let back = finished[1]
        .stderr
        .lines()
        .any(|line| line.contains("serving shard=1") && line.contains("from=\"buddy rank 0\""));
    assert!(
        back,
        "server 1 did not take its file from the first node:\n{}",
        finished[1].stderr
    );
    // The coordinator's record names both holders of each shard's file: its node and its buddy.
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(job.run_dirs[0].join("checkpoints/committed.json")).unwrap())
            .unwrap();
    let shard_1 = record["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|file| file["name"] == "ps-shard-1.safetensors")
        .unwrap_or_else(|| panic!("{record}"));
    assert_eq!(
        shard_1["nodes"],
        serde_json::json!([job.hosts.ips[1], job.hosts.ips[0]])
    );
    assert!(
        finished[0].stderr.contains("rejoined trainer=0 generation="),
        "{}",
        finished[0].stderr
    );
    let summary: serde_json::Value = common::read_summary(&job.run_dirs[0]);
    // Each shard saves its tables in its own node's run directory: shard 1's is the second's.
    let saved = "ps-shard-1.safetensors";
    std::fs::copy(job.run_dirs[1].join(saved), job.run_dirs[0].join(saved)).unwrap();
    common::ps_matches_uninterrupted(&PARAMETER_SERVERS[..1], &summary, &job.run_dirs[0]);
}

#[test]
fn a_geo_trainer_whose_node_was_lost_with_its_disk_takes_its_own_state_back_from_the_other_node() {
    // Geo pushes every 8 local steps; its checkpoints fall on pushes.
    const GEO: [&str; 6] = [
        "strategy.a_sync=true",
        "strategy.a_sync_configs.k_steps=8",
        "train.steps=240",
        "fault_tolerance.checkpoint_every=40",
        "fault_tolerance.max_restarts=1",
        "fault_tolerance.heartbeat_interval_ms=200",
    ];
    let Some(job) = Separate::create_or_say_why(Layout::ParameterServers, &GEO) else {
        return;
    };
    let finished = job.lose_the_second_node(80, Disk::Emptied);
    let stderr = &finished[1].stderr;
    let own_state_back = stderr
        .lines()
        .any(|line| line.contains("own state restored trainer=1") && line.contains("from=\"buddy rank 0\""));
    assert!(
        own_state_back,
        "trainer 1 did not take its state from the first node:\n{stderr}"
    );
    // Not bitwise (geo applies deltas in arrival order): each trainer's 30 pushes applied once.
    let summary: serde_json::Value = common::read_summary(&job.run_dirs[0]);
    assert_eq!(summary["updates_applied"], serde_json::json!([60, 60]), "{summary}");
}
