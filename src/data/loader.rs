//! Each rank's view of the training data.
//!
//! Rows held in memory ([`ShardedLoader`]): step `s` belongs to epoch `s / batches_per_epoch`; every epoch has its own
//! seeded permutation (the same on every rank), cut into global batches of
//! `global_batch` rows (the incomplete tail is dropped), and rank `r` reads
//! rows `r*local..(r+1)*local` of each global batch. So the union of all
//! ranks' batches at step `s` is exactly the batch a single process training
//! on the global batch would read — the ground truth tests compare against. Rows streamed from
//! files ([`StreamedTable`]) are read in parts (`data::parts`), which keeps the same promise.

use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};
use std::collections::VecDeque;
use std::sync::Arc;

use super::parts::{DataPosition, PartLoader};
use super::table::{StreamedTable, TableStream};
use super::{Dataset, Inputs, Targets};
use crate::rng::SplitMix64;

/// Where a run's rows come from: held in memory (training shuffles them whole every epoch), or
/// streamed from files in parts (`train.data_parts`).
#[derive(Debug, Clone)]
pub enum RowSource {
    /// Every row, in memory.
    InMemory(Arc<Dataset>),
    /// A table each rank streams its parts of.
    Streamed(Arc<StreamedTable>),
}

impl From<StreamedTable> for RowSource {
    fn from(table: StreamedTable) -> Self {
        Self::Streamed(Arc::new(table))
    }
}

impl From<Dataset> for RowSource {
    fn from(data: Dataset) -> Self {
        Self::InMemory(Arc::new(data))
    }
}

impl RowSource {
    /// Rows in one pass over the data.
    pub fn len(&self) -> usize {
        match self {
            Self::InMemory(data) => data.len(),
            Self::Streamed(table) => usize::try_from(table.rows).unwrap_or(usize::MAX),
        }
    }

    /// True when there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Inputs per row.
    pub fn dim(&self) -> usize {
        match self {
            Self::InMemory(data) => data.dim,
            Self::Streamed(table) => table.dim,
        }
    }

    /// Whether the targets are values to regress rather than classes.
    pub fn is_regression(&self) -> bool {
        match self {
            Self::InMemory(data) => data.targets.is_regression(),
            Self::Streamed(table) => table.is_regression(),
        }
    }

    /// Part `part` of `parts` near-equal parts of the rows, in pieces of at most `piece_rows`
    /// rows: together the parts hold every row once (how ranks share the held-out rows). A
    /// stream reads only its part of the files, a piece at a time.
    pub fn share(&self, part: usize, parts: usize, piece_rows: usize) -> Result<Pieces> {
        let piece_rows = piece_rows.max(1);
        Ok(Pieces(match self {
            Self::InMemory(data) => {
                let (n, parts) = (data.len(), parts.max(1));
                PiecesOf::InMemory {
                    data: data.clone(),
                    rows: part * n / parts..(part + 1) * n / parts,
                    piece_rows,
                }
            }
            Self::Streamed(table) => PiecesOf::Streamed {
                table: table.clone(),
                loader: table.evaluation(piece_rows, part, parts)?,
            },
        }))
    }
}

/// A share of rows, a piece at a time ([`RowSource::share`]).
#[derive(Debug)]
pub struct Pieces(PiecesOf);

#[derive(Debug)]
enum PiecesOf {
    InMemory {
        data: Arc<Dataset>,
        /// The rows not given yet.
        rows: std::ops::Range<usize>,
        piece_rows: usize,
    },
    Streamed {
        table: Arc<StreamedTable>,
        loader: PartLoader<TableStream>,
    },
}

impl Iterator for Pieces {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        match &mut self.0 {
            PiecesOf::InMemory { data, rows, piece_rows } => {
                let end = rows.end.min(rows.start + *piece_rows);
                let piece: Vec<usize> = (rows.start..end).collect();
                rows.start = end;
                (!piece.is_empty()).then(|| Ok(data.select(&piece)))
            }
            PiecesOf::Streamed { table, loader } => loader
                .next_eval_batch()
                .map(|rows| rows.map(|rows| Batch::of_rows(&rows, table.dim, table.is_regression())))
                .transpose(),
        }
    }
}

/// One rank's batches of a run: its part of every global batch, by step.
#[derive(Debug)]
pub(crate) enum RankBatches {
    InMemory(ShardedLoader),
    Streamed {
        table: Arc<StreamedTable>,
        loader: PartLoader<TableStream>,
        global_batch: usize,
        /// The rank reading, and of how many.
        place: (usize, usize),
        /// The step whose batch the loader reads next.
        next: usize,
        /// Where the loader was at the last few steps that are multiples of `mark_every` (the
        /// checkpoint interval): a rollback to one seeks there instead of reading from the start.
        marks: VecDeque<(usize, DataPosition)>,
        mark_every: usize,
    },
}

