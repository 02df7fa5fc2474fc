//! A character-level text corpus and its rank-sharded batches of windows.
//!
//! The shipped corpus is Jules Verne's *Around the World in 80 Days*
//! (`data/text/`, source and public-domain status in its README), compiled
//! into the binary so a language-model job runs anywhere. Batches follow the
//! same global-batch rule as [`super::ShardedLoader`]: global batch `b` is a
//! function of `(seed, b)` alone, and rank `r` of `world` reads rows
//! `[r·B/world, (r+1)·B/world)` of it, so the ranks together see exactly the
//! batch one process would.

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};
use std::sync::Arc;

use crate::rng::SplitMix64;

const AROUND_THE_WORLD: &str = include_str!("../../data/text/around_the_world_in_80_days.txt");

/// A text as token ids over its own character vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextCorpus {
    /// The distinct characters of the text, sorted: token `i` is `vocab[i]`,
    /// so the ids do not depend on where a character first appears.
    pub vocab: Vec<char>,
    /// The whole text, one id per character.
    pub tokens: Vec<u32>,
}

impl TextCorpus {
    /// *Around the World in 80 Days* (370,872 characters, 78 distinct).
    pub fn around_the_world() -> Result<Self> {
        Self::from_text(AROUND_THE_WORLD).context("tokenising the shipped Around the World in 80 Days")
    }

    /// The corpus of `text`, its vocabulary being the characters it uses.
    pub fn from_text(text: &str) -> Result<Self> {
        ensure!(!text.is_empty(), "a text corpus needs at least one character");
        let mut vocab: Vec<char> = text.chars().collect();
        vocab.sort_unstable();
        vocab.dedup();
        ensure!(
            u32::try_from(vocab.len()).is_ok(),
            "{} distinct characters do not fit u32 token ids",
            vocab.len()
        );
        let corpus = Self {
            vocab,
            tokens: Vec::new(),
        };
        let tokens = corpus.encode(text)?;
        Ok(Self { tokens, ..corpus })
    }

    /// The ids of `s`; a character outside the vocabulary is an error naming
    /// it, since silently dropping it would shift every later position.
    pub fn encode(&self, s: &str) -> Result<Vec<u32>> {
        s.chars()
            .enumerate()
            .map(|(at, ch)| match self.vocab.binary_search(&ch) {
                Ok(id) => Ok(id as u32),
                Err(_) => bail!("character {ch:?} (at {at}) is not in the corpus vocabulary"),
            })
            .collect()
    }

    /// The text of `ids`; an id outside the vocabulary (a model's output can
    /// be anything) reads as U+FFFD rather than failing a sample print-out.
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&id| {
                self.vocab
                    .get(id as usize)
                    .copied()
                    .unwrap_or(char::REPLACEMENT_CHARACTER)
            })
            .collect()
    }

    /// (train, test) token runs: the last `test_fraction` of the text is held
    /// out in one piece, so test windows are text the model never saw (a
    /// shuffled split would leak overlapping windows).
    pub fn split(&self, test_fraction: f64) -> Result<(Vec<u32>, Vec<u32>)> {
        let test_len = (self.tokens.len() as f64 * test_fraction).round() as usize;
        ensure!(
            test_fraction.is_finite() && test_len > 0 && test_len < self.tokens.len(),
            "test fraction {test_fraction} leaves an empty train or test part of {} tokens",
            self.tokens.len()
        );
        let (train, test) = self.tokens.split_at(self.tokens.len() - test_len);
        Ok((train.to_vec(), test.to_vec()))
    }
}

/// `rows` windows of `block_size` tokens, each with its next-token targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextBatch {
    /// Row-major `(rows, block_size)` token ids: the model's input.
    pub inputs: Vec<u32>,
    /// Row-major `(rows, block_size)`: `targets[r][t]` is the token after
    /// `inputs[r][t]` in the text.
    pub targets: Vec<u32>,
    /// Windows in the batch.
    pub rows: usize,
    /// Tokens per window (the model's sequence length `T`).
    pub block_size: usize,
}

