//! The training state of a replica (or of a pipeline stage) as one safetensors file, which is a
//! model file ([`crate::models::export`]) of its parameters — each under its model name, in
//! PyTorch's layout, the model's description in the metadata — with the optimizer's slots as
//! `optimizer.<name>.<slot>` (in their parameter's layout) and, in the metadata, the optimizer's
//! kind, its update counter, the batches trained, the losses seen so far (so a resumed run
//! reports the whole run) and, for data streamed from files, where every rank's parts of it were
//! (so a resumed run seeks there instead of reading its way back). Restoring it makes the
//! following steps those of the run that saved it, bit for bit.

use std::collections::HashMap;
use std::io::Write;

use crate::checkpoint::{write_tensors, LAYER_PARTS, SHARDING_STAGE};
use crate::data::DataPosition;
use crate::engines::comm::Communicator;
use crate::models::export::{from_torch_layout, in_torch_layout, ModelInfo, OPTIMIZER_PREFIX};
use crate::models::NamedParam;
use crate::optim::OptimizerState;
use anyhow::{bail, ensure, Context, Result};

/// The metadata key that marks a model file as a training state.
const OPTIMIZER: &str = "optimizer";

/// Metadata of a state merged from a pipeline's stages ([`merge_stages`]): it holds the whole
/// model, of which a stage of another cut restores its own parameters.
const WHOLE_MODEL: &str = "whole_model";

/// An optimizer's state as a training state file holds it.
pub struct SavedOptimizer {
    /// Its kind ([`crate::optim::Optimizer::name`]).
    pub kind: &'static str,
    /// Its whole state, by parameter.
    pub state: OptimizerState,
    /// The sharding stage it was gathered from, when it was sharded.
    pub sharding_stage: Option<u8>,
}

/// The metadata key of the streamed data's position.
const DATA_POSITION: &str = "data_position";

/// What a run carries besides its model and optimizer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunRecord {
    /// The loss of every step, as the saving rank saw them (empty where it sees none).
    pub losses: Vec<f32>,
    /// Where every part of the data streamed from files is (`None` for rows in memory).
    pub data: Option<DataPosition>,
}

/// What a restored state says about the run so far.
#[derive(Debug, Clone, PartialEq)]
pub struct Restored {
    /// Batches trained.
    pub batches: usize,
    /// The losses and the data position saved with it.
    pub run: RunRecord,
}

/// Every rank's `mine` joined over `comm`: where each part of the streamed data is, whichever
/// rank reads it.
pub fn join_data_positions(comm: &mut Communicator, mine: &[u8]) -> Result<DataPosition> {
    let mut joined = DataPosition::default();
    for (rank, bytes) in comm.all_gather_sized("the data positions", mine)?.iter().enumerate() {
        let position: DataPosition =
            serde_json::from_slice(bytes).with_context(|| format!("rank {rank}'s data position"))?;
        joined.merge(position);
    }
    Ok(joined)
}

/// Writes `params` (by name, `info` describing their model), the state of their optimizer (of
/// kind `optimizer`, by parameter), `batches` (batches trained so far) and `run` to `out` as a
/// safetensors file; `layer_parts` ranks split the layers the file holds whole (1: none).
pub fn write(
    out: &mut dyn Write,
    params: &[NamedParam],
    info: &ModelInfo,
    optimizer: SavedOptimizer,
    (batches, layer_parts): (usize, usize),
    run: &RunRecord,
) -> Result<()> {
    let SavedOptimizer {
        kind,
        state,
        sharding_stage,
    } = optimizer;
    let mut tensors = Vec::with_capacity(params.len() + state.tensors.len());
    for p in params {
        tensors.push((p.name.clone(), in_torch_layout(p, p.param.var()?.as_tensor())?));
    }
    for (index, slot, tensor) in state.tensors {
        let p = params
            .get(index)
            .context("optimizer state of a parameter the replica lacks")?;
        tensors.push((
            format!("{OPTIMIZER_PREFIX}{}.{slot}", p.name),
            in_torch_layout(p, &tensor)?,
        ));
    }
    let header = StateHeader {
        kind,
        optimizer_steps: state.steps,
        sharding_stage,
        batches,
        layer_parts,
    };
    let metadata = header.metadata(info, run)?;
    write_tensors(out, &tensors, metadata)
}

