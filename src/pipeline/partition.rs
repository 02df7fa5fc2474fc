//! Cutting a model's blocks into pipeline stages: contiguous, non-empty ranges of blocks,
//! either at explicit boundaries or balanced so the heaviest stage is as light as possible.

use std::ops::Range;

use anyhow::{bail, ensure, Result};

/// Cuts `weights.len()` blocks into `parts` contiguous non-empty ranges that minimise the
/// largest total weight (e.g. parameter count per block); ties go to the earliest cut.
pub fn balanced(weights: &[usize], parts: usize) -> Result<Vec<Range<usize>>> {
    check_counts(weights.len(), parts)?;
    // The smallest feasible maximum, by binary search over the greedy packing.
    let (mut low, mut high) = (
        weights.iter().copied().max().unwrap_or(0),
        weights.iter().sum::<usize>(),
    );
    while low < high {
        let mid = low + (high - low) / 2;
        if greedy(weights, mid, parts).is_some() {
            high = mid;
        } else {
            low = mid + 1;
        }
    }
    greedy(weights, low, parts).ok_or_else(|| anyhow::anyhow!("no cut of {} blocks into {parts} stages", weights.len()))
}

/// Packs blocks left to right, closing a stage when the next block would exceed `limit` or when
/// the remaining blocks are just enough for the remaining stages; `None` if `parts` stages do
/// not suffice.
fn greedy(weights: &[usize], limit: usize, parts: usize) -> Option<Vec<Range<usize>>> {
    let n = weights.len();
    let mut ranges = Vec::with_capacity(parts);
    let mut start = 0;
    let mut sum = 0;
    for (i, &w) in weights.iter().enumerate() {
        let stages_left = parts - ranges.len();
        let must_close = i > start && n - i == stages_left - 1;
        if i > start && (sum + w > limit || must_close) {
            ranges.push(start..i);
            start = i;
            sum = 0;
        }
        sum += w;
        if sum > limit || ranges.len() >= parts {
            return None;
        }
    }
    ranges.push(start..n);
    (ranges.len() == parts).then_some(ranges)
}

/// Cuts `blocks` blocks at `starts` (the first block of stages 1, 2, …; strictly increasing,
/// inside the model), giving `starts.len() + 1` stages.
pub fn explicit(starts: &[usize], blocks: usize, parts: usize) -> Result<Vec<Range<usize>>> {
    check_counts(blocks, parts)?;
    ensure!(
        starts.len() + 1 == parts,
        "{} stage boundaries give {} stages, but the pipeline has {parts}",
        starts.len(),
        starts.len() + 1
    );
    let mut ranges = Vec::with_capacity(parts);
    let mut start = 0;
    for &next in starts {
        if next <= start || next >= blocks {
            bail!("stage boundaries must be increasing block indices in 1..{blocks}, got {starts:?}");
        }
        ranges.push(start..next);
        start = next;
    }
    ranges.push(start..blocks);
    Ok(ranges)
}

fn check_counts(blocks: usize, parts: usize) -> Result<()> {
    ensure!(parts >= 1, "a pipeline needs at least one stage");
    ensure!(
        parts <= blocks,
        "{parts} pipeline stages need at least {parts} blocks, the model has {blocks}"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_minimises_the_heaviest_stage() {
        assert_eq!(balanced(&[1, 1, 1, 1], 2).unwrap(), vec![0..2, 2..4]);
        assert_eq!(balanced(&[10, 1, 1, 1, 1, 10], 3).unwrap(), vec![0..1, 1..5, 5..6]);
        assert_eq!(balanced(&[5, 5, 5], 3).unwrap(), vec![0..1, 1..2, 2..3]);
        assert_eq!(balanced(&[0, 0, 9, 0], 2).unwrap().len(), 2);
        // Every split of 7 blocks into 3 is checked against brute force.
        let weights = [3, 8, 1, 4, 4, 2, 7];
        let best = (1..7)
            .flat_map(|a| (a + 1..7).map(move |b| (a, b)))
            .map(|(a, b)| {
                let sum = |r: Range<usize>| weights[r].iter().sum::<usize>();
                sum(0..a).max(sum(a..b)).max(sum(b..7))
            })
            .min()
            .unwrap();
        let cut = balanced(&weights, 3).unwrap();
        let heaviest = cut
            .iter()
            .map(|r| weights[r.clone()].iter().sum::<usize>())
            .max()
            .unwrap();
        assert_eq!(heaviest, best);
        assert!(cut.iter().all(|r| !r.is_empty()));
    }

    #[test]
    fn too_many_stages_and_bad_boundaries_are_errors() {
        let err = balanced(&[1, 2], 3).unwrap_err().to_string();
        assert_eq!(err, "3 pipeline stages need at least 3 blocks, the model has 2");
        assert_eq!(explicit(&[2, 3], 5, 3).unwrap(), vec![0..2, 2..3, 3..5]);
        assert!(explicit(&[3, 2], 5, 3).is_err());
        assert!(explicit(&[0], 5, 2).is_err());
        assert!(explicit(&[2], 5, 3).unwrap_err().to_string().contains("give 2 stages"));
    }
}
