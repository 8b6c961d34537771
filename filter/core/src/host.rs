//! Everything the filter asks of its host (Envoy through Proxy-Wasm), behind
//! one trait, and the metrics it keeps.
//!
//! The Wasm shim implements [`Host`] with `proxy_wasm::hostcalls`; unit tests
//! use [`crate::mock::MockHost`], which records every call.

use kvgate_protocol::pd::Fallback;

/// Why a request was not steered. Every one takes the single failure path
/// ([`crate::filter::RequestFilter`]): fail-open or fail-closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// The Pick call did not answer within the timeout (gRPC 14 or 4 after
    /// the configured timeout).
    Timeout,
    /// gRPC 14 before the timeout: control plane down, or no live worker.
    Unavailable,
    /// gRPC 5: the control plane does not serve the body's model.
    UnknownModel,
    /// Any other gRPC status.
    GrpcError,
    /// An OK answer without a usable endpoint.
    UnusableAnswer,
    /// Envoy refused to start the call (e.g. the cluster does not exist).
    DispatchFailed,
    /// The body exceeds `max_body_bytes`.
    BodyTooLarge,
    /// The body is not JSON, or not an OpenAI request of the path's kind.
    Malformed,
    /// A valid request that is not routed by prefix (e.g. a prompt batch).
    Unsupported,
}

impl Cause {
    /// All causes, in metric order.
    pub const ALL: [Cause; 9] = [
        Cause::Timeout,
        Cause::Unavailable,
        Cause::UnknownModel,
        Cause::GrpcError,
        Cause::UnusableAnswer,
        Cause::DispatchFailed,
        Cause::BodyTooLarge,
        Cause::Malformed,
        Cause::Unsupported,
    ];

    /// Short name (metrics, debug header, logs).
    pub fn name(self) -> &'static str {
        match self {
            Cause::Timeout => "timeout",
            Cause::Unavailable => "unavailable",
            Cause::UnknownModel => "unknown_model",
            Cause::GrpcError => "grpc_error",
            Cause::UnusableAnswer => "unusable_answer",
            Cause::DispatchFailed => "dispatch_failed",
            Cause::BodyTooLarge => "body_too_large",
            Cause::Malformed => "malformed",
            Cause::Unsupported => "unsupported",
        }
    }

    /// Status of the local reply under `failure_mode: closed`: the client's
    /// own errors get a precise 4xx, everything else 503.
    pub fn status(self) -> u32 {
        match self {
            Cause::BodyTooLarge => 413,
            Cause::Malformed => 400,
            _ => 503,
        }
    }

    /// JSON body of the local reply under `failure_mode: closed` (OpenAI
    /// error shape; static, so the failure path allocates nothing).
    pub fn error_body(self) -> &'static [u8] {
        match self {
            Cause::Timeout => br#"{"error":{"message":"kvgate: the routing service did not answer in time","type":"service_unavailable","code":503,"kvgate_cause":"timeout"}}"#,
            Cause::Unavailable => br#"{"error":{"message":"kvgate: the routing service is unavailable or has no live worker","type":"service_unavailable","code":503,"kvgate_cause":"unavailable"}}"#,
            Cause::UnknownModel => br#"{"error":{"message":"kvgate: the routing service does not serve this model","type":"service_unavailable","code":503,"kvgate_cause":"unknown_model"}}"#,
            Cause::GrpcError => br#"{"error":{"message":"kvgate: the routing service failed","type":"service_unavailable","code":503,"kvgate_cause":"grpc_error"}}"#,
            Cause::UnusableAnswer => br#"{"error":{"message":"kvgate: the routing service gave no usable endpoint","type":"service_unavailable","code":503,"kvgate_cause":"unusable_answer"}}"#,
            Cause::DispatchFailed => br#"{"error":{"message":"kvgate: the routing service cannot be called","type":"service_unavailable","code":503,"kvgate_cause":"dispatch_failed"}}"#,
            Cause::BodyTooLarge => br#"{"error":{"message":"kvgate: request body too large","type":"invalid_request_error","code":413,"kvgate_cause":"body_too_large"}}"#,
            Cause::Malformed => br#"{"error":{"message":"kvgate: request body is not a valid OpenAI request","type":"invalid_request_error","code":400,"kvgate_cause":"malformed"}}"#,
            Cause::Unsupported => br#"{"error":{"message":"kvgate: request cannot be routed","type":"service_unavailable","code":503,"kvgate_cause":"unsupported"}}"#,
        }
    }
}

