//! `strategy.amp` and `[strategy.amp_configs]` (Paddle's names): mixed precision. On CPUs with
//! AVX-512 BF16 the dense layers' products (Paddle's `matmul_v2`, forward and backward) take
//! bfloat16 operands and sum in f32, while the parameters, the optimizer (its f32 masters),
//! checkpoints and every other op stay f32. bfloat16 keeps f32's exponent range, so no loss
//! scaling is needed; float16 with dynamic loss scaling is GPU work, not built yet.

use serde::{Deserialize, Serialize};

use super::{DeviceKind, FieldError, JobConfig};

/// Paddle's names of the products `amp` computes in bfloat16: here the dense layers' (the
/// attention's scores and weighted sums stay f32).
const PRODUCT_OPS: [&str; 3] = ["matmul_v2", "matmul", "mul"];

/// `[strategy.amp_configs]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AmpConfigs {
    /// Compute in bfloat16 (the dense layers' products, f32 sums): on CPUs with AVX-512 BF16.
    /// `false` asks for float16, which runs on GPUs and is not built yet.
    pub use_bf16: bool,
    /// Paddle's pure float16 (the parameters themselves in float16): not built yet.
    pub use_pure_fp16: bool,
    /// Ops added to those computed in bfloat16, by Paddle's names: the dense layers' products
    /// (`matmul_v2`, `matmul`, `mul`) are in already; no other op has a bfloat16 kernel here.
    pub custom_white_list: Vec<String>,
    /// Ops kept in f32, by Paddle's names: every op but the dense layers' products is already;
    /// listing those leaves nothing to compute in bfloat16 (leave `strategy.amp` false instead).
    pub custom_black_list: Vec<String>,
    /// float16's initial loss scale (Paddle's key): bfloat16 needs none, so it is refused with
    /// `use_bf16`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_loss_scaling: Option<f64>,
    /// float16's dynamic loss scaling (Paddle's key): refused with `use_bf16`, as above.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub use_dynamic_loss_scaling: Option<bool>,
}

impl JobConfig {
    /// Whether the dense layers' products take bfloat16 operands (`strategy.amp`, checked to
    /// be bfloat16 on a CPU that has it).
    pub fn bf16_products(&self) -> bool {
        self.strategy.amp
    }
}

/// Checks the amp keys against the rest of the job and this host's CPU.
pub(super) fn check_amp(config: &JobConfig) -> Result<(), FieldError> {
    let (amp, configs) = (config.strategy.amp, &config.strategy.amp_configs);
    if !amp {
        if *configs != AmpConfigs::default() {
            return Err(FieldError::new(
                "strategy.amp",
                "amp_configs are set but strategy.amp is false: set it to true",
            ));
        }
        return Ok(());
    }
    let key = |name: &str| format!("strategy.amp_configs.{name}");
    if config.cluster.device == DeviceKind::Gpu {
        return Err(FieldError::new(
            "cluster.device",
            "\"gpu\" with strategy.amp: mixed precision on GPUs (float16 with dynamic loss scaling) is not built yet",
        ));
    }
    if config.cluster.is_parameter_server() {
        return Err(FieldError::new(
            "strategy.amp",
            "mixed precision is built for collective and pipeline training, not a parameter-server job's",
        ));
    }
    if configs.use_pure_fp16 {
        return Err(FieldError::new(
            key("use_pure_fp16"),
            "float16 parameters are not built yet: use use_bf16 = true (f32 parameters, bfloat16 products)",
        ));
    }
    if !configs.use_bf16 {
        return Err(FieldError::new(
            key("use_bf16"),
            "false asks for float16, which runs on GPUs and is not built yet: set it to true (bfloat16 on CPUs \
             with AVX-512 BF16)",
        ));
    }
    for (name, set) in [
        ("init_loss_scaling", configs.init_loss_scaling.is_some()),
        ("use_dynamic_loss_scaling", configs.use_dynamic_loss_scaling.is_some()),
    ] {
        if set {
            return Err(FieldError::new(
                key(name),
                "loss scaling is float16's; bfloat16 keeps f32's exponent range and needs none: leave it unset",
            ));
        }
    }
    if let Some(op) = configs
        .custom_white_list
        .iter()
        .find(|op| !PRODUCT_OPS.contains(&op.as_str()))
    {
        return Err(FieldError::new(
            key("custom_white_list"),
            format!(
                "{op:?} has no bfloat16 kernel here: only the dense layers' products ({}) compute in bfloat16",
                PRODUCT_OPS.join(", ")
            ),
        ));
    }
    if let Some(op) = configs
        .custom_black_list
        .iter()
        .find(|op| PRODUCT_OPS.contains(&op.as_str()))
    {
        return Err(FieldError::new(
            key("custom_black_list"),
            format!("{op:?} keeps the only ops amp computes in bfloat16 in f32: leave strategy.amp false instead"),
        ));
    }
    if !crate::cpu_features::bf16_dot_products() {
        return Err(FieldError::new(
            key("use_bf16"),
            "this CPU has no AVX-512 BF16 (vdpbf16ps), so it cannot compute bfloat16 products at speed: leave \
             strategy.amp false here",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{err_text, load_with};

    fn refusal(settings: &[&str]) -> String {
        err_text(load_with("", &[], &[&["strategy.amp=true"], settings].concat()))
    }

    #[test]
    fn amp_is_bfloat16_products_or_a_refusal_naming_the_key() {
        let bf16 = "strategy.amp_configs.use_bf16=true";
        for (settings, says) in [
            (vec![], "strategy.amp_configs.use_bf16: false asks for float16"),
            (
                vec![bf16, "strategy.amp_configs.use_pure_fp16=true"],
                "strategy.amp_configs.use_pure_fp16: float16 parameters are not built yet",
            ),
            (
                vec![bf16, "strategy.amp_configs.init_loss_scaling=1024.0"],
                "strategy.amp_configs.init_loss_scaling: loss scaling is float16's",
            ),
            (
                vec![bf16, "strategy.amp_configs.custom_white_list=[\"softmax\"]"],
                "strategy.amp_configs.custom_white_list: \"softmax\" has no bfloat16 kernel here",
            ),
            (
                vec![bf16, "strategy.amp_configs.custom_black_list=[\"matmul_v2\"]"],
                "strategy.amp_configs.custom_black_list: \"matmul_v2\" keeps the only ops",
            ),
        ] {
            let msg = refusal(&settings);
            assert!(msg.contains(says), "{settings:?}: {msg}");
        }
        let msg = err_text(load_with("", &[], &[bf16]));
        assert!(
            msg.contains("strategy.amp: amp_configs are set but strategy.amp is false"),
            "{msg}"
        );
        // On this host: bfloat16 products where the CPU has them, else the refusal naming why.
        let loaded = load_with(
            "",
            &[],
            &[
                "strategy.amp=true",
                bf16,
                "strategy.amp_configs.custom_black_list=[\"softmax\"]",
            ],
        );
        match crate::cpu_features::bf16_dot_products() {
            true => assert!(loaded.expect("amp loads").bf16_products()),
            false => assert!(
                err_text(loaded).contains("this CPU has no AVX-512 BF16"),
                "refused here"
            ),
        }
    }
}
