//! The training state of a replica whose parameters are sharded (ZeRO stage 3), written as it is
//! gathered: the same file a replica holding the whole model writes ([`super::training_state`]),
//! every parameter and optimizer slot whole under its model name, but gathered a bucket (one
//! block) at a time and written as it arrives, so that neither the writing rank nor the others
//! ever hold the whole model or its optimizer state.

use std::io::Write;

use anyhow::Result;

use super::training_state::{RunRecord, StateHeader};
use super::ShardedStates;
use crate::checkpoint::write_header;
use crate::engines::comm::CommWorker;
use crate::models::export::{torch_dims, write_in_torch_layout, ModelInfo, OPTIMIZER_PREFIX};
use crate::models::NamedParam;

/// Writes the state of `params` (whose shards, with their optimizer's, `states` keeps) after
/// `batches` batches, `info` describing the model and `run` the run so far, to `out`; every rank
/// of `comm`'s ring calls this together, the one writing with `out`, the others with `None`.
pub(super) fn save_streamed(
    (states, params): (&ShardedStates, &[NamedParam]),
    comm: &CommWorker,
    mut out: Option<&mut dyn Write>,
    (info, run, batches): (&ModelInfo, &RunRecord, usize),
) -> Result<()> {
    let slots = states.slots_saved()?;
    let spans: Vec<_> = states.bucket_spans(params).collect();
    if let Some(out) = out.as_mut() {
        // The parameters bucket by bucket, then each slot likewise: the order they are gathered in.
        let names = std::iter::once(None).chain(slots.iter().map(Some));
        let mut entries = Vec::new();
        for slot in names {
            for &(param, _) in spans.iter().flatten() {
                let p = &params[param];
                let name = match slot {
                    None => p.name.clone(),
                    Some(slot) => format!("{OPTIMIZER_PREFIX}{}.{slot}", p.name),
                };
                entries.push((name, torch_dims(p)));
            }
        }
        let header = StateHeader {
            kind: states.name(),
            optimizer_steps: states.optimizer_steps()?,
            sharding_stage: Some(states.stage().number()),
            batches,
            layer_parts: 1,
        };
        write_header(*out, &entries, header.metadata(info, run)?)?;
    }
    let mut write = |index: usize, whole: Vec<f32>| -> Result<()> {
        if let Some(out) = out.as_mut() {
            for (param, range) in &spans[index] {
                write_in_torch_layout(*out, &params[*param], &whole[range.clone()])?;
            }
        }
        Ok(())
    };
    let what = format!("the parameters of the state of batch {batches}");
    states.each_gathered(comm, &what, |index| Ok(states.parameter_shard(index)), &mut write)?;
    for &slot in slots {
        let what = format!("optimizer slot {slot} of the state of batch {batches}");
        states.each_gathered(comm, &what, |index| states.slot_shard(index, slot), &mut write)?;
    }
    Ok(())
}
