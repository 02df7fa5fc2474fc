//! The public Criteo display-advertising TSV layout, so real Criteo files and
//! synthetic ones are read by the same code:
//!
//! ```text
//! label \t I1 … I13 \t C1 … C26 \n
//! ```
//!
//! 40 tab-separated columns: the label 0 or 1, 13 decimal integers (possibly
//! negative or empty), 26 categorical values as 8 lower-case hex digits
//! (possibly empty). Lines end with `\n`; `\r\n` is accepted and empty lines
//! are skipped. A file whose name ends in `.gz` is gzip-compressed (read and
//! written as such; concatenated members read as one stream).

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use flate2::write::GzEncoder;
use flate2::Compression;

use crate::data::parts::cut::Segment;
use crate::data::parts::text::{buffered, is_gzip};
use crate::data::parts::ReadPosition;

use super::{CriteoSynth, CtrRecord, Split, DENSE_FEATURES, SPARSE_SLOTS};

/// Columns per line: label, integers, categoricals.
const COLUMNS: usize = 1 + DENSE_FEATURES + SPARSE_SLOTS;

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

/// The Criteo name of a 1-based column, for error messages.
fn column_name(column: usize) -> String {
    match column {
        1 => "label".to_string(),
        c if c <= 1 + DENSE_FEATURES => format!("I{}", c - 1),
        c => format!("C{}", c - 1 - DENSE_FEATURES),
    }
}

/// Parses one TSV line (a trailing `\n` or `\r\n` is ignored). Errors name
/// the 1-based column and what is wrong with it.
pub fn parse_line(line: &str) -> Result<CtrRecord, String> {
    let line = line.trim_end_matches(['\n', '\r']);
    let mut fields = [""; COLUMNS];
    let mut found = 0;
    for field in line.split('\t') {
        if let Some(f) = fields.get_mut(found) {
            *f = field;
        }
        found += 1;
    }
    if found != COLUMNS {
        return Err(format!("expected {COLUMNS} tab-separated columns, found {found}"));
    }
    let mut fields = fields.into_iter();
    let mut next = || fields.next().unwrap_or_default();
    let bad =
        |column: usize, field: &str, why: &str| format!("column {column} ({}): {field:?} {why}", column_name(column));
    let label = match next() {
        "0" => false,
        "1" => true,
        other => return Err(bad(1, other, "is not a label: it must be 0 or 1")),
    };
    let mut dense = [None; DENSE_FEATURES];
    for (j, slot) in dense.iter_mut().enumerate() {
        let field = next();
        if !field.is_empty() {
            *slot = Some(
                field
                    .parse::<i64>()
                    .map_err(|_| bad(2 + j, field, "is not an integer"))?,
            );
        }
    }
    let mut sparse = [None; SPARSE_SLOTS];
    for (s, slot) in sparse.iter_mut().enumerate() {
        let field = next();
        let column = 2 + DENSE_FEATURES + s;
        if field.is_empty() {
            continue;
        }
        if !field.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad(column, field, "is not hexadecimal"));
        }
        if field.len() > 8 {
            return Err(bad(column, field, "has more than 8 hex digits"));
        }
        *slot = Some(u32::from_str_radix(field, 16).map_err(|e| bad(column, field, &e.to_string()))?);
    }
    Ok(CtrRecord { label, dense, sparse })
}

/// Streams records from a list of TSV files — or of byte ranges of them (`Segment`s) — in
/// order, one reused line buffer at a time, so files far larger than memory can be read.
pub struct TsvReader {
    segments: Vec<Segment>,
    /// Index in `segments` of the segment being read.
    current: usize,
    reader: Option<BufReader<Box<dyn Read + Send>>>,
    /// Offset in the current (uncompressed) file of the next byte to read.
    offset: u64,
    /// 1-based number of the line in `line`, counted from the segment's start.
    line_number: u64,
    /// Raw bytes, so skipped lines are never checked for UTF-8.
    line: Vec<u8>,
}

