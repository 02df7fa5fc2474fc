//! A replica whose parameters are sharded (ZeRO stage 3, `sharding_configs.stage = 3`): between
//! steps a rank holds its shard of each block's parameters alone ([`ShardedStates`] keeps them);
//! a step all-gathers each block's just before the block's forward, releases them after, and
//! gathers them again for its backward, which recomputes the block's forward (candle's graph
//! holds what a block read, so a block's gathered parameters can go only with its graph). The
//! next block's gather runs on the communication thread while a block computes; in backward it
//! is queued before the block's reduce-scatter, so it never waits behind it.

use std::ops::Range;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_core::Device;

use super::sharded_states::Gathered;
use super::ShardedStates;
use crate::config::LossKind;
use crate::data::Batch;
use crate::engines::comm::{CommWorker, Pending};
use crate::engines::compute::segments::{AroundSegments, Pass};
use crate::models::{Model, NamedParam, Score};
use crate::telemetry::timeline::Timeline;

/// What a replica with sharded parameters holds of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Holding {
    /// Nothing yet: the model was made released ([`crate::models::ParamInit::deferring`]), each
    /// value drawn from its recipe where a shard or the whole model is taken.
    Deferred,
    /// The whole model (built, broadcast, restored, or gathered for a checkpoint or an
    /// evaluation): the next step takes its shards from it.
    Whole,
    /// Its shards alone.
    Shards,
    /// Nothing: the shards were cut anew for another ring (a rollback), so a restore must come
    /// before anything reads the parameters.
    Lost,
}

impl Holding {
    /// What a replica holds of `params` as it is made: nothing where they were made released.
    pub(super) fn of(params: &[NamedParam]) -> Self {
        match params.iter().all(|p| p.param.is_held()) {
            true => Self::Whole,
            false => Self::Deferred,
        }
    }

    /// Holds the whole model of `params`, whose shards `states` keeps: gathered over `comm`
    /// (every rank of the ring calling together, at step `step`) where `from_peers` (drawn from
    /// their recipes, where nothing was held yet), else allocated for a restore to fill (no
    /// other rank asked).
    pub(super) fn hold_whole(
        &mut self,
        (states, params): (&ShardedStates, &[NamedParam]),
        comm: &CommWorker,
        (step, from_peers): (usize, bool),
    ) -> Result<()> {
        match (*self, from_peers) {
            (Self::Whole, _) => {}
            (Self::Lost, true) => bail!(
                "rank {}: the sharded parameters were cut anew for another ring, and no restore has filled them",
                comm.rank()
            ),
            (Self::Shards, true) => states.gather_all(params, comm, step)?,
            (Self::Deferred, true) => {
                for p in params.iter().filter(|p| !p.param.is_held()) {
                    p.param
                        .hold(&p.param.values(0..p.param.elem_count())?.to_vec1::<f32>()?)?;
                }
            }
            (_, false) => {
                for p in params {
                    p.param.hold(&vec![0.0; p.param.elem_count()])?;
                }
            }
        }
        *self = Self::Whole;
        Ok(())
    }

    /// Keeps the shards alone: taken from the whole model where it is held, which is released.
    pub(super) fn keep_shards(&mut self, states: &ShardedStates, params: &[NamedParam]) -> Result<()> {
        match *self {
            Self::Shards => return Ok(()),
            Self::Lost => bail!("a step on sharded parameters that were cut anew and never restored"),
            Self::Whole | Self::Deferred => states.take_shards(params)?,
        }
        for p in params {
            p.param.release();
        }
        *self = Self::Shards;
        Ok(())
    }
}

/// A step's gathers of the blocks' parameters, carried from its forward to its backward.
pub(super) struct BlockGathers {
    /// The bucket holding each block's parameters (`None`: the block has none).
    bucket_of: Vec<Option<usize>>,
    /// Gathers started, by block.
    pending: Vec<Option<Pending<Gathered>>>,
    /// Whether each block's parameters are held.
    held: Vec<bool>,
    step: usize,
    /// Time compute waited for the gathers.
    pub(super) waited: Duration,
}

impl BlockGathers {
    /// The gathers of step `step` over `blocks` blocks, whose parameters `params` are in the
    /// buckets of `states`, all released.
    pub(super) fn new(states: &ShardedStates, params: &[NamedParam], blocks: usize, step: usize) -> Self {
        Self {
            bucket_of: states.bucket_of_blocks(params, blocks),
            pending: (0..blocks).map(|_| None).collect(),
            held: vec![false; blocks],
            step,
            waited: Duration::ZERO,
        }
    }

    /// The hook that gathers and releases around each segment of a pass.
    pub(super) fn around<'a>(
        &'a mut self,
        (states, params): (&'a ShardedStates, &'a [NamedParam]),
        comm: &'a CommWorker,
        timeline: &'a mut Option<Timeline>,
    ) -> Gathering<'a> {
        Gathering {
            gathers: self,
            states,
            params,
            comm,
            timeline,
        }
    }
}

