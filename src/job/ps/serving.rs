//! A trained CTR model out of a parameter-server run: `flotilla ps export` writes the shards'
//! final tables and dense parameters in the export format (`ps/export_format.rs`), as a base or
//! as a delta of the rows changed since an earlier export; `flotilla predict` scores click logs
//! with an export, through the same planning and forward pass as the job's own evaluation, so
//! it reproduces the job's AUC exactly.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};
use serde::Serialize;

use super::build_shard;
use crate::config::{JobConfig, Strategy};
use crate::data::ctr::{ClickLogParser, CtrLoader, CtrSource, DataLayout};
use crate::job::outputs::CONFIG_FILE;
use crate::metrics::auc;
use crate::models::{ParamInit, SparseModelDef};
use crate::ps::dense::dense_range;
use crate::ps::export_format::{
    deleted_file, rows_bytes, rows_file, ExportDir, ExportKind, ExportManifest, ExportedTable, CONFIG, DENSE,
    EXPORT_FORMAT, MANIFEST,
};
use crate::ps::snapshot::shard_file_name;
use crate::ps::wire::PulledRows;
use crate::ps::worker::{CtrWorker, PullPlan};

/// A CTR model held whole in one process: what an export holds.
pub struct ServingModel {
    /// The job's configuration.
    pub config: JobConfig,
    /// The model: its tables and dense part.
    pub model: SparseModelDef,
    /// Every dense parameter, in the model's order.
    pub dense: Vec<f32>,
    /// Each table's rows by id.
    pub tables: Vec<BTreeMap<u64, Vec<f32>>>,
}

impl ServingModel {
    /// The model a parameter-server run in `run_dir` ended with: its `config.toml` and every
    /// shard's saved tables. `model` is the run's own model; `None`: the built-in one the
    /// configuration names.
    pub fn from_run(run_dir: &Path, model: Option<&SparseModelDef>) -> Result<Self> {
        let config_path = run_dir.join(CONFIG_FILE);
        let mut config = JobConfig::from_file(&config_path, &|_| None, &[])
            .with_context(|| format!("{} is not a run directory's configuration", config_path.display()))?;
        // The run's own tables replace whatever it started from.
        config.train.init_tables_from = None;
        ensure!(
            config.resolved_strategy() == Strategy::ParameterServer,
            "{} is not a parameter-server run",
            run_dir.display()
        );
        let mut model = Self::empty(config, model)?;
        for index in 0..model.config.cluster.server_num {
            let mut shard = build_shard(&model.config, &model.model, index)?;
            let path = run_dir.join(shard_file_name(index));
            shard
                .load(&path)
                .with_context(|| format!("parameter server {index}'s tables"))?;
            model.dense.extend_from_slice(shard.dense().values());
            for (rows, table) in model.tables.iter_mut().zip(shard.tables()) {
                rows.extend(table.rows().map(|(id, value, _)| (id, value.to_vec())));
            }
        }
        Ok(model)
    }

    /// No rows and no dense values yet of `model` (`None`: the built-in one `config` names).
    fn empty(config: JobConfig, model: Option<&SparseModelDef>) -> Result<Self> {
        let model = match model {
            Some(model) => model.clone(),
            None => SparseModelDef::builtin(&config.train)?,
        };
        Ok(Self {
            dense: Vec::new(),
            tables: vec![BTreeMap::new(); model.tables().len()],
            config,
            model,
        })
    }

    /// The model an export in `dir` holds: a base, or a delta applied to its base. `model` is
    /// the exported model; `None`: the built-in one the export's configuration names.
    pub fn from_export(dir: &Path, model: Option<&SparseModelDef>) -> Result<Self> {
        let export = ExportDir::open(dir)?;
        // A delta's model is its base's: the base's configuration describes it.
        let mut model = match (export.manifest.kind, &export.manifest.base) {
            (ExportKind::Base, _) => {
                let config_text = String::from_utf8(export.read(CONFIG)?).context("the configuration is not UTF-8")?;
                let config = JobConfig::from_toml_str(&config_text, CONFIG, &|_| None, &[])?;
                Self::empty(config, model)?
            }
            (ExportKind::Delta, Some(base)) => {
                Self::from_export(base, model).with_context(|| format!("the base of the delta {}", dir.display()))?
            }
            (ExportKind::Delta, None) => bail!("{}: a delta that names no base", dir.display()),
        };
        model.dense = read_dense(&export, &model)?;
        let def = model.model.clone();
        let layout = def.tables();
        ensure!(
            export.manifest.tables.len() == layout.len(),
            "{}: {} tables, the model has {}",
            dir.display(),
            export.manifest.tables.len(),
            layout.len()
        );
        for ((rows, spec), table) in model.tables.iter_mut().zip(layout).zip(&export.manifest.tables) {
            ensure!(
                table.name == spec.name && table.width == spec.width,
                "{}: table {} of width {}, the model's is {} of width {}",
                dir.display(),
                table.name,
                table.width,
                spec.name,
                spec.width
            );
            let (width, written) = export.rows(&rows_file(&spec.name))?;
            ensure!(width == spec.width, "{}: rows of width {width}", rows_file(&spec.name));
            rows.extend(written);
            if export.manifest.kind == ExportKind::Delta {
                for (id, _) in export.rows(&deleted_file(&spec.name))?.1 {
                    rows.remove(&id);
                }
            }
        }
        Ok(model)
    }

