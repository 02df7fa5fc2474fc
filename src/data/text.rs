//! A character-level text corpus.
//!
//! The shipped corpus is Jules Verne's *Around the World in 80 Days*
//! (`data/text/`, source and public-domain status in its README), compiled
//! into the binary so a language-model job runs anywhere; a job trains on
//! [`super::Dataset::token_windows`] of it.

use anyhow::{bail, ensure, Context, Result};

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

    /// The vocabulary `vocab` (token `i` is its `i`-th character), without a text: what a
    /// language model's file records. Its characters must be distinct and sorted, as a
    /// corpus's are.
    pub fn of_vocab(vocab: &str) -> Result<Self> {
        let vocab: Vec<char> = vocab.chars().collect();
        ensure!(!vocab.is_empty(), "an empty vocabulary");
        if let Some(pair) = vocab.windows(2).find(|pair| pair[0] >= pair[1]) {
            bail!(
                "the vocabulary's characters are not distinct and sorted: {:?} before {:?}",
                pair[0],
                pair[1]
            );
        }
        Ok(Self {
            vocab,
            tokens: Vec::new(),
        })
    }

    /// The ids of `s`; characters outside the vocabulary are an error naming
    /// every one of them, since silently dropping one would shift every later position.
    pub fn encode(&self, s: &str) -> Result<Vec<u32>> {
        let mut unknown: Vec<(usize, char)> = Vec::new();
        let mut ids = Vec::with_capacity(s.len());
        for (at, ch) in s.chars().enumerate() {
            match self.vocab.binary_search(&ch) {
                Ok(id) => ids.push(id as u32),
                Err(_) if unknown.iter().any(|&(_, seen)| seen == ch) => {}
                Err(_) => unknown.push((at, ch)),
            }
        }
        if !unknown.is_empty() {
            let named: Vec<String> = unknown
                .iter()
                .map(|(at, ch)| format!("{ch:?} (first at {at})"))
                .collect();
            bail!(
                "characters not in the vocabulary of {} characters: {}",
                self.vocab.len(),
                named.join(", ")
            );
        }
        Ok(ids)
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let err = corpus
            .encode("zbéza")
            .err()
            .context("z and é are not in the vocabulary")?;
        assert_eq!(
            err.to_string(),
            "characters not in the vocabulary of 3 characters: 'z' (first at 0), 'é' (first at 2)"
        );
        assert_eq!(corpus.decode(&[2, 9]), "c\u{FFFD}");
        Ok(())
    }

    #[test]
    fn a_vocabulary_alone_encodes_as_its_corpus_does() -> anyhow::Result<()> {
        let corpus = TextCorpus::from_text("the cat")?;
        let vocab: String = corpus.vocab.iter().collect();
        let alone = TextCorpus::of_vocab(&vocab)?;
        assert_eq!(alone.encode("a cat")?, corpus.encode("a cat")?);
        let err = TextCorpus::of_vocab("ba").err().context("unsorted")?;
        assert!(err.to_string().contains("'b' before 'a'"), "{err}");
        assert!(TextCorpus::of_vocab("").is_err());
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
}
