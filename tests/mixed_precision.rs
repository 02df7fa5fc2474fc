//! Mixed precision (`strategy.amp` with `amp_configs.use_bf16`): the dense layers' products take
//! bfloat16 operands (8 bits of mantissa, a relative rounding of at most 2⁻⁹ each) and sum in
//! f32, the parameters and AdamW's states stay f32. Over 50 steps of the GPT the loss stays
//! within 0.5 % of f32's at every step (the rounding of the products perturbs each step's update
//! by well under a percent of it, and AdamW's normalised steps do not let that grow). An AdamW
//! step moves a weight by about the learning rate at most, so no weight can drift further than
//! 50 × 3e-3 from f32's; a weight whose gradient hovers near zero may get there (AdamW
//! normalises away its size), but their root mean square stays within 2e-3. Ranks split the
//! batch as in f32: two data-parallel ranks, and two pipeline stages, stay within 1e-5 of one
//! process doing the same (sums in another order).
//! On a CPU without AVX-512 BF16 the job is refused, naming the key.

mod common;

use common::{config, max_abs_diff, train_in_process, TINY_GPT};
use flotilla::job::RunOutcome;

/// The GPT trained by AdamW for 50 steps, with `settings`.
fn run(settings: &[&str]) -> RunOutcome {
    let gpt = [
        "train.steps=50",
        "train.optimizer=\"adamw\"",
        "train.lr=0.003",
        "train.test_fraction=0.002",
        "train.gpt.n_embd=32",
    ];
    train_in_process(config(&[&TINY_GPT[..], &gpt[..], settings].concat()))
}

/// The root mean square of the differences of every parameter value.
fn rms_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    let (mut sum, mut count) = (0f64, 0usize);
    for ((name, x), (other, y)) in a.iter().zip(b) {
        assert_eq!(name, other);
        sum += x.iter().zip(y).map(|(x, y)| f64::from(x - y).powi(2)).sum::<f64>();
        count += x.len();
    }
    (sum / count.max(1) as f64).sqrt() as f32
}

const AMP: [&str; 2] = ["strategy.amp=true", "strategy.amp_configs.use_bf16=true"];

#[test]
fn bfloat16_products_train_the_gpt_within_a_stated_bound_of_f32() {
    if !flotilla::cpu_features::bf16_dot_products() {
        let refused = flotilla::config::JobConfig::from_toml_str(
            include_str!("../config.toml"),
            "config.toml",
            &|_| None,
            &AMP.map(String::from),
        )
        .expect_err("refused without AVX-512 BF16");
        assert!(
            refused
                .to_string()
                .contains("strategy.amp_configs.use_bf16: this CPU has no AVX-512 BF16"),
            "{refused}"
        );
        return;
    }
    let f32 = run(&[]);
    let bf16 = run(&AMP);
    assert_eq!(bf16.summary.matrix_kernel, "avx512_bf16");
    assert_ne!(f32.summary.matrix_kernel, "avx512_bf16");
    let mut largest = 0f32;
    for (step, (a, b)) in f32.losses.iter().zip(&bf16.losses).enumerate() {
        let relative = (a - b).abs() / a.abs();
        largest = largest.max(relative);
        assert!(
            relative <= 0.005,
            "step {step}: loss {a} in f32, {b} with bfloat16 products"
        );
    }
    let diff = max_abs_diff(&f32.parameters, &bf16.parameters);
    let rms = rms_diff(&f32.parameters, &bf16.parameters);
    eprintln!("largest relative loss difference {largest:e}, max |Δparam| = {diff:e}, rms {rms:e}");
    assert!(diff <= 50.0 * 3e-3, "max |Δparam| = {diff:e}");
    assert!(rms <= 2e-3, "rms of Δparam = {rms:e}");
    assert!(diff > 0.0, "the products were rounded");
    // The loss falls as in f32.
    let (first, last) = (bf16.losses[0], bf16.losses[49]);
    assert!(last < first - 0.5, "loss {first} → {last}");

    let two_ranks = run(&[&AMP[..], &["cluster.nproc_per_node=2"]].concat());
    let diff = max_abs_diff(&bf16.parameters, &two_ranks.parameters);
    assert!(
        diff <= 1e-5,
        "2 ranks against 1, both bfloat16: max |Δparam| = {diff:e}"
    );
    #[rustfmt::skip]
    let pipeline = ["cluster.nproc_per_node=2", "strategy.pipeline=true", "strategy.hybrid_configs.pp_degree=2",
        "strategy.pipeline_configs.accumulate_steps=2"];
    let stages = run(&[&AMP[..], &pipeline[..]].concat());
    assert_eq!(stages.summary.matrix_kernel, "avx512_bf16");
    let diff = max_abs_diff(&bf16.parameters, &stages.parameters);
    assert!(
        diff <= 1e-5,
        "2 stages against 1 process, both bfloat16: max |Δparam| = {diff:e}"
    );
}
