//! A trained dense model put to use: `flotilla eval` scores a job's held-out split with a
//! model file or a checkpoint of a run, as the job's own final evaluation does; `flotilla
//! predict` writes a model file's outputs for the rows of CSV or Parquet tables (`flotilla
//! generate`, [`super::generation`], continues text with a GPT's).

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use candle_core::{Device, Tensor};
use serde::Serialize;

use super::TrainingJob;
use crate::actors::recovery::whole_model;
use crate::checkpoint::{write_atomically, Checkpoint, CheckpointStore, MANIFEST};
use crate::collective::score_pieces;
use crate::config::JobConfig;
use crate::data::table::{feature_pieces, FeaturePieces};
use crate::models::export::ModelFile;
use crate::models::{argmax, Model, ModelSpec, ParamInit};

/// Rows per forward pass of `predict`.
const PREDICT_ROWS: usize = 256;

/// Where a model's trained parameters are read from.
#[derive(Debug, Clone)]
pub enum Weights {
    /// A model file (`params.safetensors`).
    ModelFile(PathBuf),
    /// A checkpoint of any layout: a step directory, or a checkpoint directory's newest complete
    /// checkpoint.
    Checkpoint(PathBuf),
}

impl Weights {
    /// The weights at `path`: a file is a model file, a directory a checkpoint.
    pub fn at(path: &Path) -> Self {
        match path.is_dir() {
            true => Self::Checkpoint(path.to_path_buf()),
            false => Self::ModelFile(path.to_path_buf()),
        }
    }

    /// The model file's bytes (a checkpoint's stages merged into one whole model), what they
    /// are called in errors, and the checkpoint's step when from one.
    pub(crate) fn read(&self) -> Result<(Vec<u8>, String, Option<usize>)> {
        match self {
            Self::ModelFile(path) => {
                let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
                Ok((bytes, path.display().to_string(), None))
            }
            Self::Checkpoint(dir) => {
                let checkpoint = checkpoint_in(dir)?;
                let state = whole_model(&checkpoint)?;
                Ok((
                    state,
                    format!("checkpoint {}", checkpoint.dir.display()),
                    Some(checkpoint.step),
                ))
            }
        }
    }
}

/// The checkpoint `dir` names: a step directory (one holding a manifest) itself, else the
/// newest complete checkpoint of the checkpoint directory `dir`.
fn checkpoint_in(dir: &Path) -> Result<Checkpoint> {
    if !dir.join(MANIFEST).exists() {
        return CheckpointStore::new(dir, 1)
            .latest()?
            .with_context(|| format!("{} holds no complete checkpoint", dir.display()));
    }
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    let step: usize = name
        .rsplit('-')
        .next()
        .and_then(|digits| digits.parse().ok())
        .with_context(|| format!("{}: a step directory's name ends in its step", dir.display()))?;
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let checkpoint = CheckpointStore::new(parent, 1).verify(step)?;
    ensure!(
        checkpoint.dir.file_name() == dir.file_name(),
        "{} is not a step directory of its checkpoint directory (step {step}'s is {})",
        dir.display(),
        checkpoint.dir.display()
    );
    Ok(checkpoint)
}

/// What `flotilla eval` prints.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Evaluation {
    /// Classification: accuracy on the held-out split.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_accuracy: Option<f64>,
    /// Regression: mean squared error on the held-out split.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_mse: Option<f64>,
    /// The mean training loss on the held-out split.
    pub test_loss: f64,
    /// Held-out predictions scored.
    pub test_samples: usize,
    /// The checkpoint's step, when the parameters came from one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<usize>,
}

/// Scores the held-out split of `config`'s data set with the model `config` describes,
/// holding the parameters of `weights`, [`JobConfig::eval_batch_rows`] rows at a time.
pub fn evaluate(config: JobConfig, weights: &Weights) -> Result<Evaluation> {
    let job = TrainingJob::builtin(config)?;
    let device = Device::Cpu;
    let model = (job.model)(&ParamInit::new(job.config.train.seed, device.clone()))?;
    let step = load(&model, weights)?;
    let loss = job.config.train.resolved_loss()?;
    // A piece of the held-out set at a time, never the whole set at once.
    let pieces = job.test_data.share(0, 1, job.config.eval_batch_rows())?;
    let score = score_pieces(&model, pieces, loss, &device)?;
    let held_out = score.held_out(loss);
    Ok(Evaluation {
        test_accuracy: held_out.accuracy,
        test_mse: held_out.mse,
        test_loss: held_out.loss,
        test_samples: held_out.samples,
        step,
    })
}

