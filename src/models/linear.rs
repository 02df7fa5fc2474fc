//! A fully connected block with an optional activation.

use candle_core::Tensor;

use anyhow::Context as _;

use super::parallel::{AffineMap, Flow, Group, Split};
use super::{Block, Param, ParamInit};

/// What follows the affine map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// Logits: nothing.
    Identity,
    /// max(0, x).
    Relu,
}

/// `y = act(x W + b)` with `W` of shape (in, out).
///
/// Stored input-major (unlike PyTorch's (out, in)) so that neither forward
/// nor backward goes through a transposed view: candle accumulates a
/// transposed gradient element by element, which cost a sixth of a step.
pub struct Linear {
    name: String,
    map: AffineMap,
}

impl Linear {
    /// A layer of `inputs → outputs` initialised from `init` under `name`.
    pub fn new(
        name: &str,
        inputs: usize,
        outputs: usize,
        activation: Activation,
        init: &ParamInit,
    ) -> candle_core::Result<Self> {
        let map = AffineMap::Whole {
            weight: init.fan_in_uniform(&format!("{name}.weight"), &[inputs, outputs], inputs)?,
            bias: init.fan_in_uniform(&format!("{name}.bias"), &[outputs], inputs)?,
            activation,
            products: init.products(),
        };
        Ok(Self {
            name: name.to_string(),
            map,
        })
    }
}

impl Block for Linear {
    fn name(&self) -> &str {
        &self.name
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.map.forward(x)
    }

    /// Megatron's pairs: a layer taking the whole input is split by columns (its outputs
    /// sliced), the next by rows (its outputs whole again); a last layer taking the whole input
    /// stays whole on every rank, so the model's outputs are whole.
    fn split(self: Box<Self>, group: &Group, input: &Flow, last: bool) -> anyhow::Result<(Box<dyn Block>, Flow)> {
        let Self { name, map } = *self;
        let (map, out) = match (input, last) {
            (Flow::Sliced(_), _) => (map.split(Split::Rows, group)?, Flow::Whole),
            (Flow::Whole, true) => (map, Flow::Whole),
            (Flow::Whole, false) => {
                let map = map
                    .split(Split::Columns, group)
                    .with_context(|| format!("splitting layer {name}"))?;
                let AffineMap::Split(part) = &map else {
                    anyhow::bail!("layer {name} was not split");
                };
                let outputs = part.bias.elem_count();
                let start = group.rank() * outputs;
                (map, Flow::Sliced(start..start + outputs))
            }
        };
        Ok((Box::new(Self { name, map }), out))
    }

    fn split_parameters(&self) -> Vec<(String, usize)> {
        self.map.split_parameters("")
    }

    fn transposed_parameters(&self) -> &'static [&'static str] {
        &["weight"]
    }

    fn parameters(&self) -> Vec<(String, Param)> {
        let [(_, weight), (_, bias)] = self.map.parameters("");
        vec![("bias".to_string(), bias), ("weight".to_string(), weight)]
    }
}
