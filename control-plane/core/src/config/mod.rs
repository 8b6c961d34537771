//! Configuration: a TOML file, overridden by environment variables and flags
//! (the binary maps those onto [`RawConfig`]), validated once into
//! [`Config`]. Every error names the field, the value and the reason.
//!
//! ```toml
//! listen_grpc = "127.0.0.1:50051"      # Pick / Report / grpc.health.v1
//! listen_admin = "127.0.0.1:9091"      # /metrics, /admin/* (loopback by default)
//! nats_url = "nats://127.0.0.1:4222"
//! subject_prefix = "kvgate.v1"
//! replica_id = "cp-0"                  # default: hostname-pid
//! max_prompt_bytes = 8388608           # sum of message / prompt bytes
//! max_segments = 4096                  # chat messages per request
//! snapshot_timeout_ms = 3000
//! token_cache_tokens = 8388608         # per model
//! tokenize_verify_every = 1000         # sampled whole-prompt check, 0 = off
//! ingest_shed_after_ms = 2000          # events processed this far behind: Picks by load, 0 = never
//! # TLS on the gRPC port (all three unset = plaintext):
//! tls_cert_file = "/etc/kvgate-tls/tls.crt"
//! tls_key_file = "/etc/kvgate-tls/tls.key"
//! tls_client_ca_file = "/etc/kvgate-tls/ca.crt"   # clients need a certificate it signed
//!
//! [[models]]
//! name = "deepseek-v3"
//! tokenizer_dir = "/models/deepseek-v3" # tokenizer.json + chat_template.jinja
//! block_size = 16
//! mode = "kv"                           # kv | approx | least_load | round_robin | random
//! default_output_tokens = 256
//! heartbeat_timeout_ms = 0              # 0 = 3 heartbeat intervals
//! inflight_ttl_ms = 600000
//! suspect_after_failures = 2            # connection failures (filter reports) that
//! suspect_ms = 3000                     #   take a worker out of routing this long; 0 = off
//! allowed_endpoints = ["10.0.0.0/8"]    # endpoints relays may claim (ip:port, ip, ip/len); default: any
//! workers = [{ id = "w0", endpoint = "10.0.0.5:8000" }]   # optional static workers
//! index_shards = 1                      # index shards: KV batches of several workers applied on this many threads
//! [models.session]                      # session affinity (x-session-id, see the filter)
//! enabled = false                       # keep a session on its worker unless saturated or gone
//! ttl_ms = 600000                       # a pin lapses this long after the session's last request
//! max_sessions = 1000000                # sessions pinned at once; more are routed by the policy
//! [models.overload]                     # hold requests while every worker is saturated
//! enabled = false                       #   (x-tenant-id / x-priority, see the filter)
//! max_queued = 1024                     # more are answered 429
//! max_wait_ms = 5000                    # held longer: 429; keep below the filter's timeout_ms
//! quantum_tokens = 8192                 # fair-queue quantum (prompt tokens per tenant per round)
//! [models.kv]                           # optional weights (kvgate_scheduler::KvConfig)
//! unit = "time"                         # time | blocks (Dynamo's cost)
//! learn_timing = true                  # learn the engine's timing online (below: priors)
//! fading_load = true                    # price decode by the load it lives with (measured)
//! prefill_ms_per_token = 0.1            # prior: engine prefill time per token
//! decode_ms_per_seq = 0.5               # prior: decode step time per running request
//! overlap_weight = 1.0
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::model::ModelConfig;

mod model;

/// A configuration error: which field, which value, why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {field} = {value:?}: {reason}")]
pub struct ConfigError {
    /// Dotted path of the field (`models[0].block_size`).
    pub field: String,
    /// The offending value as given.
    pub value: String,
    /// Why it is refused.
    pub reason: String,
}

fn err(field: impl Into<String>, value: impl ToString, reason: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), value: value.to_string(), reason: reason.into() }
}

