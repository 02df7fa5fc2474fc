//! Click logs in Parquet: the rows of each of a part's segments (row ranges of files), a row
//! group decoded at a time, read by a schema ([`ClickLogParser`]) whose column names are the
//! file's top-level fields (a position is a field's index). Numbers and booleans are read as
//! their decimal text, so a value gets the same id as in a text log; a list column is a
//! multi-valued slot's values.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::{Field, Row};

use super::schema::{Cell, ColumnRoles};
use super::{ClickLogParser, CtrExample};
use crate::data::parts::cut::Segment;
use crate::data::parts::ReadPosition;

/// Rows in the Parquet file at `path`.
pub(crate) fn parquet_rows(path: &Path) -> Result<u64> {
    Ok(ParquetFile::open(path)?.rows())
}

/// One Parquet file, opened.
struct ParquetFile {
    reader: SerializedFileReader<File>,
    /// Rows in each row group.
    group_rows: Vec<u64>,
}

impl ParquetFile {
    fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("cannot open click log {}", path.display()))?;
        let reader = SerializedFileReader::new(file)
            .with_context(|| format!("{} is not a readable Parquet file", path.display()))?;
        let group_rows = (reader.metadata().row_groups().iter())
            .map(|group| group.num_rows().max(0) as u64)
            .collect();
        Ok(Self { reader, group_rows })
    }

    fn rows(&self) -> u64 {
        self.group_rows.iter().sum()
    }

    /// The top-level fields' names.
    fn columns(&self) -> Vec<String> {
        let schema = self.reader.metadata().file_metadata().schema();
        schema.get_fields().iter().map(|f| f.name().to_string()).collect()
    }

    /// The first row and the rows of the row group holding `row`.
    fn group_of(&self, row: u64) -> Result<(u64, Vec<Row>)> {
        let mut first = 0;
        for (index, &rows) in self.group_rows.iter().enumerate() {
            if row < first + rows {
                let unreadable = || format!("cannot read row group {index}");
                let group = self.reader.get_row_group(index).with_context(unreadable)?;
                let rows = group.get_row_iter(None).with_context(unreadable)?;
                return Ok((
                    first,
                    rows.collect::<parquet::errors::Result<_>>().with_context(unreadable)?,
                ));
            }
            first += rows;
        }
        bail!("no row {} in a file of {first} rows", row + 1)
    }
}

/// The rows of a part's segments, in order.
pub(crate) struct ParquetClickLogReader {
    segments: Vec<Segment>,
    parser: Arc<ClickLogParser>,
    files: HashMap<PathBuf, (ParquetFile, ColumnRoles)>,
    /// Index in `segments` of the segment being read.
    current: usize,
    /// The next row to read, in the current segment's file.
    row: u64,
    /// The decoded row group holding recent rows: its first row and rows.
    group: Option<(u64, Vec<Row>)>,
}

/// Where the reader is; the decoded rows have nothing to show.
impl std::fmt::Debug for ParquetClickLogReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParquetClickLogReader")
            .field("segments", &self.segments)
            .field("current", &self.current)
            .field("row", &self.row)
            .finish_non_exhaustive()
    }
}

impl ParquetClickLogReader {
    /// A reader of the rows of `segments` (row ranges) in `parser`'s columns; every file must
    /// exist and have the columns now.
    pub(crate) fn open_segments(segments: Vec<Segment>, parser: Arc<ClickLogParser>) -> Result<Self> {
        let mut files = HashMap::new();
        for segment in &segments {
            if !files.contains_key(&segment.path) {
                let file = ParquetFile::open(&segment.path)?;
                let roles = parser
                    .roles(Some(&file.columns()))
                    .map_err(|e| anyhow!("{}: {e}", segment.path.display()))?;
                files.insert(segment.path.clone(), (file, roles));
            }
        }
        let mut reader = Self {
            segments,
            parser,
            files,
            current: 0,
            row: 0,
            group: None,
        };
        reader.rewind()?;
        Ok(reader)
    }

    /// The next record, or `None` after the last row of the last segment. Errors name the file
    /// and the row (from 1).
    pub(crate) fn next_record(&mut self) -> Result<Option<CtrExample>> {
        if !self.advance()? {
            return Ok(None);
        }
        let row = self.row - 1;
        let segment = &self.segments[self.current];
        let (file, roles) = &self.files[&segment.path];
        let at = || format!("{}: row {}", segment.path.display(), row + 1);
        if self
            .group
            .as_ref()
            .is_none_or(|(first, rows)| row < *first || row >= first + rows.len() as u64)
        {
            self.group = Some(file.group_of(row).with_context(at)?);
        }
        let (first, rows) = self.group.as_ref().context("a row group vanished")?;
        let fields: Vec<&Field> = rows[(row - first) as usize].get_column_iter().map(|(_, f)| f).collect();
        let example = self
            .parser
            .example(roles, |c| cell(fields[c]))
            .map_err(|e| anyhow!("{}: {e}", at()))?;
        Ok(Some(example))
    }

