//! Data read in parts: each rank's slice of every global batch, from the parts it opens.
//!
//! The data is cut into `parts` parts — index ranges of generated data; runs of files, or
//! ranges of fewer files (see `cut`) — and every global batch of `B` records is the
//! concatenation of the next `B / parts` records of each part, in part order. Rank `r` of
//! `world` keeps records `[r·B/W, (r+1)·B/W)` of it and opens only the parts they lie in — its
//! own parts, read by no other rank, when the ranks divide the parts. The ranks' batches at a
//! step concatenate to exactly the batch one process reading every part takes, whatever the
//! number of ranks — the ground truth of sync training, and what lets a run resume on another
//! number of ranks. Only the records of a shuffle window are held at a time, so the files may
//! be far larger than memory.
//!
//! A part is read pass after pass (epochs): at the end of a pass the records short of a whole
//! `B / parts` are dropped and the part starts over. With a shuffle buffer of `K` records, a
//! part's records are taken in windows of `K`, each permuted by a generator seeded with the
//! seed, the part, the pass and the window — the same order on any layout and after a resume.
//!
//! [`PartLoader`] does this over any [`PartStream`]: click logs (`ctr`) and tables (`table`)
//! each give the stream of one part of their records.

pub(crate) mod cut;
pub(crate) mod text;

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

use anyhow::{anyhow, ensure, Context, Result};
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::rng::SplitMix64;

/// One part's records in order, pass after pass.
pub(crate) trait PartStream: std::fmt::Debug + Send {
    /// What one record is read as.
    type Record: std::fmt::Debug + Send;

    /// The next record of the pass; `None` at its end.
    fn next(&mut self) -> Result<Option<Self::Record>>;

    /// Passes over the next record of the pass without building it; false at its end.
    fn skip(&mut self) -> Result<bool>;

    /// Where the stream is.
    fn position(&self) -> StreamPosition;

    /// Goes to `at`, a [`position`](Self::position) of a stream of the same part.
    fn seek(&mut self, at: StreamPosition) -> Result<()>;

    /// Back to the part's first record.
    fn rewind(&mut self) -> Result<()>;
}

/// Where a stream of files is: the next byte (text) or row (Parquet) it reads. Saved in
/// checkpoints, so a resumed run seeks there instead of reading its way back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadPosition {
    /// Index of the segment being read.
    pub segment: usize,
    /// Offset in the segment's (uncompressed) file of the next byte, or the next row, to read.
    pub offset: u64,
    /// Lines (or rows) of the segment read so far, for the place errors name.
    pub lines: u64,
}

/// Where a part's stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum StreamPosition {
    /// The index of the next generated record.
    Synthetic(u64),
    /// The next byte, or row, of the files.
    Files(ReadPosition),
}

/// How the data is cut and ordered: the same for every rank of a job, and kept by a resumed run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataLayout {
    /// Parts the data is cut into (`train.data_parts`).
    pub parts: usize,
    /// Records per shuffled window of a part; 0 reads in file order (`train.shuffle_buffer`).
    pub shuffle_buffer: usize,
    /// Seed of the shuffle (`train.seed`).
    pub seed: u64,
}

impl DataLayout {
    /// The training data's layout in a job of `trainers` trainers configured by `train`.
    pub fn of(train: &TrainConfig, trainers: usize) -> Self {
        Self {
            parts: train.data_parts(trainers),
            shuffle_buffer: train.shuffle_buffer,
            seed: train.seed,
        }
    }

    /// The data as one part in file order: what an evaluation or a scoring pass reads.
    pub const WHOLE: DataLayout = DataLayout {
        parts: 1,
        shuffle_buffer: 0,
        seed: 0,
    };
}

/// Where a part's reading is: its stream at the start of the current shuffle window (or at the
/// next record, unshuffled) and how many of the window's records were given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct PartPosition {
    pass: u64,
    windows: u64,
    stream: StreamPosition,
    /// Records of the current window already given; 0 when no window is under way.
    given: usize,
    taken: u64,
}

