//! Each trainer's part of every global batch of CTR records: the records of generated data or
//! of click-log files (text or Parquet, in a schema's columns), read in parts (see
//! `data::parts`).

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{anyhow, ensure, Result};

use super::parquet::{parquet_rows, ParquetClickLogReader};
use super::{ClickLogParser, ClickLogReader, CriteoSynth, CtrBatch, CtrExample, CtrShape, Split};
use crate::config::{ClickLogFormat, ClickLogSchema};
use crate::data::parts::cut::{cut_by_measure, cut_into_parts, Segment};
use crate::data::parts::text::{count_records, is_gzip};
use crate::data::parts::{DataLayout, DataPosition, PartLoader, PartStream, Placement, StreamPosition};

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
    /// Click-log files in the parser's columns, read in this order.
    Files {
        /// The files.
        files: Vec<PathBuf>,
        /// Their columns.
        parser: Arc<ClickLogParser>,
    },
}

impl CtrSource {
    /// Records in one pass over the source; for files, a byte scan of every
    /// file (no parsing), so it costs one quick read of the data.
    pub fn records_per_epoch(&self) -> Result<u64> {
        match self {
            CtrSource::Synthetic { samples, .. } => Ok(*samples),
            CtrSource::Files { files, parser } => {
                ensure!(!files.is_empty(), "no click-log files were given");
                if is_parquet(files, parser)? {
                    return files.iter().map(|path| parquet_rows(path)).sum();
                }
                let header = u64::from(parser.schema().header);
                files
                    .iter()
                    .map(|path| Ok(count_records(path)?.saturating_sub(header)))
                    .sum()
            }
        }
    }

    /// Opens every file and finds its columns (a header read, a Parquet schema), reading no
    /// record: what a missing column or file would stop a run with, found before it starts.
    pub fn check_columns(&self) -> Result<()> {
        if let CtrSource::Files { files, parser } = self {
            let whole: Vec<Segment> = files.iter().map(|path| Segment::whole(path)).collect();
            file_parts(vec![whole], files, parser, 0..1)?;
        }
        Ok(())
    }

    /// Criteo TSV files (plain or gzip), read in this order.
    pub fn criteo_files(files: Vec<PathBuf>) -> Self {
        CtrSource::Files {
            files,
            parser: Arc::new(ClickLogParser::new(ClickLogSchema::criteo())),
        }
    }

    /// What a model reads of each record.
    pub fn shape(&self) -> CtrShape {
        match self {
            CtrSource::Synthetic { .. } => CtrShape::CRITEO,
            CtrSource::Files { parser, .. } => parser.shape(),
        }
    }
}

