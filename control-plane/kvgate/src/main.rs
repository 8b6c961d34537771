//! `kvgate`: the product's one command line.
//!
//! Every component is a subcommand of this one binary, so that one container
//! image (or one `cargo install`) carries the whole product and the demo
//! launcher can start each part as `kvgate <part>`. Subcommands arrive with
//! their issues; today:
//!
//! * `kvgate serve`: the control plane (gRPC Pick, live index, metrics);
//! * `kvgate relay`: the KV event relay sidecar (vLLM ZMQ events → NATS);
//! * `kvgate sim`: simulated vLLM workers for tests and benchmarks;
//! * `kvgate hash`: block hashes of token ids (debugging routing decisions);
//! * `kvgate subject`: the NATS subjects of a model and worker;
//! * `kvgate version`.

use std::io::Read;

use anyhow::{Context, Result, bail};
use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand};
use kvgate_protocol::subject::{SubjectKind, Subjects};
use kvgate_protocol::{BlockSeed, BlockSize, local_block_hashes, sequence_hashes};

/// mimalloc instead of glibc malloc: tokenization allocates per token, and
/// measured on this machine (`cargo run --release -p kvgate-server --example
/// profile_tokens`) a cold 8K-token prompt tokenizes 2.9x faster and a new
/// chat turn 1.7x faster with it.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "kvgate", version, about = "KV-cache-aware routing for vLLM behind Envoy")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the project's block hashes (Dynamo-compatible xxh3) of token ids.
    Hash {
        /// Tokens per block.
        #[arg(long)]
        block_size: u32,
        /// LoRA adapter name, if any.
        #[arg(long)]
        lora: Option<String>,
        /// cache_salt, if any.
        #[arg(long)]
        salt: Option<String>,
        /// Token ids separated by commas or white space; `-` (default) reads stdin.
        #[arg(default_value = "-")]
        tokens: String,
    },
    /// Print the NATS subjects kvgate uses for a model and worker.
    Subject {
        /// Served model name, e.g. meta-llama/Llama-3.1-70B-Instruct.
        #[arg(long)]
        model: String,
        /// Worker id, e.g. 10.0.0.7:8000.
        #[arg(long, default_value = "")]
        worker: String,
        /// Subject prefix.
        #[arg(long, default_value = kvgate_protocol::subject::DEFAULT_PREFIX)]
        prefix: String,
    },
    /// Run the control plane: gRPC Pick/Report, live index from NATS, admin HTTP.
    Serve(Box<ServeArgs>),
    /// Run the KV event relay next to one vLLM engine.
    Relay(Box<RelayArgs>),
    /// Run simulated vLLM workers (OpenAI API, /metrics, ZMQ KV events).
    Sim(Box<SimArgs>),
    /// Print a plain-Envoy bootstrap with the kvgate filter (envoy/kvgate.yaml
    /// filled in): run it with `envoy -c FILE`.
    EnvoyConfig(Box<EnvoyConfigArgs>),
    /// Print the version.
    Version,
}

