//! The memory a job will take on one node, estimated from the config before anything is
//! allocated, so that a size typo (`hidden_sizes = [4000000000]`) is an error naming the key and
//! the bytes instead of an allocation that aborts the process.
//!
//! The estimate counts what grows with the keys: parameters with their gradients and optimizer
//! state, the whole model's values the first rank reports at the end, activations of one batch
//! or of one evaluation pass (whichever is larger: training's are freed before the held-out set
//! is scored), generated data, the per-step loss record, and parameter-server tables. It is a lower bound of the real use (no allocator or framework
//! overhead), so a job it refuses could never have run.

use super::{DatasetKind, FieldError, JobConfig, ModelKind, OptimizerKind, ShardingStage, TrainConfig, TrainLength};
use crate::data::ctr::CtrShape;

/// Bytes of one f32.
const F32: u128 = 4;
/// Pixels and classes of the bundled digits set.
const DIGITS_SHAPE: (usize, usize) = (64, 10);
/// Characters of the shipped text's vocabulary, rounded up: the GPT's vocabulary.
const TEXT_VOCAB: u128 = 128;

/// One part of the estimate: the keys that size it (the first names it), what it is, its bytes
/// on the node.
#[derive(Debug)]
struct Need {
    keys: Vec<&'static str>,
    what: &'static str,
    bytes: u128,
}

/// Refuses `config` when its estimated memory on one node exceeds `available` bytes (the host's
/// available memory; `None` where it cannot be read skips the check). The error is about the keys
/// of the largest part (named by the one the user set) and lists every part.
pub(super) fn check(config: &JobConfig, available: Option<u64>) -> Result<(), FieldError> {
    let Some(available) = available else {
        return Ok(());
    };
    let needs = estimate(config);
    let total = total(&needs);
    if total <= u128::from(available) {
        return Ok(());
    }
    let largest = needs.iter().max_by_key(|n| n.bytes).map_or(&[][..], |n| &n.keys[..]);
    let parts: Vec<String> = needs
        .iter()
        .filter(|n| n.bytes > 0)
        .map(|n| format!("{}: {} ({})", n.what, bytes_text(n.bytes), n.keys[0]))
        .collect();
    Err(FieldError::among(
        largest,
        format!(
            "the job needs at least {} of memory on this node ({}), more than the {} available",
            bytes_text(total),
            parts.join("; "),
            bytes_text(u128::from(available))
        ),
    ))
}

/// The parts of the node's memory use of `config`.
/// The estimated bytes the job takes on one node: the sum of [`estimate`]'s parts.
pub(super) fn node_bytes(config: &JobConfig) -> u128 {
    total(&estimate(config))
}

fn total(needs: &[Need]) -> u128 {
    needs.iter().map(|n| n.bytes).fold(0, u128::saturating_add)
}

/// The optimizer's state slots, each as large as the parameters.
fn optimizer_slots(train: &TrainConfig) -> u128 {
    match train.optimizer {
        OptimizerKind::Sgd if train.momentum == 0.0 => 0,
        OptimizerKind::Sgd | OptimizerKind::Adagrad => 1,
        OptimizerKind::Adamw | OptimizerKind::Adam => 2,
    }
}

/// The stages a replica is cut into: `pp_degree` in a pipeline, else 1.
fn pipeline_stages(config: &JobConfig) -> u128 {
    match config.strategy.pipeline {
        true => config.strategy.hybrid_configs.pp_degree.max(1) as u128,
        false => 1,
    }
}

fn estimate(config: &JobConfig) -> Vec<Need> {
    let train = &config.train;
    let trainers = config.cluster.nproc_per_node as u128;
    let slots = optimizer_slots(train);
    let data_rows = match train.dataset {
        DatasetKind::Synthetic => train.synthetic_features.saturating_add(1),
        DatasetKind::CriteoSynthetic => CtrShape::CRITEO.slots * 2 + CtrShape::CRITEO.dense + 1,
        DatasetKind::Digits
        | DatasetKind::Criteo
        | DatasetKind::ClickLog
        | DatasetKind::Text
        | DatasetKind::Csv
        | DatasetKind::Parquet
        | DatasetKind::Arrays => 0,
    };
    let generated = mul(&[train.synthetic_samples as u128, data_rows as u128, F32]);
    let losses = match train.length() {
        TrainLength::Steps(steps) => mul(&[steps as u128, F32]),
        TrainLength::Epochs(_) => 0,
    };
    // Every id of every slot may get a row (embedding, wide weight, optimizer state) on the
    // servers; only generated click logs bound the ids.
    let table_rows = match train.dataset {
        DatasetKind::CriteoSynthetic if train.model.is_sparse() => {
            (train.synthetic_vocab.min(train.synthetic_samples) as u128) * CtrShape::CRITEO.slots as u128
        }
        _ => 0,
    };
    let row_bytes = mul(&[train.embedding_dim as u128 + 1, slots + 1, F32]);
    let mut needs = model_needs(config, slots);
    needs.extend([
        Need {
            keys: vec!["train.synthetic_samples", "train.synthetic_features"],
            what: "generated data",
            bytes: mul(&[generated, trainers]),
        },
        Need {
            keys: vec!["train.steps"],
            what: "the loss of every step",
            bytes: mul(&[losses, trainers]),
        },
        Need {
            keys: vec![
                "train.synthetic_vocab",
                "train.synthetic_samples",
                "train.embedding_dim",
            ],
            what: "parameter-server table rows",
            bytes: mul(&[table_rows, row_bytes]),
        },
    ]);
    needs
}

