//! What every rank of a dense model holds, whatever its strategy (the data-parallel trainer,
//! the pipeline stage): its place, the job, the model, the data, its device actor, how it reports
//! and recovers. The role's actor holds it, and its run takes a clone (Arcs and handles).

use std::sync::Arc;

use actix::Addr;

use super::device::{DeviceActor, ModelFactory};
use super::recovery::faults::RoleFaults;
use super::recovery::Recovery;
use crate::config::JobConfig;
use crate::data::RowSource;
use crate::models::export::ModelInfo;
use crate::telemetry::monitor::MonitorSettings;
use crate::telemetry::timeline::TraceTarget;

/// What a rank of a dense model needs to train.
#[derive(Clone)]
pub struct RankParts {
    /// Global rank.
    pub rank: usize,
    /// The job.
    pub job: Arc<JobConfig>,
    /// The model's constructor.
    pub model: ModelFactory,
    /// What the model's files say besides its parameters.
    pub export: ModelInfo,
    /// Training split (each data-parallel replica reads its part of every global batch).
    pub train_data: RowSource,
    /// Held-out split (each replica evaluates a contiguous part).
    pub test_data: RowSource,
    /// The device actor of this rank.
    pub device: Addr<DeviceActor>,
    /// How to report every step: the reporting rank's only.
    pub monitor: Option<MonitorSettings>,
    /// Where to write this rank's timeline, when tracing.
    pub trace: Option<TraceTarget>,
    /// The checkpoint to start from and where to write new ones.
    pub(crate) recovery: Recovery,
    /// The faults planned for this rank of a simulated cluster: its training runs under their
    /// switch.
    pub faults: Option<Arc<RoleFaults>>,
}
