//! What happens when a rank dies, in one place. This file: where a run starts and where it
//! saves (step 0 or a committed checkpoint, and the checkpoint directory the run writes to).
//! Beside it:
//! - `heartbeat`: a role's heartbeats to the coordinator, which carry rollback orders to the
//!   roles it does not reach as messages;
//! - [`rollback`]: a rollback order's way to the rank's actor, and from it to the training loop;
//! - `kept`: the states a rank keeps to roll back to, its checkpoint writes and commits;
//! - [`buddy`] and [`file_mirror`]: the copy of a file only one node holds, on the next node;
//! - [`faults`]: the faults a simulated cluster injects; `divergence`: a loss that is not
//!   finite stops the job;
//! - [`death_watch`]: the launcher kills a process the coordinator declared dead.
//!
//! Elsewhere, by layer: the checkpoint's content (`collective::training_state`), preemption
//! (`collective::preemption`: the replicas agree on the step to stop at), and resuming a run
//! directory (`job::resumed`).

pub mod buddy;
pub mod death_watch;
pub(crate) mod divergence;
pub mod faults;
pub mod file_mirror;
pub(crate) mod heartbeat;
pub(crate) mod kept;
pub mod rollback;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, ensure, Context as _, Result};

use crate::checkpoint::{Checkpoint, CheckpointStore};
use crate::collective::preemption::{Preempted, PreemptionWatch};
use crate::config::{JobConfig, LrScaling, PsMode, Strategy};
use crate::net::protocol::Roster;
use crate::ps::snapshot::shard_file_name;
use crate::refusal::Refusal;

/// Set (to any value) by a launcher on the processes it restarts after a failure: each resumes
/// from the newest intact checkpoint in its checkpoint directory, if there is one.
pub const RESUME_VAR: &str = "FLOTILLA_RESUME";

/// The file a data-parallel job's checkpoint holds: rank 0's replica (all replicas are equal).
pub(crate) const REPLICA_FILE: &str = "replica.safetensors";

/// The checkpoint file of pipeline stage `stage`, written by its rank in replica 0 (replicas
/// are equal).
pub(crate) fn stage_file(stage: usize) -> String {
    format!("stage-{stage}.safetensors")
}

/// The stage files of `checkpoint`, in stage order: none when it is not a pipeline's.
fn stage_files(checkpoint: &Checkpoint) -> Vec<String> {
    checkpoint.numbered_files(stage_file)
}

/// Where training starts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Resume {
    /// From step 0. A checkpoint directory that already holds an earlier run's checkpoints is
    /// refused rather than mixed with this run's.
    #[default]
    Fresh,
    /// From the newest intact checkpoint in the checkpoint directory, or from step 0
    /// when it has none or the run takes none: a launcher's restart ([`RESUME_VAR`]).
    IfAny,
    /// From the newest intact checkpoint in this checkpoint directory, which must hold one
    /// (`flotilla train --resume RUN_DIR` resumes from its run's); the run's later checkpoints
    /// go there too.
    From(PathBuf),
}

/// The checkpoints of one run: where it writes them (when `checkpoint_every` is set) and the
/// one it starts from.
#[derive(Debug, Clone, Default)]
pub(crate) struct Recovery {
    /// Where checkpoints are written; `None` when the run takes none.
    pub(crate) store: Option<CheckpointStore>,
    /// The checkpoint training continues from.
    pub(crate) start: Option<Arc<Checkpoint>>,
    /// The newest checkpoint found in the directory of a fresh start that may be a replacement
    /// ([`Self::plan_replaceable`]).
    found_fresh: Option<usize>,
}

