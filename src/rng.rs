//! A small seeded random generator (SplitMix64).
//!
//! Every rank must draw the same numbers from the same seed — for parameter
//! initialisation, data shuffling and synthetic data — on every platform and
//! across crate upgrades, so the generator is defined here rather than taken
//! from a crate whose stream may change between versions.

/// SplitMix64 (Steele, Lea & Flood 2014): tiny, fast, and good enough for
/// shuffles and initialisers; not for cryptography.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator for one named purpose, so that e.g. the shuffle of epoch 3
    /// and the initialiser of layer 3 never share a stream.
    pub fn for_stream(seed: u64, stream: &str, index: u64) -> Self {
        let mut h = seed ^ 0x9E37_79B9_7F4A_7C15;
        for b in stream.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3);
        }
        Self::new(h ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.state)
    }

    /// Moves on `n` draws at once, as if `next_u64` had been called `n` times: a stream's values
    /// from the n-th on, without the ones before.
    pub fn skip(&mut self, n: u64) {
        self.state = self.state.wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    }

    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.next_f32()
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.next_f32().max(f32::MIN_POSITIVE);
        let u2 = self.next_f32();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }

    /// Uniform in [0, n); `n` must be positive.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Fisher–Yates shuffle in place.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

/// SplitMix64's output finaliser: a bijection of u64 with full avalanche, the hash that places
/// rows on shards and keys click-log features (kept our own: the values it gives are part of
/// every checkpoint and data set, so they must never change).
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_streams_differ() {
        let a: Vec<u64> = (0..4)
            .map({
                let mut r = SplitMix64::new(7);
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..4)
            .map({
                let mut r = SplitMix64::new(7);
                move |_| r.next_u64()
            })
            .collect();
        assert_eq!(a, b);
        let mut x = SplitMix64::for_stream(7, "shuffle", 1);
        let mut y = SplitMix64::for_stream(7, "shuffle", 2);
        assert_ne!(x.next_u64(), y.next_u64());
    }

    #[test]
    fn skipping_n_draws_lands_where_n_draws_do() {
        let mut drawn = SplitMix64::for_stream(5, "skip", 0);
        for _ in 0..1000 {
            drawn.next_u64();
        }
        let mut skipped = SplitMix64::for_stream(5, "skip", 0);
        skipped.skip(1000);
        assert_eq!(drawn.next_u64(), skipped.next_u64());
    }

    #[test]
    fn shuffle_is_a_permutation() {
        let mut v: Vec<usize> = (0..100).collect();
        SplitMix64::new(3).shuffle(&mut v);
        let mut s = v.clone();
        s.sort_unstable();
        assert_eq!(s, (0..100).collect::<Vec<_>>());
        assert_ne!(v, s);
    }
}
