//! What a rank's device thread holds, whatever the strategy: a replica of what it trains (the
//! whole model of a data-parallel rank, a pipeline rank's stage) with its optimizer and the
//! ring among the replicas holding the same parameters. The step and evaluation differ per
//! strategy; saving, restoring and sharing the state, joining data positions, the timeline and
//! reading the parameters are written here once, over what [`RankReplica::held`] lends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor, Var};
use sha2::Digest;

use super::tensor_parallel::{gather_parts, part_of};
use super::training_state::{self, RunRecord, SavedOptimizer};
use super::{checksum, ParamChecksum, ShardedStates};
use crate::data::{Batch, DataPosition, Pieces};
use crate::engines::comm::{CommWorker, Shared};
use crate::models::export::ModelInfo;
use crate::models::parallel::Group;
use crate::models::{NamedParam, NamedValues, Param, Score};
use crate::optim::{Optimizer, OptimizerState};
use crate::telemetry::timeline::{Span, Timeline};

/// One training step as a rank measured it, whatever its strategy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Mean loss over the global batch; `None` on a pipeline stage that does not hold it.
    pub loss: Option<f32>,
    /// Largest minus smallest of the replicas' losses, where the loss is held.
    pub loss_spread: Option<f32>,
    /// Learning rate of the step.
    pub lr: f64,
    /// Wall time of the step on this rank.
    pub step_time: Duration,
    /// Time the communication thread spent in the step's collectives.
    pub comm_time: Duration,
    /// The part of it compute did not hide: the time the step waited for it.
    pub exposed_comm_time: Duration,
    /// A pipeline stage's wait for its neighbours, and its schedule's time (forwards, backwards
    /// and waits, without the all-reduce and the optimizer).
    pub pipeline: Option<(Duration, Duration)>,
    /// Most micro-batch activations held at once (a pipeline's schedule; 0 elsewhere).
    pub peak_activations: usize,
    /// Most bytes of activations held for backward at once: what forward kept, plus the block
    /// outputs recomputation made again.
    pub peak_activation_bytes: usize,
    /// The largest peak resident set of the processes reported on.
    pub peak_rss_bytes: u64,
    /// Whether any rank was asked to stop (preemption): the same step on every rank.
    pub stop_asked: bool,
}

/// The bytes of state a rank holds between steps: its parameters, the averaged gradients its
/// optimizer steps on, and the optimizer's state (a sharded optimizer's copy of the parameters it
/// updates included).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StateBytes {
    /// Parameters.
    pub parameters: usize,
    /// Averaged gradients.
    pub gradients: usize,
    /// Optimizer state.
    pub optimizer: usize,
}

/// What a replica lends the calls written once for all: its parameters, optimizer, batches
/// trained, the ring among the replicas of the same parameters, and its timeline.
pub struct Held<'a> {
    /// The parameters, in model (or stage) order.
    pub params: &'a [NamedParam],
    /// Their optimizer.
    pub optimizer: HeldOptimizer<'a>,
    /// Batches trained.
    pub step: &'a mut usize,
    /// The ring among the replicas holding the same parameters.
    pub ring: &'a CommWorker,
    /// The ranks that split the layers with this one (tensor parallelism; alone, none do).
    pub layers: &'a Group,
    /// Spans recorded, when tracing.
    pub timeline: &'a mut Option<Timeline>,
}

/// A replica's optimizer, over the whole parameters or over this rank's shards of them.
pub enum HeldOptimizer<'a> {
    /// Every parameter's states.
    Whole(&'a mut Optimizer),
    /// This rank's shards of them ([`ShardedStates`]).
    Sharded(&'a mut ShardedStates),
}

impl Held<'_> {
    /// The parameters and the optimizer's state by parameter as one process holds them, as a
    /// file holds them: a sharded optimizer gathers its shards over the ring, split layers
    /// their parts over the layer group, so every rank of both calls this together.
    fn whole_state(&self) -> Result<(Vec<NamedParam>, SavedOptimizer)> {
        let mut saved = match &self.optimizer {
            HeldOptimizer::Whole(optimizer) => SavedOptimizer {
                kind: optimizer.name(),
                state: optimizer.state()?,
                sharding_stage: None,
            },
            HeldOptimizer::Sharded(states) => SavedOptimizer {
                kind: states.name(),
                state: states.state(self.params, self.ring)?,
                sharding_stage: Some(states.stage().number()),
            },
        };
        let params = gather_whole(self.params, &mut saved.state.tensors, self.layers)?;
        Ok((params, saved))
    }
}

