//! A shard's dense slice and sparse tables saved to, and loaded from, one
//! safetensors file.
//!
//! Tensors: `dense.values` F32 `[len]`, `dense.state` F32 `[state_len]`, and
//! per table `sparse.<table>.ids` U64 `[n]`, `sparse.<table>.values` F32
//! `[n, width]`, `sparse.<table>.state` F32 `[n, state_len]` (`[n, 0]` for a
//! stateless optimizer), rows in the same order in all three; a table with a row policy adds
//! `sparse.<table>.counts` F32 `[n, 3]` (shows, clicks, passes unseen, same order),
//! `sparse.<table>.candidate_ids` U64 `[m]` and `sparse.<table>.candidate_counts` F32 `[m, 2]`
//! (rows its entry rule has not stored yet) and the metadata `sparse.<table>.admitted`,
//! `.evicted` and `.deleted`. Metadata:
//! `format = "flotilla-ps-shard"`, `shard`, `server_num`, `dense.offset`,
//! `dense.optimizer`, and per table `sparse.<table>.width` and
//! `sparse.<table>.optimizer`.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fs;
use std::io::Write;
use std::path::Path;

use anyhow::{bail, ensure, Context};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors, View};

use super::dense::DenseSlice;
use super::placement::shard_of;
use super::policy::COUNTS;
use super::table::{RowTally, SparseTable};
use crate::checkpoint::write_atomically;

/// The `format` metadata value that marks a file as a PS shard snapshot.
const FORMAT: &str = "flotilla-ps-shard";

/// The snapshot file of shard `index` in a directory: the name a run saves its shards under
/// and `train.init_tables_from` loads them by.
pub fn shard_file_name(index: usize) -> String {
    format!("ps-shard-{index}.safetensors")
}

/// Which shard of how many wrote a snapshot: a file is loaded only by the
/// same shard of an equally sized server group, because rows and the dense
/// range are placed by both numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSnapshotInfo {
    /// This shard's index, from 0.
    pub shard: usize,
    /// Parameter servers in the job.
    pub server_num: usize,
}

/// Writes the shard to `path` atomically (`write_atomically`): a crash leaves either the old
/// snapshot or the new one, never half of one.
pub fn save_shard(
    path: &Path,
    info: &ShardSnapshotInfo,
    dense: &DenseSlice,
    tables: &[&SparseTable],
) -> anyhow::Result<()> {
    let saving = || format!("saving PS shard {} to {}", info.shard, path.display());
    let bytes = shard_bytes(info, dense, tables).with_context(saving)?;
    let name = path
        .file_name()
        .with_context(|| format!("{} names no file", path.display()))?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    write_atomically(dir, &name.to_string_lossy(), |file| Ok(file.write_all(&bytes)?)).with_context(saving)
}

/// The shard as the bytes of a snapshot file (what [`save_shard`] writes), for a checkpoint.
pub fn shard_bytes(info: &ShardSnapshotInfo, dense: &DenseSlice, tables: &[&SparseTable]) -> anyhow::Result<Vec<u8>> {
    let (tensors, metadata) = shard_tensors(info, dense, tables)?;
    Ok(safetensors::serialize(tensors, Some(metadata))?)
}

/// A snapshot's tensors, by name, lent to the serializer.
type NamedTensors<'a> = Vec<(String, ShardTensor<'a>)>;

