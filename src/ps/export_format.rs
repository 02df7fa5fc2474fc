//! The files of an exported CTR model (`flotilla ps export`), read back by `flotilla predict`
//! and by any serving system that follows this description.
//!
//! ```text
//! DIR/manifest.json          what the export is, and a CRC-32C of every other file
//! DIR/config.toml            the job's configuration: the model's shape, its tables and seed
//! DIR/dense.safetensors      every dense parameter, by the model's names (F32)
//! DIR/sparse/<table>.rows    the table's rows, ids ascending
//! DIR/sparse/<table>.deleted (a delta) ids the base holds that are gone now
//! ```
//!
//! A rows file, little-endian: the 8 bytes `FLOROWS1`, the width `w` (u32), the row count `n`
//! (u64), then `n` rows of an id (u64) and `w` values (f32). A `.deleted` file is a rows file
//! of width 0. A *base* export holds every row; a *delta* export holds the rows that are new or
//! changed since the export it names as its base (and the ids deleted since), with the whole
//! dense part: base then delta, applied in order, give the model at the delta's point.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};

/// The magic bytes that open a rows file.
const ROWS_MAGIC: &[u8; 8] = b"FLOROWS1";
/// Bytes of a rows file before the rows.
const ROWS_HEADER: usize = 8 + 4 + 8;

/// `format` of every manifest.
pub const EXPORT_FORMAT: &str = "flotilla-ctr-export";
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";
/// The job configuration's file name.
pub const CONFIG: &str = "config.toml";
/// The dense parameters' file name.
pub const DENSE: &str = "dense.safetensors";

/// The rows file of table `table`, relative to the export.
pub fn rows_file(table: &str) -> String {
    format!("sparse/{table}.rows")
}

/// The deleted-ids file of table `table` (deltas), relative to the export.
pub fn deleted_file(table: &str) -> String {
    format!("sparse/{table}.deleted")
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportManifest {
    /// [`EXPORT_FORMAT`].
    pub format: String,
    /// `base` or `delta`.
    pub kind: ExportKind,
    /// A delta's base export (as given to `--since`); `None` for a base.
    pub base: Option<PathBuf>,
    /// Each table: its width, the rows written and (deltas) the ids deleted.
    pub tables: Vec<ExportedTable>,
    /// Every other file of the export (relative path) with its CRC-32C.
    pub files: BTreeMap<String, u32>,
}

/// What an export holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExportKind {
    /// Every row.
    Base,
    /// The rows changed since the base.
    Delta,
}

/// One table of an export.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedTable {
    /// The table.
    pub name: String,
    /// Floats per row.
    pub width: usize,
    /// Rows written.
    pub rows: u64,
    /// Ids deleted since the base (0 for a base).
    pub deleted: u64,
}

/// A rows file read back: its width and its rows, ids ascending.
pub type RowsFile = (usize, Vec<(u64, Vec<f32>)>);

/// The bytes of a rows file of `width`-float rows, `rows` ascending by id.
pub fn rows_bytes<'a>(width: usize, rows: impl ExactSizeIterator<Item = (u64, &'a [f32])>) -> Result<Vec<u8>> {
    let mut bytes = Vec::with_capacity(ROWS_HEADER + rows.len() * (8 + 4 * width));
    bytes.extend_from_slice(ROWS_MAGIC);
    bytes.extend_from_slice(
        &u32::try_from(width)
            .context("a row wider than 2³² floats")?
            .to_le_bytes(),
    );
    bytes.extend_from_slice(&(rows.len() as u64).to_le_bytes());
    for (id, values) in rows {
        ensure!(
            values.len() == width,
            "row {id} has {} values, not {width}",
            values.len()
        );
        bytes.extend_from_slice(&id.to_le_bytes());
        values.iter().for_each(|v| bytes.extend_from_slice(&v.to_le_bytes()));
    }
    Ok(bytes)
}

/// The rows of a rows file's `bytes` (named `name` in errors): its width and each row.
pub fn parse_rows(bytes: &[u8], name: &str) -> Result<RowsFile> {
    ensure!(
        bytes.len() >= ROWS_HEADER && &bytes[..8] == ROWS_MAGIC,
        "{name} is not a rows file (no FLOROWS1 header)"
    );
    let width = u32::from_le_bytes(bytes[8..12].try_into()?) as usize;
    let count = u64::from_le_bytes(bytes[12..20].try_into()?);
    let row_bytes = 8 + 4 * width;
    let expected = (count as u128) * row_bytes as u128 + ROWS_HEADER as u128;
    ensure!(
        expected == bytes.len() as u128,
        "{name}: {count} rows of width {width} need {expected} bytes, the file has {}",
        bytes.len()
    );
    let rows = bytes[ROWS_HEADER..]
        .chunks_exact(row_bytes)
        .map(|row| {
            let id = u64::from_le_bytes(row[..8].try_into().unwrap_or_default());
            let values = row[8..]
                .chunks_exact(4)
                .map(|v| f32::from_le_bytes([v[0], v[1], v[2], v[3]]))
                .collect();
            (id, values)
        })
        .collect();
    Ok((width, rows))
}

/// An export directory being read: its manifest, and its files checked against it.
pub struct ExportDir {
    dir: PathBuf,
    /// The manifest.
    pub manifest: ExportManifest,
}

impl ExportDir {
    /// Opens the export in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST);
        let text = fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let manifest: ExportManifest =
            serde_json::from_str(&text).with_context(|| format!("{} is not an export manifest", path.display()))?;
        if manifest.format != EXPORT_FORMAT {
            bail!(
                "{}: format {:?}, not {EXPORT_FORMAT:?}",
                path.display(),
                manifest.format
            );
        }
        Ok(Self {
            dir: dir.to_owned(),
            manifest,
        })
    }

    /// The bytes of file `name` (relative), checked against the manifest's CRC-32C.
    pub fn read(&self, name: &str) -> Result<Vec<u8>> {
        let path = self.dir.join(name);
        let want = *self
            .manifest
            .files
            .get(name)
            .with_context(|| format!("{}: the manifest lists no {name}", self.dir.display()))?;
        let bytes = fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let got = crc32c::crc32c(&bytes);
        ensure!(
            got == want,
            "{} is corrupt: CRC-32C {got:08x}, the manifest says {want:08x}",
            path.display()
        );
        Ok(bytes)
    }

    /// The rows of table `table`'s file `name`, checked.
    pub fn rows(&self, name: &str) -> Result<RowsFile> {
        let bytes = self.read(name)?;
        parse_rows(&bytes, &self.dir.join(name).display().to_string())
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_and_a_short_file_is_named() -> Result<()> {
        let rows = [(3u64, vec![1.0f32, -2.0]), (9, vec![0.5, 4.0])];
        let bytes = rows_bytes(2, rows.iter().map(|(id, v)| (*id, v.as_slice())))?;
        assert_eq!(bytes.len(), ROWS_HEADER + 2 * 16);
        assert_eq!(parse_rows(&bytes, "t.rows")?, (2, rows.to_vec()));
        let error = parse_rows(&bytes[..bytes.len() - 1], "t.rows").unwrap_err().to_string();
        assert!(
            error.starts_with("t.rows: 2 rows of width 2 need 52 bytes, the file has 51"),
            "{error}"
        );
        assert!(parse_rows(b"nothing here at all", "x").is_err());
        let none = rows_bytes(0, std::iter::empty())?;
        assert_eq!(parse_rows(&none, "d")?, (0, Vec::new()));
        Ok(())
    }
}
