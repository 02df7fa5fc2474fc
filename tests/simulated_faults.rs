//! Faults injected into the simulated cluster — a rank or a pipeline stage killed or stalled
//! before a step, a link that delays its messages or loses one — recovered from in place through the path a launched
//! job takes (heartbeats, the coordinator's rollback orders as messages to the rank actors,
//! survivors restoring in their process, one replacement). The job must end bitwise equal to the run without faults: every
//! rank rolls back to one committed state and replays the same batches in the same order.

mod common;

use std::time::Duration;

use common::{config, ps_matches_uninterrupted, PIPELINE_2X2};
use flotilla::actors::recovery::faults::RoleFault;
use flotilla::config::JobConfig;
use flotilla::engines::comm::memory::LinkFault;
use flotilla::job::ps::{ParameterServerJob, PsSummary};
use flotilla::job::{FaultPlan, FaultReport, RunOptions, TrainingJob};

/// 60 steps, checkpoints every 20; heartbeats every 20 ms, a rank silent for 1 s is dead (the
/// cluster's actors share one thread, which a checkpoint's commit may hold for a moment).
const RECOVERING: [&str; 5] = [
    "train.steps=60",
    "fault_tolerance.checkpoint_every=20",
    "fault_tolerance.heartbeat_interval_ms=20",
    "fault_tolerance.heartbeat_misses=50",
    "fault_tolerance.max_restarts=2",
];

/// Three data-parallel ranks of 21 samples each, with `extra` settings.
fn job(extra: &[&str]) -> TrainingJob {
    let ranks = ["cluster.world_size=3", "train.batch_size=63"];
    TrainingJob::builtin(config(&[&RECOVERING[..], &ranks, extra].concat())).expect("job")
}

/// Two replicas of a two-stage pipeline.
fn pipeline() -> TrainingJob {
    TrainingJob::builtin(config(&[&RECOVERING[..], &PIPELINE_2X2].concat())).expect("job")
}

/// The checksum of the final parameters, and the replacements, of `job` struck by `plan`.
fn run(job: &TrainingJob, plan: &FaultPlan) -> (String, FaultReport) {
    let dir = tempfile::tempdir().unwrap();
    let (outcome, report) = job
        .run_simulated_with_faults(&RunOptions::new(dir.path()), plan)
        .expect("the job survives its faults");
    (outcome.summary.param_checksum, report)
}

fn uninterrupted(job: &TrainingJob) -> String {
    let dir = tempfile::tempdir().unwrap();
    job.run_simulated(&RunOptions::new(dir.path()))
        .unwrap()
        .summary
        .param_checksum
}

fn role(rank: usize, step: usize, fault: RoleFault) -> FaultPlan {
    FaultPlan {
        roles: vec![(rank, step, fault)],
        ..FaultPlan::default()
    }
}

/// The coordinator's rollback order is a message to each surviving rank's actor: in the
/// simulated cluster a rank's heartbeats carry no order (one would stop the rank and cost a
/// replacement), so one replacement, of the killed rank, shows the survivors rolled back on
/// the message alone.
#[test]
fn a_killed_rank_is_replaced_alone_and_the_job_ends_as_without_faults() {
    killed_ranks_are_replaced_alone(&job(&[]));
}

/// The same with sharded states (AdamW; stage 2, and stage 3 whose parameters are sharded too):
/// every rank's relinked ring cuts the shards anew, and the restored state gives each its shard
/// back.
#[test]
fn a_killed_rank_of_a_sharded_job_is_replaced_alone_and_the_job_ends_as_without_faults() {
    for stage in ["strategy.sharding_configs.stage=2", "strategy.sharding_configs.stage=3"] {
        let sharded = [
            "strategy.sharding=true",
            stage,
            "train.optimizer=\"adamw\"",
            "train.lr=0.001",
        ];
        killed_ranks_are_replaced_alone(&job(&sharded));
    }
}

/// Two replicas of an MLP whose layers two ranks split (tensor parallelism): the replacement
/// joins both its rings, the survivors relink their layer groups in place, and every rank cuts
/// its part of the layers from the whole restored state.
#[test]
fn a_killed_rank_of_a_job_splitting_its_layers_is_replaced_alone_and_the_job_ends_as_without_faults() {
    #[rustfmt::skip]
    let split = ["cluster.world_size=4", "train.batch_size=64", "strategy.hybrid_configs.dp_degree=2", "strategy.hybrid_configs.mp_degree=2"];
    killed_ranks_are_replaced_alone(&job(&split));
}

