//! `flotilla checkpoint inspect DIR`: what a checkpoint holds — its step, the layout that wrote
//! it, every file's tensors (name, shape, elements) and, for a parameter-server shard, the rows
//! of each table — after checking every file against the manifest's sizes and checksums.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use super::{CheckpointStore, LAYER_PARTS, MANIFEST, SAFETENSORS, SHARDING_STAGE, STEP_PREFIX};

/// A safetensors file's metadata, by key.
type Metadata = BTreeMap<String, String>;
/// Tensors' shapes, by name.
type Shapes = BTreeMap<String, Vec<usize>>;

/// What one checkpoint holds.
#[derive(Debug, Serialize)]
pub struct Inspection {
    /// Its directory.
    pub dir: PathBuf,
    /// The step it was taken after.
    pub step: usize,
    /// The processes of the job that wrote it.
    pub world_size: usize,
    /// How that job was laid out, as its files say.
    pub layout: String,
    /// Its files.
    pub files: Vec<FileContents>,
    /// Older or newer checkpoints of the same directory that were skipped, with why.
    pub skipped: Vec<(usize, String)>,
}

/// One file of a checkpoint.
#[derive(Debug, Serialize)]
pub struct FileContents {
    /// Its name.
    pub name: String,
    /// Its length.
    pub bytes: u64,
    /// CRC-32C, checked against the manifest.
    pub crc32c: u32,
    /// Its safetensors metadata (`format`, optimizer, batches, shard, …).
    pub metadata: Metadata,
    /// Its tensors by name: shape.
    pub tensors: Shapes,
    /// A shard's rows per sparse table.
    pub rows: BTreeMap<String, usize>,
}

