//! A sparse table's row policy on a shard (`[strategy.sparse_table_configs.<table>]`): which
//! rows earn a place (entry), how each is scored from its show and click counts, which go at the
//! end of a pass (shrink) and how many fit the table's memory cap.

use std::mem::size_of;

use super::row_index::RowIndex;
use super::row_pages::PAGE_ROWS;
use crate::config::SparseTableConfig;
use crate::rng::SplitMix64;

/// Floats of counts after a policed row's optimizer state: shows, clicks, and passes unseen —
/// whole passes ended without a show of the row, −1 once it is shown in the current pass.
pub const COUNTS: usize = 3;
const SHOWS: usize = 0;
const CLICKS: usize = 1;
const UNSEEN: usize = 2;

/// One table's policy, as its shard applies it.
#[derive(Debug, Clone, PartialEq)]
pub struct RowPolicy {
    config: SparseTableConfig,
    /// The job's seed, for the probability entry's draws.
    seed: u64,
    /// The stream the probability entry draws from: the table's.
    entry_stream: String,
}

impl RowPolicy {
    /// `config` for table `table` of a job seeded `seed`.
    pub fn new(config: SparseTableConfig, table: &str, seed: u64) -> Self {
        Self {
            config,
            seed,
            entry_stream: format!("{table}/entry"),
        }
    }

    /// Whether new rows must earn their place (so a row not stored reads as zeros).
    pub fn has_entry_rule(&self) -> bool {
        self.config.has_entry_rule()
    }

