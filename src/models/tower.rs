//! The deep tower of the CTR models: a stack of fully connected layers from the concatenated
//! embeddings (and dense features) down to one logit.

use anyhow::Result;
use candle_core::Tensor;

use super::{Activation, Block, Linear, ParamInit};

/// The deep tower: `inputs → hidden… → 1`, ReLU between layers, blocks `{prefix}0`, `{prefix}1`,
/// … and `{prefix}_out`.
pub(super) fn tower(prefix: &str, inputs: usize, hidden: &[usize], init: &ParamInit) -> Result<Vec<Linear>> {
    let widths: Vec<usize> = std::iter::once(inputs)
        .chain(hidden.iter().copied())
        .chain(std::iter::once(1))
        .collect();
    let layers = widths.len() - 1;
    Ok((0..layers)
        .map(|i| {
            let (name, activation) = if i + 1 == layers {
                (format!("{prefix}_out"), Activation::Identity)
            } else {
                (format!("{prefix}{i}"), Activation::Relu)
            };
            Linear::new(&name, widths[i], widths[i + 1], activation, init)
        })
        .collect::<candle_core::Result<Vec<_>>>()?)
}

/// The tower's output `(batch, 1)` for its input.
pub(super) fn run_tower(tower: &[Linear], input: Tensor) -> candle_core::Result<Tensor> {
    tower.iter().try_fold(input, |h, layer| layer.forward(&h))
}
