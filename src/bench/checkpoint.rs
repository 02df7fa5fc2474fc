//! `flotilla bench checkpoint`: how fast a checkpoint is saved and restored, against the disk's
//! own sequential write speed measured by `dd` in the same run. A save is what a rank does at a
//! checkpoint: a training state (parameters and two optimizer slots, as AdamW keeps) encoded
//! as safetensors, written to a temporary file, synced, renamed, and the manifest committed. A
//! restore is what a resuming job does: find the newest checkpoint, check every file against
//! its checksum, read and decode it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use candle_core::{Device, Tensor};
use serde::Serialize;

use crate::checkpoint::{decode_tensors, write_tensors, CheckpointStore};

/// Arguments of `flotilla bench checkpoint`.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckpointBenchArgs {
    /// Size of the training state in MiB (parameters plus two optimizer slots).
    #[arg(long = "size-mb", default_value_t = 512)]
    pub size_mb: usize,
    /// Directory to write in (on the disk to measure); it is removed afterwards.
    #[arg(long, default_value = "checkpoint-bench")]
    pub dir: PathBuf,
    /// Saves and restores measured; the best of each is reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// One JSON object instead of lines of text.
    #[arg(long)]
    pub json: bool,
}

/// The figures of one run, in GB/s (10⁹ bytes per second).
#[derive(Debug, Clone, Serialize)]
pub struct CheckpointFigures {
    /// Bytes of the checkpoint file.
    pub bytes: u64,
    /// Encode, write, sync, rename and commit.
    pub save_gb_s: f64,
    /// Find, verify every checksum, read and decode.
    pub restore_gb_s: f64,
    /// `dd if=/dev/zero bs=1M conv=fdatasync` of the same size, when `dd` is there.
    pub dd_write_gb_s: Option<f64>,
    /// `save_gb_s / dd_write_gb_s`.
    pub save_over_dd: Option<f64>,
}

/// Runs the benchmark and prints its figures.
pub fn run(args: &CheckpointBenchArgs) -> Result<()> {
    ensure!(
        args.size_mb >= 1 && args.repeat >= 1,
        "--size-mb and --repeat must be at least 1"
    );
    ensure!(
        !args.dir.exists(),
        "{} exists: give --dir a directory the benchmark may create and remove",
        args.dir.display()
    );
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let figures = measure(args);
    let _ = std::fs::remove_dir_all(&args.dir);
    let figures = figures?;
    if args.json {
        println!("{}", serde_json::to_string(&figures)?);
    } else {
        println!("checkpoint of {:.0} MB:", figures.bytes as f64 / 1e6);
        println!(
            "  save    {:.2} GB/s (encode, write, fsync, rename, manifest)",
            figures.save_gb_s
        );
        println!(
            "  restore {:.2} GB/s (find, verify checksums, read, decode)",
            figures.restore_gb_s
        );
        if let (Some(dd), Some(ratio)) = (figures.dd_write_gb_s, figures.save_over_dd) {
            println!("  dd      {dd:.2} GB/s sequential write with fdatasync; save / dd = {ratio:.2}");
        }
    }
    Ok(())
}

fn measure(args: &CheckpointBenchArgs) -> Result<CheckpointFigures> {
    let tensors = training_state(args.size_mb)?;
    let store = CheckpointStore::new(args.dir.join("checkpoints"), 1);
    let (mut save, mut restore, mut bytes) = (f64::INFINITY, f64::INFINITY, 0);
    for step in 1..=args.repeat {
        let started = Instant::now();
        let record = store.write_with(step, "state.safetensors", |out| {
            write_tensors(out, &tensors, HashMap::new())
        })?;
        bytes = record.bytes;
        store.commit(step, 1, vec![record])?;
        save = save.min(started.elapsed().as_secs_f64());

        let started = Instant::now();
        let checkpoint = store.latest()?.context("the checkpoint just committed")?;
        let (restored, _) = decode_tensors(&checkpoint.read("state.safetensors")?, &Device::Cpu)?;
        restore = restore.min(started.elapsed().as_secs_f64());
        ensure!(restored.len() == tensors.len(), "the restore lost tensors");
    }
    let dd = dd_write_seconds(&args.dir, args.size_mb)?;
    let gb_s = |seconds: f64| bytes as f64 / seconds / 1e9;
    Ok(CheckpointFigures {
        bytes,
        save_gb_s: gb_s(save),
        restore_gb_s: gb_s(restore),
        dd_write_gb_s: dd.map(|s| (args.size_mb << 20) as f64 / s / 1e9),
        save_over_dd: dd.map(|s| gb_s(save) / ((args.size_mb << 20) as f64 / s / 1e9)),
    })
}

/// Parameters and two optimizer slots of `size_mb` MiB in all, in 16 MiB tensors.
fn training_state(size_mb: usize) -> Result<Vec<(String, Tensor)>> {
    const TENSOR_MB: usize = 16;
    let floats_per_tensor = (TENSOR_MB << 20) / 4;
    let count = size_mb.div_ceil(TENSOR_MB);
    (0..count)
        .map(|i| {
            let slot = ["param", "m", "v"][i % 3];
            let values = Tensor::rand(-1f32, 1f32, floats_per_tensor, &Device::Cpu)?;
            Ok((format!("{slot}.{i}"), values))
        })
        .collect()
}

/// Seconds `dd` takes to write `size_mb` MiB to `dir` and sync them; `None` without `dd`.
fn dd_write_seconds(dir: &Path, size_mb: usize) -> Result<Option<f64>> {
    let target = dir.join("dd.bin");
    let started = Instant::now();
    let status = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", target.display()))
        .args(["bs=1M", &format!("count={size_mb}"), "conv=fdatasync", "status=none"])
        .status();
    let seconds = started.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&target);
    match status {
        Ok(s) if s.success() => Ok(Some(seconds)),
        Ok(s) => anyhow::bail!("dd failed ({s})"),
        Err(e) => {
            tracing::warn!("dd is not available ({e}); no disk baseline");
            Ok(None)
        }
    }
}
