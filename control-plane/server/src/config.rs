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
//! [models.kv]                           # optional weights (kvgate_scheduler::KvConfig)
//! unit = "time"                         # time | blocks (Dynamo's cost)
//! prefill_ms_per_token = 0.08           # engine prefill time per token
//! decode_ms_per_seq = 0.65              # decode step time per running request
//! overlap_weight = 1.0
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use kvgate_protocol::BlockSize;
use kvgate_scheduler::{CostUnit, KvConfig, Mode};
use serde::Deserialize;

use crate::model::ModelConfig;

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
    /// TLS on the gRPC port (`None` = plaintext).
    pub tls: Option<TlsFiles>,
    /// Models.
    pub models: Vec<ModelSettings>,
}

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
        let mut models = Vec::new();
        for (i, m) in raw.models.into_iter().enumerate() {
            let f = |name: &str| format!("models[{i}].{name}");
            if m.name.is_empty() {
                return Err(err(f("name"), "", "must not be empty"));
            }
            if models.iter().any(|x: &ModelSettings| x.routing.name == m.name) {
                return Err(err(f("name"), &m.name, "duplicate model"));
            }
            let bs = m.block_size.ok_or_else(|| err(f("block_size"), "<missing>", "required (tokens per KV block)"))?;
            let block_size = BlockSize::new(bs).map_err(|_| err(f("block_size"), bs, "must be > 0"))?;
            let mode_s = m.mode.unwrap_or_else(|| "kv".into());
            let mode: Mode = mode_s.parse().map_err(|e: String| err(f("mode"), &mode_s, e))?;
            if let Some(dir) = &m.tokenizer_dir
                && !dir.join("tokenizer.json").is_file()
            {
                return Err(err(f("tokenizer_dir"), dir.display(), "no tokenizer.json in this directory"));
            }
            let d = KvConfig::default();
            let k = m.kv.unwrap_or_default();
            let unit = match &k.unit {
                None => d.unit,
                Some(u) => u.parse().map_err(|e: String| err(f("kv.unit"), u, e))?,
            };
            // Each weight: `kv.<name>` in the file, else the default; finite, ≥ 0.
            macro_rules! w {
                ($name:ident) => {
                    weight(f(concat!("kv.", stringify!($name))), k.$name, d.$name)?
                };
            }
            let kv = KvConfig {
                unit,
                prefill_ms_per_token: w!(prefill_ms_per_token),
                decode_ms_per_seq: w!(decode_ms_per_seq),
                ttft_weight: w!(ttft_weight),
                overlap_weight: w!(overlap_weight),
                pending_weight: w!(pending_weight),
                decode_weight: w!(decode_weight),
                host_hit_weight: w!(host_hit_weight),
                inflight_hit_weight: w!(inflight_hit_weight),
                queue_penalty_blocks: w!(queue_penalty_blocks),
                tie_epsilon: w!(tie_epsilon),
                temperature: w!(temperature),
                fallbacks: k.fallbacks.unwrap_or(d.fallbacks),
            };
            if kv.unit == CostUnit::Time && kv.prefill_ms_per_token <= 0.0 {
                return Err(err(
                    f("kv.prefill_ms_per_token"),
                    kv.prefill_ms_per_token,
                    "must be > 0 with unit = \"time\"",
                ));
            }
            if kv.host_hit_weight > 1.0 {
                return Err(err(f("kv.host_hit_weight"), kv.host_hit_weight, "must be in [0, 1]"));
            }
            if kv.inflight_hit_weight > 1.0 {
                return Err(err(f("kv.inflight_hit_weight"), kv.inflight_hit_weight, "must be in [0, 1]"));
            }
            let mut static_workers = Vec::new();
            for (j, w) in m.workers.into_iter().enumerate() {
                if w.id.is_empty() {
                    return Err(err(format!("models[{i}].workers[{j}].id"), "", "must not be empty"));
                }
                if w.endpoint.parse::<SocketAddr>().is_err() {
                    return Err(err(format!("models[{i}].workers[{j}].endpoint"), &w.endpoint, "expected ip:port"));
                }
                static_workers.push((w.id, w.endpoint));
            }
            let inflight_ttl_ms = m.inflight_ttl_ms.unwrap_or(600_000);
            if inflight_ttl_ms < 1000 {
                return Err(err(f("inflight_ttl_ms"), inflight_ttl_ms, "must be ≥ 1000"));
            }
            let mut allowed_endpoints = Vec::new();
            for (j, e) in m.allowed_endpoints.iter().enumerate() {
                let rule = crate::endpoints::EndpointRule::parse(e)
                    .map_err(|why| err(format!("models[{i}].allowed_endpoints[{j}]"), e, why))?;
                allowed_endpoints.push(rule);
            }
            let suspect_ms = m.suspect_ms.unwrap_or(3000);
            if !(100..=600_000).contains(&suspect_ms) {
                return Err(err(f("suspect_ms"), suspect_ms, "must be between 100 and 600000"));
            }
            models.push(ModelSettings {
                routing: ModelConfig {
                    name: m.name,
                    block_size,
                    mode,
                    kv,
                    default_output_tokens: m.default_output_tokens.unwrap_or(256),
                    static_workers,
                    heartbeat_timeout_ms: m.heartbeat_timeout_ms.unwrap_or(0),
                    inflight_ttl_ms,
                    suspect_after_failures: m.suspect_after_failures.unwrap_or(2),
                    suspect_ms,
                    allowed_endpoints,
                },
                tokenizer_dir: m.tokenizer_dir,
            });
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
            tls,
            models,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(name: &str) -> RawModel {
        RawModel { name: name.into(), block_size: Some(16), ..Default::default() }
    }

    #[test]
    fn errors_name_field_value_and_reason() {
        let mut raw = RawConfig { models: vec![model("m")], ..Default::default() };
        raw.models[0].block_size = Some(0);
        let e = Config::validate(raw).unwrap_err();
        assert_eq!(e.field, "models[0].block_size");
        assert_eq!(e.value, "0");
        assert!(e.to_string().contains("must be > 0"), "{e}");

        let mut raw = RawConfig { models: vec![model("m")], ..Default::default() };
        raw.models[0].mode = Some("fastest".into());
        let e = Config::validate(raw).unwrap_err();
        assert_eq!((e.field.as_str(), e.value.as_str()), ("models[0].mode", "fastest"));

        let raw = RawConfig { listen_grpc: Some("localhost".into()), models: vec![model("m")], ..Default::default() };
        assert_eq!(Config::validate(raw).unwrap_err().field, "listen_grpc");

        let raw = RawConfig { models: vec![model("m"), model("m")], ..Default::default() };
        assert_eq!(Config::validate(raw).unwrap_err().reason, "duplicate model");

        let mut raw = RawConfig { models: vec![model("m")], ..Default::default() };
        raw.models[0].kv = Some(RawKv { temperature: Some(f64::NAN), ..Default::default() });
        assert_eq!(Config::validate(raw).unwrap_err().field, "models[0].kv.temperature");

        assert_eq!(Config::validate(RawConfig::default()).unwrap_err().field, "models");
    }

    #[test]
    fn toml_file_parses_and_rejects_unknown_fields() {
        let raw = RawConfig::from_toml(
            "listen_grpc = \"127.0.0.1:0\"\n[[models]]\nname = \"m\"\nblock_size = 32\nmode = \"round_robin\"\nworkers = [{ id = \"a\", endpoint = \"127.0.0.1:8000\" }]\n[models.kv]\noverlap_weight = 2.0\n",
            "config.toml",
        )
        .unwrap();
        let c = Config::validate(raw).unwrap();
        assert_eq!(c.models[0].routing.block_size.get(), 32);
        assert_eq!(c.models[0].routing.mode, Mode::RoundRobin);
        assert_eq!(c.models[0].routing.kv.overlap_weight, 2.0);
        assert_eq!(c.models[0].routing.kv.unit, CostUnit::Time);
        let blocks = "listen_grpc = \"127.0.0.1:0\"\n[[models]]\nname = \"m\"\nblock_size = 32\n[models.kv]\nunit = \"blocks\"\n";
        let b = Config::validate(RawConfig::from_toml(blocks, "config.toml").unwrap()).unwrap();
        assert_eq!(b.models[0].routing.kv.unit, CostUnit::Blocks);
        let bad = blocks.replace("\"blocks\"", "\"tokens\"");
        let e = Config::validate(RawConfig::from_toml(&bad, "config.toml").unwrap()).unwrap_err();
        assert_eq!((e.field.as_str(), e.value.as_str()), ("models[0].kv.unit", "tokens"), "{e}");
        let zero = "listen_grpc = \"127.0.0.1:0\"\n[[models]]\nname = \"m\"\nblock_size = 32\n[models.kv]\nprefill_ms_per_token = 0.0\n";
        let e = Config::validate(RawConfig::from_toml(zero, "config.toml").unwrap()).unwrap_err();
        assert_eq!(e.field, "models[0].kv.prefill_ms_per_token", "{e}");
        let negative = zero.replace("prefill_ms_per_token = 0.0", "ttft_weight = -1.0");
        let e = Config::validate(RawConfig::from_toml(&negative, "config.toml").unwrap()).unwrap_err();
        assert_eq!((e.field.as_str(), e.value.as_str()), ("models[0].kv.ttft_weight", "-1"), "{e}");
        assert_eq!(c.models[0].routing.static_workers, vec![("a".to_owned(), "127.0.0.1:8000".to_owned())]);
        let e = RawConfig::from_toml("listen_grpcc = \"x\"\n", "config.toml").unwrap_err();
        assert_eq!(e.field, "config.toml");
        assert!(e.reason.contains("listen_grpcc"), "{e}");
    }

    #[test]
    fn tls_files_come_together_and_hold_pem() {
        let dir = std::env::temp_dir().join(format!("kvgate-tls-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cert = dir.join("tls.crt");
        let key = dir.join("tls.key");
        let junk = dir.join("junk.pem");
        std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n").unwrap();
        std::fs::write(&key, "-----BEGIN PRIVATE KEY-----\nAA==\n-----END PRIVATE KEY-----\n").unwrap();
        std::fs::write(&junk, "not pem").unwrap();
        let with = |c: Option<&Path>, k: Option<&Path>, ca: Option<&Path>| {
            Config::validate(RawConfig {
                tls_cert_file: c.map(Path::to_path_buf),
                tls_key_file: k.map(Path::to_path_buf),
                tls_client_ca_file: ca.map(Path::to_path_buf),
                models: vec![model("m")],
                ..Default::default()
            })
        };
        assert_eq!(with(None, None, None).unwrap().tls, None);
        let t = with(Some(&cert), Some(&key), Some(&cert)).unwrap().tls.unwrap();
        assert_eq!((t.cert, t.key, t.client_ca), (cert.clone(), key.clone(), Some(cert.clone())));
        assert_eq!(with(Some(&cert), Some(&key), None).unwrap().tls.unwrap().client_ca, None);
        // An empty value (an unset environment variable in a manifest) is unset.
        assert_eq!(with(Some(Path::new("")), Some(Path::new("")), None).unwrap().tls, None);

        let e = with(Some(&cert), None, None).unwrap_err();
        assert_eq!((e.field.as_str(), e.reason.as_str()), ("tls_key_file", "required with tls_cert_file"));
        assert_eq!(with(None, Some(&key), None).unwrap_err().field, "tls_cert_file");
        assert_eq!(with(None, None, Some(&cert)).unwrap_err().field, "tls_cert_file");
        let e = with(Some(&junk), Some(&key), None).unwrap_err();
        assert_eq!(e.field, "tls_cert_file");
        assert!(e.reason.contains("no PEM block of CERTIFICATE"), "{e}");
        assert_eq!(with(Some(&cert), Some(&cert), None).unwrap_err().field, "tls_key_file");
        assert_eq!(with(Some(&cert), Some(&key), Some(&key)).unwrap_err().field, "tls_client_ca_file");
        let e = with(Some(&dir.join("missing.crt")), Some(&key), None).unwrap_err();
        assert!(e.reason.starts_with("cannot read"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