/// Where a loader is in each of its parts, by part number: what a checkpoint saves so a
/// resumed run starts there without reading the records before. Any rank reading a part
/// reads all of it, so a position of a part is the same whichever rank took it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DataPosition {
    parts: BTreeMap<usize, PartPosition>,
    /// How the data the positions are in is cut and ordered (absent in positions saved before
    /// it was recorded): positions of another cut point elsewhere.
    #[serde(default)]
    layout: Option<DataLayout>,
}

impl DataPosition {
    /// Joins the positions of other ranks' parts into these.
    pub fn merge(&mut self, other: DataPosition) {
        self.parts.extend(other.parts);
        self.layout = self.layout.or(other.layout);
    }
}

/// One part as a rank reads it: its stream, shuffled in windows, pass after pass.
#[derive(Debug)]
struct Part<S: PartStream> {
    index: usize,
    /// The records of each of the part's shares of a global batch that this rank keeps.
    keep: Range<usize>,
    stream: S,
    /// Passes started before the current one.
    pass: u64,
    layout: DataLayout,
    /// Windows of the current pass taken so far.
    windows: u64,
    window: VecDeque<S::Record>,
    /// The stream's position where the current window starts, and the window's size when full.
    window_start: Option<(StreamPosition, usize)>,
    /// Records taken from the stream, over every pass.
    taken: u64,
}

impl<S: PartStream> Part<S> {
    /// The next record of the pass, shuffled; `None` at its end.
    fn next(&mut self) -> Result<Option<S::Record>> {
        let size = self.layout.shuffle_buffer;
        if size == 0 {
            return self.take_from_stream();
        }
        if self.window.is_empty() {
            let start = self.stream.position();
            while self.window.len() < size {
                match self.take_from_stream()? {
                    Some(record) => self.window.push_back(record),
                    None => break,
                }
            }
            // Named as when only click logs were read in parts, so their order stays.
            let stream = format!("ctr part {} pass {}", self.index, self.pass);
            SplitMix64::for_stream(self.layout.seed, &stream, self.windows).shuffle(self.window.make_contiguous());
            self.windows += 1;
            self.window_start = Some((start, self.window.len()));
        }
        Ok(self.window.pop_front())
    }

    /// Where the part's reading is.
    fn position(&self) -> PartPosition {
        let (stream, given, windows) = match self.window_start {
            Some((start, full)) if !self.window.is_empty() => (start, full - self.window.len(), self.windows - 1),
            _ => (self.stream.position(), 0, self.windows),
        };
        PartPosition {
            pass: self.pass,
            windows,
            stream,
            given,
            taken: self.taken,
        }
    }

    /// Goes to `at`, a [`position`](Self::position) of the same part: the stream seeks there
    /// and a window under way is read again (at most a shuffle buffer) and given on from where
    /// it was.
    fn seek(&mut self, at: PartPosition) -> Result<()> {
        self.stream.seek(at.stream)?;
        self.pass = at.pass;
        self.windows = at.windows;
        self.window.clear();
        self.window_start = None;
        for _ in 0..at.given {
            self.next()?
                .with_context(|| format!("data part {}: its saved window ends early", self.index))?;
        }
        self.taken = at.taken;
        Ok(())
    }

    fn take_from_stream(&mut self) -> Result<Option<S::Record>> {
        let record = self.stream.next()?;
        self.taken += u64::from(record.is_some());
        Ok(record)
    }

    /// The next `count` records, starting the next pass when this one has fewer left.
    fn next_whole_run(&mut self, count: usize) -> Result<Vec<S::Record>> {
        self.whole_run(count, Part::next)
    }

    /// Passes over the records [`Part::next_whole_run`] would give; unshuffled, without
    /// building them.
    fn skip_whole_run(&mut self, count: usize) -> Result<()> {
        let skip_one = |part: &mut Part<S>| match part.layout.shuffle_buffer {
            0 => {
                let skipped = part.stream.skip()?;
                part.taken += u64::from(skipped);
                Ok(skipped.then_some(()))
            }
            _ => part.next().map(|record| record.map(drop)),
        };
        self.whole_run(count, skip_one).map(drop)
    }