/// `kvgate envoy-config`: the bootstrap's inputs.
#[derive(clap::Args)]
struct EnvoyConfigArgs {
    /// Where clients connect.
    #[arg(long, default_value = "0.0.0.0:10000")]
    listen: std::net::SocketAddr,
    /// Envoy's admin port (on 127.0.0.1 only).
    #[arg(long, default_value_t = 9901)]
    admin_port: u16,
    /// A vLLM worker `ip:port` (repeat for each).
    #[arg(long = "worker", required = true)]
    workers: Vec<std::net::SocketAddr>,
    /// A control-plane replica `ip:port` (repeat for each).
    #[arg(long = "control-plane", default_value = "127.0.0.1:50051")]
    control_plane: Vec<std::net::SocketAddr>,
    /// The built filter (`kvgate_filter.wasm`).
    #[arg(long)]
    wasm: std::path::PathBuf,
    /// The filter's JSON configuration (see filter/README.md), one line.
    #[arg(long, default_value = "{}")]
    filter_config: String,
    /// Mutual TLS to the control plane: CA of its certificate (with
    /// --tls-cert, --tls-key, --tls-sni).
    #[arg(long, requires_all = ["tls_cert", "tls_key", "tls_sni"])]
    tls_ca: Option<std::path::PathBuf>,
    /// Envoy's client certificate chain.
    #[arg(long, requires = "tls_ca")]
    tls_cert: Option<std::path::PathBuf>,
    /// Its private key.
    #[arg(long, requires = "tls_ca")]
    tls_key: Option<std::path::PathBuf>,
    /// The name in the control plane's certificate.
    #[arg(long, requires = "tls_ca")]
    tls_sni: Option<String>,
    /// Write here instead of standard output.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

fn envoy_config(a: EnvoyConfigArgs) -> Result<()> {
    let filter: serde_json::Value = serde_json::from_str(&a.filter_config).context("--filter-config: not JSON")?;
    let tls = match (a.tls_ca, a.tls_cert, a.tls_key, a.tls_sni) {
        (Some(ca), Some(cert), Some(key), Some(sni)) => Some(kvgate_envoy_config::ControlPlaneTls {
            ca_file: ca.display().to_string(),
            cert_file: cert.display().to_string(),
            key_file: key.display().to_string(),
            sni,
        }),
        _ => None,
    };
    let boot = kvgate_envoy_config::KvgateBootstrap {
        listen: a.listen,
        admin_port: a.admin_port,
        workers: a.workers,
        control_plane: a.control_plane,
        wasm_path: a.wasm.display().to_string(),
        // One line, re-serialized: the template quotes it in single quotes.
        filter_config: filter.to_string().replace('\'', "\\u0027"),
        tls,
    };
    let yaml = boot.render()?;
    match a.out {
        Some(path) => std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?,
        None => print!("{yaml}"),
    }
    Ok(())
}

/// `kvgate serve`: a configuration file, overridden by environment variables
/// and flags. Without a file, one model can be given with the `--model`
/// flags.
#[derive(clap::Args)]
struct ServeArgs {
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
    /// Static workers of --model, `id=ip:port`, repeatable.
    #[arg(long = "worker", requires = "model")]
    workers: Vec<String>,
}

/// The per-model flags given on the command line without `--model`.
fn model_flags_without_model(m: &clap::ArgMatches) -> Vec<&'static str> {
    use clap::parser::ValueSource;
    if m.contains_id("model") && m.value_source("model").is_some() {
        return Vec::new();
    }
    [
        ("tokenizer_dir", "--tokenizer-dir"),
        ("block_size", "--block-size"),
        ("mode", "--mode"),
        ("heartbeat_timeout_ms", "--heartbeat-timeout-ms"),
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
            ..Default::default()
        };
        match raw.models.iter_mut().find(|x| x.name == m.name) {
            Some(existing) => *existing = m,
            None => raw.models.push(m),
        }
    }
    Ok(kvgate_server::Config::validate(raw)?)
}

