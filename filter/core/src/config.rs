//! The filter's configuration: the JSON given as the Wasm plugin's
//! `configuration`, parsed and validated once when Envoy configures the
//! plugin. An invalid configuration is refused with a [`ConfigError`] naming
//! the field, the value and the reason, and Envoy rejects the listener.
//!
//! ```json
//! {
//!   "control_plane": { "cluster": "kvgate_control_plane", "authority": "kvgate", "timeout_ms": 50 },
//!   "failure_mode": "open",
//!   "max_body_bytes": 8388608,
//!   "chat_paths": ["/v1/chat/completions"],
//!   "completions_paths": ["/v1/completions"],
//!   "max_fallbacks": 2,
//!   "debug_headers": false,
//!   "retained_conversations": 4096,
//!   "session_header": "x-session-id",
//!   "tenant_header": "x-tenant-id",
//!   "priority_header": "x-priority",
//!   "lora_adapters": { "sql-lora": "llama-3-8b" },
//!   "reports": { "enabled": true, "interval_ms": 1000, "max_batch": 512, "max_queue": 8192, "tail_bytes": 16384,
//!                "first_token": true },
//!   "disaggregation": { "legs": "sidecar", "cluster": "kvgate_prefill", "timeout_ms": 30000 }
//! }
//! ```
//! Every field has the default shown except `lora_adapters` (none); `{}` is
//! a valid configuration.
//!
//! `disaggregation.legs` says who runs the two legs of a request the control
//! plane disaggregates: `"sidecar"` sets `x-prefiller-host-port` for the
//! decode pod's sidecar (llm-d's convention); `"filter"` runs the prefill
//! leg itself, an HTTP call through `cluster` (an `ORIGINAL_DST` cluster
//! that connects to the address in `x-gateway-destination-endpoint`, as
//! `envoy/kvgate.yaml` defines it: the leg reaches that prefill worker or
//! fails, never another worker), and rewrites the body of the decode leg; a prefill leg that fails or outlasts `timeout_ms`
//! leaves the request aggregated on its decode worker.

use std::collections::BTreeMap;

use serde::Deserialize;

/// What happens when no routing decision can be made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureMode {
    /// Forward without the destination header: Envoy's fallback policy
    /// (least request) picks the worker.
    Open,
    /// Answer locally with an error status and a JSON error body.
    Closed,
}

/// Completion-report settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reports {
    /// Send reports at all.
    pub enabled: bool,
    /// Flush period of each Envoy worker thread's queue.
    pub interval_ms: u32,
    /// Most reports in one `Report` call.
    pub max_batch: usize,
    /// Reports kept while the control plane is unreachable; the oldest are
    /// dropped (and counted) beyond it.
    pub max_queue: usize,
    /// Bytes of the response's end kept to find `usage`.
    pub tail_bytes: usize,
    /// Also report a stream's first token when it arrives (its worker's
    /// prefill is over), not only its end.
    pub first_token: bool,
}

/// Who runs the two legs of a disaggregated request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Legs {
    /// The decode pod's sidecar, told by `x-prefiller-host-port`.
    Sidecar,
    /// The filter: an HTTP call to the prefill worker, then the decode leg.
    Filter,
}

