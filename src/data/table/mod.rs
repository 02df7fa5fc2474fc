//! Tables of the user's own: CSV files with a header row, or Parquet files, read into a
//! [`Dataset`] of the feature columns and one label column the config names. Every file of a
//! split must have the columns, each named once; a cell that is not a number is an error naming
//! the file, the line (the file's own: the header is line 1, whether lines end in `\n` or
//! `\r\n`) or row, and the column, a Parquet column of another type its schema.

mod array_file;
mod parquet;
mod row_file;
mod stream;

use std::io::{BufReader, Read as _, Seek as _, SeekFrom};
use std::path::Path;

use anyhow::{anyhow, bail, ensure, Context, Result};

use super::Dataset;
use parquet::{read_parquet, ParquetColumns};
pub use stream::StreamedTable;
pub(crate) use stream::TableStream;

/// Which columns of a table the model reads and predicts.
#[derive(Debug, Clone, Copy)]
pub struct Columns<'a> {
    /// The column to predict (`train.label_column`); none when only features are read (to
    /// predict them).
    pub label: Option<&'a str>,
    /// The inputs, in this order (`train.feature_columns`); every other column when `None`.
    pub features: Option<&'a [String]>,
    /// Whether the label is a value to regress rather than a class id.
    pub regression: bool,
}

/// Rows read from tables: features row-major, a label per row.
#[derive(Debug, Default)]
struct Rows {
    features: Vec<f32>,
    labels: Vec<f32>,
    /// The feature columns' names, in the order read.
    names: Vec<String>,
    dim: usize,
}

/// The splits of a table, and the columns a model of it reads.
#[derive(Debug)]
pub struct TableSplits {
    /// Rows to train on.
    pub train: Dataset,
    /// Rows held out.
    pub test: Dataset,
    /// The feature columns, in the order of a row's inputs.
    pub feature_columns: Vec<String>,
}

/// The file format of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableFormat {
    /// Comma-separated values with a header row.
    Csv,
    /// Apache Parquet: columns of integers or floating-point numbers.
    Parquet,
    /// Named arrays — safetensors, or NumPy's `.npz` — each of one value per row (`(n)`) or
    /// of `k` (`(n, k)`, `k` feature columns).
    Arrays,
}

impl TableFormat {
    /// The format a path says: `.parquet` or `.pq` is Parquet, `.safetensors`, `.npz` or a
    /// directory (of `.npy` files) named arrays, anything else CSV.
    pub fn of_path(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some("parquet" | "pq") => Self::Parquet,
            Some("safetensors" | "npz" | "npy") => Self::Arrays,
            _ if path.is_dir() => Self::Arrays,
            _ => Self::Csv,
        }
    }
}

/// The rows of `files` in `format` (each in the format its name says when `None`), read in
/// order.
fn read_files(files: &[String], format: Option<TableFormat>, columns: Columns, key: &str) -> Result<Rows> {
    ensure!(!files.is_empty(), "{key}: no files given");
    let mut rows = Rows::default();
    for file in files {
        let path = Path::new(file);
        match format.unwrap_or_else(|| TableFormat::of_path(path)) {
            TableFormat::Csv => read_csv(path, columns, &mut rows),
            TableFormat::Parquet => read_parquet(path, columns, &mut rows),
            TableFormat::Arrays => read_arrays(path, columns, &mut rows),
        }
        .with_context(|| format!("{key}: {file}"))?;
    }
    ensure!(!rows.features.is_empty(), "{key}: the files hold no rows");
    Ok(rows)
}

/// Rows of features, row-major, a piece of rows at a time.
pub type FeaturePieces = Box<dyn Iterator<Item = Result<Vec<f32>>>>;

