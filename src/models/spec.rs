//! The built-in models as data: what a model file's metadata records, so that the file alone
//! rebuilds the model it holds.

use anyhow::Result;
use serde::{Deserialize, Serialize};

use super::{gpt, mlp, GptConfig, Model, ParamInit};

/// A built-in model's architecture and shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ModelSpec {
    /// [`mlp`]: `inputs → hidden… → outputs`.
    Mlp {
        /// Features per row.
        inputs: usize,
        /// Hidden widths, input side first.
        hidden: Vec<usize>,
        /// Classes, or values regressed.
        outputs: usize,
    },
    /// [`gpt`] of this shape.
    Gpt(GptConfig),
}

impl ModelSpec {
    /// The model, its parameters drawn by `init`.
    pub fn build(&self, init: &ParamInit) -> Result<Model> {
        match self {
            Self::Mlp {
                inputs,
                hidden,
                outputs,
            } => mlp(*inputs, hidden, *outputs, init),
            Self::Gpt(config) => gpt(config, init),
        }
    }
}