/// `kvgate sim`: a fleet of simulated vLLM workers in one process.
#[derive(clap::Args)]
struct SimArgs {
    /// Served model name.
    #[arg(long, env = "KVGATE_SIM_MODEL", default_value = "deepseek-v3")]
    model: String,
    /// Tokenizer directory (tokenizer.json, chat_template.jinja).
    #[arg(long, env = "KVGATE_TOKENIZER_DIR")]
    tokenizer_dir: std::path::PathBuf,
    /// Number of workers.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Listen host.
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// HTTP port of worker 0; worker i listens on port + i (0: ephemeral ports).
    #[arg(long, default_value_t = 8000)]
    http_port: u16,
    /// ZMQ port of worker 0; worker i publishes on port + 2i and replays on
    /// port + 2i + 1 (0: no KV events).
    #[arg(long, default_value_t = 5557)]
    zmq_port: u16,
    /// KV event encoding: map (vLLM ≥ 0.24) or array (older).
    #[arg(long, default_value = "map")]
    encoding: String,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks per worker (H200 + Llama-3.1-70B FP8 at block size 16: ~23,000).
    #[arg(long, default_value_t = 23_000)]
    num_blocks: usize,
    /// vLLM's max_num_seqs.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// vLLM's max_num_batched_tokens (chunked prefill budget per step).
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// Timing preset: h200-llama70b-fp8 or dynamo-mocker.
    #[arg(long, default_value = "h200-llama70b-fp8")]
    timing: String,
    /// Simulated time runs this many times faster than real time.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Output tokens per streamed chunk after the first, as vLLM's
    /// --stream-interval (fewer chunks: less CPU for the gateway under test).
    #[arg(long, default_value_t = 1)]
    stream_interval: usize,
    /// Output tokens when a request has no max_tokens.
    #[arg(long, default_value_t = 256)]
    default_max_tokens: usize,
    /// Longest prompt + output accepted.
    #[arg(long, default_value_t = 131_072)]
    max_model_len: usize,
    /// Runtime threads (1 = everything on one core).
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn run_sim(a: SimArgs) -> Result<()> {
    use kvgate_sim::server::{WorkerOptions, run_worker};
    let timing = kvgate_sim::timing::Timing::preset(&a.timing)
        .with_context(|| format!("--timing {:?}: expected h200-llama70b-fp8 or dynamo-mocker", a.timing))?;
    let encoding = match a.encoding.as_str() {
        "map" => kvgate_vllm_wire::encode::Encoding::Map,
        "array" => kvgate_vllm_wire::encode::Encoding::Array,
        e => bail!("--encoding {e:?}: expected map or array"),
    };
    if a.workers == 0 || a.block_size == 0 || a.num_blocks == 0 || a.max_num_seqs == 0 || a.stream_interval == 0 {
        bail!("--workers, --block-size, --num-blocks, --max-num-seqs and --stream-interval must be > 0");
    }
    if !(a.speedup.is_finite() && a.speedup > 0.0) {
        bail!("--speedup {}: must be > 0", a.speedup);
    }
    let tokenizer = std::sync::Arc::new(
        kvgate_tokenize::prompt::PromptTokenizer::from_dir(&a.tokenizer_dir, Default::default())
            .with_context(|| format!("--tokenizer-dir {}", a.tokenizer_dir.display()))?,
    );
    let rt = if a.threads <= 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()?
    } else {
        tokio::runtime::Builder::new_multi_thread().worker_threads(a.threads).enable_all().build()?
    };
    rt.block_on(async move {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut set = tokio::task::JoinSet::new();
        for i in 0..a.workers {
            let port = |base: u16, off: usize| -> Result<u16> {
                if base == 0 {
                    return Ok(0);
                }
                u16::try_from(usize::from(base) + off).context("port out of range")
            };
            let http_port = port(a.http_port, i)?;
            let zmq =
                if a.zmq_port == 0 { None } else { Some((port(a.zmq_port, 2 * i)?, port(a.zmq_port, 2 * i + 1)?)) };
            let opts = WorkerOptions {
                id: format!("w{i}"),
                model: a.model.clone(),
                http: std::net::SocketAddr::new(a.host, http_port),
                zmq_pub: zmq.map(|(p, _)| format!("tcp://{}:{p}", a.host)),
                zmq_replay: zmq.map(|(_, r)| format!("tcp://{}:{r}", a.host)),
                topic: "kv-events".into(),
                encoding,
                engine: kvgate_sim::engine::EngineConfig {
                    max_num_seqs: a.max_num_seqs,
                    max_num_batched_tokens: a.max_num_batched_tokens,
                    num_blocks: a.num_blocks,
                    block_size: a.block_size,
                    timing,
                },
                speedup: a.speedup,
                stream_interval: a.stream_interval,
                tokenizer: tokenizer.clone(),
                default_max_tokens: a.default_max_tokens,
                max_model_len: a.max_model_len,
                replay_buffer: 10_000,
            };
            let mut stop = stop_rx.clone();
            let zmq_desc = opts.zmq_pub.clone().unwrap_or_else(|| "off".into());
            let replay_desc = opts.zmq_replay.clone().unwrap_or_else(|| "off".into());
            set.spawn(run_worker(
                opts,
                async move {
                    let _ = stop.changed().await;
                },
                move |addr| {
                    // One machine-readable line per worker for launchers.
                    eprintln!("kvgate sim: worker w{i} http={addr} zmq={zmq_desc} replay={replay_desc}");
                },
            ));
        }
        tokio::select! {
            _ = kvgate_server::server::shutdown_signal() => {}
            r = set.join_next() => {
                if let Some(Ok(Err(e))) = r {
                    return Err(anyhow::anyhow!(e));
                }
            }
        }
        let _ = stop_tx.send(true);
        while set.join_next().await.is_some() {}
        Ok(())
    })
}