/// The model's part of the estimate on one node, with an optimizer of `slots` slots: every
/// trainer's parameters, gradients and optimizer state (its share of them, as `config` cuts and
/// shards them), the whole model's values the first rank reports at the end (gathered, where it
/// holds a part or a shard of them, for the run's model file), and the activations.
fn model_needs(config: &JobConfig, slots: u128) -> Vec<Need> {
    let trainers = config.cluster.nproc_per_node as u128;
    let size = model_size(&config.train);
    let reported = size.params;
    let ModelSize {
        keys: model_keys,
        params,
        largest_block,
        row: row_activations,
    } = size.per_rank(config);
    let [held_params, gradients, optimizer] = sharded_states(config, (params, largest_block), slots);
    vec![
        Need {
            keys: [&model_keys[..], &["strategy.sharding_configs.stage"]].concat(),
            what: "parameters",
            bytes: mul(&[held_params, F32, trainers]),
        },
        Need {
            keys: [&model_keys[..], &["strategy.sharding_configs.stage"]].concat(),
            what: "gradients",
            bytes: mul(&[gradients, F32, trainers]),
        },
        Need {
            keys: [&model_keys[..], &["train.optimizer", "strategy.sharding"]].concat(),
            what: "optimizer state",
            bytes: mul(&[optimizer, F32, trainers]),
        },
        Need {
            keys: model_keys.clone(),
            what: "the final parameters the first rank reports",
            bytes: mul(&[reported, F32]),
        },
        activations(config, row_activations, &model_keys),
    ]
}

/// The values of parameters, gradients and optimizer state one rank holds, for `params`
/// parameters (the largest block's `largest_block`) and an optimizer of `slots` slots: all of
/// them, or with `strategy.sharding` a shard of the optimizer's slots (and of the parameters it
/// updates), at stage 2 of the averaged gradients too, besides the buckets in flight (at most
/// the whole), and at stage 3 of the parameters too, besides two blocks' parameters and
/// gradients in flight (the block running and the next one gathered; a block's gradients and
/// their bucket).
fn sharded_states(config: &JobConfig, (params, largest_block): (u128, u128), slots: u128) -> [u128; 3] {
    let strategy = &config.strategy;
    let shard = params.div_ceil(config.sharding_ranks().max(1) as u128);
    let in_flight = |values: u128| shard.saturating_add(values).min(params);
    match strategy.sharding_stage() {
        None => [params, params, mul(&[params, slots])],
        Some(ShardingStage::OptimizerStates) => [params, params, mul(&[shard, slots + 1])],
        Some(ShardingStage::Gradients) => {
            let buckets = strategy.fuse_grad_size_bytes() as u128 / F32;
            [params, in_flight(buckets), mul(&[shard, slots + 1])]
        }
        Some(ShardingStage::Parameters) => {
            let blocks = in_flight(mul(&[2, largest_block]));
            [blocks, blocks, mul(&[shard, slots])]
        }
    }
}

/// What sizes a model: the keys that do, its parameters, its largest block's, and the bytes of
/// activations one row's forward pass holds (which training holds with their gradients).
struct ModelSize {
    keys: Vec<&'static str>,
    params: u128,
    largest_block: u128,
    row: u128,
}