/// Refuses to start `config`'s job from `checkpoint` when its files are cut for another layout;
/// a data-parallel job's one replica file resumes on any number of ranks, a pipeline's stage
/// files as another cut into stages, a parameter-server job's on other numbers of servers and
/// trainers (resharding).
fn check_layout(checkpoint: &Checkpoint, config: &JobConfig) -> Result<()> {
    let strategy = config.resolved_strategy();
    let pipeline_recut =
        strategy == Strategy::Pipeline && stage_files(checkpoint).len() != config.strategy.hybrid_configs.pp_degree;
    let other_ranks = checkpoint.world_size() != config.roles();
    let reshards = strategy != Strategy::ParameterServer && other_ranks;
    if strategy == Strategy::ParameterServer && other_ranks {
        // Its rows are re-hashed onto the servers there are now (their dense slices re-cut),
        // and the trainers there are now split the same global batches.
        let servers = checkpoint.numbered_files(shard_file_name).len();
        tracing::info!(
            step = checkpoint.step,
            servers_then = servers,
            trainers_then = checkpoint.world_size().saturating_sub(servers),
            servers = config.cluster.server_num,
            trainers = config.world_size(),
            "resharding: the parameter-server job continues on another layout"
        );
        return Ok(());
    }
    if reshards || pipeline_recut {
        if config.train.lr_scaling != LrScaling::None {
            return Err(Refusal::wrap(anyhow!(
                "checkpoint {} was written by {} ranks: train.lr_scaling scales the learning rate by the world \
                 size, so resuming on {} would change it; resume on {} ranks",
                checkpoint.dir.display(),
                checkpoint.world_size(),
                config.roles(),
                checkpoint.world_size()
            )));
        }
        tracing::info!(
            step = checkpoint.step,
            written_by = checkpoint.world_size(),
            ranks = config.roles(),
            stages = stage_files(checkpoint).len(),
            "resharding: the checkpoint continues on another layout"
        );
        return Ok(());
    }
    checkpoint.check_world_size(config.roles()).map_err(Refusal::wrap)
}

/// The refusal of a fresh start into `root`, which holds checkpoints up to step `step`.
fn earlier_run(root: &Path, step: usize) -> anyhow::Error {
    Refusal::wrap(anyhow!(
        "{} already holds checkpoints of an earlier run (newest: step {step}): resume it with \
         `flotilla train --resume RUN_DIR` (that run's directory), or set \
         fault_tolerance.checkpoint_dir to another directory",
        root.display()
    ))
}

impl Recovery {
    /// Where a checkpoint due now is written: only a run that takes checkpoints has one due.
    pub(crate) fn checkpoint_store(&self) -> Result<CheckpointStore> {
        self.store.clone().context("a checkpoint without a store")
    }

    /// The recovery of `config` started as `resume` says; checkpoints go to
    /// `fault_tolerance.checkpoint_dir`, by default inside `run_dir`.
    pub(crate) fn plan(config: &JobConfig, run_dir: &Path, resume: &Resume) -> Result<Self> {
        let ft = &config.fault_tolerance;
        let root = match resume {
            Resume::From(dir) => dir.clone(),
            Resume::Fresh | Resume::IfAny => ft.checkpoint_dir_of(run_dir),
        };
        let store = CheckpointStore::new(&root, ft.keep_checkpoints);
        let start = match resume {
            Resume::Fresh if ft.checkpoint_every > 0 => {
                if let Some(earlier) = store.latest()? {
                    return Err(earlier_run(&root, earlier.step));
                }
                None
            }
            Resume::Fresh => None,
            // Only a run that checkpoints owns its directory (its fresh start refused one holding
            // another run's checkpoints); one that does not restarts from step 0.
            Resume::IfAny if ft.checkpoint_every > 0 => store.latest()?,
            Resume::IfAny => None,
            Resume::From(_) => Some(store.latest()?.ok_or_else(|| {
                anyhow::anyhow!("--resume {}: no intact checkpoint there to resume from", root.display())
            })?),
        };
        match &start {
            Some(checkpoint) => {
                check_layout(checkpoint, config)?;
                tracing::info!(step = checkpoint.step, dir = %checkpoint.dir.display(), "resuming from checkpoint");
            }
            // A launcher restarted the job after a failure, or may (torchrun's agent): say what
            // that means here. No checkpoint directory yet is the first start.
            None if *resume == Resume::IfAny && ft.checkpoint_every > 0 && !root.exists() => {
                tracing::info!("no checkpoint in {} yet: training starts at step 0", root.display());
            }
            None if *resume == Resume::IfAny => {
                let why = if ft.checkpoint_every > 0 {
                    format!("none committed in {}", root.display())
                } else {
                    "fault_tolerance.checkpoint_every = 0".to_string()
                };
                tracing::warn!("no checkpoint to resume from ({why}): training starts again at step 0");
            }
            None => {}
        }
        Ok(Self {
            store: (ft.checkpoint_every > 0).then_some(store),
            start: start.map(Arc::new),
            found_fresh: None,
        })
    }