    /// The answers of the shards to `plan`, as the job's shards would give them for an
    /// evaluation: rows not held read as zeros.
    pub fn pull(&self, plan: &PullPlan) -> Vec<PulledRows> {
        let servers = self.config.cluster.server_num;
        let layout = self.model.tables();
        plan.ids
            .iter()
            .enumerate()
            .map(|(shard, tables)| {
                let rows = tables
                    .iter()
                    .zip(&self.tables)
                    .zip(layout)
                    .map(|((ids, rows), spec)| {
                        let mut out = Vec::with_capacity(ids.len() * spec.width);
                        for id in ids {
                            match rows.get(id) {
                                Some(row) => out.extend_from_slice(row),
                                None => out.resize(out.len() + spec.width, 0.0),
                            }
                        }
                        out
                    })
                    .collect();
                let dense = match plan.dense {
                    true => self.dense[dense_range(self.dense.len(), shard, servers)].to_vec(),
                    false => Vec::new(),
                };
                PulledRows {
                    rows,
                    dense,
                    stop: false,
                }
            })
            .collect()
    }
}

/// The dense parameters of `export`, in the model's order, checked against its names and shapes.
fn read_dense(export: &ExportDir, model: &ServingModel) -> Result<Vec<f32>> {
    let bytes = export.read(DENSE)?;
    let file = safetensors::SafeTensors::deserialize(&bytes).context("dense.safetensors is not safetensors")?;
    let mut dense = Vec::new();
    for (name, shape) in dense_layout(model)? {
        let view = file
            .tensor(&name)
            .with_context(|| format!("dense.safetensors has no {name}"))?;
        ensure!(
            view.shape() == shape.as_slice() && view.dtype() == safetensors::Dtype::F32,
            "dense.safetensors: {name} is {:?} {:?}, the model's is F32 {shape:?}",
            view.dtype(),
            view.shape()
        );
        dense.extend(
            view.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
    }
    Ok(dense)
}

/// The model's dense parameters: names and shapes, in the order shards slice them.
fn dense_layout(model: &ServingModel) -> Result<Vec<(String, Vec<usize>)>> {
    let built = model
        .model
        .build(&ParamInit::new(model.config.train.seed, Device::Cpu))?;
    Ok(built
        .parameters()
        .into_iter()
        .map(|(name, var)| (name, var.dims().to_vec()))
        .collect())
}

/// Writes the model of the run in `run_dir` to `out` (which must not hold an export yet): every
/// row, or with `since` (an earlier export of the same model) the rows new or changed since it
/// and the ids it holds that are gone. `model` is the run's own model; `None`: the built-in one
/// its configuration names.
pub fn export(
    run_dir: &Path,
    out: &Path,
    since: Option<&Path>,
    model: Option<&SparseModelDef>,
) -> Result<ExportManifest> {
    ensure!(
        !out.join(MANIFEST).exists(),
        "{} already holds an export; choose another --out",
        out.display()
    );
    let base = since.map(|dir| ServingModel::from_export(dir, model)).transpose()?;
    let model = ServingModel::from_run(run_dir, model)?;
    fs::create_dir_all(out.join("sparse")).with_context(|| format!("cannot create {}", out.display()))?;
    let mut files = BTreeMap::new();
    let mut write = |name: String, bytes: Vec<u8>| -> Result<()> {
        let path = out.join(&name);
        fs::write(&path, &bytes).with_context(|| format!("cannot write {}", path.display()))?;
        files.insert(name, crc32c::crc32c(&bytes));
        Ok(())
    };
    let config_text = fs::read(run_dir.join(CONFIG_FILE)).context("the run's configuration")?;
    write(CONFIG.to_owned(), config_text)?;
    write(DENSE.to_owned(), dense_bytes(&model)?)?;
    let mut tables = Vec::new();
    for (t, spec) in model.model.tables().iter().enumerate() {
        let rows = &model.tables[t];
        let (changed, deleted): (Vec<(u64, &[f32])>, Vec<u64>) = match &base {
            None => (rows.iter().map(|(id, v)| (*id, v.as_slice())).collect(), Vec::new()),
            Some(base) => {
                let before = &base.tables[t];
                let changed = rows
                    .iter()
                    .filter(|(id, v)| before.get(id) != Some(v))
                    .map(|(id, v)| (*id, v.as_slice()))
                    .collect();
                let deleted = before.keys().filter(|id| !rows.contains_key(id)).copied().collect();
                (changed, deleted)
            }
        };
        write(rows_file(&spec.name), rows_bytes(spec.width, changed.iter().copied())?)?;
        if base.is_some() {
            write(
                deleted_file(&spec.name),
                rows_bytes(0, deleted.iter().map(|&id| (id, &[][..])))?,
            )?;
        }
        tables.push(ExportedTable {
            name: spec.name.clone(),
            width: spec.width,
            rows: changed.len() as u64,
            deleted: deleted.len() as u64,
        });
    }
    let manifest = ExportManifest {
        format: EXPORT_FORMAT.to_owned(),
        kind: match base {
            Some(_) => ExportKind::Delta,
            None => ExportKind::Base,
        },
        base: since.map(|dir| fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned())),
        tables,
        files,
    };
    // Written last: an export without its manifest is visibly unfinished.
    let path = out.join(MANIFEST);
    fs::write(&path, serde_json::to_vec_pretty(&manifest)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(manifest)
}

/// The dense parameters as safetensors, by the model's names.
fn dense_bytes(model: &ServingModel) -> Result<Vec<u8>> {
    let mut tensors = HashMap::new();
    let mut offset = 0;
    for (name, shape) in dense_layout(model)? {
        let len: usize = shape.iter().product();
        let values = model.dense.get(offset..offset + len).with_context(|| {
            format!(
                "the shards hold {} dense values, fewer than the model",
                model.dense.len()
            )
        })?;
        tensors.insert(name, Tensor::from_slice(values, shape, &Device::Cpu)?);
        offset += len;
    }
    ensure!(
        offset == model.dense.len(),
        "the shards hold {} dense values, the model {offset}",
        model.dense.len()
    );
    Ok(safetensors::serialize(
        tensors.iter().map(|(name, tensor)| (name.clone(), tensor)),
        None,
    )?)
}

/// What `flotilla predict` did.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Prediction {
    /// Records scored.
    pub samples: usize,
    /// AUC of the scores against the records' labels (`None` if they are all one label).
    pub auc: Option<f64>,
}

