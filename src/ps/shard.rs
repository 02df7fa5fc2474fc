//! One parameter-server shard's state machine: its dense slice and its rows of every sparse
//! table, and the rule of each mode for when an update is applied.
//!
//! - **sync**: the pushes of step t are held until every trainer's has arrived, then summed in
//!   trainer order (so the result does not depend on arrival order), divided by the trainer
//!   count (each trainer's gradient is the mean over its part of the global batch) and applied
//!   once; pulls of step t+1 wait for that. The result equals one process training the global
//!   batch.
//! - **async**: each push is applied on arrival, as it is.
//! - **geo**: pushes carry parameter deltas of k local steps; the shard adds `delta / trainers`,
//!   so the trainers' models are averaged.
//!
//! A push is identified by (trainer, step), so a push retried after a lost answer is applied
//! once.

use std::path::Path;

use anyhow::{bail, ensure, Result};
use rustc_hash::FxHashMap;

use super::dense::DenseSlice;
use super::snapshot::{load_from_bytes, load_rehashed, load_shard, save_shard, shard_bytes, ShardSnapshotInfo};
use super::table::{Lookup, SparseTable};
use super::wire::{Part, PullRequest, PulledRows, PushRequest, ShardStats, TableStats, UpdateKind};
use crate::config::PsMode;

/// Where a shard sits in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    /// This shard's index.
    pub index: usize,
    /// Shards in the job.
    pub server_num: usize,
    /// Trainers in the job.
    pub trainers: usize,
    /// Update mode.
    pub mode: PsMode,
    /// Steps per pass (tables with a policy shrink at each pass's end); 0: no passes.
    pub pass_steps: usize,
}

/// A shard's parameters and the bookkeeping of its mode.
pub struct Shard {
    spec: ShardSpec,
    dense: DenseSlice,
    tables: Vec<SparseTable>,
    /// Sync: steps applied so far; async and geo: pushes applied so far.
    applied: u64,
    /// Passes ended.
    passes: u64,
    /// Sync: the pushes (parts) of step `applied` that arrived, by trainer.
    pending: Vec<Vec<PushRequest>>,
    /// The parts of each trainer's update in progress that arrived, to drop retried ones.
    arriving: Vec<Option<Arrivals>>,
    /// Async and geo: the last step applied whole per trainer, to drop retried pushes.
    last_step: Vec<Option<u64>>,
    ended: Vec<bool>,
    left: Vec<bool>,
    /// Sync: whether this shard's process was asked to stop (preemption) while step `applied`
    /// gathered its pushes.
    stop_asked_here: bool,
    /// Sync: whether a trainer (or this shard) was asked to stop in the last step applied: what
    /// every pull of the next step answers, so that all trainers stop after that step.
    stop_heard: bool,
}

impl Shard {
    /// A shard holding `dense` and `tables` (in the job's table order).
    pub fn new(spec: ShardSpec, dense: DenseSlice, tables: Vec<SparseTable>) -> Self {
        Self {
            spec,
            dense,
            tables,
            applied: 0,
            passes: 0,
            pending: vec![Vec::new(); spec.trainers],
            arriving: vec![None; spec.trainers],
            last_step: vec![None; spec.trainers],
            ended: vec![false; spec.trainers],
            left: vec![false; spec.trainers],
            stop_asked_here: false,
            stop_heard: false,
        }
    }

    /// This shard's process was asked to stop (preemption): the step gathering its pushes
    /// tells the trainers so.
    pub fn ask_to_stop(&mut self) {
        self.stop_asked_here = true;
    }

    /// Where the shard sits.
    pub fn spec(&self) -> ShardSpec {
        self.spec
    }

    /// The shard's tables.
    pub fn tables(&self) -> &[SparseTable] {
        &self.tables
    }

    /// The shard's dense slice.
    pub fn dense(&self) -> &DenseSlice {
        &self.dense
    }

    /// Whether `pull` can be answered now, or must wait for other trainers' pushes (sync mode)
    /// or for every trainer to end training (a final evaluation).
    pub fn can_answer(&self, pull: &PullRequest) -> bool {
        let synced = self.spec.mode != PsMode::Sync || self.applied >= pull.version;
        synced && (!pull.after_training || self.ended.iter().all(|&e| e))
    }

