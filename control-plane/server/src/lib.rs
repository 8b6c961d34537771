//! # kvgate-server
//!
//! The control plane: answers the filter's `Pick` over gRPC from a live
//! index of every worker's KV blocks (fed by the relays over NATS), the
//! model's tokenizer (with a cache keyed by the filter's segment hashes), and
//! the load of every worker (its heartbeats plus the requests this and the
//! other replicas routed). See `README.md` for the module map and costs.
#![warn(missing_docs)]

pub mod admin;
pub mod app;
pub mod config;
pub mod metrics;
pub mod model;
pub mod server;

/// Generated tonic code of `kvgate.v1.Router` (checked in; `make proto`).
#[allow(missing_docs, unreachable_pub, clippy::all)]
mod generated {
    include!("gen/kvgate.v1.tonic.rs");
}
pub use generated::{router_client, router_server};

/// Prompt tokenization with the segment cache (lives in `kvgate-tokenize`,
/// shared with the simulator).
pub use kvgate_tokenize::prompt as tokens;

pub use app::App;
pub use config::{Config, ConfigError, RawConfig};
pub use server::{Bound, Handle, run, spawn};
