//! A small decoder-only transformer (GPT-2 shaped) as sequential blocks.
//!
//! Blocks: `embed` ((B, T) u32 ids → (B, T, C)), `h0` … `h{n-1}` (pre-LN
//! transformer layers, (B, T, C) → (B, T, C)), `head` (→ (B, T, vocab)
//! logits). Every block after `embed` takes and returns one f32 tensor, so
//! any contiguous run of blocks can be a pipeline stage whose input is a
//! fresh variable.
//!
//! Initialisation follows GPT-2 in scale, drawn from the seeded uniform
//! [`ParamInit`] (same values on every rank): embeddings and weights with
//! standard deviation 0.02, the two residual output projections of each
//! layer 0.02/√(2·n_layer), biases 0, LayerNorm gain 1 and bias 0.

mod attention;
mod dense;
mod embed;
mod fused;
mod generate;
mod head;
mod layer;
mod norm;

use anyhow::{ensure, Context, Result};

pub use self::generate::{continue_text, Sampler};
use self::{embed::Embedding, head::Head, layer::TransformerLayer};
use super::{Block, Model, ParamInit};

/// The shape of a GPT model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    /// Token ids are below it; the width of the logits.
    pub vocab: usize,
    /// The longest sequence the model reads: the position table's length.
    pub block_size: usize,
    /// Transformer layers, the `h{i}` blocks: what a pipeline cuts into stages.
    pub n_layer: usize,
    /// Attention heads; must divide `n_embd`.
    pub n_head: usize,
    /// Width C of the residual stream.
    pub n_embd: usize,
    /// The head projects with the embedding's token table (one (vocab, C)
    /// parameter, reported by `embed` only) instead of its own weight. Both
    /// uses must meet in one backward pass: `embed` and `head` in the same
    /// pipeline stage, and not with an engine that runs backward block by
    /// block (as `collective`'s replica does), which would drop the head's
    /// share of the gradient.
    pub tie_head: bool,
}