    /// `count` results of `take` (`None` at the end of a pass), from the next pass when this
    /// one has fewer left: what it took of this one is dropped.
    fn whole_run<T>(&mut self, count: usize, mut take: impl FnMut(&mut Self) -> Result<Option<T>>) -> Result<Vec<T>> {
        for fresh_pass in [false, true] {
            let mut run = Vec::with_capacity(count);
            while run.len() < count {
                match take(self)? {
                    Some(taken) => run.push(taken),
                    None => break,
                }
            }
            if run.len() == count {
                return Ok(run);
            }
            if !fresh_pass {
                self.restart()?;
            }
        }
        Err(anyhow!(
            "data part {} holds fewer than {count} records, its share of a global batch: use fewer \
             train.data_parts, a smaller train.batch_size or more data",
            self.index
        ))
    }

    /// The first record of the next pass comes next.
    fn restart(&mut self) -> Result<()> {
        self.stream.rewind()?;
        self.window.clear();
        self.window_start = None;
        self.windows = 0;
        self.pass += 1;
        Ok(())
    }
}

/// Which parts a rank opens, and what it keeps of each part's share of a global batch.
#[derive(Debug, Clone)]
pub(crate) struct Placement {
    /// The parts the rank's records lie in.
    pub(crate) parts: Range<usize>,
    /// Records each part gives to a global batch.
    share: usize,
    /// Records of the rank's slice of a global batch.
    slice: usize,
    /// The first record of the rank's slice of a global batch.
    first: usize,
}

impl Placement {
    /// Where `rank` of `world` reads global batches of `global_batch` records cut into
    /// `parts`: the batch must divide among the ranks and among the parts.
    pub(crate) fn training(parts: usize, global_batch: usize, rank: usize, world: usize) -> Result<Self> {
        crate::data::check_rank_batch(global_batch, rank, world)?;
        ensure!(
            parts > 0 && global_batch.is_multiple_of(parts),
            "train.batch_size = {global_batch} does not divide into train.data_parts = {parts} equal shares"
        );
        let (share, slice) = (global_batch / parts, global_batch / world);
        let first = rank * slice;
        Ok(Self {
            parts: first / share..(first + slice).div_ceil(share),
            share,
            slice,
            first,
        })
    }

    /// `rank`'s share of an evaluation pass: part `rank` (of as many as the ranks; none past
    /// `parts`), in batches of a rank's slice of a global batch.
    pub(crate) fn evaluation(global_batch: usize, rank: usize, world: usize, parts: usize) -> Result<Self> {
        crate::data::check_rank_batch(global_batch, rank, world)?;
        let slice = global_batch / world;
        // Its part's share is its slice, kept whole.
        Ok(Self {
            parts: rank.min(parts)..(rank + 1).min(parts),
            share: slice,
            slice,
            first: rank * slice,
        })
    }

    /// The records of part `part`'s share that the rank keeps.
    fn keep(&self, part: usize) -> Range<usize> {
        let (start, last) = (
            self.first.max(part * self.share),
            (self.first + self.slice).min((part + 1) * self.share),
        );
        start.saturating_sub(part * self.share)..last.saturating_sub(part * self.share)
    }
}

/// One rank's reader of global batches from the parts it opens, for training (wrapping
/// epochs) or evaluation (one pass). Training and evaluation share the position in the data,
/// so use one loader for each.
#[derive(Debug)]
pub(crate) struct PartLoader<S: PartStream> {
    /// The parts this rank reads, in part order.
    parts: Vec<Part<S>>,
    /// Records each part gives to a global batch.
    part_batch: usize,
    /// Records of this rank's slice of a global batch.
    local_batch: usize,
    /// The part an evaluation pass is reading, as an index into `parts`.
    evaluating: usize,
}

