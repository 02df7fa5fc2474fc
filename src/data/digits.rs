//! The UCI optical handwritten digits, shipped in `data/digits/` (source and
//! licence in its README) and compiled into the binary so the default job
//! runs anywhere.

use anyhow::{bail, Context, Result};

use super::Dataset;

const DIGITS_CSV: &str = include_str!("../../data/digits/digits.csv");
const PIXELS: usize = 64;
const MAX_PIXEL: f32 = 16.0;

pub(super) fn load() -> Result<Dataset> {
    let mut features = Vec::with_capacity(1797 * PIXELS);
    let mut labels = Vec::with_capacity(1797);
    for (line_no, line) in DIGITS_CSV.lines().enumerate() {
        let values: Vec<&str> = line.split(',').collect();
        if values.len() != PIXELS + 1 {
            bail!(
                "digits.csv line {}: {} fields, expected {}",
                line_no + 1,
                values.len(),
                PIXELS + 1
            );
        }
        for v in &values[..PIXELS] {
            let pixel: f32 = v.parse().with_context(|| format!("digits.csv line {}", line_no + 1))?;
            features.push(pixel / MAX_PIXEL);
        }
        labels.push(
            values[PIXELS]
                .parse()
                .with_context(|| format!("digits.csv line {}", line_no + 1))?,
        );
    }
    Dataset::new(features, labels, PIXELS, 10)
}