impl ModelSize {
    /// A rank's share of the model under `config`: split layers (tensor parallelism) hold a
    /// part of the parameters and of the activations on each rank (at least: the LayerNorms and
    /// the residual stream stay whole), and a pipeline's stages each a share of the parameters
    /// (its stages' shares add up to the model).
    fn per_rank(self, config: &JobConfig) -> Self {
        let mp = config.mp_degree() as u128;
        let params = self.params.div_ceil(mp * pipeline_stages(config));
        Self {
            params,
            largest_block: self.largest_block.div_ceil(mp).min(params),
            row: self.row.div_ceil(mp),
            keys: self.keys,
        }
    }
}

/// The model's part of the estimate.
fn model_size(train: &TrainConfig) -> ModelSize {
    match train.model {
        ModelKind::Mlp => {
            let (inputs, classes) = match train.dataset {
                DatasetKind::Synthetic => (train.synthetic_features, train.synthetic_classes),
                _ => DIGITS_SHAPE,
            };
            let widths = widths(inputs, &train.hidden_sizes(), classes);
            let row = mul(&[widths.iter().sum(), F32]);
            let keys = vec![
                "train.hidden_sizes",
                "train.synthetic_features",
                "train.synthetic_classes",
            ];
            dense_model(keys, &widths, row)
        }
        ModelKind::WideDeep | ModelKind::DeepFm => {
            let shape = CtrShape::of_train(train);
            let inputs = match train.model {
                ModelKind::DeepFm => (shape.slots + shape.dense).saturating_mul(train.embedding_dim),
                _ => (shape.slots.saturating_mul(train.embedding_dim)).saturating_add(shape.dense),
            };
            let widths = widths(inputs, &train.hidden_sizes(), 1);
            let row = mul(&[widths.iter().sum(), F32]);
            let keys = vec!["train.hidden_sizes", "train.embedding_dim"];
            dense_model(keys, &widths, row)
        }
        // The program's own model: its size is unknown until it is built.
        ModelKind::Custom => ModelSize {
            keys: vec!["train.model"],
            params: 0,
            largest_block: 0,
            row: 0,
        },
        ModelKind::Gpt => {
            let g = &train.gpt;
            let (c, t, layers, heads) = (
                g.n_embd as u128,
                g.block_size as u128,
                g.n_layer as u128,
                g.n_head as u128,
            );
            let per_layer = mul(&[12, c, c]).saturating_add(13 * c);
            let (embed, head) = (mul(&[TEXT_VOCAB + t, c]), mul(&[TEXT_VOCAB, c]).saturating_add(2 * c));
            let params = mul(&[layers, per_layer]).saturating_add(embed).saturating_add(head);
            // Per token and layer: the residual stream and MLP (about 16 C) and the attention
            // scores (heads × T); then the logits.
            let per_token =
                mul(&[layers, mul(&[16, c]).saturating_add(mul(&[2, heads, t]))]).saturating_add(TEXT_VOCAB);
            ModelSize {
                keys: vec!["train.gpt"],
                params,
                largest_block: per_layer.max(embed).max(head),
                row: mul(&[t, per_token, F32]),
            }
        }
    }
}