/// Envoy stats the filter defines (`define_metric`; Envoy shows them under
/// `wasmcustom.`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// POSTs to a steered path.
    Requests,
    /// Requests sent with the destination header.
    Steered,
    /// Requests that took the failure path, by cause.
    Fallback(Cause),
    /// Client-supplied destination headers removed.
    SpoofedHeaders,
    /// Pick round trip, microseconds (histogram).
    PickLatencyUs,
    /// Reports the control plane accepted.
    ReportsSent,
    /// Reports dropped because the queue was full.
    ReportsDropped,
    /// Report calls that failed (their reports are retried).
    ReportErrors,
    /// Picks sent again in full because the control plane no longer held
    /// the elided messages.
    PickResends,
    /// Requests answered 429 because the control plane refused them (every
    /// worker saturated, its admission queue full or their wait too long).
    Overloaded,
    /// Prefill legs the filter ran whose decode leg then went upstream
    /// (`disaggregation.legs: "filter"`).
    PrefillLegs,
    /// Prefill leg round trip, microseconds (histogram).
    PrefillLegUs,
    /// Disaggregated requests served aggregated instead, by cause.
    PrefillFallback(Fallback),
}

/// Counter or histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Monotonic counter.
    Counter,
    /// Histogram of recorded values.
    Histogram,
}

impl Metric {
    /// Number of metrics.
    pub const COUNT: usize = 11 + Cause::ALL.len() + Fallback::ALL.len();

    /// Dense index in `0..COUNT`.
    pub fn index(self) -> usize {
        match self {
            Metric::Requests => 0,
            Metric::Steered => 1,
            Metric::SpoofedHeaders => 2,
            Metric::PickLatencyUs => 3,
            Metric::ReportsSent => 4,
            Metric::ReportsDropped => 5,
            Metric::ReportErrors => 6,
            Metric::PickResends => 7,
            Metric::Overloaded => 8,
            Metric::PrefillLegs => 9,
            Metric::PrefillLegUs => 10,
            Metric::Fallback(c) => 11 + Cause::ALL.iter().position(|x| *x == c).unwrap_or(0),
            Metric::PrefillFallback(f) => {
                11 + Cause::ALL.len() + Fallback::ALL.iter().position(|x| *x == f).unwrap_or(0)
            }
        }
    }

    /// Counter or histogram.
    pub fn kind(self) -> MetricKind {
        match self {
            Metric::PickLatencyUs | Metric::PrefillLegUs => MetricKind::Histogram,
            _ => MetricKind::Counter,
        }
    }

    /// Every metric with its stat name and kind, in index order.
    pub fn all() -> impl Iterator<Item = (Metric, &'static str, MetricKind)> {
        use MetricKind::*;
        [
            (Metric::Requests, "kvgate.requests", Counter),
            (Metric::Steered, "kvgate.steered", Counter),
            (Metric::SpoofedHeaders, "kvgate.spoofed_header_removed", Counter),
            (Metric::PickLatencyUs, "kvgate.pick_latency_us", Histogram),
            (Metric::ReportsSent, "kvgate.reports_sent", Counter),
            (Metric::ReportsDropped, "kvgate.reports_dropped", Counter),
            (Metric::ReportErrors, "kvgate.report_errors", Counter),
            (Metric::PickResends, "kvgate.pick_resends", Counter),
            (Metric::Overloaded, "kvgate.overloaded", Counter),
            (Metric::PrefillLegs, "kvgate.prefill_legs", Counter),
            (Metric::PrefillLegUs, "kvgate.prefill_leg_us", Histogram),
        ]
        .into_iter()
        .chain(Cause::ALL.into_iter().map(|c| (Metric::Fallback(c), fallback_name(c), Counter)))
        .chain(Fallback::ALL.into_iter().map(|f| (Metric::PrefillFallback(f), prefill_fallback_name(f), Counter)))
    }
}