/// Rank 1, then rank 0, of `job` killed at step 30: each is replaced alone, and the job ends
/// with the parameters of the uninterrupted run.
fn killed_ranks_are_replaced_alone(job: &TrainingJob) {
    let expected = uninterrupted(job);
    for rank in [1, 0] {
        let (checksum, report) = run(job, &role(rank, 30, RoleFault::Kill));
        let mut replaced = vec![0; job.config.world_size()];
        replaced[rank] = 1;
        assert_eq!(report.replaced, replaced, "rank {rank} killed");
        assert_eq!(checksum, expected, "rank {rank} killed");
    }
}

#[test]
fn a_stalled_rank_is_declared_dead_killed_and_replaced_and_the_job_ends_as_without_faults() {
    let job = job(&[]);
    let (checksum, report) = run(&job, &role(2, 35, RoleFault::Stall));
    assert_eq!(report.replaced, vec![0, 0, 1]);
    assert_eq!(checksum, uninterrupted(&job));
}

/// Whole replicas, and replicas keeping only their shards of the parameters (stage 3), which the
/// step-0 state kept in memory gives back.
#[test]
fn without_checkpoints_a_killed_rank_costs_a_replay_from_step_0() {
    let sharded = ["strategy.sharding=true", "strategy.sharding_configs.stage=3"];
    for settings in [&[][..], &sharded[..]] {
        let job = job(&[&["fault_tolerance.checkpoint_every=0"][..], settings].concat());
        let (checksum, report) = run(&job, &role(1, 40, RoleFault::Kill));
        assert_eq!(report.replaced, vec![0, 1, 0], "{settings:?}");
        assert_eq!(checksum, uninterrupted(&job), "{settings:?}");
    }
}

#[test]
fn a_slow_link_costs_nothing_but_time() {
    let job = job(&[]);
    let plan = FaultPlan {
        links: vec![(0, 1, LinkFault::Delay(Duration::from_millis(1)))],
        ..FaultPlan::default()
    };
    let (checksum, report) = run(&job, &plan);
    assert_eq!(report.replaced, vec![0, 0, 0]);
    assert_eq!(checksum, uninterrupted(&job));
}

#[test]
fn a_lost_message_breaks_its_link_and_the_rank_that_waited_for_it_is_replaced() {
    let job = job(&[]);
    // Each step all-reduces over the ring: message 200 from rank 1 falls mid-run.
    let plan = FaultPlan {
        links: vec![(1, 2, LinkFault::Drop { message: 200 })],
        ..FaultPlan::default()
    };
    let (checksum, report) = run(&job, &plan);
    assert_eq!(report.replaced, vec![0, 0, 1], "rank 2 receives rank 1's messages");
    assert_eq!(checksum, uninterrupted(&job));
}

#[test]
fn a_fault_plan_outside_the_cluster_or_without_in_place_recovery_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let options = RunOptions::new(dir.path());
    let error = job(&[])
        .run_simulated_with_faults(&options, &role(3, 10, RoleFault::Kill))
        .unwrap_err();
    assert!(format!("{error:#}").contains("role 3 of a cluster of 3"), "{error:#}");
    let across = FaultPlan {
        links: vec![(0, 2, LinkFault::Drop { message: 1 })],
        ..FaultPlan::default()
    };
    let error = job(&[]).run_simulated_with_faults(&options, &across).unwrap_err();
    assert!(
        format!("{error:#}").contains("no ring carries messages from rank 0 to rank 2"),
        "{error:#}"
    );
    let error = job(&["fault_tolerance.recovery=restart"])
        .run_simulated_with_faults(&options, &role(1, 10, RoleFault::Kill))
        .unwrap_err();
    assert!(format!("{error:#}").contains("fault_tolerance.recovery"), "{error:#}");
}

#[test]
fn a_killed_pipeline_stage_is_replaced_alone_and_the_pipeline_ends_as_without_faults() {
    let job = pipeline();
    let (checksum, report) = run(&job, &role(3, 30, RoleFault::Kill));
    assert_eq!(report.replaced, vec![0, 0, 0, 1], "stage 1 of replica 1 killed");
    assert_eq!(checksum, uninterrupted(&job));
}

#[test]
fn a_stalled_pipeline_stage_is_declared_dead_killed_and_replaced() {
    let job = pipeline();
    let (checksum, report) = run(&job, &role(0, 25, RoleFault::Stall));
    assert_eq!(report.replaced, vec![1, 0, 0, 0], "stage 0 of replica 0 stalled");
    assert_eq!(checksum, uninterrupted(&job));
}

#[test]
fn a_pipelines_slow_links_cost_nothing_but_time() {
    let job = pipeline();
    let slow = LinkFault::Delay(Duration::from_millis(1));
    // Rank 0's activations to rank 1, rank 3's gradients to rank 2, rank 1's to its replica.
    let plan = FaultPlan {
        links: vec![(0, 1, slow), (3, 2, slow), (1, 3, slow)],
        ..FaultPlan::default()
    };
    let (checksum, report) = run(&job, &plan);
    assert_eq!(report.replaced, vec![0, 0, 0, 0]);
    assert_eq!(checksum, uninterrupted(&job));
}

