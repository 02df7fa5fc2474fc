//! A shard's part of one sparse embedding table: the rows whose feature ids
//! hash to this shard, with their optimizer state, created on first touch.

use std::fmt;
use std::mem::size_of;

use anyhow::{ensure, Context};

use super::optimizer::ServerOptimizer;
use super::row_index::RowIndex;
use super::row_pages::RowPages;
use crate::rng::SplitMix64;

/// How a row is initialised the first time any trainer touches it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowInit {
    /// The job's seed: every shard, and any reference, derives the same rows.
    pub seed: u64,
    /// Rows start uniform in `[-bound, bound)`.
    pub bound: f32,
}

/// Writes the initial value of row `id` of `table` into `out`.
///
/// Depends only on the seed, the table's name and the id — not on the shard
/// holding the row nor on when it was created — so a job re-sharded over a
/// different number of servers starts from the same model, and tests can
/// reproduce any row.
pub fn init_row(init: &RowInit, table: &str, id: u64, out: &mut [f32]) {
    let mut rng = SplitMix64::for_stream(init.seed, table, id);
    for value in out {
        *value = rng.uniform(-init.bound, init.bound);
    }
}

/// The rows of one sparse table held by one shard, each its value followed
/// by its optimizer state.
///
/// Memory per row is the value, the state, and about 15–30 bytes of index
/// (12-byte entries and a control byte, in a hash map between 7/16 and 7/8
/// full); rows live in fixed pages, so there is no doubling of the row
/// storage and no allocation per row. `examples/ps_table_memory.rs` measures
/// it.
pub struct SparseTable {
    name: String,
    width: usize,
    init: RowInit,
    optimizer: ServerOptimizer,
    index: RowIndex,
    rows: RowPages,
    len: usize,
}

impl SparseTable {
    /// An empty table of rows `width` floats wide.
    ///
    /// # Panics
    ///
    /// If `width` is 0: such a table holds nothing, so it is a configuration
    /// bug.
    pub fn new(name: &str, width: usize, init: RowInit, optimizer: ServerOptimizer) -> Self {
        assert!(
            width > 0,
            "sparse table `{name}` must have rows at least one float wide"
        );
        Self {
            name: name.to_owned(),
            width,
            init,
            optimizer,
            index: RowIndex::default(),
            rows: RowPages::new(width + optimizer.state_len(width)),
            len: 0,
        }
    }

    /// The table's name: trainers address tables by it and rows are
    /// initialised from it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Floats per row, the embedding dimension.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The optimizer pushes are applied with.
    pub fn optimizer(&self) -> ServerOptimizer {
        self.optimizer
    }

    /// Rows this shard holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no row has been touched yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies the rows of `ids` into `out` (`ids.len() × width`, row after
    /// row), creating and initialising rows never seen before.
    pub fn pull(&mut self, ids: &[u64], out: &mut [f32]) -> anyhow::Result<()> {
        self.check_rows("pull", "output", ids.len(), out.len())?;
        for (&id, out) in ids.iter().zip(out.chunks_exact_mut(self.width)) {
            let slot = self.slot(id)?;
            out.copy_from_slice(&self.rows.row(slot)[..self.width]);
        }
        Ok(())
    }

    /// Applies the optimizer to each row of `ids` with its gradient from
    /// `grads` (`ids.len() × width`); a repeated id is updated once per
    /// occurrence, in order. Rows not listed are left alone (lazy updates).
    pub fn apply_gradients(&mut self, ids: &[u64], grads: &[f32]) -> anyhow::Result<()> {
        self.check_rows("push", "gradient", ids.len(), grads.len())?;
        for (&id, grad) in ids.iter().zip(grads.chunks_exact(self.width)) {
            let slot = self.slot(id)?;
            let (value, state) = self.rows.row_mut(slot).split_at_mut(self.width);
            self.optimizer.apply(value, state, grad);
        }
        Ok(())
    }

    /// Geo mode: adds each trainer-computed delta to its row's value, with no
    /// optimizer and no change of state.
    pub fn add_deltas(&mut self, ids: &[u64], deltas: &[f32]) -> anyhow::Result<()> {
        self.check_rows("delta push", "delta", ids.len(), deltas.len())?;
        for (&id, delta) in ids.iter().zip(deltas.chunks_exact(self.width)) {
            let slot = self.slot(id)?;
            for (value, &d) in self.rows.row_mut(slot).iter_mut().zip(delta) {
                *value += d;
            }
        }
        Ok(())
    }

