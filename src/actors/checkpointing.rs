//! The commit half of the checkpoint protocol, shared by every role: each rank hands rank 0
//! the records of the files it wrote for a step, at a gather; rank 0 commits the manifest once
//! all have arrived, so a checkpoint exists only when every role's files do.

use anyhow::{Context, Result};
use bytes::Bytes;

use crate::checkpoint::{CheckpointStore, FileRecord};
use crate::net::ControlBus;

/// Rank `rank` acknowledges step `step`'s checkpoint with the `written` files; on rank 0 this
/// returns after the commit.
pub(crate) async fn acknowledge(
    bus: &mut ControlBus,
    rank: usize,
    world_size: usize,
    store: &CheckpointStore,
    step: usize,
    written: &[FileRecord],
) -> Result<()> {
    let part = Bytes::from(serde_json::to_vec(written)?);
    let parts = bus.gather(rank, &format!("checkpoint of step {step}"), part).await?;
    if rank != 0 {
        return Ok(());
    }
    let mut files = Vec::new();
    for (from, part) in parts.iter().enumerate() {
        let records: Vec<FileRecord> =
            serde_json::from_slice(part).with_context(|| format!("rank {from}'s checkpoint acknowledgement"))?;
        files.extend(records);
    }
    store.commit(step, world_size, files)
}