    /// Whether a row not stored yet, shown `before` times in earlier pushes and `now` times in
    /// this one, is stored now.
    pub fn admits(&self, id: u64, before: f32, now: f32) -> bool {
        if self.config.count_filter > 1 {
            return before + now >= self.config.count_filter as f32;
        }
        if self.config.probability < 1.0 {
            // One draw per push carrying the row, each from its own point of the table's stream.
            let point = self.seed ^ (before as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            return f64::from(SplitMix64::for_stream(point, &self.entry_stream, id).next_f32())
                < self.config.probability;
        }
        true
    }

    /// Adds a training occurrence's `shows` and `clicks` to a row's `counts`; it is seen in
    /// this pass.
    pub fn count(counts: &mut [f32], shows: f32, clicks: f32) {
        counts[SHOWS] += shows;
        counts[CLICKS] += clicks;
        counts[UNSEEN] = -1.0;
    }

    /// Paddle's show-click score: `nonclk_coeff × (shows − clicks) + click_coeff × clicks`.
    pub fn score(&self, counts: &[f32]) -> f32 {
        let (shows, clicks) = (counts[SHOWS], counts[CLICKS]);
        self.config.nonclk_coeff * (shows - clicks) + self.config.click_coeff * clicks
    }

    /// The end of a pass for a row: its counts decay, and it has been unseen one whole pass more
    /// (none if it was shown in this one). Returns whether it stays.
    pub fn survives_pass(&self, counts: &mut [f32]) -> bool {
        let decay = self.config.show_click_decay_rate;
        counts[SHOWS] *= decay;
        counts[CLICKS] *= decay;
        counts[UNSEEN] += 1.0;
        self.score(counts) >= self.config.delete_threshold
            && counts[UNSEEN] <= self.config.delete_after_unseen_days as f32
    }

    /// The end of a pass for the shows and clicks of a row not stored yet: they decay; below
    /// one whole show it is forgotten. Returns whether it is remembered.
    pub fn candidate_survives_pass(&self, counts: &mut [f32; 2]) -> bool {
        counts
            .iter_mut()
            .for_each(|count| *count *= self.config.show_click_decay_rate);
        counts[SHOWS] >= 1.0
    }

    /// The memory cap in bytes, split between rows and, under an entry rule, candidates
    /// ([`ROWS_SHARE`] for rows); `None` without a cap.
    fn cap_shares(&self) -> Option<(usize, Option<usize>)> {
        let cap = self.config.max_memory_mb * 1024.0 * 1024.0;
        if cap <= 0.0 {
            return None;
        }
        Some(match self.has_entry_rule() {
            true => ((cap * ROWS_SHARE) as usize, Some((cap * (1.0 - ROWS_SHARE)) as usize)),
            false => (cap as usize, None),
        })
    }

    /// The most rows of `stride` floats a shard of the table may hold under the memory cap, or
    /// `None` without a cap. Counted at the worst: whole pages of rows, and an index grown to
    /// the capacity of twice the rows (evicted rows leave tombstones until the index is rebuilt
    /// in place, which it is while at most half full).
    pub fn row_budget(&self, stride: usize) -> Option<usize> {
        let (cap, _) = self.cap_shares()?;
        let bytes = |rows: usize| {
            rows.div_ceil(PAGE_ROWS) * PAGE_ROWS * stride * size_of::<f32>() + RowIndex::bytes_for(2 * rows)
        };
        Some(largest_fitting(cap, cap / (stride * size_of::<f32>()) + 1, bytes))
    }

    /// The most candidates (rows not admitted yet, their shows and clicks) a shard of the table
    /// may remember under the memory cap — the cap's part rows do not get, as a map reserved
    /// once to hold them — or `None` without a cap or an entry rule.
    pub fn candidate_budget(&self) -> Option<usize> {
        let cap = self.cap_shares()?.1?;
        Some(largest_fitting(cap, cap / CANDIDATE_BYTES + 1, candidate_map_bytes))
    }
}

/// Under a memory cap and an entry rule, the share of the cap that rows get; candidates get the
/// rest.
const ROWS_SHARE: f64 = 0.75;

/// Bytes of one bucket of the candidates' map: the id, two counts and a control byte.
const CANDIDATE_BYTES: usize = size_of::<(u64, [f32; 2])>() + 1;

/// Bytes of the candidates' map reserved for `n` entries: its buckets by hashbrown's rule (at
/// most 7/8 full, a power of two, at least 4).
pub(crate) fn candidate_map_bytes(n: usize) -> usize {
    let buckets = match n {
        0 => 0,
        1..=3 => 4,
        4..=7 => 8,
        _ => (n * 8 / 7).next_power_of_two(),
    };
    buckets * CANDIDATE_BYTES
}

/// The largest `n < over` with `bytes(n) <= cap`, for `bytes` growing with `n`.
fn largest_fitting(cap: usize, mut over: usize, bytes: impl Fn(usize) -> usize) -> usize {
    let mut fits = 0usize;
    while over - fits > 1 {
        let mid = fits + (over - fits) / 2;
        if bytes(mid) <= cap {
            fits = mid;
        } else {
            over = mid;
        }
    }
    fits
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(edit: impl FnOnce(&mut SparseTableConfig)) -> RowPolicy {
        let mut config = SparseTableConfig::default();
        edit(&mut config);
        RowPolicy::new(config, "emb", 42)
    }

    #[test]
    fn a_count_filter_admits_a_row_at_its_nth_show() {
        let filter = policy(|c| c.count_filter = 3);
        assert!(!filter.admits(7, 0.0, 1.0));
        assert!(!filter.admits(7, 1.0, 1.0));
        assert!(filter.admits(7, 2.0, 1.0));
        assert!(filter.admits(7, 0.0, 3.0));
        assert!(policy(|_| {}).admits(7, 0.0, 1.0));
    }

    #[test]
    fn the_probability_entry_admits_about_its_share_and_repeats() {
        let half = policy(|c| c.probability = 0.25);
        let admitted = (0..10_000u64).filter(|&id| half.admits(id, 0.0, 1.0)).count();
        assert!((2_200..2_800).contains(&admitted), "{admitted}");
        let again = (0..10_000u64).filter(|&id| half.admits(id, 0.0, 1.0)).count();
        assert_eq!(admitted, again);
        // A row refused once gets another draw at its next push.
        let later = (0..10_000u64)
            .filter(|&id| !half.admits(id, 0.0, 1.0) && half.admits(id, 1.0, 1.0))
            .count();
        assert!(later > 1_000, "{later}");
    }

    #[test]
    fn scores_decay_and_rows_go_below_the_threshold_or_unseen_too_long() {
        let decaying = policy(|c| {
            c.delete_threshold = 0.5;
            c.show_click_decay_rate = 0.5;
        });
        let mut clicked = [0.0; COUNTS];
        RowPolicy::count(&mut clicked, 4.0, 2.0);
        assert!((decaying.score(&clicked) - (0.1 * 2.0 + 2.0)).abs() < 1e-6);
        assert!(decaying.survives_pass(&mut clicked));
        assert_eq!(clicked, [2.0, 1.0, 0.0], "shown in the pass that ended");
        assert!(decaying.survives_pass(&mut clicked), "score 0.55");
        assert!(!decaying.survives_pass(&mut clicked), "score 0.275 < 0.5");
        let mut shown = [0.0; COUNTS];
        RowPolicy::count(&mut shown, 8.0, 0.0);
        assert!(!decaying.survives_pass(&mut shown), "0.1 × 4 < 0.5");

        let forgetting = policy(|c| {
            c.delete_threshold = 0.0;
            c.delete_after_unseen_days = 2;
        });
        let mut row = [0.0; COUNTS];
        RowPolicy::count(&mut row, 1.0, 0.0);
        assert!(forgetting.survives_pass(&mut row));
        assert!(forgetting.survives_pass(&mut row));
        RowPolicy::count(&mut row, 1.0, 0.0);
        for _ in 0..3 {
            assert!(forgetting.survives_pass(&mut row), "{row:?}");
        }
        assert!(
            !forgetting.survives_pass(&mut row),
            "unseen for 3 whole passes: {row:?}"
        );
    }

    #[test]
    fn the_row_budget_fits_the_cap_at_its_worst() {
        let p = policy(|c| c.max_memory_mb = 16.0);
        let stride = 21;
        let rows = p.row_budget(stride).unwrap();
        let worst = rows.div_ceil(PAGE_ROWS) * PAGE_ROWS * stride * 4 + RowIndex::bytes_for(2 * rows);
        assert!(worst <= 16 << 20 && rows > 100_000, "{rows} rows, {worst} bytes");
        assert_eq!(policy(|_| {}).row_budget(stride), None);
    }
}