/// The tensors and metadata of a shard's snapshot.
fn shard_tensors<'a>(
    info: &ShardSnapshotInfo,
    dense: &'a DenseSlice,
    tables: &[&'a SparseTable],
) -> anyhow::Result<(NamedTensors<'a>, HashMap<String, String>)> {
    let mut metadata = HashMap::from([
        ("format".to_owned(), FORMAT.to_owned()),
        ("shard".to_owned(), info.shard.to_string()),
        ("server_num".to_owned(), info.server_num.to_string()),
        ("dense.offset".to_owned(), dense.offset().to_string()),
        ("dense.optimizer".to_owned(), dense.optimizer().name().to_owned()),
    ]);
    let mut tensors = vec![
        (
            "dense.values".to_owned(),
            ShardTensor::new(Part::Floats(dense.values()), vec![dense.len()]),
        ),
        (
            "dense.state".to_owned(),
            ShardTensor::new(Part::Floats(dense.state()), vec![dense.state().len()]),
        ),
    ];
    let mut names = HashSet::new();
    for &table in tables {
        let name = table.name();
        ensure!(names.insert(name), "two tables are named `{name}`");
        let (rows, width) = (table.len(), table.width());
        let state_len = table.optimizer().state_len(width);
        metadata.insert(format!("sparse.{name}.width"), width.to_string());
        metadata.insert(format!("sparse.{name}.optimizer"), table.optimizer().name().to_owned());
        tensors.push((
            format!("sparse.{name}.ids"),
            ShardTensor::new(Part::Ids(table), vec![rows]),
        ));
        tensors.push((
            format!("sparse.{name}.values"),
            ShardTensor::new(Part::Values(table), vec![rows, width]),
        ));
        tensors.push((
            format!("sparse.{name}.state"),
            ShardTensor::new(Part::State(table), vec![rows, state_len]),
        ));
        if table.policy().is_some() {
            let tally = table.tally();
            for (key, value) in [
                ("admitted", tally.admitted),
                ("evicted", tally.evicted),
                ("deleted", tally.deleted),
            ] {
                metadata.insert(format!("sparse.{name}.{key}"), value.to_string());
            }
            let candidates = table.candidates().count();
            tensors.push((
                format!("sparse.{name}.counts"),
                ShardTensor::new(Part::Counts(table), vec![rows, COUNTS]),
            ));
            tensors.push((
                format!("sparse.{name}.candidate_ids"),
                ShardTensor::new(Part::CandidateIds(table), vec![candidates]),
            ));
            tensors.push((
                format!("sparse.{name}.candidate_counts"),
                ShardTensor::new(Part::CandidateCounts(table), vec![candidates, 2]),
            ));
        }
    }
    Ok((tensors, metadata))
}

/// Replaces `dense` and every table of `tables` with the snapshot in `path`:
/// rows created since it was taken are dropped.
///
/// Everything is checked before anything changes — format, shard and server
/// count, the dense range, each table's presence, width and optimizer — so a
/// mismatched file leaves the shard as it was. (A file that passes these
/// checks but repeats an id fails after the tables were refilled.)
pub fn load_shard(
    path: &Path,
    info: &ShardSnapshotInfo,
    dense: &mut DenseSlice,
    tables: &mut [&mut SparseTable],
) -> anyhow::Result<()> {
    let bytes = fs::read(path).with_context(|| format!("reading PS shard snapshot {}", path.display()))?;
    load_from_bytes(&bytes, info, dense, tables)
        .with_context(|| format!("loading PS shard snapshot {}", path.display()))
}

/// Replaces `dense` and every table of `tables` with the snapshot held in `bytes` (as
/// [`load_shard`] does with a file).
pub fn load_from_bytes(
    bytes: &[u8],
    info: &ShardSnapshotInfo,
    dense: &mut DenseSlice,
    tables: &mut [&mut SparseTable],
) -> anyhow::Result<()> {
    let file = ShardFile::parse(bytes)?;
    file.expect("shard", &info.shard.to_string())?;
    file.expect("server_num", &info.server_num.to_string())?;
    file.expect("dense.offset", &dense.offset().to_string())?;
    file.expect("dense.optimizer", dense.optimizer().name())?;
    let dense_values = file.tensor("dense.values", Dtype::F32, Some(&[dense.len()]))?;
    let dense_state = file.tensor("dense.state", Dtype::F32, Some(&[dense.state().len()]))?;

    let mut loads: Vec<TableLoad<'_>> = Vec::with_capacity(tables.len());
    for table in tables.iter() {
        let name = table.name();
        ensure!(
            loads.iter().all(|load| load.name != name),
            "two tables are named `{name}`"
        );
        let ids_name = format!("sparse.{name}.ids");
        ensure!(file.has(&ids_name), "table `{name}` is missing from the file");
        file.expect(&format!("sparse.{name}.width"), &table.width().to_string())?;
        file.expect(&format!("sparse.{name}.optimizer"), table.optimizer().name())?;
        let ids = file.tensor(&ids_name, Dtype::U64, None)?;
        let [rows] = ids.shape() else {
            bail!("`{ids_name}` has shape {:?}, not [rows]", ids.shape());
        };
        let (width, state_len) = (table.width(), table.optimizer().state_len(table.width()));
        loads.push(TableLoad {
            name: name.to_owned(),
            ids: ids.data(),
            values: file
                .tensor(&format!("sparse.{name}.values"), Dtype::F32, Some(&[*rows, width]))?
                .data(),
            state: file
                .tensor(&format!("sparse.{name}.state"), Dtype::F32, Some(&[*rows, state_len]))?
                .data(),
            policy: PolicyLoad::read(&file, name, *rows)?,
        });
    }
    for table in file.table_names() {
        ensure!(
            loads.iter().any(|load| load.name == table),
            "the file holds table `{table}`, which this shard does not have"
        );
    }

    dense.restore(floats(dense_values.data()), floats(dense_state.data()))?;
    for (table, load) in tables.iter_mut().zip(loads) {
        table.clear();
        let (width, state_len) = (table.width(), table.optimizer().state_len(table.width()));
        let values = floats(load.values);
        let state = floats(load.state);
        for (i, id) in load.ids.chunks_exact(8).map(u64_from_le).enumerate() {
            table.insert_row(id, &values[i * width..][..width], &state[i * state_len..][..state_len])?;
            if let Some(counts) = load.policy.row_counts(i) {
                table.restore_counts(id, counts)?;
            }
        }
        load.policy.restore_candidates(table, |_| true);
        table.restore_tally(load.policy.tally);
        let rows = load.ids.len() / 8;
        ensure!(
            table.len() == rows,
            "table `{}`: {rows} ids but only {} distinct",
            table.name(),
            table.len()
        );
    }
    Ok(())
}

