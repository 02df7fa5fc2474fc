//! Text from a trained GPT, a token at a time: the model reads the last `block_size` tokens of
//! the text so far and the next token is chosen from its logits at the last position — the
//! most likely one at temperature 0, else drawn from the softmax of the logits divided by the
//! temperature, restricted to the `top_k` largest, by a seeded generator so that a seed
//! reproduces the text.
//!
//! Each token recomputes the whole window (no key/value cache): the blocks are the ones training
//! runs, whose attention keeps no cache, and a character model's window is short (64 tokens in
//! the examples), so a token costs one forward pass of one window.

use std::ops::ControlFlow;

use anyhow::{ensure, Context, Result};
use candle_core::{Device, IndexOp, Tensor};

use crate::models::{argmax, Model};
use crate::rng::SplitMix64;

/// How the next token is chosen from the logits.
#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f32,
    top_k: Option<usize>,
    rng: SplitMix64,
}

impl Sampler {
    /// Greedy at `temperature` 0; else softmax sampling at `temperature` among the `top_k`
    /// largest logits (all of them when `None`), drawn from a generator seeded with `seed`.
    pub fn new(temperature: f32, top_k: Option<usize>, seed: u64) -> Result<Self> {
        ensure!(
            temperature.is_finite() && temperature >= 0.0,
            "the temperature must be a finite number ≥ 0, got {temperature}"
        );
        ensure!(top_k != Some(0), "top-k must keep at least 1 token, got 0");
        Ok(Self {
            temperature,
            top_k,
            rng: SplitMix64::for_stream(seed, "generate", 0),
        })
    }

    /// The token chosen from `logits`, one per token of the vocabulary.
    pub fn next(&mut self, logits: &[f32]) -> usize {
        if self.temperature == 0.0 {
            return argmax(logits);
        }
        // Largest first; equal logits keep token order, so a seed draws the same token anywhere.
        let mut ranked: Vec<usize> = (0..logits.len()).collect();
        ranked.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        ranked.truncate(self.top_k.unwrap_or(usize::MAX).min(logits.len()));
        let Some(&best) = ranked.first() else {
            return 0;
        };
        // Shifted by the largest logit, so that exp never overflows.
        let scale = f64::from(self.temperature);
        let weights: Vec<f64> = ranked
            .iter()
            .map(|&token| ((f64::from(logits[token]) - f64::from(logits[best])) / scale).exp())
            .collect();
        let mut left = f64::from(self.rng.next_f32()) * weights.iter().sum::<f64>();
        for (&token, weight) in ranked.iter().zip(&weights) {
            if left < *weight {
                return token;
            }
            left -= weight;
        }
        // Rounding left a sliver past the last weight.
        ranked[ranked.len() - 1]
    }
}

