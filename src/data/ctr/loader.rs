//! Each trainer's part of every global batch of CTR records.
//!
//! The data is read in order, one pass per epoch, cut into global batches of
//! `global_batch` records (an incomplete tail is dropped in training), and
//! rank `r` of `world` takes records `[r·B/world, (r+1)·B/world)` of each.
//! So the ranks' batches at each step concatenate to exactly the batch one
//! process would read — the same contract as [`crate::data::ShardedLoader`].

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, ensure, Result};

use super::tsv::count_records;
use super::{CriteoSynth, CtrBatch, Split, TsvReader};

/// Where CTR records come from.
#[derive(Debug, Clone)]
pub enum CtrSource {
    /// Generated on the fly: record `i` of an epoch is `synth.record(split, i)`.
    Synthetic {
        /// The generator, shared by the loaders of one process.
        synth: Arc<CriteoSynth>,
        /// Which split to read.
        split: Split,
        /// Records per epoch.
        samples: u64,
    },
    /// Criteo TSV files, read in this order.
    Files(Vec<PathBuf>),
}

impl CtrSource {
    /// Records in one pass over the source; for files, a byte scan of every
    /// file (no parsing), so it costs one quick read of the data.
    pub fn records_per_epoch(&self) -> Result<u64> {
        match self {
            CtrSource::Synthetic { samples, .. } => Ok(*samples),
            CtrSource::Files(files) => {
                ensure!(!files.is_empty(), "no CTR data files were given");
                files.iter().map(|path| count_records(path)).sum()
            }
        }
    }
}

/// How records are reached: by index, or by reading on.
#[derive(Debug)]
enum Cursor {
    Synthetic { synth: Arc<CriteoSynth>, split: Split },
    Files(TsvReader),
}

/// One rank's reader of global CTR batches, for training (wrapping epochs)
/// or evaluation (one pass). Training and evaluation share the position in
/// the data, so use one loader for each.
#[derive(Debug)]
pub struct CtrLoader {
    cursor: Cursor,
    /// Records in one pass over the data.
    records: u64,
    global_batch: usize,
    rank: usize,
    world: usize,
    /// Records of the current pass already consumed, by all ranks together.
    position: u64,
    epoch: usize,
}

impl CtrLoader {
    /// The loader of `rank` among `world` trainers reading global batches of
    /// `global_batch` records, which must divide evenly among them. For
    /// files, every file is scanned once now to count its records.
    pub fn new(source: CtrSource, global_batch: usize, rank: usize, world: usize) -> Result<Self> {
        crate::data::check_rank_batch(global_batch, rank, world)?;
        let records = source.records_per_epoch()?;
        let cursor = match source {
            CtrSource::Synthetic { synth, split, .. } => Cursor::Synthetic { synth, split },
            CtrSource::Files(files) => Cursor::Files(TsvReader::open(files)?),
        };
        Ok(Self {
            cursor,
            records,
            global_batch,
            rank,
            world,
            position: 0,
            epoch: 0,
        })
    }

    /// This rank's slice of the next global training batch. After the last
    /// full global batch of a pass it starts the next epoch from the first
    /// record; the incomplete tail of a pass is never read.
    pub fn next_batch(&mut self) -> Result<CtrBatch> {
        let global = self.global_batch as u64;
        ensure!(
            self.records >= global,
            "the data holds {} records, fewer than one global batch of {global}",
            self.records
        );
        if self.position + global > self.records {
            self.restart()?;
            self.epoch += 1;
        }
        self.read_global(global)
    }

    /// Moves on to where `batches` calls of [`next_batch`](Self::next_batch) from the start
    /// would leave it (a resumed run): by arithmetic for generated data, by reading on for files.
    pub fn skip_batches(&mut self, batches: usize) -> Result<()> {
        let global = self.global_batch as u64;
        match self.cursor {
            Cursor::Synthetic { .. } if batches > 0 => {
                let per_epoch = (self.records / global).max(1) as usize;
                self.epoch = (batches - 1) / per_epoch;
                self.position = ((batches - 1) % per_epoch + 1) as u64 * global;
            }
            Cursor::Synthetic { .. } => {}
            Cursor::Files(_) => {
                for _ in 0..batches {
                    self.next_batch()?;
                }
            }
        }
        Ok(())
    }

