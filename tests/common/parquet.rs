//! Parquet files for tests, written with the `parquet` crate's own writer.

use std::path::Path;
use std::sync::Arc;

use parquet::data_type::{ByteArray, ByteArrayType, DoubleType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

/// The values of one column.
pub enum Column {
    Doubles(Vec<f64>),
    Longs(Vec<i64>),
    Texts(Vec<String>),
}

impl Column {
    fn schema(&self, name: &str) -> String {
        match self {
            Self::Doubles(_) => format!("required double {name};"),
            Self::Longs(_) => format!("required int64 {name};"),
            Self::Texts(_) => format!("required binary {name} (UTF8);"),
        }
    }

    fn slice(&self, rows: std::ops::Range<usize>) -> Self {
        match self {
            Self::Doubles(v) => Self::Doubles(v[rows].to_vec()),
            Self::Longs(v) => Self::Longs(v[rows].to_vec()),
            Self::Texts(v) => Self::Texts(v[rows].to_vec()),
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::Doubles(v) => v.len(),
            Self::Longs(v) => v.len(),
            Self::Texts(v) => v.len(),
        }
    }
}

/// Writes `columns` (of equal lengths) as a Parquet file at `path`, `group_rows` rows a row
/// group, snappy-compressed as pyarrow writes by default.
pub fn write_parquet(path: &Path, columns: &[(&str, Column)], group_rows: usize) {
    let fields: String = columns.iter().map(|(name, column)| column.schema(name)).collect();
    let schema = Arc::new(parse_message_type(&format!("message table {{ {fields} }}")).unwrap());
    let properties = Arc::new(
        WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .build(),
    );
    let file = std::fs::File::create(path).unwrap();
    let mut writer = SerializedFileWriter::new(file, schema, properties).unwrap();
    let rows = columns[0].1.len();
    for start in (0..rows).step_by(group_rows) {
        let range = start..(start + group_rows).min(rows);
        let mut group = writer.next_row_group().unwrap();
        for (_, column) in columns {
            let mut out = group.next_column().unwrap().unwrap();
            match column.slice(range.clone()) {
                Column::Doubles(v) => out.typed::<DoubleType>().write_batch(&v, None, None),
                Column::Longs(v) => out.typed::<Int64Type>().write_batch(&v, None, None),
                Column::Texts(v) => {
                    let bytes: Vec<ByteArray> = v.iter().map(|s| ByteArray::from(s.as_str())).collect();
                    out.typed::<ByteArrayType>().write_batch(&bytes, None, None)
                }
            }
            .unwrap();
            out.close().unwrap();
        }
        group.close().unwrap();
    }
    writer.close().unwrap();
}