/// `params` as one process holds them, and their optimizer `slots` (by parameter index) likewise:
/// the split ones' parts gathered over `layers`, in one gather, every rank of the group calling
/// this together.
fn gather_whole(
    params: &[NamedParam],
    slots: &mut [(usize, String, Tensor)],
    layers: &Group,
) -> Result<Vec<NamedParam>> {
    let split = |index: usize| params.get(index).and_then(|p| p.split);
    let mut parts = Vec::new();
    for (index, p) in params.iter().enumerate() {
        if let Some(dim) = split(index) {
            parts.push((dim, p.param.var()?.as_tensor().clone()));
        }
    }
    for (index, _, tensor) in slots.iter() {
        if let Some(dim) = split(*index) {
            parts.push((dim, tensor.clone()));
        }
    }
    let mut whole = gather_parts(layers, parts)?.into_iter();
    let mut gathered = Vec::with_capacity(params.len());
    for p in params {
        let mut p = p.clone();
        if p.split.take().is_some() {
            let tensor = whole.next().context("a split parameter was not gathered")?;
            p.param = Param::new(Var::from_tensor(&tensor)?);
        }
        gathered.push(p);
    }
    for (index, _, tensor) in slots.iter_mut() {
        if split(*index).is_some() {
            *tensor = whole.next().context("a split optimizer slot was not gathered")?;
        }
    }
    Ok(gathered)
}

/// Stand-ins of `params` in the whole model's shapes, for the state file `bytes` (which holds
/// the whole model) to be read into: a split parameter's a variable of the shape the file gives
/// it (a vocabulary's slices may differ by one, so no rank knows the whole length alone), the
/// others the parameters themselves. Reads no values and asks no other rank, so a rank restores
/// whatever the others of its group do meanwhile.
fn whole_shaped(params: &[NamedParam], bytes: &[u8]) -> Result<Vec<NamedParam>> {
    let file = safetensors::SafeTensors::deserialize(bytes).context("not a safetensors file")?;
    params
        .iter()
        .map(|p| {
            let mut whole = p.clone();
            if let Some(dim) = whole.split.take() {
                let view = file
                    .tensor(&p.name)
                    .with_context(|| format!("the checkpoint has no parameter {}", p.name))?;
                let mut dims = view.shape().to_vec();
                if p.transposed {
                    dims.reverse();
                }
                let part = p.param.dims();
                let holds_part = dims.len() == part.len()
                    && (0..dims.len()).all(|d| {
                        if d == dim {
                            dims[d] >= part[d]
                        } else {
                            dims[d] == part[d]
                        }
                    });
                ensure!(
                    holds_part,
                    "parameter {}: the checkpoint's {dims:?} does not hold this rank's part {part:?} (split along \
                     dimension {dim})",
                    p.name
                );
                whole.param = Param::new(Var::zeros(dims, p.param.dtype(), p.param.device())?);
            }
            Ok(whole)
        })
        .collect()
}

/// `state`, read in the whole model's shapes, cut to this rank's parts of `params`.
fn state_part(mut state: OptimizerState, params: &[NamedParam], layers: &Group) -> Result<OptimizerState> {
    for (index, _, tensor) in &mut state.tensors {
        if let Some(dim) = params.get(*index).and_then(|p| p.split) {
            *tensor = part_of(layers, dim, tensor)?;
        }
    }
    Ok(state)
}

/// A rank's replica on its device thread: what differs per strategy is the step and the
/// evaluation; the rest is provided over [`RankReplica::held`].
pub trait RankReplica: Send {
    /// Lends what the provided calls work on.
    fn held(&mut self) -> Held<'_>;

    /// Holds the whole parameters where a rank keeps only its shard of them between steps
    /// (sharded parameters): gathered from the ring's ranks where `from_peers` (every rank of
    /// the ring calling together), else allocated for a restore to fill. The provided calls that
    /// read or write the parameters call it first.
    fn hold_parameters(&mut self, _from_peers: bool) -> Result<()> {
        Ok(())
    }

