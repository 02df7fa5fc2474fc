//! Writes click logs in the public Criteo display-advertising TSV layout, so synthetic data
//! exercises the same reader as real Criteo files (`ClickLogSchema::criteo`):
//!
//! ```text
//! label \t I1 … I13 \t C1 … C26 \n
//! ```
//!
//! 40 tab-separated columns: the label 0 or 1, 13 decimal integers (possibly
//! negative or empty), 26 categorical values as 8 lower-case hex digits
//! (possibly empty). Lines end with `\n`. A file whose name ends in `.gz` is
//! written gzip-compressed.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{Context, Result};
use flate2::write::GzEncoder;
use flate2::Compression;

use crate::data::parts::text::is_gzip;

use super::{CriteoSynth, CtrRecord, Split};

/// Writes `record` as one TSV line, ending in `\n`.
pub fn write_record(out: &mut (impl Write + ?Sized), record: &CtrRecord) -> std::io::Result<()> {
    out.write_all(if record.label { b"1" } else { b"0" })?;
    for x in &record.dense {
        match x {
            Some(v) => write!(out, "\t{v}")?,
            None => out.write_all(b"\t")?,
        }
    }
    for c in &record.sparse {
        match c {
            Some(v) => write!(out, "\t{v:08x}")?,
            None => out.write_all(b"\t")?,
        }
    }
    out.write_all(b"\n")
}

/// Writes the samples `records` of `split` to `path` in the Criteo layout, so synthetic data
/// can exercise the file path of the loader; gzip-compressed when the name ends in `.gz`.
pub fn write_synthetic(path: &Path, synth: &CriteoSynth, split: Split, records: std::ops::Range<u64>) -> Result<()> {
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let file = BufWriter::with_capacity(1 << 16, file);
    let records = |out: &mut dyn Write| {
        records
            .clone()
            .try_for_each(|index| write_record(out, &synth.record(split, index)))
    };
    let written = match is_gzip(path) {
        true => {
            let mut out = GzEncoder::new(file, Compression::default());
            records(&mut out).and_then(|()| out.finish()?.flush())
        }
        false => {
            let mut out = file;
            records(&mut out).and_then(|()| out.flush())
        }
    };
    written.with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::ctr::{DENSE_FEATURES, SPARSE_SLOTS};

    #[test]
    fn writes_the_criteo_layout() -> Result<()> {
        let mut record = CriteoSynth::new(1, 100).record(Split::Train, 0);
        record.dense = [None; DENSE_FEATURES];
        record.dense[0] = Some(-2);
        record.sparse = [None; SPARSE_SLOTS];
        record.sparse[0] = Some(0xab);
        record.label = true;
        let mut out = Vec::new();
        write_record(&mut out, &record)?;
        let text = String::from_utf8(out)?;
        assert!(text.starts_with("1\t-2\t\t"));
        assert!(text.ends_with("\t000000ab\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\n"));
        assert_eq!(text.split('\t').count(), 1 + DENSE_FEATURES + SPARSE_SLOTS);
        Ok(())
    }
}