    /// The recovery of a rank of a job that recovers in place, started as `resume` says. Started
    /// fresh, it may be the replacement of a lost rank on a node whose disk kept the job's
    /// checkpoints (its node's launcher started again): the checkpoints found are refused only
    /// once the coordinator says the job is new ([`Self::check_joined`]).
    pub(crate) fn plan_replaceable(config: &JobConfig, run_dir: &Path, resume: &Resume) -> Result<Self> {
        let ft = &config.fault_tolerance;
        if *resume != Resume::Fresh || ft.checkpoint_every == 0 {
            return Self::plan(config, run_dir, resume);
        }
        let store = CheckpointStore::new(ft.checkpoint_dir_of(run_dir), ft.keep_checkpoints);
        let found = store.latest()?;
        if let Some(checkpoint) = &found {
            check_layout(checkpoint, config)?;
        }
        Ok(Self {
            store: Some(store),
            found_fresh: found.as_ref().map(|checkpoint| checkpoint.step),
            start: found.map(Arc::new),
        })
    }

    /// Refuses a fresh start into a directory holding checkpoints of an earlier run once the
    /// coordinator's roster shows the job is new (its first generation, from no checkpoint);
    /// a replacement joining a running job uses them.
    pub(crate) fn check_joined(&self, roster: &Roster) -> Result<()> {
        match (self.found_fresh, &self.store) {
            (Some(step), Some(store)) if roster.generation == 0 && roster.resume_step.is_none() => {
                Err(earlier_run(store.root(), step))
            }
            _ => Ok(()),
        }
    }

    /// The step of the checkpoint the run starts from, if any.
    pub(crate) fn start_step(&self) -> Option<usize> {
        self.start.as_ref().map(|checkpoint| checkpoint.step)
    }

    /// The first step to train of a run of `steps` steps.
    pub(crate) fn first_step(&self, steps: usize) -> Result<usize> {
        let first = self.start_step().unwrap_or(0);
        self.check_first_step(first, steps)?;
        Ok(first)
    }

    /// Refuses to continue a run of `steps` steps after step `first` (where the coordinator
    /// says training resumes) when that is past its end.
    pub(crate) fn check_first_step(&self, first: usize, steps: usize) -> Result<()> {
        let dir = self.store.as_ref().map_or_else(
            || self.start.as_ref().map(|c| c.dir.clone()).unwrap_or_default(),
            |store| store.root().to_path_buf(),
        );
        ensure!(
            first <= steps,
            "the checkpoint of step {first} in {} is past the end of this run ({steps} steps)",
            dir.display()
        );
        Ok(())
    }

    /// The committed checkpoint of step `step` (a rollback's, which the coordinator names in
    /// `roster`), written by `world_size` ranks when its files are cut per rank (`None`: they
    /// hold the whole model, and restore on any number). A copy this node wrote but never
    /// committed — every role on it was lost between the coordinator's commit and its own — is
    /// committed from the coordinator's record.
    pub(crate) fn committed(
        &self,
        step: usize,
        world_size: Option<usize>,
        roster: Option<&Roster>,
    ) -> Result<Checkpoint> {
        let store = self
            .store
            .as_ref()
            .ok_or_else(|| anyhow!("resuming at step {step}, but this run takes no checkpoints"))?;
        let checkpoint = match (store.verify(step), roster.and_then(|r| r.record.as_ref())) {
            (Ok(checkpoint), _) => checkpoint,
            (Err(never), Some(record)) if record.step == step => {
                tracing::info!(
                    step,
                    "committing this node's copy from the coordinator's record ({never:#})"
                );
                store.commit_held(record)?;
                store.verify(step)?
            }
            (Err(e), _) => return Err(e),
        };
        if let Some(world_size) = world_size {
            checkpoint.check_world_size(world_size)?;
        }
        Ok(checkpoint)
    }

