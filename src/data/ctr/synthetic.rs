//! A deterministic Criteo-shaped generator with a planted click model.
//!
//! Sample `index` of a split is a pure function of `(seed, split, index)`: any
//! trainer can produce any sample, nothing is stored, and one process and a
//! sharded cluster read the same data. Labels come from a planted logistic
//! model over the record's features, so a learner's AUC can be compared with
//! the ceiling [`CriteoSynth::planted_auc`].

use super::zipf::Zipf;
use super::{feature_key, mix64, CtrRecord, DENSE_FEATURES, SPARSE_SLOTS};
use crate::metrics::auc;
use crate::rng::SplitMix64;

/// Smallest slot vocabulary (Criteo's smallest slots have 3–4 values).
const MIN_VOCAB: u64 = 3;
/// Exponent of the Zipf law of ids within a slot.
const ZIPF_EXPONENT: f64 = 1.1;
/// Share of clicks the bias is calibrated to (Criteo's is about 0.256).
const POSITIVE_RATE: f64 = 0.25;
/// Records drawn (from their own stream) to calibrate the bias.
const CALIBRATION_RECORDS: u64 = 4096;
/// Chance that an integer column is missing, close to Criteo's own rates.
const DENSE_MISSING: [f64; DENSE_FEATURES] = [
    0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22,
];
/// Chance that a categorical slot is missing, close to Criteo's own rates.
const SPARSE_MISSING: [f64; SPARSE_SLOTS] = [
    0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0, 0.0, 0.0, 0.03, 0.0, 0.0, 0.44, 0.44, 0.03,
    0.76, 0.0, 0.03, 0.44, 0.44,
];
/// Scale of the slot-pair interaction terms.
const INTERACTION_SCALE: f64 = 0.6;

/// Which half of the data a sample belongs to; each has its own stream, so
/// test samples are never training samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// Samples to train on.
    Train,
    /// Held-out samples to evaluate on.
    Test,
}

impl Split {
    fn stream(self) -> &'static str {
        match self {
            Split::Train => "ctr-train",
            Split::Test => "ctr-test",
        }
    }
}

/// How one integer column is drawn: `floor(exp(mu + sigma·z)) - offset`,
/// heavy-tailed counts like Criteo's.
#[derive(Debug, Clone)]
struct DenseColumn {
    mu: f64,
    sigma: f64,
    offset: i64,
}

/// Criteo-shaped synthetic CTR data: 26 slots with vocabularies from 3 to
/// `max_vocab` and Zipf-distributed ids, 13 heavy-tailed integer columns,
/// missing values, and labels drawn from a planted model.
#[derive(Debug, Clone)]
pub struct CriteoSynth {
    seed: u64,
    slots: Vec<Zipf>,
    dense: Vec<DenseColumn>,
    /// Salts of the value, weight and interaction-factor hashes.
    value_salt: u64,
    weight_salt: u64,
    factor_salt: u64,
    /// Per-slot scale of the planted weights.
    slot_scale: [f64; SPARSE_SLOTS],
    /// Planted weights of the dense features.
    dense_weight: [f64; DENSE_FEATURES],
    /// Slot pairs whose values interact in the planted logit.
    pairs: [(usize, usize); 3],
    bias: f64,
}

impl CriteoSynth {
    /// The generator for `seed`, with the largest slot vocabulary `max_vocab`
    /// (at least 3 and at most 2³² are used). Vocabularies grow
    /// geometrically from 3 to `max_vocab` over the 26 slots, in a seeded
    /// order. Building it draws 4096 calibration records (a few ms).
    pub fn new(seed: u64, max_vocab: usize) -> Self {
        let max_vocab = (max_vocab as u64).clamp(MIN_VOCAB, u64::from(u32::MAX) + 1);
        let mut shape = SplitMix64::for_stream(seed, "ctr-shape", 0);
        let mut order: Vec<usize> = (0..SPARSE_SLOTS).collect();
        shape.shuffle(&mut order);
        let ratio = max_vocab as f64 / MIN_VOCAB as f64;
        let mut vocab = [0u64; SPARSE_SLOTS];
        for (position, &slot) in order.iter().enumerate() {
            let v = MIN_VOCAB as f64 * ratio.powf(position as f64 / (SPARSE_SLOTS - 1) as f64);
            vocab[slot] = (v.round() as u64).clamp(MIN_VOCAB, max_vocab);
        }
        let slots = vocab.iter().map(|&n| Zipf::new(n, ZIPF_EXPONENT)).collect();
        let dense = (0..DENSE_FEATURES)
            .map(|j| DenseColumn {
                mu: f64::from(shape.uniform(0.0, 4.0)),
                sigma: f64::from(shape.uniform(0.7, 1.7)),
                // Criteo's I2 is the one column with negative values (down to -3).
                offset: if j == 1 { 3 } else { 0 },
            })
            .collect();
        let mut planted = SplitMix64::for_stream(seed, "ctr-planted", 0);
        let slot_scale = std::array::from_fn(|_| f64::from(planted.uniform(0.05, 0.4)));
        let dense_weight = std::array::from_fn(|_| 0.2 * f64::from(planted.normal()));
        // Interacting slots are mid-sized: common enough values to be learnable.
        let mut by_size: Vec<usize> = (0..SPARSE_SLOTS).collect();
        by_size.sort_by_key(|&s| (vocab[s], s));
        let pairs = [
            (by_size[8], by_size[13]),
            (by_size[10], by_size[16]),
            (by_size[6], by_size[18]),
        ];
        let mut synth = Self {
            seed,
            slots,
            dense,
            value_salt: planted.next_u64(),
            weight_salt: planted.next_u64(),
            factor_salt: planted.next_u64(),
            slot_scale,
            dense_weight,
            pairs,
            bias: 0.0,
        };
        synth.bias = synth.calibrated_bias();
        synth
    }

