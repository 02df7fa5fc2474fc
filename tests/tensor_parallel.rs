//! Tensor parallelism (`strategy.hybrid_configs.mp_degree`, Megatron's layout) trains as one
//! process does on the same global batch, within a stated tolerance: a split layer sums its
//! partial products (a row-split map's over the group, a column-split map's input gradients) and
//! the vocabulary's softmax (max and sum of exponentials over the slices) in another order than
//! one process does, a reassociation of f32 sums of about 2⁻²⁴ relative each, which 20 steps of
//! SGD or AdamW carry to well under 1e-5 of the parameters — the tolerance
//! `data_parallel_equivalence.rs` holds data parallelism to. The checkpoint holds the whole
//! model whatever the split, so a job resumes on another one.

mod common;

use common::{config, max_abs_diff, train_in_process, TINY_GPT};
use flotilla::job::RunOutcome;

/// A tiny GPT of four heads trained by AdamW, its held-out split a few windows.
const SPLIT_GPT: [&str; 4] = [
    "train.gpt.n_head=4",
    "train.optimizer=\"adamw\"",
    "train.lr=0.003",
    "train.test_fraction=0.002",
];

/// One process against every split's run agree to this, parameters and losses alike.
const TOLERANCE: f32 = 1e-5;

/// 20 steps of the default job (an MLP on digits) with `settings`.
fn run(settings: &[&str]) -> RunOutcome {
    train_in_process(config(
        &[&["train.steps=20", "strategy.check_every=5"], settings].concat(),
    ))
}

