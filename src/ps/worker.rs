//! The trainer's compute for the parameter-server strategy, run on its device thread: it plans
//! which rows a batch needs from which shard (each id of a table once), runs forward and backward
//! of the job's sparse model on the pulled rows, and says what to push back. In geo mode it also
//! keeps the local copies the trainer trains on between pushes.

use std::collections::VecDeque;

use anyhow::{ensure, Context as _, Result};
use candle_core::{Device, Tensor, Var};
use rustc_hash::FxHashMap;

use super::dense::dense_range;
use super::optimizer::ServerOptimizer;
use super::placement::shard_of;
use super::wire::{Part, PulledRows, PushRequest, Request, UpdateKind};
use crate::config::{JobConfig, PsMode};
use crate::data::ctr::CtrBatch;
use crate::models::{click_probability, sigmoid_cross_entropy, Lookup, ParamInit, SparseModel, SparseModelDef};

/// What a step needs from each shard.
#[derive(Debug, Clone, PartialEq)]
pub struct PullPlan {
    /// `ids[shard][table]`: ids to pull, each once.
    pub ids: Vec<Vec<Vec<u64>>>,
    /// Whether the dense slices are needed.
    pub dense: bool,
    /// For a training step (rows not held read as their initial values) or for evaluation.
    pub training: bool,
}

/// One shard's part of an update.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardUpdate {
    /// Ids per table.
    pub ids: Vec<Vec<u64>>,
    /// Per table, `ids × width` gradients or deltas.
    pub values: Vec<Vec<f32>>,
    /// Per table with a row policy, each id's shows and clicks (`2 × ids`); empty for others.
    pub counts: Vec<Vec<f32>>,
    /// The shard's dense slice of gradients or deltas.
    pub dense: Vec<f32>,
}

impl ShardUpdate {
    /// The request that pushes this update: trainer `trainer`'s of step `step`, saying whether
    /// it was asked to `stop`.
    pub fn into_push(self, trainer: usize, step: u64, kind: UpdateKind, stop: bool) -> Request {
        Request::Push(PushRequest {
            trainer,
            step,
            part: Part::WHOLE,
            kind,
            ids: self.ids,
            values: self.values,
            counts: self.counts,
            dense: self.dense,
            stop,
        })
    }
}

/// What a training step produced.
#[derive(Debug, Clone)]
pub struct StepOutcome {
    /// Mean loss over this trainer's batch.
    pub loss: f32,
    /// The update to push, by shard; `None` between geo pushes.
    pub push: Option<Vec<ShardUpdate>>,
}

/// The batch between planning its pull and running it.
struct PlannedBatch {
    batch: CtrBatch,
    /// Per slot group (tables read by the same slots share one), its ids deduplicated.
    groups: Vec<DistinctIds>,
    /// `slots[table][u]`: which shard and which position of that shard's id list the table's
    /// `u`-th distinct id is pulled from; `None` when it is already held locally (geo).
    slots: Vec<Vec<Option<(usize, usize)>>>,
}

/// The ids a group of slots holds in a batch, each once.
struct DistinctIds {
    /// The distinct ids in first-seen order (sample-major, then the group's slot order).
    unique: Vec<u64>,
    /// Per sample and slot of the group, the positions of its ids in `unique`.
    index: Vec<u32>,
    /// With multi-valued slots, per entry of `index` its (sample, group slot):
    /// `sample × slot_count + slot`; empty when each has one entry.
    segments: Vec<u32>,
    /// Slots in the group.
    slot_count: usize,
}

impl DistinctIds {
    /// The distinct ids of `slots` in `batch`.
    fn of(batch: &CtrBatch, slots: &[usize]) -> Self {
        let mut position: FxHashMap<u64, u32> = FxHashMap::default();
        let mut unique = Vec::new();
        let mut index = Vec::with_capacity(batch.len * slots.len());
        let mut segments = Vec::new();
        let multi_valued = !batch.slot_ends.is_empty();
        for sample in 0..batch.len {
            for (k, &slot) in slots.iter().enumerate() {
                for &id in batch.slot_ids(sample, slot) {
                    index.push(*position.entry(id).or_insert_with(|| {
                        unique.push(id);
                        (unique.len() - 1) as u32
                    }));
                    if multi_valued {
                        segments.push((sample * slots.len() + k) as u32);
                    }
                }
            }
        }
        Self {
            unique,
            index,
            segments,
            slot_count: slots.len(),
        }
    }