/// The model of `config`: blocks `embed`, `h0` … `h{n_layer-1}`, `head`.
pub fn gpt(config: &GptConfig, init: &ParamInit) -> Result<Model> {
    let GptConfig {
        vocab,
        block_size,
        n_layer,
        n_head,
        n_embd,
        tie_head,
    } = *config;
    ensure!(
        vocab > 0 && block_size > 0,
        "GPT needs a vocabulary and a block size: {config:?}"
    );
    ensure!(
        n_head > 0 && n_embd > 0 && n_embd.is_multiple_of(n_head),
        "GPT width {n_embd} does not split into {n_head} equal heads"
    );
    let embed = Embedding::new(vocab, block_size, n_embd, init).context("creating the GPT embedding")?;
    let head = if tie_head {
        Head::tied(embed.token_table(), n_embd, init)
    } else {
        Head::untied(vocab, n_embd, init)
    }
    .context("creating the GPT head")?;
    let mut blocks: Vec<Box<dyn Block>> = vec![Box::new(embed)];
    for i in 0..n_layer {
        let layer = TransformerLayer::new(&format!("h{i}"), n_embd, n_head, n_layer, init)
            .with_context(|| format!("creating GPT layer h{i}"))?;
        blocks.push(Box::new(layer));
    }
    blocks.push(Box::new(head));
    Model::new(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::text::TextCorpus;
    use crate::data::{Dataset, ShardedLoader};
    use crate::models::cross_entropy;
    use crate::rng::SplitMix64;
    use candle_core::{DType, Device, Tensor, Var};
    use candle_nn::Optimizer;
    use std::sync::Arc;

    fn tiny(tie_head: bool) -> GptConfig {
        GptConfig {
            vocab: 7,
            block_size: 5,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            tie_head,
        }
    }

    fn ids(values: &[u32], rows: usize) -> candle_core::Result<Tensor> {
        Tensor::from_slice(values, (rows, values.len() / rows), &Device::Cpu)
    }

    fn param(model: &Model, name: &str) -> anyhow::Result<Var> {
        let found = model.parameters().into_iter().find(|p| p.name == name);
        Ok(found.with_context(|| format!("no parameter {name}"))?.param.var()?)
    }

    #[test]
    fn shapes_names_and_determinism() -> anyhow::Result<()> {
        let init = ParamInit::new(3, Device::Cpu);
        let model = gpt(&tiny(false), &init)?;
        let names: Vec<&str> = model.blocks().iter().map(|b| b.name()).collect();
        assert_eq!(names, ["embed", "h0", "h1", "head"]);
        let mut x = ids(&[0, 1, 2, 3, 4, 5, 6, 0], 2)?;
        let expected: [&[usize]; 4] = [&[2, 4, 8], &[2, 4, 8], &[2, 4, 8], &[2, 4, 7]];
        for (block, dims) in model.blocks().iter().zip(expected) {
            x = block.forward(&x)?;
            assert_eq!(x.dims(), dims, "output of {}", block.name());
            assert_eq!(x.dtype(), DType::F32);
        }
        let params: Vec<String> = model.parameters().into_iter().map(|p| p.name).collect();
        let mut unique = params.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), params.len(), "parameter names are unique");
        for name in [
            "embed.token",
            "h1.attn.q.weight",
            "h0.mlp.proj.bias",
            "h1.ln2.gain",
            "head.weight",
        ] {
            assert!(params.iter().any(|p| p == name), "{name} in {params:?}");
        }
        assert!(
            model.blocks()[0].forward(&ids(&[0; 12], 2)?).is_err(),
            "6 > block size 5"
        );
        let again = gpt(&tiny(false), &init)?;
        let (a, b) = (param(&model, "h1.attn.v.weight")?, param(&again, "h1.attn.v.weight")?);
        assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
        Ok(())
    }

    #[test]
    fn later_tokens_do_not_change_earlier_logits() -> anyhow::Result<()> {
        let model = gpt(&tiny(true), &ParamInit::new(5, Device::Cpu))?;
        let before = model.forward(&ids(&[1, 2, 3, 4, 5, 6, 0, 1, 2, 3], 2)?)?;
        let after = model.forward(&ids(&[1, 2, 6, 6, 6, 6, 5, 5, 5, 5], 2)?)?;
        // Row 0 differs from position 2 on, row 1 from position 1 on.
        for (row, same) in [(0, 2), (1, 1)] {
            let a = before.get(row)?.narrow(0, 0, same)?.flatten_all()?.to_vec1::<f32>()?;
            let b = after.get(row)?.narrow(0, 0, same)?.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(a, b, "row {row}: positions before {same} are bit-for-bit equal");
            let next_a = before.get(row)?.get(same)?.to_vec1::<f32>()?;
            let next_b = after.get(row)?.get(same)?.to_vec1::<f32>()?;
            assert_ne!(next_a, next_b, "row {row}: position {same} does see its new token");
        }
        Ok(())
    }

    #[test]
    fn gradients_match_finite_differences() -> anyhow::Result<()> {
        let model = gpt(&tiny(false), &ParamInit::new(11, Device::Cpu))?;
        // GPT-2's small initial weights leave attention nearly uniform; larger
        // ones make every term (including the softmax's) count.
        let mut rng = SplitMix64::new(42);
        for p in model.parameters() {
            let noise: Vec<f32> = (0..p.param.elem_count()).map(|_| rng.uniform(-0.5, 0.5)).collect();
            let moved = (p.param.var()?.as_tensor() + Tensor::from_vec(noise, p.param.shape(), &Device::Cpu)?)?;
            p.param.set(&moved)?;
        }
        let x = ids(&[0, 3, 1, 4, 1, 5, 2, 6, 5, 3], 2)?;
        let y = ids(&[3, 1, 4, 1, 5, 2, 6, 5, 3, 5], 2)?;
        let loss = |m: &Model| -> anyhow::Result<f32> { Ok(cross_entropy(&m.forward(&x)?, &y)?.to_scalar::<f32>()?) };
        let grads = cross_entropy(&model.forward(&x)?, &y)?.backward()?;
        // f32 with ε = 1e-2: rounding error ≈ 1e-7/ε and truncation ≈ ε²;
        // measured differences were ≤ 3e-5, so 1e-4 absolute + 1% relative,
        // with every checked gradient above 2e-3 (a missing term shows).
        let eps = 1e-2;
        let checks = [
            ("h0.ln1.gain", 3),
            ("h1.ln2.gain", 6),
            ("h1.attn.q.weight", 5),
            ("h0.attn.k.weight", 17),
            ("h0.attn.v.weight", 40),
            ("h1.mlp.fc.weight", 100),
            ("embed.token", 3 * 8 + 2),
            ("embed.position", 4 * 8 + 1),
            ("head.weight", 9),
        ];
        for (name, index) in checks {
            let var = param(&model, name)?;
            let analytic = grads.get(&var).context("gradient")?.flatten_all()?.to_vec1::<f32>()?[index];
            let original = var.flatten_all()?.to_vec1::<f32>()?;
            let at = |delta: f32| -> anyhow::Result<f32> {
                let mut v = original.clone();
                v[index] += delta;
                var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu)?)?;
                loss(&model)
            };
            let numeric = (at(eps)? - at(-eps)?) / (2.0 * eps);
            var.set(&Tensor::from_vec(original, var.shape(), &Device::Cpu)?)?;
            assert!(
                analytic.abs() > 2e-3,
                "{name}[{index}] gradient {analytic} is too small to test"
            );
            assert!(
                (analytic - numeric).abs() <= 1e-4 + 0.01 * numeric.abs(),
                "{name}[{index}]: backward {analytic}, finite difference {numeric}"
            );
        }
        Ok(())
    }

    #[test]
    fn tying_shares_the_token_table() -> anyhow::Result<()> {
        let init = ParamInit::new(1, Device::Cpu);
        let (tied, untied) = (gpt(&tiny(true), &init)?, gpt(&tiny(false), &init)?);
        assert_eq!(untied.parameter_count() - tied.parameter_count(), 7 * 8);
        let per_layer = 2 * 8 + 4 * (8 * 8 + 8) + 2 * 8 + (8 * 32 + 32) + (32 * 8 + 8);
        assert_eq!(tied.parameter_count(), 7 * 8 + 5 * 8 + 2 * per_layer + 2 * 8);
        assert!(tied.parameters().iter().all(|p| !p.name.starts_with("head.weight")));
        // The head's logits move with the embedding table.
        let x = ids(&[1, 2, 3], 1)?;
        let before = tied.forward(&x)?.flatten_all()?.to_vec1::<f32>()?;
        let table = param(&tied, "embed.token")?;
        table.set(&(table.as_tensor() * 2.0)?)?;
        assert_ne!(before, tied.forward(&x)?.flatten_all()?.to_vec1::<f32>()?);
        Ok(())
    }

    #[test]
    fn uniform_logits_cost_ln_vocab() -> anyhow::Result<()> {
        let logits = Tensor::zeros((2, 3, 7), DType::F32, &Device::Cpu)?;
        let loss = cross_entropy(&logits, &ids(&[0, 1, 2, 3, 4, 6], 2)?)?.to_scalar::<f32>()?;
        assert!((loss - 7f32.ln()).abs() < 1e-6, "{loss}");
        assert!(cross_entropy(&logits, &ids(&[0, 1, 2, 3], 2)?).is_err());
        Ok(())
    }

    #[test]
    fn stage_by_stage_backward_equals_whole_backward() -> anyhow::Result<()> {
        let model = gpt(&tiny(false), &ParamInit::new(9, Device::Cpu))?;
        let (x, y) = (ids(&[0, 3, 1, 4, 1, 5, 2, 6], 2)?, ids(&[3, 1, 4, 1, 5, 2, 6, 5], 2)?);
        let whole = cross_entropy(&model.forward(&x)?, &y)?.backward()?;
        // Stages [embed, h0] and [h1, head], the second's input a fresh Var.
        let (first, second) = model.blocks().split_at(2);
        let boundary = first.iter().try_fold(x, |h, b| b.forward(&h))?;
        let input = Var::from_tensor(&boundary.detach())?;
        let logits = second
            .iter()
            .try_fold(input.as_tensor().clone(), |h, b| b.forward(&h))?;
        let late = cross_entropy(&logits, &y)?.backward()?;
        let g = late.get(input.as_tensor()).context("boundary gradient")?.detach();
        let early = (boundary * g)?.sum_all()?.backward()?;
        for p in model.parameters() {
            let store = if p.block < 2 { &early } else { &late };
            let staged = store
                .get(p.param.var()?.as_tensor())
                .context("staged gradient")?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let reference = whole
                .get(p.param.var()?.as_tensor())
                .context("gradient")?
                .flatten_all()?
                .to_vec1::<f32>()?;
            for (s, r) in staged.iter().zip(&reference) {
                assert!((s - r).abs() <= 1e-6 + 1e-4 * r.abs(), "{}: {s} vs {r}", p.name);
            }
        }
        Ok(())
    }

    #[test]
    fn learns_around_the_world() -> anyhow::Result<()> {
        let corpus = TextCorpus::around_the_world()?;
        let (train, test) = corpus.split(0.1)?;
        let config = GptConfig {
            vocab: corpus.vocab.len(),
            block_size: 32,
            n_layer: 2,
            n_head: 2,
            n_embd: 32,
            tie_head: true,
        };
        let model = gpt(&config, &ParamInit::new(0, Device::Cpu))?;
        let vars = model
            .parameters()
            .into_iter()
            .map(|p| p.param.var())
            .collect::<candle_core::Result<_>>()?;
        let params = candle_nn::ParamsAdamW {
            lr: 3e-3,
            ..Default::default()
        };
        let mut optimizer = candle_nn::AdamW::new(vars, params)?;
        let windows = Dataset::token_windows(&train, 32, 16, corpus.vocab.len())?;
        let mut batches = ShardedLoader::new(Arc::new(windows), 16, 0, 1, 7)?;
        let started = std::time::Instant::now();
        for step in 0..200 {
            let (x, y) = batches.batch(step).tensors(&Device::Cpu)?;
            let loss = cross_entropy(&model.forward(&x)?, &y)?;
            if step % 20 == 0 {
                eprintln!("step {step:3}: train loss {:.3}", loss.to_scalar::<f32>()?);
            }
            optimizer.backward_step(&loss)?;
        }
        let test = Dataset::token_windows(&test, 32, 32, corpus.vocab.len())?;
        let (x, y) = test.select(&(0..64).collect::<Vec<_>>()).tensors(&Device::Cpu)?;
        let held_out = cross_entropy(&model.forward(&x)?, &y)?.to_scalar::<f32>()?;
        let chance = (config.vocab as f32).ln();
        eprintln!(
            "held-out loss {held_out:.3} (ln vocab {chance:.3}) after {:.1?}",
            started.elapsed()
        );
        assert!(
            held_out < 0.75 * chance,
            "held-out loss {held_out} vs ln vocab {chance}"
        );
        Ok(())
    }
}