/// Where the reader is; the stream itself has nothing to show.
impl std::fmt::Debug for TsvReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TsvReader")
            .field("segments", &self.segments)
            .field("at", &self.location())
            .finish_non_exhaustive()
    }
}

impl TsvReader {
    /// A reader of whole `files`, positioned at the start of the first; every file must exist
    /// now, so a typo fails at start-up rather than mid-epoch.
    pub fn open(files: Vec<PathBuf>) -> Result<Self> {
        Self::open_segments(files.iter().map(|path| Segment::whole(path)).collect())
    }

    /// A reader of the lines that begin in each of `segments`, in order.
    pub(crate) fn open_segments(segments: Vec<Segment>) -> Result<Self> {
        for segment in &segments {
            File::open(&segment.path)
                .with_context(|| format!("cannot open CTR data file {}", segment.path.display()))?;
        }
        let mut reader = Self {
            segments,
            current: 0,
            reader: None,
            offset: 0,
            line_number: 0,
            line: Vec::new(),
        };
        reader.rewind()?;
        Ok(reader)
    }

    /// The next record, or `None` after the last line of the last segment.
    /// Errors carry `path:line:`.
    pub fn next_record(&mut self) -> Result<Option<CtrRecord>> {
        if !self.next_line()? {
            return Ok(None);
        }
        let text =
            std::str::from_utf8(&self.line).map_err(|e| anyhow::anyhow!("{}: not UTF-8: {e}", self.location()))?;
        let record = parse_line(text).map_err(|e| anyhow::anyhow!("{}: {e}", self.location()))?;
        Ok(Some(record))
    }

    /// Passes over the next record without parsing it; false after the last line of the last
    /// segment.
    pub fn skip_record(&mut self) -> Result<bool> {
        self.next_line()
    }

    /// Goes back to the start of the first segment, for the next epoch.
    pub fn rewind(&mut self) -> Result<()> {
        self.open_segment(0)
    }

    /// Where the reader is.
    pub fn position(&self) -> ReadPosition {
        ReadPosition {
            segment: self.current,
            offset: self.offset,
            lines: self.line_number,
        }
    }

    /// Goes to `at`, a [`position`](Self::position) of a reader of the same segments: a seek
    /// in an uncompressed file; a gzip-compressed one is decompressed up to it, unparsed.
    pub fn seek(&mut self, at: ReadPosition) -> Result<()> {
        let Some(segment) = self.segments.get(at.segment) else {
            anyhow::ensure!(
                at.segment == self.segments.len() && at.offset == 0,
                "a data position in segment {} of {}: not a position of these files",
                at.segment,
                self.segments.len()
            );
            return self.open_segment(at.segment);
        };
        let path = segment.path.clone();
        let mut file = File::open(&path).with_context(|| format!("cannot open CTR data file {}", path.display()))?;
        let reader = match is_gzip(&path) {
            false => {
                let size = file.metadata().map(|m| m.len()).unwrap_or(0);
                anyhow::ensure!(
                    at.offset <= size,
                    "{}: a data position at byte {} of a file of {size} bytes: the file changed since the checkpoint",
                    path.display(),
                    at.offset
                );
                file.seek(SeekFrom::Start(at.offset))
                    .with_context(|| format!("cannot seek to byte {} of {}", at.offset, path.display()))?;
                buffered(&path, file)
            }
            true => {
                let mut reader = buffered(&path, file);
                let passed = std::io::copy(&mut (&mut reader).take(at.offset), &mut std::io::sink())
                    .with_context(|| format!("{}: cannot read up to byte {}", path.display(), at.offset))?;
                anyhow::ensure!(
                    passed == at.offset,
                    "{}: a data position at byte {} of {passed} bytes: the file changed since the checkpoint",
                    path.display(),
                    at.offset
                );
                reader
            }
        };
        self.current = at.segment;
        self.offset = at.offset;
        self.line_number = at.lines;
        self.reader = Some(reader);
        Ok(())
    }

