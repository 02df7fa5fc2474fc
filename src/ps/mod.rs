//! The storage and optimizer core of a parameter-server shard.
//!
//! Vocabulary:
//! - a **shard** is one parameter server's part of the model: a contiguous
//!   [`dense::DenseSlice`] of the flattened dense parameters and, of every
//!   sparse embedding table, the rows whose feature ids hash to it;
//! - a **row** is one feature id's embedding, `width` floats, followed in
//!   memory by its optimizer state; rows are created, initialised from the
//!   job's seed, on first pull or push ([`table::SparseTable`]);
//! - a **push** carries gradients the shard applies with its
//!   [`optimizer::ServerOptimizer`], lazily: rows not pushed are untouched;
//!   in geo mode a push carries deltas the shard simply adds;
//! - a **snapshot** is one safetensors file per shard ([`snapshot`]).
//!
//! Layout: storage ([`table`], [`dense`], [`optimizer`], [`snapshot`]); the
//! shard's rules per mode ([`shard`]); where a row lives ([`placement`]);
//! what travels between trainer and shard ([`wire`]) and the shard's TCP endpoint
//! ([`server`]); the trainer's side ([`client`] for the links, [`worker`] for its step on the
//! device thread, [`push_lane`] for async mode's pushes sent while it trains on).
//! The shard's actor is a role, in `actors::pserver`: it keeps the shard's state across
//! rollbacks with the recovery pieces, which sit above this module.

pub mod client;
pub mod dense;
pub mod export_format;
pub mod optimizer;
pub mod parts;
pub mod placement;
pub mod policy;
pub mod push_lane;
mod row_index;
mod row_pages;
pub mod server;
pub mod shard;
pub mod snapshot;
pub mod table;
pub mod wire;
pub mod worker;

pub use row_pages::PAGE_ROWS;
pub use shard::{Shard, ShardSpec};
