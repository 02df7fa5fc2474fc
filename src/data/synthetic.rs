//! Synthetic classification data of any size, for benchmarks: Gaussian
//! inputs labelled by a planted random linear teacher, so a model can learn
//! it and a falling loss means something.

use anyhow::Result;

use super::Dataset;
use crate::rng::SplitMix64;

pub(super) fn generate(rows: usize, dim: usize, classes: usize, seed: u64) -> Result<Dataset> {
    anyhow::ensure!(classes >= 2, "synthetic data needs at least two classes, got {classes}");
    let mut teacher_rng = SplitMix64::for_stream(seed, "synthetic-teacher", 0);
    let teacher: Vec<f32> = (0..dim * classes).map(|_| teacher_rng.normal()).collect();
    let mut rng = SplitMix64::for_stream(seed, "synthetic-rows", 0);
    let mut features = Vec::with_capacity(rows * dim);
    let mut labels = Vec::with_capacity(rows);
    for _ in 0..rows {
        let x: Vec<f32> = (0..dim).map(|_| rng.normal()).collect();
        let score = |c: usize| -> f32 { x.iter().zip(&teacher[c * dim..(c + 1) * dim]).map(|(a, b)| a * b).sum() };
        let label = (0..classes)
            .map(|c| (c, score(c)))
            .fold((0, f32::MIN), |best, cur| if cur.1 > best.1 { cur } else { best })
            .0;
        features.extend_from_slice(&x);
        labels.push(label as u32);
    }
    Dataset::new(features, labels, dim, classes)
}