    /// How many roles wrote the committed checkpoint of `step`: as the coordinator's record in
    /// `roster` says, else the checkpoint the run started from, else this node's copy.
    pub(crate) fn writers(&self, step: usize, roster: Option<&Roster>) -> Result<usize> {
        if let Some(record) = roster.and_then(|r| r.record.as_ref()).filter(|r| r.step == step) {
            return Ok(record.world_size);
        }
        match &self.start {
            Some(start) if start.step == step => Ok(start.world_size()),
            _ => Ok(self.committed(step, None, roster)?.world_size()),
        }
    }

    /// File `name` of step `step`'s committed checkpoint, from the one the run started from or
    /// this node's checkpoint directory (see [`Self::committed`]).
    pub(crate) fn read_committed(
        &self,
        step: usize,
        world_size: Option<usize>,
        roster: Option<&Roster>,
        name: &str,
    ) -> Result<Arc<Vec<u8>>> {
        let checkpoint = match &self.start {
            Some(start) if start.step == step => start.clone(),
            _ => Arc::new(self.committed(step, world_size, roster)?),
        };
        Ok(Arc::new(checkpoint.read(name)?))
    }

    /// The state of stage `stage` of a pipeline of `stages` stages after step `step` (see
    /// [`Self::read_committed`]). From the checkpoint the run started from when that was cut
    /// otherwise (another number of stages, or a data-parallel replica): the whole model, merged,
    /// of which the stage restores its own parameters.
    pub(crate) fn read_stage(
        &self,
        step: usize,
        world_size: usize,
        roster: Option<&Roster>,
        (stage, stages): (usize, usize),
    ) -> Result<Arc<Vec<u8>>> {
        match self.start.as_ref().filter(|start| start.step == step) {
            Some(start) if stage_files(start).len() != stages => Ok(Arc::new(whole_model(start)?)),
            _ => self.read_committed(step, Some(world_size), roster, &stage_file(stage)),
        }
    }

    /// A data-parallel replica's state after step `step` (see [`Self::read_committed`]); from a
    /// pipeline's checkpoint the run started from, merged from its stages.
    pub(crate) fn read_replica(&self, step: usize, roster: Option<&Roster>) -> Result<Arc<Vec<u8>>> {
        match self.start.as_ref().filter(|start| start.step == step) {
            Some(start) if !stage_files(start).is_empty() => Ok(Arc::new(whole_model(start)?)),
            _ => self.read_committed(step, None, roster, REPLICA_FILE),
        }
    }

    /// Whether a checkpoint is due after `done` steps of `steps`: every `checkpoint_every`
    /// steps, and after the last (so a finished run's training state, optimizer included,
    /// can be evaluated or trained on) where a checkpoint may fall: where a gradient merge has
    /// completed, and in geo mode where the trainers have pushed.
    pub(crate) fn due(&self, config: &JobConfig, done: usize, steps: usize) -> bool {
        let every = config.fault_tolerance.checkpoint_every;
        let last = done == steps && may_fall_after(config, done);
        self.store.is_some() && every > 0 && (done.is_multiple_of(every) || last)
    }

    /// Whether the run takes checkpoints at all.
    pub(crate) fn takes_checkpoints(&self) -> bool {
        self.store.is_some()
    }
}

/// What follows a step: its checkpoint, and whether the run stops there.
pub(crate) struct AfterStep {
    /// Take the checkpoint of the step.
    pub(crate) checkpoint: bool,
    /// The run stops after the step (preemption), with its checkpoint when it takes them.
    pub(crate) stop: Option<Preempted>,
}