    /// The epoch (0-based) of the last batch [`next_batch`](Self::next_batch)
    /// returned, for logging and learning-rate schedules.
    pub fn epoch(&self) -> usize {
        self.epoch
    }

    /// This rank's slice of the next global evaluation batch, the final
    /// partial one included (whose slice may be short or empty on high
    /// ranks); `None` once the pass is over, after which the next call starts
    /// a new pass from the first record.
    pub fn next_eval_batch(&mut self) -> Result<Option<CtrBatch>> {
        if self.position >= self.records {
            self.restart()?;
            return Ok(None);
        }
        let count = (self.global_batch as u64).min(self.records - self.position);
        self.read_global(count).map(Some)
    }

    /// Back to the first record of the data.
    fn restart(&mut self) -> Result<()> {
        self.position = 0;
        match &mut self.cursor {
            Cursor::Synthetic { .. } => Ok(()),
            Cursor::Files(reader) => reader.rewind(),
        }
    }

    /// Consumes a global batch of `count` records, keeping this rank's slice.
    fn read_global(&mut self, count: u64) -> Result<CtrBatch> {
        let local = (self.global_batch / self.world) as u64;
        let lo = (self.rank as u64 * local).min(count);
        let hi = (lo + local).min(count);
        let mut batch = CtrBatch::with_capacity((hi - lo) as usize);
        match &mut self.cursor {
            Cursor::Synthetic { synth, split } => {
                for i in lo..hi {
                    batch.push(&synth.record(*split, self.position + i));
                }
            }
            Cursor::Files(reader) => {
                let ended = |at: u64| {
                    anyhow::anyhow!(
                        "the CTR files ended at record {at} of {}: did they change while read?",
                        self.records
                    )
                };
                for i in 0..count {
                    if !(lo..hi).contains(&i) {
                        if !reader.skip_record()? {
                            bail!(ended(self.position + i));
                        }
                        continue;
                    }
                    match reader.next_record()? {
                        Some(record) => batch.push(&record),
                        None => bail!(ended(self.position + i)),
                    }
                }
            }
        }
        self.position += count;
        Ok(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::ctr::write_synthetic;

    /// The synthetic source and a file holding the same records.
    fn sources(samples: u64, dir: &std::path::Path) -> Result<[CtrSource; 2]> {
        let synth = Arc::new(CriteoSynth::new(9, 2000));
        let path = dir.join("part.tsv");
        write_synthetic(&path, &synth, Split::Train, samples)?;
        Ok([
            CtrSource::Synthetic {
                synth,
                split: Split::Train,
                samples,
            },
            CtrSource::Files(vec![path]),
        ])
    }

    fn concat(parts: impl IntoIterator<Item = CtrBatch>) -> CtrBatch {
        let mut all = CtrBatch::default();
        for p in parts {
            all.len += p.len;
            all.dense.extend(p.dense);
            all.ids.extend(p.ids);
            all.labels.extend(p.labels);
        }
        all
    }

    #[test]
    fn rank_slices_concatenate_to_the_single_process_batch() -> Result<()> {
        let dir = tempfile::tempdir()?;
        // 50 records, batches of 12: 4 per epoch, the tail of 2 dropped.
        for source in sources(50, dir.path())? {
            let mut whole = CtrLoader::new(source.clone(), 12, 0, 1)?;
            let mut ranks: Vec<CtrLoader> = (0..3)
                .map(|r| CtrLoader::new(source.clone(), 12, r, 3))
                .collect::<Result<_>>()?;
            let mut first = None;
            for step in 0..10 {
                let expected = whole.next_batch()?;
                assert_eq!(expected.len, 12);
                let joined = concat(ranks.iter_mut().map(|l| l.next_batch()).collect::<Result<Vec<_>>>()?);
                assert_eq!(joined, expected, "step {step}");
                assert_eq!(whole.epoch(), step / 4);
                assert!(ranks.iter().all(|l| l.epoch() == step / 4));
                if step == 0 {
                    first = Some(expected);
                } else if step % 4 == 0 {
                    assert_eq!(Some(&expected), first.as_ref(), "epoch starts over at step {step}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn a_loader_that_skips_batches_reads_on_as_one_that_read_them() -> Result<()> {
        let dir = tempfile::tempdir()?;
        for source in sources(50, dir.path())? {
            for skipped in [0, 3, 4, 5, 9] {
                let mut read = CtrLoader::new(source.clone(), 12, 1, 2)?;
                for _ in 0..skipped {
                    read.next_batch()?;
                }
                let mut skipping = CtrLoader::new(source.clone(), 12, 1, 2)?;
                skipping.skip_batches(skipped)?;
                for _ in 0..6 {
                    assert_eq!(skipping.next_batch()?, read.next_batch()?, "after {skipped} skipped");
                    assert_eq!(skipping.epoch(), read.epoch());
                }
            }
        }
        Ok(())
    }

    #[test]
    fn eval_pass_reads_every_record_once_including_the_tail() -> Result<()> {
        let dir = tempfile::tempdir()?;
        for source in sources(50, dir.path())? {
            let mut whole = CtrLoader::new(source.clone(), 12, 0, 1)?;
            let mut everything = Vec::new();
            while let Some(b) = whole.next_eval_batch()? {
                everything.push(b);
            }
            let sizes: Vec<usize> = everything.iter().map(|b| b.len).collect();
            assert_eq!(sizes, vec![12, 12, 12, 12, 2]);
            let all = concat(everything);
            let mut one_by_one = CtrLoader::new(source.clone(), 1, 0, 1)?;
            let singles = concat((0..50).map(|_| one_by_one.next_batch()).collect::<Result<Vec<_>>>()?);
            assert_eq!(all, singles);
            // Ranks split the partial batch as one process would, and the next
            // pass starts over.
            let mut ranks: Vec<CtrLoader> = (0..3)
                .map(|r| CtrLoader::new(source.clone(), 12, r, 3))
                .collect::<Result<_>>()?;
            for pass in 0..2 {
                let mut parts = Vec::new();
                loop {
                    let slices: Vec<Option<CtrBatch>> =
                        ranks.iter_mut().map(|l| l.next_eval_batch()).collect::<Result<_>>()?;
                    if slices.iter().all(Option::is_none) {
                        break;
                    }
                    parts.extend(slices.into_iter().flatten());
                }
                assert_eq!(concat(parts), all, "pass {pass}");
            }
        }
        Ok(())
    }

    #[test]
    fn bad_shapes_and_empty_data_are_errors() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let [synthetic, _] = sources(5, dir.path())?;
        assert!(CtrLoader::new(synthetic.clone(), 7, 0, 2).is_err());
        assert!(CtrLoader::new(synthetic.clone(), 6, 2, 2).is_err());
        assert!(CtrLoader::new(synthetic.clone(), 0, 0, 1).is_err());
        assert!(CtrLoader::new(CtrSource::Files(Vec::new()), 4, 0, 1).is_err());
        assert!(CtrLoader::new(synthetic, 6, 0, 1)?.next_batch().is_err());
        let empty = dir.path().join("empty.tsv");
        std::fs::write(&empty, "\n\n")?;
        let mut loader = CtrLoader::new(CtrSource::Files(vec![empty]), 4, 0, 1)?;
        assert!(loader.next_batch().is_err());
        assert_eq!(loader.next_eval_batch()?, None);
        Ok(())
    }
}
