//! Tests of `snapshot`.

use super::*;
use crate::ps::optimizer::ServerOptimizer;
use crate::ps::table::test_optimizers::{ADAM, SGD};
use crate::ps::table::RowInit;

const INFO: ShardSnapshotInfo = ShardSnapshotInfo {
    shard: 1,
    server_num: 3,
};
const INIT: RowInit = RowInit { seed: 9, bound: 0.1 };

/// A shard as a few steps of training leave it: Adam on the dense slice
/// and on table `user`, stateless SGD on table `item`.
struct Shard {
    dense: DenseSlice,
    user: SparseTable,
    item: SparseTable,
}

impl Shard {
    fn fresh() -> Self {
        Self {
            dense: DenseSlice::new(4, vec![0.0; 4], ADAM),
            user: SparseTable::new("user", 3, INIT, ADAM),
            item: SparseTable::new("item", 2, INIT, SGD),
        }
    }

    fn trained() -> anyhow::Result<Self> {
        let mut shard = Self::fresh();
        for step in 0..3 {
            let g = step as f32 + 1.0;
            shard.dense.apply_gradients(&[0.1 * g, -0.2, 0.3, g])?;
            shard.user.apply_gradients(&[1, 2 + step, 1 << 40], &[g; 9], &[])?;
            shard.item.apply_gradients(&[7, 8], &[-g; 4], &[])?;
        }
        Ok(shard)
    }

    /// One more identical step on both shards: equal results only if the
    /// Adam moments and step counts came back too.
    fn step(&mut self) -> anyhow::Result<()> {
        self.dense.apply_gradients(&[1.0, 2.0, 3.0, 4.0])?;
        self.user.apply_gradients(&[1, 3, 1 << 40], &[0.5; 9], &[])?;
        self.item.apply_gradients(&[7], &[1.0; 2], &[])
    }

    fn save(&self, path: &Path) -> anyhow::Result<()> {
        save_shard(path, &INFO, &self.dense, &[&self.user, &self.item])
    }

    fn load(&mut self, path: &Path, info: &ShardSnapshotInfo) -> anyhow::Result<()> {
        load_shard(path, info, &mut self.dense, &mut [&mut self.user, &mut self.item])
    }
}

type Rows = Vec<(u64, Vec<f32>, Vec<f32>)>;

fn sorted_rows(table: &SparseTable) -> Rows {
    let mut rows: Rows = table.rows().map(|(id, v, s)| (id, v.to_vec(), s.to_vec())).collect();
    rows.sort_unstable_by_key(|row| row.0);
    rows
}

fn assert_same(a: &Shard, b: &Shard) {
    assert_eq!(a.dense.values(), b.dense.values());
    assert_eq!(a.dense.state(), b.dense.state());
    assert_eq!(sorted_rows(&a.user), sorted_rows(&b.user));
    assert_eq!(sorted_rows(&a.item), sorted_rows(&b.item));
}

#[test]
fn rehashing_cuts_every_optimizer_slot_of_the_dense_floats_and_keeps_the_rows_hashed_here() -> anyhow::Result<()> {
    // One server held everything: 8 dense floats under Adam, and the rows of two tables.
    let mut whole = Shard {
        dense: DenseSlice::new(0, vec![0.0; 8], ADAM),
        ..Shard::fresh()
    };
    for step in 0..3 {
        let g = step as f32 + 1.0;
        whole
            .dense
            .apply_gradients(&[g, -g, 0.5, 2.0, -1.0, g * g, 0.25, 3.0])?;
        let ids: Vec<u64> = (0..20).map(|id| id * 7 + step).collect();
        whole.user.apply_gradients(&ids, &vec![g; ids.len() * 3], &[])?;
        whole.item.apply_gradients(&ids, &vec![-g; ids.len() * 2], &[])?;
    }
    let one = ShardSnapshotInfo {
        shard: 0,
        server_num: 1,
    };
    let files = [shard_bytes(&one, &whole.dense, &[&whole.user, &whole.item])?];
    // Shard 1 of 2 holds floats 4..8.
    let info = ShardSnapshotInfo {
        shard: 1,
        server_num: 2,
    };
    let mut part = Shard {
        dense: DenseSlice::new(4, vec![0.0; 4], ADAM),
        ..Shard::fresh()
    };
    load_rehashed(&files, &info, &mut part.dense, &mut [&mut part.user, &mut part.item])?;
    assert_eq!(part.dense.values(), &whole.dense.values()[4..]);
    let state = whole.dense.state();
    let (first_moment, second_moment, powers) = (&state[4..8], &state[12..16], &state[16..]);
    let expected: Vec<f32> = first_moment
        .iter()
        .chain(second_moment)
        .chain(powers)
        .copied()
        .collect();
    assert_eq!(part.dense.state(), expected);
    for (index, (kept, all)) in [(&part.user, &whole.user), (&part.item, &whole.item)]
        .into_iter()
        .enumerate()
    {
        let here: Rows = sorted_rows(all)
            .into_iter()
            .filter(|row| shard_of(index, row.0, 2) == 1)
            .collect();
        assert!(!here.is_empty() && here.len() < all.len());
        assert_eq!(sorted_rows(kept), here);
    }
    Ok(())
}

/// The chained message of `result`'s error, or "" if it succeeded.
fn message(result: anyhow::Result<()>) -> String {
    result.err().map(|e| format!("{e:#}")).unwrap_or_default()
}

