//! Sequential-block models.
//!
//! A model is an ordered list of [`Block`]s; the output of block `i` is the
//! input of block `i + 1`, and the last block's output is the logits. The
//! data-parallel engine runs backward block by block from the last one (so
//! a bucket of gradients can be all-reduced while earlier blocks are still
//! in backward), and the pipeline engine will cut the same list into stages.

mod affine;
mod bf16_matmul;
mod deepfm;
pub mod export;
mod gpt;
mod init;
mod linear;
mod loss;
mod mlp;
pub mod parallel;
mod param;
mod sparse;
mod spec;
mod tower;
mod wide_deep;

pub use affine::{cpu_matrix_kernel, Precision};
pub use deepfm::DeepFm;
pub use gpt::{continue_text, gpt, GptConfig, Sampler};
pub use init::{ParamInit, Recipe};
pub use linear::{Activation, Linear};
pub use loss::{
    argmax, click_probability, correct_predictions, cross_entropy, sigmoid_cross_entropy, training_loss, HeldOut, Score,
};
pub use mlp::mlp;
pub use param::Param;
pub use sparse::{Lookup, SparseModel, SparseModelBuilder, SparseModelDef, SparseTableSpec};
pub use spec::ModelSpec;
pub use wide_deep::WideDeep;

/// A model's parameters' values by name, each flat in the model's own layout: what ranks report.
pub type NamedValues = Vec<(String, Vec<f32>)>;

use anyhow::{ensure, Result};
use candle_core::Tensor;

use crate::config::LossKind;

/// One unit of a sequential model: a function of its input with named
/// parameters.
pub trait Block: Send {
    /// The block's name, unique within its model; parameter names are
    /// `"{block}.{param}"`.
    fn name(&self) -> &str;
    /// Output for input `x` (rows are samples).
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor>;
    /// The block's parameters with their names inside the block, in a fixed
    /// order.
    fn parameters(&self) -> Vec<(String, Param)>;

    /// This rank's part of the block with its weights split over `group` (tensor parallelism),
    /// given what it takes in (`input`) and whether it is the model's `last` block; answers what
    /// it hands on, or why it cannot be split.
    fn split(
        self: Box<Self>,
        _group: &parallel::Group,
        _input: &parallel::Flow,
        _last: bool,
    ) -> Result<(Box<dyn Block>, parallel::Flow)> {
        anyhow::bail!("block {} cannot be split over the ranks of a layer group", self.name())
    }

    /// The parameters (names inside the block) split over the block's layer group, each with
    /// the dimension (of the held layout) it is split along; each rank holds its slice in rank
    /// order, as [`parallel::balanced_slice`] cuts it.
    fn split_parameters(&self) -> Vec<(String, usize)> {
        Vec::new()
    }

    /// The parameters (names inside the block) held as the transpose of PyTorch's layout: the
    /// affine weights stored (in, out), which the model file writes (out, in) as `nn.Linear`
    /// holds them.
    fn transposed_parameters(&self) -> &'static [&'static str] {
        &[]
    }

    /// The block's parameters with their model-wide names, `"{block}.{param}"`, in the order of
    /// [`parameters`](Self::parameters); `index` is the block's place in its model (or stage).
    fn named_parameters(&self, index: usize) -> Vec<NamedParam> {
        let transposed = self.transposed_parameters();
        let split = self.split_parameters();
        self.parameters()
            .into_iter()
            .map(|(name, param)| NamedParam {
                block: index,
                transposed: transposed.contains(&name.as_str()),
                split: split.iter().find(|(split, _)| *split == name).map(|&(_, dim)| dim),
                name: format!("{}.{name}", self.name()),
                param,
            })
            .collect()
    }
}

/// How a model's outputs are trained and scored: whole, or (a GPT split over a layer group)
/// this rank's slice of the vocabulary's logits, whose cross-entropy never gathers them.
#[derive(Clone, Default)]
pub struct Logits {
    vocab_slice: Option<(std::ops::Range<usize>, parallel::Group)>,
}

impl Logits {
    /// The mean training loss `kind` of `outputs` against `targets`.
    pub fn loss(&self, kind: LossKind, outputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        match &self.vocab_slice {
            None => training_loss(kind, outputs, targets),
            Some((slice, group)) => {
                split_logits_only(kind)?;
                parallel::vocab::cross_entropy(outputs, targets, slice, group)
            }
        }
    }

