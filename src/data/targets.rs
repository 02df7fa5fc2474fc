//! What a model is trained to predict: a class per row or per position (classification, a
//! language model's next tokens), or real values per row (regression).

use candle_core::{Device, Tensor};

use super::select_rows;

/// The targets of a set of rows, row-major: the same number for every row.
#[derive(Debug, Clone, PartialEq)]
pub enum Targets {
    /// Class ids: one per row, or one per input of a row (the next token after each).
    Classes(Vec<u32>),
    /// Values to regress, the same number per row.
    Values(Vec<f32>),
}

impl Targets {
    /// Targets held (predictions a model makes for them).
    pub fn len(&self) -> usize {
        match self {
            Self::Classes(v) => v.len(),
            Self::Values(v) => v.len(),
        }
    }

    /// True when no targets are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether these are values to regress rather than classes.
    pub fn is_regression(&self) -> bool {
        matches!(self, Self::Values(_))
    }

    /// The targets of rows `indices` (of `per_row` targets each), in that order.
    pub(super) fn select(&self, indices: &[usize], per_row: usize) -> Self {
        match self {
            Self::Classes(v) => Self::Classes(select_rows(v, indices, per_row)),
            Self::Values(v) => Self::Values(select_rows(v, indices, per_row)),
        }
    }

    /// The targets of consecutive rows `range`, `per_row` each.
    pub(super) fn range(&self, range: std::ops::Range<usize>, per_row: usize) -> Self {
        let span = range.start * per_row..range.end * per_row;
        match self {
            Self::Classes(v) => Self::Classes(v[span].to_vec()),
            Self::Values(v) => Self::Values(v[span].to_vec()),
        }
    }

    /// The targets of `rows` rows on `device`: classes `(rows)` with one per row, else
    /// `(rows, per row)` (u32 classes or f32 values), the shape of a model's predictions.
    pub fn tensor(&self, rows: usize, device: &Device) -> candle_core::Result<Tensor> {
        let per_row = self.len() / rows.max(1);
        match self {
            Self::Classes(v) if per_row == 1 => Tensor::from_slice(v, rows, device),
            Self::Classes(v) => Tensor::from_slice(v, (rows, per_row), device),
            Self::Values(v) => Tensor::from_slice(v, (rows, per_row), device),
        }
    }
}