    /// The sample each entry of `index` belongs to.
    fn sample_of(&self, entry: usize) -> usize {
        match self.segments.is_empty() {
            true => entry / self.slot_count,
            false => self.segments[entry] as usize / self.slot_count,
        }
    }

    /// Each distinct id's shows (its occurrences in the batch) and clicks (those in clicked
    /// samples), in the order of `unique`.
    fn shows_and_clicks(&self, labels: &[f32]) -> Vec<[f32; 2]> {
        let mut counts = vec![[0.0f32; 2]; self.unique.len()];
        for (entry, &u) in self.index.iter().enumerate() {
            counts[u as usize][0] += 1.0;
            counts[u as usize][1] += labels[self.sample_of(entry)];
        }
        counts
    }
}

/// Local copies of geo mode: what the trainer trains on between pushes, and the values they
/// started from, whose difference is the delta to push. The job's optimizer runs here, on the
/// trainer; its state outlives the copies (which are pulled fresh after every push), as the
/// shards only add deltas.
struct GeoCopies {
    k_steps: usize,
    steps_since_push: usize,
    /// Per table, id → `[local row, base row]` (2 × width floats).
    rows: Vec<FxHashMap<u64, Vec<f32>>>,
    /// `[local, base]` of the dense parameters; `None` until pulled after a push.
    dense: Option<(Vec<f32>, Vec<f32>)>,
    /// Per table, id → the local optimizer's state of that row.
    row_state: Vec<FxHashMap<u64, Vec<f32>>>,
    /// Per table with a row policy, id → its shows and clicks since the last push.
    counts: Vec<FxHashMap<u64, [f32; 2]>>,
    /// The local optimizer's state of the dense parameters.
    dense_state: Vec<f32>,
}

/// A geo trainer's checkpointed state: its local optimizer's, per table by id (ascending), and
/// of the dense parameters.
#[derive(serde::Serialize, serde::Deserialize)]
struct GeoState {
    rows: Vec<Vec<(u64, Vec<f32>)>>,
    dense: Vec<f32>,
}

/// The trainer's model and the step logic around it.
pub struct CtrWorker {
    model: Box<dyn SparseModel>,
    dense_vars: Vec<Var>,
    dense_len: usize,
    widths: Vec<usize>,
    /// The distinct slot lists of the tables: tables read by the same slots share one
    /// deduplication of a batch's ids.
    slot_groups: Vec<Vec<usize>>,
    /// Per table, its slot group.
    group_of: Vec<usize>,
    /// Per table, whether its shards count shows and clicks (it has a row policy).
    counted: Vec<bool>,
    server_num: usize,
    device: Device,
    /// Geo mode: the optimizers of the local copies, per table.
    row_optimizers: Vec<ServerOptimizer>,
    /// Geo mode: the optimizer of the local dense copy.
    dense_optimizer: ServerOptimizer,
    geo: Option<GeoCopies>,
    /// Batches planned and not yet run, oldest first (async mode plans one step ahead).
    planned: VecDeque<PlannedBatch>,
}

impl CtrWorker {
    /// The worker of `job`, training `model`, on `device`.
    pub fn new(job: &JobConfig, model: &SparseModelDef, device: Device) -> Result<Self> {
        let tables = model.tables();
        let model = model.build(&ParamInit::new(job.train.seed, device.clone()))?;
        let dense_vars = (model.parameters().into_iter())
            .map(|(_, param)| param.var())
            .collect::<candle_core::Result<Vec<Var>>>()?;
        let dense_len = dense_vars.iter().map(|v| v.elem_count()).sum();
        let dense_optimizer = ServerOptimizer::for_job(job);
        let geo = match job.strategy.ps_mode() {
            PsMode::Geo { k_steps } => {
                let mut dense_state = vec![0.0; dense_optimizer.state_len(dense_len)];
                dense_optimizer.init_state(&mut dense_state);
                Some(GeoCopies {
                    k_steps,
                    steps_since_push: 0,
                    rows: vec![FxHashMap::default(); tables.len()],
                    dense: None,
                    row_state: vec![FxHashMap::default(); tables.len()],
                    counts: vec![FxHashMap::default(); tables.len()],
                    dense_state,
                })
            }
            PsMode::Sync | PsMode::Async => None,
        };
        let mut slot_groups: Vec<Vec<usize>> = Vec::new();
        let group_of = tables
            .iter()
            .map(|table| match slot_groups.iter().position(|g| *g == table.slots) {
                Some(group) => group,
                None => {
                    slot_groups.push(table.slots.clone());
                    slot_groups.len() - 1
                }
            })
            .collect();
        Ok(Self {
            model,
            dense_vars,
            dense_len,
            widths: tables.iter().map(|t| t.width).collect(),
            slot_groups,
            group_of,
            counted: tables
                .iter()
                .map(|t| job.strategy.sparse_table_configs.contains_key(&t.name))
                .collect(),
            server_num: job.cluster.server_num,
            device,
            row_optimizers: tables.iter().map(|t| ServerOptimizer::for_table(job, t)).collect(),
            dense_optimizer,
            geo,
            planned: VecDeque::new(),
        })
    }

