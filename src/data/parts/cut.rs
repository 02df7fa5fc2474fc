//! The cut of a file set into the parts that trainers read on their own.
//!
//! With at least as many files as parts, a part is a run of whole files, the first
//! `files % parts` parts one file longer (Paddle's `get_file_shard`); with fewer files, the
//! files are cut into ranges of their concatenation, measured in the unit the format can start
//! a reader at: bytes of uncompressed text — a line belonging to the part where its first byte
//! lies, so a reader seeks to its start and passes over the line begun before it — or rows of
//! Parquet. Only file sizes (or row counts in a file's footer) are looked at: cutting reads no
//! data.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::text::is_gzip;

/// The part of one file that belongs to a part: the lines that begin in bytes `start..end`, or
/// rows `start..end`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Segment {
    /// The file.
    pub(crate) path: PathBuf,
    /// The first byte (or row) of the range.
    pub(crate) start: u64,
    /// Just past the range; `None` to the end of the file.
    pub(crate) end: Option<u64>,
}

impl Segment {
    /// The whole of `path`.
    pub(crate) fn whole(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            start: 0,
            end: None,
        }
    }
}

/// Text `files` cut into `parts` parts, each a list of segments read in order: fewer files
/// than parts are cut by bytes, which compressed files cannot be.
pub(crate) fn cut_into_parts(files: &[PathBuf], parts: usize) -> Result<Vec<Vec<Segment>>> {
    let by_bytes = files.len() < parts;
    if let Some(packed) = files.iter().find(|path| by_bytes && is_gzip(path)) {
        bail!(
            "train.data_parts = {parts} parts of {} file(s): fewer files than parts can only be cut into byte \
             ranges, and {} is gzip-compressed; give at least {parts} files or uncompressed ones",
            files.len(),
            packed.display()
        );
    }
    cut_by_measure(files, parts, |path| {
        std::fs::metadata(path)
            .map(|meta| meta.len())
            .with_context(|| format!("cannot open data file {}", path.display()))
    })
}

/// At least as many `files` as `parts` dealt in runs of whole files, the first
/// `files % parts` runs one file longer.
fn whole_files(files: &[PathBuf], parts: usize) -> Vec<Vec<Segment>> {
    let (per_part, longer) = (files.len() / parts, files.len() % parts);
    let mut next = 0;
    (0..parts)
        .map(|part| {
            let take = per_part + usize::from(part < longer);
            let run = files[next..next + take]
                .iter()
                .map(|path| Segment::whole(path))
                .collect();
            next += take;
            run
        })
        .collect()
}

/// `files` cut into `parts` parts: runs of whole files when there are at least as many, else
/// ranges of the files' concatenation in the unit `measure` counts a file's length in.
pub(crate) fn cut_by_measure(
    files: &[PathBuf],
    parts: usize,
    measure: impl Fn(&Path) -> Result<u64>,
) -> Result<Vec<Vec<Segment>>> {
    anyhow::ensure!(parts > 0, "data cannot be cut into 0 parts");
    anyhow::ensure!(!files.is_empty(), "no data files were given");
    if files.len() >= parts {
        return Ok(whole_files(files, parts));
    }
    let sizes: Vec<u64> = files.iter().map(|path| measure(path)).collect::<Result<_>>()?;
    let total: u64 = sizes.iter().sum();
    let boundary = |part: usize| (u128::from(total) * part as u128 / parts as u128) as u64;
    Ok((0..parts)
        .map(|part| {
            let (from, to) = (boundary(part), boundary(part + 1));
            let mut file_start = 0;
            let mut segments = Vec::new();
            for (path, &size) in files.iter().zip(&sizes) {
                let file_end = file_start + size;
                if from < file_end && to > file_start {
                    segments.push(Segment {
                        path: path.clone(),
                        start: from.saturating_sub(file_start),
                        end: (to < file_end).then(|| to - file_start),
                    });
                }
                file_start = file_end;
            }
            segments
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(parts: &[Vec<Segment>]) -> Vec<Vec<(String, u64, Option<u64>)>> {
        parts
            .iter()
            .map(|part| {
                part.iter()
                    .map(|s| (s.path.display().to_string(), s.start, s.end))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn files_are_dealt_in_runs_and_few_files_are_cut_by_bytes() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let files: Vec<PathBuf> = ["a", "b", "c"]
            .iter()
            .zip([10usize, 20, 30])
            .map(|(name, size)| {
                let path = dir.path().join(name);
                std::fs::write(&path, vec![b'x'; size]).map(|()| path)
            })
            .collect::<std::io::Result<_>>()?;
        let at = |name: &str| dir.path().join(name).display().to_string();
        assert_eq!(
            names(&cut_into_parts(&files, 2)?),
            vec![vec![(at("a"), 0, None), (at("b"), 0, None)], vec![(at("c"), 0, None)]]
        );
        // 60 bytes in 4 parts of 15: a and the start of b, the rest of b, c in halves.
        assert_eq!(
            names(&cut_into_parts(&files[..], 4)?),
            vec![
                vec![(at("a"), 0, None), (at("b"), 0, Some(5))],
                vec![(at("b"), 5, None)],
                vec![(at("c"), 0, Some(15))],
                vec![(at("c"), 15, None)],
            ]
        );
        let packed = dir.path().join("d.tsv.gz");
        std::fs::write(&packed, b"")?;
        let error = cut_into_parts(&[packed], 2)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(error.contains("d.tsv.gz is gzip-compressed"), "{error}");
        assert!(cut_into_parts(&[], 1).is_err());
        Ok(())
    }
}
