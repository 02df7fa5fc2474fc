//! Parquet tables: a file opened for the columns a model reads (integers or floating-point
//! numbers, checked against its schema), its rows decoded with a projection of those columns.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

use super::row_file::RowFile;
use super::{Columns, Layout, Rows};

/// A Parquet file opened for the columns a model reads.
pub(crate) struct ParquetColumns {
    pub(super) reader: parquet::file::reader::SerializedFileReader<std::fs::File>,
    pub(super) header: Vec<String>,
    pub(super) layout: Layout,
    /// The columns decoded, in the file's order: a decoded row holds them so.
    read: Vec<usize>,
    /// The schema of the columns decoded.
    pub(super) projection: parquet::schema::types::Type,
}

impl ParquetColumns {
    /// The Parquet file at `path`, its `columns` found and checked to be of integers or
    /// floating-point numbers.
    pub(super) fn open(path: &Path, columns: Columns) -> Result<Self> {
        use parquet::file::reader::{FileReader, SerializedFileReader};

        let file = std::fs::File::open(path).context("cannot open it")?;
        let reader = SerializedFileReader::new(file).context("not a readable Parquet file")?;
        let schema = reader.metadata().file_metadata().schema();
        let fields = schema.get_fields();
        let header: Vec<String> = fields.iter().map(|f| f.name().to_string()).collect();
        let layout = Layout::find(&header, columns, "column")?;
        for column in layout.read() {
            let field = &fields[column];
            let numeric = field.is_primitive()
                && matches!(
                    field.get_physical_type(),
                    parquet::basic::Type::INT32
                        | parquet::basic::Type::INT64
                        | parquet::basic::Type::FLOAT
                        | parquet::basic::Type::DOUBLE
                )
                && field
                    .get_basic_info()
                    .logical_type_ref()
                    .is_none_or(|logical| matches!(logical, parquet::basic::LogicalType::Integer { .. }));
            ensure!(
                numeric,
                "column {:?} is not numbers: its schema is `{}`",
                header[column],
                schema_line(field)
            );
        }
        let mut read: Vec<usize> = layout.read().collect();
        read.sort_unstable();
        read.dedup();
        let projection = parquet::schema::types::Type::group_type_builder(schema.name())
            .with_fields(read.iter().map(|&column| fields[column].clone()).collect())
            .build()
            .context("projecting the columns read")?;
        Ok(Self {
            reader,
            header,
            layout,
            read,
            projection,
        })
    }

    /// Rows in the file.
    pub(super) fn rows(&self) -> u64 {
        use parquet::file::reader::FileReader;
        self.reader.metadata().file_metadata().num_rows().max(0) as u64
    }

    /// The values of `row`, decoded with the projection and numbered `number` from 1 in errors.
    pub(super) fn values(
        &self,
        row: parquet::errors::Result<parquet::record::Row>,
        number: u64,
        regression: bool,
    ) -> Result<Vec<f32>> {
        use parquet::record::Field;

        let cells = row
            .with_context(|| format!("row {number}: cannot be decoded"))?
            .into_columns();
        let header = &self.header;
        let at = || format!("row {number}");
        self.layout.values(regression, header, &at, |column| {
            let place = self.read.binary_search(&column).unwrap_or_default();
            let value = match &cells[place].1 {
                Field::Int(v) => *v as f32,
                Field::Long(v) => *v as f32,
                Field::Float(v) => *v,
                Field::Double(v) => *v as f32,
                Field::Byte(v) => f32::from(*v),
                Field::Short(v) => f32::from(*v),
                Field::UByte(v) => f32::from(*v),
                Field::UShort(v) => f32::from(*v),
                Field::UInt(v) => *v as f32,
                Field::ULong(v) => *v as f32,
                other => bail!("row {number}, column {:?}: {other} is not a number", header[column]),
            };
            ensure!(
                value.is_finite(),
                "row {number}, column {:?}: {value} is not a finite number",
                header[column]
            );
            Ok(value)
        })
    }
}

/// Appends the rows of the Parquet file at `path` to `rows`: its top-level columns of
/// integers or floating-point numbers.
pub(super) fn read_parquet(path: &Path, columns: Columns, rows: &mut Rows) -> Result<()> {
    use parquet::file::reader::FileReader;

    let table = ParquetColumns::open(path, columns)?;
    rows.take_features(table.layout.feature_names(&table.header), table.layout.features.len())?;
    let read = table
        .reader
        .get_row_iter(Some(table.projection.clone()))
        .context("cannot read its rows")?;
    for (index, row) in read.enumerate() {
        rows.push(table.values(row, index as u64 + 1, columns.regression)?);
    }
    Ok(())
}

/// A schema field as Parquet's message syntax prints it, on one line.
fn schema_line(field: &parquet::schema::types::Type) -> String {
    let mut text = Vec::new();
    parquet::schema::printer::print_schema(&mut text, field);
    String::from_utf8_lossy(&text)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

impl RowFile for ParquetColumns {
    fn open(path: &Path, columns: Columns) -> Result<Self> {
        ParquetColumns::open(path, columns)
    }

    fn rows(&self) -> u64 {
        ParquetColumns::rows(self)
    }

    /// The row group holding `row`.
    fn block_of(&self, row: u64, regression: bool) -> Result<(u64, Vec<Vec<f32>>)> {
        use parquet::file::reader::FileReader;

        let metadata = self.reader.metadata();
        let mut first = 0u64;
        for index in 0..metadata.num_row_groups() {
            let rows = metadata.row_group(index).num_rows().max(0) as u64;
            if row < first + rows {
                let unreadable = || format!("cannot read row group {index}");
                let group = self.reader.get_row_group(index).with_context(unreadable)?;
                let values = group
                    .get_row_iter(Some(self.projection.clone()))
                    .with_context(unreadable)?
                    .enumerate()
                    .map(|(i, decoded)| self.values(decoded, first + i as u64 + 1, regression))
                    .collect::<Result<_>>()?;
                return Ok((first, values));
            }
            first += rows;
        }
        bail!("no row {} in a file of {first} rows", row + 1)
    }
}