/// [`BlockGathers`] at work around a pass's segments.
pub(super) struct Gathering<'a> {
    gathers: &'a mut BlockGathers,
    states: &'a ShardedStates,
    params: &'a [NamedParam],
    comm: &'a CommWorker,
    timeline: &'a mut Option<Timeline>,
}

impl Gathering<'_> {
    /// Starts the gather of `block`'s parameters, unless held, started, or beyond the model.
    fn start(&mut self, block: usize) -> Result<()> {
        let g = &mut *self.gathers;
        if block >= g.held.len() || g.held[block] || g.pending[block].is_some() {
            return Ok(());
        }
        if let Some(bucket) = g.bucket_of[block] {
            g.pending[block] = Some(self.states.gather(bucket, self.comm, g.step)?);
        }
        Ok(())
    }

    /// Holds `block`'s parameters, waiting for their gather.
    fn hold(&mut self, block: usize) -> Result<()> {
        if self.gathers.held[block] {
            return Ok(());
        }
        self.start(block)?;
        let g = &mut *self.gathers;
        if let (Some(bucket), Some(gathered)) = (g.bucket_of[block], g.pending[block].take()) {
            g.waited += self.states.hold(bucket, gathered, self.params, self.timeline)?;
        }
        g.held[block] = true;
        Ok(())
    }

    fn release(&mut self, block: usize) {
        let g = &mut *self.gathers;
        if let Some(bucket) = g.bucket_of[block] {
            self.states.release(bucket, self.params);
        }
        g.held[block] = false;
    }
}

impl AroundSegments for Gathering<'_> {
    /// Holds the segment's blocks, then starts the gather of the block that runs next: after
    /// them in forward, before them in backward.
    fn entering(&mut self, range: &Range<usize>, pass: Pass) -> Result<()> {
        for block in range.clone() {
            self.hold(block)?;
        }
        match pass {
            Pass::Forward => self.start(range.end),
            Pass::Backward if range.start > 0 => self.start(range.start - 1),
            Pass::Backward => Ok(()),
        }
    }

    /// Releases the segment's blocks, except the last segment's after forward: its backward
    /// comes next.
    fn leaving(&mut self, range: &Range<usize>, pass: Pass) -> Result<()> {
        if pass == Pass::Forward && range.end == self.gathers.held.len() {
            return Ok(());
        }
        for block in range.clone() {
            self.release(block);
        }
        Ok(())
    }
}

/// The score of `pieces` of held-out rows under `model`, whose parameters `params` are sharded
/// (`states` keeps the shards; none is held): round by round, every rank of `comm`'s ring takes
/// its next piece and all run the blocks in order, each block's parameters gathered just before
/// it runs (the next one's while it does) and released after; the activations leave the graph
/// after each block, so a block's gathered parameters go with it. A rank whose share has run out
/// still joins a round's gathers; the rounds end when no rank has a piece left.
pub(super) fn score_pieces_sharded(
    model: &Model,
    mut pieces: impl Iterator<Item = Result<Batch>>,
    (loss, device): (LossKind, &Device),
    (states, params): (&ShardedStates, &[NamedParam]),
    (comm, step): (&CommWorker, usize),
) -> Result<Score> {
    let blocks = model.blocks();
    let mut score = Score::default();
    for round in 0usize.. {
        let piece = pieces.next().transpose()?;
        if !any_rank_has_piece(comm, piece.is_some(), round)? {
            break;
        }
        let (mut gathers, mut untraced) = (BlockGathers::new(states, params, blocks.len(), step), None);
        let mut around = gathers.around((states, params), comm, &mut untraced);
        let mut held = piece.map(|piece| piece.tensors(device)).transpose()?;
        for (index, block) in blocks.iter().enumerate() {
            around.entering(&(index..index + 1), Pass::Forward)?;
            if let Some((h, _)) = &mut held {
                *h = (block.forward(h))
                    .with_context(|| format!("evaluation: forward of block {}", block.name()))?
                    .detach();
            }
            around.release(index);
        }
        if let Some((outputs, targets)) = held {
            score += model.score(loss, &outputs, &targets)?;
        }
    }
    Ok(score)
}

/// Whether any rank of `comm`'s ring has a piece for evaluation round `round` (`mine`: this one).
fn any_rank_has_piece(comm: &CommWorker, mine: bool, round: usize) -> Result<bool> {
    let mut count = [f32::from(u8::from(mine))];
    let count = comm.run(move |c| {
        c.all_reduce_sum(&format!("all-reduce of evaluation round {round}"), &mut count)?;
        Ok(count[0])
    })?;
    Ok(count > 0.0)
}
