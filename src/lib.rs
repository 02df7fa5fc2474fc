//! flotilla: a distributed deep-learning training runtime.
pub mod actors;
pub mod bench;
pub mod collective;
pub mod config;
pub mod data;
pub mod engines;
pub mod job;
pub mod launch;
pub mod models;
pub mod net;
pub mod optim;
pub mod rng;
pub mod telemetry;
