//! Synthetic click logs in any schema's columns and format (`flotilla data click-log`), so a
//! job over a log of the user's own layout can be tried before the real log is at hand: record
//! `i` is the Criteo-shaped generator's record `i` (its planted click model kept), its dense
//! column `j` the generator's count `j mod 13`, its slot `s` the generator's categorical value
//! `s mod 26` written as the slot's `ids` reads it; a multi-valued slot holds one to three values
//! (the next records' values of that slot), joined by its separator.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use flate2::write::GzEncoder;
use flate2::Compression;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

use super::{CriteoSynth, CtrRecord, Split, DENSE_FEATURES, SPARSE_SLOTS};
use crate::config::{ClickLogFormat, ClickLogSchema, ColumnRef, ColumnRole, SlotIds, SlotSpec};
use crate::data::parts::text::is_gzip;

/// Records per Parquet row group, and per batch of text lines built before writing.
const CHUNK: u64 = 1 << 16;

/// What a file's column holds: a role, or nothing the schema reads (a gap between positions).
type Content = Option<ColumnRole>;

/// Writes records `records` of `split` of `synth` to `path` in `schema`'s columns and format
/// (the schema's, else the name's; text gzip-compressed when the name ends in `.gz`).
pub fn write_click_log(
    path: &Path,
    schema: &ClickLogSchema,
    synth: &CriteoSynth,
    split: Split,
    records: Range<u64>,
) -> Result<()> {
    let (names, contents) = layout(schema);
    let cells = |index: u64| -> Vec<Option<String>> {
        let record = synth.record(split, index);
        let later = |k: u64| synth.record(split, index + k);
        contents.iter().map(|&c| cell(schema, c, &record, &later)).collect()
    };
    let format = schema.format.unwrap_or_else(|| ClickLogFormat::of_path(path));
    let written = match format {
        ClickLogFormat::Parquet => write_parquet(path, &names, records, cells),
        text => write_text(path, text, schema.header.then_some(&names[..]), records, cells),
    };
    written.with_context(|| format!("cannot write {}", path.display()))
}

/// The file's columns: their names and what each holds. Positions sit where they say; named
/// columns fill the free places in order; a gap is an unused column.
fn layout(schema: &ClickLogSchema) -> (Vec<String>, Vec<Content>) {
    let mut contents: Vec<Option<(Content, String)>> = Vec::new();
    let mut named = Vec::new();
    for (role, column) in schema.columns() {
        let content = Some(role);
        match column {
            ColumnRef::Position(p) => {
                if contents.len() <= *p {
                    contents.resize(p + 1, None);
                }
                contents[*p] = Some((content, format!("column_{p}")));
            }
            ColumnRef::Name(name) => named.push((content, name.clone())),
        }
    }
    let mut named = named.into_iter();
    for place in contents.iter_mut().filter(|c| c.is_none()) {
        *place = named.next();
    }
    contents.extend(named.map(Some));
    contents
        .into_iter()
        .enumerate()
        .map(|(p, c)| c.unwrap_or((None, format!("unused_{p}"))))
        .map(|(content, name)| (name, content))
        .unzip()
}

/// The text of one cell of `record` (`later(k)`: the record `k` after it); `None` is empty.
fn cell(
    schema: &ClickLogSchema,
    content: Content,
    record: &CtrRecord,
    later: &dyn Fn(u64) -> CtrRecord,
) -> Option<String> {
    match content {
        Some(ColumnRole::Label) => Some(u8::from(record.label).to_string()),
        Some(ColumnRole::Dense(j)) => record.dense[j % DENSE_FEATURES].map(|v| v.to_string()),
        Some(ColumnRole::Slot(s)) => {
            let spec = &schema.slots[s];
            let first = record.sparse[s % SPARSE_SLOTS]?;
            let mut values = vec![slot_text(spec, first)];
            if let Some(separator) = &spec.separator {
                let more = u64::from(first % 3);
                values.extend(
                    (1..=more)
                        .filter_map(|k| later(k).sparse[s % SPARSE_SLOTS])
                        .map(|v| slot_text(spec, v)),
                );
                return Some(values.join(separator));
            }
            values.pop()
        }
        None => None,
    }
}

/// A generated 32-bit value as a slot of `spec` reads it.
fn slot_text(spec: &SlotSpec, value: u32) -> String {
    match spec.ids {
        SlotIds::Hex => format!("{value:08x}"),
        SlotIds::Integer => (u64::from(value) % spec.codes()).to_string(),
        SlotIds::Hash => format!("v{value:x}"),
    }
}

