//! # kvgate-relay
//!
//! The sidecar next to one vLLM engine: vLLM's ZMQ KV events in, normalized
//! protobuf batches on NATS out, with an exact mirror of the engine's cache
//! for snapshots (ARCHITECTURE §5).
//!
//! | module | what |
//! |---|---|
//! | [`core`] | the relay's logic without sockets: sequencing (gaps, restarts, replay), normalization (salt inheritance, skips), actions |
//! | [`mirror`] | the engine's cached blocks, reference-counted; snapshots in chunks, parents first |
//!
//! The socket side (ZMQ SUB and DEALER, NATS, heartbeats from `/metrics`)
//! drives [`core::RelayCore`]; it is being built in issue #5.
#![warn(missing_docs)]

pub mod core;
pub mod mirror;

pub use core::{Action, RelayConfig, RelayCore, RelayCounters};
pub use mirror::{Mirror, MirrorBlock};