#[test]
fn a_message_lost_between_stages_or_replicas_costs_the_rank_that_waited_for_it() {
    let job = pipeline();
    // A gradient of stage 1 to stage 0 of replica 1, and a message of stage 0's all-reduce.
    for (from, to) in [(3, 2), (0, 2)] {
        let plan = FaultPlan {
            links: vec![(from, to, LinkFault::Drop { message: 100 })],
            ..FaultPlan::default()
        };
        let (checksum, report) = run(&job, &plan);
        let mut replaced = vec![0; 4];
        replaced[to] = 1;
        assert_eq!(report.replaced, replaced, "message lost from rank {from} to rank {to}");
        assert_eq!(
            checksum,
            uninterrupted(&job),
            "message lost from rank {from} to rank {to}"
        );
    }
}

/// A two-stage pipeline whose stages two ranks split (its MLP's column-split layer ends stage
/// 0): a killed rank is replaced alone, its stage's layer group relinked in place; a message lost
/// on stage 1's layer group costs the rank that waited for it. Each run ends as without faults.
#[test]
fn a_pipeline_of_split_stages_recovers_from_a_killed_rank_and_a_lost_layer_message() {
    #[rustfmt::skip]
    let split = ["strategy.pipeline=true", "cluster.nproc_per_node=4", "strategy.hybrid_configs.pp_degree=2",
        "strategy.hybrid_configs.mp_degree=2", "strategy.pipeline_configs.accumulate_steps=4",
        "strategy.pipeline_configs.stage_boundaries=[1]", "train.hidden_sizes=[64, 32]"];
    let job = TrainingJob::builtin(config(&[&RECOVERING[..], &split].concat())).expect("job");
    killed_ranks_are_replaced_alone(&job);
    let plan = FaultPlan {
        links: vec![(2, 3, LinkFault::Drop { message: 100 })],
        ..FaultPlan::default()
    };
    let (checksum, report) = run(&job, &plan);
    assert_eq!(report.replaced, vec![0, 0, 0, 1], "a layer group's message lost");
    assert_eq!(checksum, uninterrupted(&job), "a layer group's message lost");
}

