//! Sharded states (`strategy.sharding`, ZeRO stages 1, 2 and 3) train as plain data parallelism
//! on the same ranks, and so within `data_parallel_equivalence.rs`'s tolerance of one process.
//!
//! Bit for bit against data parallelism at stages 1 and 2: a stage-2 rank's reduce-scatter sums
//! every value in the order the all-reduce does (the same buckets, the same ring steps), a
//! stage-1 rank all-reduces as data parallelism does, the division by the world and the
//! optimizer's arithmetic are element-wise, and the all-gather of the updated shards copies
//! values. Stage 3 cuts its buckets by block instead, so a value's place in its bucket — and with
//! it the order its ring sums the ranks' gradients in — changes: bit for bit on two ranks (a sum
//! of two is the same either way round), within 1e-5 of data parallelism on more (the one-process
//! tolerance), as are clipped runs, whose global norm is summed from the ranks' shards.

mod common;

use common::{config, max_abs_diff, train_in_process};
use flotilla::job::RunOutcome;

/// 20 steps of the default MLP job with `settings`.
fn run(settings: &[&str]) -> RunOutcome {
    train_in_process(config(
        &[&["train.steps=20", "strategy.check_every=5"], settings].concat(),
    ))
}

/// The job `settings` on `world` ranks trains to the same bits with sharding stage 1 and 2 as
/// without (and stage 3 on two ranks; within 1e-5 on more), and within 1e-5 of one process.
fn assert_sharding_changes_nothing(world: usize, settings: &[&str]) {
    let ranks = format!("cluster.nproc_per_node={world}");
    let plain = run(&[&[ranks.as_str()], settings].concat());
    for stage in [1, 2, 3] {
        let bitwise = stage < 3 || world == 2;
        let stage = format!("strategy.sharding_configs.stage={stage}");
        let sharded = run(&[&[ranks.as_str(), "strategy.sharding=true", &stage], settings].concat());
        assert_eq!(sharded.summary.steps, 20);
        let diff = max_abs_diff(&plain.parameters, &sharded.parameters);
        let case = format!("{world} ranks, {stage} {settings:?}: max |Δparam| = {diff:e}");
        // Every held-out row scored, whatever each rank's share: a sharded replica scores
        // them block by block, each block's parameters gathered for it.
        assert_eq!(plain.summary.test_samples, sharded.summary.test_samples, "{case}");
        let test_loss = (plain.summary.test_loss - sharded.summary.test_loss).abs();
        if bitwise {
            assert_eq!(diff, 0.0, "{case}");
            assert_eq!(plain.losses, sharded.losses, "{case}");
            assert_eq!(test_loss, 0.0, "{case}");
        } else {
            assert!(diff <= 1e-5, "{case}");
            assert!(
                test_loss <= 1e-5 * plain.summary.test_loss.abs().max(1.0),
                "{case}: Δtest_loss = {test_loss:e}"
            );
        }
    }
    let single = run(&[&["cluster.nproc_per_node=1"], settings].concat());
    let diff = max_abs_diff(&single.parameters, &plain.parameters);
    assert!(
        diff <= 1e-5,
        "{world} ranks against one process: max |Δparam| = {diff:e}"
    );
}

#[test]
fn sgd_with_momentum_on_two_and_four_ranks_matches_data_parallelism_bit_for_bit() {
    // 2 KiB buckets: fc1's 1,290 values and fc0's 8,320 in buckets of their own, cut into
    // shards the world does not divide evenly.
    for world in [2, 4] {
        assert_sharding_changes_nothing(world, &["strategy.fuse_grad_size_in_MB=0.002"]);
    }
}

#[test]
fn adamw_with_weight_decay_on_three_ranks_matches_data_parallelism_bit_for_bit() {
    assert_sharding_changes_nothing(
        3,
        &[
            "train.optimizer=\"adamw\"",
            "train.lr=0.001",
            "train.weight_decay=0.01",
            "train.batch_size=66",
            "train.hidden_sizes=[37, 19]",
            "strategy.fuse_grad_size_in_MB=0.0005",
        ],
    );
}