/// Optional `kv` weights in the file.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawKv {
    /// `time` (default) or `blocks`: see [`KvConfig::unit`].
    pub unit: Option<String>,
    /// See [`KvConfig::prefill_ms_per_token`].
    pub prefill_ms_per_token: Option<f64>,
    /// See [`KvConfig::decode_ms_per_seq`].
    pub decode_ms_per_seq: Option<f64>,
    /// Learn the engine's timing online (default true); false uses
    /// `prefill_ms_per_token` and `decode_ms_per_seq` as given.
    pub learn_timing: Option<bool>,
    /// Price a request's decode by the load it lives with on average while
    /// later decisions even differences out, as measured (default true).
    pub fading_load: Option<bool>,
    /// See [`KvConfig::ttft_weight`].
    pub ttft_weight: Option<f64>,
    /// See [`KvConfig::overlap_weight`].
    pub overlap_weight: Option<f64>,
    /// See [`KvConfig::pending_weight`].
    pub pending_weight: Option<f64>,
    /// See [`KvConfig::decode_weight`].
    pub decode_weight: Option<f64>,
    /// See [`KvConfig::host_hit_weight`].
    pub host_hit_weight: Option<f64>,
    /// See [`KvConfig::inflight_hit_weight`].
    pub inflight_hit_weight: Option<f64>,
    /// See [`KvConfig::inflight_wait_weight`].
    pub inflight_wait_weight: Option<f64>,
    /// See [`KvConfig::queue_penalty_blocks`].
    pub queue_penalty_blocks: Option<f64>,
    /// See [`KvConfig::tie_epsilon`].
    pub tie_epsilon: Option<f64>,
    /// See [`KvConfig::temperature`].
    pub temperature: Option<f64>,
    /// See [`KvConfig::fallbacks`].
    pub fallbacks: Option<usize>,
}

/// A static worker in the file.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RawWorker {
    /// Worker id.
    pub id: String,
    /// `ip:port` Envoy knows it by.
    pub endpoint: String,
}

/// One model in the file.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    /// `model` as clients send it.
    pub name: String,
    /// Directory with `tokenizer.json` and `chat_template.jinja`; without it
    /// only token-id prompts are routed by KV, other requests by load.
    pub tokenizer_dir: Option<PathBuf>,
    /// Tokens per block.
    pub block_size: Option<u32>,
    /// Routing mode.
    pub mode: Option<String>,
    /// Output tokens assumed without `max_tokens`.
    pub default_output_tokens: Option<u32>,
    /// Heartbeat timeout (0 = 3 intervals).
    pub heartbeat_timeout_ms: Option<u64>,
    /// In-flight request TTL.
    pub inflight_ttl_ms: Option<u64>,
    /// Connection failures to a worker (from the filter's reports) within
    /// `suspect_ms` that make it a suspect (0 = never).
    pub suspect_after_failures: Option<u32>,
    /// How long a suspect worker gets no Pick.
    pub suspect_ms: Option<u64>,
    /// Endpoints relays may claim (`ip:port`, `ip`, `ip/len`); empty = any.
    #[serde(default)]
    pub allowed_endpoints: Vec<String>,
    /// Static workers.
    #[serde(default)]
    pub workers: Vec<RawWorker>,
    /// `kv` weights.
    pub kv: Option<RawKv>,
    /// Session affinity.
    pub session: Option<RawSession>,
    /// Overload protection.
    pub overload: Option<RawOverload>,
    /// Disaggregated prefill and decode.
    pub disaggregation: Option<RawDisaggregation>,
    /// Shards of the block index: KV batches from several workers applied
    /// on this many threads (1–64, default 1).
    pub index_shards: Option<u16>,
}

/// Optional `[models.disaggregation]` table: when a request's prefill goes
/// to a `prefill` worker (only fleets with prefill workers are affected).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawDisaggregation {
    /// Disaggregate when prefill workers exist (default true).
    pub enabled: Option<bool>,
    /// Uncached prompt tokens on the decode worker from which the prefill
    /// goes to a prefill worker; unset = derived from the learned timing
    /// and `max_local_prefill_ms`.
    pub min_uncached_tokens: Option<u32>,
    /// A local prefill the learned timing says would take this long or
    /// longer goes to a prefill worker (default 100 ms).
    pub max_local_prefill_ms: Option<f64>,
    /// A prefill worker takes a leg only when it would finish that prefill
    /// no later than the decode worker would locally (default true).
    pub only_if_sooner: Option<bool>,
    /// With `only_if_sooner`: how much the stall of the decodes running on
    /// the decode worker counts against the new request's TTFT (default 4;
    /// 0 = only the new request's TTFT).
    pub stall_weight: Option<f64>,
    /// `both` workers take prefill legs too (default false; every worker
    /// must run a KV connector as `kv_both`).
    pub prefill_on_both: Option<bool>,
    /// A `prefill` worker takes a whole request when the chosen decode
    /// worker is saturated (default false).
    pub overflow_to_prefill: Option<bool>,
}

/// Optional `[models.overload]` table: requests held while every worker is
/// saturated, released fairly between tenants.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RawOverload {
    /// Hold requests while the fleet is saturated (default false).
    pub enabled: Option<bool>,
    /// Most requests held at once (default 1024); more are refused (429).
    pub max_queued: Option<usize>,
    /// Longest a request is held (default 5000 ms); then refused (429).
    pub max_wait_ms: Option<u64>,
    /// Prompt tokens credited to a tenant per round of the fair queue
    /// (default 8192).
    pub quantum_tokens: Option<u64>,
}