/// Disaggregated prefill and decode settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disaggregation {
    /// Who runs the legs.
    pub legs: Legs,
    /// The Envoy cluster of the filter's prefill calls (one that connects
    /// to the address in `x-gateway-destination-endpoint`).
    pub cluster: String,
    /// Longest wait for a prefill leg the filter runs.
    pub timeout_ms: u32,
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Envoy cluster of the control plane (HTTP/2).
    pub cluster: String,
    /// `:authority` of the gRPC calls ("" = the cluster name).
    pub authority: String,
    /// Pick timeout.
    pub timeout_ms: u32,
    /// Failure path.
    pub failure_mode: FailureMode,
    /// Largest body the filter buffers; larger ones pass through unrouted.
    pub max_body_bytes: usize,
    /// Paths of the chat API (query string ignored).
    pub chat_paths: Vec<String>,
    /// Paths of the completions API.
    pub completions_paths: Vec<String>,
    /// Fallback endpoints appended to the header after the primary.
    pub max_fallbacks: usize,
    /// Add `x-kvgate-*` response headers.
    pub debug_headers: bool,
    /// Size of the per-thread table of conversations the control plane said
    /// it retains, whose leading messages are then elided from the Pick
    /// (rounded up to a power of two; 0 = never elide).
    pub retained_conversations: usize,
    /// LoRA adapter name → base model.
    pub lora_adapters: BTreeMap<String, String>,
    /// Request header whose value is the session key sent with the Pick
    /// (lowercase; "" = none sent). The control plane uses it only when
    /// its session affinity is on.
    pub session_header: String,
    /// Request header naming the tenant, sent with the Pick ("" = none):
    /// the control plane's overload protection shares held requests fairly
    /// between tenants.
    pub tenant_header: String,
    /// Request header with the priority class, a digit 0-9 (higher first),
    /// sent with the Pick ("" = none).
    pub priority_header: String,
    /// Completion reports.
    pub reports: Reports,
    /// Disaggregated prefill and decode.
    pub disaggregation: Disaggregation,
    /// The serialized `envoy.config.core.v3.GrpcService` handed to Envoy
    /// for every call (so that the cluster name is never mistaken for a
    /// protobuf).
    pub grpc_service: Vec<u8>,
}

/// A configuration that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The field (dotted path).
    pub field: &'static str,
    /// The offending value, as given.
    pub value: String,
    /// Why it is refused.
    pub reason: &'static str,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "kvgate filter configuration: {} = {}: {}", self.field, self.value, self.reason)
    }
}