/// `kvgate relay`: flags, each also settable from the environment.
#[derive(clap::Args)]
struct RelayArgs {
    /// vLLM's `kv-events-config` endpoint, as vLLM was given it. vLLM binds
    /// for `*`, `::` and ipc endpoints (the relay then connects to
    /// --zmq-connect or the same address on 127.0.0.1) and connects
    /// otherwise (the relay binds it).
    #[arg(long, env = "KVGATE_ZMQ_ENDPOINT")]
    zmq_endpoint: String,
    /// Override: the address to connect to when vLLM binds.
    #[arg(long, env = "KVGATE_ZMQ_CONNECT")]
    zmq_connect: Option<String>,
    /// Topic prefix (vLLM's `topic`; "" = all).
    #[arg(long, env = "KVGATE_ZMQ_TOPIC", default_value = "")]
    topic: String,
    /// vLLM's `replay_endpoint`, if set (the relay connects a DEALER).
    #[arg(long, env = "KVGATE_ZMQ_REPLAY")]
    replay_endpoint: Option<String>,
    /// NATS server.
    #[arg(long, env = "KVGATE_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// NATS subject prefix.
    #[arg(long, env = "KVGATE_SUBJECT_PREFIX", default_value = kvgate_protocol::subject::DEFAULT_PREFIX)]
    subject_prefix: String,
    /// Served model name.
    #[arg(long, env = "KVGATE_MODEL")]
    model: String,
    /// `ip:port` Envoy routes to for this worker (the pod IP and vLLM's port).
    #[arg(long, env = "KVGATE_ENDPOINT")]
    endpoint: String,
    /// Worker id on NATS (default: the endpoint).
    #[arg(long, env = "KVGATE_WORKER_ID")]
    worker_id: Option<String>,
    /// vLLM's metrics URL, e.g. http://127.0.0.1:8000/metrics.
    #[arg(long, env = "KVGATE_METRICS_URL")]
    metrics_url: Option<String>,
    /// Block size when the engine's metrics do not report it.
    #[arg(long, env = "KVGATE_BLOCK_SIZE", default_value_t = 16)]
    block_size: u32,
    /// The engine's max_num_seqs (0 = unknown).
    #[arg(long, env = "KVGATE_MAX_NUM_SEQS", default_value_t = 0)]
    max_num_seqs: u32,
    /// Heartbeat period in milliseconds.
    #[arg(long, env = "KVGATE_HEARTBEAT_MS", default_value_t = 1000)]
    heartbeat_ms: u64,
    /// Where to serve the relay's Prometheus metrics (e.g. 0.0.0.0:9101).
    #[arg(long, env = "KVGATE_RELAY_METRICS")]
    listen_metrics: Option<std::net::SocketAddr>,
    /// The engine's health URL (default: /health beside --metrics-url).
    #[arg(long, env = "KVGATE_HEALTH_URL")]
    health_url: Option<String>,
    /// Health probe period in milliseconds.
    #[arg(long, env = "KVGATE_HEALTH_MS", default_value_t = 250)]
    health_ms: u64,
    /// A probe that takes longer than this (ms) has failed.
    #[arg(long, env = "KVGATE_HEALTH_TIMEOUT_MS", default_value_t = 1000)]
    health_timeout_ms: u64,
    /// Probes failing for this long (ms) = the engine is down: its blocks
    /// are cleared from every index.
    #[arg(long, env = "KVGATE_DOWN_AFTER_MS", default_value_t = 3000)]
    down_after_ms: u64,
    /// Messages held for NATS while it is unreachable (beyond, dropped and
    /// repaired by snapshots).
    #[arg(long, env = "KVGATE_PUBLISH_QUEUE", default_value_t = 8192)]
    publish_queue: usize,
}

fn relay_options(a: RelayArgs) -> Result<kvgate_relay::runtime::RelayOptions> {
    use kvgate_relay::runtime::{RelayOptions, ZmqMode};
    let e = a.zmq_endpoint.as_str();
    let vllm_binds = e.contains('*') || e.contains("::") || e.starts_with("ipc://") || e.starts_with("inproc://");
    let zmq = if vllm_binds {
        ZmqMode::Connect(a.zmq_connect.unwrap_or_else(|| e.replace("*", "127.0.0.1").replace("[::]", "127.0.0.1")))
    } else {
        ZmqMode::Bind(e.to_owned())
    };
    if a.block_size == 0 {
        bail!("--block-size: 0 is not a block size (must be at least 1)");
    }
    let subjects = Subjects::new(&a.subject_prefix).context("--subject-prefix")?;
    Ok(RelayOptions {
        zmq,
        topic: a.topic,
        replay_endpoint: a.replay_endpoint,
        replay_timeout: std::time::Duration::from_secs(2),
        nats_url: a.nats_url,
        subjects,
        worker_id: a.worker_id.unwrap_or_else(|| a.endpoint.clone()),
        model: a.model,
        endpoint: a.endpoint,
        metrics_url: a.metrics_url,
        heartbeat_interval: std::time::Duration::from_millis(a.heartbeat_ms.max(100)),
        block_size: a.block_size,
        max_num_seqs: a.max_num_seqs,
        snapshot_max_chunk_bytes: 900 * 1024,
        listen_metrics: a.listen_metrics,
        health_url: a.health_url,
        health_interval: std::time::Duration::from_millis(a.health_ms.max(10)),
        health_timeout: std::time::Duration::from_millis(a.health_timeout_ms.max(10)),
        down_after: std::time::Duration::from_millis(a.down_after_ms),
        publish_queue: a.publish_queue.max(16),
    })
}