    /// The device the replica computes on.
    fn device(&self) -> &Device;

    /// One step on this rank's part of the global batch.
    fn train_step(&mut self, batch: &Batch) -> Result<StepReport>;

    /// The score of `share` (this replica's part of the held-out split) summed over the
    /// replicas; `None` where the rank holds no output (a pipeline stage before the last).
    fn evaluate(&mut self, share: Pieces) -> Result<Option<Score>>;

    /// The parameters (a model file's, `export` describing the model), optimizer state, batches
    /// trained and `run`, to `out` as one checkpoint file.
    fn save_state(&mut self, out: &mut dyn std::io::Write, export: &ModelInfo, run: &RunRecord) -> Result<()> {
        save_whole(self, Some(out), export, run)
    }

    /// Takes part in a save another rank writes: a sharded optimizer hands its shards over in
    /// the gather every rank of the ring joins, split layers their parts in the layer group's;
    /// nothing is serialized here.
    fn join_save(&mut self) -> Result<()> {
        save_whole(self, None, &ModelInfo::default(), &RunRecord::default())
    }

    /// Continues from a state saved by [`RankReplica::save_state`] (by the same part of any
    /// replica), as if never stopped; answers the run record it held.
    fn restore_state(&mut self, bytes: &[u8]) -> Result<RunRecord> {
        self.hold_parameters(false)?;
        let Held {
            params,
            optimizer,
            step,
            layers,
            ..
        } = self.held();
        // The file holds the whole model: read into its shapes, then cut to this rank's parts.
        let whole = whole_shaped(params, bytes)?;
        let part = |state| state_part(state, params, layers);
        let restored = match optimizer {
            HeldOptimizer::Whole(optimizer) => {
                let kind = optimizer.name();
                training_state::restore(bytes, &whole, kind, |state| Ok(optimizer.load_state(part(state)?)?))?
            }
            HeldOptimizer::Sharded(states) => {
                let kind = states.name();
                training_state::restore(bytes, &whole, kind, |state| states.load_state(part(state)?, params))?
            }
        };
        for (p, whole) in params.iter().zip(&whole) {
            if let Some(dim) = p.split {
                p.param.set(&part_of(layers, dim, whole.param.var()?.as_tensor())?)?;
            }
        }
        *step = restored.batches;
        Ok(restored.run)
    }

    /// Gives the state after step `step` — `mine`, where this rank holds it — to the replicas
    /// that lack it (healing from a peer).
    fn share_state(&mut self, step: usize, mine: Option<Arc<Vec<u8>>>) -> Result<Shared> {
        self.held()
            .ring
            .run(move |c| c.share(&format!("the state of step {step}"), mine.as_deref().map(Vec::as_slice)))
    }

    /// Every replica's `mine` joined: where each part of the streamed data is, whichever
    /// replica reads it.
    fn join_data_positions(&mut self, mine: &DataPosition) -> Result<DataPosition> {
        let mine = serde_json::to_vec(mine)?;
        self.held()
            .ring
            .run(move |c| training_state::join_data_positions(c, &mine))
    }

    /// Starts recording a timeline, measured from `origin`.
    fn trace_from(&mut self, origin: Instant) {
        *self.held().timeline = Some(Timeline::new(origin));
    }

    /// The spans recorded so far (none unless tracing).
    fn take_spans(&mut self) -> Vec<Span> {
        self.held().timeline.as_mut().map(Timeline::take).unwrap_or_default()
    }

    /// The bytes of the state this rank holds.
    fn state_bytes(&mut self) -> StateBytes {
        let held = self.held();
        let values: usize = held.params.iter().map(|p| p.param.elem_count()).sum();
        let f32_bytes = std::mem::size_of::<f32>();
        let [parameters, gradients, optimizer] = match &held.optimizer {
            HeldOptimizer::Whole(optimizer) => [values, values, values * optimizer.slots().len()],
            HeldOptimizer::Sharded(states) => states.held_values(values),
        };
        StateBytes {
            parameters: parameters * f32_bytes,
            gradients: gradients * f32_bytes,
            optimizer: optimizer * f32_bytes,
        }
    }

