//! The roles, one actor each: the [`coordinator`] (rendezvous, barriers, liveness, commits),
//! the data-parallel [`trainer`], the pipeline [`stage`], the parameter-server trainer
//! ([`ps_trainer`]) and shard ([`pserver`]), and the device thread of each rank (a
//! `SyncArbiter` actor: [`device`] owns a data-parallel or pipeline rank's replica and its
//! communicators, [`ctr_device`] a parameter-server trainer's CTR worker). Every message an
//! actor accepts is defined in its file.

pub mod coordinator;
pub mod ctr_device;
pub mod device;
mod ps_requests;
pub mod ps_trainer;
pub mod pserver;
mod rank_generations;
pub mod rank_parts;
mod rank_steps;
pub mod recovery;
pub mod ring_link;
mod run_loop;
pub mod stage;
pub mod trainer;

/// The most steps' losses reserved up front: a run may be far longer than it will ever get
/// (a huge `train.epochs`), and the record grows as steps are taken.
const LOSSES_RESERVED: usize = 1 << 20;

pub use coordinator::{Coordinator, JobAskedToStop};
pub use device::DeviceActor;
pub use trainer::Trainer;