#[test]
fn a_gpt_sharded_over_two_and_four_ranks_matches_data_parallelism_bit_for_bit() {
    for world in [2, 4] {
        let training = [
            "train.optimizer=\"adamw\"",
            "train.lr=0.003",
            "train.test_fraction=0.002",
            "strategy.fuse_grad_size_in_MB=0.01",
        ];
        assert_sharding_changes_nothing(world, &[&common::TINY_GPT[..], &training[..]].concat());
    }
}

/// A pipeline's stages shard their states over their replicas (each stage part's data-parallel
/// ring): 2 replicas of 2 stages, and the 4-D layout — 2 sharded replicas × 2 stages × 2 parts
/// of each stage's split layers — train bit for bit as without sharding, the replicas counted as
/// `dp_degree` (stage 1) or as `sharding_degree` (stage 2).
#[test]
fn a_pipelines_stages_shard_their_states_over_their_replicas_bit_for_bit() {
    #[rustfmt::skip]
    let pipeline = [&common::TINY_GPT[..], &["train.optimizer=\"adamw\"", "train.lr=0.003",
        "train.test_fraction=0.002", "strategy.fuse_grad_size_in_MB=0.01", "strategy.pipeline=true",
        "strategy.hybrid_configs.pp_degree=2", "strategy.pipeline_configs.accumulate_steps=2", "train.gpt.n_head=4"]]
    .concat();
    for (ranks, mp) in [(4, 1), (8, 2)] {
        let (ranks, mp) = (
            format!("cluster.nproc_per_node={ranks}"),
            format!("strategy.hybrid_configs.mp_degree={mp}"),
        );
        let layout = [&pipeline[..], &[ranks.as_str(), mp.as_str()]].concat();
        let plain = run(&[&layout[..], &["strategy.hybrid_configs.dp_degree=2"]].concat());
        for (stage, replicas) in [
            ("1", "strategy.hybrid_configs.dp_degree=2"),
            ("2", "strategy.hybrid_configs.sharding_degree=2"),
        ] {
            let stage = format!("strategy.sharding_configs.stage={stage}");
            // Checkpoints gather the shards from every replica of each stage's part.
            let sharded = [
                replicas,
                "strategy.sharding=true",
                stage.as_str(),
                "fault_tolerance.checkpoint_every=10",
            ];
            let sharded = run(&[&layout[..], &sharded[..]].concat());
            let diff = max_abs_diff(&plain.parameters, &sharded.parameters);
            assert_eq!(diff, 0.0, "{ranks} {mp} {stage}: max |Δparam| = {diff:e}");
            assert_eq!(plain.losses, sharded.losses, "{ranks} {mp} {stage}");
            let held = |run: &RunOutcome| run.summary.state_bytes.expect("state bytes").optimizer;
            // AdamW's two moments of stage 0, against two moments and a copy of half of them.
            assert!(
                held(&sharded) < held(&plain),
                "{ranks} {mp} {stage}: the moments are sharded"
            );
        }
    }
}

#[test]
fn gradient_merge_and_recompute_combine_with_sharded_gradients() {
    assert_sharding_changes_nothing(
        2,
        &[
            "strategy.gradient_merge=true",
            "strategy.gradient_merge_configs.k_steps=2",
            "strategy.recompute=true",
            "strategy.recompute_configs.checkpoints=[\"fc0\"]",
            "strategy.fuse_grad_size_in_MB=0.002",
        ],
    );
}

/// Stage 3 with split layers: 2 data-parallel ranks × 2 parts of a GPT's layers, each part's
/// parameters sharded over its 2 replicas — within 1e-5 of one process (the split layers' sums
/// and the shards' norm in another order), each rank holding half of its part's parameters,
/// gradients and moments between steps.
#[test]
fn parameters_sharded_beside_split_layers_hold_half_of_each_part() {
    let gpt = [
        &common::TINY_GPT[..],
        &["train.optimizer=\"adamw\"", "train.lr=0.003", "train.gpt.n_head=4"],
    ]
    .concat();
    let single = run(&gpt);
    let split = ["cluster.nproc_per_node=4", "strategy.hybrid_configs.mp_degree=2"];
    let parts = run(&[&gpt[..], &split[..], &["strategy.hybrid_configs.dp_degree=2"]].concat());
    let sharding = [
        "strategy.hybrid_configs.sharding_degree=2",
        "strategy.sharding=true",
        "strategy.sharding_configs.stage=3",
        "fault_tolerance.checkpoint_every=10",
    ];
    let sharded = run(&[&gpt[..], &split[..], &sharding[..]].concat());
    let diff = max_abs_diff(&single.parameters, &sharded.parameters);
    assert!(diff <= 1e-5, "max |Δparam| = {diff:e}");
    let [whole, held] = [parts, sharded].map(|run| run.summary.state_bytes.expect("state bytes"));
    for (term, mine, all) in [
        ("parameters", held.parameters, whole.parameters),
        ("gradients", held.gradients, whole.gradients),
        ("optimizer", held.optimizer, whole.optimizer),
    ] {
        // Half, give or take the shards' rounding (a bucket's last rank may hold a value less).
        assert!(mine.abs_diff(all / 2) <= 64, "{term}: {mine} of {all}");
    }
}