/// The feature columns `features` (every column when `None`) of the table `file`, in the
/// format its name says ([`TableFormat::of_path`]): the values per row, and the rows'
/// values row-major `piece_rows` rows at a time — streamed, but for `.npz` archives (and a
/// lone `.npy` file, refused with how to pair it), which are read whole.
pub fn feature_pieces(file: &str, features: Option<&[String]>, piece_rows: usize) -> Result<(usize, FeaturePieces)> {
    let columns = Columns {
        label: None,
        features,
        regression: true,
    };
    let piece_rows = piece_rows.max(1);
    let path = Path::new(file);
    let archive = matches!(path.extension().and_then(|e| e.to_str()), Some("npz" | "npy"));
    match TableFormat::of_path(path) {
        TableFormat::Arrays if archive => {
            let rows = read_files(&[file.to_string()], None, columns, "the data")?;
            let pieces: Vec<Vec<f32>> = rows
                .features
                .chunks(piece_rows * rows.dim)
                .map(<[f32]>::to_vec)
                .collect();
            Ok((rows.dim, Box::new(pieces.into_iter().map(Ok))))
        }
        format => {
            let layout = crate::data::parts::DataLayout::WHOLE;
            let table = StreamedTable::open(format, &[file.to_string()], columns, layout, "the data")?;
            Ok((table.dim, Box::new(table.feature_pieces(piece_rows)?)))
        }
    }
}

/// Where the columns a model reads are in a table's `header`, by index.
#[derive(Debug)]
struct Layout {
    label: Option<usize>,
    features: Vec<usize>,
}

impl Layout {
    /// The layout of `columns` in `header`, one value a column; the first file read sets the
    /// feature columns of `rows`, and every later one must have as many.
    fn of(header: &[String], columns: Columns, rows: &mut Rows) -> Result<Self> {
        let layout = Self::find(header, columns, "column")?;
        rows.take_features(layout.feature_names(header), layout.features.len())?;
        Ok(layout)
    }

    /// The names of the feature columns, in `header`.
    fn feature_names(&self, header: &[String]) -> Vec<String> {
        self.features.iter().map(|&i| header[i].clone()).collect()
    }

    /// Where `columns` are among `names`, a file's `what`s (columns, or arrays): the features
    /// are every other one when none are given. A name given twice in the file is refused (which
    /// of the two is meant?), and so is a label among the features (the model would read the
    /// answer it is to predict).
    fn find(names: &[String], columns: Columns, what: &str) -> Result<Self> {
        if let (Some(label), Some(features)) = (columns.label, columns.features) {
            ensure!(
                !features.iter().any(|name| name == label),
                "train.label_column {label:?} is also in train.feature_columns: a model must not read the {what} it predicts"
            );
        }
        let mut seen = std::collections::HashMap::with_capacity(names.len());
        for (second, name) in names.iter().enumerate() {
            if let Some(first) = seen.insert(name.as_str(), second) {
                bail!(
                    "{what}s {} and {} (counted from 1) are both named {name:?}: a {what} must be named once",
                    first + 1,
                    second + 1
                );
            }
        }
        let find = |name: &str, key: &str| {
            names
                .iter()
                .position(|n| n == name)
                .with_context(|| format!("no {what} {name:?} ({key}); its {what}s are {}", names.join(", ")))
        };
        let label = columns.label.map(|name| find(name, "train.label_column")).transpose()?;
        let features: Vec<usize> = match columns.features {
            Some(wanted) => wanted
                .iter()
                .map(|name| find(name, "train.feature_columns"))
                .collect::<Result<_>>()?,
            None => (0..names.len()).filter(|&i| Some(i) != label).collect(),
        };
        ensure!(!features.is_empty(), "no feature {what}s besides the label");
        Ok(Self { label, features })
    }

    /// The columns read, the features' then the label's.
    fn read(&self) -> impl Iterator<Item = usize> + '_ {
        self.features.iter().copied().chain(self.label)
    }

    /// One row's values, its cells read by `cell` (by column index): the features', then the
    /// label's; `at` names the row in errors.
    fn values(
        &self,
        regression: bool,
        header: &[String],
        at: &dyn Fn() -> String,
        mut cell: impl FnMut(usize) -> Result<f32>,
    ) -> Result<Vec<f32>> {
        let mut values = Vec::with_capacity(self.features.len() + 1);
        for &column in &self.features {
            values.push(cell(column)?);
        }
        if let Some(label) = self.label {
            let at = || format!("{}, column {:?}", at(), header[label]);
            values.push(label_value(cell(label)?, regression, &at)?);
        }
        Ok(values)
    }
}