/// Logs to stderr, filtered by `KVGATE_LOG` (or `RUST_LOG`), `info` by
/// default: the control plane and the relay log alike.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVGATE_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

fn parse_tokens(text: &str) -> Result<Vec<u32>> {
    text.split(|c: char| c == ',' || c.is_whitespace() || c == '[' || c == ']')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().with_context(|| format!("token id {s:?} is not a u32")))
        .collect()
}

fn main() -> Result<()> {
    let matches = Cli::command().get_matches();
    if let Some(("serve", m)) = matches.subcommand() {
        let orphans = model_flags_without_model(m);
        if !orphans.is_empty() {
            bail!("{} apply to --model: give --model too (or name the model in the --config file)", orphans.join(", "));
        }
    }
    match Cli::from_arg_matches(&matches)?.command {
        Command::Hash { block_size, lora, salt, tokens } => {
            let bs = BlockSize::new(block_size).context("--block-size")?;
            let text = if tokens == "-" {
                let mut s = String::new();
                std::io::stdin().read_to_string(&mut s).context("reading stdin")?;
                s
            } else {
                tokens
            };
            let tokens = parse_tokens(&text)?;
            if tokens.is_empty() {
                bail!("no token ids given");
            }
            let seed = BlockSeed::new(lora.as_deref(), salt.as_deref());
            let local: Vec<String> = local_block_hashes(&tokens, bs, seed).map(|h| h.to_string()).collect();
            let seq: Vec<String> = sequence_hashes(&tokens, bs, seed).iter().map(|h| h.to_string()).collect();
            let out = serde_json::json!({
                "block_size": block_size,
                "block_seed": seed.get().to_string(),
                "tokens": tokens.len(),
                "full_blocks": local.len(),
                "local_hashes": local,
                "sequence_hashes": seq,
            });
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
        Command::Subject { model, worker, prefix } => {
            let s = Subjects::new(&prefix)?;
            println!("kv events:  {}", s.kv_events(&model, &worker));
            println!("heartbeat:  {}", s.heartbeat(&model, &worker));
            println!("snapshot:   {}", s.snapshot(&model, &worker));
            println!("inflight:   {}", s.inflight(&model));
            println!("subscribe:  {}  {}", s.model(SubjectKind::KvEvents, &model), s.all(SubjectKind::KvEvents));
        }
        Command::Serve(args) => {
            let config = serve_config(*args)?;
            init_logging();
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            rt.block_on(kvgate_server::run(config, kvgate_server::server::shutdown_signal(), |b, _| {
                // One machine-readable line for launchers and tests.
                eprintln!("kvgate serve: grpc={} admin={}", b.grpc, b.admin.map(|a| a.to_string()).unwrap_or_default());
            }))?;
        }
        Command::Sim(args) => run_sim(*args)?,
        Command::EnvoyConfig(args) => envoy_config(*args)?,
        Command::Relay(args) => {
            let opts = relay_options(*args)?;
            init_logging();
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(kvgate_relay::runtime::run(opts, kvgate_server::server::shutdown_signal()))?;
        }
        Command::Version => println!("kvgate {}", env!("CARGO_PKG_VERSION")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_tokens;

    #[test]
    fn token_lists() {
        assert_eq!(parse_tokens("1, 2 3\n[4]").unwrap(), vec![1, 2, 3, 4]);
        assert!(parse_tokens("1,-2").is_err());
        assert!(parse_tokens("x").unwrap_err().to_string().contains("\"x\""));
    }
}