/// Optional `[models.session]` table: session affinity.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RawSession {
    /// Keep a session on its worker (default false).
    pub enabled: Option<bool>,
    /// A pin lapses this long after the session's last request (default
    /// 600000 ms).
    pub ttl_ms: Option<u64>,
    /// Most sessions pinned at once (default 1000000).
    pub max_sessions: Option<usize>,
}

/// The file as parsed, before validation. Flags and environment variables
/// overwrite its fields.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// gRPC listen address.
    pub listen_grpc: Option<String>,
    /// Admin / metrics listen address.
    pub listen_admin: Option<String>,
    /// NATS server URL; none = no NATS (static workers only).
    pub nats_url: Option<String>,
    /// Subject prefix.
    pub subject_prefix: Option<String>,
    /// This replica's id.
    pub replica_id: Option<String>,
    /// Largest prompt accepted (bytes).
    pub max_prompt_bytes: Option<usize>,
    /// Most chat messages accepted.
    pub max_segments: Option<usize>,
    /// Snapshot timeout.
    pub snapshot_timeout_ms: Option<u64>,
    /// Token cache budget per model.
    pub token_cache_tokens: Option<usize>,
    /// Sampled verification of chunked tokenization.
    pub tokenize_verify_every: Option<u64>,
    /// Event stream processed this far behind (ms): Picks are routed by
    /// load, unscored, until it catches up; 0 = never.
    pub ingest_shed_after_ms: Option<u64>,
    /// PEM certificate chain served on the gRPC port; with `tls_key_file`,
    /// the port speaks TLS only.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
    /// PEM CA bundle: when set, every gRPC client must present a
    /// certificate it signed (mutual TLS).
    pub tls_client_ca_file: Option<PathBuf>,
    /// Models.
    #[serde(default)]
    pub models: Vec<RawModel>,
}

impl RawConfig {
    /// Parses a TOML text.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| err(origin, "<file>", e.to_string().trim().replace('\n', " ")))
    }
}

/// One model, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSettings {
    /// Routing settings.
    pub routing: ModelConfig,
    /// Tokenizer directory.
    pub tokenizer_dir: Option<PathBuf>,
}

/// TLS on the gRPC port, validated: the files existed and held PEM when the
/// configuration was read (they are loaded again at start).
#[derive(Debug, Clone, PartialEq)]
pub struct TlsFiles {
    /// Certificate chain.
    pub cert: PathBuf,
    /// Private key.
    pub key: PathBuf,
    /// CA of the clients' certificates; `None` = no client certificate asked.
    pub client_ca: Option<PathBuf>,
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// gRPC listen address.
    pub listen_grpc: SocketAddr,
    /// Admin listen address.
    pub listen_admin: Option<SocketAddr>,
    /// NATS URL.
    pub nats_url: Option<String>,
    /// Subjects.
    pub subject_prefix: String,
    /// Replica id.
    pub replica_id: String,
    /// Largest prompt (bytes).
    pub max_prompt_bytes: usize,
    /// Most chat messages.
    pub max_segments: usize,
    /// Snapshot timeout.
    pub snapshot_timeout_ms: u64,
    /// Token cache budget per model.
    pub token_cache_tokens: usize,
    /// Sampled verification period.
    pub tokenize_verify_every: u64,
    /// Picks are routed by load while the event stream is processed this
    /// far behind, ms (0 = never).
    pub ingest_shed_after_ms: u64,
    /// TLS on the gRPC port (`None` = plaintext).
    pub tls: Option<TlsFiles>,
    /// Models.
    pub models: Vec<ModelSettings>,
}

/// Default of `ingest_shed_after_ms` (docs/DECISIONS.md, "Picks give way
/// to ingest").
pub const DEFAULT_SHED_AFTER_MS: u64 = 2000;

fn addr(field: &str, v: &str) -> Result<SocketAddr, ConfigError> {
    v.parse().map_err(|_| err(field, v, "expected ip:port, e.g. 127.0.0.1:50051"))
}

fn weight(field: String, v: Option<f64>, default: f64) -> Result<f64, ConfigError> {
    let x = v.unwrap_or(default);
    if x.is_finite() && x >= 0.0 { Ok(x) } else { Err(err(field, x, "must be a finite number ≥ 0")) }
}