    /// Every row as `(id, value, state)`, in no particular order: for
    /// snapshots and tests.
    pub fn rows(&self) -> impl Iterator<Item = (u64, &[f32], &[f32])> + '_ {
        self.index.iter().map(move |(id, slot)| {
            let (value, state) = self.rows.row(slot).split_at(self.width);
            (id, value, state)
        })
    }

    /// Sets row `id` to `value` and `state` (creating it if needed), as a
    /// snapshot being loaded does.
    pub fn insert_row(&mut self, id: u64, value: &[f32], state: &[f32]) -> anyhow::Result<()> {
        let state_len = self.optimizer.state_len(self.width);
        ensure!(
            value.len() == self.width && state.len() == state_len,
            "table `{}`: row {id} needs {} values and {state_len} state floats ({}), got {} and {}",
            self.name,
            self.width,
            self.optimizer.name(),
            value.len(),
            state.len()
        );
        let slot = self.slot(id)?;
        let (row_value, row_state) = self.rows.row_mut(slot).split_at_mut(self.width);
        row_value.copy_from_slice(value);
        row_state.copy_from_slice(state);
        Ok(())
    }

    /// Drops every row, as loading a snapshot does before inserting the
    /// snapshot's: rows created after it must not survive a rollback.
    pub(crate) fn clear(&mut self) {
        self.index = RowIndex::default();
        self.rows = RowPages::new(self.rows.stride());
        self.len = 0;
    }

    /// Bytes allocated for rows and index, counting capacity not yet used:
    /// what the shard's memory budget is measured against.
    pub fn memory_bytes(&self) -> usize {
        self.rows.memory_bytes() + self.index.memory_bytes()
    }

    /// Bytes a row needs at the least — its id, value and state — the ideal
    /// `memory_bytes() / len()` is compared with.
    pub fn raw_bytes_per_row(&self) -> usize {
        size_of::<u64>() + size_of::<f32>() * (self.width + self.optimizer.state_len(self.width))
    }

    /// The slot of row `id`, created and initialised if it is new.
    fn slot(&mut self, id: u64) -> anyhow::Result<u32> {
        let Self {
            name,
            width,
            init,
            optimizer,
            index,
            rows,
            len,
        } = self;
        index
            .get_or_insert_with(id, || {
                let slot = rows.push()?;
                let (value, state) = rows.row_mut(slot).split_at_mut(*width);
                init_row(init, name, id, value);
                optimizer.init_state(state);
                *len += 1;
                Ok(slot)
            })
            .with_context(|| format!("table `{name}`: cannot add row {id}"))
    }

    /// Checks that `floats` holds exactly one row per id.
    fn check_rows(&self, operation: &str, what: &str, ids: usize, floats: usize) -> anyhow::Result<()> {
        ensure!(
            Some(floats) == ids.checked_mul(self.width),
            "table `{}`: a {operation} of {ids} ids needs {} {what} floats ({ids} × width {}), got {floats}",
            self.name,
            ids.saturating_mul(self.width),
            self.width
        );
        Ok(())
    }
}