    /// The score of `outputs` against `targets` under a job trained with `kind`.
    pub fn score(&self, kind: LossKind, outputs: &Tensor, targets: &Tensor) -> candle_core::Result<Score> {
        match &self.vocab_slice {
            None => Score::of(kind, outputs, targets),
            Some((slice, group)) => {
                split_logits_only(kind)?;
                parallel::vocab::score(outputs, targets, slice, group)
            }
        }
    }
}

/// Logits split over the vocabulary are a cross-entropy's.
fn split_logits_only(kind: LossKind) -> candle_core::Result<()> {
    if kind != LossKind::CrossEntropy {
        candle_core::bail!("logits split over a vocabulary are scored by cross-entropy, not {kind:?}");
    }
    Ok(())
}

/// A parameter with its model-wide name.
#[derive(Debug, Clone)]
pub struct NamedParam {
    /// `"{block}.{param}"`.
    pub name: String,
    /// Index of the block that owns it, in its model (or pipeline stage).
    pub block: usize,
    /// The trainable variable's slot, shared with the block that reads it.
    pub param: Param,
    /// Held as the transpose of PyTorch's layout ([`Block::transposed_parameters`]).
    pub transposed: bool,
    /// The dimension (of the held layout) the parameter is split along over its layer group,
    /// where it is ([`Block::split_parameters`]).
    pub split: Option<usize>,
}

/// A model: blocks applied in order.
pub struct Model {
    blocks: Vec<Box<dyn Block>>,
    /// How its outputs train and score.
    logits: Logits,
}

impl Model {
    /// A model of `blocks`, whose names must be distinct.
    pub fn new(blocks: Vec<Box<dyn Block>>) -> Result<Self> {
        ensure!(!blocks.is_empty(), "a model needs at least one block");
        let mut names: Vec<&str> = blocks.iter().map(|b| b.name()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            anyhow::bail!("two blocks are named {:?}; block names must be unique", w[0]);
        }
        Ok(Self {
            blocks,
            logits: Logits::default(),
        })
    }

    /// This rank's part of the model split over `group` (tensor parallelism, Megatron's layout):
    /// each block split given what the one before hands on. Its logits are whole, or its slice
    /// of the vocabulary (a GPT's); a group of one splits nothing.
    pub fn split(self, group: &parallel::Group) -> Result<Self> {
        if group.size() == 1 {
            return Ok(self);
        }
        let last = self.blocks.len() - 1;
        let mut flow = parallel::Flow::Whole;
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for (index, block) in self.blocks.into_iter().enumerate() {
            let (part, out) = block.split(group, &flow, index == last)?;
            blocks.push(part);
            flow = out;
        }
        let vocab_slice = match flow {
            parallel::Flow::Whole => None,
            parallel::Flow::Sliced(range) => Some((range, group.clone())),
        };
        Ok(Self {
            blocks,
            logits: Logits { vocab_slice },
        })
    }

    /// The mean training loss `kind` of `outputs` (this model's) against `targets`; logits split
    /// over the vocabulary take the split cross-entropy, which never gathers them.
    pub fn loss(&self, kind: LossKind, outputs: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        self.logits.loss(kind, outputs, targets)
    }

    /// The score of `outputs` (this model's) against `targets` under a job trained with `kind`.
    pub fn score(&self, kind: LossKind, outputs: &Tensor, targets: &Tensor) -> candle_core::Result<Score> {
        self.logits.score(kind, outputs, targets)
    }

    /// The blocks, in order.
    pub fn blocks(&self) -> &[Box<dyn Block>] {
        &self.blocks
    }

    /// The blocks, in order.
    pub fn into_blocks(self) -> Vec<Box<dyn Block>> {
        self.blocks
    }

    /// The blocks, in order, to be cut into pipeline stages, and how the last one's outputs
    /// train and score.
    pub fn into_parts(self) -> (Vec<Box<dyn Block>>, Logits) {
        (self.blocks, self.logits)
    }

    /// Every parameter, block by block in model order, each block's in its
    /// own order: the order buckets and broadcasts use.
    pub fn parameters(&self) -> Vec<NamedParam> {
        self.blocks
            .iter()
            .enumerate()
            .flat_map(|(index, block)| block.named_parameters(index))
            .collect()
    }

    /// Total number of scalar parameters.
    pub fn parameter_count(&self) -> usize {
        self.parameters().iter().map(|p| p.param.elem_count()).sum()
    }

    /// The logits for input `x`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.blocks.iter().try_fold(x.clone(), |h, b| b.forward(&h))
    }
}