    /// Passes over the next row without decoding it; false after the last one.
    pub(crate) fn skip_record(&mut self) -> Result<bool> {
        self.advance()
    }

    /// Goes back to the first row of the first segment.
    pub(crate) fn rewind(&mut self) -> Result<()> {
        self.current = 0;
        self.row = self.segments.first().map_or(0, |s| s.start);
        self.group = None;
        Ok(())
    }

    /// Where the reader is: the segment and the next row of its file.
    pub(crate) fn position(&self) -> ReadPosition {
        ReadPosition {
            segment: self.current,
            offset: self.row,
            lines: self.row,
        }
    }

    /// Goes to `at`, a [`position`](Self::position) of a reader of the same segments.
    pub(crate) fn seek(&mut self, at: ReadPosition) -> Result<()> {
        anyhow::ensure!(
            at.segment <= self.segments.len(),
            "a data position in segment {} of {}: not a position of these files",
            at.segment,
            self.segments.len()
        );
        self.current = at.segment;
        self.row = at.offset;
        self.group = None;
        Ok(())
    }

    /// Moves past the next row (to the next segment's first where this one ends); false at
    /// the end of the last segment.
    fn advance(&mut self) -> Result<bool> {
        while let Some(segment) = self.segments.get(self.current) {
            let rows = self.files[&segment.path].0.rows();
            let end = segment.end.map_or(rows, |end| end.min(rows));
            if self.row < end {
                self.row += 1;
                return Ok(true);
            }
            self.current += 1;
            self.row = self.segments.get(self.current).map_or(0, |s| s.start);
            self.group = None;
        }
        Ok(false)
    }
}

/// A Parquet value as a cell: numbers and booleans as their decimal text, strings as they are,
/// lists as their elements' texts.
fn cell(field: &Field) -> Cell<'static> {
    match field {
        Field::Null => Cell::Missing,
        Field::ListInternal(list) => Cell::List(list.elements().iter().filter_map(scalar_text).collect()),
        other => scalar_text(other).map_or(Cell::Missing, |text| Cell::Text(text.into())),
    }
}

