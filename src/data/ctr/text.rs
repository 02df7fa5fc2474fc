//! Click logs in text: TSV (Criteo's layout, or any) and CSV lines, read by a schema
//! ([`ClickLogParser`]) into model inputs. A file with a header has its columns named by its
//! first line, read once per file, also for a part that starts inside the file; errors carry
//! `path:line` (the file's own line numbers: the header is line 1).

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};

use super::lines::LineReader;
use super::schema::{Cell, ColumnRoles};
use super::{ClickLogParser, CtrExample};
use crate::config::ClickLogFormat;
use crate::data::parts::cut::Segment;
use crate::data::parts::text::buffered;
use crate::data::parts::ReadPosition;

/// Streams the records of click-log text files, or of byte ranges of them, in order.
#[derive(Debug)]
pub struct ClickLogReader {
    lines: LineReader,
    parser: Arc<ClickLogParser>,
    /// Each file's format and column roles, found when the reader opened.
    files: HashMap<PathBuf, (ClickLogFormat, Arc<ColumnRoles>)>,
}

impl ClickLogReader {
    /// A reader of whole `files` in `parser`'s columns, positioned at the start of the first;
    /// every file must exist and have the columns now, so a typo fails at start-up rather than
    /// mid-epoch.
    pub fn open(files: Vec<PathBuf>, parser: Arc<ClickLogParser>) -> Result<Self> {
        Self::open_segments(files.iter().map(|path| Segment::whole(path)).collect(), parser)
    }

    /// A reader of the records whose lines begin in each of `segments`, in order.
    pub(crate) fn open_segments(segments: Vec<Segment>, parser: Arc<ClickLogParser>) -> Result<Self> {
        let mut files = HashMap::new();
        for segment in &segments {
            if !files.contains_key(&segment.path) {
                let format = text_format(&parser, &segment.path)?;
                let roles = file_roles(&parser, &segment.path, format)?;
                files.insert(segment.path.clone(), (format, Arc::new(roles)));
            }
        }
        Ok(Self {
            lines: LineReader::open_segments(segments)?,
            parser,
            files,
        })
    }

    /// The next record, or `None` after the last line of the last segment. Errors carry
    /// `path:line:`.
    pub fn next_record(&mut self) -> Result<Option<CtrExample>> {
        if !self.next_record_line()? {
            return Ok(None);
        }
        let location = || self.lines.location();
        let text = std::str::from_utf8(self.lines.line()).map_err(|e| anyhow!("{}: not UTF-8: {e}", location()))?;
        let text = text.trim_end_matches(['\n', '\r']);
        let path = &self.lines.segment().context("a line past the last segment")?.path;
        let (format, roles) = &self.files[path];
        let fields = split_fields(text, *format).map_err(|e| anyhow!("{}: {e}", location()))?;
        let expected = roles.expected_columns();
        let count_fits = match roles.header {
            Some(_) => fields.len() == expected,
            None => fields.len() >= expected,
        };
        if !count_fits {
            let at_least = if roles.header.is_some() { "" } else { "at least " };
            bail!(
                "{}: expected {at_least}{expected} {} columns, found {}",
                location(),
                separated(*format),
                fields.len()
            );
        }
        let example = self
            .parser
            .example(roles, |c| Cell::Text(fields[c].clone()))
            .map_err(|e| anyhow!("{}: {e}", location()))?;
        Ok(Some(example))
    }

    /// Passes over the next record without parsing it; false after the last line of the last
    /// segment.
    pub fn skip_record(&mut self) -> Result<bool> {
        self.next_record_line()
    }

    /// Goes back to the start of the first segment, for the next epoch.
    pub fn rewind(&mut self) -> Result<()> {
        self.lines.rewind()
    }

    /// Where the reader is.
    pub fn position(&self) -> ReadPosition {
        self.lines.position()
    }

    /// Goes to `at`, a [`position`](Self::position) of a reader of the same segments.
    pub fn seek(&mut self, at: ReadPosition) -> Result<()> {
        self.lines.seek(at)
    }

    /// Reads the next line that is a record (a header is not); false at the end.
    fn next_record_line(&mut self) -> Result<bool> {
        loop {
            if !self.lines.next_line()? {
                return Ok(false);
            }
            if !(self.parser.schema().header && self.lines.is_first_line_of_file()) {
                return Ok(true);
            }
        }
    }
}

/// The text format of `path`: the schema's, or its name's; Parquet is not text.
fn text_format(parser: &ClickLogParser, path: &Path) -> Result<ClickLogFormat> {
    match parser.schema().format.unwrap_or_else(|| ClickLogFormat::of_path(path)) {
        ClickLogFormat::Parquet => bail!("{} is Parquet, not a text click log", path.display()),
        text => Ok(text),
    }
}