    /// Deduplicates the batch's ids and says what to pull from which shard. With `training`
    /// false (evaluation) geo's local copies are bypassed: the shards' values are evaluated.
    pub fn plan(&mut self, batch: CtrBatch, training: bool) -> Result<PullPlan> {
        let expected = batch.len * batch.slots;
        ensure!(
            match batch.slot_ends.is_empty() {
                true => batch.ids.len() == expected,
                false =>
                    batch.slot_ends.len() == expected
                        && batch.slot_ends.last().map_or(0, |&e| e as usize) == batch.ids.len(),
            },
            "a batch of {} samples of {} slots has {} ids and {} slot ends",
            batch.len,
            batch.slots,
            batch.ids.len(),
            batch.slot_ends.len()
        );
        ensure!(
            self.slot_groups.iter().flatten().all(|&slot| slot < batch.slots),
            "the model reads slots up to {}, the batch has {}",
            self.slot_groups.iter().flatten().max().copied().unwrap_or_default(),
            batch.slots
        );
        let groups: Vec<DistinctIds> = self
            .slot_groups
            .iter()
            .map(|slots| DistinctIds::of(&batch, slots))
            .collect();
        let geo = self.geo.as_ref().filter(|_| training);
        let mut ids = vec![vec![Vec::new(); self.widths.len()]; self.server_num];
        let slots = (0..self.widths.len())
            .map(|table| {
                groups[self.group_of[table]]
                    .unique
                    .iter()
                    .map(|&id| {
                        if geo.is_some_and(|g| g.rows[table].contains_key(&id)) {
                            return None;
                        }
                        let shard = shard_of(table, id, self.server_num);
                        ids[shard][table].push(id);
                        Some((shard, ids[shard][table].len() - 1))
                    })
                    .collect()
            })
            .collect();
        let dense = !training || geo.is_none_or(|g| g.dense.is_none());
        self.planned.push_back(PlannedBatch { batch, groups, slots });
        Ok(PullPlan { ids, dense, training })
    }

