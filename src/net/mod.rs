//! Transport of the control plane: framed messages between roles.
//!
//! - [`frame`]: a frame is a postcard-encoded header followed by raw
//!   little-endian tensor bytes, inside a length-delimited TCP frame whose
//!   size is capped.
//! - [`protocol`]: the coordinator's protocol, one request enum and one
//!   answer enum (the actor's message and the frames' headers alike), and the
//!   [`CoordinatorLine`] the transports deliver them through.
//! - [`bus`]: the one interface roles talk to the coordinator through, in
//!   memory (actor messages) or over TCP (frames).
//! - [`server`]: the coordinator's TCP endpoint, turning frames into actor
//!   messages.
//! - [`listen`]: the accept loop the endpoints share (token handshake first).
//! - [`tcp_store`]: a client of PyTorch's TCPStore, where ranks under torchrun meet.
//!
//! Bulk tensors (all-reduce chunks) do not travel here: they go through the
//! communicators of `engines::comm`, on their own sockets.

pub mod auth;
pub mod bus;
pub mod frame;
pub mod frame_stream;
pub mod listen;
pub mod protocol;
pub mod server;
pub mod tcp_store;

pub use bus::ControlBus;
pub use frame::Frame;
pub use protocol::CoordinatorLine;