/// Sharding inside each of 2 nodes of 2 ranks, the nodes holding replicas of the shards: the
/// reduce-scatter sums a node's share over the node, then across the nodes, as the hierarchical
/// all-reduce does — so the run is bit for bit the hierarchical data-parallel one (each level a
/// sum of two, whatever stage 3's buckets), while each rank holds half of the optimizer's states
/// (and at stage 2 of the gradients, at stage 3 of the parameters too).
#[test]
fn sharding_inside_the_nodes_with_replicas_across_matches_the_hierarchical_all_reduce() {
    let nodes = [
        "cluster.nnodes=2",
        "cluster.nproc_per_node=2",
        "train.optimizer=\"adamw\"",
        "train.lr=0.001",
        "strategy.fuse_grad_size_in_MB=0.002",
    ];
    let plain = run(&[&nodes[..], &["strategy.use_hierarchical_allreduce=true"]].concat());
    let whole = plain.summary.state_bytes.expect("a data-parallel run's state bytes");
    for number in [1, 2, 3] {
        let stage = format!("strategy.sharding_configs.stage={number}");
        let hybrid = [
            "strategy.sharding=true",
            "strategy.hybrid_configs.sharding_degree=2",
            "strategy.hybrid_configs.dp_degree=2",
            &stage,
        ];
        let sharded = run(&[&nodes[..], &hybrid[..]].concat());
        let diff = max_abs_diff(&plain.parameters, &sharded.parameters);
        assert_eq!(diff, 0.0, "{stage}: max |Δparam| = {diff:e}");
        let held = sharded.summary.state_bytes.expect("a data-parallel run's state bytes");
        // Half of the two moments, and (stages 1, 2) half of the parameters as the shard's own
        // copy; at stage 3 that copy is the parameters'.
        let (optimizer, parameters) = match number {
            3 => (whole.optimizer / 2, whole.parameters / 2),
            _ => (whole.optimizer * 3 / 4, whole.parameters),
        };
        assert!(
            held.optimizer.abs_diff(optimizer) <= 64 && held.parameters.abs_diff(parameters) <= 64,
            "{stage}: {held:?} against {whole:?}"
        );
    }
}

/// A norm limit that binds at every step: the shards' norm is the whole gradient's, summed in
/// another order.
#[test]
fn clipping_the_sharded_gradients_clips_the_global_norm() {
    let clip = ["train.grad_clip_norm=0.05", "strategy.fuse_grad_size_in_MB=0.002"];
    let plain = run(&[&["cluster.nproc_per_node=4"], &clip[..]].concat());
    let unclipped = run(&[
        "cluster.nproc_per_node=4",
        "strategy.sharding=true",
        "strategy.sharding_configs.stage=2",
    ]);
    for stage in ["1", "2", "3"] {
        let stage = format!("strategy.sharding_configs.stage={stage}");
        let sharded = run(&[
            &["cluster.nproc_per_node=4", "strategy.sharding=true", &stage],
            &clip[..],
        ]
        .concat());
        let diff = max_abs_diff(&plain.parameters, &sharded.parameters);
        assert!(diff <= 1e-5, "{stage}: max |Δparam| = {diff:e}");
        let moved = max_abs_diff(&unclipped.parameters, &sharded.parameters);
        assert!(moved > 1e-3, "{stage}: clipping moved the parameters by only {moved:e}");
    }
}