/// Replaces `dense` and every table of `tables` — shard `info.shard` of `info.server_num` —
/// with its part of `files`, the snapshots of every shard of a job with another number of
/// servers (one resumed with another `server_num`): the rows each table hashes to this shard,
/// with their optimizer state, and this shard's range of the dense parameters, each optimizer
/// slot cut at the same floats.
pub fn load_rehashed(
    files: &[Vec<u8>],
    info: &ShardSnapshotInfo,
    dense: &mut DenseSlice,
    tables: &mut [&mut SparseTable],
) -> anyhow::Result<()> {
    let parsed = files
        .iter()
        .enumerate()
        .map(|(old, bytes)| ShardFile::parse(bytes).with_context(|| format!("shard {old}'s file")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (values, state) = rehashed_dense(&parsed, dense).context("the dense parameters")?;
    let mut rows: Vec<(Vec<RowCopy>, Vec<PolicyLoad>)> = Vec::with_capacity(tables.len());
    for (index, table) in tables.iter().enumerate() {
        let (name, width) = (table.name(), table.width());
        let state_len = table.optimizer().state_len(width);
        let (mut kept, mut policies) = (Vec::new(), Vec::new());
        for (old, file) in parsed.iter().enumerate() {
            let context = || format!("table `{name}` in shard {old}'s file");
            file.expect(&format!("sparse.{name}.width"), &width.to_string())
                .with_context(context)?;
            file.expect(&format!("sparse.{name}.optimizer"), table.optimizer().name())
                .with_context(context)?;
            let ids = file
                .tensor(&format!("sparse.{name}.ids"), Dtype::U64, None)
                .with_context(context)?;
            let n = ids.shape().first().copied().unwrap_or(0);
            let values = floats(
                file.tensor(&format!("sparse.{name}.values"), Dtype::F32, Some(&[n, width]))?
                    .data(),
            );
            let state = floats(
                file.tensor(&format!("sparse.{name}.state"), Dtype::F32, Some(&[n, state_len]))?
                    .data(),
            );
            let policy = PolicyLoad::read(file, name, n).with_context(context)?;
            for (i, id) in ids.data().chunks_exact(8).map(u64_from_le).enumerate() {
                if shard_of(index, id, info.server_num) == info.shard {
                    kept.push(RowCopy {
                        id,
                        values: values[i * width..][..width].to_vec(),
                        state: state[i * state_len..][..state_len].to_vec(),
                        counts: policy.row_counts(i).map(<[f32]>::to_vec),
                    });
                }
            }
            policies.push(policy);
        }
        rows.push((kept, policies));
    }
    dense.restore(values, state)?;
    for (index, (table, (kept, policies))) in tables.iter_mut().zip(rows).enumerate() {
        table.clear();
        for row in kept {
            table.insert_row(row.id, &row.values, &row.state)?;
            if let Some(counts) = &row.counts {
                table.restore_counts(row.id, counts)?;
            }
        }
        // The tally was the old shards'; this layout's counts from here.
        for policy in &policies {
            policy.restore_candidates(table, |id| shard_of(index, id, info.server_num) == info.shard);
        }
    }
    Ok(())
}

/// A row taken from an old shard's file: its id, values, optimizer state and policy counts.
struct RowCopy {
    id: u64,
    values: Vec<f32>,
    state: Vec<f32>,
    counts: Option<Vec<f32>>,
}

/// `dense`'s range of the dense parameters and its optimizer state, from the slices of `files`
/// (which cover every float once): the state is slot-major per slice (`[slot 0 of every float,
/// slot 1 …, then the optimizer's scalars]`), so each slot is gathered and cut on its own.
fn rehashed_dense(files: &[ShardFile<'_>], dense: &DenseSlice) -> anyhow::Result<(Vec<f32>, Vec<f32>)> {
    let optimizer = dense.optimizer();
    let scalars = optimizer.state_len(0);
    let slots = optimizer.state_len(1) - scalars;
    let mut slices = Vec::with_capacity(files.len());
    for (old, file) in files.iter().enumerate() {
        file.expect("dense.optimizer", optimizer.name())?;
        let offset: usize = file
            .metadata
            .get("dense.offset")
            .and_then(|offset| offset.parse().ok())
            .with_context(|| format!("shard {old}'s file has no dense.offset"))?;
        let values = floats(file.tensor("dense.values", Dtype::F32, None)?.data());
        let state = floats(
            file.tensor("dense.state", Dtype::F32, Some(&[slots * values.len() + scalars]))?
                .data(),
        );
        slices.push((offset, values, state));
    }
    slices.sort_by_key(|(offset, _, _)| *offset);
    let total: usize = slices.iter().map(|(_, values, _)| values.len()).sum();
    let (mut whole, mut whole_slots) = (Vec::with_capacity(total), vec![Vec::with_capacity(total); slots]);
    for (offset, values, state) in &slices {
        ensure!(
            *offset == whole.len(),
            "the slices leave floats {}..{offset} out",
            whole.len()
        );
        whole.extend_from_slice(values);
        for (slot, gathered) in whole_slots.iter_mut().enumerate() {
            gathered.extend_from_slice(&state[slot * values.len()..][..values.len()]);
        }
    }
    let (start, len) = (dense.offset(), dense.len());
    ensure!(
        start + len <= total,
        "this shard's floats {start}..{} are past the {total} the files hold",
        start + len
    );
    let range = start..start + len;
    let mut state: Vec<f32> = whole_slots
        .iter()
        .flat_map(|slot| slot[range.clone()].iter().copied())
        .collect();
    // The scalars (a step count, Adam's powers of beta) are the same on every shard.
    let first = &slices.first().context("no shard files")?.2;
    state.extend_from_slice(&first[first.len() - scalars..]);
    Ok((whole[range].to_vec(), state))
}

/// One table's tensors, checked, waiting to be copied in.
struct TableLoad<'a> {
    name: String,
    ids: &'a [u8],
    values: &'a [u8],
    state: &'a [u8],
    policy: PolicyLoad,
}

/// What a policed table's snapshot holds besides its rows: their counts, the shows and clicks of
/// rows not stored yet, and the tally. A file written without a policy has none of it: counting starts
/// afresh.
#[derive(Default)]
struct PolicyLoad {
    counts: Vec<f32>,
    candidates: Vec<(u64, [f32; 2])>,
    tally: RowTally,
}

impl PolicyLoad {
    /// The policy part of table `name` (of `rows` rows) in `file`.
    fn read(file: &ShardFile<'_>, name: &str, rows: usize) -> anyhow::Result<Self> {
        let counts_name = format!("sparse.{name}.counts");
        if !file.has(&counts_name) {
            return Ok(Self::default());
        }
        let counts = floats(file.tensor(&counts_name, Dtype::F32, Some(&[rows, COUNTS]))?.data());
        let ids = file.tensor(&format!("sparse.{name}.candidate_ids"), Dtype::U64, None)?;
        let m = ids.shape().first().copied().unwrap_or(0);
        let shown = file.tensor(&format!("sparse.{name}.candidate_counts"), Dtype::F32, Some(&[m, 2]))?;
        let candidates = ids
            .data()
            .chunks_exact(8)
            .map(u64_from_le)
            .zip(floats(shown.data()).chunks_exact(2).map(|c| [c[0], c[1]]))
            .collect();
        let figure = |key: &str| -> anyhow::Result<u64> {
            let key = format!("sparse.{name}.{key}");
            match file.metadata.get(&key) {
                Some(value) => value
                    .parse()
                    .with_context(|| format!("the file's {key} is {value:?}, not a count")),
                None => Ok(0),
            }
        };
        let tally = RowTally {
            admitted: figure("admitted")?,
            evicted: figure("evicted")?,
            deleted: figure("deleted")?,
        };
        Ok(Self {
            counts,
            candidates,
            tally,
        })
    }

    /// The counts of row `i` of the file, if it holds counts.
    fn row_counts(&self, i: usize) -> Option<&[f32]> {
        self.counts.get(i * COUNTS..(i + 1) * COUNTS)
    }

    /// Gives `table` the candidates `keep` accepts.
    fn restore_candidates(&self, table: &mut SparseTable, keep: impl Fn(u64) -> bool) {
        for &(id, counts) in self.candidates.iter().filter(|(id, _)| keep(*id)) {
            table.restore_candidate(id, counts);
        }
    }
}

/// A parsed snapshot whose every accessor explains a mismatch.
struct ShardFile<'a> {
    tensors: SafeTensors<'a>,
    metadata: HashMap<String, String>,
}

impl<'a> ShardFile<'a> {
    fn parse(bytes: &'a [u8]) -> anyhow::Result<Self> {
        let not_ours = || format!("not a flotilla PS shard file (no `format = \"{FORMAT}\"` safetensors header)");
        let (_, header) = SafeTensors::read_metadata(bytes).with_context(not_ours)?;
        let metadata = header.metadata().clone().unwrap_or_default();
        if metadata.get("format").map(String::as_str) != Some(FORMAT) {
            bail!(not_ours());
        }
        let tensors = SafeTensors::deserialize(bytes).with_context(not_ours)?;
        Ok(Self { tensors, metadata })
    }

    /// Fails unless metadata `key` is `want`, naming both values.
    fn expect(&self, key: &str, want: &str) -> anyhow::Result<()> {
        match self.metadata.get(key) {
            Some(got) if got == want => Ok(()),
            Some(got) => bail!("the file's {key} is {got}, this shard's is {want}"),
            None => bail!("the file has no `{key}` (this shard's is {want})"),
        }
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.tensor(name).is_ok()
    }

    /// Tensor `name`, which must have `dtype` and, when given, `shape`.
    fn tensor(&self, name: &str, dtype: Dtype, shape: Option<&[usize]>) -> anyhow::Result<TensorView<'a>> {
        let view = self
            .tensors
            .tensor(name)
            .with_context(|| format!("tensor `{name}` is missing"))?;
        ensure!(
            view.dtype() == dtype,
            "`{name}` is {:?}, expected {dtype:?}",
            view.dtype()
        );
        if let Some(shape) = shape {
            ensure!(
                view.shape() == shape,
                "`{name}` has shape {:?}, this shard expects {shape:?}",
                view.shape()
            );
        }
        Ok(view)
    }

    /// Names of the sparse tables in the file.
    fn table_names(&self) -> impl Iterator<Item = &str> + '_ {
        self.tensors
            .names()
            .into_iter()
            .filter_map(|name| name.strip_prefix("sparse.")?.strip_suffix(".ids"))
    }
}

