//! `kvgate serve`: the control plane from flags, environment and a file.

use anyhow::{Context, Result};

/// `kvgate serve`: a configuration file, overridden by environment variables
/// and flags. Without a file, one model can be given with the `--model`
/// flags.
#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    /// TOML configuration file (see control-plane/server/README.md).
    #[arg(long, env = "KVGATE_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// gRPC listen address (default 127.0.0.1:50051).
    #[arg(long, env = "KVGATE_LISTEN_GRPC")]
    listen_grpc: Option<String>,
    /// Admin/metrics listen address (default 127.0.0.1:9091; "off" disables).
    #[arg(long, env = "KVGATE_LISTEN_ADMIN")]
    listen_admin: Option<String>,
    /// NATS URL ("off" = static workers only).
    #[arg(long, env = "KVGATE_NATS_URL")]
    nats_url: Option<String>,
    /// NATS subject prefix.
    #[arg(long, env = "KVGATE_SUBJECT_PREFIX")]
    subject_prefix: Option<String>,
    /// This replica's id (default hostname-pid).
    #[arg(long, env = "KVGATE_REPLICA_ID")]
    replica_id: Option<String>,
    /// Snapshot timeout in milliseconds.
    #[arg(long, env = "KVGATE_SNAPSHOT_TIMEOUT_MS")]
    snapshot_timeout_ms: Option<u64>,
    /// PEM certificate chain: the gRPC port then speaks TLS only.
    #[arg(long, env = "KVGATE_TLS_CERT_FILE")]
    tls_cert_file: Option<std::path::PathBuf>,
    /// PEM private key of --tls-cert-file.
    #[arg(long, env = "KVGATE_TLS_KEY_FILE")]
    tls_key_file: Option<std::path::PathBuf>,
    /// PEM CA bundle: gRPC clients must present a certificate it signed.
    #[arg(long, env = "KVGATE_TLS_CLIENT_CA_FILE")]
    tls_client_ca_file: Option<std::path::PathBuf>,
    /// A model served without a file (or added to it).
    #[arg(long, env = "KVGATE_MODEL")]
    model: Option<String>,
    /// Tokenizer directory of --model (tokenizer.json, chat_template.jinja).
    /// The per-model flags need --model on the command line; from the
    /// environment without a --model (a config file names the models) they
    /// are ignored, so that a shell with `.tools/env` sourced still works.
    #[arg(long, env = "KVGATE_TOKENIZER_DIR")]
    tokenizer_dir: Option<std::path::PathBuf>,
    /// Block size of --model.
    #[arg(long, env = "KVGATE_BLOCK_SIZE")]
    block_size: Option<u32>,
    /// Routing mode of --model.
    #[arg(long, env = "KVGATE_MODE")]
    mode: Option<String>,
    /// Heartbeat timeout of --model in ms (0 = 3 intervals).
    #[arg(long, env = "KVGATE_HEARTBEAT_TIMEOUT_MS")]
    heartbeat_timeout_ms: Option<u64>,
    /// Session affinity of --model (`true` / `false`, default false): keep a
    /// session (the filter's session header) on its worker unless that
    /// worker is saturated or gone.
    #[arg(long, env = "KVGATE_SESSION_AFFINITY")]
    session_affinity: Option<bool>,
    /// How long a session stays pinned after its last request, ms (--model).
    #[arg(long, env = "KVGATE_SESSION_TTL_MS")]
    session_ttl_ms: Option<u64>,
    /// Overload protection of --model (`true` / `false`, default false):
    /// hold requests while every worker is saturated, 429 past the bound.
    #[arg(long, env = "KVGATE_OVERLOAD")]
    overload: Option<bool>,
    /// Longest a request is held, ms (--model; default 5000).
    #[arg(long, env = "KVGATE_OVERLOAD_MAX_WAIT_MS")]
    overload_max_wait_ms: Option<u64>,
    /// Disaggregated prefill/decode of --model: a local prefill of at least
    /// this many uncached tokens goes to a prefill worker (default: derived
    /// from the learned engine timing, a prefill of 100 ms or more).
    #[arg(long, env = "KVGATE_DISAGGREGATE_MIN_UNCACHED_TOKENS")]
    disaggregate_min_uncached_tokens: Option<u32>,
    /// Disaggregated prefill/decode of --model on `both` workers too: another
    /// `both` worker may prefill a request (every worker must run a KV
    /// connector as `kv_both`; default false).
    #[arg(long, env = "KVGATE_DISAGGREGATE_PREFILL_ON_BOTH")]
    disaggregate_prefill_on_both: Option<bool>,
    /// Disaggregated prefill/decode of --model: while the chosen decode
    /// worker is saturated, a prefill worker that is not serves the whole
    /// request (prefill pods must run the connector as `kv_both`; default
    /// false).
    #[arg(long, env = "KVGATE_DISAGGREGATE_OVERFLOW_TO_PREFILL")]
    disaggregate_overflow_to_prefill: Option<bool>,
    /// Shards of --model's block index (1–64, default 1): KV batches of
    /// several workers that arrive together are applied on this many threads.
    #[arg(long, env = "KVGATE_INDEX_SHARDS")]
    index_shards: Option<u16>,
    /// Static workers of --model, `id=ip:port`, repeatable.
    #[arg(long = "worker", requires = "model")]
    workers: Vec<String>,
}