impl Rows {
    /// The rows as a data set of `outputs` classes, or of values when `columns` regress.
    fn into_dataset(self, columns: Columns, outputs: usize) -> Result<Dataset> {
        if columns.regression {
            Dataset::regression(self.features, self.labels, self.dim, 1)
        } else {
            let classes = self.labels.iter().map(|&l| l as u32).collect();
            Dataset::new(self.features, classes, self.dim, outputs)
        }
    }

    /// Appends a row of [`Layout::values`]: `dim` features, then the label when there is one.
    fn push(&mut self, mut values: Vec<f32>) {
        if values.len() > self.dim {
            self.labels.extend(values.pop());
        }
        self.features.extend_from_slice(&values);
    }

    /// Takes `names` (`dim` values a row) as the features of the rows read: the first file read
    /// sets them, and every later one must have as many.
    fn take_features(&mut self, names: Vec<String>, dim: usize) -> Result<()> {
        if self.dim == 0 {
            self.dim = dim;
            self.names = names;
        }
        ensure!(
            self.dim == dim,
            "{dim} feature columns, where the files before had {}",
            self.dim
        );
        Ok(())
    }
}

/// `value`, the label of a row `at` names, checked: a class id unless `regression`.
fn label_value(value: f32, regression: bool, at: &dyn Fn() -> String) -> Result<f32> {
    let class_id = value >= 0.0 && value.fract() == 0.0 && value < (1 << 24) as f32;
    if !regression && !class_id {
        bail!(
            "{}: {value} is not a class id (a whole number from 0); to regress values set train.loss = \"mse\"",
            at()
        );
    }
    Ok(value)
}

/// Reads CSV with a header row, cells trimmed, as the in-memory and the streamed reader both do.
fn csv_reader<R: std::io::Read>(input: R, has_headers: bool) -> csv::Reader<R> {
    csv::ReaderBuilder::new()
        .has_headers(has_headers)
        .trim(csv::Trim::All)
        .from_reader(input)
}

/// A CSV file's header row.
fn csv_header(reader: &mut csv::Reader<impl std::io::Read>) -> Result<Vec<String>> {
    Ok(reader
        .headers()
        .context("cannot read its header row")?
        .iter()
        .map(str::to_string)
        .collect())
}

/// The line a CSV record begins on, counted as the csv reader counts from byte `base` of the
/// file at `path` (from the file's start, the header is line 1), where the reader marked it at
/// `mark`. The reader marks a record where it began looking for it: before the `\n` of the
/// line before's `\r\n`, and before blank lines, which it passes over. The line breaks from
/// there to the record's first cell are counted here, from the file, which is read again only
/// for a message; one that cannot be leaves the mark's line.
fn record_line(path: &Path, base: u64, mark: &csv::Position) -> u64 {
    let breaks = || -> std::io::Result<u64> {
        let mut file = std::fs::File::open(path)?;
        file.seek(SeekFrom::Start(base + mark.byte()))?;
        let mut breaks = 0;
        for byte in BufReader::new(file).bytes() {
            match byte? {
                b'\n' => breaks += 1,
                b'\r' => {}
                _ => break,
            }
        }
        Ok(breaks)
    };
    mark.line() + breaks().unwrap_or(0)
}

/// A record the csv reader could not read, at `at` (the record's line, [`record_line`]'s): a
/// ragged one in words of the table, any other with the reader's own error.
fn malformed(error: csv::Error, at: &str) -> anyhow::Error {
    match error.kind() {
        csv::ErrorKind::UnequalLengths { expected_len, len, .. } => {
            anyhow!("{at}: malformed CSV: {len} cells where the rows before have {expected_len}")
        }
        _ => anyhow::Error::new(error).context(format!("{at}: malformed CSV")),
    }
}

/// The values of the CSV `record` at `line` laid out by `layout` in a file of `header`.
fn csv_values(
    layout: &Layout,
    record: &csv::ByteRecord,
    line: &dyn Fn() -> String,
    header: &[String],
    regression: bool,
) -> Result<Vec<f32>> {
    layout.values(regression, header, line, |column| {
        let text = String::from_utf8_lossy(record.get(column).unwrap_or_default());
        text.parse::<f32>()
            .ok()
            .filter(|v| v.is_finite())
            .with_context(|| format!("{}, column {:?}: {text:?} is not a number", line(), header[column]))
    })
}