/// Where a saved tensor's floats or ids come from: table rows are gathered
/// only when the writer asks, one tensor at a time, so saving needs one
/// tensor's worth of extra memory rather than a copy of the shard.
enum Part<'a> {
    Floats(&'a [f32]),
    Ids(&'a SparseTable),
    Values(&'a SparseTable),
    State(&'a SparseTable),
    Counts(&'a SparseTable),
    CandidateIds(&'a SparseTable),
    CandidateCounts(&'a SparseTable),
}

struct ShardTensor<'a> {
    part: Part<'a>,
    shape: Vec<usize>,
}

impl<'a> ShardTensor<'a> {
    fn new(part: Part<'a>, shape: Vec<usize>) -> Self {
        Self { part, shape }
    }
}

impl View for ShardTensor<'_> {
    fn dtype(&self) -> Dtype {
        match self.part {
            Part::Ids(_) | Part::CandidateIds(_) => Dtype::U64,
            _ => Dtype::F32,
        }
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let mut bytes = Vec::with_capacity(self.data_len());
        match self.part {
            Part::Floats(floats) => floats.iter().for_each(|f| bytes.extend_from_slice(&f.to_le_bytes())),
            Part::Ids(table) => table
                .rows()
                .for_each(|(id, _, _)| bytes.extend_from_slice(&id.to_le_bytes())),
            Part::Values(table) => table
                .rows()
                .flat_map(|(_, value, _)| value)
                .for_each(|f| bytes.extend_from_slice(&f.to_le_bytes())),
            Part::State(table) => table
                .rows()
                .flat_map(|(_, _, state)| state)
                .for_each(|f| bytes.extend_from_slice(&f.to_le_bytes())),
            Part::Counts(table) => table
                .row_counts()
                .flatten()
                .for_each(|f| bytes.extend_from_slice(&f.to_le_bytes())),
            Part::CandidateIds(table) => table
                .candidates()
                .for_each(|(id, _)| bytes.extend_from_slice(&id.to_le_bytes())),
            Part::CandidateCounts(table) => table
                .candidates()
                .flat_map(|(_, counts)| counts)
                .for_each(|f| bytes.extend_from_slice(&f.to_le_bytes())),
        }
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype().bitsize() / 8
    }
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn u64_from_le(b: &[u8]) -> u64 {
    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

#[cfg(test)]
mod tests;
