//! Recompute and gradient merge against their ground truth: recomputation changes memory, not
//! results; merging k batches' gradients equals one step over the k batches concatenated.

mod common;

use common::{config, max_abs_diff, run_error, train_in_process};

const MODEL: &str = "train.hidden_sizes=[64, 32, 32]";

/// After 10 optimizer steps of SGD with momentum: a merged step sums two batch means where
/// the reference takes one mean over their rows, so values agree to f32 rounding (the bound of
/// the data-parallel equivalence tests, for the same reason); a batch lost or counted twice
/// moves parameters by ~1e-3.
const TOLERANCE: f32 = 1e-5;

fn pipeline_2x2() -> Vec<&'static str> {
    vec![
        "strategy.pipeline=true",
        "cluster.nproc_per_node=4",
        "strategy.hybrid_configs.dp_degree=2",
        "strategy.hybrid_configs.pp_degree=2",
        "strategy.pipeline_configs.accumulate_steps=4",
    ]
}

#[test]
fn gradient_merge_equals_one_step_over_the_concatenated_batches() {
    let merge = [
        "strategy.gradient_merge=true",
        "strategy.gradient_merge_configs.k_steps=2",
        "train.batch_size=64",
        "train.steps=20",
    ];
    let reference = train_in_process(config(&[
        MODEL,
        "cluster.nproc_per_node=1",
        "train.batch_size=128",
        "train.steps=10",
    ]));
    for layout in [vec!["cluster.nproc_per_node=2"], pipeline_2x2()] {
        let mut overrides = vec![MODEL];
        overrides.extend(&merge);
        overrides.extend(&layout);
        let merged = train_in_process(config(&overrides));
        let diff = max_abs_diff(&reference.parameters, &merged.parameters);
        assert!(diff <= TOLERANCE, "{layout:?}: max |Δparam| = {diff:e}");
    }

    // Summing instead of averaging doubles every SGD update (weight decay is 0): the same
    // parameters as the reference at twice the learning rate.
    let doubled = train_in_process(config(&[
        MODEL,
        "cluster.nproc_per_node=1",
        "train.batch_size=128",
        "train.steps=10",
        "train.lr=0.1",
    ]));
    let mut overrides = vec![
        MODEL,
        "cluster.nproc_per_node=2",
        "strategy.gradient_merge_configs.avg=false",
    ];
    overrides.extend(&merge);
    let summed = train_in_process(config(&overrides));
    let diff = max_abs_diff(&doubled.parameters, &summed.parameters);
    assert!(diff <= TOLERANCE, "avg = false: max |Δparam| = {diff:e}");
}

#[test]
fn recompute_trains_exactly_like_keeping_every_activation() {
    let recompute = [
        "strategy.recompute=true",
        "strategy.recompute_configs.checkpoints=[\"fc1\"]",
    ];
    for layout in [vec!["cluster.nproc_per_node=2"], pipeline_2x2()] {
        let mut overrides = vec![MODEL, "train.steps=10"];
        overrides.extend(&layout);
        let kept = train_in_process(config(&overrides));
        overrides.extend(&recompute);
        let recomputed = train_in_process(config(&overrides));
        // The same operations on the same values in the same order: bit-identical.
        assert_eq!(
            kept.summary.param_checksum, recomputed.summary.param_checksum,
            "{layout:?}"
        );
        let peaks = |outcome: &flotilla::job::RunOutcome| {
            let peaks = outcome.summary.peak_activation_bytes.clone();
            peaks.unwrap_or_else(|| panic!("{layout:?}: no peak_activation_bytes"))
        };
        let (kept, recomputed) = (peaks(&kept), peaks(&recomputed));
        assert_eq!(kept.len(), recomputed.len(), "{layout:?}");
        // The first stage holds p micro-batches in 1F1B and keeps only their inputs; the last
        // one runs each backward right after its forward, so it cannot save. Data parallel is
        // one stage: a row keeps 64 + 32 + 32 + 10 block outputs, against fc1's 32 held and, at
        // most, fc0's and fc1's 96 made again.
        for (stage, (k, r)) in kept.iter().zip(&recomputed).enumerate() {
            assert!(
                r <= k,
                "{layout:?} stage {stage}: recompute holds {r} bytes, keeping holds {k}"
            );
        }
        assert!(recomputed[0] < kept[0], "{layout:?}: {recomputed:?} vs {kept:?}");
    }
}

#[test]
fn a_run_that_ends_inside_a_merge_is_refused() {
    let err = run_error(config(&[
        "strategy.gradient_merge=true",
        "strategy.gradient_merge_configs.k_steps=4",
        "train.steps=10",
    ]));
    assert!(err.contains("k_steps = 4"), "{err}");
}

#[test]
fn an_unknown_checkpoint_is_an_error_naming_the_blocks() {
    let err = run_error(config(&[
        "strategy.recompute=true",
        "strategy.recompute_configs.checkpoints=[\"fc9\"]",
        "train.steps=2",
    ]));
    assert!(err.contains("no block \"fc9\"") && err.contains("fc0, fc1"), "{err}");
}
