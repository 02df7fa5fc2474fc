//! Click-through-rate (CTR) data: click logs whose records are a click label, dense values and
//! sparse slots — Criteo's display-advertising layout (13 integer columns, 26 hashed categorical
//! slots), or a log of the user's own in the columns `[train.click_log]` describes.
//!
//! The parameter-server strategy trains a wide&deep or DeepFM model on it: each slot's values
//! become feature ids looked up in tables whose rows live on the PS shards, the dense values
//! become dense inputs.
//!
//! - [`CtrShape`], [`CtrExample`], [`CtrBatch`], [`feature_id`]: what a model reads, one
//!   record's and a batch's model inputs, and the id contract shared with the PS.
//! - `schema`: [`ClickLogParser`], a log's columns compiled for reading.
//! - `lines`, `text`, `parquet`: the files, streamed (TSV and CSV by byte ranges, Parquet by file).
//! - `synthetic`: [`CriteoSynth`], a deterministic Criteo-shaped generator with a planted click
//!   model; `tsv` writes it in Criteo's layout, `generate` in any schema's.
//! - `loader`: [`CtrLoader`], each trainer's slice of every global batch, from its parts
//!   (`data::parts`).

mod generate;
mod lines;
mod loader;
mod parquet;
mod schema;
mod synthetic;
mod text;
mod tsv;
mod zipf;

pub use crate::config::{CRITEO_DENSE as DENSE_FEATURES, CRITEO_SLOTS as SPARSE_SLOTS};
pub use crate::data::parts::{DataLayout, DataPosition};
pub use generate::write_click_log;
pub use loader::{CtrLoader, CtrSource};
pub use schema::{text_hash, ClickLogParser};
pub use synthetic::{CriteoSynth, Split};
pub use text::ClickLogReader;
pub use tsv::{write_record, write_synthetic};

use crate::rng::mix64;

/// What a CTR model reads of each record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CtrShape {
    /// Dense inputs.
    pub dense: usize,
    /// Sparse slots.
    pub slots: usize,
}

impl CtrShape {
    /// Criteo's: 13 dense, 26 slots.
    pub const CRITEO: CtrShape = CtrShape {
        dense: DENSE_FEATURES,
        slots: SPARSE_SLOTS,
    };

    /// The inputs of a log in `schema`'s columns.
    pub fn of(schema: &crate::config::ClickLogSchema) -> Self {
        Self {
            dense: schema.dense.len(),
            slots: schema.slots.len(),
        }
    }

    /// The inputs of the click logs `train` reads (Criteo's where it names none).
    pub fn of_train(train: &crate::config::TrainConfig) -> Self {
        train
            .click_log_schema()
            .map_or(Self::CRITEO, |schema| Self::of(&schema))
    }
}

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

    /// The model inputs of the record: what reading its TSV line with Criteo's schema gives.
    pub fn example(&self) -> CtrExample {
        CtrExample {
            label: if self.label { 1.0 } else { 0.0 },
            dense: self.dense_features().to_vec(),
            ids: self.feature_ids().to_vec(),
            slot_ends: Vec::new(),
        }
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
/// `value` is the slot's 32-bit code of the value read: Criteo's hex hash, an integer id, or a
/// hash of the text (`[train.click_log]`'s `ids`). `mix64` is SplitMix64's finaliser, a
/// bijection on `u64`, and distinct `(slot, value)` pairs give distinct keys, so ids never
/// collide, within a slot or across slots, and a missing value has its own id in every slot.
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

/// One record's model inputs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CtrExample {
    /// 1.0 for a click, 0.0 otherwise.
    pub label: f32,
    /// The dense inputs, in the schema's order.
    pub dense: Vec<f32>,
    /// The slots' feature ids, slot by slot: one per slot, or, with multi-valued slots, each
    /// slot's values (at least one: an empty slot holds its missing id).
    pub ids: Vec<u64>,
    /// With multi-valued slots, where each slot's ids end in `ids`; empty otherwise.
    pub slot_ends: Vec<u32>,
}

/// Records turned into model inputs, row-major, ready to become tensors
/// without further reshaping.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CtrBatch {
    /// Number of records.
    pub len: usize,
    /// Slots per record.
    pub slots: usize,
    /// `len × dense` values.
    pub dense: Vec<f32>,
    /// The records' ids, record by record: `len × slots` of them, or, with multi-valued slots,
    /// each slot's values.
    pub ids: Vec<u64>,
    /// With multi-valued slots, `len × slots` ends: where each (record, slot)'s ids end in
    /// `ids`; empty when every slot holds exactly one id.
    pub slot_ends: Vec<u32>,
    /// One 0.0/1.0 label per record, the form a logistic loss takes.
    pub labels: Vec<f32>,
}

impl CtrBatch {
    /// An empty batch of `shape`d records with room for `n`, so filling it allocates once.
    pub fn with_capacity(shape: CtrShape, n: usize) -> Self {
        Self {
            len: 0,
            slots: shape.slots,
            dense: Vec::with_capacity(n * shape.dense),
            ids: Vec::with_capacity(n * shape.slots),
            slot_ends: Vec::new(),
            labels: Vec::with_capacity(n),
        }
    }

    /// Appends one record's model inputs.
    pub fn push(&mut self, example: &CtrExample) {
        let start = self.ids.len() as u32;
        self.slot_ends.extend(example.slot_ends.iter().map(|end| start + end));
        self.dense.extend_from_slice(&example.dense);
        self.ids.extend_from_slice(&example.ids);
        self.labels.push(example.label);
        self.len += 1;
    }

    /// The ids of `record`'s `slot`.
    pub fn slot_ids(&self, record: usize, slot: usize) -> &[u64] {
        let at = record * self.slots + slot;
        match self.slot_ends.is_empty() {
            true => &self.ids[at..at + 1],
            false => {
                let start = if at == 0 { 0 } else { self.slot_ends[at - 1] as usize };
                &self.ids[start..self.slot_ends[at] as usize]
            }
        }
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
        let mut b = CtrBatch::with_capacity(CtrShape::CRITEO, 2);
        b.push(&r.example());
        b.push(
            &CtrRecord {
                label: false,
                ..r.clone()
            }
            .example(),
        );
        assert_eq!(b.len, 2);
        assert_eq!(b.labels, vec![1.0, 0.0]);
        assert_eq!(b.dense[DENSE_FEATURES..], r.dense_features());
        assert_eq!(b.ids[SPARSE_SLOTS..], r.feature_ids());
        assert_eq!(b.slot_ids(1, 3), [r.feature_ids()[3]]);
    }

    #[test]
    fn multi_valued_records_keep_their_slots_apart_in_a_batch() {
        let example = |ids: Vec<u64>, ends: Vec<u32>| CtrExample {
            ids,
            slot_ends: ends,
            ..CtrExample::default()
        };
        let mut b = CtrBatch::with_capacity(CtrShape { dense: 0, slots: 2 }, 2);
        b.push(&example(vec![1, 2, 3], vec![2, 3]));
        b.push(&example(vec![4, 5, 6], vec![1, 3]));
        assert_eq!(b.slot_ends, [2, 3, 4, 6]);
        assert_eq!((b.slot_ids(0, 0), b.slot_ids(0, 1)), (&[1, 2][..], &[3][..]));
        assert_eq!((b.slot_ids(1, 0), b.slot_ids(1, 1)), (&[4][..], &[5, 6][..]));
    }
}
