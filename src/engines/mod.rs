//! Engines: where the bytes and the floats move. `comm` moves tensors between
//! ranks, `compute` picks the device tensors live on. Engines know nothing of
//! actors; actors drive them.

pub mod comm;
pub mod compute;