    /// Positions the reader at the first line of segment `index` (or at the end).
    fn open_segment(&mut self, index: usize) -> Result<()> {
        self.current = index;
        self.line_number = 0;
        self.offset = 0;
        self.reader = None;
        let Some(segment) = self.segments.get(index) else {
            return Ok(());
        };
        let path = &segment.path;
        let mut file = File::open(path).with_context(|| format!("cannot open CTR data file {}", path.display()))?;
        // The line under way at `start` belongs to the part before: seek to the byte before
        // it and pass over the rest of that line (only uncompressed files are cut by bytes).
        let at = segment.start.saturating_sub(1);
        if segment.start > 0 {
            file.seek(SeekFrom::Start(at))
                .with_context(|| format!("cannot seek to byte {at} of {}", path.display()))?;
        }
        let mut reader = buffered(path, file);
        if segment.start > 0 {
            let mut passed = Vec::new();
            let read = reader
                .read_until(b'\n', &mut passed)
                .with_context(|| format!("cannot read {} at byte {at}", path.display()))?;
            self.offset = at + read as u64;
        }
        self.reader = Some(reader);
        Ok(())
    }

    /// Reads the next non-empty line into `self.line`; false at the end.
    fn next_line(&mut self) -> Result<bool> {
        loop {
            let Some(reader) = self.reader.as_mut() else {
                return Ok(false);
            };
            let past_end = self.segments[self.current].end.is_some_and(|end| self.offset >= end);
            self.line.clear();
            let read = match past_end {
                true => 0,
                false => reader
                    .read_until(b'\n', &mut self.line)
                    .with_context(|| format!("{}: cannot read", self.location()))?,
            };
            if read == 0 {
                self.open_segment(self.current + 1)?;
                continue;
            }
            self.offset += read as u64;
            self.line_number += 1;
            if self.line.iter().any(|&b| b != b'\n' && b != b'\r') {
                return Ok(true);
            }
        }
    }

    /// `path:line` of the line last read; for a segment that starts inside its file, the
    /// byte it starts at, since lines are counted from there.
    fn location(&self) -> String {
        match self.segments.get(self.current) {
            Some(Segment { path, start: 0, .. }) => format!("{}:{}", path.display(), self.line_number),
            Some(Segment { path, start, .. }) => format!(
                "{} (the part from byte {start}), line {}",
                path.display(),
                self.line_number
            ),
            None => "the end of the data".to_string(),
        }
    }
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
    use crate::data::parts::text::count_records;

    fn line_with(column: usize, value: &str) -> String {
        let mut fields = vec![String::new(); COLUMNS];
        fields[0] = "0".into();
        fields[column - 1] = value.into();
        fields.join("\t")
    }

    #[test]
    fn synthetic_records_round_trip_through_tsv() -> Result<()> {
        let synth = CriteoSynth::new(3, 5000);
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("train.tsv");
        write_synthetic(&path, &synth, Split::Train, 0..500)?;
        let mut reader = TsvReader::open(vec![path])?;
        for index in 0..500 {
            let expected = synth.record(Split::Train, index);
            let read = reader
                .next_record()?
                .ok_or_else(|| anyhow::anyhow!("file ended at {index}"))?;
            assert_eq!(read.feature_ids(), expected.feature_ids());
            assert_eq!(read, expected);
            assert_eq!(synth.click_logit(&read), synth.click_logit(&expected));
        }
        assert_eq!(reader.next_record()?, None);
        assert_eq!(count_records(&dir.path().join("train.tsv"))?, 500);
        Ok(())
    }