/// The activations a node's ranks hold at once, of `row` bytes a row's forward pass: a training
/// step's with their gradients, or an evaluation pass's (a forward that keeps its graph), which
/// comes after training's are freed — whichever is larger, named by its batch's key; the model's
/// `model_keys` size a row.
fn activations(config: &JobConfig, row: u128, model_keys: &[&'static str]) -> Need {
    let trainers = config.cluster.nproc_per_node as u128;
    // A pipeline's stage holds its own blocks' share of a replica's rows.
    let stages = pipeline_stages(config);
    let local_batch = config.train.local_batch_size(config.data_parallel_replicas()) as u128;
    let training = mul(&[local_batch, row, 2, trainers]);
    let evaluation = mul(&[config.eval_batch_rows() as u128, row, trainers]) / stages;
    if evaluation > training {
        Need {
            keys: [&["train.eval_batch_size"][..], model_keys].concat(),
            what: "activations of an evaluation pass",
            bytes: evaluation,
        }
    } else {
        Need {
            keys: [&["train.batch_size"][..], model_keys].concat(),
            what: "activations of a batch",
            bytes: training,
        }
    }
}

/// Layer widths from the input to the output.
fn widths(inputs: usize, hidden: &[usize], outputs: usize) -> Vec<u128> {
    std::iter::once(inputs)
        .chain(hidden.iter().copied())
        .chain(std::iter::once(outputs))
        .map(|w| w as u128)
        .collect()
}

/// A model of dense layers of `widths` (their weights and biases), sized by `keys`, of `row`
/// bytes of activations a row.
fn dense_model(keys: Vec<&'static str>, widths: &[u128], row: u128) -> ModelSize {
    let layers: Vec<u128> = widths.windows(2).map(|w| mul(&[w[0] + 1, w[1]])).collect();
    ModelSize {
        keys,
        params: layers.iter().copied().fold(0, u128::saturating_add),
        largest_block: layers.iter().copied().max().unwrap_or(0),
        row,
    }
}

/// The saturating product of `factors`.
fn mul(factors: &[u128]) -> u128 {
    factors.iter().fold(1, |product, &f| product.saturating_mul(f))
}

/// `bytes` in binary units, e.g. `1.2 TiB`.
fn bytes_text(bytes: u128) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The memory this host can still give a new process (`MemAvailable` of `/proc/meminfo`), or
/// `None` where that cannot be read.
pub(super) fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// The default job changed by `edit`, unvalidated: loading would check it against this
    /// host's memory.
    fn job(edit: impl FnOnce(&mut JobConfig)) -> JobConfig {
        let mut config = JobConfig::default();
        edit(&mut config);
        config
    }

    /// `key: message` of the refusal of `config` on a node with `available` bytes.
    fn refusal(config: &JobConfig, available: u64) -> String {
        let err = check(config, Some(available)).unwrap_err();
        format!("{}: {}", err.key, err.message)
    }

    #[test]
    fn the_default_jobs_fit_in_a_small_machine() {
        check(&JobConfig::default(), Some(GIB)).unwrap();
        check(&job(|c| c.train.hidden_sizes = Some(vec![u32::MAX as usize])), None).unwrap();
        let gpt = job(|c| {
            c.train.model = ModelKind::Gpt;
            c.train.dataset = DatasetKind::Text;
        });
        check(&gpt, Some(GIB)).unwrap();
    }

    #[test]
    fn a_huge_hidden_layer_is_refused_naming_the_key_and_the_bytes() {
        let msg = refusal(&job(|c| c.train.hidden_sizes = Some(vec![4_000_000_000])), 64 * GIB);
        assert!(
            msg.starts_with("train.hidden_sizes: the job needs at least 9.5 TiB"),
            "{msg}"
        );
        // Two ranks' states, and the whole model's values once, as the first rank reports them.
        for part in ["parameters", "gradients", "optimizer state"] {
            assert!(msg.contains(&format!("{part}: 2.2 TiB (train.hidden_sizes)")), "{msg}");
        }
        assert!(
            msg.contains("the final parameters the first rank reports: 1.1 TiB (train.hidden_sizes)"),
            "{msg}"
        );
        assert!(msg.ends_with("more than the 64.0 GiB available"), "{msg}");
    }

    #[test]
    fn batches_data_steps_and_gpt_shapes_count() {
        let msg = refusal(&job(|c| c.train.batch_size = 2_000_000_000_000), 64 * GIB);
        assert!(msg.starts_with("train.batch_size: "), "{msg}");
        let msg = refusal(
            &job(|c| {
                c.train.dataset = DatasetKind::Synthetic;
                c.train.synthetic_samples = 100_000_000_000;
            }),
            64 * GIB,
        );
        assert!(msg.starts_with("train.synthetic_samples: "), "{msg}");
        let msg = refusal(&job(|c| c.train.steps = Some(100_000_000_000_000)), 64 * GIB);
        assert!(msg.starts_with("train.steps: "), "{msg}");
        let msg = refusal(
            &job(|c| {
                c.train.model = ModelKind::Gpt;
                c.train.dataset = DatasetKind::Text;
                c.train.gpt.n_embd = 1 << 20;
            }),
            64 * GIB,
        );
        assert!(msg.starts_with("train.gpt: "), "{msg}");
    }

    #[test]
    fn evaluation_counts_when_its_pass_holds_more_than_a_step() {
        let gpt = |eval_rows: Option<usize>| {
            job(|c| {
                c.train.model = ModelKind::Gpt;
                c.train.dataset = DatasetKind::Text;
                c.train.eval_batch_size = eval_rows;
            })
        };
        // By default a pass scores a step's rows, without gradients: training is the larger.
        let (by_default, step) = (gpt(None), gpt(Some(1)));
        assert_eq!(node_bytes(&by_default), node_bytes(&step));
        let msg = refusal(&gpt(Some(10_000_000)), 64 * GIB);
        assert!(
            msg.starts_with("train.eval_batch_size: ")
                && msg.contains("activations of an evaluation pass: ")
                && msg.contains("(train.eval_batch_size)"),
            "{msg}"
        );
        assert!(node_bytes(&gpt(Some(256))) > node_bytes(&by_default));
    }

    /// The bytes of `config`'s estimate for `what` (0 where it has no such term).
    fn part(config: &JobConfig, what: &str) -> u128 {
        estimate(config)
            .into_iter()
            .find(|n| n.what == what)
            .map(|n| n.bytes)
            .unwrap_or_default()
    }

    #[test]
    fn sharded_states_count_a_shard_of_the_optimizer_and_at_stage_2_of_the_gradients() {
        let adamw = |stage: Option<u8>| {
            job(|c| {
                c.cluster.nproc_per_node = 4;
                c.train.optimizer = OptimizerKind::Adamw;
                c.train.hidden_sizes = Some(vec![4_000_000_000]);
                c.strategy.fuse_grad_size_in_mb = 1.0;
                if let Some(stage) = stage {
                    c.strategy.sharding = true;
                    c.strategy.sharding_configs.stage = stage;
                }
            })
        };
        let (plain, one, two) = (adamw(None), adamw(Some(1)), adamw(Some(2)));
        // Bytes of all the ranks' values of `count` each.
        let bytes = |count: u128| count * F32 * 4;
        let params = part(&plain, "parameters") / bytes(1);
        assert_eq!(part(&plain, "gradients"), bytes(params));
        assert_eq!(part(&plain, "optimizer state"), bytes(2 * params));
        // Each of the 4 ranks: a quarter of the two moments and of the parameters it updates.
        let quarter = params.div_ceil(4);
        assert_eq!(part(&one, "optimizer state"), bytes(3 * quarter));
        assert_eq!(part(&one, "gradients"), bytes(params));
        // Stage 2 keeps a quarter of the averaged gradients, and a 1 MiB bucket in flight.
        assert_eq!(part(&two, "gradients"), bytes(quarter + (1 << 20) / F32));
        assert_eq!(part(&two, "optimizer state"), part(&one, "optimizer state"));
    }

    #[test]
    fn sharded_parameters_count_a_shard_of_everything_and_two_blocks_in_flight() {
        let deep = |stage: Option<u8>| {
            job(|c| {
                c.cluster.nproc_per_node = 4;
                c.train.optimizer = OptimizerKind::Adamw;
                c.train.hidden_sizes = Some(vec![1000; 8]);
                c.strategy.sharding = stage.is_some();
                c.strategy.sharding_configs.stage = stage.unwrap_or(1);
            })
        };
        let (plain, three) = (deep(None), deep(Some(3)));
        let bytes = |count: u128| count * F32 * 4;
        let params = part(&plain, "parameters") / bytes(1);
        let (quarter, layer) = (params.div_ceil(4), 1001 * 1000);
        assert_eq!(part(&three, "parameters"), bytes(quarter + 2 * layer));
        assert_eq!(part(&three, "gradients"), bytes(quarter + 2 * layer));
        assert_eq!(part(&three, "optimizer state"), bytes(2 * quarter));
    }

    /// A rank holds its stage's share of the parameters and its part of the split layers': the
    /// node's ranks together hold the model once per replica on it.
    #[test]
    fn pipeline_stages_and_split_layers_hold_their_share_of_the_parameters() {
        let params = |edit: &dyn Fn(&mut JobConfig)| {
            let config = job(|c| {
                c.cluster.nproc_per_node = 4;
                c.train.hidden_sizes = Some(vec![4096, 4096]);
                edit(c);
            });
            estimate(&config)
                .into_iter()
                .find(|n| n.what == "parameters")
                .map_or(0, |n| n.bytes)
        };
        let replicas = params(&|_| {});
        let pipeline = params(&|c| {
            c.strategy.pipeline = true;
            c.strategy.hybrid_configs.pp_degree = 2;
            c.strategy.hybrid_configs.dp_degree = 2;
        });
        let split = params(&|c| {
            c.strategy.hybrid_configs.mp_degree = 4;
        });
        // Four whole replicas; two replicas of two stages; one model split four ways (each
        // share rounded up to whole values: a few bytes more).
        let ranks_rounding = 4 * F32 * 4;
        assert!(
            (pipeline * 2).abs_diff(replicas) <= ranks_rounding,
            "{pipeline} × 2 against {replicas}"
        );
        assert!(
            (split * 4).abs_diff(replicas) <= ranks_rounding,
            "{split} × 4 against {replicas}"
        );
    }

    #[test]
    fn sizes_read_in_binary_units() {
        assert_eq!(bytes_text(512), "512 B");
        assert_eq!(bytes_text(1536), "1.5 KiB");
        assert_eq!(bytes_text(u128::from(3 * GIB)), "3.0 GiB");
    }
}
