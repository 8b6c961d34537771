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
pub mod endpoints;
pub mod epp;
pub mod metrics;
pub mod model;
pub mod server;

/// Generated tonic code of `kvgate.v1.Router` (checked in; `make proto`).
#[allow(missing_docs, unreachable_pub, clippy::all)]
mod generated {
    include!("gen/kvgate.v1.tonic.rs");
}
pub use generated::{router_client, router_server};

/// Generated messages and server of kvgate's subset of Envoy's ext_proc
/// protocol (`envoy.service.ext_proc.v3`; checked in; `make proto`).
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod ext_proc {
    include!("gen/envoy.service.ext_proc.v3.rs");
}

/// Prompt tokenization with the segment cache (lives in `kvgate-tokenize`,
/// shared with the simulator).
pub use kvgate_tokenize::prompt as tokens;

pub use app::App;
pub use config::{Config, ConfigError, RawConfig};
pub use server::{Bound, Handle, run, spawn};

/// A chat-completions `PickRequest` for JSON messages, with the segment
/// hashes the filter would compute (for tests, benchmarks and tools that
/// call the control plane without Envoy). Each message is serialized with
/// `serde_json` (keys sorted), and those bytes are what is hashed and sent.
pub fn chat_pick_request(
    model: &str,
    request_id: &str,
    messages: &[serde_json::Value],
    max_tokens: Option<u32>,
) -> kvgate_protocol::pb::PickRequest {
    use kvgate_protocol::pb;
    let bytes: Vec<Vec<u8>> = messages.iter().map(|m| serde_json::to_vec(m).unwrap_or_default()).collect();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let hashes = tokens::chain_hashes(b"", &refs);
    pb::PickRequest {
        request_id: request_id.to_owned(),
        model: model.to_owned(),
        api: pb::ApiKind::ChatCompletions as i32,
        segments: bytes
            .into_iter()
            .zip(hashes)
            .map(|(b, h)| pb::Segment { chain_hash: h, role: String::new(), message_json: b, elided: false })
            .collect(),
        max_tokens,
        ..Default::default()
    }
}