#[test]
fn round_trip_keeps_values_and_optimizer_state() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("shard-1.safetensors");
    let mut original = Shard::trained()?;
    original.save(&path)?;

    let mut loaded = Shard::fresh();
    loaded.user.apply_gradients(&[99], &[0.0; 3], &[])?; // created after the snapshot: must go
    loaded.load(&path, &INFO)?;
    assert_eq!(loaded.user.len(), 5);
    assert_same(&original, &loaded);

    original.step()?;
    loaded.step()?;
    assert_same(&original, &loaded);

    let leftovers: Vec<_> = fs::read_dir(dir.path())?.collect::<Result<_, _>>()?;
    assert_eq!(leftovers.len(), 1, "temporary files left: {leftovers:?}");
    Ok(())
}

#[test]
fn saving_again_replaces_the_file() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("shard.safetensors");
    Shard::fresh().save(&path)?;
    let trained = Shard::trained()?;
    trained.save(&path)?;
    let mut loaded = Shard::fresh();
    loaded.load(&path, &INFO)?;
    assert_same(&trained, &loaded);
    Ok(())
}

#[test]
fn wrong_shard_or_server_count_is_refused_and_changes_nothing() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("shard.safetensors");
    Shard::trained()?.save(&path)?;
    let mut shard = Shard::fresh();
    let err = message(shard.load(
        &path,
        &ShardSnapshotInfo {
            shard: 2,
            server_num: 3,
        },
    ));
    assert!(
        err.contains("shard.safetensors") && err.contains("shard is 1, this shard's is 2"),
        "{err}"
    );
    let err = message(shard.load(
        &path,
        &ShardSnapshotInfo {
            shard: 1,
            server_num: 4,
        },
    ));
    assert!(err.contains("server_num is 3, this shard's is 4"), "{err}");
    assert_same(&shard, &Shard::fresh());
    Ok(())
}

#[test]
fn table_mismatches_are_named() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("shard.safetensors");
    let saved = Shard::trained()?;
    save_shard(&path, &INFO, &saved.dense, &[&saved.user])?;
    let mut shard = Shard::fresh();
    let err = message(shard.load(&path, &INFO));
    assert!(err.contains("table `item` is missing"), "{err}");

    saved.save(&path)?;
    let mut wide = SparseTable::new("user", 4, INIT, ADAM);
    let err = message(load_shard(
        &path,
        &INFO,
        &mut shard.dense,
        &mut [&mut wide, &mut shard.item],
    ));
    assert!(err.contains("sparse.user.width is 3, this shard's is 4"), "{err}");

    let mut adagrad = SparseTable::new(
        "user",
        3,
        INIT,
        ServerOptimizer::Adagrad {
            lr: 0.1,
            epsilon: 1e-10,
            initial_accumulator: 0.0,
        },
    );
    let err = message(load_shard(
        &path,
        &INFO,
        &mut shard.dense,
        &mut [&mut adagrad, &mut shard.item],
    ));
    assert!(
        err.contains("sparse.user.optimizer is adam, this shard's is adagrad"),
        "{err}"
    );

    let mut momentum = SparseTable::new("item", 2, INIT, ServerOptimizer::Sgd { lr: 0.1, momentum: 0.9 });
    let err = message(load_shard(
        &path,
        &INFO,
        &mut shard.dense,
        &mut [&mut shard.user, &mut momentum],
    ));
    assert!(
        err.contains("sparse.item.state") && err.contains("[2, 0]") && err.contains("[2, 2]"),
        "{err}"
    );

    let err = message(load_shard(&path, &INFO, &mut shard.dense, &mut [&mut shard.user]));
    assert!(
        err.contains("holds table `item`, which this shard does not have"),
        "{err}"
    );
    assert_same(&shard, &Shard::fresh());
    Ok(())
}

#[test]
fn dense_mismatches_are_named() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("shard.safetensors");
    let saved = Shard::trained()?;
    saved.save(&path)?;
    let mut shard = Shard::fresh();
    let mut longer = DenseSlice::new(4, vec![0.0; 5], ADAM);
    let err = message(load_shard(
        &path,
        &INFO,
        &mut longer,
        &mut [&mut shard.user, &mut shard.item],
    ));
    assert!(
        err.contains("dense.values") && err.contains("[4]") && err.contains("[5]"),
        "{err}"
    );
    let mut moved = DenseSlice::new(5, vec![0.0; 4], ADAM);
    let err = message(load_shard(
        &path,
        &INFO,
        &mut moved,
        &mut [&mut shard.user, &mut shard.item],
    ));
    assert!(err.contains("dense.offset is 4, this shard's is 5"), "{err}");
    let mut sgd = DenseSlice::new(4, vec![0.0; 4], SGD);
    let err = message(load_shard(
        &path,
        &INFO,
        &mut sgd,
        &mut [&mut shard.user, &mut shard.item],
    ));
    assert!(err.contains("dense.optimizer is adam, this shard's is sgd"), "{err}");
    Ok(())
}

#[test]
fn other_files_are_not_taken_for_shards() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let garbage = dir.path().join("garbage.safetensors");
    fs::write(&garbage, b"not a tensor file at all")?;
    let mut shard = Shard::fresh();
    let err = message(shard.load(&garbage, &INFO));
    assert!(
        err.contains("garbage.safetensors") && err.contains("not a flotilla PS shard file"),
        "{err}"
    );

    let model = dir.path().join("model.safetensors");
    let weight = [0u8; 8];
    let view = TensorView::new(Dtype::F32, vec![2], &weight)?;
    safetensors::serialize_to_file([("weight", view)], None, &model)?;
    let err = message(shard.load(&model, &INFO));
    assert!(
        err.contains("model.safetensors") && err.contains("not a flotilla PS shard file"),
        "{err}"
    );
    assert!(message(shard.load(&dir.path().join("absent"), &INFO)).contains("absent"));
    Ok(())
}
