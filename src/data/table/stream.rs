//! Tables streamed in parts (`train.data_parts`): each rank opens only its parts of the CSV,
//! Parquet or array files and holds a shuffle window of rows at a time, so the files may be far
//! larger than memory. CSV files are cut into byte ranges — a row belongs to the part its line
//! begins in, so a quoted cell may not span lines there — and Parquet and array files into row
//! ranges, read a block of rows at a time (a Parquet row group, a run of array rows).

use std::fs::File;
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, ensure, Context, Result};

use super::array_file::ArrayTable;
use super::row_file::RowFile;
use super::{csv_header, csv_reader, csv_values, malformed, record_line, Columns, Layout, ParquetColumns, TableFormat};
use crate::data::parts::cut::{cut_by_measure, cut_into_parts, Segment};
use crate::data::parts::text::{count_records, is_gzip};
use crate::data::parts::{DataLayout, PartLoader, PartStream, Placement, ReadPosition, StreamPosition};

/// The columns a streamed table's rows are read from, owned by every part's stream.
#[derive(Debug)]
struct ColumnNames {
    label: Option<String>,
    features: Option<Vec<String>>,
    regression: bool,
}

impl ColumnNames {
    fn columns(&self) -> Columns<'_> {
        Columns {
            label: self.label.as_deref(),
            features: self.features.as_deref(),
            regression: self.regression,
        }
    }
}

/// A table the ranks stream in parts instead of holding it in memory.
#[derive(Debug, Clone)]
pub struct StreamedTable {
    format: TableFormat,
    files: Vec<PathBuf>,
    columns: Arc<ColumnNames>,
    layout: DataLayout,
    /// Rows in each file, counted at the open: Parquet and array files are cut by them.
    file_rows: Vec<u64>,
    /// Inputs per row.
    pub dim: usize,
    /// Rows in one pass over the files.
    pub rows: u64,
    /// The feature columns, in the order of a row's inputs.
    pub feature_columns: Vec<String>,
}

impl StreamedTable {
    /// The `files` of a table in `format`, to be read in parts cut and shuffled as `layout`
    /// says: every file's header (or schema) is checked for `columns` and its rows counted
    /// now, so a bad file fails the start rather than an epoch.
    /// `key` names the files in errors.
    pub fn open(
        format: TableFormat,
        files: &[String],
        columns: Columns,
        layout: DataLayout,
        key: &str,
    ) -> Result<Self> {
        ensure!(!files.is_empty(), "{key}: no files given");
        let label = columns.label.map(str::to_string);
        let mut dims = None;
        let mut file_rows = Vec::with_capacity(files.len());
        for file in files {
            let path = Path::new(file);
            // The feature columns' (or arrays') names and the values a row holds of them.
            let ((names, dim), count) = match format {
                TableFormat::Csv => {
                    ensure!(
                        !is_gzip(path),
                        "{key}: {file}: a streamed CSV file is cut by bytes, so it must not be compressed"
                    );
                    let (header, layout) = read_csv_layout(path, columns).with_context(|| key.to_string())?;
                    // The header is one of the file's lines.
                    let names = layout.feature_names(&header);
                    ((names, layout.features.len()), count_records(path)?.saturating_sub(1))
                }
                TableFormat::Parquet => {
                    let table = ParquetColumns::open(path, columns).with_context(|| format!("{key}: {file}"))?;
                    let names = table.layout.feature_names(&table.header);
                    ((names, table.layout.features.len()), table.rows())
                }
                TableFormat::Arrays => {
                    let table = ArrayTable::open(path, columns).with_context(|| format!("{key}: {file}"))?;
                    (table.features(), table.rows())
                }
            };
            match &dims {
                None => dims = Some((names, dim)),
                Some((_, first)) => ensure!(
                    *first == dim,
                    "{key}: {file} has {dim} feature values a row, where the files before had {first}"
                ),
            }
            file_rows.push(count);
        }
        let rows = file_rows.iter().sum();
        let (feature_columns, dim) = dims.unwrap_or_default();
        ensure!(rows > 0, "{key}: the files hold no rows");
        tracing::info!(
            rows,
            files = files.len(),
            "{key}: streamed from the files, a piece at a time"
        );
        Ok(Self {
            format,
            files: files.iter().map(PathBuf::from).collect(),
            columns: Arc::new(ColumnNames {
                label,
                features: columns.features.map(<[String]>::to_vec),
                regression: columns.regression,
            }),
            layout,
            file_rows,
            dim,
            rows,
            feature_columns,
        })
    }

    /// Whether the label is a value to regress rather than a class id.
    pub fn is_regression(&self) -> bool {
        self.columns.regression
    }