/// Scores the records of `data` with the export in `model_dir`, writing `label \t click
/// probability` per record to `out`: click logs in the columns the job trained on (its
/// configuration, in the export, says them: Criteo TSV, or `[train.click_log]`'s). `model` is
/// the exported model; `None`: the built-in one the export's configuration names.
pub fn predict(model_dir: &Path, data: &[PathBuf], out: &Path, model: Option<&SparseModelDef>) -> Result<Prediction> {
    let model = ServingModel::from_export(model_dir, model)?;
    let mut worker = CtrWorker::new(&model.config, &model.model, Device::Cpu)?;
    let schema = (model.config.train.click_log_schema())
        .context("the export's job read no click logs: its configuration names no columns")?;
    let mut loader = CtrLoader::new(
        CtrSource::Files {
            files: data.to_vec(),
            parser: Arc::new(ClickLogParser::new(schema)),
        },
        DataLayout::WHOLE,
        model.config.train.batch_size,
        0,
        1,
    )?;
    let file = fs::File::create(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut lines = BufWriter::new(file);
    let (mut scores, mut labels) = (Vec::new(), Vec::new());
    while let Some(batch) = loader.next_eval_batch()? {
        let batch_labels = batch.labels.clone();
        let plan = worker.plan(batch, false)?;
        let batch_scores = worker.predict(model.pull(&plan))?;
        for (label, score) in batch_labels.iter().zip(&batch_scores) {
            writeln!(lines, "{label}\t{score}").with_context(|| format!("cannot write {}", out.display()))?;
        }
        labels.extend(batch_labels);
        scores.extend(batch_scores);
    }
    lines
        .flush()
        .with_context(|| format!("cannot write {}", out.display()))?;
    Ok(Prediction {
        samples: scores.len(),
        auc: auc(&scores, &labels),
    })
}