/// Appends the rows of the CSV file at `path` to `rows`.
fn read_csv(path: &Path, columns: Columns, rows: &mut Rows) -> Result<()> {
    let mut reader = csv_reader(std::fs::File::open(path).context("cannot open it")?, true);
    let header = csv_header(&mut reader)?;
    let layout = Layout::of(&header, columns, rows)?;
    let line = |mark: Option<&csv::Position>| format!("line {}", mark.map_or(0, |m| record_line(path, 0, m)));
    for record in reader.byte_records() {
        let record = record.map_err(|e| {
            let at = line(e.position());
            malformed(e, &at)
        })?;
        let at = || line(record.position());
        rows.push(csv_values(&layout, &record, &at, &header, columns.regression)?);
    }
    Ok(())
}

/// The `.npy` files in `dir` (`numpy.save`), each with the array name its file's stem gives.
fn npy_files(dir: &Path) -> Result<Vec<(String, std::path::PathBuf)>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).context("reading the directory")? {
        let path = entry.context("reading the directory")?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("npy") {
            continue;
        }
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .with_context(|| format!("{}: a file name that is not UTF-8", path.display()))?
            .to_string();
        files.push((name, path));
    }
    ensure!(!files.is_empty(), "the directory holds no .npy files");
    Ok(files)
}

/// The arrays of the `.npy` files in `dir`, each named by its file's stem.
fn read_npy_directory(dir: &Path) -> Result<Vec<(String, candle_core::Tensor)>> {
    npy_files(dir)?
        .into_iter()
        .map(|(name, path)| {
            let array = candle_core::Tensor::read_npy(&path)
                .with_context(|| format!("{}: not a readable .npy file", path.display()))?;
            Ok((name, array))
        })
        .collect()
}

/// Appends the rows of the named arrays at `path` (safetensors, `.npz`, or a directory of
/// `.npy` files, each array named by its file's stem) to `rows`: the label array (one value per
/// row) and the feature arrays (`(n)` or `(n, k)`), by name.
fn read_arrays(path: &Path, columns: Columns, rows: &mut Rows) -> Result<()> {
    let device = candle_core::Device::Cpu;
    let mut arrays: Vec<(String, candle_core::Tensor)> = match path.extension().and_then(|e| e.to_str()) {
        _ if path.is_dir() => read_npy_directory(path)?,
        Some("npz") => candle_core::Tensor::read_npz(path).context("not a readable .npz file")?,
        Some("npy") => bail!(
            "a .npy file holds one array: put the label's and the features' .npy files in one \
             directory and name the directory"
        ),
        _ => candle_core::safetensors::load(path, &device)
            .context("not a readable safetensors file")?
            .into_iter()
            .collect(),
    };
    // In name order: the order of a feature list nobody gave.
    arrays.sort_by(|a, b| a.0.cmp(&b.0));
    let names: Vec<String> = arrays.iter().map(|(name, _)| name.clone()).collect();
    let layout = Layout::find(&names, columns, "array")?;
    // Every array as (n, k) f32 values.
    let table = |name: &str, array: &candle_core::Tensor| -> Result<(usize, Vec<Vec<f32>>)> {
        let values = match array.dims() {
            [_] => array.unsqueeze(1)?,
            [_, _] => array.clone(),
            dims => bail!("array {name:?} has shape {dims:?}: one value per row (n) or k of them (n, k)"),
        };
        let values = values.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
        if let Some((row, _)) = values
            .iter()
            .enumerate()
            .find(|(_, r)| r.iter().any(|v| !v.is_finite()))
        {
            bail!("array {name:?}, row {}: a value that is not a finite number", row + 1);
        }
        Ok((values.len(), values))
    };
    let feature_names: Vec<String> = layout.features.iter().map(|&i| names[i].clone()).collect();
    let features = layout
        .features
        .iter()
        .map(|&i| table(&names[i], &arrays[i].1))
        .collect::<Result<Vec<_>>>()?;
    let n = features[0].0;
    for (name, (len, _)) in feature_names.iter().zip(&features) {
        ensure!(*len == n, "array {name:?} has {len} rows, {:?} {n}", feature_names[0]);
    }
    let dim: usize = features
        .iter()
        .map(|(_, values)| values.first().map_or(0, Vec::len))
        .sum();
    rows.take_features(feature_names, dim)?;
    let labels = match layout.label {
        Some(i) => {
            let (name, array) = &arrays[i];
            let (len, values) = table(name, array)?;
            ensure!(len == n, "the label array {name:?} has {len} rows, the features {n}");
            ensure!(
                values.iter().all(|v| v.len() == 1),
                "the label array {name:?} holds more than one value a row"
            );
            Some((name, values))
        }
        None => None,
    };
    for row in 0..n {
        for (_, values) in &features {
            rows.features.extend_from_slice(&values[row]);
        }
        if let Some((name, values)) = &labels {
            let at = || format!("array {name:?}, row {}", row + 1);
            rows.labels.push(label_value(values[row][0], columns.regression, &at)?);
        }
    }
    Ok(())
}

