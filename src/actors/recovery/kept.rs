//! What a rank that rolls back in place keeps of its state, and where a rollback takes the state
//! from: memory, else its node's disk, else a peer that holds the same state (healing from a
//! peer). Shared by data-parallel trainers and pipeline stages.

use std::sync::Arc;
use std::time::Instant;

use actix::Addr;
use anyhow::{Context as _, Result};

use super::buddy::Buddy;
use crate::actors::device::{DeviceActor, JoinSave, RestoreCheckpoint, SaveCheckpoint, ShareState, Snapshot};
use crate::checkpoint::{CheckpointStore, CommitRecord, HeldFile};
use crate::collective::training_state::RunRecord;
use crate::engines::comm::Shared;
use crate::net::protocol::Roster;
use crate::net::ControlBus;

/// A rank's whole state after some step, as checkpoint bytes.
type State = (usize, Arc<Vec<u8>>);

/// The states a rank that rolls back in place keeps in memory: the newest committed one, and
/// the one of a checkpoint not yet committed.
#[derive(Default)]
pub(crate) struct Kept {
    committed: Option<State>,
    pending: Option<State>,
}

impl Kept {
    /// The state after `step` steps, if kept.
    pub(crate) fn at(&self, step: usize) -> Option<Arc<Vec<u8>>> {
        [&self.committed, &self.pending]
            .into_iter()
            .flatten()
            .find(|(at, _)| *at == step)
            .map(|(_, bytes)| bytes.clone())
    }

    /// The state of `step`'s checkpoint, taken before its commit.
    pub(crate) fn taken(&mut self, step: usize, state: Arc<Vec<u8>>) {
        self.pending = Some((step, state));
    }

    /// The step of the checkpoint taken and not yet committed.
    pub(crate) fn pending_step(&self) -> Option<usize> {
        self.pending.as_ref().map(|(step, _)| *step)
    }

    /// The checkpoint taken last was committed.
    pub(crate) fn committed(&mut self) {
        if let Some(pending) = self.pending.take() {
            self.committed = Some(pending);
        }
    }
}

/// How a rank writes its part of the checkpoint of one step.
pub(crate) struct RankCheckpoint<'a> {
    /// The step the checkpoint is of.
    pub(crate) step: usize,
    /// The file of the rank's state in the checkpoint.
    pub(crate) file: String,
    /// Whether this rank writes the file (one rank of those holding the same state, or of each
    /// node's).
    pub(crate) writes: bool,
    /// Whether the rank takes part in taking the state even where it writes nothing: sharded
    /// states are gathered from every rank of the ring, split layers from their groups.
    pub(crate) gathered: bool,
    /// Its device actor, which holds the state.
    pub(crate) device: &'a Addr<DeviceActor>,
    /// Where checkpoints go.
    pub(crate) store: &'a CheckpointStore,
    /// The states kept for a rollback, when the rank rolls back in place.
    pub(crate) kept: Option<&'a mut Kept>,
}

impl RankCheckpoint<'_> {
    /// Writes the state with `run`: streamed to the file tensor by tensor (no copy in memory);
    /// or, by a rank that rolls back in place, taken into memory first and kept, the kept copy
    /// written. Returns the file written (if this rank writes) and the state kept (if kept).
    pub(crate) async fn write(self, run: RunRecord) -> Result<(Option<HeldFile>, Option<Arc<Vec<u8>>>)> {
        let Some(kept) = self.kept else {
            if !self.writes {
                if self.gathered {
                    self.device.send(JoinSave).await??;
                }
                return Ok((None, None));
            }
            let save = SaveCheckpoint {
                store: self.store.clone(),
                step: self.step,
                file: self.file,
                run,
            };
            return Ok((Some(HeldFile::here(self.device.send(save).await??)), None));
        };
        let state = Arc::new(self.device.send(Snapshot { run }).await??);
        kept.taken(self.step, state.clone());
        if !self.writes {
            return Ok((None, Some(state)));
        }
        let (store, step, file, bytes) = (self.store.clone(), self.step, self.file, state.clone());
        let write = tokio::task::spawn_blocking(move || store.write(step, &file, &bytes));
        let written = write.await.context("the checkpoint writer stopped")??;
        Ok((Some(HeldFile::here(written)), Some(state)))
    }
}

/// Acknowledges `rank`'s part of `step`'s checkpoint (the `written` files) and waits for the
/// coordinator's commit; a rank that rolls back in place (`kept`) then holds the committed state
/// and, as its node's first rank, commits the node's copy in `store`.
pub(crate) async fn acknowledge_checkpoint(
    bus: &mut ControlBus,
    (rank, step): (usize, usize),
    written: Vec<HeldFile>,
    kept: Option<&mut Kept>,
    store: &CheckpointStore,
    roster: Option<&Roster>,
) -> Result<()> {
    let record = bus.acknowledge(rank, step, written).await?;
    if let Some(kept) = kept {
        kept.committed();
        commit_on_this_node(store, record, roster, rank).await?;
    }
    Ok(())
}