    /// Sample `index` of `split`: the same record on every call and machine.
    pub fn record(&self, split: Split, index: u64) -> CtrRecord {
        let mut rng = SplitMix64::for_stream(self.seed, split.stream(), index);
        let mut record = self.features(&mut rng);
        let p = sigmoid(self.click_logit(&record));
        record.label = unit(rng.next_u64()) < p;
        record
    }

    /// The planted model's log-odds of a click, from the record's features
    /// only (so it also scores records read back from TSV): a calibrated
    /// bias, plus a hashed weight per slot value (missing → 0), plus a linear
    /// term in [`CtrRecord::dense_features`], plus products of per-value
    /// factors for three slot pairs — the part a linear model cannot learn.
    pub fn click_logit(&self, record: &CtrRecord) -> f64 {
        self.bias + self.feature_logit(record)
    }

    /// ROC AUC of the planted probabilities over the first `samples` samples
    /// of `split`: the ceiling any learner can reach on them. `None` when
    /// those samples hold only one class.
    pub fn planted_auc(&self, split: Split, samples: u64) -> Option<f64> {
        let mut scores = Vec::with_capacity(samples as usize);
        let mut labels = Vec::with_capacity(samples as usize);
        for index in 0..samples {
            let r = self.record(split, index);
            // The logit ranks exactly as the probability, with fewer f32 ties.
            scores.push(self.click_logit(&r) as f32);
            labels.push(if r.label { 1.0 } else { 0.0 });
        }
        auc(&scores, &labels)
    }

    /// Bytes held by the Zipf tables of all slots.
    pub fn table_bytes(&self) -> usize {
        self.slots.iter().map(Zipf::table_bytes).sum()
    }

    /// The features of one record (label unset), drawn from `rng`. One
    /// 64-bit draw serves each column: its low half decides whether the value
    /// is missing, its high half picks the value.
    fn features(&self, rng: &mut SplitMix64) -> CtrRecord {
        let mut dense = [None; DENSE_FEATURES];
        let mut spare_normal = None;
        for (j, (x, c)) in dense.iter_mut().zip(&self.dense).enumerate() {
            if low_unit(rng.next_u64()) < DENSE_MISSING[j] {
                continue;
            }
            let z = match spare_normal.take() {
                Some(z) => z,
                None => {
                    let (z, spare) = normal_pair(rng);
                    spare_normal = Some(spare);
                    z
                }
            };
            *x = Some((c.mu + c.sigma * z).exp().floor() as i64 - c.offset);
        }
        let sparse = std::array::from_fn(|slot| {
            let bits = rng.next_u64();
            if low_unit(bits) < SPARSE_MISSING[slot] {
                return None;
            }
            let rank = self.slots[slot].rank(high_unit(bits));
            // A 32-bit hash of (slot, rank), like Criteo's hex values.
            Some((mix64(self.value_salt ^ (((slot as u64 + 1) << 32) | rank)) >> 32) as u32)
        });
        CtrRecord {
            label: false,
            dense,
            sparse,
        }
    }

    /// The planted logit without the bias.
    fn feature_logit(&self, record: &CtrRecord) -> f64 {
        let mut logit = 0.0;
        for (slot, value) in record.sparse.iter().enumerate() {
            if let Some(v) = value {
                let h = mix64(self.weight_salt ^ feature_key(slot, Some(*v)));
                logit += self.slot_scale[slot] * centred(h);
            }
        }
        for (x, a) in record.dense_features().iter().zip(&self.dense_weight) {
            logit += a * f64::from(*x);
        }
        let factor = |slot: usize| {
            record.sparse[slot].map_or(0.0, |v| centred(mix64(self.factor_salt ^ feature_key(slot, Some(v)))))
        };
        for &(p, q) in &self.pairs {
            logit += INTERACTION_SCALE * factor(p) * factor(q);
        }
        logit
    }