/// A training table in `format` streamed in parts cut as `layout` says, and its held-out
/// `test_files` streamed too (each rank scoring its part), with the width of a model's output.
/// Class ids count the classes: one more than the largest of either split, which a pass over
/// the labels finds.
pub fn streamed_splits(
    format: TableFormat,
    train_files: &[String],
    test_files: &[String],
    columns: Columns,
    layout: crate::data::parts::DataLayout,
) -> Result<(StreamedTable, StreamedTable, usize)> {
    let train = StreamedTable::open(format, train_files, columns, layout, "train.train_files")?;
    ensure!(
        !test_files.is_empty(),
        "train.test_files: a table streamed in parts (train.data_parts) holds out files, not a fraction of its rows"
    );
    let test = StreamedTable::open(format, test_files, columns, layout, "train.test_files")?;
    ensure!(
        test.dim == train.dim,
        "train.test_files have {} feature columns, train.train_files {}",
        test.dim,
        train.dim
    );
    let largest = match columns.regression {
        true => 0.0,
        false => train.largest_label()?.max(test.largest_label()?),
    };
    Ok((train, test, outputs(columns, largest)))
}

/// The width of a model's output over a table of `columns` whose largest label is `largest`:
/// one value regressed, or a class for every id up to the largest.
fn outputs(columns: Columns, largest: f32) -> usize {
    match columns.regression {
        true => 1,
        false => largest as usize + 1,
    }
}