/// Once the coordinator committed a checkpoint (its `record`), the first rank on each node
/// commits that node's copy in `store`: every node keeps its own, and needs no shared
/// filesystem.
pub(crate) async fn commit_on_this_node(
    store: &CheckpointStore,
    record: CommitRecord,
    roster: Option<&Roster>,
    rank: usize,
) -> Result<()> {
    if !roster.is_some_and(|r| r.first_on_its_host(rank, r.members())) {
        return Ok(());
    }
    let store = store.clone();
    let commit = tokio::task::spawn_blocking(move || store.commit_held(&record));
    commit.await.context("the checkpoint committer stopped")?
}

/// How a rank comes back to the state after a step.
pub(crate) struct Restore<'a> {
    /// The rank, for the log.
    pub(crate) rank: usize,
    /// Its device actor.
    pub(crate) device: &'a Addr<DeviceActor>,
    /// What it keeps, when it rolls back in place (`None`: it does not).
    pub(crate) kept: Option<&'a mut Kept>,
    /// The rank at each place of the ring that shares the state (a pipeline stage's replicas).
    pub(crate) ring_ranks: Vec<usize>,
    /// Where the next node keeps a copy of the state, when no other node does.
    pub(crate) buddy: Option<BuddyCopy<'a>>,
}

/// A rank's file kept on the next node ([`Buddy`]).
pub(crate) struct BuddyCopy<'a> {
    pub(crate) buddy: &'a Buddy,
    pub(crate) roster: &'a Roster,
    /// The file's name in the checkpoint.
    pub(crate) name: String,
}

impl Restore<'_> {
    /// Brings the device's state to the one after `step` steps (a fresh one is step 0's) and
    /// returns the run record saved with it (the losses of those steps, where the data was). A rank that rolls back in place takes it from memory,
    /// else from `disk` (its node's copy), else from its buddy node's copy, else from the peer
    /// nearest it that holds it — every
    /// rank sharing the state takes part in that exchange, so all call this at the same step.
    /// One that does not roll back in place reads `disk`.
    pub(crate) async fn to(self, step: usize, disk: impl FnOnce() -> Result<Arc<Vec<u8>>>) -> Result<RunRecord> {
        let started = Instant::now();
        let Restore {
            rank,
            device,
            kept,
            ring_ranks,
            buddy,
        } = self;
        let Some(kept) = kept else {
            if step == 0 {
                return Ok(RunRecord::default());
            }
            return restored(rank, device, step, disk()?, "disk".to_string(), started).await;
        };
        if step == 0 {
            // A fresh state is step 0's, kept to roll back to until a checkpoint is committed. A
            // rank that held it returns to it; then every rank takes it anew, together: the
            // snapshot gathers sharded states and split layers from the ranks holding them, a
            // replacement's (whose state is fresh) among them.
            let run = match kept.at(0) {
                Some(bytes) => restored(rank, device, step, bytes, "memory".to_string(), started).await?,
                None => RunRecord::default(),
            };
            let initial = device.send(Snapshot { run: run.clone() }).await??;
            kept.committed = Some((0, Arc::new(initial)));
            return Ok(run);
        }
        let local = match kept.at(step) {
            Some(bytes) => Some((bytes, "memory".to_string())),
            None => match disk() {
                Ok(bytes) => Some((bytes, "disk".to_string())),
                Err(e) => {
                    tracing::info!(rank, step, "not on this node's disk: {e:#}");
                    match buddy {
                        Some(copy) => match copy.buddy.fetch(copy.roster, rank, step, &copy.name).await {
                            Ok((bytes, from)) => Some((Arc::new(bytes), from)),
                            Err(e) => {
                                tracing::info!(rank, step, "no buddy copy: {e:#}");
                                None
                            }
                        },
                        None => None,
                    }
                }
            },
        };
        let mine = local.as_ref().map(|(bytes, _)| bytes.clone());
        let (bytes, from) = match device.send(ShareState { step, mine }).await?? {
            Shared::Held => local.context("a rank without the state was told it held it")?,
            Shared::Received { bytes, from } => (Arc::new(bytes), format!("rank {}", ring_ranks[from])),
        };
        if from != "memory" {
            kept.committed = Some((step, bytes.clone()));
        }
        restored(rank, device, step, bytes, from, started).await
    }
}

/// Restores `bytes`, the state after `step`, on `device` and says where it came from.
async fn restored(
    rank: usize,
    device: &Addr<DeviceActor>,
    step: usize,
    bytes: Arc<Vec<u8>>,
    from: String,
    started: Instant,
) -> Result<RunRecord> {
    let run = device
        .send(RestoreCheckpoint(bytes.clone()))
        .await?
        .with_context(|| format!("restoring the state after step {step} from {from}"))?;
    tracing::info!(
        rank,
        step,
        from,
        bytes = bytes.len(),
        seconds = started.elapsed().as_secs_f64(),
        "state restored"
    );
    Ok(run)
}
