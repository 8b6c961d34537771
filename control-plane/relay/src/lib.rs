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
//! | [`ranks`] | data-parallel ranks of one server: each rank's event socket and worker id |
//! | [`split`] | batches cut under the NATS payload limit (a huge store into chained pieces) |
//! | [`health`] | the engine's health from probes: healthy, unhealthy, down |
//! | [`metrics`] | the engine's load from vLLM's `/metrics` text |
//! | [`exposition`] | the relay's own Prometheus metrics |
//! | `runtime` (feature `runtime`, default) | the sockets: ZMQ SUB/DEALER, NATS publish, snapshot replies, heartbeats |
#![warn(missing_docs)]

pub mod core;
pub mod exposition;
pub mod health;
pub mod metrics;
pub mod mirror;
#[cfg(feature = "runtime")]
pub mod publish;
pub mod ranks;
#[cfg(feature = "runtime")]
pub mod runtime;
pub mod split;

pub use core::{Action, RelayConfig, RelayCore, RelayCounters};
pub use mirror::{Mirror, MirrorBlock};