/// The training and held-out splits of tables in `format`: `test_files` held out, or when there are
/// none a `test_fraction` of the training rows (shuffled with `seed`). Class ids count the
/// classes: one more than the largest of either split.
pub fn table_splits(
    format: TableFormat,
    train_files: &[String],
    test_files: &[String],
    columns: Columns,
    test_fraction: f64,
    seed: u64,
) -> Result<TableSplits> {
    let mut train = read_files(train_files, Some(format), columns, "train.train_files")?;
    let test = if test_files.is_empty() {
        None
    } else {
        Some(read_files(test_files, Some(format), columns, "train.test_files")?)
    };
    if let Some(test) = &test {
        ensure!(
            test.dim == train.dim,
            "train.test_files have {} feature columns, train.train_files {}",
            test.dim,
            train.dim
        );
    }
    let largest = train
        .labels
        .iter()
        .chain(test.iter().flat_map(|t| &t.labels))
        .fold(0f32, |a, &b| a.max(b));
    let outputs = outputs(columns, largest);
    let feature_columns = std::mem::take(&mut train.names);
    let train = train.into_dataset(columns, outputs)?;
    let (train, test) = match test {
        Some(test) => (train, test.into_dataset(columns, outputs)?),
        None => train.split(test_fraction, seed).context("train.test_fraction")?,
    };
    Ok(TableSplits {
        train,
        test,
        feature_columns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{Inputs, Targets};

    fn write(dir: &Path, name: &str, text: &str) -> String {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    }

    #[test]
    fn a_path_says_its_format_and_a_directory_is_one_of_npy_arrays() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let x = candle_core::Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &candle_core::Device::Cpu)?;
        x.write_npy(dir.path().join("x.npy"))?;
        std::fs::write(dir.path().join("notes.txt"), "not an array")?;
        assert_eq!(TableFormat::of_path(dir.path()), TableFormat::Arrays);
        assert_eq!(TableFormat::of_path(Path::new("a.pq")), TableFormat::Parquet);
        assert_eq!(TableFormat::of_path(Path::new("a.tsv")), TableFormat::Csv);
        let (dim, pieces) = feature_pieces(&dir.path().to_string_lossy(), None, 1)?;
        let pieces: Vec<Vec<f32>> = pieces.collect::<Result<_>>()?;
        assert_eq!((pieces, dim), (vec![vec![1.0, 2.0], vec![3.0, 4.0]], 2));
        let empty = tempfile::tempdir()?;
        let err = match feature_pieces(&empty.path().to_string_lossy(), None, 1) {
            Ok(_) => anyhow::bail!("an empty directory read as arrays"),
            Err(err) => format!("{err:#}"),
        };
        assert!(err.contains("the directory holds no .npy files"), "{err}");
        Ok(())
    }

    /// Every column but the label, a value to regress.
    pub(super) const REGRESS: Columns = Columns {
        label: Some("y"),
        features: None,
        regression: true,
    };

    const CLASSES: Columns = Columns {
        regression: false,
        ..REGRESS
    };

    /// CSV texts whose error both readers must place on the file's line (the header is line 1)
    /// through `\r\n` endings and blank lines before it: the text, its columns, the line and
    /// what the error says after it.
    pub(super) const LINE_ERRORS: [(&str, Columns, usize, &str); 4] = [
        (
            "x,y\r\n1,abc\r\n",
            REGRESS,
            2,
            ", column \"y\": \"abc\" is not a number",
        ),
        (
            "x,y\n1,2\n\n\n3,abc\n",
            REGRESS,
            5,
            ", column \"y\": \"abc\" is not a number",
        ),
        (
            "x,y\r\n1,0\r\n\r\n2,1.5\r\n",
            CLASSES,
            4,
            ", column \"y\": 1.5 is not a class id",
        ),
        (
            "x,y\r\n1,2\r\n3\r\n",
            REGRESS,
            3,
            ": malformed CSV: 1 cells where the rows before have 2",
        ),
    ];

    #[test]
    fn columns_are_found_by_name_in_every_file() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let a = write(dir.path(), "a.csv", "x1, y ,x0\n1,10,2\n3,30,4\n");
        let b = write(dir.path(), "b.csv", "y,x0,x1\n50,6,5\n");
        let order = ["x0".to_string(), "x1".to_string()];
        let columns = Columns {
            features: Some(&order),
            ..REGRESS
        };
        let TableSplits {
            train,
            test,
            feature_columns,
        } = table_splits(TableFormat::Csv, std::slice::from_ref(&a), &[b], columns, 0.5, 1)?;
        assert_eq!(feature_columns, order);
        assert_eq!(train.inputs, Inputs::Features(vec![2.0, 1.0, 4.0, 3.0]));
        assert_eq!(train.targets, Targets::Values(vec![10.0, 30.0]));
        assert_eq!(test.inputs, Inputs::Features(vec![6.0, 5.0]));
        assert!(test.targets.is_regression());
        // Every column but the label, in file order.
        let all = table_splits(TableFormat::Csv, &[a.clone(), a], &[], REGRESS, 0.5, 1)?;
        assert_eq!((all.train.len(), all.train.dim), (2, 2));
        assert_eq!(all.feature_columns, ["x1", "x0"]);
        Ok(())
    }

    #[test]
    fn class_ids_count_the_classes_of_both_splits() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let a = write(dir.path(), "a.csv", "x,label\n0.5,0\n1.5,1\n");
        let b = write(dir.path(), "b.csv", "x,label\n2.5,3\n");
        let columns = Columns {
            label: Some("label"),
            features: None,
            regression: false,
        };
        let splits = table_splits(TableFormat::Csv, &[a], &[b], columns, 0.5, 1)?;
        assert_eq!((splits.train.outputs, splits.test.outputs), (4, 4));
        assert_eq!(splits.test.targets, Targets::Classes(vec![3]));
        Ok(())
    }

    #[test]
    fn bad_tables_are_named_to_the_line_and_column() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let err = |file: &str, columns: Columns| {
            format!(
                "{:#}",
                table_splits(TableFormat::Csv, &[file.to_string()], &[], columns, 0.5, 1).unwrap_err()
            )
        };
        let missing = write(dir.path(), "missing.csv", "x,z\n1,2\n");
        let text = err(&missing, REGRESS);
        assert!(
            text.contains("missing.csv") && text.contains("no column \"y\"") && text.contains("x, z"),
            "{text}"
        );
        let cell = write(dir.path(), "cell.csv", "x,y\n1,2\n3,4\n5,abc\n");
        let text = err(&cell, REGRESS);
        assert!(text.contains("line 4, column \"y\": \"abc\" is not a number"), "{text}");
        let classes = Columns {
            regression: false,
            ..REGRESS
        };
        let text = err(&cell.replace("cell", "fraction"), classes);
        assert!(text.contains("cannot open it"), "{text}");
        let fraction = write(dir.path(), "fraction.csv", "x,y\n1,0\n2,1.5\n");
        let text = err(&fraction, classes);
        assert!(text.contains("line 3") && text.contains("not a class id"), "{text}");
        let ragged = write(dir.path(), "ragged.csv", "x,y\n1,2\n3\n");
        assert!(err(&ragged, REGRESS).contains("malformed CSV"));
        let nope = ["nope".to_string()];
        let wrong = Columns {
            features: Some(&nope),
            ..REGRESS
        };
        assert!(err(&cell, wrong).contains("no column \"nope\" (train.feature_columns)"));
        Ok(())
    }

    #[test]
    fn a_column_named_twice_or_a_label_among_the_features_is_refused() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let twice = write(dir.path(), "twice.csv", "x,y,z,x\n1,2,3,4\n");
        let text = format!(
            "{:#}",
            table_splits(TableFormat::Csv, std::slice::from_ref(&twice), &[], REGRESS, 0.5, 1).unwrap_err()
        );
        assert!(
            text.contains("twice.csv") && text.contains("columns 1 and 4 (counted from 1) are both named \"x\""),
            "{text}"
        );
        // Streamed, it is refused at the open.
        let layout = crate::data::parts::DataLayout::WHOLE;
        let text = format!(
            "{:#}",
            StreamedTable::open(TableFormat::Csv, &[twice], REGRESS, layout, "train.train_files").unwrap_err()
        );
        assert!(text.contains("columns 1 and 4"), "{text}");
        let plain = write(dir.path(), "plain.csv", "x,y\n1,2\n3,4\n");
        let with_label = ["x".to_string(), "y".to_string()];
        let columns = Columns {
            features: Some(&with_label),
            ..REGRESS
        };
        let text = format!(
            "{:#}",
            table_splits(TableFormat::Csv, &[plain], &[], columns, 0.5, 1).unwrap_err()
        );
        assert!(
            text.contains("plain.csv") && text.contains("train.label_column \"y\" is also in train.feature_columns"),
            "{text}"
        );
        Ok(())
    }

    /// One line numbering, the file's (the header is line 1), whether its lines end in `\r\n`
    /// or blank lines come before the row: for a cell, a class id and a ragged row alike.
    #[test]
    fn errors_name_the_file_s_line_through_crlf_and_blank_lines() -> Result<()> {
        let dir = tempfile::tempdir()?;
        for (text, columns, line, error) in LINE_ERRORS {
            let file = write(dir.path(), "lines.csv", text);
            let err = table_splits(TableFormat::Csv, &[file], &[], columns, 0.5, 1).unwrap_err();
            let message = format!("{err:#}");
            assert!(message.contains(&format!("line {line}{error}")), "{text:?}: {message}");
        }
        Ok(())
    }
}