    /// The files cut into `parts` parts.
    fn segments(&self, parts: usize) -> Result<Vec<Vec<Segment>>> {
        match self.format {
            TableFormat::Csv => cut_into_parts(&self.files, parts),
            TableFormat::Parquet | TableFormat::Arrays => cut_by_measure(&self.files, parts, |path| {
                let file = self.files.iter().position(|f| f == path);
                file.map(|i| self.file_rows[i])
                    .with_context(|| format!("{} is not a file of the table", path.display()))
            }),
        }
    }

    /// The loader of `rank` among `world` ranks reading global batches of `global_batch` rows:
    /// it opens only the parts its slices lie in.
    pub(crate) fn loader(&self, global_batch: usize, rank: usize, world: usize) -> Result<PartLoader<TableStream>> {
        let placement = Placement::training(self.layout.parts, global_batch, rank, world)?;
        let streams = self.open_parts(self.layout.parts, &placement)?;
        Ok(PartLoader::new(streams, self.layout, &placement))
    }

    /// The streams of the parts `placement` reads of the files cut into `parts`.
    fn open_parts(&self, parts: usize, placement: &Placement) -> Result<Vec<(usize, TableStream)>> {
        self.segments(parts)?
            .into_iter()
            .enumerate()
            .filter(|(part, _)| placement.parts.contains(part))
            .map(|(part, segments)| Ok((part, self.stream(segments)?)))
            .collect()
    }

    /// The loader of `rank`'s share of a pass over the files among `world` ranks, in batches
    /// of at most `batch_rows`: the files cut into `world` parts, part `rank` its own.
    pub(crate) fn evaluation(&self, batch_rows: usize, rank: usize, world: usize) -> Result<PartLoader<TableStream>> {
        let placement = Placement::evaluation(batch_rows * world, rank, world, world)?;
        let streams = self.open_parts(world, &placement)?;
        Ok(PartLoader::new(streams, DataLayout::WHOLE, &placement))
    }

    /// The feature rows of one pass over the files, `piece_rows` at a time (without a label
    /// column, what `predict` reads).
    pub fn feature_pieces(&self, piece_rows: usize) -> Result<impl Iterator<Item = Result<Vec<f32>>>> {
        let mut loader = self.evaluation(piece_rows, 0, 1)?;
        let dim = self.dim;
        Ok(std::iter::from_fn(move || {
            let piece = loader.next_eval_batch().transpose()?;
            Some(piece.map(|rows| rows.iter().flat_map(|row| &row[..dim]).copied().collect()))
        }))
    }

    /// The largest label of one pass over the files, read as one part a batch at a time.
    pub fn largest_label(&self) -> Result<f32> {
        let mut loader = self.evaluation(4096, 0, 1)?;
        let mut largest = 0f32;
        while let Some(rows) = loader.next_eval_batch()? {
            largest = rows.iter().filter_map(|row| row.last()).fold(largest, |a, &b| a.max(b));
        }
        Ok(largest)
    }

    fn stream(&self, segments: Vec<Segment>) -> Result<TableStream> {
        Ok(match self.format {
            TableFormat::Parquet => TableStream::Parquet(RowPart::open(segments, self.columns.clone())?),
            TableFormat::Arrays => TableStream::Arrays(RowPart::open(segments, self.columns.clone())?),
            TableFormat::Csv => TableStream::Csv(CsvPart::open(segments, &self.columns)?),
        })
    }
}

/// The header and the layout of `columns` of the CSV file at `path`.
fn read_csv_layout(path: &Path, columns: Columns) -> Result<(Vec<String>, Layout)> {
    let at = || path.display().to_string();
    let file = File::open(path).context("cannot open it").with_context(at)?;
    let header = csv_header(&mut csv_reader(file, true)).with_context(at)?;
    let layout = Layout::find(&header, columns, "column").with_context(at)?;
    Ok((header, layout))
}

/// One part's rows of a table: the features' values, then the label's.
#[derive(Debug)]
pub(crate) enum TableStream {
    Csv(CsvPart),
    Parquet(RowPart<ParquetColumns>),
    Arrays(RowPart<ArrayTable>),
}

impl PartStream for TableStream {
    type Record = Vec<f32>;

    fn next(&mut self) -> Result<Option<Vec<f32>>> {
        match self {
            Self::Csv(part) => part.next(),
            Self::Parquet(part) => part.next(),
            Self::Arrays(part) => part.next(),
        }
    }

    fn skip(&mut self) -> Result<bool> {
        match self {
            Self::Csv(part) => part.advance(),
            Self::Parquet(part) => part.skip(),
            Self::Arrays(part) => part.skip(),
        }
    }