impl TextBatch {
    /// Inputs and targets as `(rows, block_size)` u32 tensors on `device`:
    /// the shapes [`crate::models::gpt()`] and [`crate::models::lm_loss`] take.
    pub fn tensors(&self, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
        let shape = (self.rows, self.block_size);
        Ok((
            Tensor::from_slice(&self.inputs, shape, device)?,
            Tensor::from_slice(&self.targets, shape, device)?,
        ))
    }

    /// The batch cut into `m` equal micro-batches of consecutive rows, in
    /// order, as a pipeline schedule feeds them; `m` must divide the rows so
    /// every micro-batch weighs the same in the averaged gradient.
    pub fn micro_batches(&self, m: usize) -> Result<Vec<TextBatch>> {
        ensure!(
            m > 0 && self.rows.is_multiple_of(m),
            "{} rows do not divide into {m} equal micro-batches",
            self.rows
        );
        let rows = self.rows / m;
        let len = rows * self.block_size;
        Ok((0..m)
            .map(|i| TextBatch {
                inputs: self.inputs[i * len..(i + 1) * len].to_vec(),
                targets: self.targets[i * len..(i + 1) * len].to_vec(),
                rows,
                block_size: self.block_size,
            })
            .collect())
    }
}

/// Deterministic, rank-sharded batches of random windows over a token run.
#[derive(Debug, Clone)]
pub struct TextBatches {
    tokens: Arc<[u32]>,
    block_size: usize,
    global_batch: usize,
    rank: usize,
    world_size: usize,
    seed: u64,
}

impl TextBatches {
    /// Batches for `rank` of `world_size` over `tokens`; `global_batch` must
    /// divide by the world size, and the run must hold one window of
    /// `block_size + 1` tokens.
    pub fn new(
        tokens: Arc<[u32]>,
        block_size: usize,
        global_batch: usize,
        rank: usize,
        world_size: usize,
        seed: u64,
    ) -> Result<Self> {
        super::check_rank_batch(global_batch, rank, world_size)?;
        ensure!(block_size > 0, "a window needs at least one input token");
        ensure!(
            tokens.len() > block_size,
            "{} tokens cannot hold a window of {} (block size {block_size} plus its last target)",
            tokens.len(),
            block_size + 1
        );
        Ok(Self {
            tokens,
            block_size,
            global_batch,
            rank,
            world_size,
            seed,
        })
    }

    /// Windows this rank reads per step.
    pub fn local_batch(&self) -> usize {
        self.global_batch / self.world_size
    }