/// A summary: the rows themselves would flood any log they reach.
impl fmt::Debug for SparseTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SparseTable")
            .field("name", &self.name)
            .field("width", &self.width)
            .field("optimizer", &self.optimizer)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INIT: RowInit = RowInit { seed: 42, bound: 0.5 };
    const ADAM: ServerOptimizer = ServerOptimizer::Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
    };
    const SGD: ServerOptimizer = ServerOptimizer::Sgd { lr: 0.1, momentum: 0.0 };

    fn expected_row(table: &str, id: u64, width: usize) -> Vec<f32> {
        let mut row = vec![0.0; width];
        init_row(&INIT, table, id, &mut row);
        row
    }

    #[test]
    fn rows_start_from_their_id_whatever_the_order() -> anyhow::Result<()> {
        let ids = [7u64, 1 << 50, 3, 99];
        let mut forward = SparseTable::new("emb", 4, INIT, SGD);
        let mut backward = SparseTable::new("emb", 4, INIT, ADAM);
        let mut a = vec![0.0; 16];
        let mut b = vec![0.0; 16];
        forward.pull(&ids, &mut a)?;
        let reversed: Vec<u64> = ids.iter().rev().copied().collect();
        backward.pull(&reversed, &mut b)?;
        for (i, &id) in ids.iter().enumerate() {
            let want = expected_row("emb", id, 4);
            assert_eq!(a[i * 4..(i + 1) * 4], want[..]);
            assert_eq!(b[(3 - i) * 4..(4 - i) * 4], want[..]);
            assert!(want.iter().all(|v| (-0.5..0.5).contains(v)));
        }
        assert_ne!(expected_row("emb", 7, 4), expected_row("emb", 3, 4));
        assert_ne!(expected_row("emb", 7, 4), expected_row("other", 7, 4));
        assert_eq!(forward.len(), 4);
        Ok(())
    }

    #[test]
    fn repeated_ids_update_in_order_and_others_stay_lazy() -> anyhow::Result<()> {
        let mut table = SparseTable::new("emb", 2, INIT, ADAM);
        let mut out = vec![0.0; 4];
        table.pull(&[1, 2], &mut out)?;
        table.apply_gradients(&[1, 1], &[0.5, -1.0, 0.25, 2.0])?;

        // Reference: the same row updated twice by hand.
        let mut value = expected_row("emb", 1, 2);
        let mut state = vec![0.0; ADAM.state_len(2)];
        ADAM.init_state(&mut state);
        ADAM.apply(&mut value, &mut state, &[0.5, -1.0]);
        ADAM.apply(&mut value, &mut state, &[0.25, 2.0]);

        let mut fresh_state = vec![0.0; ADAM.state_len(2)];
        ADAM.init_state(&mut fresh_state);
        for (id, row_value, row_state) in table.rows() {
            match id {
                1 => assert_eq!((row_value, row_state), (&value[..], &state[..])),
                2 => assert_eq!((row_value, row_state), (&out[2..], &fresh_state[..])),
                _ => panic!("unexpected row {id}"),
            }
        }
        Ok(())
    }

    #[test]
    fn pushes_and_deltas_create_missing_rows() -> anyhow::Result<()> {
        let mut table = SparseTable::new("emb", 3, INIT, SGD);
        table.apply_gradients(&[10], &[1.0, 2.0, 3.0])?;
        table.add_deltas(&[11], &[1.0, 1.0, 1.0])?;
        let mut out = vec![0.0; 6];
        table.pull(&[10, 11], &mut out)?;
        let (start10, start11) = (expected_row("emb", 10, 3), expected_row("emb", 11, 3));
        for i in 0..3 {
            assert!((out[i] - (start10[i] - 0.1 * (i + 1) as f32)).abs() < 1e-6);
            assert_eq!(out[3 + i], start11[i] + 1.0);
        }
        assert_eq!(table.len(), 2);
        Ok(())
    }

    #[test]
    fn wrong_sizes_name_the_table_and_both_sizes() {
        let mut table = SparseTable::new("user_emb", 9, INIT, ADAM);
        let pull = table.pull(&[1, 2, 3], &mut [0.0; 26]).err().map(|e| e.to_string());
        let pull = pull.unwrap_or_default();
        assert!(
            pull.contains("user_emb") && pull.contains("27") && pull.contains("26"),
            "{pull}"
        );

        let push = table.apply_gradients(&[1], &[0.0; 8]).err().map(|e| e.to_string());
        let push = push.unwrap_or_default();
        assert!(
            push.contains("user_emb") && push.contains('9') && push.contains('8'),
            "{push}"
        );
        assert!(table.add_deltas(&[1], &[0.0; 10]).is_err());

        let insert = table.insert_row(5, &[0.0; 8], &[0.0; 20]).err().map(|e| e.to_string());
        let insert = insert.unwrap_or_default();
        assert!(insert.contains("user_emb") && insert.contains("9 values") && insert.contains("got 8"));
        assert!(table.insert_row(5, &[0.0; 9], &[0.0; 19]).is_err());
        assert!(table.is_empty(), "failed calls must not create rows");
    }

    #[test]
    fn inserted_rows_read_back() -> anyhow::Result<()> {
        let mut table = SparseTable::new("emb", 2, INIT, ServerOptimizer::Sgd { lr: 0.1, momentum: 0.9 });
        table.insert_row(4, &[1.0, 2.0], &[3.0, 4.0])?;
        table.insert_row(4, &[5.0, 6.0], &[7.0, 8.0])?;
        let rows: Vec<(u64, Vec<f32>, Vec<f32>)> = table.rows().map(|(i, v, s)| (i, v.to_vec(), s.to_vec())).collect();
        assert_eq!(rows, [(4, vec![5.0, 6.0], vec![7.0, 8.0])]);
        Ok(())
    }

    /// Bytes per row stay within 1.5× of the ideal at 200k rows for the
    /// stateful optimizers (it holds from ~100k rows up whatever the hash
    /// map's fill; plain SGD at width 9 can reach ~1.55× just after the map
    /// grows, so it is measured by `examples/ps_table_memory.rs`, not here).
    #[test]
    fn memory_per_row_is_near_the_ideal() -> anyhow::Result<()> {
        let adagrad = ServerOptimizer::Adagrad {
            lr: 0.1,
            epsilon: 1e-10,
            initial_accumulator: 0.1,
        };
        for optimizer in [adagrad, ADAM] {
            let mut table = SparseTable::new("emb", 9, INIT, optimizer);
            let mut rng = SplitMix64::new(5);
            let ids: Vec<u64> = (0..200_000).map(|_| rng.next_u64()).collect();
            let mut out = vec![0.0; ids.len() * 9];
            table.pull(&ids, &mut out)?;
            let ratio = table.memory_bytes() as f64 / table.len() as f64 / table.raw_bytes_per_row() as f64;
            assert!(ratio < 1.5, "{}: {ratio:.3}× the ideal", optimizer.name());
            assert!(ratio >= 1.0);
        }
        Ok(())
    }
}