/// Continues `prompt` (token ids) by `tokens` tokens of `model`, a GPT reading at most
/// `block_size` tokens on `device`, chosen by `sampler`; hands each to `emit` as it comes, and
/// stops early, answering `Break`, when `emit` does.
pub fn continue_text(
    model: &Model,
    block_size: usize,
    device: &Device,
    prompt: &[u32],
    tokens: usize,
    sampler: &mut Sampler,
    mut emit: impl FnMut(u32) -> Result<ControlFlow<()>>,
) -> Result<ControlFlow<()>> {
    ensure!(!prompt.is_empty(), "a GPT continues a prompt of at least one token");
    ensure!(block_size > 0, "a block size of 0 tokens");
    let mut window = prompt[prompt.len().saturating_sub(block_size)..].to_vec();
    for made in 0..tokens {
        let ids = Tensor::from_slice(&window, (1, window.len()), device)?;
        let logits = model
            .forward(&ids)
            .and_then(|out| out.i((0, window.len() - 1))?.to_vec1::<f32>())
            .with_context(|| format!("running the model for token {made}"))?;
        let next = u32::try_from(sampler.next(&logits)).context("a token id beyond u32")?;
        if window.len() == block_size {
            window.remove(0);
        }
        window.push(next);
        if emit(next)?.is_break() {
            return Ok(ControlFlow::Break(()));
        }
    }
    Ok(ControlFlow::Continue(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{gpt, GptConfig, ParamInit};

    /// How often each token of `logits` is drawn in `draws` draws.
    fn counts(sampler: &mut Sampler, logits: &[f32], draws: usize) -> Vec<usize> {
        let mut counts = vec![0; logits.len()];
        for _ in 0..draws {
            counts[sampler.next(logits)] += 1;
        }
        counts
    }

    #[test]
    fn temperature_zero_is_the_first_largest_logit() -> Result<()> {
        let mut greedy = Sampler::new(0.0, Some(1), 3)?;
        assert_eq!(greedy.next(&[0.5, 2.0, -1.0, 2.0]), 1);
        let mut top_one = Sampler::new(5.0, Some(1), 3)?;
        assert_eq!(counts(&mut top_one, &[0.5, 2.0, -1.0, 2.5], 50), [0, 0, 0, 50]);
        Ok(())
    }

    #[test]
    fn sampling_follows_the_tempered_softmax_of_the_top_k() -> Result<()> {
        // ln 3, ln 1, ln 2, ln 6: softmax 1/4, 1/12, 1/6, 1/2 at temperature 1.
        let logits = [3f32.ln(), 0.0, 2f32.ln(), 6f32.ln()];
        let draws = 60_000;
        let seen = counts(&mut Sampler::new(1.0, None, 7)?, &logits, draws);
        for (count, p) in seen.iter().zip([0.25, 1.0 / 12.0, 1.0 / 6.0, 0.5]) {
            let share = *count as f64 / draws as f64;
            assert!((share - p).abs() < 0.01, "{seen:?}");
        }
        // Top 2 of them (6 and 3): 2/3 and 1/3; at temperature 2 the ratio's square root.
        let seen = counts(&mut Sampler::new(1.0, Some(2), 7)?, &logits, draws);
        assert_eq!((seen[1], seen[2]), (0, 0));
        assert!((seen[3] as f64 / draws as f64 - 2.0 / 3.0).abs() < 0.01, "{seen:?}");
        let seen = counts(&mut Sampler::new(2.0, Some(2), 7)?, &logits, draws);
        let ratio = seen[3] as f64 / seen[0] as f64;
        assert!((ratio - 2f64.sqrt()).abs() < 0.05, "{seen:?}");
        // A seed reproduces its draws.
        assert_eq!(
            counts(&mut Sampler::new(1.0, Some(3), 11)?, &logits, 100),
            counts(&mut Sampler::new(1.0, Some(3), 11)?, &logits, 100)
        );
        Ok(())
    }

    #[test]
    fn settings_out_of_range_are_refused() {
        for (temperature, top_k) in [(-0.5, None), (f32::NAN, None), (1.0, Some(0))] {
            assert!(Sampler::new(temperature, top_k, 0).is_err(), "{temperature} {top_k:?}");
        }
    }

    #[test]
    fn a_long_prompt_is_read_through_the_last_window() -> Result<()> {
        let config = GptConfig {
            vocab: 5,
            block_size: 4,
            n_layer: 1,
            n_head: 1,
            n_embd: 8,
            tie_head: false,
        };
        let model = gpt(&config, &ParamInit::new(1, Device::Cpu))?;
        // The tokens made, until `emit` has taken `wanted`.
        let run = |prompt: &[u32], wanted: usize| -> Result<(Vec<u32>, ControlFlow<()>)> {
            let mut made = Vec::new();
            let mut sampler = Sampler::new(0.0, None, 0)?;
            let ended = continue_text(&model, 4, &Device::Cpu, prompt, 6, &mut sampler, |token| {
                made.push(token);
                Ok(match made.len() < wanted {
                    true => ControlFlow::Continue(()),
                    false => ControlFlow::Break(()),
                })
            })?;
            Ok((made, ended))
        };
        let (made, ended) = run(&[4, 3, 2, 1, 0, 1, 2], usize::MAX)?;
        assert_eq!((made.len(), ended), (6, ControlFlow::Continue(())));
        assert!(made.iter().all(|&token| token < 5), "{made:?}");
        // Only the last 4 tokens are read.
        assert_eq!(run(&[1, 0, 1, 2], usize::MAX)?.0, made);
        assert_eq!(run(&[1, 0, 1, 2], 2)?, (made[..2].to_vec(), ControlFlow::Break(())));
        Ok(())
    }
}