/// The roles of `path`'s columns: named by its first non-empty line where files have a header.
fn file_roles(parser: &ClickLogParser, path: &Path, format: ClickLogFormat) -> Result<ColumnRoles> {
    let header = match parser.schema().header {
        false => None,
        true => Some(read_header(path, format)?),
    };
    parser
        .roles(header.as_deref())
        .map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// The column names of `path`'s first non-empty line.
fn read_header(path: &Path, format: ClickLogFormat) -> Result<Vec<String>> {
    let file = std::fs::File::open(path).with_context(|| format!("cannot open click log {}", path.display()))?;
    let mut reader = buffered(path, file);
    let mut line = String::new();
    while line.trim_end_matches(['\n', '\r']).is_empty() {
        line.clear();
        let read = reader
            .read_line(&mut line)
            .with_context(|| format!("{}: cannot read its header", path.display()))?;
        if read == 0 {
            bail!(
                "{}: no header line (train.click_log.header = true), the file is empty",
                path.display()
            );
        }
    }
    let fields = split_fields(line.trim_end_matches(['\n', '\r']), format)
        .map_err(|e| anyhow!("{}:1: the header: {e}", path.display()))?;
    Ok(fields.into_iter().map(|f| f.trim().to_string()).collect())
}

/// "tab-separated" or "comma-separated".
fn separated(format: ClickLogFormat) -> &'static str {
    match format {
        ClickLogFormat::Csv => "comma-separated",
        _ => "tab-separated",
    }
}