/// Whether `files` are Parquet (by the schema's format, else by their names); a mix of Parquet
/// and text is refused.
fn is_parquet(files: &[PathBuf], parser: &ClickLogParser) -> Result<bool> {
    if let Some(format) = parser.schema().format {
        return Ok(format == ClickLogFormat::Parquet);
    }
    let parquet = |path: &PathBuf| ClickLogFormat::of_path(path) == ClickLogFormat::Parquet;
    match (files.iter().all(parquet), files.iter().any(parquet)) {
        (all, any) if all == any => Ok(all),
        _ => anyhow::bail!(
            "the click logs mix Parquet and text files ({}): give one format, or train.click_log.format",
            files
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// `files` cut into `parts`: text by byte ranges (or runs of files), Parquet by row ranges.
fn cut_files(files: &[PathBuf], parser: &ClickLogParser, parts: usize) -> Result<Vec<Vec<Segment>>> {
    match is_parquet(files, parser)? {
        true => cut_by_measure(files, parts, parquet_rows),
        false => cut_into_parts(files, parts),
    }
}

/// One part's CTR records in order.
#[derive(Debug)]
pub(crate) enum CtrStream {
    Synthetic {
        synth: Arc<CriteoSynth>,
        split: Split,
        records: Range<u64>,
        next: u64,
    },
    Text(ClickLogReader),
    Parquet(ParquetClickLogReader),
}

impl PartStream for CtrStream {
    type Record = CtrExample;

    fn next(&mut self) -> Result<Option<CtrExample>> {
        match self {
            CtrStream::Synthetic {
                synth,
                split,
                records,
                next,
            } => Ok((*next < records.end).then(|| {
                *next += 1;
                synth.record(*split, *next - 1).example()
            })),
            CtrStream::Text(reader) => reader.next_record(),
            CtrStream::Parquet(reader) => reader.next_record(),
        }
    }

    fn skip(&mut self) -> Result<bool> {
        match self {
            CtrStream::Synthetic { records, next, .. } => {
                let more = *next < records.end;
                *next += u64::from(more);
                Ok(more)
            }
            CtrStream::Text(reader) => reader.skip_record(),
            CtrStream::Parquet(reader) => reader.skip_record(),
        }
    }

    fn position(&self) -> StreamPosition {
        match self {
            CtrStream::Synthetic { next, .. } => StreamPosition::Synthetic(*next),
            CtrStream::Text(reader) => StreamPosition::Files(reader.position()),
            CtrStream::Parquet(reader) => StreamPosition::Files(reader.position()),
        }
    }

    fn seek(&mut self, at: StreamPosition) -> Result<()> {
        match (self, at) {
            (CtrStream::Synthetic { records, next, .. }, StreamPosition::Synthetic(at)) => {
                ensure!(
                    records.start <= at && at <= records.end,
                    "a data position at generated record {at}, outside the part's {records:?}"
                );
                *next = at;
                Ok(())
            }
            (CtrStream::Text(reader), StreamPosition::Files(at)) => reader.seek(at),
            (CtrStream::Parquet(reader), StreamPosition::Files(at)) => reader.seek(at),
            (_, at) => Err(anyhow!("a data position {at:?} of another kind of data")),
        }
    }

    fn rewind(&mut self) -> Result<()> {
        match self {
            CtrStream::Synthetic { records, next, .. } => {
                *next = records.start;
                Ok(())
            }
            CtrStream::Text(reader) => reader.rewind(),
            CtrStream::Parquet(reader) => reader.rewind(),
        }
    }
}

/// One rank's reader of global CTR batches, for training (wrapping epochs) or evaluation (one
/// pass). Training and evaluation share the position in the data, so use one loader for each.
#[derive(Debug)]
pub struct CtrLoader {
    parts: PartLoader<CtrStream>,
    shape: CtrShape,
}

impl CtrLoader {
    /// The loader of `rank` among `world` ranks reading global batches of `global_batch`
    /// records from `source` cut as `layout` says: the batch must divide among the ranks and
    /// among the parts. Rank `r` keeps records `[r·B/W, (r+1)·B/W)` of each global batch and
    /// opens only the parts those lie in: its own parts when the ranks divide the parts; with
    /// more ranks than parts (a run resumed on more trainers), ranks share a part, each reading
    /// all of it and keeping its slice of every share.
    pub fn new(source: CtrSource, layout: DataLayout, global_batch: usize, rank: usize, world: usize) -> Result<Self> {
        let placement = Placement::training(layout.parts, global_batch, rank, world)?;
        let mine = placement.parts.clone();
        let shape = source.shape();
        let streams = match source {
            CtrSource::Synthetic { synth, split, samples } => {
                synthetic_parts(&synth, split, samples, layout.parts, mine)?
            }
            CtrSource::Files { files, parser } => {
                file_parts(cut_files(&files, &parser, layout.parts)?, &files, &parser, mine)?
            }
        };
        Ok(Self {
            parts: PartLoader::new(streams, layout, &placement),
            shape,
        })
    }

    /// The loader of `rank`'s share of an evaluation pass over `source` among `world` ranks,
    /// in batches of at most `global_batch / world`: the data cut into `world` parts, or, for
    /// gzip-compressed files fewer than the ranks, into its files, the ranks past the last
    /// file evaluating nothing. Every record is in exactly one rank's share.
    pub fn evaluation(source: CtrSource, global_batch: usize, rank: usize, world: usize) -> Result<Self> {
        let shape = source.shape();
        let (streams, placement) = match source {
            CtrSource::Synthetic { synth, split, samples } => {
                let placement = Placement::evaluation(global_batch, rank, world, world)?;
                (
                    synthetic_parts(&synth, split, samples, world, placement.parts.clone())?,
                    placement,
                )
            }
            // Gzip files cannot be cut by bytes.
            CtrSource::Files { files, parser } if files.len() < world && files.iter().any(|path| is_gzip(path)) => {
                let placement = Placement::evaluation(global_batch, rank, world, files.len())?;
                let whole: Vec<Vec<Segment>> = files.iter().map(|path| vec![Segment::whole(path)]).collect();
                (file_parts(whole, &files, &parser, placement.parts.clone())?, placement)
            }
            CtrSource::Files { files, parser } => {
                let placement = Placement::evaluation(global_batch, rank, world, world)?;
                let cut = cut_files(&files, &parser, world)?;
                (file_parts(cut, &files, &parser, placement.parts.clone())?, placement)
            }
        };
        Ok(Self {
            parts: PartLoader::new(streams, DataLayout::WHOLE, &placement),
            shape,
        })
    }

    /// This rank's slice of the next global training batch: the next share of each of its
    /// parts. A part whose pass has less than a share left starts its next pass.
    pub fn next_batch(&mut self) -> Result<CtrBatch> {
        let records = self.parts.next_batch()?;
        Ok(batch_of(self.shape, &records, self.parts.local_batch()))
    }

    /// Moves on to where `batches` calls of [`next_batch`](Self::next_batch) from the start
    /// would leave it (a resumed run), reading only this rank's parts and building no batch:
    /// unshuffled parts pass over lines without parsing them.
    pub fn skip_batches(&mut self, batches: usize) -> Result<()> {
        self.parts.skip_batches(batches)
    }

    /// Where this loader is in each of its parts.
    pub fn position(&self) -> DataPosition {
        self.parts.position()
    }

    /// Goes to `at` — positions of at least this loader's parts, of a loader of the same data
    /// cut into the same parts — as if it had read every batch up to there.
    pub fn resume_at(&mut self, at: &DataPosition) -> Result<()> {
        self.parts.resume_at(at)
    }

    /// The epoch (0-based) of the last batch [`next_batch`](Self::next_batch) returned: the
    /// pass of this rank's first part, for logging.
    pub fn epoch(&self) -> usize {
        self.parts.epoch()
    }

    /// Records this loader took from its parts, over every pass: the share of the data it read.
    pub fn records_read(&self) -> u64 {
        self.parts.records_read()
    }

    /// The next batch of an evaluation pass over this rank's parts, one after the other, up to
    /// a rank's slice of a global batch, the last one short; `None` once every record was
    /// given, after which the next call starts a new pass.
    pub fn next_eval_batch(&mut self) -> Result<Option<CtrBatch>> {
        let local_batch = self.parts.local_batch();
        let shape = self.shape;
        Ok(self
            .parts
            .next_eval_batch()?
            .map(|records| batch_of(shape, &records, local_batch)))
    }
}

/// The model inputs of `records`, room made for `capacity`.
fn batch_of(shape: CtrShape, records: &[CtrExample], capacity: usize) -> CtrBatch {
    let mut batch = CtrBatch::with_capacity(shape, capacity);
    for record in records {
        batch.push(record);
    }
    batch
}

/// Parts `mine` of `samples` generated records cut into `parts` index ranges.
fn synthetic_parts(
    synth: &Arc<CriteoSynth>,
    split: Split,
    samples: u64,
    parts: usize,
    mine: Range<usize>,
) -> Result<Vec<(usize, CtrStream)>> {
    ensure!(samples > 0, "the data holds no records");
    let bound = |part: usize| (u128::from(samples) * part as u128 / parts as u128) as u64;
    Ok(mine
        .map(|part| {
            let stream = CtrStream::Synthetic {
                synth: synth.clone(),
                split,
                records: bound(part)..bound(part + 1),
                next: bound(part),
            };
            (part, stream)
        })
        .collect())
}

/// Parts `mine` of `files` cut into `parts`, opened.
fn file_parts(
    parts: Vec<Vec<Segment>>,
    files: &[PathBuf],
    parser: &Arc<ClickLogParser>,
    mine: Range<usize>,
) -> Result<Vec<(usize, CtrStream)>> {
    let parquet = is_parquet(files, parser)?;
    parts
        .into_iter()
        .enumerate()
        .filter(|(part, _)| mine.contains(part))
        .map(|(part, segments)| {
            let stream = match parquet {
                true => CtrStream::Parquet(ParquetClickLogReader::open_segments(segments, parser.clone())?),
                false => CtrStream::Text(ClickLogReader::open_segments(segments, parser.clone())?),
            };
            Ok((part, stream))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::ctr::write_synthetic;

    const fn layout(parts: usize, shuffle_buffer: usize) -> DataLayout {
        DataLayout {
            parts,
            shuffle_buffer,
            seed: 5,
        }
    }

    /// The synthetic source of `samples` records and `parts` files holding the same records,
    /// each file one part of them.
    fn sources(samples: u64, parts: usize, dir: &std::path::Path) -> Result<[CtrSource; 2]> {
        let synth = Arc::new(CriteoSynth::new(9, 2000));
        let bound = |part: usize| samples * part as u64 / parts as u64;
        let mut files = Vec::new();
        for part in 0..parts {
            let path = dir.join(format!("part-{part}.tsv"));
            let mut out = std::io::BufWriter::new(std::fs::File::create(&path)?);
            for index in bound(part)..bound(part + 1) {
                crate::data::ctr::write_record(&mut out, &synth.record(Split::Train, index))?;
            }
            std::io::Write::flush(&mut out)?;
            files.push(path);
        }
        Ok([
            CtrSource::Synthetic {
                synth,
                split: Split::Train,
                samples,
            },
            CtrSource::criteo_files(files),
        ])
    }

    fn concat(parts: impl IntoIterator<Item = CtrBatch>) -> CtrBatch {
        let mut all = CtrBatch {
            slots: crate::data::ctr::SPARSE_SLOTS,
            ..CtrBatch::default()
        };
        for p in parts {
            all.len += p.len;
            all.dense.extend(p.dense);
            all.ids.extend(p.ids);
            all.labels.extend(p.labels);
        }
        all
    }

    fn batches(loader: &mut CtrLoader, count: usize) -> Result<Vec<CtrBatch>> {
        (0..count).map(|_| loader.next_batch()).collect()
    }

    #[test]
    fn ranks_read_their_parts_and_their_slices_concatenate_to_the_single_process_batch() -> Result<()> {
        let dir = tempfile::tempdir()?;
        // 50 records in 2 parts of 25, batches of 12 (6 per part): 4 per pass, 1 record dropped.
        let [synthetic, files] = sources(50, 2, dir.path())?;
        for shuffle in [0, 7] {
            let mut expected = None;
            for source in [&synthetic, &files] {
                let mut whole = CtrLoader::new(source.clone(), layout(2, shuffle), 12, 0, 1)?;
                let mut ranks: Vec<CtrLoader> = (0..2)
                    .map(|r| CtrLoader::new(source.clone(), layout(2, shuffle), 12, r, 2))
                    .collect::<Result<_>>()?;
                let mut seen = Vec::new();
                for step in 0..10 {
                    let batch = whole.next_batch()?;
                    assert_eq!(batch.len, 12);
                    let joined = concat(ranks.iter_mut().map(|l| l.next_batch()).collect::<Result<Vec<_>>>()?);
                    assert_eq!(joined, batch, "step {step}, shuffle {shuffle}");
                    assert!(ranks.iter().all(|l| l.epoch() == step / 4));
                    seen.push(batch);
                }
                // Each rank read its own part alone: 25 records a pass (24 of them used), two
                // passes and 12 records of the third.
                let read: Vec<u64> = ranks.iter().map(CtrLoader::records_read).collect();
                let third = if shuffle == 0 { 12 } else { 14 }; // whole windows of 7
                assert_eq!(read, vec![25 * 2 + third; 2], "shuffle {shuffle}");
                match &expected {
                    None => expected = Some(seen),
                    Some(expected) => assert_eq!(&seen, expected, "files read as the generator, shuffle {shuffle}"),
                }
            }
            let passes = expected.unwrap_or_default();
            let ids = |range: std::ops::Range<usize>| -> Vec<u64> {
                let mut ids: Vec<u64> = passes[range].iter().flat_map(|b| b.ids.clone()).collect();
                ids.sort_unstable();
                ids
            };
            match shuffle {
                0 => assert_eq!(passes[4], passes[0], "a pass starts over"),
                _ => {
                    assert_ne!(passes[4], passes[0], "each pass is shuffled anew");
                    // Windows of 7 records shuffle within the pass: the same records, minus
                    // the one each pass drops.
                    assert_ne!(ids(0..4), ids(4..8));
                }
            }
        }
        Ok(())
    }

    #[test]
    fn ranks_that_do_not_divide_the_parts_share_them_and_keep_the_same_batches() -> Result<()> {
        let dir = tempfile::tempdir()?;
        for source in sources(60, 2, dir.path())? {
            // 2 parts, batches of 12: one rank, then 3 (sharing part 1) and 4 (two per part).
            let mut whole = CtrLoader::new(source.clone(), layout(2, 4), 12, 0, 1)?;
            let expected = batches(&mut whole, 7)?;
            for world in [3, 4] {
                let mut ranks: Vec<CtrLoader> = (0..world)
                    .map(|r| CtrLoader::new(source.clone(), layout(2, 4), 12, r, world))
                    .collect::<Result<_>>()?;
                for (step, batch) in expected.iter().enumerate() {
                    let joined = concat(ranks.iter_mut().map(|l| l.next_batch()).collect::<Result<Vec<_>>>()?);
                    assert_eq!(&joined, batch, "{world} ranks, step {step}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn a_loader_that_skips_batches_reads_on_as_one_that_read_them() -> Result<()> {
        let dir = tempfile::tempdir()?;
        for source in sources(50, 2, dir.path())? {
            for (skipped, shuffle) in [0, 3, 4, 5, 9].into_iter().flat_map(|n| [(n, 0), (n, 5)]) {
                let mut read = CtrLoader::new(source.clone(), layout(2, shuffle), 12, 1, 2)?;
                batches(&mut read, skipped)?;
                let mut skipping = CtrLoader::new(source.clone(), layout(2, shuffle), 12, 1, 2)?;
                skipping.skip_batches(skipped)?;
                assert_eq!(skipping.records_read(), read.records_read());
                for _ in 0..6 {
                    let what = format!("after {skipped} skipped, shuffle {shuffle}");
                    assert_eq!(skipping.next_batch()?, read.next_batch()?, "{what}");
                    assert_eq!(skipping.epoch(), read.epoch(), "{what}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn a_loader_resumed_at_saved_positions_reads_on_as_if_it_had_read_on_any_layout() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let synth = CriteoSynth::new(9, 2000);
        let mut cases = sources(50, 2, dir.path())?.to_vec();
        let gzipped: Vec<PathBuf> = [0..25, 25..50]
            .into_iter()
            .enumerate()
            .map(|(i, records)| {
                let path = dir.path().join(format!("part-{i}.tsv.gz"));
                write_synthetic(&path, &synth, Split::Train, records).map(|()| path)
            })
            .collect::<Result<_>>()?;
        cases.push(CtrSource::criteo_files(gzipped));
        // One file, cut into byte ranges.
        let one = dir.path().join("one.tsv");
        write_synthetic(&one, &synth, Split::Train, 0..50)?;
        cases.push(CtrSource::criteo_files(vec![one]));
        for source in cases {
            for (read, shuffle) in [0, 3, 4, 5, 9].into_iter().flat_map(|n| [(n, 0), (n, 5)]) {
                // Two ranks read `read` batches; their checkpoint holds both positions.
                let mut saved = DataPosition::default();
                for rank in 0..2 {
                    let mut loader = CtrLoader::new(source.clone(), layout(2, shuffle), 12, rank, 2)?;
                    batches(&mut loader, read)?;
                    saved.merge(loader.position());
                }
                for world in [1, 2, 4] {
                    for rank in 0..world {
                        let what = format!("{source:?}: after {read}, shuffle {shuffle}, rank {rank} of {world}");
                        let mut resumed = CtrLoader::new(source.clone(), layout(2, shuffle), 12, rank, world)?;
                        resumed.resume_at(&saved)?;
                        let mut reading = CtrLoader::new(source.clone(), layout(2, shuffle), 12, rank, world)?;
                        batches(&mut reading, read)?;
                        assert_eq!(resumed.position(), reading.position(), "{what}");
                        for _ in 0..6 {
                            assert_eq!(resumed.next_batch()?, reading.next_batch()?, "{what}");
                        }
                    }
                }
            }
        }
        let mut other_layout = CtrLoader::new(sources(50, 2, dir.path())?[0].clone(), layout(2, 0), 12, 0, 1)?;
        let err = other_layout.resume_at(&DataPosition::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the saved data position holds no position of data part 0"
        );
        Ok(())
    }

    #[test]
    fn one_file_cut_into_byte_ranges_gives_every_line_to_exactly_one_part() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let synth = CriteoSynth::new(9, 2000);
        let path = dir.path().join("day.tsv");
        write_synthetic(&path, &synth, Split::Train, 0..101)?;
        let mut one = CtrLoader::new(CtrSource::criteo_files(vec![path.clone()]), DataLayout::WHOLE, 8, 0, 1)?;
        let mut all = Vec::new();
        while let Some(batch) = one.next_eval_batch()? {
            all.push(batch);
        }
        let all = concat(all);
        assert_eq!(all.len, 101);
        for parts in [2, 3, 4, 8] {
            let mut pieces = Vec::new();
            let mut read = 0;
            for rank in 0..parts {
                let mut loader = CtrLoader::new(
                    CtrSource::criteo_files(vec![path.clone()]),
                    layout(parts, 0),
                    24,
                    rank,
                    parts,
                )?;
                while let Some(batch) = loader.next_eval_batch()? {
                    pieces.push(batch);
                }
                assert!(
                    loader.records_read() < 101 * 2 / parts as u64,
                    "{parts} parts: rank {rank} read too much"
                );
                read += loader.records_read();
            }
            assert_eq!((concat(pieces), read), (all.clone(), 101), "{parts} parts");
        }
        Ok(())
    }

    #[test]
    fn the_ranks_evaluation_shares_hold_every_record_once() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let [synthetic, files] = sources(50, 2, dir.path())?;
        let packed: Vec<PathBuf> = (0..2)
            .map(|part| {
                let path = dir.path().join(format!("part-{part}.tsv.gz"));
                let synth = CriteoSynth::new(9, 2000);
                write_synthetic(&path, &synth, Split::Train, part * 25..(part + 1) * 25).map(|()| path)
            })
            .collect::<Result<_>>()?;
        for source in [synthetic, files, CtrSource::criteo_files(packed)] {
            let mut whole = CtrLoader::evaluation(source.clone(), 12, 0, 1)?;
            let mut everything = Vec::new();
            while let Some(b) = whole.next_eval_batch()? {
                everything.push(b);
            }
            let sizes: Vec<usize> = everything.iter().map(|b| b.len).collect();
            assert_eq!(sizes, vec![12, 12, 12, 12, 2]);
            let all = concat(everything);
            // Three ranks: two gzipped files go to the first two, whole.
            for world in [2, 3] {
                let mut ranks: Vec<CtrLoader> = (0..world)
                    .map(|r| CtrLoader::evaluation(source.clone(), 12, r, world))
                    .collect::<Result<_>>()?;
                for pass in 0..2 {
                    let mut shares = Vec::new();
                    for rank in &mut ranks {
                        while let Some(b) = rank.next_eval_batch()? {
                            assert!(b.len <= 12 / world);
                            shares.push(b);
                        }
                    }
                    assert_eq!(concat(shares), all, "{world} ranks, pass {pass}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn bad_shapes_and_empty_data_are_errors() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let [synthetic, _] = sources(5, 1, dir.path())?;
        assert!(CtrLoader::new(synthetic.clone(), DataLayout::WHOLE, 7, 0, 2).is_err());
        assert!(CtrLoader::new(synthetic.clone(), DataLayout::WHOLE, 6, 2, 2).is_err());
        assert!(CtrLoader::new(synthetic.clone(), DataLayout::WHOLE, 0, 0, 1).is_err());
        let uneven = CtrLoader::new(synthetic.clone(), layout(4, 0), 6, 0, 2)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            uneven.as_deref(),
            Some("train.batch_size = 6 does not divide into train.data_parts = 4 equal shares")
        );
        assert!(CtrLoader::new(CtrSource::criteo_files(Vec::new()), DataLayout::WHOLE, 4, 0, 1).is_err());
        let small = CtrLoader::new(synthetic, layout(2, 0), 6, 0, 1)?.next_batch().err();
        assert!(
            small.is_some_and(|e| e.to_string().starts_with("data part 0 holds fewer than 3 records")),
            "a part smaller than its share of a batch"
        );
        let empty = dir.path().join("empty.tsv");
        std::fs::write(&empty, "\n\n")?;
        let mut loader = CtrLoader::new(CtrSource::criteo_files(vec![empty]), DataLayout::WHOLE, 4, 0, 1)?;
        assert!(loader.next_batch().is_err());
        assert_eq!(loader.next_eval_batch()?, None);
        Ok(())
    }
}
