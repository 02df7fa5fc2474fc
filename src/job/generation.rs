//! `flotilla generate`: a trained character-level GPT continues a prompt. The model comes from a
//! model file or a checkpoint of any layout, read as `eval` reads them ([`Weights`]); the
//! characters its tokens stand for from the file's `vocab` entry.

use std::io::{ErrorKind, Write};
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::Device;

use super::serving::Weights;
use crate::data::text::TextCorpus;
use crate::models::export::ModelFile;
use crate::models::{continue_text, GptConfig, ModelSpec, Sampler};

/// The flags of `flotilla generate`.
#[derive(Debug, Clone, clap::Args)]
pub struct GenerateArgs {
    /// A GPT's model file (a run's `params.safetensors`), or a checkpoint of any layout: a step
    /// directory (`step-NNNNNNNN`), or a checkpoint directory (its newest complete checkpoint).
    #[arg(long)]
    pub model: PathBuf,
    /// The text to continue; every character must be in the model's vocabulary. Only its last
    /// `block_size` characters are read.
    #[arg(long)]
    pub prompt: String,
    /// Characters to write after the prompt.
    #[arg(long)]
    pub tokens: usize,
    /// 0: always the most likely character (greedy); above 0, characters are drawn from the
    /// softmax of the logits divided by it (1: the model's own distribution; higher: more
    /// varied).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Draw only among the K most likely characters (default: all of them).
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// The seed of the draws: the same seed, model and prompt write the same text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Writes `args.prompt` and its continuation by `args.tokens` characters of the GPT in
/// `args.model` to `out`, each character as it comes, then a newline. A reader that goes away
/// (`| head`) ends generation early without an error: nobody is left to read the rest.
pub fn generate(args: &GenerateArgs, out: &mut dyn Write) -> Result<()> {
    let mut sampler = Sampler::new(args.temperature, args.top_k, args.seed)?;
    let (bytes, name, _) = Weights::at(&args.model).read()?;
    let file = ModelFile::parse(&bytes).with_context(|| name.clone())?;
    let (config, vocab) = gpt_of(&file).with_context(|| name.clone())?;
    let prompt = vocab.encode(&args.prompt).context("the prompt")?;
    let device = Device::Cpu;
    let model = file.model(&device).with_context(|| name.clone())?;
    tracing::info!(
        model = %name,
        prompt_chars = prompt.len(),
        tokens = args.tokens,
        temperature = args.temperature,
        top_k = args.top_k,
        seed = args.seed,
        "generating"
    );
    if write_now(out, &args.prompt)?.is_break() {
        return Ok(());
    }
    let ended = continue_text(
        &model,
        config.block_size,
        &device,
        &prompt,
        args.tokens,
        &mut sampler,
        |token| write_now(out, &vocab.decode(&[token])),
    )?;
    if ended.is_continue() {
        // The text ends the line; a reader gone by now has all it asked for.
        let _ = write_now(out, "\n")?;
    }
    Ok(())
}

/// The shape of the GPT `file` holds and the characters its tokens stand for.
fn gpt_of(file: &ModelFile) -> Result<(GptConfig, TextCorpus)> {
    let config = match &file.info.spec {
        Some(ModelSpec::Gpt(config)) => *config,
        Some(ModelSpec::Mlp { .. }) => bail!("it holds an MLP, not a GPT: predict scores tables with it"),
        None => bail!("it holds a model of a program's own, not a built-in GPT"),
    };
    let json = file
        .info
        .extra
        .get("vocab")
        .context("it records no `vocab`: the characters its tokens stand for are unknown")?;
    let vocab: String = serde_json::from_str(json).context("its `vocab` entry")?;
    let corpus = TextCorpus::of_vocab(&vocab).context("its `vocab` entry")?;
    anyhow::ensure!(
        corpus.vocab.len() == config.vocab,
        "its `vocab` has {} characters, its model {} tokens",
        corpus.vocab.len(),
        config.vocab
    );
    Ok((config, corpus))
}

/// Writes `text` to `out` at once; `Break` when the reader has gone away.
fn write_now(out: &mut dyn Write, text: &str) -> Result<ControlFlow<()>> {
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(ControlFlow::Continue(())),
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Ok(ControlFlow::Break(())),
        Err(e) => Err(e).context("writing the text"),
    }
}
