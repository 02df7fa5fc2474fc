//! The training state of a replica (or of a pipeline stage) as one safetensors file: every
//! parameter as `param.<name>`, every optimizer slot as `optimizer.<name>.<slot>`, and in the
//! metadata the optimizer's kind, its update counter and the batches trained. Restoring it
//! makes the following steps those of the run that saved it, bit for bit.

use std::collections::HashMap;

use anyhow::{bail, ensure, Context, Result};
use candle_core::Device;

use crate::checkpoint::{decode_tensors, encode_tensors};
use crate::models::NamedParam;
use crate::optim::{Optimizer, OptimizerState};

const FORMAT: &str = "flotilla-training-state";

/// `params`, `optimizer`'s state and `batches` (batches trained so far) as safetensors bytes.
pub fn encode(params: &[NamedParam], optimizer: &Optimizer, batches: usize) -> Result<Vec<u8>> {
    let state = optimizer.state()?;
    let mut tensors = Vec::with_capacity(params.len() + state.tensors.len());
    for p in params {
        tensors.push((format!("param.{}", p.name), p.var.as_tensor().clone()));
    }
    for (index, slot, tensor) in state.tensors {
        let param = params
            .get(index)
            .context("optimizer state of a parameter the replica lacks")?;
        tensors.push((format!("optimizer.{}.{slot}", param.name), tensor));
    }
    let metadata = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("optimizer".to_string(), optimizer.name().to_string()),
        ("optimizer_steps".to_string(), state.steps.to_string()),
        ("batches".to_string(), batches.to_string()),
    ]);
    encode_tensors(&tensors, metadata)
}

/// Loads bytes written by [`encode`] into `params` and `optimizer`; returns the batches trained.
/// A file of another model (a parameter missing, extra or of another shape) or of another
/// optimizer is refused by name before anything changes.
pub fn restore(bytes: &[u8], params: &[NamedParam], optimizer: &mut Optimizer, device: &Device) -> Result<usize> {
    let (mut tensors, metadata) = decode_tensors(bytes, device)?;
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

    let mut values = Vec::with_capacity(params.len());
    for p in params {
        let key = format!("param.{}", p.name);
        let value = tensors
            .remove(&key)
            .with_context(|| format!("the checkpoint has no parameter {}", p.name))?;
        ensure!(
            value.dims() == p.var.dims(),
            "parameter {}: the checkpoint's shape is {:?}, the model's {:?}",
            p.name,
            value.dims(),
            p.var.dims()
        );
        values.push(value);
    }
    let index: HashMap<&str, usize> = params.iter().enumerate().map(|(i, p)| (p.name.as_str(), i)).collect();
    let mut state = OptimizerState {
        steps,
        tensors: Vec::with_capacity(tensors.len()),
    };
    for (key, tensor) in tensors {
        let Some((name, slot)) = key.strip_prefix("optimizer.").and_then(|k| k.rsplit_once('.')) else {
            bail!("the checkpoint has {key}, which this model does not know");
        };
        let Some(&i) = index.get(name) else {
            bail!("the checkpoint has optimizer state of {name}, which this model does not have");
        };
        state.tensors.push((i, slot.to_string(), tensor));
    }
    optimizer.load_state(state)?;
    for (p, value) in params.iter().zip(values) {
        p.var.set(&value)?;
    }
    Ok(batches)
}