    /// This rank's rows of global batch `step`.
    pub fn batch(&self, step: usize) -> TextBatch {
        // Every rank draws the whole global batch's offsets so its rows are
        // the same ones a single process would read.
        let mut rng = SplitMix64::for_stream(self.seed, "text-windows", step as u64);
        let starts_available = self.tokens.len() - self.block_size;
        let starts: Vec<usize> = (0..self.global_batch).map(|_| rng.below(starts_available)).collect();
        let local = self.local_batch();
        let mine = &starts[self.rank * local..(self.rank + 1) * local];
        let mut inputs = Vec::with_capacity(local * self.block_size);
        let mut targets = Vec::with_capacity(local * self.block_size);
        for &start in mine {
            inputs.extend_from_slice(&self.tokens[start..start + self.block_size]);
            targets.extend_from_slice(&self.tokens[start + 1..start + self.block_size + 1]);
        }
        TextBatch {
            inputs,
            targets,
            rows: local,
            block_size: self.block_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batches(tokens: &Arc<[u32]>, rank: usize, world: usize, seed: u64) -> anyhow::Result<TextBatches> {
        TextBatches::new(tokens.clone(), 6, 8, rank, world, seed)
    }

    #[test]
    fn shipped_text_round_trips() -> anyhow::Result<()> {
        let corpus = TextCorpus::around_the_world()?;
        assert_eq!(corpus.tokens.len(), 370_872);
        assert_eq!(corpus.vocab.len(), 78);
        assert!(corpus.vocab.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(corpus.decode(&corpus.tokens), AROUND_THE_WORLD);
        assert!(
            !AROUND_THE_WORLD.contains("Gutenberg"),
            "the PG header and footer are removed"
        );
        Ok(())
    }

    #[test]
    fn unknown_character_is_named() -> anyhow::Result<()> {
        let corpus = TextCorpus::from_text("abca")?;
        assert_eq!(corpus.tokens, [0, 1, 2, 0]);
        let err = corpus.encode("abz").err().context("z is not in the vocabulary")?;
        assert!(format!("{err}").contains("'z'"), "{err}");
        assert_eq!(corpus.decode(&[2, 9]), "c\u{FFFD}");
        Ok(())
    }

    #[test]
    fn split_holds_out_the_end() -> anyhow::Result<()> {
        let corpus = TextCorpus::from_text("abcdefghij")?;
        let (train, test) = corpus.split(0.2)?;
        assert_eq!(corpus.decode(&train), "abcdefgh");
        assert_eq!(corpus.decode(&test), "ij");
        assert!(corpus.split(0.0).is_err());
        assert!(corpus.split(1.0).is_err());
        Ok(())
    }

    #[test]
    fn rank_batches_concatenate_to_the_global_batch() -> anyhow::Result<()> {
        let tokens: Arc<[u32]> = (0..100).collect();
        let whole = batches(&tokens, 0, 1, 3)?;
        for step in [0, 1, 17] {
            let mut inputs = Vec::new();
            let mut targets = Vec::new();
            for rank in 0..4 {
                let b = batches(&tokens, rank, 4, 3)?.batch(step);
                assert_eq!((b.rows, b.inputs.len()), (2, 12));
                inputs.extend(b.inputs);
                targets.extend(b.targets);
            }
            let global = whole.batch(step);
            assert_eq!((inputs, targets), (global.inputs, global.targets));
        }
        assert_eq!(
            whole.batch(5),
            batches(&tokens, 0, 1, 3)?.batch(5),
            "same seed, same batch"
        );
        assert_ne!(whole.batch(5), whole.batch(6));
        assert_ne!(whole.batch(5), batches(&tokens, 0, 1, 4)?.batch(5));
        Ok(())
    }

    #[test]
    fn targets_are_the_next_tokens_and_windows_stay_inside() -> anyhow::Result<()> {
        // Eight tokens and windows of six inputs plus a target: only starts 0 and 1 fit.
        let tokens: Arc<[u32]> = (10..18).collect();
        let loader = TextBatches::new(tokens, 6, 8, 0, 1, 1)?;
        let mut starts = std::collections::BTreeSet::new();
        for step in 0..50 {
            let b = loader.batch(step);
            for (x, y) in b.inputs.chunks(6).zip(b.targets.chunks(6)) {
                assert!(x.iter().zip(y).all(|(&a, &b)| b == a + 1));
                assert!(y[5] <= 17);
                starts.insert(x[0]);
            }
        }
        assert_eq!(
            starts.into_iter().collect::<Vec<_>>(),
            [10, 11],
            "both starts, and only those"
        );
        assert!(TextBatches::new((0..6).collect(), 6, 1, 0, 1, 1).is_err());
        Ok(())
    }

    #[test]
    fn micro_batches_concatenate_to_the_batch() -> anyhow::Result<()> {
        let tokens: Arc<[u32]> = (0..100).collect();
        let batch = batches(&tokens, 0, 1, 2)?.batch(0);
        let micro = batch.micro_batches(4)?;
        assert_eq!(micro.len(), 4);
        assert!(micro.iter().all(|m| m.rows == 2));
        let inputs: Vec<u32> = micro.iter().flat_map(|m| m.inputs.clone()).collect();
        let targets: Vec<u32> = micro.iter().flat_map(|m| m.targets.clone()).collect();
        assert_eq!((inputs, targets), (batch.inputs.clone(), batch.targets.clone()));
        assert!(batch.micro_batches(3).is_err());
        assert!(batch.micro_batches(0).is_err());
        let (x, y) = micro[1].tensors(&Device::Cpu)?;
        assert_eq!((x.dims(), y.dims()), (&[2, 6][..], &[2, 6][..]));
        Ok(())
    }
}