/// The fields of one line: TSV split at tabs; CSV at commas outside quotes, a quoted field's
/// `""` read as one quote. A quote left open is an error (quoted line breaks are not read).
fn split_fields(line: &str, format: ClickLogFormat) -> Result<Vec<Cow<'_, str>>, String> {
    if format != ClickLogFormat::Csv {
        return Ok(line.split('\t').map(Cow::Borrowed).collect());
    }
    if !line.contains('"') {
        return Ok(line.split(',').map(Cow::Borrowed).collect());
    }
    let mut fields = Vec::new();
    let mut rest = line;
    loop {
        let Some(quoted) = rest.strip_prefix('"') else {
            let end = rest.find(',').unwrap_or(rest.len());
            fields.push(Cow::Borrowed(&rest[..end]));
            if end == rest.len() {
                return Ok(fields);
            }
            rest = &rest[end + 1..];
            continue;
        };
        let mut value = String::new();
        let mut chars = quoted.char_indices();
        let after = loop {
            match chars.next() {
                Some((i, '"')) if quoted[i + 1..].starts_with('"') => {
                    value.push('"');
                    chars.next();
                }
                Some((i, '"')) => break &quoted[i + 1..],
                Some((_, c)) => value.push(c),
                None => {
                    return Err(format!(
                        "field {} opens a quote that the line does not close (quoted line breaks are not read)",
                        fields.len()
                    ))
                }
            }
        };
        fields.push(Cow::Owned(value));
        match after.strip_prefix(',') {
            Some(next) => rest = next,
            None if after.is_empty() => return Ok(fields),
            None => return Err(format!("field {} has text after its closing quote", fields.len() - 1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ClickLogSchema, ColumnRef, SlotIds, SlotSpec};
    use crate::data::ctr::{feature_id, write_synthetic, CriteoSynth, Split, DENSE_FEATURES};
    use crate::data::parts::text::count_records;

    fn criteo() -> Arc<ClickLogParser> {
        Arc::new(ClickLogParser::new(ClickLogSchema::criteo()))
    }

    /// A Criteo line with `value` in (0-based) `column`.
    fn line_with(column: usize, value: &str) -> String {
        let mut fields = vec![String::new(); 40];
        fields[0] = "0".into();
        fields[column] = value.into();
        fields.join("\t")
    }

    fn read_all(reader: &mut ClickLogReader) -> Result<Vec<CtrExample>> {
        std::iter::from_fn(|| reader.next_record().transpose()).collect()
    }

    #[test]
    fn criteo_files_read_as_the_generator_wrote_them_plain_or_gzip() -> Result<()> {
        let synth = CriteoSynth::new(3, 5000);
        let dir = tempfile::tempdir()?;
        let (plain, packed) = (dir.path().join("train.tsv"), dir.path().join("train.tsv.gz"));
        write_synthetic(&plain, &synth, Split::Train, 0..300)?;
        write_synthetic(&packed, &synth, Split::Train, 0..300)?;
        let expected: Vec<CtrExample> = (0..300).map(|i| synth.record(Split::Train, i).example()).collect();
        assert_eq!(read_all(&mut ClickLogReader::open(vec![plain], criteo())?)?, expected);
        assert_eq!(
            read_all(&mut ClickLogReader::open(vec![packed.clone()], criteo())?)?,
            expected
        );

        let bytes = std::fs::read(&packed)?;
        let cut = dir.path().join("cut.tsv.gz");
        std::fs::write(&cut, &bytes[..bytes.len() / 2])?;
        let error = format!(
            "{:#}",
            read_all(&mut ClickLogReader::open(vec![cut.clone()], criteo())?).unwrap_err()
        );
        assert!(
            error.starts_with(&format!("{}:", cut.display())) && error.contains("cannot read"),
            "{error}"
        );
        Ok(())
    }

    #[test]
    fn errors_name_the_file_line_and_column() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let (a, b) = (dir.path().join("a.tsv"), dir.path().join("b.tsv"));
        std::fs::write(&a, format!("{}\n\n{}\r\n", line_with(1, "1"), line_with(1, "2")))?;
        std::fs::write(&b, format!("{}\n{}", line_with(1, "3"), line_with(14, "xyz")))?;
        let mut reader = ClickLogReader::open(vec![a.clone(), b.clone()], criteo())?;
        for expected in [1.0f32, 2.0, 3.0] {
            let dense = reader.next_record()?.context("a record")?.dense[0];
            assert_eq!(dense, (expected + 1.0).ln());
        }
        let bad = reader.next_record().unwrap_err().to_string();
        assert_eq!(
            bad,
            format!("{}:2: column 14 (slot 0): \"xyz\" is not hexadecimal", b.display())
        );
        assert!(!reader.skip_record()?);
        reader.rewind()?;
        assert!(reader.skip_record()?);
        assert_eq!(reader.next_record()?.context("a record")?.dense[0], 3f32.ln());

        let short = line_with(1, "1");
        std::fs::write(&a, &short[..short.rfind('\t').unwrap_or(0)])?;
        let err = ClickLogReader::open(vec![a.clone()], criteo())?
            .next_record()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}:1: expected at least 40 tab-separated columns, found 39",
                a.display()
            )
        );
        std::fs::write(&a, line_with(0, "2"))?;
        let err = ClickLogReader::open(vec![a.clone()], criteo())?
            .next_record()
            .unwrap_err();
        assert!(
            err.to_string()
                .ends_with("column 0 (label): \"2\" is not a click label: it must be 0 or 1"),
            "{err}"
        );
        let missing = PathBuf::from("/nonexistent/day_0.tsv");
        let err = ClickLogReader::open(vec![missing], criteo()).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/day_0.tsv"), "{err}");
        Ok(())
    }

    #[test]
    fn csv_with_a_header_is_read_by_name_in_every_part_of_a_file() -> Result<()> {
        let mut tags = SlotSpec::new(ColumnRef::Name("tags".into()), SlotIds::Hash);
        tags.separator = Some(";".into());
        let parser = Arc::new(ClickLogParser::new(ClickLogSchema {
            header: true,
            label: ColumnRef::Name("click".into()),
            dense: vec![ColumnRef::Name("price".into())],
            slots: vec![SlotSpec::new(ColumnRef::Name("ad".into()), SlotIds::Hex), tags],
            ..ClickLogSchema::default()
        }));
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("log.csv");
        let mut text = "ad,\"tags\",click,price\r\n".to_string();
        for i in 0..50 {
            text.push_str(&format!("{i:x},\"a;b,{i}\",{},{i}\r\n", i % 2));
        }
        std::fs::write(&path, &text)?;
        assert_eq!(count_records(&path)?, 51, "lines, the header among them");
        let whole = read_all(&mut ClickLogReader::open(vec![path.clone()], parser.clone())?)?;
        assert_eq!(whole.len(), 50);
        assert_eq!(whole[7].label, 1.0);
        assert_eq!(whole[7].ids[0], feature_id(0, Some(7)));
        assert_eq!(whole[7].ids.len(), 3, "tags \"a\" and \"b,7\"");
        assert_eq!(whole[7].slot_ends, [1, 3]);
        // Cut into byte ranges, the parts read every record once and the header never.
        let parts = crate::data::parts::cut::cut_into_parts(std::slice::from_ref(&path), 3)?;
        let mut pieces = Vec::new();
        for segments in parts {
            pieces.extend(read_all(&mut ClickLogReader::open_segments(segments, parser.clone())?)?);
        }
        assert_eq!(pieces, whole);

        std::fs::write(&path, "ad,click,price\n1,0,1\n")?;
        let err = ClickLogReader::open(vec![path.clone()], parser.clone())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("the slot 1 column \"tags\" is not among the file's columns"),
            "{err}"
        );
        std::fs::write(&path, "ad,tags,click,price\n1,\"x,0,1\n")?;
        let err = ClickLogReader::open(vec![path.clone()], parser)?
            .next_record()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(":2: field 1 opens a quote that the line does not close"),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn fields_split_as_csv_quotes_them() {
        let split = |line| split_fields(line, ClickLogFormat::Csv);
        assert_eq!(split("a,\"b,c\",\"d\"\"e\",").unwrap(), ["a", "b,c", "d\"e", ""]);
        assert_eq!(
            split("\"a\"x,b").unwrap_err(),
            "field 0 has text after its closing quote"
        );
        assert_eq!(split_fields("a,b\tc", ClickLogFormat::Tsv).unwrap(), ["a,b", "c"]);
        assert_eq!(DENSE_FEATURES, 13);
    }
}
