//! Communicators: collectives over a ring of ranks.
//!
//! Vocabulary, as nccl-tests uses it:
//! - **rank**: one participant, `0..world_size`; its *right* neighbour is
//!   `rank + 1 (mod n)`, its *left* one `rank - 1 (mod n)`.
//! - **transport**: how bytes reach the neighbours — [`tcp`] sockets between
//!   processes, or [`memory`] channels between threads of one process. Both
//!   carry the same per-message header, so the algorithms above them are
//!   identical and give bit-identical results in both worlds.
//! - **ring all-reduce**: reduce-scatter then all-gather, `2(n-1)` steps,
//!   each moving `1/n` of the buffer ([`ring`]).
//! - **worker**: a thread that owns a communicator and runs collectives
//!   submitted by the compute thread, so communication overlaps backward
//!   ([`worker`]).

mod links;
pub mod memory;
pub mod ring;
mod send_queue;
pub mod tcp;
pub mod transport;
pub mod worker;

pub use ring::Communicator;
pub use transport::RingTransport;
pub use worker::{CommWorker, Pending};