/// The per-model flags given on the command line without `--model`.
pub(crate) fn model_flags_without_model(m: &clap::ArgMatches) -> Vec<&'static str> {
    use clap::parser::ValueSource;
    if m.contains_id("model") && m.value_source("model").is_some() {
        return Vec::new();
    }
    [
        ("tokenizer_dir", "--tokenizer-dir"),
        ("block_size", "--block-size"),
        ("mode", "--mode"),
        ("heartbeat_timeout_ms", "--heartbeat-timeout-ms"),
        ("session_affinity", "--session-affinity"),
        ("session_ttl_ms", "--session-ttl-ms"),
        ("overload", "--overload"),
        ("overload_max_wait_ms", "--overload-max-wait-ms"),
        ("disaggregate_min_uncached_tokens", "--disaggregate-min-uncached-tokens"),
        ("index_shards", "--index-shards"),
        ("workers", "--worker"),
    ]
    .into_iter()
    .filter(|(id, _)| m.value_source(id) == Some(ValueSource::CommandLine))
    .map(|(_, flag)| flag)
    .collect()
}

fn serve_config(a: ServeArgs) -> Result<kvgate_server::Config> {
    let mut raw = match &a.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            kvgate_server::RawConfig::from_toml(&text, &path.display().to_string())?
        }
        None => kvgate_server::RawConfig::default(),
    };
    macro_rules! over {
        ($($f:ident),*) => { $( if a.$f.is_some() { raw.$f = a.$f.clone(); } )* };
    }
    over!(
        listen_grpc,
        listen_admin,
        nats_url,
        subject_prefix,
        replica_id,
        snapshot_timeout_ms,
        tls_cert_file,
        tls_key_file,
        tls_client_ca_file
    );
    if let Some(name) = a.model {
        let mut workers = Vec::new();
        for w in &a.workers {
            let (id, endpoint) = w.split_once('=').with_context(|| format!("--worker {w:?}: expected id=ip:port"))?;
            workers.push(kvgate_server::config::RawWorker { id: id.into(), endpoint: endpoint.into() });
        }
        let m = kvgate_server::config::RawModel {
            name,
            tokenizer_dir: a.tokenizer_dir,
            block_size: a.block_size,
            mode: a.mode,
            heartbeat_timeout_ms: a.heartbeat_timeout_ms,
            workers,
            session: (a.session_affinity.is_some() || a.session_ttl_ms.is_some()).then_some(
                kvgate_server::config::RawSession {
                    enabled: a.session_affinity,
                    ttl_ms: a.session_ttl_ms,
                    max_sessions: None,
                },
            ),
            overload: (a.overload.is_some() || a.overload_max_wait_ms.is_some()).then_some(
                kvgate_server::config::RawOverload {
                    enabled: a.overload,
                    max_wait_ms: a.overload_max_wait_ms,
                    ..Default::default()
                },
            ),
            disaggregation: (a.disaggregate_min_uncached_tokens.is_some()
                || a.disaggregate_prefill_on_both.is_some()
                || a.disaggregate_overflow_to_prefill.is_some())
            .then_some(kvgate_server::config::RawDisaggregation {
                min_uncached_tokens: a.disaggregate_min_uncached_tokens,
                prefill_on_both: a.disaggregate_prefill_on_both,
                overflow_to_prefill: a.disaggregate_overflow_to_prefill,
                ..Default::default()
            }),
            index_shards: a.index_shards,
            ..Default::default()
        };
        match raw.models.iter_mut().find(|x| x.name == m.name) {
            Some(existing) => *existing = m,
            None => raw.models.push(m),
        }
    }
    Ok(kvgate_server::Config::validate(raw)?)
}

/// `kvgate serve`.
pub(crate) fn run(a: ServeArgs) -> Result<()> {
    let config = serve_config(a)?;
    crate::init_logging();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(kvgate_server::run(config, kvgate_server::server::shutdown_signal(), |b, _| {
        // One machine-readable line for launchers and tests, in one write
        // (stderr is unbuffered: `eprintln!` with arguments writes piece
        // by piece, and a launcher may read the line half written).
        let admin = b.admin.map(|a| a.to_string()).unwrap_or_default();
        let line = format!("kvgate serve: grpc={} admin={admin}\n", b.grpc);
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }))?;
    Ok(())
}
