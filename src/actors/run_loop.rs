//! The parts of a rank's training run that outlive a rollback: the batches it reads, how many
//! steps the run has, and the monitor that reports them. Shared by trainers and stages.

use actix::Addr;
use anyhow::{Context as _, Result};

use super::device::{DeviceActor, JoinDataPositions};
use super::recovery::Recovery;
use crate::config::JobConfig;
use crate::data::{DataPosition, RankBatches, RowSource};
use crate::telemetry::monitor::{Monitor, MonitorSettings};

/// The batches of a whole run of `job` over `data`: its `train.steps`, or its epochs of whole
/// global batches.
pub(crate) fn run_steps(job: &JobConfig, data: &RowSource) -> Result<usize> {
    let per_epoch = data.len() / job.train.batch_size.max(1);
    job.train.length().steps(per_epoch)
}

/// Whether the held-out split is scored after `done` of the run's `steps` steps, besides the
/// final evaluation: every `train.eval_every` steps, and at the end when any are.
pub(crate) fn eval_due(job: &JobConfig, done: usize, steps: usize) -> bool {
    let every = job.train.eval_every;
    every > 0 && (done.is_multiple_of(every) || done == steps)
}

/// A rank's run, from the step it starts after to its end.
pub(crate) struct RunLoop {
    /// This rank's part of every global batch.
    pub(crate) loader: RankBatches,
    /// Steps of the whole run.
    pub(crate) steps: usize,
    /// The reporting rank's monitor.
    pub(crate) monitor: Option<Monitor>,
    /// This process's clock against the coordinator's, for timelines.
    pub(crate) clock_offset_us: f64,
}

impl RunLoop {
    /// The run of `job` as data-parallel replica `replica` of `replicas` reads `data`, started
    /// after step `first` (refused past the run's end), reported by `monitor` where given.
    pub(crate) fn start(
        job: &JobConfig,
        data: &RowSource,
        (replica, replicas): (usize, usize),
        recovery: &Recovery,
        first: usize,
        monitor: Option<&MonitorSettings>,
        clock_offset_us: f64,
    ) -> Result<Self> {
        let train = &job.train;
        let mark_every = job.fault_tolerance.checkpoint_every;
        let loader = RankBatches::new(data, train.batch_size, (replica, replicas), train.seed, mark_every)
            .with_context(|| format!("train.batch_size = {}", train.batch_size))?;
        let steps = run_steps(job, data)?;
        crate::optim::check_run_length(&job.strategy, steps)?;
        recovery.check_first_step(first, steps)?;
        let monitor = monitor
            .map(|settings| Monitor::start(settings, steps, first, train.batch_size, train.log_every))
            .transpose()?;
        Ok(Self {
            loader,
            steps,
            monitor,
            clock_offset_us,
        })
    }

    /// Where every replica is in the streamed data before the batch of step `step`, joined
    /// over the replicas by `device` (every rank of the ring asks at the same step); `None` for
    /// rows in memory, which a step locates.
    pub(crate) async fn data_position(&self, device: &Addr<DeviceActor>, step: usize) -> Result<Option<DataPosition>> {
        let Some(mine) = self.loader.position(step)? else {
            return Ok(None);
        };
        Ok(Some(device.send(JoinDataPositions(mine)).await??))
    }

    /// Takes up the streamed data at `at`, saved with the state of step `step`, instead of
    /// reading the rows before it; where `at` does not fit (the data cut otherwise), reads its
    /// way there.
    pub(crate) fn resume_data(&mut self, rank: usize, step: usize, at: Option<&DataPosition>) {
        if let Some(at) = at {
            if let Err(refused) = self.loader.resume_at(step, at) {
                tracing::warn!(rank, step, "reading the data up to the step: {refused:#}");
            }
        }
    }

    /// The run ended: the monitor says so.
    pub(crate) fn finish(&self) {
        if let Some(monitor) = &self.monitor {
            monitor.finish();
        }
    }
}