/// Positions kept for rollbacks: a rollback goes to one of the last few checkpoints.
const MARKS_KEPT: usize = 4;

impl RankBatches {
    /// The batches `rank` of `world` reads of `rows`, in global batches of `global_batch`
    /// (shuffled with `seed` when in memory); a stream marks where it is every `mark_every`
    /// steps (0: never), for rollbacks.
    pub(crate) fn new(
        rows: &RowSource,
        global_batch: usize,
        (rank, world): (usize, usize),
        seed: u64,
        mark_every: usize,
    ) -> Result<Self> {
        Ok(match rows {
            RowSource::InMemory(data) => {
                Self::InMemory(ShardedLoader::new(data.clone(), global_batch, rank, world, seed)?)
            }
            RowSource::Streamed(table) => Self::Streamed {
                table: table.clone(),
                loader: table.loader(global_batch, rank, world)?,
                global_batch,
                place: (rank, world),
                next: 0,
                marks: VecDeque::new(),
                mark_every,
            },
        })
    }

    /// Reads the same batches as `rank` of `world` from now on (another cut of every global
    /// batch, when membership changed). A stream read by the same rank keeps its place and
    /// its marks.
    pub(crate) fn place(&mut self, rank: usize, world: usize) -> Result<()> {
        match self {
            Self::InMemory(loader) => *loader = loader.for_rank(rank, world)?,
            Self::Streamed { place, .. } if *place == (rank, world) => {}
            Self::Streamed {
                table,
                global_batch,
                mark_every,
                ..
            } => {
                let table = RowSource::Streamed(table.clone());
                *self = Self::new(&table, *global_batch, (rank, world), 0, *mark_every)?;
            }
        }
        Ok(())
    }

    /// Where a stream is before the batch of step `step`, when that is the batch it reads next:
    /// what a checkpoint after `step` steps saves. `None` for rows in memory (a step says
    /// where they are).
    pub(crate) fn position(&self, step: usize) -> Result<Option<DataPosition>> {
        match self {
            Self::InMemory(_) => Ok(None),
            Self::Streamed { loader, next, .. } => {
                ensure!(
                    *next == step,
                    "the data position before step {step} was asked of a stream at step {next}"
                );
                Ok(Some(loader.position()))
            }
        }
    }

    /// Goes to `at`, the position saved before the batch of step `step` (by any ranks, as long
    /// as they hold this rank's parts), instead of reading the rows before it. Refused (and
    /// back at the start, to read its way there) where `at` is of another layout or lacks a
    /// part of this rank's.
    pub(crate) fn resume_at(&mut self, step: usize, at: &DataPosition) -> Result<()> {
        if let Self::Streamed {
            loader, next, marks, ..
        } = self
        {
            if let Err(refused) = loader.resume_at(at) {
                loader.rewind()?;
                *next = 0;
                marks.clear();
                return Err(refused);
            }
            *next = step;
            marks.retain(|(marked, _)| *marked < step);
            marks.push_back((step, loader.position()));
            if marks.len() > MARKS_KEPT {
                marks.pop_front();
            }
        }
        Ok(())
    }

    /// This rank's batch at global step `step`. A stream reads on from where it is: a step
    /// before it (a rollback) seeks to the newest mark at or before the step, or reads its
    /// parts again from the start, passing over the rows before without building them.
    pub(crate) fn batch(&mut self, step: usize) -> Result<Batch> {
        match self {
            Self::InMemory(loader) => Ok(loader.batch(step)),
            Self::Streamed {
                table,
                loader,
                next,
                marks,
                mark_every,
                ..
            } => {
                if step < *next {
                    marks.retain(|(marked, _)| *marked <= step);
                    match marks.back() {
                        Some((marked, position)) => {
                            loader.resume_at(position)?;
                            *next = *marked;
                        }
                        None => {
                            loader.rewind()?;
                            *next = 0;
                        }
                    }
                }
                loader.skip_batches(step - *next)?;
                let at_mark = *mark_every > 0 && step.is_multiple_of(*mark_every);
                if at_mark && marks.back().is_none_or(|(marked, _)| *marked < step) {
                    if marks.len() == MARKS_KEPT {
                        marks.pop_front();
                    }
                    marks.push_back((step, loader.position()));
                }
                let rows = loader.next_batch()?;
                *next = step + 1;
                Ok(Batch::of_rows(&rows, table.dim, table.is_regression()))
            }
        }
    }
}

/// A batch of rows, inputs row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// `rows() * dim` inputs.
    pub inputs: Inputs,
    /// One class per row, one per input (next tokens), or values per row.
    pub targets: Targets,
    /// Inputs per row.
    pub dim: usize,
}