/// A PEM file that exists and holds a block of one of `labels`
/// (`CERTIFICATE`, `PRIVATE KEY`, …).
fn pem_file(field: &str, path: &Path, labels: &[&str]) -> Result<(), ConfigError> {
    let text = std::fs::read(path).map_err(|e| err(field, path.display(), format!("cannot read: {e}")))?;
    let text = String::from_utf8_lossy(&text);
    let found = labels.iter().any(|l| text.contains(&format!("-----BEGIN {l}-----")));
    if found {
        Ok(())
    } else {
        Err(err(field, path.display(), format!("no PEM block of {} in this file", labels.join(" / "))))
    }
}

fn tls_files(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
) -> Result<Option<TlsFiles>, ConfigError> {
    let empty = |p: Option<PathBuf>| p.filter(|p| !p.as_os_str().is_empty());
    match (empty(cert), empty(key), empty(client_ca)) {
        (None, None, None) => Ok(None),
        (Some(cert), Some(key), client_ca) => {
            pem_file("tls_cert_file", &cert, &["CERTIFICATE"])?;
            pem_file("tls_key_file", &key, &["PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"])?;
            if let Some(ca) = &client_ca {
                pem_file("tls_client_ca_file", ca, &["CERTIFICATE"])?;
            }
            Ok(Some(TlsFiles { cert, key, client_ca }))
        }
        (None, Some(_), _) | (None, None, Some(_)) => {
            Err(err("tls_cert_file", "<missing>", "required with tls_key_file or tls_client_ca_file"))
        }
        (Some(_), None, _) => Err(err("tls_key_file", "<missing>", "required with tls_cert_file")),
    }
}

impl Config {
    /// Validates a raw configuration.
    pub fn validate(raw: RawConfig) -> Result<Self, ConfigError> {
        let listen_grpc = addr("listen_grpc", raw.listen_grpc.as_deref().unwrap_or("127.0.0.1:50051"))?;
        let listen_admin = match raw.listen_admin.as_deref() {
            Some("") | Some("off") => None,
            Some(v) => Some(addr("listen_admin", v)?),
            None => Some(addr("listen_admin", "127.0.0.1:9091")?),
        };
        let nats_url = match raw.nats_url {
            Some(u) if u.is_empty() || u == "off" => None,
            Some(u) => {
                if !(u.starts_with("nats://") || u.starts_with("tls://") || u.contains(':')) {
                    return Err(err("nats_url", u, "expected nats://host:port"));
                }
                Some(u)
            }
            None => None,
        };
        let subject_prefix = raw.subject_prefix.unwrap_or_else(|| kvgate_protocol::subject::DEFAULT_PREFIX.to_owned());
        if let Err(e) = kvgate_protocol::subject::Subjects::new(&subject_prefix) {
            return Err(err("subject_prefix", &subject_prefix, e.to_string()));
        }
        let replica_id = raw.replica_id.filter(|r| !r.is_empty()).unwrap_or_else(|| {
            let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default().trim().to_owned();
            format!("{}-{}", if host.is_empty() { "kvgate" } else { &host }, std::process::id())
        });
        let max_prompt_bytes = raw.max_prompt_bytes.unwrap_or(8 << 20);
        if max_prompt_bytes == 0 {
            return Err(err("max_prompt_bytes", 0, "must be > 0"));
        }
        let max_segments = raw.max_segments.unwrap_or(4096);
        if max_segments == 0 {
            return Err(err("max_segments", 0, "must be > 0"));
        }
        let snapshot_timeout_ms = raw.snapshot_timeout_ms.unwrap_or(3000);
        if snapshot_timeout_ms < 10 {
            return Err(err("snapshot_timeout_ms", snapshot_timeout_ms, "must be ≥ 10"));
        }
        let tls = tls_files(raw.tls_cert_file, raw.tls_key_file, raw.tls_client_ca_file)?;
        if raw.models.is_empty() {
            return Err(err("models", "[]", "at least one model is required"));
        }
        let mut models: Vec<ModelSettings> = Vec::new();
        for (i, m) in raw.models.into_iter().enumerate() {
            if models.iter().any(|x| x.routing.name == m.name) {
                return Err(err(format!("models[{i}].name"), &m.name, "duplicate model"));
            }
            models.push(model::validate(i, m)?);
        }
        Ok(Self {
            listen_grpc,
            listen_admin,
            nats_url,
            subject_prefix,
            replica_id,
            max_prompt_bytes,
            max_segments,
            snapshot_timeout_ms,
            token_cache_tokens: raw.token_cache_tokens.unwrap_or(8 << 20),
            tokenize_verify_every: raw.tokenize_verify_every.unwrap_or(1000),
            ingest_shed_after_ms: raw.ingest_shed_after_ms.unwrap_or(DEFAULT_SHED_AFTER_MS),
            tls,
            models,
        })
    }
}

#[cfg(test)]
mod tests;