    /// What a pull that cannot be answered yet waits for, naming the trainers it waits on.
    pub fn waiting_for(&self, pull: &PullRequest) -> String {
        let missing =
            |done: &dyn Fn(usize) -> bool| -> Vec<usize> { (0..self.spec.trainers).filter(|&t| !done(t)).collect() };
        if self.spec.mode == PsMode::Sync && self.applied < pull.version {
            let step = self.applied;
            format!(
                "step {step} still waits for the pushes of trainers {:?}",
                missing(&|t| self.has_whole_update(t, step))
            )
        } else {
            format!("trainers {:?} have not ended training", missing(&|t| self.ended[t]))
        }
    }

    /// Reads the requested rows and the dense slice; creates nothing.
    pub fn pull(&self, pull: &PullRequest) -> Result<PulledRows> {
        self.check_trainer(pull.trainer)?;
        self.check_table_count(pull.ids.len(), "pull")?;
        let lookup = match pull.training {
            true => Lookup::Training,
            false => Lookup::Serving,
        };
        let rows = self
            .tables
            .iter()
            .zip(&pull.ids)
            .map(|(table, ids)| {
                let mut out = vec![0.0; ids.len() * table.width()];
                table.pull(ids, &mut out, lookup)?;
                Ok(out)
            })
            .collect::<Result<_>>()?;
        let dense = if pull.dense {
            self.dense.values().to_vec()
        } else {
            Vec::new()
        };
        Ok(PulledRows {
            rows,
            dense,
            stop: self.stop_heard,
        })
    }

    /// Takes a trainer's update; applies it now or, in sync mode, when the step is complete.
    /// Returns whether anything was applied (pulls waiting on the shard may now be answerable).
    pub fn push(&mut self, push: PushRequest) -> Result<bool> {
        self.check_push(&push)?;
        let trainer = push.trainer;
        match self.spec.mode {
            PsMode::Sync => {
                if push.step < self.applied {
                    return Ok(false); // a retry of a push already applied
                }
                ensure!(
                    push.step == self.applied,
                    "trainer {trainer} pushed step {} while shard {} is at step {}: trainers out of step",
                    push.step,
                    self.spec.index,
                    self.applied
                );
                if !Arrivals::record(&mut self.arriving[trainer], push.step, push.part, trainer)? {
                    return Ok(false); // a retry of a part already taken
                }
                self.pending[trainer].push(push);
                let step = self.applied;
                if (0..self.spec.trainers).all(|t| self.has_whole_update(t, step)) {
                    self.apply_step()?;
                    return Ok(true);
                }
                Ok(false)
            }
            PsMode::Async | PsMode::Geo { .. } => {
                if self.last_step[trainer].is_some_and(|last| push.step <= last)
                    || !Arrivals::record(&mut self.arriving[trainer], push.step, push.part, trainer)?
                {
                    return Ok(false); // a retry
                }
                let scale = match push.kind {
                    UpdateKind::Gradients => 1.0,
                    UpdateKind::Deltas => 1.0 / self.spec.trainers as f32,
                };
                self.apply(push.kind, scale, &push.ids, push.values, &push.counts, push.dense)?;
                if self.has_whole_update(trainer, push.step) {
                    self.arriving[trainer] = None;
                    self.last_step[trainer] = Some(push.step);
                    self.applied += 1;
                    self.end_passes();
                }
                Ok(true)
            }
        }
    }

    /// Records that `trainer` pushed its last update; returns whether all have.
    pub fn end_training(&mut self, trainer: usize) -> Result<bool> {
        self.check_trainer(trainer)?;
        self.ended[trainer] = true;
        Ok(self.ended.iter().all(|&e| e))
    }

    /// Records that `trainer` is gone; returns whether all are, so the shard can exit.
    pub fn leave(&mut self, trainer: usize) -> Result<bool> {
        self.check_trainer(trainer)?;
        self.left[trainer] = true;
        Ok(self.left.iter().all(|&l| l))
    }

    /// Rows and allocated bytes of every table.
    pub fn stats(&self) -> ShardStats {
        let tables = self
            .tables
            .iter()
            .map(|t| {
                let tally = t.tally();
                TableStats {
                    rows: t.len() as u64,
                    bytes: t.memory_bytes() as u64,
                    admitted: tally.admitted,
                    evicted: tally.evicted,
                    deleted: tally.deleted,
                }
            })
            .collect();
        ShardStats {
            tables,
            updates_applied: self.applied,
        }
    }

    /// Writes the dense slice and every table to `path`.
    pub fn save(&self, path: &Path) -> Result<()> {
        let tables: Vec<&SparseTable> = self.tables.iter().collect();
        save_shard(path, &self.snapshot_info(), &self.dense, &tables)
    }

