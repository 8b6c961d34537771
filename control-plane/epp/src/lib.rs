//! The endpoint picker (EPP) of the Gateway API Inference Extension:
//! `envoy.service.ext_proc.v3.ExternalProcessor/Process` served next to
//! `kvgate.v1.Router` on the gRPC port, for gateways that route an
//! `InferencePool` through an endpoint picker instead of loading the kvgate
//! Wasm filter.
//!
//! One ext_proc stream is one HTTP request. The picker reads the OpenAI body
//! with the filter's own extraction and hashing (`kvgate-filter-core`), so a
//! request gets exactly the `Pick` the filter would have sent, and answers as
//! the endpoint-picker protocol asks: the `x-gateway-destination-endpoint`
//! header (primary, then fallbacks, comma-separated) and the same value in
//! the dynamic metadata `envoy.lb` / `x-gateway-destination-endpoint`.
//!
//! | request body mode | what the picker does |
//! |---|---|
//! | `BUFFERED` | answers the headers at once; sets the destination in its answer to the whole body |
//! | `FULL_DUPLEX_STREAMED` (what Inference Extension gateways configure) | holds the headers answer until the body is complete, then answers headers (with the destination) and streams the body back unchanged, in chunks of at most 64 KiB |
//! | `BUFFERED_PARTIAL` | as `BUFFERED`; a truncated body is routed by load |
//! | `NONE`, `STREAMED` | cannot see the body before the headers leave: routed by load at the headers |
//!
//! Outcomes, each counted in `kvgate_epp_requests_total{outcome}`:
//! * `routed`: a KV-aware pick;
//! * `load`: routed by load: other paths and methods (e.g. `GET /v1/models`,
//!   for the first configured model), bodies kvgate does not route by prefix
//!   (a batch of prompts), over the size limit, or over the message limit;
//! * `bad_request`: 400 with an OpenAI-style JSON error (not JSON, wrong shape);
//! * `unknown_model`: 404, as OpenAI answers an unknown model;
//! * `unavailable`: 503 when no live worker remains (the protocol's answer),
//!   also when a subset hint allows none of the live workers. The hint
//!   narrows the candidates before the pick: the destination is the best
//!   allowed worker, then allowed fallbacks.
//!
//! The response is watched, never changed: its first body byte is reported
//! as the first token (total 0) and its end (or the stream's end) as the
//! completion, with `usage` read from the body's tail, as the filter reports
//! them. Cost per request: the filter's single pass over the body, the Pick
//! built as a message (no protobuf round trip in-process), and one copy of
//! the body when it is echoed back in full-duplex mode.

//!
//! | file | what |
//! |---|---|
//! | [`service`] | the tonic `ExternalProcessor` service: one task per stream |
//! | `exchange.rs` | one request's conversation: a synchronous state machine |
//! | `answers.rs` | the protobuf answers (destination, echo, local errors) |
//! | `fuzz.rs` | the fuzz driver of an exchange |
#![warn(missing_docs)]

mod answers;
mod exchange;
mod fuzz;
pub mod service;

use kvgate_core::App;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

pub use fuzz::drive_exchange;
pub use service::EndpointPicker;

/// Generated messages and server of kvgate's subset of Envoy's ext_proc
/// protocol (`envoy.service.ext_proc.v3`; checked in; `make proto`).
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod ext_proc {
    include!("gen/envoy.service.ext_proc.v3.rs");
}

/// The header and metadata key of the protocol.
pub const DESTINATION: &str = kvgate_protocol::DESTINATION_HEADER;
/// The dynamic-metadata namespace of the destination.
pub const METADATA_NAMESPACE: &str = "envoy.lb";
/// Where a data plane puts the endpoints a pick must choose from.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of that list.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Largest chunk sent back in full-duplex mode (the protocol recommends
/// at most 64 KiB).
const ECHO_CHUNK: usize = 64 << 10;
/// Bytes of the response kept to find `usage` (as the filter's default).
const TAIL_BYTES: usize = 16 << 10;

kvgate_core::label_enum! {
    /// How the picker answered a request (`kvgate_epp_requests_total{outcome}`).
    pub enum Outcome {
        /// A KV-aware pick.
        Routed => "routed",
        /// Routed by load.
        Load => "load",
        /// 400.
        BadRequest => "bad_request",
        /// 404.
        UnknownModel => "unknown_model",
        /// 503.
        Unavailable => "unavailable",
    }
}

/// `{outcome}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: Outcome,
}

/// The picker's metrics, registered in the app's registry.
#[derive(Debug, Clone)]
pub struct EppMetrics {
    outcomes: Family<OutcomeLabel, Counter>,
    stream_errors: Counter,
}

impl EppMetrics {
    /// Registers the picker's families with `app`'s registry.
    pub fn register(app: &App) -> Self {
        let m = Self { outcomes: Family::default(), stream_errors: Counter::default() };
        for outcome in Outcome::ALL {
            drop(m.outcomes.get_or_create(&OutcomeLabel { outcome: *outcome }));
        }
        app.metrics.register(
            "kvgate_epp_requests",
            "Requests the endpoint picker (ext_proc) answered, by outcome.",
            m.outcomes.clone(),
        );
        app.metrics.register(
            "kvgate_epp_stream_errors",
            "ext_proc streams the data plane ended with an error.",
            m.stream_errors.clone(),
        );
        m
    }

    fn count(&self, outcome: Outcome) {
        self.outcomes.get_or_create(&OutcomeLabel { outcome }).inc();
    }

    /// Requests answered with `outcome` so far.
    pub fn outcome(&self, outcome: Outcome) -> u64 {
        self.outcomes.get_or_create(&OutcomeLabel { outcome }).get()
    }
}

#[cfg(test)]
mod tests;
