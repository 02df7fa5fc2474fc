//! Click-through-rate (CTR) data shaped like the Criteo display-advertising
//! set: a click label, 13 integer columns and 26 hashed categorical slots.
//!
//! The parameter-server strategy trains a wide&deep model on it: the 26 slots
//! become feature ids looked up in one shared embedding table (rows live on
//! the PS shards), the 13 integers become dense inputs.
//!
//! - [`CtrRecord`], [`CtrBatch`], [`feature_id`]: one raw row, a batch of
//!   model inputs, and the id contract shared with the PS.
//! - `synthetic`: [`CriteoSynth`], a deterministic Criteo-shaped generator
//!   with a planted click model.
//! - `tsv`: the public Criteo TSV layout, written and streamed back.
//! - `loader`: [`CtrLoader`], each trainer's slice of every global batch, from its parts
//!   (`data::parts`).

mod loader;
mod synthetic;
mod tsv;
mod zipf;

pub use crate::data::parts::{DataLayout, DataPosition};
pub use loader::{CtrLoader, CtrSource};
pub use synthetic::{CriteoSynth, Split};
pub use tsv::{parse_line, write_record, write_synthetic, TsvReader};

use crate::rng::mix64;

/// Integer columns per record (Criteo's I1..I13).
pub const DENSE_FEATURES: usize = 13;
/// Categorical slots per record (Criteo's C1..C26).
pub const SPARSE_SLOTS: usize = 26;

/// One raw Criteo row, kept as read so that it can be written back unchanged
/// and turned into model inputs in exactly one place.
#[derive(Debug, Clone, PartialEq)]
pub struct CtrRecord {
    /// Whether the ad was clicked: the target.
    pub label: bool,
    /// Integer columns as counted: missing (`None`), zero or even negative.
    pub dense: [Option<i64>; DENSE_FEATURES],
    /// Categorical columns as Criteo ships them: 32-bit hashes, or missing.
    pub sparse: [Option<u32>; SPARSE_SLOTS],
}

impl CtrRecord {
    /// The dense model inputs, `ln(1 + max(x, 0))` with missing as 0: the
    /// counts are heavy-tailed, and the log keeps them in a range a network
    /// can take without per-column statistics.
    pub fn dense_features(&self) -> [f32; DENSE_FEATURES] {
        // 1 + x is exact in f32 for counts below 2^24, and `ln` is cheaper than `ln_1p`.
        self.dense.map(|x| x.map_or(0.0, |v| (v.max(0) as f32 + 1.0).ln()))
    }

    /// The embedding-table ids of the 26 slots (see [`feature_id`]).
    pub fn feature_ids(&self) -> [u64; SPARSE_SLOTS] {
        std::array::from_fn(|slot| feature_id(slot, self.sparse[slot]))
    }
}

/// The id under which `(slot, value)` is stored in the one embedding table all
/// slots share; trainers and PS shards must agree on it, and files of pushed
/// rows store it, so the formula is part of the contract and never changes:
///
/// ```text
/// key = ((slot + 1) << 33) | (1 << 32) | value     value present
/// key = ((slot + 1) << 33)                         value missing
/// id  = mix64(key)
/// mix64(z): z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
///           z = (z ^ (z >> 27)) * 0x94D049BB133111EB;
///           z ^ (z >> 31)                           (wrapping u64 arithmetic)
/// ```
///
/// `mix64` is SplitMix64's finaliser, a bijection on `u64`, and distinct
/// `(slot, value)` pairs give distinct keys, so ids never collide, within a
/// slot or across slots, and a missing value has its own id in every slot.
/// The mixing spreads ids evenly over PS shards placed by `id % shards`.
pub fn feature_id(slot: usize, value: Option<u32>) -> u64 {
    mix64(feature_key(slot, value))
}

/// The unmixed `key` of [`feature_id`]: distinct for every `(slot, value)`.
fn feature_key(slot: usize, value: Option<u32>) -> u64 {
    let slot_key = (slot as u64 + 1) << 33;
    match value {
        Some(v) => slot_key | (1 << 32) | u64::from(v),
        None => slot_key,
    }
}

/// Records turned into model inputs, row-major, ready to become tensors
/// without further reshaping.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CtrBatch {
    /// Number of records.
    pub len: usize,
    /// `len × DENSE_FEATURES` values from [`CtrRecord::dense_features`].
    pub dense: Vec<f32>,
    /// `len × SPARSE_SLOTS` ids from [`CtrRecord::feature_ids`].
    pub ids: Vec<u64>,
    /// One 0.0/1.0 label per record, the form a logistic loss takes.
    pub labels: Vec<f32>,
}

impl CtrBatch {
    /// An empty batch with room for `n` records, so filling it allocates once.
    pub fn with_capacity(n: usize) -> Self {
        Self {
            len: 0,
            dense: Vec::with_capacity(n * DENSE_FEATURES),
            ids: Vec::with_capacity(n * SPARSE_SLOTS),
            labels: Vec::with_capacity(n),
        }
    }

    /// Appends one record's model inputs.
    pub fn push(&mut self, record: &CtrRecord) {
        self.dense.extend_from_slice(&record.dense_features());
        self.ids.extend_from_slice(&record.feature_ids());
        self.labels.push(if record.label { 1.0 } else { 0.0 });
        self.len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> CtrRecord {
        let mut dense = [None; DENSE_FEATURES];
        dense[0] = Some(0);
        dense[1] = Some(-3);
        dense[2] = Some(9);
        let mut sparse = [None; SPARSE_SLOTS];
        sparse[0] = Some(0x68fd_1e64);
        sparse[5] = Some(0);
        CtrRecord {
            label: true,
            dense,
            sparse,
        }
    }

    #[test]
    fn dense_features_are_log_counts_with_missing_and_negative_as_zero() {
        let f = record().dense_features();
        assert_eq!(f[0], 0.0);
        assert_eq!(f[1], 0.0);
        assert!((f[2] - 10f32.ln()).abs() < 1e-6);
        assert_eq!(f[3], 0.0);
    }

    #[test]
    fn feature_ids_follow_the_documented_formula_and_do_not_collide() {
        assert_eq!(feature_id(0, Some(7)), mix64((1 << 33) | (1 << 32) | 7));
        assert_eq!(feature_id(25, None), mix64(26 << 33));
        let mut ids = std::collections::HashSet::new();
        for slot in 0..SPARSE_SLOTS {
            assert!(ids.insert(feature_id(slot, None)));
            for v in [0, 1, 2, u32::MAX] {
                assert!(ids.insert(feature_id(slot, Some(v))), "slot {slot} value {v}");
            }
        }
    }

    #[test]
    fn batch_push_lays_records_out_row_major() {
        let r = record();
        let mut b = CtrBatch::with_capacity(2);
        b.push(&r);
        b.push(&CtrRecord {
            label: false,
            ..r.clone()
        });
        assert_eq!(b.len, 2);
        assert_eq!(b.labels, vec![1.0, 0.0]);
        assert_eq!(b.dense[DENSE_FEATURES..], r.dense_features());
        assert_eq!(b.ids[SPARSE_SLOTS..], r.feature_ids());
    }
}