impl Batch {
    /// A batch of `rows`, each `dim` features and then its label: a value to regress, or a
    /// class id.
    pub(crate) fn of_rows(rows: &[Vec<f32>], dim: usize, regression: bool) -> Self {
        let mut inputs = Vec::with_capacity(rows.len() * dim);
        let mut labels = Vec::with_capacity(rows.len());
        for row in rows {
            inputs.extend_from_slice(&row[..dim]);
            labels.extend(row.get(dim));
        }
        let targets = match regression {
            true => Targets::Values(labels),
            false => Targets::Classes(labels.into_iter().map(|label| label as u32).collect()),
        };
        Self {
            inputs: Inputs::Features(inputs),
            targets,
            dim,
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.inputs.len() / self.dim.max(1)
    }

    /// Rows `range` of the batch, as a batch of their own.
    pub fn piece(&self, range: std::ops::Range<usize>) -> Batch {
        let per_row = self.targets.len() / self.rows().max(1);
        let indices: Vec<usize> = range.clone().collect();
        Batch {
            inputs: self.inputs.select(&indices, self.dim),
            targets: self.targets.range(range, per_row),
            dim: self.dim,
        }
    }

    /// Inputs `(rows, dim)` (f32 features or u32 tokens) and targets ([`Targets::tensor`]) on
    /// `device`.
    pub fn tensors(&self, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
        let rows = self.rows();
        let x = match &self.inputs {
            Inputs::Features(v) => Tensor::from_slice(v, (rows, self.dim), device)?,
            Inputs::Tokens(v) => Tensor::from_slice(v, (rows, self.dim), device)?,
        };
        Ok((x, self.targets.tensor(rows, device)?))
    }
}

/// Deterministic, rank-sharded batches over a dataset.
#[derive(Debug, Clone)]
pub struct ShardedLoader {
    data: Arc<Dataset>,
    global_batch: usize,
    rank: usize,
    world_size: usize,
    seed: u64,
    /// The permutation of the current epoch, drawn once per epoch.
    epoch_order: Option<(usize, Vec<usize>)>,
}

impl ShardedLoader {
    /// A loader for `rank` of `world_size`; `global_batch` must divide by the
    /// world size and fit in the dataset.
    pub fn new(data: Arc<Dataset>, global_batch: usize, rank: usize, world_size: usize, seed: u64) -> Result<Self> {
        super::check_rank_batch(global_batch, rank, world_size)?;
        ensure!(
            global_batch <= data.len(),
            "global batch {global_batch} is larger than the dataset ({} rows)",
            data.len()
        );
        Ok(Self {
            data,
            global_batch,
            rank,
            world_size,
            seed,
            epoch_order: None,
        })
    }

    /// The same stream read by `rank` of `world_size` (another cut of every global batch).
    pub fn for_rank(&self, rank: usize, world_size: usize) -> Result<Self> {
        Self::new(self.data.clone(), self.global_batch, rank, world_size, self.seed)
    }

    /// Global batches in one epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.data.len() / self.global_batch
    }

    /// Rows this rank reads per step.
    pub fn local_batch(&self) -> usize {
        self.global_batch / self.world_size
    }

    /// This rank's batch at global step `step`.
    pub fn batch(&mut self, step: usize) -> Batch {
        let per_epoch = self.batches_per_epoch();
        let epoch = step / per_epoch;
        let start = (step % per_epoch) * self.global_batch + self.rank * self.local_batch();
        let local = self.local_batch();
        let (data, seed) = (&self.data, self.seed);
        let (_, order) = match &mut self.epoch_order {
            Some(cached) if cached.0 == epoch => cached,
            slot => slot.insert((epoch, epoch_permutation(data.len(), seed, epoch))),
        };
        self.data.select(&order[start..start + local])
    }
}

fn epoch_permutation(rows: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..rows).collect();
    SplitMix64::for_stream(seed, "epoch-shuffle", epoch as u64).shuffle(&mut order);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_batches_concatenate_to_the_global_batch() -> anyhow::Result<()> {
        let data = Arc::new(Dataset::synthetic(100, 3, 2, 5)?);
        let mut whole = ShardedLoader::new(data.clone(), 20, 0, 1, 9)?;
        for step in [0, 4, 5, 13] {
            let mut joined = Vec::new();
            for rank in 0..4 {
                let mut l = ShardedLoader::new(data.clone(), 20, rank, 4, 9)?;
                let Targets::Classes(classes) = l.batch(step).targets else {
                    anyhow::bail!("synthetic data has classes")
                };
                joined.extend(classes);
            }
            assert_eq!(Targets::Classes(joined), whole.batch(step).targets);
        }
        let (first, next_epoch) = (whole.batch(0), whole.batch(5));
        assert_ne!(first, next_epoch, "epochs are reshuffled");
        assert_eq!(
            whole.batch(0),
            first,
            "going back to an earlier epoch gives the same batch"
        );
        Ok(())
    }

    #[test]
    fn indivisible_batch_is_rejected() -> anyhow::Result<()> {
        let data = Arc::new(Dataset::synthetic(10, 2, 2, 1)?);
        assert!(ShardedLoader::new(data, 7, 0, 2, 0).is_err());
        Ok(())
    }
}