    fn position(&self) -> StreamPosition {
        StreamPosition::Files(match self {
            Self::Csv(part) => part.position(),
            Self::Parquet(part) => part.position(),
            Self::Arrays(part) => part.position(),
        })
    }

    fn seek(&mut self, at: StreamPosition) -> Result<()> {
        let StreamPosition::Files(at) = at else {
            return Err(anyhow!("a data position {at:?} of another kind of data"));
        };
        match self {
            Self::Csv(part) => part.open_segment(at.segment, Some(at)),
            Self::Parquet(part) => part.seek(at),
            Self::Arrays(part) => part.seek(at),
        }
    }

    fn rewind(&mut self) -> Result<()> {
        match self {
            Self::Csv(part) => part.open_segment(0, None),
            Self::Parquet(part) => part.open_segment(0),
            Self::Arrays(part) => part.open_segment(0),
        }
    }
}

/// The rows of CSV files whose lines begin in each of a part's segments.
pub(crate) struct CsvPart {
    segments: Vec<Segment>,
    /// Each segment's file's header and where the columns read are in it.
    headers: Vec<(Vec<String>, Layout)>,
    regression: bool,
    current: usize,
    reader: Option<csv::Reader<File>>,
    /// Where in its file the reader started: the byte, and the lines before it.
    base: (u64, u64),
    /// The reader's next record is its file's header row.
    header_next: bool,
    record: csv::ByteRecord,
}

/// Where the part is; the reader itself has nothing to show.
impl std::fmt::Debug for CsvPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CsvPart")
            .field("segments", &self.segments)
            .field("at", &self.position())
            .finish_non_exhaustive()
    }
}

impl CsvPart {
    fn open(segments: Vec<Segment>, columns: &ColumnNames) -> Result<Self> {
        let headers = segments
            .iter()
            .map(|segment| read_csv_layout(&segment.path, columns.columns()))
            .collect::<Result<_>>()?;
        let mut part = Self {
            segments,
            headers,
            regression: columns.regression,
            current: 0,
            reader: None,
            base: (0, 0),
            header_next: false,
            record: csv::ByteRecord::new(),
        };
        part.open_segment(0, None)?;
        Ok(part)
    }

    /// Reads from segment `index` — at `at`, or at its first line — or, past the last, nothing.
    fn open_segment(&mut self, index: usize, at: Option<ReadPosition>) -> Result<()> {
        self.current = index;
        self.reader = None;
        let Some(segment) = self.segments.get(index) else {
            ensure!(
                at.is_none_or(|at| at.offset == 0),
                "a data position in segment {index} of {}: not a position of these files",
                self.segments.len()
            );
            return Ok(());
        };
        let path = &segment.path;
        let mut file = File::open(path).with_context(|| format!("cannot open data file {}", path.display()))?;
        let (offset, lines) = match at {
            Some(at) => {
                let size = file.metadata().map(|m| m.len()).unwrap_or(0);
                ensure!(
                    at.offset <= size,
                    "{}: a data position at byte {} of a file of {size} bytes: the file changed",
                    path.display(),
                    at.offset
                );
                (at.offset, at.lines)
            }
            None if segment.start == 0 => (0, 0),
            None => {
                // The line under way at `start` belongs to the part before: pass over its rest.
                let from = segment.start - 1;
                file.seek(SeekFrom::Start(from))
                    .with_context(|| format!("cannot seek to byte {from} of {}", path.display()))?;
                let read = BufReader::new(&mut file)
                    .read_until(b'\n', &mut Vec::new())
                    .with_context(|| format!("cannot read {} at byte {from}", path.display()))?;
                (from + read as u64, 0)
            }
        };
        file.seek(SeekFrom::Start(offset))
            .with_context(|| format!("cannot seek to byte {offset} of {}", path.display()))?;
        self.header_next = segment.start == 0 && offset == 0;
        self.base = (offset, lines);
        self.reader = Some(csv_reader(file, false));
        Ok(())
    }

    /// Reads the next row of the part into `self.record`; false at its end.
    fn advance(&mut self) -> Result<bool> {
        loop {
            let Some(reader) = self.reader.as_mut() else {
                return Ok(false);
            };
            let read = reader.read_byte_record(&mut self.record);
            let after = reader.position().clone();
            let read = read.map_err(|e| {
                let at = self.location(e.position().unwrap_or(&after));
                malformed(e, &at)
            })?;
            let start = self.base.0 + self.record.position().map_or(0, csv::Position::byte);
            if !read || self.segments[self.current].end.is_some_and(|end| start >= end) {
                self.open_segment(self.current + 1, None)?;
                continue;
            }
            if !std::mem::take(&mut self.header_next) {
                return Ok(true);
            }
        }
    }