/// Sets `model`'s parameters from `weights`; answers the checkpoint's step when from one.
fn load(model: &Model, weights: &Weights) -> Result<Option<usize>> {
    let (bytes, name, step) = weights.read()?;
    ModelFile::parse(&bytes)
        .and_then(|file| file.load_into(model))
        .with_context(|| name)?;
    Ok(step)
}

/// What `flotilla predict` prints of a dense model's predictions.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Predictions {
    /// Rows predicted.
    pub rows: usize,
    /// Outputs per row: classes' logits, or values.
    pub outputs: usize,
}

/// Writes the predictions of the model in `model_file` for every row of the CSV `data` to
/// `out`, a CSV table: per row the predicted class and every class's logit
/// (`class,logit_0,…`), or the predicted values (`prediction`, or `prediction_0,…`). The model
/// reads the feature columns it was trained on (the file's `feature_columns`; every column of
/// the tables for a model of other data). `out` appears whole or not at all.
pub fn predict(model_file: &Path, data: &[String], out: &Path) -> Result<Predictions> {
    let bytes = std::fs::read(model_file).with_context(|| format!("reading {}", model_file.display()))?;
    let file = ModelFile::parse(&bytes).with_context(|| model_file.display().to_string())?;
    ensure!(
        !matches!(file.info.spec, Some(ModelSpec::Gpt(_))),
        "{} holds a GPT, a language model of characters: predict reads tables of features; continue \
         text with it: flotilla generate --model {} --prompt TEXT --tokens N",
        model_file.display(),
        model_file.display()
    );
    let model = file
        .model(&Device::Cpu)
        .with_context(|| model_file.display().to_string())?;
    let columns: Option<Vec<String>> = file
        .info
        .extra
        .get("feature_columns")
        .map(|json| serde_json::from_str(json).context("the model file's feature_columns"))
        .transpose()?;
    let regression = matches!(file.info.loss.as_deref(), Some("mse" | "mae"));
    let inputs = match &file.info.spec {
        Some(ModelSpec::Mlp { inputs, .. }) => Some(*inputs),
        _ => None,
    };
    let dir = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = out
        .file_name()
        .with_context(|| format!("{} names no file", out.display()))?
        .to_string_lossy();
    // Each file is read a piece at a time and its predictions written as they come, so the
    // tables may be larger than memory.
    let sources = open_tables(data, columns.as_deref(), inputs)?;
    let (mut rows, mut width) = (0, 0);
    write_atomically(dir, &name, |handle| {
        let mut table = csv::Writer::from_writer(std::io::BufWriter::new(handle));
        for (dim, pieces) in sources {
            for piece in pieces {
                let piece = piece?;
                let (first, count) = (rows, piece.len() / dim);
                let x = Tensor::from_vec(piece, (count, dim), &Device::Cpu)?;
                let y = model
                    .forward(&x)
                    .with_context(|| format!("running the model on rows {first}..{}", first + count))?;
                for row in y.to_vec2::<f32>()? {
                    if rows == 0 {
                        width = row.len();
                        table.write_record(header(regression, width))?;
                    }
                    let mut record: Vec<String> = Vec::with_capacity(width + 1);
                    if !regression {
                        record.push(argmax(&row).to_string());
                    }
                    record.extend(row.iter().map(f32::to_string));
                    table.write_record(&record)?;
                    rows += 1;
                }
            }
        }
        ensure!(rows > 0, "the data holds no rows");
        table.flush()?;
        Ok(())
    })?;
    Ok(Predictions { rows, outputs: width })
}

/// Every table of `data` opened (its `columns`, or all) and its width checked against the
/// model's `inputs` first, so that a missing or mismatched file is refused before the
/// predictions file is begun: each table's width and pieces.
fn open_tables(
    data: &[String],
    columns: Option<&[String]>,
    inputs: Option<usize>,
) -> Result<Vec<(usize, FeaturePieces)>> {
    data.iter()
        .map(|file| {
            let (dim, pieces) = feature_pieces(file, columns, PREDICT_ROWS)?;
            if let Some(inputs) = inputs {
                ensure!(
                    inputs == dim,
                    "{file}: the model reads {inputs} features a row, the data has {dim} columns (give the columns \
                     it was trained on)"
                );
            }
            Ok((dim, pieces))
        })
        .collect()
}

/// The columns of a predictions table.
fn header(regression: bool, width: usize) -> Vec<String> {
    match (regression, width) {
        (true, 1) => vec!["prediction".to_string()],
        (true, _) => (0..width).map(|i| format!("prediction_{i}")).collect(),
        (false, _) => std::iter::once("class".to_string())
            .chain((0..width).map(|i| format!("logit_{i}")))
            .collect(),
    }
}