/// What a training state's metadata says besides the model's description and the run record.
pub struct StateHeader {
    /// The optimizer's kind ([`crate::optim::Optimizer::name`]).
    pub kind: &'static str,
    /// Its update count.
    pub optimizer_steps: u64,
    /// The sharding stage the state was gathered from, when it was sharded.
    pub sharding_stage: Option<u8>,
    /// Batches trained.
    pub batches: usize,
    /// Ranks that split the layers the file holds whole (1: none).
    pub layer_parts: usize,
}

impl StateHeader {
    /// The file's metadata: `info`'s (the model's), this header's and `run`'s.
    pub fn metadata(&self, info: &ModelInfo, run: &RunRecord) -> Result<HashMap<String, String>> {
        // Bit patterns, so that a NaN loss survives too.
        let loss_bits: Vec<u32> = run.losses.iter().map(|l| l.to_bits()).collect();
        let mut metadata = info.metadata()?;
        metadata.extend([
            (OPTIMIZER.to_string(), self.kind.to_string()),
            ("optimizer_steps".to_string(), self.optimizer_steps.to_string()),
            ("batches".to_string(), self.batches.to_string()),
            ("loss_bits".to_string(), serde_json::to_string(&loss_bits)?),
        ]);
        if let Some(data) = &run.data {
            metadata.insert(DATA_POSITION.to_string(), serde_json::to_string(data)?);
        }
        if let Some(stage) = self.sharding_stage {
            metadata.insert(SHARDING_STAGE.to_string(), stage.to_string());
        }
        if self.layer_parts > 1 {
            metadata.insert(LAYER_PARTS.to_string(), self.layer_parts.to_string());
        }
        Ok(metadata)
    }
}

/// The metadata of a training state, which must be one.
fn training_metadata(bytes: &[u8]) -> Result<HashMap<String, String>> {
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).context("not a safetensors file")?;
    let metadata = header.metadata().clone().unwrap_or_default();
    ensure!(
        metadata.contains_key(OPTIMIZER),
        "not a training state file (its metadata names no optimizer)"
    );
    Ok(metadata)
}

/// The training state of the whole model from `stages`, the files of a pipeline's stages in
/// stage order (a checkpoint written with another cut): every parameter and optimizer slot
/// under its model name, the losses of the stage that saw them. The stages must agree on the
/// optimizer and the steps taken.
pub fn merge_stages(stages: &[Vec<u8>]) -> Result<Vec<u8>> {
    // Views into the files, copied once into the merged one: no tensor is decoded.
    let mut tensors = Vec::new();
    let mut merged: Option<HashMap<String, String>> = None;
    for (stage, bytes) in stages.iter().enumerate() {
        let file = safetensors::SafeTensors::deserialize(bytes).with_context(|| format!("stage {stage}'s file"))?;
        let metadata = training_metadata(bytes).with_context(|| format!("stage {stage}'s file"))?;
        let meta = |key: &str| metadata.get(key).cloned().unwrap_or_default();
        match &mut merged {
            None => merged = Some(metadata.clone()),
            Some(first) => {
                for key in [OPTIMIZER, "optimizer_steps", "batches"] {
                    let (was, is) = (first.get(key).cloned().unwrap_or_default(), meta(key));
                    ensure!(
                        was == is,
                        "the stages disagree on {key}: stage 0 has {was}, stage {stage} {is}"
                    );
                }
                // The losses are those of the stage that computed them, the last.
                if meta("loss_bits").len() > first.get("loss_bits").map_or(0, String::len) {
                    first.insert("loss_bits".to_string(), meta("loss_bits"));
                }
            }
        }
        tensors.extend(file.tensors());
    }
    let mut metadata = merged.context("a pipeline checkpoint without stage files")?;
    metadata.insert(WHOLE_MODEL.to_string(), "true".to_string());
    Ok(safetensors::serialize(tensors, Some(metadata))?)
}

