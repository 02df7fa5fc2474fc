//! Zipf-distributed ranks for the synthetic categorical slots.
//!
//! P(rank = k) ∝ k^-s for k in 1..=n. Ranks up to [`HEAD_RANKS`] are drawn
//! exactly from a cumulative table by binary search; the rarer tail is drawn
//! by inverting the continuous density (rank k owns `[k - ½, k + ½)`), which
//! for k > 4096 differs from the discrete law by far less than sampling
//! noise. So a slot's table is at most 4096 × 8 bytes = 32 KiB whatever its
//! vocabulary: 26 slots need under 1 MiB even for Criteo-sized vocabularies.

/// Ranks drawn from the exact table.
const HEAD_RANKS: u64 = 4096;
/// Equal-mass buckets of the guide table that starts each table search.
const GUIDE_BUCKETS: usize = 1024;

/// A Zipf law over ranks `1..=n`.
#[derive(Debug, Clone)]
pub(super) struct Zipf {
    n: u64,
    exponent: f64,
    /// `head_cum[i]` = Σ_{k=1}^{i+1} k^-s over the head ranks.
    head_cum: Vec<f64>,
    /// `guide[b]`: the first head index whose cumulative mass exceeds the
    /// share `b / GUIDE_BUCKETS` of the head, so a search scans a few entries
    /// (about 4 on average) instead of bisecting 4096.
    guide: Vec<u32>,
    /// `(HEAD_RANKS + ½)^(1-s)`: where the continuous tail starts.
    tail_start: f64,
    /// Total (unnormalised) mass: head plus tail.
    total: f64,
}

impl Zipf {
    /// The law over `1..=n` (n ≥ 1) with exponent `s` > 1.
    pub(super) fn new(n: u64, exponent: f64) -> Self {
        let n = n.max(1);
        let mut head_cum = Vec::with_capacity(n.min(HEAD_RANKS) as usize);
        let mut sum = 0.0;
        for k in 1..=n.min(HEAD_RANKS) {
            sum += (k as f64).powf(-exponent);
            head_cum.push(sum);
        }
        let guide = (0..GUIDE_BUCKETS)
            .map(|b| head_cum.partition_point(|&c| c <= sum * b as f64 / GUIDE_BUCKETS as f64) as u32)
            .collect();
        let power = 1.0 - exponent;
        let tail_start = (HEAD_RANKS as f64 + 0.5).powf(power);
        let tail = if n > HEAD_RANKS {
            (tail_start - (n as f64 + 0.5).powf(power)) / (exponent - 1.0)
        } else {
            0.0
        };
        Self {
            n,
            exponent,
            head_cum,
            guide,
            tail_start,
            total: sum + tail,
        }
    }

    /// The rank (1-based) that the uniform `u` in [0, 1) maps to.
    pub(super) fn rank(&self, u: f64) -> u64 {
        let v = u * self.total;
        let head_mass = self.head_cum.last().copied().unwrap_or(0.0);
        if v < head_mass || self.n <= HEAD_RANKS {
            let bucket = ((v / head_mass * GUIDE_BUCKETS as f64) as usize).min(GUIDE_BUCKETS - 1);
            let last = self.head_cum.len() - 1;
            let mut i = (self.guide[bucket] as usize).min(last);
            // Scan to the first entry above v; the step back only guards
            // against rounding in the bucket index.
            while i > 0 && self.head_cum[i - 1] > v {
                i -= 1;
            }
            while i < last && self.head_cum[i] <= v {
                i += 1;
            }
            return i as u64 + 1;
        }
        let x = (self.tail_start - (v - head_mass) * (self.exponent - 1.0)).powf(1.0 / (1.0 - self.exponent));
        (x.round() as u64).clamp(HEAD_RANKS + 1, self.n)
    }

    /// Bytes held by the table, for reporting memory use.
    pub(super) fn table_bytes(&self) -> usize {
        self.head_cum.capacity() * std::mem::size_of::<f64>() + self.guide.capacity() * std::mem::size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn frequencies(zipf: &Zipf, draws: usize, upto: u64) -> Vec<f64> {
        let mut rng = SplitMix64::new(11);
        let mut counts = vec![0usize; upto as usize + 1];
        for _ in 0..draws {
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            let k = zipf.rank(u);
            assert!((1..=zipf.n).contains(&k));
            if k <= upto {
                counts[k as usize] += 1;
            }
        }
        counts.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    #[test]
    fn guided_search_finds_what_bisection_finds() {
        let zipf = Zipf::new(100_000, 1.1);
        let mut rng = SplitMix64::new(2);
        let head_share = zipf.head_cum[zipf.head_cum.len() - 1] / zipf.total;
        for _ in 0..50_000 {
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * head_share;
            let bisected = zipf.head_cum.partition_point(|&c| c <= u * zipf.total) as u64 + 1;
            assert_eq!(zipf.rank(u), bisected, "u = {u}");
        }
    }

    #[test]
    fn small_vocabulary_matches_the_exact_law() {
        let zipf = Zipf::new(5, 1.1);
        let norm: f64 = (1..=5).map(|k| (k as f64).powf(-1.1)).sum();
        let f = frequencies(&zipf, 200_000, 5);
        for (k, share) in f.iter().enumerate().skip(1) {
            let p = (k as f64).powf(-1.1) / norm;
            assert!((share - p).abs() < 0.005, "rank {k}: {share} vs {p}");
        }
    }

    #[test]
    fn tail_mass_and_ranks_follow_the_law_beyond_the_table() {
        let n = 1_000_000u64;
        let zipf = Zipf::new(n, 1.1);
        let exact_total: f64 = (1..=n).map(|k| (k as f64).powf(-1.1)).sum();
        assert!((zipf.total - exact_total).abs() / exact_total < 1e-6);
        // Share of draws in (4096, 8192] against the exact discrete mass.
        let exact: f64 = (4097..=8192u64).map(|k| (k as f64).powf(-1.1)).sum::<f64>() / exact_total;
        let mut rng = SplitMix64::new(5);
        let draws = 400_000;
        let hits = (0..draws)
            .filter(|_| (4097..=8192).contains(&zipf.rank((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64)))
            .count();
        let share = hits as f64 / draws as f64;
        assert!((share - exact).abs() < 0.004, "{share} vs {exact}");
        assert_eq!(zipf.table_bytes(), 4096 * 8 + 1024 * 4);
    }
}