    #[test]
    fn gzip_files_read_as_their_text_and_a_truncated_one_is_named() -> Result<()> {
        let synth = CriteoSynth::new(3, 5000);
        let dir = tempfile::tempdir()?;
        let (plain, packed) = (dir.path().join("train.tsv"), dir.path().join("train.tsv.gz"));
        write_synthetic(&plain, &synth, Split::Train, 0..300)?;
        write_synthetic(&packed, &synth, Split::Train, 0..300)?;
        let bytes = std::fs::read(&packed)?;
        assert_eq!(&bytes[..2], [0x1f, 0x8b], "a gzip stream");
        assert!(bytes.len() < std::fs::metadata(&plain)?.len() as usize / 2);
        let (mut a, mut b) = (TsvReader::open(vec![plain])?, TsvReader::open(vec![packed.clone()])?);
        while let Some(record) = a.next_record()? {
            assert_eq!(b.next_record()?, Some(record));
        }
        assert_eq!((b.next_record()?, count_records(&packed)?), (None, 300));

        let cut = dir.path().join("cut.tsv.gz");
        std::fs::write(&cut, &bytes[..bytes.len() / 2])?;
        let mut reader = TsvReader::open(vec![cut.clone()])?;
        let error = loop {
            match reader.next_record() {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("a truncated file read to its end"),
                Err(e) => break format!("{e:#}"),
            }
        };
        assert!(
            error.starts_with(&format!("{}:", cut.display())) && error.contains("cannot read"),
            "{error}"
        );
        assert!(count_records(&cut).is_err());
        Ok(())
    }

    #[test]
    fn writes_the_criteo_layout() -> Result<()> {
        let mut record = parse_line(&line_with(2, "-2")).map_err(anyhow::Error::msg)?;
        record.sparse[0] = Some(0xab);
        record.label = true;
        let mut out = Vec::new();
        write_record(&mut out, &record)?;
        let text = String::from_utf8(out)?;
        assert!(text.starts_with("1\t-2\t\t"));
        assert!(text.ends_with("\t000000ab\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\n"));
        assert_eq!(
            parse_line(&text.replace('\n', "\r\n")).map_err(anyhow::Error::msg)?,
            record
        );
        Ok(())
    }

    #[test]
    fn errors_name_the_column() {
        let err = |line: &str| parse_line(line).err().unwrap_or_default();
        assert_eq!(err(&line_with(15, "zz")), "column 15 (C1): \"zz\" is not hexadecimal");
        assert_eq!(
            err(&line_with(40, "123456789")),
            "column 40 (C26): \"123456789\" has more than 8 hex digits"
        );
        assert_eq!(err(&line_with(3, "1.5")), "column 3 (I2): \"1.5\" is not an integer");
        assert!(err(&line_with(1, "2")).starts_with("column 1 (label): \"2\""));
        let short = line_with(2, "1");
        let short = &short[..short.rfind('\t').unwrap_or(0)];
        assert_eq!(err(short), "expected 40 tab-separated columns, found 39");
    }

    #[test]
    fn reader_streams_files_in_order_skips_blank_lines_and_rewinds() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let (a, b) = (dir.path().join("a.tsv"), dir.path().join("b.tsv"));
        std::fs::write(&a, format!("{}\n\n{}\r\n", line_with(2, "1"), line_with(2, "2")))?;
        std::fs::write(&b, format!("{}\n{}", line_with(2, "3"), line_with(15, "xyz")))?;
        assert_eq!((count_records(&a)?, count_records(&b)?), (2, 2));
        let mut reader = TsvReader::open(vec![a, b.clone()])?;
        let mut seen = Vec::new();
        for _ in 0..3 {
            seen.push(reader.next_record()?.and_then(|r| r.dense[0]));
        }
        assert_eq!(seen, vec![Some(1), Some(2), Some(3)]);
        let bad = reader.next_record().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(
            bad,
            format!("{}:2: column 15 (C1): \"xyz\" is not hexadecimal", b.display())
        );
        assert!(!reader.skip_record()?);
        reader.rewind()?;
        assert!(reader.skip_record()?);
        assert_eq!(reader.next_record()?.and_then(|r| r.dense[0]), Some(2));
        Ok(())
    }

    #[test]
    fn a_missing_file_is_named() {
        let missing = PathBuf::from("/nonexistent/day_0.tsv");
        let err = TsvReader::open(vec![missing])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("/nonexistent/day_0.tsv"), "{err}");
    }
}