/// Loads bytes written by [`write()`] into `params` and, through `load`, into their optimizer
/// of kind `optimizer` (its state by parameter). A file of another model (a parameter missing,
/// extra or of another shape) or of another optimizer is refused by name before anything
/// changes, as is a state `load` refuses; of a whole model ([`merge_stages`]), the parameters of
/// other stages are left.
pub fn restore(
    bytes: &[u8],
    params: &[NamedParam],
    optimizer: &str,
    load: impl FnOnce(OptimizerState) -> Result<()>,
) -> Result<Restored> {
    // Views into the bytes: only the tensors this model holds are decoded (a whole model's file
    // holds every stage's).
    let file = safetensors::SafeTensors::deserialize(bytes).context("not a safetensors file")?;
    let metadata = training_metadata(bytes)?;
    let meta = |key: &str| {
        metadata
            .get(key)
            .with_context(|| format!("the training state has no {key:?} entry"))
    };
    let kind = meta(OPTIMIZER)?;
    ensure!(
        kind == optimizer,
        "the checkpoint holds {kind} state, this job trains with {optimizer}"
    );
    let steps: u64 = meta("optimizer_steps")?.parse().context("optimizer_steps")?;
    let batches: usize = meta("batches")?.parse().context("batches")?;
    let loss_bits: Vec<u32> = serde_json::from_str(meta("loss_bits")?).context("loss_bits")?;
    let data = metadata
        .get(DATA_POSITION)
        .map(|text| serde_json::from_str(text).context(DATA_POSITION))
        .transpose()?;
    let whole_model = metadata.contains_key(WHOLE_MODEL);

    let mut values = Vec::with_capacity(params.len());
    for p in params {
        let view = file
            .tensor(&p.name)
            .ok()
            .with_context(|| format!("the checkpoint has no parameter {}", p.name))?;
        values.push(from_torch_layout(p, &view, &format!("parameter {}", p.name))?);
    }
    let index: HashMap<&str, usize> = params.iter().enumerate().map(|(i, p)| (p.name.as_str(), i)).collect();
    let mut state = OptimizerState {
        steps,
        tensors: Vec::new(),
    };
    for key in file.names() {
        let Some(slot_key) = key.strip_prefix(OPTIMIZER_PREFIX) else {
            ensure!(
                whole_model || index.contains_key(key),
                "the checkpoint has {key}, which this model does not know"
            );
            continue;
        };
        let Some((name, slot)) = slot_key.rsplit_once('.') else {
            bail!("the checkpoint has {key}, which this model does not know");
        };
        let Some(&i) = index.get(name) else {
            if whole_model {
                continue;
            }
            bail!("the checkpoint has optimizer state of {name}, which this model does not have");
        };
        let value = from_torch_layout(&params[i], &file.tensor(key)?, &format!("optimizer slot {key}"))?;
        state.tensors.push((i, slot.to_string(), value));
    }
    load(state)?;
    for (p, value) in params.iter().zip(values) {
        p.param.set(&value)?;
    }
    Ok(Restored {
        batches,
        run: RunRecord {
            losses: loss_bits.into_iter().map(f32::from_bits).collect(),
            data,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{OptimizerKind, TrainConfig};
    use crate::models::export::ModelFile;
    use crate::models::{mlp, Model, ParamInit};
    use crate::optim::Optimizer;
    use candle_core::backprop::GradStore;
    use candle_core::{Device, Tensor};

    /// A model, its AdamW optimizer after one step (so every slot is set), and its state file.
    fn trained(seed: u64) -> Result<(Model, Optimizer, Vec<u8>)> {
        let model = mlp(3, &[4], 2, &ParamInit::new(seed, Device::Cpu))?;
        let train = TrainConfig {
            optimizer: OptimizerKind::Adamw,
            ..TrainConfig::default()
        };
        let params = model.parameters();
        let mut optimizer = Optimizer::new(
            &train,
            params
                .iter()
                .map(|p| p.param.var())
                .collect::<candle_core::Result<_>>()?,
            0.1,
        )?;
        step(&model, &mut optimizer)?;
        let info = ModelInfo {
            loss: Some("mse".to_string()),
            ..ModelInfo::default()
        };
        let mut bytes = Vec::new();
        let run = RunRecord {
            losses: vec![0.5],
            data: None,
        };
        let saved = SavedOptimizer {
            kind: optimizer.name(),
            state: optimizer.state()?,
            sharding_stage: None,
        };
        write(&mut bytes, &params, &info, saved, (1, 1), &run)?;
        Ok((model, optimizer, bytes))
    }

    fn step(model: &Model, optimizer: &mut Optimizer) -> Result<GradStore> {
        let x = Tensor::new(&[[0.5f32, -1.0, 2.0], [1.0, 0.25, -0.5]], &Device::Cpu)?;
        let grads = model.forward(&x)?.sqr()?.sum_all()?.backward()?;
        optimizer.step(&grads)?;
        Ok(grads)
    }

    fn values(model: &Model) -> Result<Vec<Vec<f32>>> {
        let params = model.parameters();
        Ok(params
            .iter()
            .map(|p| p.param.var()?.flatten_all()?.to_vec1::<f32>())
            .collect::<candle_core::Result<_>>()?)
    }

    #[test]
    fn the_state_is_a_model_file_in_pytorch_layout_with_the_optimizer_beside() -> Result<()> {
        let (model, _, bytes) = trained(3)?;
        let file = safetensors::SafeTensors::deserialize(&bytes)?;
        // nn.Linear's (out, in), for the parameter and for its slots alike.
        assert_eq!(file.tensor("fc0.weight")?.shape(), [4, 3]);
        assert_eq!(file.tensor("optimizer.fc0.weight.m")?.shape(), [4, 3]);
        assert_eq!(file.tensor("optimizer.fc1.bias.v")?.shape(), [2]);
        // As a model file it loads into the model by name, the slots set aside.
        let fresh = mlp(3, &[4], 2, &ParamInit::new(9, Device::Cpu))?;
        ModelFile::parse(&bytes)?.load_into(&fresh)?;
        assert_eq!(values(&fresh)?, values(&model)?);
        Ok(())
    }

    #[test]
    fn a_restored_state_steps_on_bit_for_bit() -> Result<()> {
        let (model, mut optimizer, bytes) = trained(3)?;
        let (other, mut other_optimizer, _) = trained(4)?;
        let restored = restore(&bytes, &other.parameters(), "adamw", |state| {
            Ok(other_optimizer.load_state(state)?)
        })?;
        assert_eq!(
            restored,
            Restored {
                batches: 1,
                run: RunRecord {
                    losses: vec![0.5],
                    data: None
                }
            }
        );
        step(&model, &mut optimizer)?;
        step(&other, &mut other_optimizer)?;
        assert_eq!(values(&other)?, values(&model)?);
        // A model of another shape is refused by the parameter, and keeps its values.
        let wider = mlp(3, &[5], 2, &ParamInit::new(4, Device::Cpu))?;
        let before = values(&wider)?;
        let err = restore(&bytes, &wider.parameters(), "adamw", |state| {
            Ok(other_optimizer.load_state(state)?)
        })
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("parameter fc0.bias: the file's is F32 [4], the model's F32 [5]"),
            "{err:#}"
        );
        assert_eq!(values(&wider)?, before);
        Ok(())
    }
}