    /// The whole model's parameters' values by name, answered where `keep` (the rank that
    /// reports them; `None` elsewhere): split ones gathered over the layer group, sharded ones
    /// over the ring, whose ranks all call this together.
    fn parameters(&mut self, keep: bool) -> Result<Option<NamedValues>> {
        whole_parameters(self, keep)
    }

    /// What the replicas of this one's values hold alike: the whole parameters, which every rank
    /// of the ring holds.
    fn replicated(&mut self) -> Result<Replicated> {
        self.hold_parameters(true)?;
        whole_replicated(&self.held())
    }

    /// Compares the checksums of what replicas hold alike (every rank's parameters; with sharded
    /// parameters, the shards of the ranks holding the same ones); a difference stops training
    /// with an error naming the ranks that disagree with the first holding the same, and a value
    /// that is not finite with one naming this rank and the parameter.
    fn check_replicas_agree(&mut self) -> Result<ParamChecksum> {
        // One copy of the values serves both checks.
        let Replicated { key, values } = self.replicated()?;
        let mine = ParamChecksum::of_values(&values);
        let held = self.held();
        let step = *held.step;
        let mut payload = sha2::Sha256::digest(&key).to_vec();
        payload.extend(mine.0);
        let all = held
            .ring
            .run(move |c| c.all_gather(&format!("all-gather of parameter checksums at step {step}"), &payload))?;
        // After the gather, which every rank joins: one rank stopping before it would leave
        // the others waiting there.
        checksum::check_finite(held.ring.rank(), step, &values)?;
        let (keys, sums): (Vec<&[u8]>, Vec<&[u8]>) = all.iter().map(|p| p.split_at(p.len().min(32))).unzip();
        for (first, sum) in sums.iter().enumerate() {
            if keys[..first].contains(&keys[first]) {
                continue;
            }
            let diverged: Vec<String> = (first + 1..sums.len())
                .filter(|&rank| keys[rank] == keys[first] && sums[rank] != *sum)
                .map(|rank| format!("rank {rank} has {}", hex_prefix(sums[rank])))
                .collect();
            if !diverged.is_empty() {
                bail!(
                    "replicas diverged at step {step}: rank {first} has parameter checksum {}, {}",
                    hex_prefix(sum),
                    diverged.join(", ")
                );
            }
        }
        Ok(mine)
    }
}

/// [`RankReplica::save_state`] of a replica that holds the whole parameters to save them (those
/// of its layer group's parts, gathered): written to `out`, or only joined where `None`.
pub(super) fn save_whole<R: RankReplica + ?Sized>(
    replica: &mut R,
    out: Option<&mut dyn std::io::Write>,
    export: &ModelInfo,
    run: &RunRecord,
) -> Result<()> {
    replica.hold_parameters(true)?;
    let held = replica.held();
    let (params, optimizer) = held.whole_state()?;
    match out {
        Some(out) => training_state::write(out, &params, export, optimizer, (*held.step, held.layers.size()), run),
        None => Ok(()),
    }
}

/// [`RankReplica::parameters`] of a replica that holds the whole parameters to read them.
pub(super) fn whole_parameters<R: RankReplica + ?Sized>(replica: &mut R, keep: bool) -> Result<Option<NamedValues>> {
    replica.hold_parameters(true)?;
    let held = replica.held();
    let whole = gather_whole(held.params, &mut [], held.layers)?;
    if !keep {
        return Ok(None);
    }
    whole
        .into_iter()
        .map(|p| Ok((p.name, p.param.var()?.flatten_all()?.to_vec1::<f32>()?)))
        .collect::<Result<_>>()
        .map(Some)
}

/// Values replicas hold alike, and what tells their holders apart: the ranks of one `key` hold
/// the same `values` (by name).
pub struct Replicated {
    /// The same on the ranks that hold the same values (empty: every rank of the ring).
    pub key: Vec<u8>,
    /// The values, by name.
    pub values: Vec<(String, Vec<f32>)>,
}

/// Every parameter `held`, which every rank of the ring holds alike.
pub(super) fn whole_replicated(held: &Held<'_>) -> Result<Replicated> {
    Ok(Replicated {
        key: Vec::new(),
        values: checksum::values_of(held.params)?,
    })
}

fn hex_prefix(bytes: &[u8]) -> String {
    hex::encode(&bytes[..bytes.len().min(8)])
}