/// Two shards and two trainers of `examples/ctr_ps.toml` (roles 0 and 1 are the servers, 2 and 3
/// the trainers), recovering as the other jobs here, with `extra` settings.
fn ps_settings(extra: &[&'static str]) -> Vec<&'static str> {
    [&RECOVERING[..], &["train.batch_size=256"], extra].concat()
}

fn ps_config(settings: &[&str]) -> JobConfig {
    let settings: Vec<String> = settings.iter().map(|s| s.to_string()).collect();
    JobConfig::from_file(std::path::Path::new("examples/ctr_ps.toml"), &|_| None, &settings).expect("config")
}

/// `settings`' parameter-server job struck by `plan`: its summary, its run directory and the
/// replacements.
fn run_ps(settings: &[&str], plan: &FaultPlan) -> (PsSummary, tempfile::TempDir, FaultReport) {
    let dir = tempfile::tempdir().unwrap();
    let job = ParameterServerJob::builtin(ps_config(settings)).expect("job");
    let (summary, report) = job
        .run_simulated_with_faults(&RunOptions::new(dir.path()), plan)
        .expect("the job survives its faults");
    (summary, dir, report)
}

/// Runs the sync job struck by `plan`, which must cost `replaced` replacements and end bitwise
/// equal to the same job without faults: its shards' tables and dense slices, AUC and loss.
fn ps_sync_survives(extra: &[&'static str], plan: &FaultPlan, replaced: [usize; 4]) {
    let settings = ps_settings(extra);
    let (summary, dir, report) = run_ps(&settings, plan);
    assert_eq!(report.replaced, replaced, "{plan:?}");
    assert_eq!(summary.steps, 60);
    let summary = serde_json::to_value(&summary).unwrap();
    ps_matches_uninterrupted(&settings, &summary, dir.path());
}

#[test]
fn a_killed_sync_shard_or_trainer_is_replaced_alone_and_the_job_ends_as_without_faults() {
    ps_sync_survives(&[], &role(0, 30, RoleFault::Kill), [1, 0, 0, 0]);
    ps_sync_survives(&[], &role(3, 30, RoleFault::Kill), [0, 0, 0, 1]);
}

/// Row policies checkpoint their state: counts, the shows of rows not admitted yet, the tally.
/// Passes of 15 steps end at 15 and 30; the trainer killed before step 30 rolls the job back to
/// step 20, between them.
#[test]
fn a_job_with_table_policies_resumes_their_counts_and_ends_as_without_faults() {
    let policies = [
        "strategy.sparse_pass_steps=15",
        "strategy.sparse_table_configs.embedding.count_filter=2",
        "strategy.sparse_table_configs.wide.delete_after_unseen_days=0",
    ];
    ps_sync_survives(&policies, &role(3, 30, RoleFault::Kill), [0, 0, 0, 1]);
}

#[test]
fn a_stalled_shard_is_declared_dead_killed_and_replaced_and_the_job_ends_as_without_faults() {
    ps_sync_survives(&[], &role(1, 25, RoleFault::Stall), [0, 1, 0, 0]);
}

#[test]
fn a_lost_push_answer_or_pull_is_retried_and_applied_once_a_slow_link_costs_only_time() {
    // Each step a trainer pulls then pushes on each of its links: its request 11 is the push of
    // step 5, request 24 the pull of step 12.
    let plan = FaultPlan {
        links: vec![
            (0, 2, LinkFault::Drop { message: 11 }),
            (3, 1, LinkFault::Drop { message: 24 }),
            (2, 1, LinkFault::Delay(Duration::from_millis(1))),
        ],
        ..FaultPlan::default()
    };
    ps_sync_survives(&[], &plan, [0, 0, 0, 0]);
    // Without retries, the trainer whose answer was lost fails, and is replaced.
    let lost_answer = FaultPlan {
        links: plan.links[..1].to_vec(),
        ..FaultPlan::default()
    };
    ps_sync_survives(&["fault_tolerance.retry=0"], &lost_answer, [0, 0, 1, 0]);
}

/// Async and geo cannot be bitwise equal to a run without faults (pushes apply in arrival
/// order): each shard must end having applied each trainer's push of each step once.
fn applied_once(extra: &[&'static str], plan: &FaultPlan, replaced: [usize; 4], pushes_per_trainer: u64) {
    let (summary, _dir, report) = run_ps(&ps_settings(extra), plan);
    assert_eq!(report.replaced, replaced, "{plan:?}");
    assert_eq!(summary.updates_applied, vec![2 * pushes_per_trainer; 2], "{summary:?}");
    assert!(summary.auc > 0.6, "{summary:?}");
}

#[test]
fn async_and_geo_lose_no_update_to_a_killed_shard_or_trainer_nor_apply_one_twice() {
    applied_once(
        &["strategy.a_sync=true"],
        &role(1, 30, RoleFault::Kill),
        [0, 1, 0, 0],
        60,
    );
    let geo = ["strategy.a_sync=true", "strategy.a_sync_configs.k_steps=4"];
    applied_once(&geo, &role(2, 30, RoleFault::Kill), [0, 0, 1, 0], 60 / 4);
}

#[test]
fn a_link_fault_between_two_trainers_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let plan = FaultPlan {
        links: vec![(2, 3, LinkFault::Drop { message: 1 })],
        ..FaultPlan::default()
    };
    let job = ParameterServerJob::builtin(ps_config(&ps_settings(&[]))).expect("job");
    let error = job
        .run_simulated_with_faults(&RunOptions::new(dir.path()), &plan)
        .unwrap_err();
    assert!(
        format!("{error:#}").contains("no link carries messages from trainer 0 to trainer 1"),
        "{error:#}"
    );
}

/// Links delayed by 5 ms each way between the trainers (roles 2, 3) and the shards (0, 1) slow
/// every sync step by at least the pull's and the push's round trips: 60 steps take at least
/// 60 × 4 × 5 ms, however loaded the machine (a lower bound only; how much of its throughput
/// async mode keeps over slow links is a figure for `benches/`, and that its next pull overlaps
/// the step is checked structurally in `tests/parameter_server.rs`).
#[test]
fn delayed_links_delay_every_request_and_answer_between_trainers_and_shards() {
    let delay = LinkFault::Delay(Duration::from_millis(5));
    let plan = FaultPlan {
        links: [(2, 0), (2, 1), (3, 0), (3, 1)]
            .into_iter()
            .flat_map(|(trainer, shard)| [(trainer, shard, delay), (shard, trainer, delay)])
            .collect(),
        ..FaultPlan::default()
    };
    let settings = ps_settings(&["train.steps=60"]);
    let (summary, _dir, _) = run_ps(&settings, &plan);
    let config = ps_config(&settings);
    let seconds = (summary.steps * config.train.batch_size) as f64 / summary.samples_per_sec;
    assert!(
        seconds >= 60.0 * 4.0 * 0.005,
        "60 sync steps over 5 ms links took {seconds:.3} s, less than their round trips"
    );
}