    /// Steps applied so far (sync mode), or pushes applied (async and geo).
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// The dense slice and every table as the bytes of a snapshot file, for a checkpoint.
    pub fn snapshot_bytes(&self) -> Result<Vec<u8>> {
        let tables: Vec<&SparseTable> = self.tables.iter().collect();
        shard_bytes(&self.snapshot_info(), &self.dense, &tables)
    }

    /// Serves `trainers` trainers from the next [`Shard::resume`] on: a job with elastic
    /// membership trains some generations on fewer.
    pub fn set_trainers(&mut self, trainers: usize) {
        self.spec.trainers = trainers;
    }

    /// Continues from a checkpoint taken after `step` steps: the tables and dense slice of
    /// `bytes` (as [`Shard::snapshot_bytes`] made them), and the bookkeeping of that point —
    /// every trainer had pushed exactly its steps before `step` ([`Shard::checkpoint_ready`]).
    pub fn resume(&mut self, bytes: &[u8], step: u64) -> Result<()> {
        let info = self.snapshot_info();
        let mut tables: Vec<&mut SparseTable> = self.tables.iter_mut().collect();
        load_from_bytes(bytes, &info, &mut self.dense, &mut tables)?;
        self.resumed_at(step);
        Ok(())
    }

    /// Continues from a checkpoint of another number of shards taken after `step` steps: its
    /// part of every shard's file `files`, re-hashed ([`load_rehashed`]).
    pub fn resume_rehashed(&mut self, files: &[Vec<u8>], step: u64) -> Result<()> {
        let info = self.snapshot_info();
        let mut tables: Vec<&mut SparseTable> = self.tables.iter_mut().collect();
        load_rehashed(files, &info, &mut self.dense, &mut tables)?;
        self.resumed_at(step);
        Ok(())
    }

    /// The bookkeeping of the point after `step` steps: every trainer had pushed exactly its
    /// steps before it ([`Shard::checkpoint_ready`]).
    fn resumed_at(&mut self, step: u64) {
        let trainers = self.spec.trainers;
        let (applied, last_step) = match self.spec.mode {
            PsMode::Sync => (step, None),
            PsMode::Async => (step * trainers as u64, step.checked_sub(1)),
            PsMode::Geo { k_steps } => (step / k_steps as u64 * trainers as u64, step.checked_sub(1)),
        };
        self.applied = applied;
        self.passes = step.checked_div(self.spec.pass_steps as u64).unwrap_or(0);
        self.last_step = vec![last_step; trainers];
        self.pending = vec![Vec::new(); trainers];
        self.arriving = vec![None; trainers];
        self.ended = vec![false; trainers];
        self.left = vec![false; trainers];
        self.stop_heard = false;
    }

    /// Whether the checkpoint after `step` steps can be taken now: every trainer has pushed its
    /// steps before `step` and none after (the trainers wait for the checkpoint before they
    /// push on), so the shard holds one consistent point in every mode. An error when a trainer
    /// is already past it.
    pub fn checkpoint_ready(&self, step: u64) -> Result<bool> {
        let index = self.spec.index;
        match self.spec.mode {
            PsMode::Sync => {
                ensure!(
                    self.applied <= step,
                    "parameter server {index}: asked for the checkpoint of step {step} at step {}",
                    self.applied
                );
                Ok(self.applied == step)
            }
            PsMode::Async | PsMode::Geo { .. } => {
                let before = step.checked_sub(1);
                if let Some(t) = (0..self.spec.trainers).find(|&t| self.last_step[t] > before) {
                    bail!(
                        "parameter server {index}: trainer {t} pushed step {:?} before the checkpoint of step {step}",
                        self.last_step[t]
                    );
                }
                Ok(self.last_step.iter().all(|&last| last == before))
            }
        }
    }

