//! # kvgate-core
//!
//! The control plane's synchronous core: it answers Picks from a live index
//! of every worker's KV blocks, the model's tokenizer (with a cache keyed by
//! the filter's segment hashes) and the load of every worker. No async
//! runtime and no network: adapters in other crates (the gRPC `Router`
//! service and NATS ingest in `kvgate-server`, the ext_proc endpoint picker
//! in `kvgate-epp`, the admin HTTP API) call it. See `README.md` for the
//! module map and costs.
#![warn(missing_docs)]

pub mod app;
pub mod collect;
pub mod config;
pub mod endpoints;
pub mod error;
pub mod ingest;
pub mod metrics;
pub mod model;
pub mod served;
pub mod timing;
pub mod views;

pub use app::{App, Model, ReplicaSink};
pub use config::{Config, ConfigError, RawConfig};
pub use error::{PickError, StartError};
pub use kvgate_scheduler::Ticket;

/// Prompt tokenization with the segment cache (lives in `kvgate-tokenize`,
/// shared with the simulator).
pub use kvgate_tokenize::prompt as tokens;

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
