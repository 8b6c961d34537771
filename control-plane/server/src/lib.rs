//! # kvgate-server
//!
//! The control plane's network side around the synchronous core
//! (`kvgate-core`): the gRPC `Router` service ([`grpc`]), NATS ingest,
//! snapshots (bounded, one per worker) and replica sync ([`nats`]), the admin HTTP API ([`admin`]),
//! and the process that runs them with the endpoint picker (`kvgate-epp`)
//! on the gRPC port ([`server`]). See `README.md` for the module map.
#![warn(missing_docs)]

pub mod admin;
pub mod grpc;
pub mod held;
pub mod nats;
pub mod server;
mod snapshots;

/// Generated tonic code of `kvgate.v1.Router` (checked in; `make proto`).
#[allow(missing_docs, unreachable_pub, clippy::all)]
mod generated {
    include!("gen/kvgate.v1.tonic.rs");
}
pub use generated::{router_client, router_server};

pub use kvgate_core::{App, Config, ConfigError, RawConfig, chat_pick_request, config, tokens};
pub use server::{Bound, Handle, run, spawn};
