//! A fully connected block with an optional activation.

use candle_core::{Tensor, Var};

use super::affine::affine;
use super::{Block, ParamInit};

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
    weight: Var,
    bias: Var,
    activation: Activation,
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
        Ok(Self {
            name: name.to_string(),
            weight: init.fan_in_uniform(&format!("{name}.weight"), &[inputs, outputs], inputs)?,
            bias: init.fan_in_uniform(&format!("{name}.bias"), &[outputs], inputs)?,
            activation,
        })
    }
}

impl Block for Linear {
    fn name(&self) -> &str {
        &self.name
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        affine(x, self.weight.as_tensor(), self.bias.as_tensor(), self.activation)
    }

    fn transposed_parameters(&self) -> &'static [&'static str] {
        &["weight"]
    }

    fn parameters(&self) -> Vec<(String, Var)> {
        vec![
            ("bias".to_string(), self.bias.clone()),
            ("weight".to_string(), self.weight.clone()),
        ]
    }
}