    /// The bias that makes the mean click probability [`POSITIVE_RATE`] on
    /// calibration records drawn from their own stream.
    fn calibrated_bias(&self) -> f64 {
        let logits: Vec<f64> = (0..CALIBRATION_RECORDS)
            .map(|i| self.feature_logit(&self.features(&mut SplitMix64::for_stream(self.seed, "ctr-calibration", i))))
            .collect();
        let rate = |b: f64| logits.iter().map(|l| sigmoid(b + l)).sum::<f64>() / logits.len() as f64;
        // The mean probability rises with the bias: bisect.
        let (mut lo, mut hi) = (-30.0, 30.0);
        for _ in 0..80 {
            let mid = 0.5 * (lo + hi);
            if rate(mid) < POSITIVE_RATE {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        0.5 * (lo + hi)
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Uniform in [0, 1) from 53 random bits.
fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// Uniform in [0, 1) from the low 32 bits.
fn low_unit(bits: u64) -> f64 {
    f64::from(bits as u32) / 4_294_967_296.0
}

/// Uniform in [0, 1) from the high 32 bits: fine enough for the rarest id of
/// a 10⁷-value slot (probability ~10⁻⁹ against a 2⁻³² grid).
fn high_unit(bits: u64) -> f64 {
    f64::from((bits >> 32) as u32) / 4_294_967_296.0
}

/// Two independent standard normals (both halves of Box–Muller), since the
/// transcendental calls dominate the cost of a dense column.
fn normal_pair(rng: &mut SplitMix64) -> (f64, f64) {
    let u1 = unit(rng.next_u64()).max(f64::MIN_POSITIVE);
    let angle = std::f64::consts::TAU * unit(rng.next_u64());
    let radius = (-2.0 * u1.ln()).sqrt();
    (radius * angle.cos(), radius * angle.sin())
}

/// Uniform with mean 0 and variance 1 (in [-√3, √3)) from a hash.
fn centred(hash: u64) -> f64 {
    (2.0 * unit(hash) - 1.0) * 3f64.sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_pure_functions_of_seed_split_and_index() {
        let a = CriteoSynth::new(42, 1000);
        let b = CriteoSynth::new(42, 1000);
        assert_eq!(a.record(Split::Train, 17), b.record(Split::Train, 17));
        assert_ne!(a.record(Split::Train, 17), a.record(Split::Test, 17));
        assert_ne!(a.record(Split::Train, 17), a.record(Split::Train, 18));
        assert_ne!(
            a.record(Split::Train, 17),
            CriteoSynth::new(43, 1000).record(Split::Train, 17)
        );
    }

    #[test]
    fn data_looks_like_criteo() {
        let synth = CriteoSynth::new(7, 100_000);
        let n = 20_000u64;
        let records: Vec<CtrRecord> = (0..n).map(|i| synth.record(Split::Train, i)).collect();
        let clicks = records.iter().filter(|r| r.label).count() as f64 / n as f64;
        assert!((0.22..0.28).contains(&clicks), "positive rate {clicks}");
        // I12 is missing 77% of the time; I2 goes negative; C1 is never missing.
        let missing = records.iter().filter(|r| r.dense[11].is_none()).count() as f64 / n as f64;
        assert!((0.74..0.80).contains(&missing), "I12 missing {missing}");
        assert!(records.iter().any(|r| r.dense[1].is_some_and(|x| x < 0)));
        assert!(records.iter().all(|r| r.sparse[0].is_some()));
        // Distinct values per slot span small and large vocabularies.
        let distinct: Vec<usize> = (0..SPARSE_SLOTS)
            .map(|s| {
                records
                    .iter()
                    .filter_map(|r| r.sparse[s])
                    .collect::<std::collections::HashSet<_>>()
                    .len()
            })
            .collect();
        assert!(distinct.iter().any(|&d| d <= 4), "{distinct:?}");
        assert!(distinct.iter().any(|&d| d > 2_000), "{distinct:?}");
    }

    #[test]
    fn planted_model_is_informative_but_not_perfect() -> anyhow::Result<()> {
        let synth = CriteoSynth::new(42, 100_000);
        let auc = synth
            .planted_auc(Split::Test, 20_000)
            .ok_or_else(|| anyhow::anyhow!("one class"))?;
        assert!((0.7..0.9).contains(&auc), "planted AUC {auc}");
        Ok(())
    }

    #[test]
    fn tables_stay_small_for_huge_vocabularies() {
        assert!(CriteoSynth::new(1, 10_000_000).table_bytes() <= SPARSE_SLOTS * (4096 * 8 + 1024 * 4));
    }
}
