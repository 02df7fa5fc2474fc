//! The lines of click-log text files — whole files or byte ranges of them (`Segment`s) — in
//! order, one reused buffer at a time, so files far larger than memory can be read; plain or
//! gzip-compressed (a name ending in `.gz`; concatenated members read as one stream). Empty lines
//! are skipped; `\r\n` endings are the parser's to trim.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};

use anyhow::{Context, Result};

use crate::data::parts::cut::Segment;
use crate::data::parts::text::{buffered, is_gzip};
use crate::data::parts::ReadPosition;

/// Streams records from a list of TSV files — or of byte ranges of them (`Segment`s) — in
/// order, one reused line buffer at a time, so files far larger than memory can be read.
pub(super) struct LineReader {
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
    /// Non-empty lines given from the current segment (at least those before a position
    /// sought to).
    given: u64,
}

/// Where the reader is; the stream itself has nothing to show.
impl std::fmt::Debug for LineReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LineReader")
            .field("segments", &self.segments)
            .field("at", &self.location())
            .finish_non_exhaustive()
    }
}

impl LineReader {
    /// A reader of the lines that begin in each of `segments`, in order.
    pub(super) fn open_segments(segments: Vec<Segment>) -> Result<Self> {
        for segment in &segments {
            File::open(&segment.path).with_context(|| format!("cannot open click log {}", segment.path.display()))?;
        }
        let mut reader = Self {
            segments,
            current: 0,
            reader: None,
            offset: 0,
            line_number: 0,
            line: Vec::new(),
            given: 0,
        };
        reader.rewind()?;
        Ok(reader)
    }

    /// Goes back to the start of the first segment, for the next epoch.
    pub(super) fn rewind(&mut self) -> Result<()> {
        self.open_segment(0)
    }

    /// Where the reader is.
    pub(super) fn position(&self) -> ReadPosition {
        ReadPosition {
            segment: self.current,
            offset: self.offset,
            lines: self.line_number,
        }
    }

    /// Goes to `at`, a [`position`](Self::position) of a reader of the same segments: a seek
    /// in an uncompressed file; a gzip-compressed one is decompressed up to it, unparsed.
    pub(super) fn seek(&mut self, at: ReadPosition) -> Result<()> {
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
        let mut file = File::open(&path).with_context(|| format!("cannot open click log {}", path.display()))?;
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
        self.given = at.lines;
        self.reader = Some(reader);
        Ok(())
    }

    /// Positions the reader at the first line of segment `index` (or at the end).
    fn open_segment(&mut self, index: usize) -> Result<()> {
        self.current = index;
        self.line_number = 0;
        self.given = 0;
        self.offset = 0;
        self.reader = None;
        let Some(segment) = self.segments.get(index) else {
            return Ok(());
        };
        let path = &segment.path;
        let mut file = File::open(path).with_context(|| format!("cannot open click log {}", path.display()))?;
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

    /// Reads the next non-empty line (see [`line`](Self::line)); false after the last line of
    /// the last segment.
    pub(super) fn next_line(&mut self) -> Result<bool> {
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
                self.given += 1;
                return Ok(true);
            }
        }
    }

    /// The line last read, as its bytes (unchecked: skipped lines are never decoded), its
    /// ending included.
    pub(super) fn line(&self) -> &[u8] {
        &self.line
    }

    /// The segment the last line was read from; `None` at the end.
    pub(super) fn segment(&self) -> Option<&Segment> {
        self.segments.get(self.current)
    }

    /// Whether the last line read is its file's first non-empty one (a header, where files
    /// have one).
    pub(super) fn is_first_line_of_file(&self) -> bool {
        self.segment().is_some_and(|s| s.start == 0) && self.given == 1
    }

    /// `path:line` of the line last read; for a segment that starts inside its file, the
    /// byte it starts at, since lines are counted from there.
    pub(super) fn location(&self) -> String {
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
