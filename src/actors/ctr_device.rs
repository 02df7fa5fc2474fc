//! The device thread of a parameter-server trainer: a `SyncArbiter` thread that owns the CTR
//! worker — the dense part of the model, the ids of the batch in flight and, in geo mode, the
//! local tables. The trainer actor plans a batch's pull here, pulls the rows from the shards,
//! and trains or predicts here on what it pulled.

use std::sync::Arc;

use actix::prelude::*;
use anyhow::{anyhow, Result};

use crate::config::JobConfig;
use crate::data::ctr::CtrBatch;
use crate::engines::compute::device_for;
use crate::models::SparseModelDef;
use crate::ps::wire::PulledRows;
use crate::ps::worker::{CtrWorker, PullPlan, ShardUpdate, StepOutcome};

/// Builds the CTR worker of a parameter-server trainer.
#[derive(Message)]
#[rtype(result = "Result<()>")]
pub struct PrepareCtr {
    /// The job.
    pub job: Arc<JobConfig>,
    /// Its sparse model.
    pub model: SparseModelDef,
    /// The trainer's rank.
    pub rank: usize,
}

/// Plans the pull of a CTR batch (training, or evaluation when `training` is false).
#[derive(Message)]
#[rtype(result = "Result<PullPlan>")]
pub struct PlanCtr {
    /// This trainer's part of the batch.
    pub batch: CtrBatch,
    /// Whether the batch is trained on.
    pub training: bool,
}

/// Trains on the planned CTR batch with the rows pulled from each shard.
#[derive(Message)]
#[rtype(result = "Result<StepOutcome>")]
pub struct TrainCtr(pub Vec<PulledRows>);

/// Click probabilities of the planned CTR batch.
#[derive(Message)]
#[rtype(result = "Result<Vec<f32>>")]
pub struct PredictCtr(pub Vec<PulledRows>);

/// Geo mode: the deltas not pushed yet.
#[derive(Message)]
#[rtype(result = "Result<Option<Vec<ShardUpdate>>>")]
pub struct FlushCtr;

/// A parameter-server trainer's own state at a checkpoint (geo's local optimizer state; `None`
/// in the modes where a trainer holds none).
#[derive(Message)]
#[rtype(result = "Result<Option<Vec<u8>>>")]
pub struct CtrOwnState;

/// Takes back a parameter-server trainer's own state.
#[derive(Message)]
#[rtype(result = "Result<()>")]
pub struct RestoreCtrOwnState(pub Arc<Vec<u8>>);

/// The CTR worker's thread: empty until [`PrepareCtr`].
#[derive(Default)]
pub struct CtrDevice {
    worker: Option<CtrWorker>,
}

impl CtrDevice {
    fn worker(&mut self) -> Result<&mut CtrWorker> {
        self.worker
            .as_mut()
            .ok_or_else(|| anyhow!("the CTR device was used before PrepareCtr"))
    }
}

impl Actor for CtrDevice {
    type Context = SyncContext<Self>;
}

impl Handler<PrepareCtr> for CtrDevice {
    type Result = Result<()>;

    fn handle(&mut self, msg: PrepareCtr, _: &mut Self::Context) -> Result<()> {
        let device = device_for(msg.job.cluster.device, msg.rank)?;
        self.worker = Some(CtrWorker::new(&msg.job, &msg.model, device)?);
        Ok(())
    }
}

impl Handler<PlanCtr> for CtrDevice {
    type Result = Result<PullPlan>;

    fn handle(&mut self, msg: PlanCtr, _: &mut Self::Context) -> Self::Result {
        self.worker()?.plan(msg.batch, msg.training)
    }
}

impl Handler<TrainCtr> for CtrDevice {
    type Result = Result<StepOutcome>;

    fn handle(&mut self, msg: TrainCtr, _: &mut Self::Context) -> Self::Result {
        self.worker()?.train_step(msg.0)
    }
}

impl Handler<PredictCtr> for CtrDevice {
    type Result = Result<Vec<f32>>;

    fn handle(&mut self, msg: PredictCtr, _: &mut Self::Context) -> Self::Result {
        self.worker()?.predict(msg.0)
    }
}

impl Handler<FlushCtr> for CtrDevice {
    type Result = Result<Option<Vec<ShardUpdate>>>;

    fn handle(&mut self, _: FlushCtr, _: &mut Self::Context) -> Self::Result {
        self.worker()?.flush()
    }
}

impl Handler<CtrOwnState> for CtrDevice {
    type Result = Result<Option<Vec<u8>>>;

    fn handle(&mut self, _: CtrOwnState, _: &mut Self::Context) -> Self::Result {
        self.worker()?.own_state()
    }
}

impl Handler<RestoreCtrOwnState> for CtrDevice {
    type Result = Result<()>;

    fn handle(&mut self, msg: RestoreCtrOwnState, _: &mut Self::Context) -> Self::Result {
        self.worker()?.restore_own_state(&msg.0)
    }
}