    /// The distinct ids of `table` in `planned`.
    fn unique<'p>(&self, planned: &'p PlannedBatch, table: usize) -> &'p [u64] {
        &planned.groups[self.group_of[table]].unique
    }

    /// Per slot group read by a table with a row policy, its distinct ids' shows and clicks;
    /// `None` for the other groups. A table's are `table_counts` of them.
    fn shows_and_clicks(&self, planned: &PlannedBatch) -> Vec<Option<Vec<[f32; 2]>>> {
        (0..planned.groups.len())
            .map(|g| {
                let used = (0..self.widths.len()).any(|t| self.counted[t] && self.group_of[t] == g);
                used.then(|| planned.groups[g].shows_and_clicks(&planned.batch.labels))
            })
            .collect()
    }

    /// Table `table`'s shows and clicks among `by_group` ([`Self::shows_and_clicks`]); `None`
    /// without a row policy.
    fn table_counts<'c>(&self, by_group: &'c [Option<Vec<[f32; 2]>>], table: usize) -> Option<&'c [[f32; 2]]> {
        by_group[self.group_of[table]]
            .as_deref()
            .filter(|_| self.counted[table])
    }

    /// Runs forward and backward of the planned batch on the pulled rows (`pulled[shard]`)
    /// and returns the loss and what to push.
    pub fn train_step(&mut self, pulled: Vec<PulledRows>) -> Result<StepOutcome> {
        let (planned, row_vars, logits) = self.forward(&pulled, true)?;
        let batch = &planned.batch;
        let labels = Tensor::from_slice(&batch.labels, batch.len, &self.device)?;
        let loss = sigmoid_cross_entropy(&logits, &labels)?;
        let grads = loss.backward()?;
        let loss = loss.to_scalar::<f32>()?;
        let grad_of = |var: &Var| -> Result<Vec<f32>> {
            Ok(match grads.get(var.as_tensor()) {
                Some(g) => g.flatten_all()?.to_vec1::<f32>()?,
                None => vec![0.0; var.elem_count()],
            })
        };
        let row_grads = row_vars.iter().map(grad_of).collect::<Result<Vec<_>>>()?;
        let mut dense_grad = Vec::with_capacity(self.dense_len);
        for var in &self.dense_vars {
            dense_grad.extend(grad_of(var)?);
        }
        let push = match self.geo.is_some() {
            true => self.geo_step(&planned, &row_grads, &dense_grad)?,
            false => Some(self.split_gradients(&planned, &row_grads, &dense_grad)),
        };
        Ok(StepOutcome { loss, push })
    }

    /// Click probabilities of the planned batch under the pulled (shard) values.
    pub fn predict(&mut self, pulled: Vec<PulledRows>) -> Result<Vec<f32>> {
        let (_, _, logits) = self.forward(&pulled, false)?;
        Ok(click_probability(&logits)?.to_vec1::<f32>()?)
    }

    /// The logits of the oldest planned batch, with its rows as variables (for their
    /// gradients) and the model's dense parameters set from the pulled (or geo's local) values.
    fn forward(&mut self, pulled: &[PulledRows], training: bool) -> Result<(PlannedBatch, Vec<Var>, Tensor)> {
        let planned = self
            .planned
            .pop_front()
            .context("a batch was run before it was planned")?;
        let rows = self.gather(&planned, pulled, training)?;
        let dense = self.dense_values(pulled, training)?;
        self.set_dense(&dense)?;
        let row_vars = rows
            .iter()
            .enumerate()
            .map(|(table, values)| {
                let shape = (self.unique(&planned, table).len(), self.widths[table]);
                Var::from_tensor(&Tensor::from_slice(values, shape, &self.device)?)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let batch = &planned.batch;
        let dense_in = Tensor::from_slice(
            &batch.dense,
            (batch.len, batch.dense.len() / batch.len.max(1)),
            &self.device,
        )?;
        let indexes = planned
            .groups
            .iter()
            .map(|g| Tensor::from_slice(&g.index, g.index.len(), &self.device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let segments = (planned.groups.iter())
            .map(|g| match g.segments.is_empty() {
                true => Ok(None),
                false => Tensor::from_slice(&g.segments, g.segments.len(), &self.device).map(Some),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let lookups: Vec<Lookup> = row_vars
            .iter()
            .zip(&self.group_of)
            .map(|(rows, &group)| Lookup {
                rows: rows.as_tensor(),
                index: &indexes[group],
                segments: segments[group].as_ref(),
                slots: planned.groups[group].slot_count,
            })
            .collect();
        let logits = self.model.logits(&dense_in, &lookups)?;
        Ok((planned, row_vars, logits))
    }

    /// Per table, the rows of the batch's unique ids (`unique × width`), from the pulled
    /// answers or, in geo mode while training, from the local copies (which take in the
    /// pulled rows).
    fn gather(&mut self, planned: &PlannedBatch, pulled: &[PulledRows], training: bool) -> Result<Vec<Vec<f32>>> {
        ensure!(
            pulled.len() == self.server_num,
            "answers from {} shards, expected {}",
            pulled.len(),
            self.server_num
        );
        let mut tables = Vec::with_capacity(self.widths.len());
        for (table, &width) in self.widths.iter().enumerate() {
            let unique = self.unique(planned, table);
            let mut rows = vec![0.0f32; unique.len() * width];
            for (u, slot) in planned.slots[table].iter().enumerate() {
                let out = &mut rows[u * width..(u + 1) * width];
                match slot {
                    Some((shard, k)) => {
                        let answer = &pulled[*shard].rows[table];
                        let row = answer.get(k * width..(k + 1) * width).with_context(|| {
                            format!(
                                "shard {shard} sent {} values for table {table}, too few for row {k}",
                                answer.len()
                            )
                        })?;
                        out.copy_from_slice(row);
                    }
                    None => {
                        let geo = self.geo.as_ref().context("a row is local outside geo mode")?;
                        let copy = geo.rows[table].get(&unique[u]).context("a local row vanished")?;
                        out.copy_from_slice(&copy[..width]);
                    }
                }
            }
            if let Some(geo) = self.geo.as_mut().filter(|_| training) {
                for (u, slot) in planned.slots[table].iter().enumerate() {
                    if slot.is_some() {
                        let row = &rows[u * width..(u + 1) * width];
                        geo.rows[table].insert(unique[u], [row, row].concat());
                    }
                }
            }
            tables.push(rows);
        }
        Ok(tables)
    }

    /// The full dense parameter vector: the shards' slices joined, or geo's local copy.
    fn dense_values(&mut self, pulled: &[PulledRows], training: bool) -> Result<Vec<f32>> {
        if let Some((local, _)) = self.geo.as_ref().filter(|_| training).and_then(|g| g.dense.as_ref()) {
            return Ok(local.clone());
        }
        let dense: Vec<f32> = pulled.iter().flat_map(|p| p.dense.iter().copied()).collect();
        ensure!(
            dense.len() == self.dense_len,
            "the shards sent {} dense values, the model has {}",
            dense.len(),
            self.dense_len
        );
        if let Some(geo) = self.geo.as_mut().filter(|_| training) {
            geo.dense = Some((dense.clone(), dense.clone()));
        }
        Ok(dense)
    }

    fn set_dense(&self, values: &[f32]) -> Result<()> {
        let mut offset = 0;
        for var in &self.dense_vars {
            let n = var.elem_count();
            let tensor = Tensor::from_slice(&values[offset..offset + n], var.shape(), &self.device)?;
            var.set(&tensor)?;
            offset += n;
        }
        Ok(())
    }

    /// Sync and async: the step's gradients, each row to the shard it lives on.
    fn split_gradients(&self, planned: &PlannedBatch, row_grads: &[Vec<f32>], dense_grad: &[f32]) -> Vec<ShardUpdate> {
        let mut updates = self.empty_updates(dense_grad);
        let counts = self.shows_and_clicks(planned);
        for (table, &width) in self.widths.iter().enumerate() {
            for (u, &id) in self.unique(planned, table).iter().enumerate() {
                let shard = shard_of(table, id, self.server_num);
                updates[shard].ids[table].push(id);
                updates[shard].values[table].extend_from_slice(&row_grads[table][u * width..(u + 1) * width]);
                if let Some(counts) = self.table_counts(&counts, table) {
                    updates[shard].counts[table].extend_from_slice(&counts[u]);
                }
            }
        }
        updates
    }

    /// Geo: one local SGD step on the local copies; every `k_steps` steps, the deltas since the
    /// last push, after which the copies are dropped and pulled fresh.
    fn geo_step(
        &mut self,
        planned: &PlannedBatch,
        row_grads: &[Vec<f32>],
        dense_grad: &[f32],
    ) -> Result<Option<Vec<ShardUpdate>>> {
        let by_group = self.shows_and_clicks(planned);
        let counts: Vec<Option<&[[f32; 2]]>> = (0..self.widths.len())
            .map(|t| self.table_counts(&by_group, t))
            .collect();
        let uniques: Vec<&[u64]> = (0..self.widths.len()).map(|t| self.unique(planned, t)).collect();
        let geo = self.geo.as_mut().context("geo step outside geo mode")?;
        for (table, &width) in self.widths.iter().enumerate() {
            let optimizer = self.row_optimizers[table];
            for (u, id) in uniques[table].iter().enumerate() {
                if let Some(counts) = counts[table] {
                    let sum = geo.counts[table].entry(*id).or_default();
                    sum[0] += counts[u][0];
                    sum[1] += counts[u][1];
                }
                let copy = geo.rows[table].get_mut(id).context("a local row vanished")?;
                let state = geo.row_state[table].entry(*id).or_insert_with(|| {
                    let mut state = vec![0.0; optimizer.state_len(width)];
                    optimizer.init_state(&mut state);
                    state
                });
                optimizer.apply(&mut copy[..width], state, &row_grads[table][u * width..(u + 1) * width]);
            }
        }
        let (local, _) = geo.dense.as_mut().context("geo dense copy missing")?;
        self.dense_optimizer.apply(local, &mut geo.dense_state, dense_grad);
        geo.steps_since_push += 1;
        if geo.steps_since_push < geo.k_steps {
            return Ok(None);
        }
        self.flush()
    }

    /// Geo: the deltas of the local steps not pushed yet (`None` if there are none, and always
    /// outside geo mode); the local copies are dropped, to be pulled fresh.
    pub fn flush(&mut self) -> Result<Option<Vec<ShardUpdate>>> {
        let Some(geo) = self.geo.as_mut().filter(|g| g.steps_since_push > 0) else {
            return Ok(None);
        };
        geo.steps_since_push = 0;
        let (local, base) = geo.dense.take().context("geo dense copy missing")?;
        let dense_delta: Vec<f32> = local.iter().zip(&base).map(|(l, b)| l - b).collect();
        let rows = std::mem::replace(&mut geo.rows, vec![FxHashMap::default(); self.widths.len()]);
        let counts = std::mem::replace(&mut geo.counts, vec![FxHashMap::default(); self.widths.len()]);
        let mut updates = self.empty_updates(&dense_delta);
        for (table, (copies, &width)) in rows.into_iter().zip(&self.widths).enumerate() {
            let mut copies: Vec<(u64, Vec<f32>)> = copies.into_iter().collect();
            copies.sort_unstable_by_key(|(id, _)| *id);
            for (id, copy) in copies {
                let shard = shard_of(table, id, self.server_num);
                updates[shard].ids[table].push(id);
                let (local, base) = copy.split_at(width);
                updates[shard].values[table].extend(local.iter().zip(base).map(|(l, b)| l - b));
                if self.counted[table] {
                    updates[shard].counts[table].extend(counts[table].get(&id).copied().unwrap_or_default());
                }
            }
        }
        Ok(Some(updates))
    }

    /// Geo: the trainer's own state at a checkpoint — its local optimizer's state of every row
    /// and of the dense parameters (the copies themselves were just pushed and dropped: a geo
    /// checkpoint falls on a push). `None` outside geo mode, where a trainer holds no state.
    pub fn own_state(&self) -> Result<Option<Vec<u8>>> {
        let Some(geo) = &self.geo else {
            return Ok(None);
        };
        ensure!(
            geo.steps_since_push == 0,
            "a geo trainer's checkpoint falls between pushes ({} local steps not pushed)",
            geo.steps_since_push
        );
        let rows = geo
            .row_state
            .iter()
            .map(|table| {
                let mut rows: Vec<(u64, Vec<f32>)> = table.iter().map(|(id, s)| (*id, s.clone())).collect();
                rows.sort_unstable_by_key(|(id, _)| *id);
                rows
            })
            .collect();
        let state = GeoState {
            rows,
            dense: geo.dense_state.clone(),
        };
        Ok(Some(
            postcard::to_stdvec(&state).context("encoding a geo trainer's state")?,
        ))
    }

    /// Geo: takes back the state [`CtrWorker::own_state`] made.
    pub fn restore_own_state(&mut self, bytes: &[u8]) -> Result<()> {
        let geo = self
            .geo
            .as_mut()
            .context("only a geo trainer keeps a state of its own")?;
        let state: GeoState = postcard::from_bytes(bytes).context("a geo trainer's state file is malformed")?;
        ensure!(
            state.rows.len() == geo.row_state.len() && state.dense.len() == geo.dense_state.len(),
            "a geo trainer's state holds {} tables and {} dense values; the job has {} and {}",
            state.rows.len(),
            state.dense.len(),
            geo.row_state.len(),
            geo.dense_state.len()
        );
        geo.row_state = state.rows.into_iter().map(|rows| rows.into_iter().collect()).collect();
        geo.dense_state = state.dense;
        geo.steps_since_push = 0;
        geo.rows = vec![FxHashMap::default(); self.widths.len()];
        geo.dense = None;
        Ok(())
    }

    /// One update per shard holding its slice of `dense` and no rows yet.
    fn empty_updates(&self, dense: &[f32]) -> Vec<ShardUpdate> {
        (0..self.server_num)
            .map(|shard| ShardUpdate {
                ids: vec![Vec::new(); self.widths.len()],
                values: vec![Vec::new(); self.widths.len()],
                counts: vec![Vec::new(); self.widths.len()],
                dense: dense[dense_range(self.dense_len, shard, self.server_num)].to_vec(),
            })
            .collect()
    }
}
