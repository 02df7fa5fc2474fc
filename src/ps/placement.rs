//! Which shard holds a sparse row: a fixed hash of (table, id), so every trainer and every
//! restart agree without a directory.
//!
//! `shard_of(table, id, S) = mix64(id ⊕ (table + 1)·0x9E3779B97F4A7C15) mod S`, where `mix64`
//! is the SplitMix64 finaliser (`z ⊕= z >> 30; z ·= 0xBF58476D1CE4E5B9; z ⊕= z >> 27;
//! z ·= 0x94D049BB133111EB; z ⊕= z >> 31`). Feature ids are already hashes, but the finaliser
//! makes placement even for structured ids too, and mixing in the table spreads the rows of one
//! id in several tables over the shards.

use crate::rng::mix64;

/// The shard of row `id` of table `table` among `server_num` shards (`server_num > 0`).
pub fn shard_of(table: usize, id: u64, server_num: usize) -> usize {
    let salted = id ^ (table as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (mix64(salted) % server_num.max(1) as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_is_fixed_and_balanced() {
        // Pinned values: placement is part of the on-disk contract (one snapshot file per shard).
        assert_eq!(shard_of(0, 0, 7), (mix64(0x9E37_79B9_7F4A_7C15) % 7) as usize);
        assert_eq!(mix64(1), 0x5692_161D_100B_05E5);
        let mut counts = [0usize; 4];
        for id in 0..40_000u64 {
            counts[shard_of(1, id, 4)] += 1;
        }
        assert!(counts.iter().all(|&c| (9_000..11_000).contains(&c)), "{counts:?}");
        let differ = (0..1000u64)
            .filter(|&id| shard_of(0, id, 2) != shard_of(1, id, 2))
            .count();
        assert!(
            (400..600).contains(&differ),
            "tables are placed independently: {differ}"
        );
    }
}