    /// Replaces the dense slice and the tables with those saved in `path`.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let info = self.snapshot_info();
        let mut tables: Vec<&mut SparseTable> = self.tables.iter_mut().collect();
        load_shard(path, &info, &mut self.dense, &mut tables)
    }

    fn snapshot_info(&self) -> ShardSnapshotInfo {
        ShardSnapshotInfo {
            shard: self.spec.index,
            server_num: self.spec.server_num,
        }
    }

    /// Sync mode: sums the step's pushes in trainer order, averages and applies them.
    fn apply_step(&mut self) -> Result<()> {
        // In trainer order, each trainer's parts in order: the sums are those of whole pushes.
        let mut pushes = Vec::new();
        for parts in &mut self.pending {
            parts.sort_by_key(|push| push.part.index);
            pushes.append(parts);
        }
        self.arriving.fill(None);
        self.stop_heard = std::mem::take(&mut self.stop_asked_here) || pushes.iter().any(|push| push.stop);
        let scale = 1.0 / self.spec.trainers as f32;
        let mut dense = vec![0.0f32; self.dense.len()];
        for push in &pushes {
            for (sum, g) in dense.iter_mut().zip(&push.dense) {
                *sum += g;
            }
        }
        let mut ids = Vec::with_capacity(self.tables.len());
        let mut values = Vec::with_capacity(self.tables.len());
        let mut counts = Vec::with_capacity(self.tables.len());
        for (t, table) in self.tables.iter().enumerate() {
            let parts = pushes.iter().map(|push| (&push.ids[t][..], &push.values[t][..]));
            let (table_ids, table_values) = sum_rows(parts, table.width());
            // The same ids in the same first-seen order: each row's shows and clicks summed.
            let counted = pushes.iter().filter_map(|push| {
                let counts = push.counts.get(t).filter(|counts| !counts.is_empty())?;
                Some((&push.ids[t][..], &counts[..]))
            });
            let (_, table_counts) = sum_rows(counted, 2);
            ids.push(table_ids);
            values.push(table_values);
            counts.push(table_counts);
        }
        self.apply(UpdateKind::Gradients, scale, &ids, values, &counts, dense)?;
        self.applied += 1;
        self.end_passes();
        Ok(())
    }

    /// Ends the passes every trainer has trained through — in sync mode the steps applied, in
    /// async and geo the steps of each trainer's last push — shrinking the tables at each.
    fn end_passes(&mut self) {
        let pass = self.spec.pass_steps as u64;
        if pass == 0 {
            return;
        }
        let trained = match self.spec.mode {
            PsMode::Sync => self.applied,
            PsMode::Async | PsMode::Geo { .. } => self
                .last_step
                .iter()
                .map(|last| last.map_or(0, |step| step + 1))
                .min()
                .unwrap_or(0),
        };
        while (self.passes + 1) * pass <= trained {
            self.passes += 1;
            for table in &mut self.tables {
                let deleted = table.end_pass();
                if table.policy().is_some() {
                    tracing::debug!(
                        "parameter server {}: pass {} ended, table `{}` deleted {deleted} rows, holds {}",
                        self.spec.index,
                        self.passes,
                        table.name(),
                        table.len()
                    );
                }
            }
        }
    }

    /// Applies `scale ×` the update: gradients through the optimizer, deltas added.
    fn apply(
        &mut self,
        kind: UpdateKind,
        scale: f32,
        ids: &[Vec<u64>],
        mut values: Vec<Vec<f32>>,
        counts: &[Vec<f32>],
        mut dense: Vec<f32>,
    ) -> Result<()> {
        if scale != 1.0 {
            for v in values.iter_mut().flatten().chain(dense.iter_mut()) {
                *v *= scale;
            }
        }
        for (t, ((table, ids), values)) in self.tables.iter_mut().zip(ids).zip(&values).enumerate() {
            let counts = counts.get(t).map_or(&[][..], Vec::as_slice);
            match kind {
                UpdateKind::Gradients => table.apply_gradients(ids, values, counts)?,
                UpdateKind::Deltas => table.add_deltas(ids, values, counts)?,
            }
        }
        if dense.is_empty() && !self.dense.is_empty() {
            return Ok(()); // a later part of an update: the dense values came with part 0
        }
        match kind {
            UpdateKind::Gradients => self.dense.apply_gradients(&dense),
            UpdateKind::Deltas => self.dense.add_deltas(&dense),
        }
    }

    /// Whether every part of `trainer`'s update for `step` has arrived.
    fn has_whole_update(&self, trainer: usize, step: u64) -> bool {
        self.arriving[trainer]
            .as_ref()
            .is_some_and(|arrivals| arrivals.step == step && arrivals.whole())
    }

    /// Everything about a push that can be wrong, checked before it is stored, so a bad push
    /// fails at once with the trainer's name on it.
    fn check_push(&self, push: &PushRequest) -> Result<()> {
        self.check_trainer(push.trainer)?;
        self.check_table_count(push.ids.len().max(push.values.len()), "push")?;
        ensure!(
            push.ids.len() == push.values.len(),
            "push from trainer {} has ids for {} tables and values for {}",
            push.trainer,
            push.ids.len(),
            push.values.len()
        );
        for ((table, ids), values) in self.tables.iter().zip(&push.ids).zip(&push.values) {
            ensure!(
                values.len() == ids.len() * table.width(),
                "push from trainer {} to table {:?}: {} values for {} rows of width {} (expected {})",
                push.trainer,
                table.name(),
                values.len(),
                ids.len(),
                table.width(),
                ids.len() * table.width()
            );
        }
        ensure!(
            push.counts.is_empty() || push.counts.len() == push.ids.len(),
            "push from trainer {} has ids for {} tables and counts for {}",
            push.trainer,
            push.ids.len(),
            push.counts.len()
        );
        ensure!(
            push.part.index < push.part.of && push.part.of <= Part::MOST,
            "push from trainer {}: part {} of {}",
            push.trainer,
            push.part.index,
            push.part.of
        );
        // The dense values travel with the first part.
        let dense = if push.part.index == 0 { self.dense.len() } else { 0 };
        ensure!(
            push.dense.len() == dense,
            "push from trainer {} (part {} of {}): {} dense values, shard {} expects {dense}",
            push.trainer,
            push.part.index,
            push.part.of,
            push.dense.len(),
            self.spec.index,
        );
        let expected = match self.spec.mode {
            PsMode::Geo { .. } => UpdateKind::Deltas,
            PsMode::Sync | PsMode::Async => UpdateKind::Gradients,
        };
        ensure!(
            push.kind == expected,
            "push from trainer {} carries {:?}, but shard {} runs in {} mode",
            push.trainer,
            push.kind,
            self.spec.index,
            self.spec.mode.name()
        );
        Ok(())
    }

    fn check_trainer(&self, trainer: usize) -> Result<()> {
        ensure!(
            trainer < self.spec.trainers,
            "trainer {trainer} is not in this job of {} trainers",
            self.spec.trainers
        );
        Ok(())
    }

    fn check_table_count(&self, named: usize, what: &str) -> Result<()> {
        if named > self.tables.len() {
            let names: Vec<&str> = self.tables.iter().map(SparseTable::name).collect();
            bail!(
                "{what} names table {} but the job has {} tables ({})",
                named - 1,
                self.tables.len(),
                names.join(", ")
            );
        }
        ensure!(
            named == self.tables.len(),
            "{what} covers {named} of the job's {} tables",
            self.tables.len()
        );
        Ok(())
    }
}