/// The checkpoint at `path`: a step directory, or a checkpoint directory whose newest intact
/// checkpoint is inspected (the broken ones after it are listed as skipped).
pub fn inspect(path: &Path) -> Result<Inspection> {
    let (store, steps) = if path.join(MANIFEST).exists() || step_of(path).is_some() {
        let step = step_of(path)
            .with_context(|| format!("{}: a step directory is named {STEP_PREFIX}NNNNNNNN", path.display()))?;
        let parent = path.parent().unwrap_or(Path::new("."));
        (CheckpointStore::new(parent, usize::MAX), vec![step])
    } else {
        let store = CheckpointStore::new(path, usize::MAX);
        let steps = store.steps()?;
        if steps.is_empty() {
            bail!("{} holds no checkpoint (no {STEP_PREFIX}* directory)", path.display());
        }
        (store, steps)
    };
    let mut skipped = Vec::new();
    for step in steps.into_iter().rev() {
        match store.verify(step) {
            Ok(checkpoint) => {
                let files = checkpoint
                    .files()
                    .iter()
                    .map(|record| {
                        let (metadata, tensors) = if record.name.ends_with(SAFETENSORS) {
                            read_header(&checkpoint.read(&record.name)?)
                                .with_context(|| format!("{}", checkpoint.dir.join(&record.name).display()))?
                        } else {
                            Default::default()
                        };
                        let rows = table_rows(&tensors);
                        Ok(FileContents {
                            name: record.name.clone(),
                            bytes: record.bytes,
                            crc32c: record.crc32c,
                            metadata,
                            tensors,
                            rows,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                return Ok(Inspection {
                    layout: layout(checkpoint.world_size(), &files),
                    dir: checkpoint.dir.clone(),
                    step,
                    world_size: checkpoint.world_size(),
                    files,
                    skipped,
                });
            }
            Err(why) => skipped.push((step, format!("{why:#}"))),
        }
    }
    let reasons: Vec<String> = skipped
        .iter()
        .map(|(step, why)| format!("step {step}: {why}"))
        .collect();
    bail!("{} holds no intact checkpoint:\n{}", path.display(), reasons.join("\n"))
}

/// The step of a directory named `step-NNNNNNNN`.
fn step_of(dir: &Path) -> Option<usize> {
    dir.file_name()?.to_str()?.strip_prefix(STEP_PREFIX)?.parse().ok()
}

/// A safetensors file's metadata and its tensors' shapes, from its header.
fn read_header(bytes: &[u8]) -> Result<(Metadata, Shapes)> {
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes)?;
    let metadata = header.metadata().clone().unwrap_or_default().into_iter().collect();
    let tensors = header
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, info.shape.clone()))
        .collect();
    Ok((metadata, tensors))
}

/// A shard's rows per sparse table: the length of each `sparse.TABLE.ids`.
fn table_rows(tensors: &Shapes) -> BTreeMap<String, usize> {
    tensors
        .iter()
        .filter_map(|(name, shape)| {
            let table = name.strip_prefix("sparse.")?.strip_suffix(".ids")?;
            Some((table.to_string(), shape.first().copied().unwrap_or(0)))
        })
        .collect()
}

/// How the job that wrote `files` was laid out: data-parallel replicas (one copy), pipeline
/// stages (a file each), or parameter-server shards (a file each, trainers beside them).
fn layout(world_size: usize, files: &[FileContents]) -> String {
    let count = |prefix: &str| files.iter().filter(|f| f.name.starts_with(prefix)).count();
    let (stages, shards) = (count("stage-"), count("ps-shard-"));
    if shards > 0 {
        let trainers = world_size.saturating_sub(shards);
        return format!("parameter servers: {shards} shard(s), {trainers} trainer(s)");
    }
    let meta = |key: &str| files.iter().find_map(|f| f.metadata.get(key));
    if stages > 0 {
        let parts: usize = meta(LAYER_PARTS).and_then(|parts| parts.parse().ok()).unwrap_or(1);
        let replicas = world_size / (stages * parts).max(1);
        let mut layout = format!("pipeline: {stages} stage(s) × {replicas} data-parallel replica(s)");
        if parts > 1 {
            layout += &format!(", each stage's layers split {parts} ways (tensor parallelism; the parts gathered)");
        }
        if let Some(stage) = meta(SHARDING_STAGE) {
            layout += &format!(", its states sharded over them (stage {stage}; the shards gathered)");
        }
        layout
    } else {
        let ranks = match meta(LAYER_PARTS) {
            Some(parts) => format!("{world_size} rank(s) splitting each layer {parts} ways (tensor parallelism)"),
            None => format!("{world_size} rank(s)"),
        };
        let gathered = match (meta(SHARDING_STAGE), meta(LAYER_PARTS)) {
            (Some(_), Some(_)) => " (the shards and the layers' parts gathered)",
            (Some(_), None) => " (the shards gathered)",
            (None, Some(_)) => " (the layers' parts gathered)",
            (None, None) => "",
        };
        match meta(SHARDING_STAGE) {
            Some(stage) => {
                format!("data parallel: {ranks} with sharded states (stage {stage}), one copy of the replica{gathered}")
            }
            None => format!("data parallel: {ranks}, one copy of the replica{gathered}"),
        }
    }
}

/// The inspection as text, one file after another.
pub fn render(inspection: &Inspection) -> String {
    let mut out = format!(
        "checkpoint {}\nstep {}, written by {} process(es) — {}\nevery file matches the manifest (size and CRC-32C)\n",
        inspection.dir.display(),
        inspection.step,
        inspection.world_size,
        inspection.layout
    );
    for (step, why) in &inspection.skipped {
        out += &format!("skipped newer step {step}: {why}\n");
    }
    for file in &inspection.files {
        let elements: usize = file.tensors.values().map(|shape| shape.iter().product::<usize>()).sum();
        out += &format!(
            "\n{}  {} bytes  crc32c {:08x}  {} tensor(s), {elements} values\n",
            file.name,
            file.bytes,
            file.crc32c,
            file.tensors.len()
        );
        let shown: Vec<String> = file
            .metadata
            .iter()
            .filter(|(key, _)| *key != "loss_bits")
            .map(|(key, value)| format!("{key}={value}"))
            .collect();
        out += &format!("  {}\n", shown.join(" "));
        for (table, rows) in &file.rows {
            out += &format!("  table {table}: {rows} rows\n");
        }
        for (name, shape) in &file.tensors {
            out += &format!("  {name} {shape:?}\n");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};
    use std::collections::HashMap;

    #[test]
    fn a_checkpoint_shows_its_tensors_rows_and_layout_and_a_broken_one_is_skipped() -> Result<()> {
        let root = tempfile::tempdir()?;
        let store = CheckpointStore::new(root.path(), 5);
        let ids = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?;
        let values = Tensor::zeros((3, 4), candle_core::DType::F32, &Device::Cpu)?;
        let tensors = vec![
            ("sparse.embedding.ids".to_string(), ids),
            ("sparse.embedding.values".to_string(), values),
        ];
        let metadata = HashMap::from([("format".to_string(), "flotilla-ps-shard".to_string())]);
        let record = store.write_with(10, "ps-shard-0.safetensors", |out| {
            super::super::write_tensors(out, &tensors, metadata.clone())
        })?;
        store.commit(10, 3, vec![record])?;
        // A newer checkpoint that was never committed.
        store.write(20, "ps-shard-0.safetensors", b"half")?;
        let inspection = inspect(root.path())?;
        assert_eq!((inspection.step, inspection.world_size), (10, 3));
        assert_eq!(inspection.layout, "parameter servers: 1 shard(s), 2 trainer(s)");
        assert_eq!(inspection.files[0].rows, BTreeMap::from([("embedding".to_string(), 3)]));
        assert_eq!(inspection.files[0].tensors["sparse.embedding.values"], vec![3, 4]);
        assert_eq!(inspection.skipped.len(), 1);
        assert!(
            inspection.skipped[0].1.contains("never committed"),
            "{:?}",
            inspection.skipped
        );
        let text = render(&inspection);
        assert!(text.contains("table embedding: 3 rows"), "{text}");
        // The step directory itself, and one whose file was corrupted.
        let step = inspect(&root.path().join("step-00000010"))?;
        assert_eq!(step.step, 10);
        let file = root.path().join("step-00000010/ps-shard-0.safetensors");
        let mut bytes = std::fs::read(&file)?;
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&file, bytes)?;
        let error = inspect(root.path()).unwrap_err().to_string();
        assert!(
            error.contains("holds no intact checkpoint") && error.contains("corrupted"),
            "{error}"
        );
        Ok(())
    }
}
