//! `kvgate relay`: the KV event relay next to one engine.

use anyhow::{Context, Result, bail};
use kvgate_protocol::subject::Subjects;

/// `kvgate relay`: flags, each also settable from the environment.
#[derive(clap::Args)]
pub(crate) struct RelayArgs {
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
    /// A probe unanswered this long (ms) marks the engine unhealthy (no new
    /// request, blocks kept) until a probe answers: a hung engine leaves
    /// rotation before the probe's timeout. 0 = off.
    #[arg(long, env = "KVGATE_HEALTH_OVERDUE_MS", default_value_t = 500)]
    health_overdue_ms: u64,
    /// Probes failing for this long (ms) = the engine is down: its blocks
    /// are cleared from every index.
    #[arg(long, env = "KVGATE_DOWN_AFTER_MS", default_value_t = 3000)]
    down_after_ms: u64,
    /// Messages held for NATS while it is unreachable (beyond, dropped and
    /// repaired by snapshots).
    #[arg(long, env = "KVGATE_PUBLISH_QUEUE", default_value_t = 8192)]
    publish_queue: usize,
    /// The server's data-parallel size (vLLM `--data-parallel-size`): each
    /// rank becomes a worker `<worker-id>/dp<rank>` whose events arrive on
    /// the event endpoint's port + rank (vLLM's rule) and whose load is the
    /// metrics labelled `engine="<rank>"`.
    #[arg(long, env = "KVGATE_DATA_PARALLEL_SIZE", default_value_t = 1)]
    data_parallel_size: u32,
    /// The worker's part in disaggregated serving: `both` (aggregated, the
    /// default), `prefill` (receives only prefill legs) or `decode`. Takes
    /// llm-d's pod label values, so a manifest can set it from the label
    /// `llm-d.ai/role` through the downward API.
    #[arg(long, env = "KVGATE_ROLE", default_value = "both", value_parser = parse_role)]
    role: kvgate_protocol::pb::WorkerRole,
}

/// `--role`: `both` (or llm-d's `prefill-decode`), `prefill`, `decode`.
fn parse_role(s: &str) -> Result<kvgate_protocol::pb::WorkerRole, String> {
    use kvgate_protocol::pb::WorkerRole;
    match s.trim().to_ascii_lowercase().as_str() {
        "both" | "prefill-decode" | "" => Ok(WorkerRole::Both),
        "prefill" => Ok(WorkerRole::Prefill),
        "decode" => Ok(WorkerRole::Decode),
        other => Err(format!("{other:?} is not a role (expected prefill, decode or both)")),
    }
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
    if a.data_parallel_size > 1024 {
        bail!("--data-parallel-size: {} ranks is beyond what one server runs (at most 1024)", a.data_parallel_size);
    }
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
        health_overdue: (a.health_overdue_ms > 0)
            .then(|| std::time::Duration::from_millis(a.health_overdue_ms.max(10))),
        down_after: std::time::Duration::from_millis(a.down_after_ms),
        publish_queue: a.publish_queue.max(16),
        data_parallel_size: a.data_parallel_size.max(1),
        role: a.role,
    })
}

/// `kvgate relay`.
pub(crate) fn run(a: RelayArgs) -> Result<()> {
    let opts = relay_options(a)?;
    crate::init_logging();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(kvgate_relay::runtime::run(opts, kvgate_server::server::shutdown_signal()))?;
    Ok(())
}
