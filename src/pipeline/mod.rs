//! Pipeline parallelism: a model's blocks cut into stages, micro-batches streamed through
//! them. [`schedule`] says in which order each stage runs forwards and backwards (GPipe, 1F1B,
//! interleaved 1F1B) and simulates them; [`partition`] cuts the block list into stages;
//! [`stage`] runs one stage's step over a [`link`] to its neighbours; [`replica`] is a
//! rank's stage with its optimizer and its data-parallel ring.

pub mod link;
pub mod partition;
pub mod replica;
pub mod schedule;
pub mod stage;
