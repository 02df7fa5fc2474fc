//! A shard's contiguous range of the model's dense parameters.

use std::fmt;
use std::ops::Range;

use anyhow::ensure;

use super::optimizer::ServerOptimizer;

/// This shard's range of the flattened dense parameters (all dense tensors
/// in name order, end to end) with its optimizer state.
///
/// The whole slice is one optimizer "row": every push covers all of it, so
/// Adam keeps one pair of `beta^t` for the slice.
pub struct DenseSlice {
    offset: usize,
    values: Vec<f32>,
    state: Vec<f32>,
    optimizer: ServerOptimizer,
}

impl DenseSlice {
    /// The slice starting at float `offset` of the flattened parameters,
    /// holding `values`, its optimizer state freshly initialised.
    pub fn new(offset: usize, values: Vec<f32>, optimizer: ServerOptimizer) -> Self {
        let mut state = vec![0.0; optimizer.state_len(values.len())];
        optimizer.init_state(&mut state);
        Self {
            offset,
            values,
            state,
            optimizer,
        }
    }

    /// Where the slice starts in the flattened parameters: trainers place a
    /// pulled slice, and cut a gradient for a push, by it.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Floats in the slice.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether this shard holds no dense floats (more shards than floats).
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The optimizer pushes are applied with.
    pub fn optimizer(&self) -> ServerOptimizer {
        self.optimizer
    }

    /// The parameters, as a pull returns them.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// The optimizer state, for snapshots.
    pub fn state(&self) -> &[f32] {
        &self.state
    }

    /// One optimizer step with the gradient of the whole slice.
    pub fn apply_gradients(&mut self, grads: &[f32]) -> anyhow::Result<()> {
        self.check_len("gradient", grads.len())?;
        self.optimizer.apply(&mut self.values, &mut self.state, grads);
        Ok(())
    }

    /// Geo mode: adds a trainer's delta to every float, no optimizer.
    pub fn add_deltas(&mut self, deltas: &[f32]) -> anyhow::Result<()> {
        self.check_len("delta", deltas.len())?;
        for (value, &d) in self.values.iter_mut().zip(deltas) {
            *value += d;
        }
        Ok(())
    }

    /// Replaces values and state with a snapshot's; both must have the sizes
    /// this slice already has.
    pub fn restore(&mut self, values: Vec<f32>, state: Vec<f32>) -> anyhow::Result<()> {
        self.check_len("restored value", values.len())?;
        ensure!(
            state.len() == self.state.len(),
            "dense slice at offset {}: {} state needs {} floats, got {}",
            self.offset,
            self.optimizer.name(),
            self.state.len(),
            state.len()
        );
        self.values = values;
        self.state = state;
        Ok(())
    }

    fn check_len(&self, what: &str, len: usize) -> anyhow::Result<()> {
        ensure!(
            len == self.values.len(),
            "dense slice at offset {}: needs {} {what} floats, got {len}",
            self.offset,
            self.values.len()
        );
        Ok(())
    }
}

/// A summary: the floats themselves would flood any log they reach.
impl fmt::Debug for DenseSlice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DenseSlice")
            .field("offset", &self.offset)
            .field("len", &self.values.len())
            .field("optimizer", &self.optimizer)
            .finish_non_exhaustive()
    }
}

/// The contiguous range of `total` dense floats that shard `shard` of
/// `server_num` holds: equal splits, the first `total % server_num` shards
/// one longer, so trainers and shards agree on placement without talking.
///
/// # Panics
///
/// If `shard >= server_num`.
pub fn dense_range(total: usize, shard: usize, server_num: usize) -> Range<usize> {
    assert!(shard < server_num, "shard {shard} of {server_num} servers");
    let (base, longer) = (total / server_num, total % server_num);
    let start = shard * base + shard.min(longer);
    start..start + base + usize::from(shard < longer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_tile_the_parameters() {
        for (total, server_num) in [(10, 3), (3, 5), (0, 2), (1024, 4), (7, 1)] {
            let ranges: Vec<Range<usize>> = (0..server_num).map(|s| dense_range(total, s, server_num)).collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[server_num - 1].end, total);
            for pair in ranges.windows(2) {
                assert_eq!(pair[0].end, pair[1].start);
                assert!(pair[0].len() == pair[1].len() || pair[0].len() == pair[1].len() + 1);
            }
        }
        assert_eq!(dense_range(10, 0, 3), 0..4);
        assert_eq!(dense_range(10, 2, 3), 7..10);
    }

    #[test]
    fn whole_slice_is_one_row() -> anyhow::Result<()> {
        let adam = ServerOptimizer::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            epsilon: 1e-8,
        };
        let mut slice = DenseSlice::new(4, vec![1.0, 2.0, 3.0], adam);
        assert_eq!(slice.state().len(), 8);
        let (mut value, mut state) = (vec![1.0, 2.0, 3.0], slice.state().to_vec());
        slice.apply_gradients(&[0.1, -0.2, 0.3])?;
        adam.apply(&mut value, &mut state, &[0.1, -0.2, 0.3]);
        assert_eq!((slice.values(), slice.state()), (&value[..], &state[..]));

        slice.add_deltas(&[1.0, 1.0, 1.0])?;
        assert_eq!(slice.values()[0], value[0] + 1.0);
        Ok(())
    }

    #[test]
    fn wrong_sizes_are_refused_with_both_sizes() {
        let mut slice = DenseSlice::new(8, vec![0.0; 4], ServerOptimizer::Sgd { lr: 0.1, momentum: 0.9 });
        let message = slice
            .apply_gradients(&[0.0; 3])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(message.contains("offset 8") && message.contains("needs 4") && message.contains("got 3"));
        assert!(slice.add_deltas(&[0.0; 5]).is_err());
        assert!(slice.restore(vec![0.0; 4], vec![0.0; 3]).is_err());
        assert!(slice.restore(vec![0.0; 3], vec![0.0; 4]).is_err());
        assert!(slice.restore(vec![2.0; 4], vec![1.0; 4]).is_ok());
        assert_eq!(slice.values(), [2.0; 4]);
    }
}
