//! `flotilla generate`: a character-level GPT trained for a few steps continues a prompt, from
//! its model file and from its checkpoints, greedily or by seeded draws.

mod common;

use std::path::Path;

use common::flotilla;

const PROMPT: &str = "Phileas Fogg ";

/// A small GPT for a few steps, checkpointed at steps 3 and 6: seconds, not minutes.
const TINY_GPT: [&str; 9] = [
    "train.steps=6",
    "train.gpt.n_layer=1",
    "train.gpt.n_head=2",
    "train.gpt.n_embd=16",
    "train.gpt.block_size=16",
    "train.batch_size=8",
    "train.test_fraction=0.002",
    "fault_tolerance.checkpoint_every=3",
    "train.log_every=3",
];

/// Trains `examples/{example}` shrunk to [`TINY_GPT`] into `run_dir`.
fn train(example: &str, run_dir: &Path) {
    let config = format!("examples/{example}");
    let mut args = vec!["train", "--config", &config, "--run-dir", run_dir.to_str().unwrap()];
    for setting in TINY_GPT {
        args.extend(["--set", setting]);
    }
    let trained = flotilla(&args, &[], 120);
    assert!(trained.success, "{}", trained.stderr);
}

/// `generate`'s text with the model at `model` and the further flags `flags`.
fn generate(model: &Path, flags: &[&str]) -> String {
    let mut args = vec!["generate", "--model", model.to_str().unwrap(), "--prompt", PROMPT];
    args.extend(flags);
    let generated = flotilla(&args, &[], 60);
    assert!(generated.success, "{}", generated.stderr);
    generated.stdout
}

/// The prompt, then `tokens` characters of the shipped text's vocabulary, then a newline.
fn assert_continues(text: &str, tokens: usize) {
    let vocabulary = include_str!("../data/text/around_the_world_in_80_days.txt");
    let continuation = text
        .strip_prefix(PROMPT)
        .and_then(|rest| rest.strip_suffix('\n'))
        .unwrap_or_else(|| panic!("{text:?} does not continue {PROMPT:?} on one line"));
    assert_eq!(continuation.chars().count(), tokens, "{text:?}");
    assert!(continuation.chars().all(|c| vocabulary.contains(c)), "{text:?}");
}

#[test]
fn a_trained_gpt_continues_a_prompt_greedily_and_by_seeded_draws() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    train("gpt.toml", &run_dir);
    let params = run_dir.join("params.safetensors");
    let greedy = generate(&params, &["--tokens", "30"]);
    assert_continues(&greedy, 30);
    assert_eq!(generate(&params, &["--tokens", "30", "--temperature", "0"]), greedy);
    let drawn = ["--tokens", "30", "--temperature", "1", "--seed", "7"];
    let sampled = generate(&params, &drawn);
    assert_continues(&sampled, 30);
    assert_eq!(generate(&params, &drawn), sampled);
    let other_seed = generate(&params, &["--tokens", "30", "--temperature", "1", "--seed", "8"]);
    assert_continues(&other_seed, 30);
    let top_two = generate(&params, &["--tokens", "30", "--temperature", "1", "--top-k", "2"]);
    assert_continues(&top_two, 30);
    // The last checkpoint holds the parameters the model file does.
    let checkpoints = run_dir.join("checkpoints");
    assert_eq!(generate(&checkpoints, &drawn), sampled);
    let step = checkpoints.join("step-00000003");
    assert_continues(&generate(&step, &drawn), 30);

    let refused = flotilla(
        &[
            "generate",
            "--model",
            params.to_str().unwrap(),
            "--prompt",
            "Fogg’s café",
            "--tokens",
            "5",
        ],
        &[],
        60,
    );
    assert!(!refused.success && refused.stdout.is_empty(), "{}", refused.stdout);
    assert!(
        refused.stderr.contains("the prompt: characters not in the vocabulary")
            && refused.stderr.contains("'’' (first at 4)")
            && refused.stderr.contains("'é' (first at 10)"),
        "{}",
        refused.stderr
    );
}

/// A pipeline's checkpoint holds a file per stage: generate reads them as one model, and
/// `predict` sends a GPT's model file to `generate`.
#[test]
fn a_pipeline_checkpoint_generates_and_predict_points_a_gpt_to_generate() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    train("gpt_pipeline.toml", &run_dir);
    let params = run_dir.join("params.safetensors");
    let drawn = ["--tokens", "20", "--temperature", "0.8", "--top-k", "5", "--seed", "3"];
    let from_file = generate(&params, &drawn);
    assert_continues(&from_file, 20);
    let step = run_dir.join("checkpoints/step-00000006");
    assert_eq!(generate(&step, &drawn), from_file);

    let table = dir.path().join("rows.csv");
    std::fs::write(&table, "a,b\n1,2\n").unwrap();
    let out = dir.path().join("predictions.csv");
    let predicted = flotilla(
        &[
            "predict",
            "--model",
            params.to_str().unwrap(),
            "--data",
            table.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
        60,
    );
    assert!(
        !predicted.success && predicted.stderr.contains("flotilla generate --model"),
        "{}",
        predicted.stderr
    );
}
