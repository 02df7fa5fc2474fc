//! Tables of the user's own: CSV files with a header row, read into a [`Dataset`] of the
//! feature columns and one label column the config names. Every file of a split must have the
//! columns; a cell that is not a number is an error naming the file, the line and the column.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

use super::Dataset;

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

/// The rows of `files`, read in order.
fn read_files(files: &[String], columns: Columns, key: &str) -> Result<Rows> {
    ensure!(!files.is_empty(), "{key}: no files given");
    let mut rows = Rows::default();
    for file in files {
        read_csv(Path::new(file), columns, &mut rows).with_context(|| format!("{key}: {file}"))?;
    }
    ensure!(!rows.features.is_empty(), "{key}: the files hold no rows");
    Ok(rows)
}

/// The feature columns `features` (every column when `None`) of CSV `files`, read in order:
/// row-major values, and the number per row.
pub fn read_features(files: &[String], features: Option<&[String]>) -> Result<(Vec<f32>, usize)> {
    let columns = Columns {
        label: None,
        features,
        regression: true,
    };
    let rows = read_files(files, columns, "the data")?;
    Ok((rows.features, rows.dim))
}

/// Appends the rows of the CSV file at `path` to `rows`.
fn read_csv(path: &Path, columns: Columns, rows: &mut Rows) -> Result<()> {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .trim(csv::Trim::All)
        .from_path(path)
        .context("cannot open it")?;
    let header: Vec<String> = reader
        .headers()
        .context("cannot read its header row")?
        .iter()
        .map(str::to_string)
        .collect();
    let find = |name: &str, what: &str| {
        header
            .iter()
            .position(|h| h == name)
            .with_context(|| format!("no column {name:?} ({what}); its columns are {}", header.join(", ")))
    };
    let label = columns.label.map(|name| find(name, "train.label_column")).transpose()?;
    let features: Vec<usize> = match columns.features {
        Some(names) => names
            .iter()
            .map(|name| find(name, "train.feature_columns"))
            .collect::<Result<_>>()?,
        None => (0..header.len()).filter(|&i| Some(i) != label).collect(),
    };
    ensure!(!features.is_empty(), "no feature columns besides the label");
    if rows.dim == 0 {
        rows.dim = features.len();
        rows.names = features.iter().map(|&i| header[i].clone()).collect();
    }
    ensure!(
        rows.dim == features.len(),
        "{} feature columns, where the files before had {}",
        features.len(),
        rows.dim
    );
    for record in reader.records() {
        let record = record.context("malformed CSV")?;
        let line = record.position().map_or(0, csv::Position::line);
        let cell = |column: usize| -> Result<f32> {
            let text = record.get(column).unwrap_or("");
            text.parse::<f32>()
                .ok()
                .filter(|v| v.is_finite())
                .with_context(|| format!("line {line}, column {:?}: {text:?} is not a number", header[column]))
        };
        for &column in &features {
            rows.features.push(cell(column)?);
        }
        let Some(label) = label else { continue };
        let value = cell(label)?;
        let class_id = value >= 0.0 && value.fract() == 0.0 && value < (1 << 24) as f32;
        if !columns.regression && !class_id {
            bail!(
                "line {line}, column {:?}: {value} is not a class id (a whole number from 0); \
                 to regress values set train.loss = \"mse\"",
                header[label]
            );
        }
        rows.labels.push(value);
    }
    Ok(())
}

/// The training and held-out splits of CSV tables: `test_files` held out, or when there are
/// none a `test_fraction` of the training rows (shuffled with `seed`). Class ids count the
/// classes: one more than the largest of either split.
pub fn csv_splits(
    train_files: &[String],
    test_files: &[String],
    columns: Columns,
    test_fraction: f64,
    seed: u64,
) -> Result<TableSplits> {
    let mut train = read_files(train_files, columns, "train.train_files")?;
    let test = if test_files.is_empty() {
        None
    } else {
        Some(read_files(test_files, columns, "train.test_files")?)
    };
    if let Some(test) = &test {
        ensure!(
            test.dim == train.dim,
            "train.test_files have {} feature columns, train.train_files {}",
            test.dim,
            train.dim
        );
    }
    let outputs = if columns.regression {
        1
    } else {
        let largest = train
            .labels
            .iter()
            .chain(test.iter().flat_map(|t| &t.labels))
            .fold(0f32, |a, &b| a.max(b));
        largest as usize + 1
    };
    let dataset = |rows: Rows| {
        if columns.regression {
            Dataset::regression(rows.features, rows.labels, rows.dim, 1)
        } else {
            let classes = rows.labels.iter().map(|&l| l as u32).collect();
            Dataset::new(rows.features, classes, rows.dim, outputs)
        }
    };
    let feature_columns = std::mem::take(&mut train.names);
    let train = dataset(train)?;
    let (train, test) = match test {
        Some(test) => (train, dataset(test)?),
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

    const REGRESS: Columns = Columns {
        label: Some("y"),
        features: None,
        regression: true,
    };

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
        } = csv_splits(std::slice::from_ref(&a), &[b], columns, 0.5, 1)?;
        assert_eq!(feature_columns, order);
        assert_eq!(train.inputs, Inputs::Features(vec![2.0, 1.0, 4.0, 3.0]));
        assert_eq!(train.targets, Targets::Values(vec![10.0, 30.0]));
        assert_eq!(test.inputs, Inputs::Features(vec![6.0, 5.0]));
        assert!(test.targets.is_regression());
        // Every column but the label, in file order.
        let all = csv_splits(&[a.clone(), a], &[], REGRESS, 0.5, 1)?;
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
        let splits = csv_splits(&[a], &[b], columns, 0.5, 1)?;
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
                csv_splits(&[file.to_string()], &[], columns, 0.5, 1).unwrap_err()
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
}
