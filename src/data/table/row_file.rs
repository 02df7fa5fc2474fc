//! Files whose rows are read by index, a block at a time: what a streamed table's parts read
//! from Parquet and array files alike.

use std::path::Path;

use anyhow::Result;

use super::Columns;

/// A file whose rows are read by index, a block of rows decoded at a time: Parquet (a row
/// group) or named arrays (a run of rows).
pub(crate) trait RowFile: Sized + Send {
    /// The file at `path`, its `columns` found and checked.
    fn open(path: &Path, columns: Columns) -> Result<Self>;

    /// Rows in the file.
    fn rows(&self) -> u64;

    /// The first row and the values (features, then the label) of a block of rows holding
    /// `row`, labels checked as `regression` says.
    fn block_of(&self, row: u64, regression: bool) -> Result<(u64, Vec<Vec<f32>>)>;
}