/// The rows of `parts` (ids with their `width`-float values), each id once (first-seen order),
/// values summed.
pub(crate) fn sum_rows<'a>(
    parts: impl IntoIterator<Item = (&'a [u64], &'a [f32])>,
    width: usize,
) -> (Vec<u64>, Vec<f32>) {
    let mut position: FxHashMap<u64, usize> = FxHashMap::default();
    let mut ids = Vec::new();
    let mut sums: Vec<f32> = Vec::new();
    for (part_ids, values) in parts {
        for (id, row) in part_ids.iter().zip(values.chunks_exact(width)) {
            let at = *position.entry(*id).or_insert_with(|| {
                ids.push(*id);
                sums.resize(sums.len() + width, 0.0);
                ids.len() - 1
            });
            for (sum, g) in sums[at * width..(at + 1) * width].iter_mut().zip(row) {
                *sum += g;
            }
        }
    }
    (ids, sums)
}

/// The parts of one trainer's update for one step that have arrived.
#[derive(Debug, Clone)]
struct Arrivals {
    step: u64,
    seen: Vec<bool>,
}

impl Arrivals {
    /// Records `part` of `trainer`'s update for `step` in `slot`; `false` when it had arrived
    /// before (a retry). A part of another step while one is incomplete is an error.
    fn record(slot: &mut Option<Arrivals>, step: u64, part: Part, trainer: usize) -> Result<bool> {
        let arrivals = slot.get_or_insert_with(|| Arrivals {
            step,
            seen: vec![false; part.of as usize],
        });
        ensure!(
            arrivals.step == step,
            "trainer {trainer} pushed part {} of step {step} while its update of step {} misses parts",
            part.index,
            arrivals.step
        );
        ensure!(
            arrivals.seen.len() == part.of as usize,
            "trainer {trainer} pushed step {step} in {} parts and in {}",
            arrivals.seen.len(),
            part.of
        );
        let seen = &mut arrivals.seen[part.index as usize];
        Ok(!std::mem::replace(seen, true))
    }

    fn whole(&self) -> bool {
        self.seen.iter().all(|&seen| seen)
    }
}