/// A run's answer to being asked to stop (preemption): while alive, a first SIGTERM does not end
/// the process; once every rank has heard it (the same step on all), the run stops at the next
/// step where a checkpoint may fall, taking that checkpoint.
pub(crate) struct StopAtCheckpoint {
    _watch: Option<PreemptionWatch>,
    stopping: bool,
}

impl StopAtCheckpoint {
    /// Watching for SIGTERM when `watched`; else SIGTERM ends the process (a run whose ranks
    /// share no step).
    pub(crate) fn new(watched: bool) -> Result<Self> {
        Ok(Self {
            _watch: watched.then(PreemptionWatch::install).transpose()?,
            stopping: false,
        })
    }

    /// After `done` of `steps` steps, of which `asked` says whether the job has heard that a rank
    /// was asked to stop.
    pub(crate) fn after(
        &mut self,
        asked: bool,
        config: &JobConfig,
        recovery: &Recovery,
        done: usize,
        steps: usize,
    ) -> AfterStep {
        self.stopping |= asked;
        let stop = self.stopping && may_fall_after(config, done);
        let checkpoint = recovery.due(config, done, steps) || (stop && recovery.takes_checkpoints());
        AfterStep {
            checkpoint,
            stop: stop.then_some(Preempted {
                step: done,
                checkpointed: checkpoint,
            }),
        }
    }
}

/// Whether a checkpoint may fall after `done` steps of `config`'s job: where a gradient merge has
/// completed, and in geo mode where the trainers have pushed.
pub(crate) fn may_fall_after(config: &JobConfig, done: usize) -> bool {
    let mut granularity = config.strategy.merge_steps();
    if let (Strategy::ParameterServer, PsMode::Geo { k_steps }) =
        (config.resolved_strategy(), config.strategy.ps_mode())
    {
        granularity = granularity.max(k_steps);
    }
    done.is_multiple_of(granularity.max(1))
}

/// The whole model's state from `checkpoint`: its stages' files merged, or its replica's.
pub(crate) fn whole_model(checkpoint: &Checkpoint) -> Result<Vec<u8>> {
    let started = std::time::Instant::now();
    let mut names = stage_files(checkpoint);
    if names.is_empty() {
        names.push(REPLICA_FILE.to_string());
    }
    let files = names
        .iter()
        .map(|name| checkpoint.read(name))
        .collect::<Result<Vec<_>>>()?;
    let merged = crate::collective::training_state::merge_stages(&files)
        .with_context(|| format!("re-cutting checkpoint {}", checkpoint.dir.display()))?;
    tracing::info!(
        step = checkpoint.step,
        files = names.len(),
        bytes = merged.len(),
        seconds = started.elapsed().as_secs_f64(),
        "merged the checkpoint's files into the whole model, to cut it anew"
    );
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{CommitRecord, HeldFile};

    #[test]
    fn a_copy_written_but_never_committed_on_its_node_is_committed_from_the_coordinators_record() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path(), 3);
        let written = store.write(20, "rank-0.state", b"the state after step 20").unwrap();
        let recovery = Recovery {
            store: Some(store),
            ..Recovery::default()
        };
        let error = recovery.read_committed(20, Some(1), None, "rank-0.state").unwrap_err();
        assert!(format!("{error:#}").contains("never committed"), "{error:#}");
        let roster = Roster {
            members: vec![0],
            endpoints: vec!["10.0.0.1:1".to_string()],
            mirrors: vec![None],
            generation: 1,
            resume_step: Some(20),
            record: Some(CommitRecord {
                step: 20,
                world_size: 1,
                files: vec![HeldFile::here(written)],
            }),
        };
        let bytes = recovery
            .read_committed(20, Some(1), Some(&roster), "rank-0.state")
            .unwrap();
        assert_eq!(bytes.as_slice(), b"the state after step 20");
        // Committed for good: found again without the record.
        assert_eq!(
            recovery.read_committed(20, Some(1), None, "rank-0.state").unwrap(),
            bytes
        );
    }
}