impl<S: PartStream> PartLoader<S> {
    /// A loader placed by `placement` reading `streams`, each the stream of the part numbered
    /// alongside, cut and shuffled as `layout` says.
    pub(crate) fn new(streams: Vec<(usize, S)>, layout: DataLayout, placement: &Placement) -> Self {
        Self {
            parts: streams
                .into_iter()
                .map(|(index, stream)| Part {
                    index,
                    keep: placement.keep(index),
                    stream,
                    pass: 0,
                    layout,
                    windows: 0,
                    window: VecDeque::new(),
                    window_start: None,
                    taken: 0,
                })
                .collect(),
            part_batch: placement.share,
            local_batch: placement.slice,
            evaluating: 0,
        }
    }

    /// Records of this rank's slice of a global batch.
    pub(crate) fn local_batch(&self) -> usize {
        self.local_batch
    }

    /// This rank's slice of the next global training batch: the next share of each of its
    /// parts. A part whose pass has less than a share left starts its next pass.
    pub(crate) fn next_batch(&mut self) -> Result<Vec<S::Record>> {
        let mut batch = Vec::with_capacity(self.local_batch);
        for part in &mut self.parts {
            let mut share = part.next_whole_run(self.part_batch)?;
            batch.extend(share.drain(part.keep.clone()));
        }
        Ok(batch)
    }

    /// Moves on to where `batches` calls of [`next_batch`](Self::next_batch) from the start
    /// would leave it (a resumed run), reading only this rank's parts and building no batch:
    /// unshuffled parts pass over records without parsing them.
    pub(crate) fn skip_batches(&mut self, batches: usize) -> Result<()> {
        for _ in 0..batches {
            for part in &mut self.parts {
                part.skip_whole_run(self.part_batch)?;
            }
        }
        Ok(())
    }

    /// Back to the start of every part, as the loader was opened.
    pub(crate) fn rewind(&mut self) -> Result<()> {
        for part in &mut self.parts {
            part.restart()?;
            part.pass = 0;
            part.taken = 0;
        }
        self.evaluating = 0;
        Ok(())
    }

    /// Where this loader is in each of its parts.
    pub(crate) fn position(&self) -> DataPosition {
        DataPosition {
            parts: self.parts.iter().map(|part| (part.index, part.position())).collect(),
            layout: self.parts.first().map(|part| part.layout),
        }
    }

    /// Goes to `at` — positions of at least this loader's parts, of a loader of the same data
    /// cut into the same parts — as if it had read every batch up to there.
    pub(crate) fn resume_at(&mut self, at: &DataPosition) -> Result<()> {
        if let (Some(saved), Some(part)) = (at.layout, self.parts.first()) {
            ensure!(
                saved == part.layout,
                "the saved data position is of the data cut and shuffled as {saved:?}, this run reads it as {:?}",
                part.layout
            );
        }
        for part in &mut self.parts {
            let position = at
                .parts
                .get(&part.index)
                .with_context(|| format!("the saved data position holds no position of data part {}", part.index))?;
            part.seek(*position)
                .with_context(|| format!("data part {}: resuming at its saved position", part.index))?;
        }
        Ok(())
    }

    /// The epoch (0-based) of the last batch [`next_batch`](Self::next_batch) returned: the
    /// pass of this rank's first part, for logging.
    pub(crate) fn epoch(&self) -> usize {
        self.parts.first().map_or(0, |part| part.pass as usize)
    }

    /// Records this loader took from its parts, over every pass: the share of the data it read.
    pub(crate) fn records_read(&self) -> u64 {
        self.parts.iter().map(|part| part.taken).sum()
    }

    /// The next batch of an evaluation pass over this rank's parts, one after the other, up to
    /// a rank's slice of a global batch, the last one short; `None` once every record was
    /// given, after which the next call starts a new pass.
    pub(crate) fn next_eval_batch(&mut self) -> Result<Option<Vec<S::Record>>> {
        let mut batch = Vec::with_capacity(self.local_batch);
        while batch.len() < self.local_batch {
            let Some(part) = self.parts.get_mut(self.evaluating) else {
                break;
            };
            match part.next()? {
                Some(record) => batch.push(record),
                None => self.evaluating += 1,
            }
        }
        if !batch.is_empty() {
            return Ok(Some(batch));
        }
        for part in &mut self.parts {
            part.restart()?;
        }
        self.evaluating = 0;
        Ok(None)
    }
}