/// A checkpoint holds the whole state in the replica's layout, whatever the sharding: one of
/// four sharded ranks resumes on two sharded ranks and on two plain ones, and a plain one on four
/// sharded ranks, as the uninterrupted run goes on (within the resharding tolerance, 1e-5: the
/// ranks' means are summed in another order on another number of ranks).
#[test]
fn a_checkpoint_resumes_on_another_number_of_ranks_sharded_or_not() {
    use common::{flotilla, read_params};
    let dir = tempfile::tempdir().expect("temp dir");
    // The sharding stage of each layout (`None`: unsharded).
    let job = |ranks: usize, stage: Option<u8>| {
        let mut settings = vec![
            "train.batch_size=48".to_string(),
            "strategy.fuse_grad_size_in_MB=0.002".to_string(),
            "train.optimizer=\"adamw\"".to_string(),
            "train.lr=0.001".to_string(),
            "fault_tolerance.checkpoint_every=10".to_string(),
            format!("cluster.nproc_per_node={ranks}"),
        ];
        // Unsharded, the stage goes back to its default (a stage without sharding is refused).
        settings.push(format!("strategy.sharding={}", stage.is_some()));
        settings.push(format!("strategy.sharding_configs.stage={}", stage.unwrap_or(1)));
        settings
            .into_iter()
            .flat_map(|s| ["--set".to_string(), s])
            .collect::<Vec<_>>()
    };
    let train = |run_dir: &std::path::Path, flags: Vec<String>, steps: usize, resume: bool| {
        let steps = format!("train.steps={steps}");
        let mode = if resume { "--resume" } else { "--run-dir" };
        let mut args = vec!["train", mode, run_dir.to_str().expect("utf-8"), "--set", &steps];
        args.extend(flags.iter().map(String::as_str));
        let finished = flotilla(&args, &[], 120);
        assert!(finished.success, "{}", finished.stderr);
        if resume {
            assert!(
                finished.stderr.contains("state restored rank=0 step=20"),
                "{}",
                finished.stderr
            );
        }
    };
    let uninterrupted = dir.path().join("uninterrupted");
    train(&uninterrupted, job(4, Some(2)), 30, false);
    let expected = read_params(&uninterrupted.join("params.safetensors"));
    for (from, to) in [
        ((4, Some(2)), (2, Some(2))),
        ((4, Some(3)), (2, Some(3))),
        ((4, Some(3)), (2, None)),
        ((4, None), (4, Some(3))),
    ] {
        let run_dir = dir.path().join(format!("{from:?}-{to:?}"));
        train(&run_dir, job(from.0, from.1), 20, false);
        let checkpoints = run_dir.join("checkpoints");
        let inspected = flotilla(
            &["checkpoint", "inspect", checkpoints.to_str().expect("utf-8")],
            &[],
            30,
        );
        let layout = match from.1 {
            Some(stage) => {
                format!("4 rank(s) with sharded states (stage {stage}), one copy of the replica (the shards gathered)")
            }
            None => "4 rank(s), one copy of the replica".to_string(),
        };
        assert!(inspected.stdout.contains(&layout), "{}", inspected.stdout);
        train(&run_dir, job(to.0, to.1), 30, true);
        let diff = max_abs_diff(&expected, &read_params(&run_dir.join("params.safetensors")));
        eprintln!("{from:?} → {to:?}: max |Δparam| = {diff:e}");
        assert!(diff <= 1e-5, "{from:?} → {to:?}: max |Δparam| = {diff:e}");
    }
}