/// The text of a scalar value; `None` for a null. Types without a text of their own (dates,
/// decimals, maps) read as Parquet prints them.
fn scalar_text(field: &Field) -> Option<String> {
    Some(match field {
        Field::Null => return None,
        Field::Bool(b) => u8::from(*b).to_string(),
        Field::Byte(v) => v.to_string(),
        Field::Short(v) => v.to_string(),
        Field::Int(v) => v.to_string(),
        Field::Long(v) => v.to_string(),
        Field::UByte(v) => v.to_string(),
        Field::UShort(v) => v.to_string(),
        Field::UInt(v) => v.to_string(),
        Field::ULong(v) => v.to_string(),
        Field::Float(v) => v.to_string(),
        Field::Double(v) => v.to_string(),
        Field::Str(s) => s.clone(),
        Field::Bytes(bytes) => String::from_utf8_lossy(bytes.data()).into_owned(),
        other => other.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ClickLogSchema, ColumnRef, SlotIds, SlotSpec};
    use crate::data::ctr::{feature_id, text_hash};
    use parquet::data_type::{ByteArray, ByteArrayType, DoubleType, Int32Type, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;

    /// Rows `i` of 0..n: click `i % 2`, tags `[]`, `["t{i}"]` or `["a", "b"]` by `i % 3`, price
    /// `i` (null every 5th), user `i % 4`; in row groups of 4.
    fn write_log(path: &Path, n: usize) {
        let schema = "message log { required int32 click; optional group tags (LIST) { repeated group list { \
                      optional binary element (UTF8); } } optional double price; optional int64 user; }";
        let schema = Arc::new(parse_message_type(schema).expect("a schema"));
        let mut writer = SerializedFileWriter::new(
            File::create(path).unwrap(),
            schema,
            Arc::new(WriterProperties::builder().build()),
        )
        .expect("a writer");
        for start in (0..n).step_by(4) {
            let rows: Vec<usize> = (start..(start + 4).min(n)).collect();
            let mut group = writer.next_row_group().unwrap();
            let mut column = group.next_column().unwrap().unwrap();
            let clicks: Vec<i32> = rows.iter().map(|&i| (i % 2) as i32).collect();
            column.typed::<Int32Type>().write_batch(&clicks, None, None).unwrap();
            column.close().unwrap();
            let (mut values, mut defs, mut reps) = (Vec::new(), Vec::new(), Vec::new());
            for &i in &rows {
                let tags: Vec<String> = match i % 3 {
                    0 => vec![],
                    1 => vec![format!("t{i}")],
                    _ => vec!["a".into(), "b".into()],
                };
                if tags.is_empty() {
                    defs.push(1);
                    reps.push(0);
                }
                for (k, tag) in tags.iter().enumerate() {
                    values.push(ByteArray::from(tag.as_str()));
                    defs.push(3);
                    reps.push(i16::from(k > 0));
                }
            }
            let mut column = group.next_column().unwrap().unwrap();
            column
                .typed::<ByteArrayType>()
                .write_batch(&values, Some(&defs), Some(&reps))
                .unwrap();
            column.close().unwrap();
            let prices: Vec<f64> = rows.iter().filter(|&&i| i % 5 != 0).map(|&i| i as f64).collect();
            let defs: Vec<i16> = rows.iter().map(|&i| i16::from(i % 5 != 0)).collect();
            let mut column = group.next_column().unwrap().unwrap();
            column
                .typed::<DoubleType>()
                .write_batch(&prices, Some(&defs), None)
                .unwrap();
            column.close().unwrap();
            let users: Vec<i64> = rows.iter().map(|&i| (i % 4) as i64).collect();
            let defs = vec![1i16; rows.len()];
            let mut column = group.next_column().unwrap().unwrap();
            column
                .typed::<Int64Type>()
                .write_batch(&users, Some(&defs), None)
                .unwrap();
            column.close().unwrap();
            group.close().unwrap();
        }
        writer.close().unwrap();
    }

    fn parser(tags_separator: Option<&str>) -> Arc<ClickLogParser> {
        let mut tags = SlotSpec::new(ColumnRef::Name("tags".into()), SlotIds::Hash);
        tags.separator = tags_separator.map(String::from);
        let mut user = SlotSpec::new(ColumnRef::Position(3), SlotIds::Integer);
        user.id_range = Some(4);
        Arc::new(ClickLogParser::new(ClickLogSchema {
            label: ColumnRef::Name("click".into()),
            dense: vec![ColumnRef::Name("price".into())],
            dense_transform: crate::config::DenseTransform::None,
            slots: vec![tags, user],
            ..ClickLogSchema::default()
        }))
    }

    fn read_all(reader: &mut ParquetClickLogReader) -> Result<Vec<CtrExample>> {
        std::iter::from_fn(|| reader.next_record().transpose()).collect()
    }

    #[test]
    fn lists_are_multi_valued_slots_numbers_read_as_their_text_and_row_ranges_split_the_file() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("log.parquet");
        write_log(&path, 10);
        assert_eq!(parquet_rows(&path)?, 10);
        let mut reader = ParquetClickLogReader::open_segments(vec![Segment::whole(&path)], parser(Some("|")))?;
        let all = read_all(&mut reader)?;
        assert_eq!(all.len(), 10);
        let hash = |v: &str| feature_id(0, Some((text_hash(v) % (1 << 32)) as u32));
        assert_eq!(
            (all[0].label, all[0].dense.clone()),
            (0.0, vec![0.0]),
            "a null price is 0"
        );
        assert_eq!(
            all[0].ids,
            [feature_id(0, None), feature_id(1, Some(0))],
            "an empty list is missing"
        );
        assert_eq!(all[4].ids, [hash("t4"), feature_id(1, Some(0))]);
        assert_eq!(
            (all[5].ids.clone(), all[5].slot_ends.clone()),
            (vec![hash("a"), hash("b"), feature_id(1, Some(1))], vec![2, 3])
        );
        assert_eq!((all[7].label, all[7].dense.clone()), (1.0, vec![7.0]));

        // Cut by rows (across row groups), the parts read every row once, in order.
        let parts = crate::data::parts::cut::cut_by_measure(std::slice::from_ref(&path), 3, parquet_rows)?;
        let mut pieces = Vec::new();
        for segments in parts {
            pieces.extend(read_all(&mut ParquetClickLogReader::open_segments(
                segments,
                parser(Some("|")),
            )?)?);
        }
        assert_eq!(pieces, all);
        // A position saved mid-file is where a new reader goes on from.
        reader.rewind()?;
        for _ in 0..6 {
            reader.skip_record()?;
        }
        let at = reader.position();
        let mut resumed = ParquetClickLogReader::open_segments(vec![Segment::whole(&path)], parser(Some("|")))?;
        resumed.seek(at)?;
        assert_eq!(read_all(&mut resumed)?, all[6..]);

        // A list of several values in a slot without a separator is named with its row; one
        // of none or one value is that value.
        let mut single = ParquetClickLogReader::open_segments(vec![Segment::whole(&path)], parser(None))?;
        assert_eq!(single.next_record()?.map(|e| e.ids), Some(all[0].ids.clone()));
        assert_eq!(single.next_record()?.map(|e| e.ids), Some(all[1].ids.clone()));
        let err = single.next_record().unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "{}: row 3: column 1 \"tags\" (slot 0): a list of 2 values in a single-valued slot (give the slot a separator to read lists)",
                path.display()
            )
        );
        Ok(())
    }
}
