//! The training state of a replica (or of a pipeline stage) as one safetensors file: every
//! parameter as `param.<name>`, every optimizer slot as `optimizer.<name>.<slot>`, and in the
//! metadata the optimizer's kind, its update counter, the batches trained and the losses seen so
//! far (so a resumed run reports the whole run). Restoring it makes the following steps those
//! of the run that saved it, bit for bit.

use std::collections::HashMap;
use std::io::Write;

use anyhow::{bail, ensure, Context, Result};
use candle_core::safetensors::Load;
use candle_core::{Device, Var};

use crate::checkpoint::write_tensors;
use crate::optim::{Optimizer, OptimizerState};

const FORMAT: &str = "flotilla-training-state";

/// Metadata of a state merged from a pipeline's stages ([`merge_stages`]): it holds the whole
/// model, of which a stage of another cut restores its own parameters.
const WHOLE_MODEL: &str = "whole_model";

/// What a restored state says about the run so far.
#[derive(Debug, Clone, PartialEq)]
pub struct Restored {
    /// Batches trained.
    pub batches: usize,
    /// The loss of every step, as the saving rank saw them (empty where it sees none).
    pub losses: Vec<f32>,
}

/// Writes `params` (by name), `optimizer`'s state, `batches` (batches trained so far) and
/// `losses` to `out` as a safetensors file.
pub fn write(
    out: &mut dyn Write,
    params: &[(&str, &Var)],
    optimizer: &Optimizer,
    batches: usize,
    losses: &[f32],
) -> Result<()> {
    let state = optimizer.state()?;
    let mut tensors = Vec::with_capacity(params.len() + state.tensors.len());
    for (name, var) in params {
        tensors.push((format!("param.{name}"), var.as_tensor().clone()));
    }
    for (index, slot, tensor) in state.tensors {
        let (name, _) = params
            .get(index)
            .context("optimizer state of a parameter the replica lacks")?;
        tensors.push((format!("optimizer.{name}.{slot}"), tensor));
    }
    // Bit patterns, so that a NaN loss survives too.
    let loss_bits: Vec<u32> = losses.iter().map(|l| l.to_bits()).collect();
    let metadata = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("optimizer".to_string(), optimizer.name().to_string()),
        ("optimizer_steps".to_string(), state.steps.to_string()),
        ("batches".to_string(), batches.to_string()),
        ("loss_bits".to_string(), serde_json::to_string(&loss_bits)?),
    ]);
    write_tensors(out, &tensors, metadata)
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
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes)?;
        let metadata = header.metadata().clone().unwrap_or_default();
        let meta = |key: &str| metadata.get(key).cloned().unwrap_or_default();
        ensure!(meta("format") == FORMAT, "stage {stage}'s file is not a training state");
        match &mut merged {
            None => merged = Some(metadata.clone()),
            Some(first) => {
                for key in ["optimizer", "optimizer_steps", "batches"] {
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

/// The parameters of a training state ([`write`], or a whole model [`merge_stages`] made), by
/// name and flat in the model's own layout.
pub fn parameters(bytes: &[u8]) -> Result<Vec<(String, Vec<f32>)>> {
    let file = safetensors::SafeTensors::deserialize(bytes).context("not a safetensors file")?;
    let mut params = Vec::new();
    for (key, view) in file.tensors() {
        if let Some(name) = key.strip_prefix("param.") {
            let tensor = view.load(&Device::Cpu)?;
            params.push((name.to_string(), tensor.flatten_all()?.to_vec1::<f32>()?));
        }
    }
    Ok(params)
}

/// Loads bytes written by [`write`] into `params` and `optimizer`. A file of another model (a
/// parameter missing, extra or of another shape) or of another optimizer is refused by name
/// before anything changes; of a whole model ([`merge_stages`]), the parameters of other stages
/// are left.
pub fn restore(bytes: &[u8], params: &[(&str, &Var)], optimizer: &mut Optimizer, device: &Device) -> Result<Restored> {
    // Views into the bytes: only the tensors this model holds are decoded (a whole model's file
    // holds every stage's).
    let file = safetensors::SafeTensors::deserialize(bytes).context("not a safetensors file")?;
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes)?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let meta = |key: &str| {
        metadata
            .get(key)
            .with_context(|| format!("the training state has no {key:?} entry"))
    };
    ensure!(meta("format")? == FORMAT, "not a training state file");
    let kind = meta("optimizer")?;
    ensure!(
        kind == optimizer.name(),
        "the checkpoint holds {kind} state, this job trains with {}",
        optimizer.name()
    );
    let steps: u64 = meta("optimizer_steps")?.parse().context("optimizer_steps")?;
    let batches: usize = meta("batches")?.parse().context("batches")?;
    let loss_bits: Vec<u32> = serde_json::from_str(meta("loss_bits")?).context("loss_bits")?;
    let whole_model = metadata.contains_key(WHOLE_MODEL);

    let mut values = Vec::with_capacity(params.len());
    for (name, var) in params {
        let view = file
            .tensor(&format!("param.{name}"))
            .ok()
            .with_context(|| format!("the checkpoint has no parameter {name}"))?;
        ensure!(
            view.shape() == var.dims(),
            "parameter {name}: the checkpoint's shape is {:?}, the model's {:?}",
            view.shape(),
            var.dims()
        );
        values.push(view.load(device)?);
    }
    let index: HashMap<&str, usize> = params.iter().enumerate().map(|(i, (name, _))| (*name, i)).collect();
    let mut state = OptimizerState {
        steps,
        tensors: Vec::new(),
    };
    for key in file.names() {
        if let Some(name) = key.strip_prefix("param.") {
            ensure!(
                whole_model || index.contains_key(name),
                "the checkpoint has {key}, which this model does not know"
            );
            continue;
        }
        let Some((name, slot)) = key.strip_prefix("optimizer.").and_then(|k| k.rsplit_once('.')) else {
            bail!("the checkpoint has {key}, which this model does not know");
        };
        let Some(&i) = index.get(name) else {
            if whole_model {
                continue;
            }
            bail!("the checkpoint has optimizer state of {name}, which this model does not have");
        };
        state
            .tensors
            .push((i, slot.to_string(), file.tensor(key)?.load(device)?));
    }
    optimizer.load_state(state)?;
    for ((_, var), value) in params.iter().zip(values) {
        var.set(&value)?;
    }
    Ok(Restored {
        batches,
        losses: loss_bits.into_iter().map(f32::from_bits).collect(),
    })
}
