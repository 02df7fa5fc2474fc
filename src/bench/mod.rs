//! Benchmarks that print figures (never asserts): `flotilla bench …`.

pub mod allreduce;
pub mod checkpoint;
pub mod pipeline;
pub mod ps;