fn write_text(
    path: &Path,
    format: ClickLogFormat,
    header: Option<&[String]>,
    records: Range<u64>,
    cells: impl Fn(u64) -> Vec<Option<String>>,
) -> Result<()> {
    let delimiter = if format == ClickLogFormat::Csv { "," } else { "\t" };
    let quote = |text: &str| match format == ClickLogFormat::Csv && text.contains([',', '"']) {
        true => format!("\"{}\"", text.replace('"', "\"\"")),
        false => text.to_string(),
    };
    let file = BufWriter::with_capacity(1 << 16, File::create(path)?);
    let mut out: Box<dyn Write> = match is_gzip(path) {
        true => Box::new(GzEncoder::new(file, Compression::default())),
        false => Box::new(file),
    };
    if let Some(names) = header {
        let names: Vec<String> = names.iter().map(|n| quote(n)).collect();
        writeln!(out, "{}", names.join(delimiter))?;
    }
    for index in records {
        let line: Vec<String> = cells(index).iter().map(|c| quote(c.as_deref().unwrap_or(""))).collect();
        writeln!(out, "{}", line.join(delimiter))?;
    }
    out.flush()?;
    Ok(())
}

/// Every column an optional UTF-8 string: the reader reads numbers from their text alike.
fn write_parquet(
    path: &Path,
    names: &[String],
    records: Range<u64>,
    cells: impl Fn(u64) -> Vec<Option<String>>,
) -> Result<()> {
    if let Some(name) = names
        .iter()
        .find(|n| !n.chars().all(|c| c.is_alphanumeric() || c == '_'))
    {
        bail!("column {name:?}: the generator writes Parquet columns named by letters, digits and '_' only");
    }
    let fields: String = names.iter().map(|n| format!("optional binary {n} (UTF8); ")).collect();
    let schema = Arc::new(parse_message_type(&format!("message click_log {{ {fields} }}"))?);
    let properties = Arc::new(WriterProperties::builder().build());
    let mut writer = SerializedFileWriter::new(File::create(path)?, schema, properties)?;
    let mut start = records.start;
    while start < records.end {
        let end = (start + CHUNK).min(records.end);
        let rows: Vec<Vec<Option<String>>> = (start..end).map(&cells).collect();
        let mut group = writer.next_row_group()?;
        for column in 0..names.len() {
            let mut out = group.next_column()?.context("a column the schema has")?;
            let present: Vec<ByteArray> = (rows.iter().filter_map(|r| r[column].as_deref()))
                .map(ByteArray::from)
                .collect();
            let levels: Vec<i16> = rows.iter().map(|r| i16::from(r[column].is_some())).collect();
            out.typed::<ByteArrayType>()
                .write_batch(&present, Some(&levels), None)?;
            out.close()?;
        }
        group.close()?;
        start = end;
    }
    writer.close()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::ctr::{ClickLogParser, ClickLogReader, CtrSource};

    #[test]
    fn columns_sit_at_their_positions_and_names_fill_the_gaps() {
        let schema = ClickLogSchema {
            label: ColumnRef::Position(2),
            dense: vec![ColumnRef::Name("price".into())],
            slots: vec![SlotSpec::new(ColumnRef::Name("user".into()), SlotIds::Hash)],
            ..ClickLogSchema::default()
        };
        let (names, contents) = layout(&schema);
        assert_eq!(names, ["price", "user", "column_2"]);
        assert_eq!(
            contents,
            [
                Some(ColumnRole::Dense(0)),
                Some(ColumnRole::Slot(0)),
                Some(ColumnRole::Label)
            ]
        );
    }

    #[test]
    fn a_generated_criteo_log_reads_as_the_generator_s_records() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("day.tsv");
        let synth = CriteoSynth::new(5, 1000);
        write_click_log(&path, &ClickLogSchema::criteo(), &synth, Split::Test, 0..40)?;
        let parser = Arc::new(ClickLogParser::new(ClickLogSchema::criteo()));
        let mut reader = ClickLogReader::open(vec![path.clone()], parser.clone())?;
        for i in 0..40 {
            assert_eq!(reader.next_record()?, Some(synth.record(Split::Test, i).example()));
        }
        let source = CtrSource::Files {
            files: vec![path],
            parser,
        };
        assert_eq!(source.records_per_epoch()?, 40);
        Ok(())
    }
}
