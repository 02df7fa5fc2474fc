//! `strategy.hybrid_configs.mp_degree` (Paddle's name; Megatron's tensor parallelism): each
//! layer's weights split over `mp_degree` ranks, the innermost axis of the rank grid, the
//! `dp_degree` groups of them replicas of the whole model.

use super::{DeviceKind, FieldError, JobConfig, ModelKind};

const KEY: &str = "strategy.hybrid_configs.mp_degree";

impl JobConfig {
    /// Ranks that split each layer between them (1: none).
    pub fn mp_degree(&self) -> usize {
        self.strategy.hybrid_configs.mp_degree.max(1)
    }

    /// Replicas of the whole model that train over a data-parallel ring: the world, or its
    /// layer groups.
    pub fn data_parallel_replicas(&self) -> usize {
        self.world_size() / self.mp_degree()
    }
}

/// Checks `mp_degree` against the rest of the job: collective data parallelism or pipelines on
/// CPUs (not yet with elastic membership or the hierarchical all-reduce; sharded states over
/// every data-parallel rank), `dp_degree × sharding_degree × mp_degree` the world size (with a
/// pipeline `dp_degree × pp_degree × mp_degree`), a GPT's heads or an MLP's hidden layers split
/// evenly.
pub(super) fn check_tensor_parallel(config: &JobConfig) -> Result<(), FieldError> {
    let hybrid = &config.strategy.hybrid_configs;
    let mp = hybrid.mp_degree;
    if mp == 0 {
        return Err(FieldError::new(KEY, "must be at least 1, got 0"));
    }
    if mp == 1 {
        return Ok(());
    }
    let strategy = &config.strategy;
    let not_with = |key: &str, what: &str| Err(FieldError::new(key, format!("{what} with {KEY} = {mp}")));
    if config.cluster.is_parameter_server() {
        return not_with(
            "cluster.server_num",
            "splits the layers of collective training, not a parameter-server job's: leave mp_degree 1",
        );
    }
    if config.cluster.min_nnodes.is_some() {
        return not_with("cluster.min_nnodes", "elastic membership is not supported yet");
    }
    if strategy.use_hierarchical_allreduce == Some(true) {
        return not_with("strategy.use_hierarchical_allreduce", "not supported yet");
    }
    if config.cluster.device == DeviceKind::Gpu {
        return not_with("cluster.device", "\"gpu\": split layers run on CPUs only so far");
    }
    if strategy.pipeline {
        // `dp_degree × pp_degree × mp_degree` is checked with the pipeline's keys.
        return check_model(config, mp);
    }
    let (dp, world) = (hybrid.dp_degree, config.world_size());
    // Sharded over every data-parallel rank, Paddle counts them as `sharding_degree` (with
    // `dp_degree` 1, the shards' replicas) or as `dp_degree`.
    let sharding = match strategy.sharding {
        true if dp == 1 => hybrid.sharding_degree,
        _ => 1,
    };
    if dp.checked_mul(sharding).and_then(|d| d.checked_mul(mp)) != Some(world) {
        let product = match strategy.sharding {
            true => format!("dp_degree × sharding_degree × mp_degree = {dp} × {sharding} × {mp}"),
            false => format!("dp_degree × mp_degree = {dp} × {mp}"),
        };
        return Err(FieldError::new(
            "strategy.hybrid_configs",
            format!("{product} must equal the world size {world}"),
        ));
    }
    check_model(config, mp)
}

/// The layers the model splits divide evenly: a GPT's heads (and so its widths), an MLP's
/// column-split hidden layers (every other one from the first, the last layer staying whole).
fn check_model(config: &JobConfig, mp: usize) -> Result<(), FieldError> {
    let train = &config.train;
    match train.model {
        ModelKind::Gpt => {
            let heads = train.gpt.n_head;
            if !heads.is_multiple_of(mp) {
                return Err(FieldError::new(
                    KEY,
                    format!("{mp} does not divide train.gpt.n_head = {heads}: each rank computes whole heads"),
                ));
            }
            Ok(())
        }
        ModelKind::Mlp => {
            let hidden = train.hidden_sizes();
            for (layer, width) in hidden.iter().enumerate().step_by(2) {
                if !width.is_multiple_of(mp) {
                    return Err(FieldError::new(
                        KEY,
                        format!(
                            "{mp} does not divide hidden layer {layer}'s width {width} (train.hidden_sizes): it is \
                             split by columns"
                        ),
                    ));
                }
            }
            Ok(())
        }
        other => Err(FieldError::new(
            KEY,
            format!("splits the mlp and gpt models, not {}", other.name()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{err_text, load_with};

    /// The refusal of a 4-rank job with `settings`.
    fn refusal(settings: &[&str]) -> String {
        err_text(load_with("", &[], &[&["cluster.nproc_per_node=4"], settings].concat()))
    }

    #[test]
    fn a_split_must_fit_the_world_the_model_and_the_strategy() {
        let mp2 = "strategy.hybrid_configs.mp_degree=2";
        let dp2 = "strategy.hybrid_configs.dp_degree=2";
        for (settings, key, says) in [
            // Named by the key set, among those the rule spans.
            (
                vec![mp2],
                "strategy.hybrid_configs.mp_degree",
                "dp_degree × mp_degree = 1 × 2 must equal the world size 4",
            ),
            (
                vec![mp2, dp2, "train.hidden_sizes=[8, 6, 7]"],
                "strategy.hybrid_configs.mp_degree",
                "2 does not divide hidden layer 2's width 7",
            ),
            (
                vec!["strategy.hybrid_configs.mp_degree=4", "train.hidden_sizes=[6, 8]"],
                "strategy.hybrid_configs.mp_degree",
                "4 does not divide hidden layer 0's width 6",
            ),
            (
                vec![
                    mp2,
                    "strategy.sharding=true",
                    "strategy.hybrid_configs.sharding_degree=4",
                ],
                "strategy.hybrid_configs.sharding_degree",
                "1 × 4 × 2 must equal the world size 4",
            ),
            (
                vec!["strategy.hybrid_configs.mp_degree=0"],
                "strategy.hybrid_configs.mp_degree",
                "at least 1",
            ),
        ] {
            let msg = refusal(&settings);
            assert!(
                msg.contains(&format!("{key}: ")) && msg.contains(says),
                "{settings:?}: {msg}"
            );
        }
        let gpt = [
            "cluster.nproc_per_node=4",
            "train.model=\"gpt\"",
            "train.dataset=\"text\"",
            "train.gpt.n_head=6",
            "train.gpt.n_embd=48",
        ];
        let fits = load_with("", &[], &[&gpt[..], &[mp2, dp2]].concat());
        assert!(fits.is_ok(), "{:?}", fits.err());
        // Sharded over both data-parallel ranks, counted either way.
        for shards in [
            [dp2, "strategy.sharding=true"],
            ["strategy.hybrid_configs.sharding_degree=2", "strategy.sharding=true"],
        ] {
            let fits = load_with("", &[], &[&gpt[..], &[mp2], &shards[..]].concat());
            assert!(fits.is_ok(), "{shards:?}: {:?}", fits.err());
        }
        let msg = refusal(&[&gpt[1..], &["strategy.hybrid_configs.mp_degree=4"]].concat());
        assert!(msg.contains("4 does not divide train.gpt.n_head = 6"), "{msg}");
    }
}