/// A stage-3 checkpoint, gathered and written a block at a time, is the file a replica holding
/// the whole model writes, tensor for tensor: on two ranks (where stage 3 trains bit for bit as
/// data parallelism) every parameter and optimizer slot is there under its name, in its shape,
/// with the same bits.
#[test]
fn a_sharded_parameters_checkpoint_holds_what_a_whole_replica_writes() {
    use std::collections::BTreeMap;
    let dir = tempfile::tempdir().expect("temp dir");
    let state = |name: &str, sharding: &[&str]| -> BTreeMap<String, (Vec<usize>, Vec<u8>)> {
        let run_dir = dir.path().join(name);
        #[rustfmt::skip]
        let mut args = vec!["train", "--run-dir", run_dir.to_str().expect("utf-8"), "--set", "train.steps=10",
            "--set", "cluster.nproc_per_node=2", "--set", "train.optimizer=\"adamw\"", "--set", "train.lr=0.001",
            "--set", "fault_tolerance.checkpoint_every=10", "--set", "strategy.fuse_grad_size_in_MB=0.002"];
        for setting in sharding {
            args.extend(["--set", setting]);
        }
        let finished = common::flotilla(&args, &[], 120);
        assert!(finished.success, "{}", finished.stderr);
        let step = run_dir.join("checkpoints").join("step-00000010");
        let file = std::fs::read_dir(&step)
            .expect("the checkpoint of step 10")
            .map(|entry| entry.expect("an entry").path())
            .find(|path| path.extension().is_some_and(|e| e == "safetensors"))
            .expect("a state file");
        let bytes = std::fs::read(&file).expect("the state file");
        let tensors = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
        tensors
            .tensors()
            .into_iter()
            .map(|(name, view)| (name, (view.shape().to_vec(), view.data().to_vec())))
            .collect()
    };
    let whole = state("whole", &[]);
    let sharded = state(
        "sharded",
        &["strategy.sharding=true", "strategy.sharding_configs.stage=3"],
    );
    assert!(whole.keys().any(|k| k.starts_with("optimizer.")), "{:?}", whole.keys());
    assert_eq!(whole.keys().collect::<Vec<_>>(), sharded.keys().collect::<Vec<_>>());
    for (name, tensor) in &whole {
        assert!(sharded[name] == *tensor, "{name} differs");
    }
}

/// A traced sharded step shows each bucket's reduce-scatter and its parameters' all-gathers on the
/// communication lane of every rank: at stage 2 one of each per bucket; at stage 3 (a bucket per
/// layer) one per layer's forward, and one per backward but the last layer's, which stays held.
#[test]
fn a_traced_sharded_step_shows_its_reduce_scatters_and_all_gathers() {
    use flotilla::job::{RunOptions, TrainingJob};
    // Two buckets (fc1's 1,290 values, then fc0's 8,320) in each of 3 steps.
    for (stage, gathers_per_step) in [
        ("strategy.sharding_configs.stage=2", 2),
        ("strategy.sharding_configs.stage=3", 3),
    ] {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut options = RunOptions::new(dir.path());
        let traces = dir.path().join("trace");
        options.trace = Some(traces.clone());
        #[rustfmt::skip]
        let job = config(&["train.steps=3", "cluster.nproc_per_node=2", "strategy.sharding=true", stage,
            "strategy.fuse_grad_size_in_MB=0.002"]);
        TrainingJob::builtin(job)
            .expect("job")
            .run_simulated(&options)
            .expect("training succeeds");
        let trace: serde_json::Value =
            serde_json::from_slice(&std::fs::read(traces.join("trace.json")).expect("the merged trace")).expect("JSON");
        for pid in 0..2 {
            let scatters = common::trace_spans(&trace, pid, |n| n.starts_with("reduce-scatter bucket "));
            let gathers = common::trace_spans(&trace, pid, |n| n.starts_with("all-gather parameter bucket "));
            assert_eq!(
                (scatters.len(), gathers.len()),
                (6, 3 * gathers_per_step),
                "{stage}, rank {pid}"
            );
        }
    }
}

/// `strategy.fp16_allreduce` carries the reduce-scatter's partial sums as bfloat16 (the
/// parameters' all-gather stays f32): the run stays within the wire's bound of the f32 one, as
/// `data_parallel_equivalence.rs` states it for the all-reduce (0.04 after 20 steps), and the
/// replicas agree bit for bit (the run checks their checksums every 5 steps).
#[test]
fn sharded_gradients_on_a_bfloat16_wire_stay_within_its_bound() {
    let sharded = [
        "cluster.nproc_per_node=4",
        "strategy.sharding=true",
        "strategy.sharding_configs.stage=2",
    ];
    let exact = run(&sharded);
    let compressed = run(&[&sharded[..], &["strategy.fp16_allreduce=true"]].concat());
    let diff = max_abs_diff(&exact.parameters, &compressed.parameters);
    assert!(diff <= 0.04, "max |Δparam| = {diff:e}");
    assert!(diff > 1e-5, "max |Δparam| = {diff:e}: was the wire bfloat16 at all?");
}