impl std::error::Error for ConfigError {}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawControlPlane {
    cluster: Option<String>,
    authority: Option<String>,
    timeout_ms: Option<u32>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawReports {
    enabled: Option<bool>,
    interval_ms: Option<u32>,
    max_batch: Option<usize>,
    max_queue: Option<usize>,
    tail_bytes: Option<usize>,
    first_token: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDisaggregation {
    legs: Option<String>,
    cluster: Option<String>,
    timeout_ms: Option<u32>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    control_plane: RawControlPlane,
    failure_mode: Option<String>,
    max_body_bytes: Option<usize>,
    chat_paths: Option<Vec<String>>,
    completions_paths: Option<Vec<String>>,
    max_fallbacks: Option<usize>,
    debug_headers: Option<bool>,
    retained_conversations: Option<usize>,
    session_header: Option<String>,
    tenant_header: Option<String>,
    priority_header: Option<String>,
    #[serde(default)]
    lora_adapters: BTreeMap<String, String>,
    #[serde(default)]
    reports: RawReports,
    #[serde(default)]
    disaggregation: RawDisaggregation,
}

fn err<T: std::fmt::Display>(field: &'static str, value: T, reason: &'static str) -> ConfigError {
    ConfigError { field, value: value.to_string(), reason }
}

fn range<T: PartialOrd + Copy + std::fmt::Display>(
    field: &'static str,
    v: T,
    lo: T,
    hi: T,
    reason: &'static str,
) -> Result<T, ConfigError> {
    if v < lo || v > hi { Err(err(field, v, reason)) } else { Ok(v) }
}

fn paths(field: &'static str, v: Vec<String>) -> Result<Vec<String>, ConfigError> {
    for p in &v {
        if !p.starts_with('/') || p.contains('?') {
            return Err(err(field, p, "a path starts with '/' and has no query string"));
        }
    }
    Ok(v)
}

/// `GrpcService { envoy_grpc: EnvoyGrpc { cluster_name = 1, authority = 2 } = 1 }`.
fn grpc_service(cluster: &str, authority: &str) -> Vec<u8> {
    let mut inner = Vec::with_capacity(cluster.len() + authority.len() + 8);
    for (tag, v) in [(1u32, cluster), (2, authority)] {
        if !v.is_empty() {
            prost::encoding::encode_key(tag, prost::encoding::WireType::LengthDelimited, &mut inner);
            prost::encoding::encode_varint(v.len() as u64, &mut inner);
            inner.extend_from_slice(v.as_bytes());
        }
    }
    let mut out = Vec::with_capacity(inner.len() + 4);
    prost::encoding::encode_key(1, prost::encoding::WireType::LengthDelimited, &mut out);
    prost::encoding::encode_varint(inner.len() as u64, &mut out);
    out.extend_from_slice(&inner);
    out
}

impl Config {
    /// Parses and validates the plugin configuration (empty = defaults).
    pub fn parse(json: &[u8]) -> Result<Config, ConfigError> {
        let raw: RawConfig = if json.iter().all(u8::is_ascii_whitespace) {
            RawConfig::default()
        } else {
            serde_json::from_slice(json).map_err(|e| ConfigError {
                field: "(document)",
                value: e.to_string(),
                reason: "not a JSON object of the documented fields",
            })?
        };
        let cluster = raw.control_plane.cluster.unwrap_or_else(|| "kvgate_control_plane".into());
        if cluster.is_empty() || cluster.bytes().any(|b| b <= b' ' || b >= 0x7f) {
            return Err(err("control_plane.cluster", &cluster, "must be printable ASCII characters"));
        }
        let authority = raw.control_plane.authority.unwrap_or_default();
        if authority.bytes().any(|b| b <= b' ' || b >= 0x7f) {
            return Err(err("control_plane.authority", &authority, "must be a host[:port] of printable ASCII"));
        }
        // The serialized GrpcService below must be valid UTF-8 (the
        // proxy-wasm API takes it as a string): every length prefix under
        // 128, i.e. cluster + (authority + 2 when set) at most 125 bytes.
        // Istio's cluster names (`outbound|50051||<service FQDN>`) fit.
        let authority_cost = if authority.is_empty() { 0 } else { authority.len() + 2 };
        if cluster.len() + authority_cost > 125 {
            return Err(err(
                "control_plane.cluster",
                &cluster,
                "cluster plus authority (+2 when set) must be at most 125 characters",
            ));
        }
        let timeout_ms = range(
            "control_plane.timeout_ms",
            raw.control_plane.timeout_ms.unwrap_or(50),
            1,
            60_000,
            "must be between 1 and 60000",
        )?;
        let failure_mode = match raw.failure_mode.as_deref().unwrap_or("open") {
            "open" => FailureMode::Open,
            "closed" => FailureMode::Closed,
            other => return Err(err("failure_mode", other, "must be \"open\" or \"closed\"")),
        };
        let max_body_bytes = range(
            "max_body_bytes",
            raw.max_body_bytes.unwrap_or(8 << 20),
            1024,
            256 << 20,
            "must be between 1 KiB and 256 MiB (and not above the listener's buffer limit)",
        )?;
        let chat_paths = paths("chat_paths", raw.chat_paths.unwrap_or_else(|| vec!["/v1/chat/completions".into()]))?;
        let completions_paths =
            paths("completions_paths", raw.completions_paths.unwrap_or_else(|| vec!["/v1/completions".into()]))?;
        if let Some(p) = chat_paths.iter().find(|p| completions_paths.contains(p)) {
            return Err(err("completions_paths", p, "a path cannot be both chat and completions"));
        }
        let max_fallbacks = range("max_fallbacks", raw.max_fallbacks.unwrap_or(2), 0, 16, "must be between 0 and 16")?;
        let retained_conversations = range(
            "retained_conversations",
            raw.retained_conversations.unwrap_or(4096),
            0,
            1 << 20,
            "must be between 0 and 1048576",
        )?;
        for (adapter, base) in &raw.lora_adapters {
            if adapter.is_empty() || base.is_empty() || adapter == base {
                return Err(err("lora_adapters", adapter, "adapter and base model names must be non-empty and differ"));
            }
        }
        let header = |field: &'static str, v: Option<String>, default: &str| {
            let name = v.unwrap_or_else(|| default.into());
            let token = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b);
            if name.bytes().all(token) && name.len() <= 128 {
                Ok(name)
            } else {
                Err(err(field, &name, "must be a lowercase header name (or \"\" for none)"))
            }
        };
        let session_header = header("session_header", raw.session_header, "x-session-id")?;
        let tenant_header = header("tenant_header", raw.tenant_header, "x-tenant-id")?;
        let priority_header = header("priority_header", raw.priority_header, "x-priority")?;
        let r = raw.reports;
        let reports = Reports {
            enabled: r.enabled.unwrap_or(true),
            interval_ms: range(
                "reports.interval_ms",
                r.interval_ms.unwrap_or(1000),
                10,
                600_000,
                "must be between 10 and 600000",
            )?,
            max_batch: range(
                "reports.max_batch",
                r.max_batch.unwrap_or(512),
                1,
                65_536,
                "must be between 1 and 65536",
            )?,
            max_queue: range(
                "reports.max_queue",
                r.max_queue.unwrap_or(8192),
                1,
                1 << 20,
                "must be between 1 and 1048576",
            )?,
            tail_bytes: range(
                "reports.tail_bytes",
                r.tail_bytes.unwrap_or(16 << 10),
                256,
                1 << 20,
                "must be between 256 and 1048576",
            )?,
            first_token: r.first_token.unwrap_or(true),
        };
        if reports.max_batch > reports.max_queue {
            return Err(err("reports.max_batch", reports.max_batch, "cannot exceed reports.max_queue"));
        }
        let d = raw.disaggregation;
        let legs = match d.legs.as_deref().unwrap_or("sidecar") {
            "sidecar" => Legs::Sidecar,
            "filter" => Legs::Filter,
            other => return Err(err("disaggregation.legs", other, "must be \"sidecar\" or \"filter\"")),
        };
        let prefill_cluster = d.cluster.unwrap_or_else(|| "kvgate_prefill".into());
        if prefill_cluster.is_empty() || prefill_cluster.bytes().any(|b| b <= b' ' || b >= 0x7f) {
            return Err(err("disaggregation.cluster", &prefill_cluster, "must be printable ASCII characters"));
        }
        let disaggregation = Disaggregation {
            legs,
            cluster: prefill_cluster,
            timeout_ms: range(
                "disaggregation.timeout_ms",
                d.timeout_ms.unwrap_or(30_000),
                1,
                600_000,
                "must be between 1 and 600000",
            )?,
        };
        let grpc_service = grpc_service(&cluster, &authority);
        Ok(Config {
            cluster,
            authority,
            timeout_ms,
            failure_mode,
            max_body_bytes,
            chat_paths,
            completions_paths,
            max_fallbacks,
            debug_headers: raw.debug_headers.unwrap_or(false),
            retained_conversations,
            lora_adapters: raw.lora_adapters,
            session_header,
            tenant_header,
            priority_header,
            reports,
            disaggregation,
            grpc_service,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_cluster_names_fit_while_the_grpc_service_stays_utf8() {
        let cfg = |c: &str, a: &str| {
            let json = format!(r#"{{"control_plane":{{"cluster":"{c}","authority":"{a}"}}}}"#);
            Config::parse(json.as_bytes())
        };
        // Istio's cluster for a Service, with its FQDN as authority.
        let istio = cfg(
            "outbound|50051||kvgate-control-plane.kvgate.svc.cluster.local",
            "kvgate-control-plane.kvgate.svc.cluster.local",
        )
        .unwrap();
        assert!(std::str::from_utf8(&istio.grpc_service).is_ok());
        // At the limit: still UTF-8; one byte more is refused.
        let c = "c".repeat(100);
        let at = cfg(&c, &"a".repeat(23)).unwrap();
        assert!(std::str::from_utf8(&at.grpc_service).is_ok());
        assert!(std::str::from_utf8(&cfg(&"c".repeat(125), "").unwrap().grpc_service).is_ok());
        assert_eq!(cfg(&c, &"a".repeat(24)).unwrap_err().field, "control_plane.cluster");
        assert!(cfg(&"c".repeat(126), "").is_err());
    }

    #[test]
    fn defaults_and_full() {
        let d = Config::parse(b"").unwrap();
        assert_eq!(d, Config::parse(b"{}").unwrap());
        assert_eq!((d.timeout_ms, d.failure_mode, d.max_fallbacks), (50, FailureMode::Open, 2));
        assert_eq!(d.chat_paths, vec!["/v1/chat/completions"]);
        // GrpcService{envoy_grpc{cluster_name: "kvgate_control_plane"}}
        let mut want = vec![0x0a, 22, 0x0a, 20];
        want.extend_from_slice(b"kvgate_control_plane");
        assert_eq!(d.grpc_service, want);
        let f = Config::parse(
            br#"{"control_plane":{"cluster":"cp","authority":"cp.kvgate:9000","timeout_ms":20},
                 "failure_mode":"closed","max_body_bytes":2048,"chat_paths":["/chat"],"completions_paths":[],
                 "max_fallbacks":0,"debug_headers":true,"lora_adapters":{"a":"b"},
                 "reports":{"enabled":false,"interval_ms":50,"max_batch":2,"max_queue":3,"tail_bytes":300,
                            "first_token":false}}"#,
        )
        .unwrap();
        assert_eq!(f.failure_mode, FailureMode::Closed);
        assert!(d.reports.first_token && !f.reports.first_token);
        assert_eq!(f.lora_adapters.get("a").map(String::as_str), Some("b"));
        assert_eq!(f.reports.max_queue, 3);
        assert!(f.grpc_service.ends_with(b"cp.kvgate:9000"));
        assert_eq!(d.session_header, "x-session-id");
        assert_eq!(Config::parse(br#"{"session_header":""}"#).unwrap().session_header, "");
        assert_eq!(Config::parse(br#"{"session_header":"x-conv"}"#).unwrap().session_header, "x-conv");
        let want = Disaggregation { legs: Legs::Sidecar, cluster: "kvgate_prefill".into(), timeout_ms: 30_000 };
        assert_eq!(d.disaggregation, want);
        let own = Config::parse(br#"{"disaggregation":{"legs":"filter","cluster":"pool","timeout_ms":900}}"#).unwrap();
        let want = Disaggregation { legs: Legs::Filter, cluster: "pool".into(), timeout_ms: 900 };
        assert_eq!(own.disaggregation, want);
    }

    #[test]
    fn errors_name_field_value_and_reason() {
        let e = |j: &str| Config::parse(j.as_bytes()).unwrap_err();
        assert_eq!(e(r#"{"failure_mode":"maybe"}"#).field, "failure_mode");
        assert_eq!(e(r#"{"failure_mode":"maybe"}"#).value, "maybe");
        assert_eq!(e(r#"{"control_plane":{"timeout_ms":0}}"#).field, "control_plane.timeout_ms");
        assert_eq!(e(r#"{"max_body_bytes":10}"#).field, "max_body_bytes");
        assert_eq!(e(r#"{"chat_paths":["v1/chat"]}"#).field, "chat_paths");
        assert_eq!(e(r#"{"chat_paths":["/a"],"completions_paths":["/a"]}"#).field, "completions_paths");
        assert_eq!(e(r#"{"reports":{"max_batch":10,"max_queue":5}}"#).field, "reports.max_batch");
        assert_eq!(e(r#"{"lora_adapters":{"x":""}}"#).field, "lora_adapters");
        assert_eq!(e(r#"{"session_header":"X-Session"}"#).field, "session_header");
        assert_eq!(e(r#"{"session_header":"a b"}"#).field, "session_header");
        assert_eq!(e(r#"{"tenant_header":"Tenant"}"#).field, "tenant_header");
        assert_eq!(e(r#"{"priority_header":"x prio"}"#).field, "priority_header");
        assert_eq!(e(r#"{"disaggregation":{"legs":"both"}}"#).field, "disaggregation.legs");
        assert_eq!(e(r#"{"disaggregation":{"cluster":"a b"}}"#).field, "disaggregation.cluster");
        assert_eq!(e(r#"{"disaggregation":{"timeout_ms":0}}"#).field, "disaggregation.timeout_ms");
        assert_eq!(e(r#"{"nope":1}"#).field, "(document)");
        assert!(e(r#"{"nope":1}"#).value.contains("nope"));
        assert!(e(r#"{"failure_mode":"maybe"}"#).to_string().contains("must be"));
    }
}