/// `settings` trained on each of `layouts` (each the flags of a [`grid`]) ends within
/// [`TOLERANCE`] of one process, its losses too, and scores the held-out split alike (its mean
/// loss within 1e-4: the parameters' differences, scored over every held-out position).
fn assert_like_one_process(layouts: &[Vec<String>], settings: &[&str]) {
    let single = run(&[&["cluster.nproc_per_node=1"], settings].concat());
    for layout in layouts {
        let layout: Vec<&str> = layout.iter().map(String::as_str).collect();
        let split = run(&[&layout[..], settings].concat());
        let (mp, pp) = (setting(&layout, "mp_degree"), setting(&layout, "pp_degree"));
        let layout = layout.join(" ");
        assert_eq!(split.summary.steps, 20);
        let diff = max_abs_diff(&single.parameters, &split.parameters);
        assert!(diff <= TOLERANCE, "{layout} {settings:?}: max |Δparam| = {diff:e}");
        eprintln!("{layout}: max |Δparam| = {diff:e}");
        // Each rank holds its part of the split layers: less than the whole model, more than
        // its 1/mp share (the LayerNorms, biases and the MLP's classifier stay whole).
        if let (None, Some(held)) = (pp, split.summary.state_bytes) {
            let (whole, part) = (
                single.summary.state_bytes.expect("state bytes").parameters,
                held.parameters,
            );
            let mp = mp.expect("a split layout");
            assert!(part < whole && part * mp >= whole, "{layout}: {part} bytes of {whole}");
        }
        for (step, (a, b)) in single.losses.iter().zip(&split.losses).enumerate() {
            assert!(
                (a - b).abs() <= TOLERANCE * (1.0 + a.abs()),
                "{layout}: step {step}: loss {a} vs {b}"
            );
        }
        let (a, b) = (single.summary.test_loss, split.summary.test_loss);
        assert!(
            (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
            "{layout}: test loss {a} vs {b}"
        );
    }
}

#[test]
fn an_mlp_split_over_two_and_four_ranks_trains_as_one_process() {
    // Hidden layers 64 and 32: the first split by columns, the second by rows (its ReLU after
    // the sum), the classifier whole on every rank.
    assert_like_one_process(
        &[layout((1, 2)), layout((1, 4)), layout((2, 2))],
        &["train.hidden_sizes=[64, 32]"],
    );
}

#[test]
fn a_gpt_split_over_two_and_four_ranks_trains_as_one_process() {
    // Four heads: two or one per rank; the character vocabulary split unevenly where the
    // group does not divide it.
    let gpt = [&TINY_GPT[..], &SPLIT_GPT[..], &["train.grad_clip_norm=0.5"]].concat();
    assert_like_one_process(&[layout((1, 2)), layout((1, 4)), layout((2, 2))], &gpt);
}

/// A pipeline's stages split over layer groups (Megatron's 3-D layout): each part of a stage
/// hands its activations to the same part of the next, and the last stage's vocabulary-split
/// cross-entropy sums over its group. 2 × 2 × 2 on 8 ranks and 1 × 2 × 2 interleaved train as
/// one process does, within the tolerance; the MLP's column-split layer may end a stage, its
/// slice handed on.
#[test]
fn a_pipeline_of_split_stages_trains_as_one_process() {
    let gpt = [&TINY_GPT[..], &SPLIT_GPT[..]].concat();
    let interleaved = [
        grid((1, 2, 2)),
        vec!["strategy.pipeline_configs.virtual_pipeline_stages=2".into()],
    ]
    .concat();
    assert_like_one_process(
        &[grid((2, 2, 2)), interleaved],
        &[&gpt[..], &["train.gpt.n_layer=4"]].concat(),
    );
    let cut_after_a_column_split = [
        grid((2, 2, 2)),
        vec!["strategy.pipeline_configs.stage_boundaries=[1]".into()],
    ]
    .concat();
    assert_like_one_process(&[cut_after_a_column_split], &["train.hidden_sizes=[64, 32]"]);
}

/// Recomputation runs a segment's split layers — and their collectives — again in backward, in
/// the same order on every rank of the group; gradient merge all-reduces every second batch.
/// Both leave the split GPT within the tolerance of one process doing the same.
#[test]
fn recompute_and_gradient_merge_combine_with_split_layers() {
    let gpt = [
        &TINY_GPT[..],
        &SPLIT_GPT[..],
        &[
            "strategy.gradient_merge=true",
            "strategy.gradient_merge_configs.k_steps=2",
            "strategy.recompute=true",
            "strategy.recompute_configs.checkpoints=[\"h0\"]",
        ],
    ]
    .concat();
    assert_like_one_process(&[layout((1, 2)), layout((2, 2))], &gpt);
}

/// Sharded states over the data-parallel ranks of each layer part (ZeRO stages 1 and 2 over
/// `dp_degree` ranks) train a split GPT bit for bit as the same split without sharding, as they
/// do an unsplit model (`sharded_states.rs`): the shards are cut from each rank's own parts.
#[test]
fn sharded_states_of_a_split_gpt_train_it_bit_for_bit_as_without_sharding() {
    let gpt = [&TINY_GPT[..], &SPLIT_GPT[..], &["strategy.fuse_grad_size_in_MB=0.01"]].concat();
    let split: Vec<String> = layout((2, 2));
    let split: Vec<&str> = split.iter().map(String::as_str).collect();
    let plain = run(&[&gpt[..], &split[..]].concat());
    for stage in ["1", "2"] {
        let stage = format!("strategy.sharding_configs.stage={stage}");
        let sharded = run(&[&gpt[..], &split[..], &["strategy.sharding=true", stage.as_str()]].concat());
        assert_eq!(max_abs_diff(&plain.parameters, &sharded.parameters), 0.0, "{stage}");
        assert_eq!(plain.losses, sharded.losses, "{stage}");
        let held = |run: &RunOutcome| run.summary.state_bytes.expect("state bytes").optimizer;
        // AdamW's two moments of every part, against two moments and a copy of half of them.
        assert!(held(&sharded) < held(&plain), "{stage}: the moments are sharded");
    }
    // Clipped, the global norm adds the shards' squares — the split parameters' over the layer
    // group, the whole ones' once — in another order than one process: within the tolerance.
    for stage in ["1", "2"] {
        let stage = format!("strategy.sharding_configs.stage={stage}");
        let clipped = [
            &gpt[..],
            &["strategy.sharding=true", stage.as_str(), "train.grad_clip_norm=0.5"],
        ]
        .concat();
        assert_like_one_process(&[layout((2, 2))], &clipped);
    }
}

/// `flotilla train` flags for `settings`.
fn set_flags(settings: &[String]) -> Vec<String> {
    settings.iter().flat_map(|s| ["--set".to_string(), s.clone()]).collect()
}

/// The value of `key` among a layout's `flags` (`strategy.hybrid_configs.KEY=N`), if set.
fn setting(flags: &[&str], key: &str) -> Option<usize> {
    let prefix = format!("strategy.hybrid_configs.{key}=");
    flags.iter().find_map(|f| f.strip_prefix(&prefix)?.parse().ok())
}

/// `(dp_degree, mp_degree)` on `dp × mp` ranks.
fn layout((dp, mp): (usize, usize)) -> Vec<String> {
    grid((dp, mp, 1))
}

/// `(dp_degree, mp_degree, pp_degree)` on `dp × mp × pp` ranks, a pipeline (of 2 micro-batches
/// a step) where `pp` > 1.
fn grid((dp, mp, pp): (usize, usize, usize)) -> Vec<String> {
    let mut flags = vec![
        format!("cluster.nproc_per_node={}", dp * mp * pp),
        format!("strategy.hybrid_configs.dp_degree={dp}"),
        format!("strategy.hybrid_configs.mp_degree={mp}"),
    ];
    if pp > 1 {
        flags.extend([
            "strategy.pipeline=true".to_string(),
            format!("strategy.hybrid_configs.pp_degree={pp}"),
            "strategy.pipeline_configs.accumulate_steps=2".to_string(),
        ]);
    }
    flags
}

/// Trains `settings` (the rank count among them) for `steps` as a process per rank under
/// `flotilla launch` in `run_dir`, or resumes there from its step 20.
fn launched(run_dir: &std::path::Path, settings: &[String], steps: usize, resume: bool) {
    let ranks = settings
        .iter()
        .find_map(|s| s.strip_prefix("cluster.nproc_per_node="))
        .expect("a rank count");
    let port = common::free_port_range(5).to_string();
    let steps = format!("train.steps={steps}");
    let mode = if resume { "--resume" } else { "--run-dir" };
    let flags = set_flags(settings);
    #[rustfmt::skip]
    let mut args = vec!["launch", "--nproc_per_node", ranks, "--started_port", &port, "--", "train", mode,
        run_dir.to_str().expect("utf-8"), "--set", &steps];
    args.extend(flags.iter().map(String::as_str));
    let finished = common::flotilla(&args, &[], 180);
    assert!(finished.success, "{settings:?}: {}", finished.stderr);
    if resume {
        assert!(
            finished.stderr.contains("state restored rank=0 step=20"),
            "{}",
            finished.stderr
        );
    }
}

/// The split GPT, checkpointing every 10 steps, laid out by `layout`'s flags.
fn checkpointed_gpt(layout: &[String]) -> Vec<String> {
    let gpt = [&TINY_GPT[..], &SPLIT_GPT[..], &["fault_tolerance.checkpoint_every=10"]].concat();
    gpt.iter()
        .map(|s| s.to_string())
        .chain(layout.iter().cloned())
        .collect()
}

/// The checkpointed GPT launched on `layout` for 30 steps ends bit for bit as the same job
/// simulated in one process; then each of `changes` — launched on its first layout for 20 steps,
/// its checkpoint inspected to say its text, resumed on its second layout — ends within
/// [`TOLERANCE`] of that run (the partial products are summed in another order after the
/// change). Answers the uninterrupted run's parameters.
fn resumes_on_other_layouts(
    layout: &[String],
    changes: &[(Vec<String>, Vec<String>, String)],
) -> Vec<(String, Vec<f32>)> {
    use common::{flotilla, read_params};
    let dir = tempfile::tempdir().expect("temp dir");
    let uninterrupted = dir.path().join("uninterrupted");
    launched(&uninterrupted, &checkpointed_gpt(layout), 30, false);
    let expected = read_params(&uninterrupted.join("params.safetensors"));
    let settings = checkpointed_gpt(layout);
    let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
    let simulated = train_in_process(config(&[&settings[..], &["train.steps=30"]].concat()));
    assert_eq!(
        max_abs_diff(&expected, &simulated.parameters),
        0.0,
        "launched against simulated"
    );
    for (change, (from, to, says)) in changes.iter().enumerate() {
        let run_dir = dir.path().join(format!("resumed-{change}"));
        launched(&run_dir, &checkpointed_gpt(from), 20, false);
        let checkpoints = run_dir.join("checkpoints");
        let inspected = flotilla(
            &["checkpoint", "inspect", checkpoints.to_str().expect("utf-8")],
            &[],
            30,
        );
        assert!(inspected.stdout.contains(says.as_str()), "{}", inspected.stdout);
        launched(&run_dir, &checkpointed_gpt(to), 30, true);
        let diff = max_abs_diff(&expected, &read_params(&run_dir.join("params.safetensors")));
        eprintln!("{from:?} → {to:?}: max |Δparam| = {diff:e}");
        assert!(diff <= TOLERANCE, "{from:?} → {to:?}: max |Δparam| = {diff:e}");
    }
    expected
}

/// Launched as processes (rings over shared memory and TCP), a GPT split 2 ways in 2 replicas
/// ends bit for bit as the same job simulated in one process (the same sums in the same order),
/// its `params.safetensors` the whole model in one process's names and shapes. Its checkpoint
/// holds the whole model: it resumes unsplit on 4 ranks and split 4 ways, and an unsplit one
/// resumes split, each as the uninterrupted split run goes on.
#[test]
fn a_split_job_across_processes_checkpoints_the_whole_model_and_resumes_on_another_split() {
    let says = |mp: usize| match mp {
        1 => "data parallel: 4 rank(s), one copy of the replica\n".to_string(),
        mp => format!(
            "4 rank(s) splitting each layer {mp} ways (tensor parallelism), one copy of the replica (the layers' \
             parts gathered)"
        ),
    };
    let changes: Vec<_> = [((2, 2), (4, 1)), ((2, 2), (1, 4)), ((4, 1), (2, 2))]
        .into_iter()
        .map(|(from, to)| (layout(from), layout(to), says(from.1)))
        .collect();
    let expected = resumes_on_other_layouts(&layout((2, 2)), &changes);
    let single = run(&[&["cluster.nproc_per_node=1", "train.steps=30"], &TINY_GPT[..]].concat());
    assert_eq!(
        expected.iter().map(|(n, v)| (n, v.len())).collect::<Vec<_>>(),
        single.parameters.iter().map(|(n, v)| (n, v.len())).collect::<Vec<_>>(),
        "params.safetensors holds the whole model"
    );
}

/// Launched as 4 processes (each stage's layer group, stage rings and replica rings over shared
/// memory and TCP), a 2-stage pipeline whose stages are split 2 ways ends bit for bit as the
/// same job simulated in one process. Part 0 of each stage writes the whole stage: the
/// checkpoint resumes as an unsplit pipeline of 2 replicas, and an unsplit one resumes split,
/// each as the uninterrupted run goes on.
#[test]
fn a_pipeline_of_split_stages_across_processes_resumes_split_another_way() {
    let (split, unsplit) = (grid((1, 2, 2)), grid((2, 1, 2)));
    let changes = [
        (
            split.clone(),
            unsplit.clone(),
            "pipeline: 2 stage(s) × 1 data-parallel replica(s), each stage's layers split 2 ways".to_string(),
        ),
        (
            unsplit,
            split.clone(),
            "pipeline: 2 stage(s) × 2 data-parallel replica(s)\n".to_string(),
        ),
    ];
    resumes_on_other_layouts(&split, &changes);
}

/// `examples/gpt_hybrid.toml` — 2 sharded replicas × 2 stages × 2 parts on 8 ranks in this
/// process — loads and trains, its loss falling.
#[test]
fn the_4d_hybrid_example_trains_and_its_loss_falls() {
    let overrides = ["train.steps=6".to_string(), "train.test_fraction=0.002".to_string()];
    let config = flotilla::config::JobConfig::from_toml_str(
        include_str!("../examples/gpt_hybrid.toml"),
        "examples/gpt_hybrid.toml",
        &|_| None,
        &overrides,
    )
    .expect("the example loads");
    let hybrid = &config.strategy.hybrid_configs;
    let degrees = (hybrid.sharding_degree, hybrid.pp_degree, hybrid.mp_degree);
    assert_eq!((degrees, config.strategy.sharding), ((2, 2, 2), true));
    let outcome = train_in_process(config);
    assert_eq!(outcome.summary.world_size, 8);
    let (first, last) = (outcome.losses[0], *outcome.losses.last().expect("losses"));
    // From ln 78 ≈ 4.36 (uniform over the characters) down within a few AdamW steps.
    assert!(first > 4.0 && last < first - 0.3, "loss {first} → {last}");
}

/// The 4-D layout's checkpoint (2 replicas sharding their states × 2 stages × 2 parts, run as
/// one process) holds every stage whole: resumed with the replicas unsharded it ends bit for bit
/// as the uninterrupted sharded run (sharding changes no bit of training).
#[test]
fn the_4d_hybrid_checkpoint_resumes_unsharded_bit_for_bit() {
    use common::flotilla;
    let dir = tempfile::tempdir().expect("temp dir");
    let checksum = |run: &std::path::Path| -> String {
        let summary = std::fs::read_to_string(run.join("summary.json")).expect("a summary");
        let summary: serde_json::Value = serde_json::from_str(&summary).expect("json");
        summary["param_checksum"].as_str().expect("a checksum").to_string()
    };
    let train = |run: &std::path::Path, steps: &str| {
        #[rustfmt::skip]
        let args = ["train", "--config", "examples/gpt_hybrid.toml", "--run-dir", run.to_str().expect("utf-8"),
            "--set", steps, "--set", "fault_tolerance.checkpoint_every=10", "--set", "train.test_fraction=0.002"];
        let finished = flotilla(&args, &[], 120);
        assert!(finished.success, "{}", finished.stderr);
    };
    let (uninterrupted, resumed) = (dir.path().join("uninterrupted"), dir.path().join("resumed"));
    train(&uninterrupted, "train.steps=30");
    train(&resumed, "train.steps=20");
    let checkpoints = resumed.join("checkpoints");
    let inspected = flotilla(
        &["checkpoint", "inspect", checkpoints.to_str().expect("utf-8")],
        &[],
        30,
    );
    let says = "pipeline: 2 stage(s) × 2 data-parallel replica(s), each stage's layers split 2 ways (tensor \
                parallelism; the parts gathered), its states sharded over them (stage 2; the shards gathered)";
    assert!(inspected.stdout.contains(says), "{}", inspected.stdout);
    #[rustfmt::skip]
    let unsharded = ["train", "--resume", resumed.to_str().expect("utf-8"), "--set", "train.steps=30",
        "--set", "strategy.sharding=false", "--set", "strategy.sharding_configs.stage=1",
        "--set", "strategy.hybrid_configs.sharding_degree=1", "--set", "strategy.hybrid_configs.dp_degree=2"];
    let finished = flotilla(&unsharded, &[], 120);
    assert!(finished.success, "{}", finished.stderr);
    assert!(
        finished.stderr.contains("state restored rank=0 step=20"),
        "{}",
        finished.stderr
    );
    assert_eq!(checksum(&resumed), checksum(&uninterrupted));
}