fn prefill_fallback_name(f: Fallback) -> &'static str {
    match f {
        Fallback::BadHeader => "kvgate.prefill_fallback.bad_header",
        Fallback::NotJson => "kvgate.prefill_fallback.not_json",
        Fallback::Unreachable => "kvgate.prefill_fallback.unreachable",
        Fallback::Timeout => "kvgate.prefill_fallback.timeout",
        Fallback::Status => "kvgate.prefill_fallback.status",
        Fallback::NoParams => "kvgate.prefill_fallback.no_params",
    }
}

fn fallback_name(c: Cause) -> &'static str {
    match c {
        Cause::Timeout => "kvgate.fallback.timeout",
        Cause::Unavailable => "kvgate.fallback.unavailable",
        Cause::UnknownModel => "kvgate.fallback.unknown_model",
        Cause::GrpcError => "kvgate.fallback.grpc_error",
        Cause::UnusableAnswer => "kvgate.fallback.unusable_answer",
        Cause::DispatchFailed => "kvgate.fallback.dispatch_failed",
        Cause::BodyTooLarge => "kvgate.fallback.body_too_large",
        Cause::Malformed => "kvgate.fallback.malformed",
        Cause::Unsupported => "kvgate.fallback.unsupported",
    }
}

/// What the filter returns to the host for a header or body callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Go on.
    Continue,
    /// Stop iteration (for a body: and buffer it).
    Pause,
}

/// The host's services. Methods take `&self`: Proxy-Wasm host calls act on
/// the current stream, which the host tracks.
pub trait Host {
    /// Wall clock, nanoseconds since the Unix epoch.
    fn now_ns(&self) -> u64;
    /// A request header (`:method`, `:path` included).
    fn request_header(&self, name: &str) -> Option<String>;
    /// Sets (`Some`) or removes (`None`) a request header.
    fn set_request_header(&self, name: &str, value: Option<&str>);
    /// `len` bytes of the buffered request body from `start`.
    fn request_body(&self, start: usize, len: usize) -> Option<Vec<u8>>;
    /// A response header (`:status` included).
    fn response_header(&self, name: &str) -> Option<String>;
    /// Adds a response header.
    fn add_response_header(&self, name: &str, value: &str);
    /// `len` bytes of the current response body chunk from `start`.
    fn response_body(&self, start: usize, len: usize) -> Option<Vec<u8>>;
    /// The message of the gRPC status of the call that just ended (only
    /// asked on failures). Envoy marks the cause in braces: its own timeout
    /// is `upstream request timeout{response_timeout}`, a status the server
    /// sent ends in `{via_upstream}`.
    fn grpc_status_message(&self) -> Option<String>;
    /// The address of the upstream host that served the stream (Envoy's
    /// `upstream.address`), asked once when the stream ends.
    fn upstream_address(&self) -> Option<String>;
    /// Starts `kvgate.v1.Router/Pick`; returns the call's token.
    fn dispatch_pick(&self, grpc_service: &[u8], message: &[u8], timeout_ms: u32) -> Option<u32>;
    /// Starts an HTTP call through `cluster` (headers include `:method`,
    /// `:path`, `:authority`); returns its token.
    fn dispatch_http(&self, cluster: &str, headers: &[(&str, &str)], body: &[u8], timeout_ms: u32) -> Option<u32>;
    /// Replaces the buffered request body (`old_len` bytes) with `body`.
    fn replace_request_body(&self, old_len: usize, body: &[u8]);
    /// Resumes a paused request.
    fn resume_request(&self);
    /// Answers locally (the request goes no further).
    fn send_local_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]);
    /// Adds to a counter or records into a histogram.
    fn metric(&self, metric: Metric, value: u64);
}
