//! flotilla: a distributed deep-learning training runtime.
//!
//! One [`config::DistributedStrategy`] decides how a job spreads over
//! machines and the runtime does the communication: collective data
//! parallelism (every rank holds a replica of the model; gradients are
//! averaged by a ring all-reduce of fused buckets, overlapped with
//! backward), pipeline parallelism (stages of the model's blocks, combined
//! with data parallelism across replicas) and parameter servers (sharded
//! dense parameters and sparse embedding tables), on CPU and, with the
//! `cuda` feature, on NVIDIA GPUs.
//!
//! # Using it as a library
//!
//! Define a model as [`models::Block`]s, load a [`data::Dataset`] and a
//! [`config::JobConfig`], and hand them to [`job::TrainingJob::run`]: it
//! trains in this process as a simulated cluster, or as one rank when the
//! program is started by `flotilla launch` (see `examples/custom_model.rs`).
//! [`cli::standard_command_line`] gives such a program `flotilla train`'s flags in one call.
//!
//! A program that keeps the loop, the loss and the optimizer for itself — `init_process_group`
//! and `DDP(model)` in PyTorch — joins its launcher's job with [`job::ProcessGroup::init`] and
//! wraps its model in a [`job::DistributedModel`], whose `backward` returns the gradients
//! averaged over the ranks (`examples/own_loop.rs`).
//!
//! ```
//! use flotilla::config::{process_env, JobConfig};
//! use flotilla::job::{RunOptions, TrainingJob};
//!
//! # fn main() -> anyhow::Result<()> {
//! // Two data-parallel ranks, five steps of the built-in digits MLP.
//! let config = JobConfig::from_toml_str(
//!     "[cluster]\nnproc_per_node = 2\n[train]\nsteps = 5\nbatch_size = 32\n",
//!     "example",
//!     &process_env,
//!     &[],
//! )?;
//! let run_dir = std::env::temp_dir().join("flotilla-doc-example");
//! let options = RunOptions::new(run_dir);
//! let outcome = TrainingJob::builtin(config)?.run_simulated(&options)?;
//! assert_eq!(outcome.summary.world_size, 2);
//! assert_eq!(outcome.summary.steps, 5);
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//!
//! - [`config`]: the job's TOML (`[cluster]`, `[strategy]`, `[train]`,
//!   `[fault_tolerance]`), environment and `--set` overrides, validation.
//! - [`actors`]: the roles — coordinator (rendezvous, barriers), trainer
//!   (the collective loop), device (a `SyncArbiter` thread owning the replica
//!   and the communicator, or the CTR worker), pserver (a parameter-server
//!   shard), ps_trainer (the parameter-server loop).
//! - [`collective`]: the data-parallel replica — block-wise backward,
//!   gradient buckets, replica checksums.
//! - [`engines`]: the ring collectives over memory or TCP transports, and
//!   compute-device selection.
//! - [`net`]: the control plane — frames, the coordinator's and the shards'
//!   TCP servers, the bus roles use to reach the coordinator.
//! - [`models`], [`optim`], [`data`]: blocks, the MLP and wide&deep; SGD with
//!   momentum, AdamW and the learning-rate policy; datasets and loaders
//!   (digits, synthetic, Criteo-shaped click logs and Criteo TSV).
//! - [`job`]: a collective, pipeline or parameter-server job run in-process or as one
//!   launched role, and the files a run writes.
//! - [`launch`]: `flotilla launch` and `launch-ps`, starting and supervising
//!   a node's processes.
//! - [`cli`]: the command line of a training program.
//! - [`doctor`]: `flotilla doctor`, the checks before a launch — config,
//!   endpoints, ports, peers, clock, GPU libraries.
//! - [`metrics`]: quality measures of model outputs (ROC AUC).
//! - [`pipeline`]: pipeline parallelism — schedules (GPipe, 1F1B,
//!   interleaved) and the cut of a model into stages.
//! - [`ps`]: the parameter-server strategy — a shard's tables, dense slice,
//!   optimizer and snapshots, the placement of rows, the protocol, the
//!   trainer's client and its step logic.
//! - [`checkpoint`]: coordinated checkpoints — atomic files, a checksummed manifest committed
//!   last, the newest intact one found again.
//! - [`bench`](mod@bench): benchmarks that print figures.
//! - [`refusal`]: errors no restart can change, and the exit status that tells a launcher so.
//! - [`rng`], [`telemetry`]: the seeded generator every rank shares; logging, per-step
//!   metrics, progress, the report, timelines and their merge.

#![warn(missing_docs, unreachable_pub)]

pub mod actors;
pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod collective;
pub mod config;
pub mod cpu_features;
pub mod cpu_values;
pub mod data;
pub mod doctor;
pub mod engines;
pub mod job;
pub mod k8s;
pub mod launch;
pub mod metrics;
pub mod models;
pub mod net;
pub mod optim;
pub mod pipeline;
pub mod ps;
pub mod refusal;
pub mod rng;
pub mod telemetry;