    fn next(&mut self) -> Result<Option<Vec<f32>>> {
        if !self.advance()? {
            return Ok(None);
        }
        let (header, layout) = &self.headers[self.current];
        let mark = self.record.position().cloned().unwrap_or_else(csv::Position::new);
        let at = || self.location(&mark);
        csv_values(layout, &self.record, &at, header, self.regression).map(Some)
    }

    fn position(&self) -> ReadPosition {
        let (offset, lines) = match &self.reader {
            Some(reader) => {
                let at = reader.position();
                (self.base.0 + at.byte(), self.base.1 + at.line() - 1)
            }
            None => (0, 0),
        };
        ReadPosition {
            segment: self.current,
            offset,
            lines,
        }
    }

    /// `path:line` of the record the reader marked at `mark`; for a segment that starts inside
    /// its file, the byte it starts at, since lines are counted from there.
    fn location(&self, mark: &csv::Position) -> String {
        let Some(Segment { path, start, .. }) = self.segments.get(self.current) else {
            return "the end of the data".to_string();
        };
        let line = self.base.1 + record_line(path, self.base.0, mark);
        match start {
            0 => format!("{}:{line}", path.display()),
            start => format!("{} (the part from byte {start}), line {line}", path.display()),
        }
    }
}

/// The rows of [`RowFile`]s in each of a part's segments, a block decoded at a time.
pub(crate) struct RowPart<F> {
    segments: Vec<Segment>,
    columns: Arc<ColumnNames>,
    current: usize,
    /// The current segment's file.
    file: Option<F>,
    /// The next row of the file.
    row: u64,
    /// The first row of the block decoded last, and its rows' values.
    block: Option<(u64, Vec<Vec<f32>>)>,
}

/// Where the part is; the file itself has nothing to show.
impl<F: RowFile> std::fmt::Debug for RowPart<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowPart")
            .field("segments", &self.segments)
            .field("at", &self.position())
            .finish_non_exhaustive()
    }
}

impl<F: RowFile> RowPart<F> {
    fn open(segments: Vec<Segment>, columns: Arc<ColumnNames>) -> Result<Self> {
        let mut part = Self {
            segments,
            columns,
            current: 0,
            file: None,
            row: 0,
            block: None,
        };
        part.open_segment(0)?;
        Ok(part)
    }

    /// Reads from the first row of segment `index`, or, past the last, nothing.
    fn open_segment(&mut self, index: usize) -> Result<()> {
        self.current = index;
        self.block = None;
        self.file = None;
        let Some(segment) = self.segments.get(index) else {
            return Ok(());
        };
        let file =
            F::open(&segment.path, self.columns.columns()).with_context(|| segment.path.display().to_string())?;
        self.row = segment.start;
        self.file = Some(file);
        Ok(())
    }

    /// The row after the segment's last.
    fn end(&self, file: &F) -> u64 {
        let rows = file.rows();
        self.segments[self.current].end.map_or(rows, |end| end.min(rows))
    }

    /// Passes over the next row; false at the part's end.
    fn skip(&mut self) -> Result<bool> {
        loop {
            let Some(file) = &self.file else {
                return Ok(false);
            };
            if self.row < self.end(file) {
                self.row += 1;
                return Ok(true);
            }
            self.open_segment(self.current + 1)?;
        }
    }

    fn next(&mut self) -> Result<Option<Vec<f32>>> {
        if !self.skip()? {
            return Ok(None);
        }
        let row = self.row - 1;
        let held = self
            .block
            .as_ref()
            .is_some_and(|(first, rows)| (*first..*first + rows.len() as u64).contains(&row));
        if !held {
            let file = self.file.as_ref().context("an open file")?;
            let path = &self.segments[self.current].path;
            let block = file
                .block_of(row, self.columns.regression)
                .with_context(|| path.display().to_string())?;
            self.block = Some(block);
        }
        let (first, rows) = self.block.as_ref().context("a decoded block of rows")?;
        Ok(Some(rows[(row - first) as usize].clone()))
    }

    fn position(&self) -> ReadPosition {
        ReadPosition {
            segment: self.current,
            offset: self.row,
            lines: self.row,
        }
    }

    fn seek(&mut self, at: ReadPosition) -> Result<()> {
        if at.segment != self.current || self.file.is_none() {
            self.open_segment(at.segment)?;
        }
        if let Some(file) = &self.file {
            ensure!(
                at.offset <= file.rows(),
                "a data position at row {} of a file of {} rows: the file changed",
                at.offset,
                file.rows()
            );
        }
        self.row = at.offset;
        Ok(())
    }
}

// The integration tests' writer of Parquet files.
#[cfg(test)]
#[path = "../../../tests/common/parquet.rs"]
#[allow(unreachable_pub)]
mod parquet_files;

#[cfg(test)]
mod tests;
