//! The simulated worker's interfaces (feature `server`): vLLM's OpenAI HTTP
//! API with SSE streaming, `/metrics` with vLLM's metric names, and KV
//! events on a ZMQ PUB socket with a replay ROUTER socket, in vLLM's wire
//! format. One tokio task owns each [`Engine`]; it advances in simulated
//! time (`speedup` × faster than the wall clock).
//!
//! A worker with `data_parallel_size` N runs N engines behind its one HTTP
//! address, as vLLM's `--data-parallel-size`: rank r publishes on the event
//! and replay endpoints offset by r (vLLM's rule), its `/metrics` series are
//! labelled `engine="r"`, and a request goes to the rank its
//! `x-data-parallel-rank` header names (400 when out of range) or else to
//! the rank with the fewest requests in flight (vLLM's API server balances
//! by its ranks' queues), the lowest on a tie.
//!
//! ```text
//! HTTP handler ──Submit──▶ engine task ──step()──▶ sleep(step.ms / speedup)
//!      ▲                        │                    ├─ outputs ──▶ per-request channel ──▶ SSE / JSON
//!      └──── tokens ◀───────────┘                    └─ events ──▶ ZMQ PUB [topic, seq, msgpack] + replay buffer
//! ```
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | options, shared state, `run_worker` (bind, spawn, serve) |
//! | `engine_task.rs` | the task that owns the engine: admit, step, pace, record, publish events |
//! | `replay.rs` | the ZMQ sockets: where each rank's are (ports picked and held), PUB bound, the replay ROUTER task |
//! | `http.rs` | OpenAI handlers (parse, tokenize, validate) and the simulator's own endpoints |
//! | `generate.rs` | one request's answer: JSON, or SSE chunks as vLLM streams them |
//! | `kv_transfer.rs` | disaggregated serving: `kv_transfer_params` in (either leg) and out (prefill leg) |
//! | `metrics.rs` | `/metrics` in vLLM's exposition (names, labels, float formatting) |

mod engine_task;
mod generate;
mod http;
mod kv_transfer;
mod metrics;
mod replay;

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use axum::http::StatusCode;
use axum::routing::{get, post};
use kvgate_tokenize::prompt::PromptTokenizer;
use kvgate_vllm_wire::encode::Encoding;
use parking_lot::Mutex;
use tokio::sync::mpsc;

use crate::engine::{EngineConfig, Request};
use metrics::Stats;

/// Settings of one simulated worker.
#[derive(Clone)]
pub struct WorkerOptions {
    /// Worker id (for logs).
    pub id: String,
    /// Served model name.
    pub model: String,
    /// HTTP listen address.
    pub http: SocketAddr,
    /// Where the KV event sockets are bound.
    pub events: EventSockets,
    /// ZMQ topic.
    pub topic: String,
    /// Event encoding (map: vLLM ≥ 0.24; array: older).
    pub encoding: Encoding,
    /// Engine settings.
    pub engine: EngineConfig,
    /// Simulated time runs this many times faster than the wall clock.
    pub speedup: f64,
    /// Output tokens per streamed chunk after the first (vLLM's
    /// `--stream-interval`; 1 streams every token).
    pub stream_interval: usize,
    /// Tokenizer and chat template shared by all workers.
    pub tokenizer: Arc<PromptTokenizer>,
    /// Output tokens when the request gives no `max_tokens`.
    pub default_max_tokens: usize,
    /// Longest prompt + output accepted.
    pub max_model_len: usize,
    /// Batches kept for replay.
    pub replay_buffer: usize,
    /// Data-parallel ranks (vLLM `--data-parallel-size`): engines behind
    /// this one HTTP address, each with its own cache and event sockets.
    pub data_parallel_size: usize,
}

/// Where a worker binds its KV event sockets: a PUB socket per rank, and a
/// ROUTER answering replay requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventSockets {
    /// No KV events.
    Off,
    /// These endpoints (as vLLM binds `tcp://*:port`); rank r's are offset
    /// by r, vLLM's rule ([`kvgate_vllm_wire::dp::rank_endpoint`]).
    At {
        /// The PUB endpoint.
        publish: String,
        /// The replay ROUTER endpoint, if any.
        replay: Option<String>,
    },
    /// 2·D consecutive TCP ports on this address that the worker picks and
    /// holds itself (rank r publishes on P + r and replays on P + D + r),
    /// reported in [`Bound`]: no other process can take one between the
    /// pick and the bind, as one could when a launcher picked them.
    Any(IpAddr),
}

/// What a worker bound: its HTTP address, and rank 0's event endpoints
/// (rank r's are offset by r).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bound {
    /// The HTTP address.
    pub http: SocketAddr,
    /// Rank 0's PUB endpoint.
    pub publish: Option<String>,
    /// Rank 0's replay endpoint.
    pub replay: Option<String>,
}

impl std::fmt::Debug for WorkerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerOptions").field("id", &self.id).field("http", &self.http).finish()
    }
}

/// Published batches kept for replay: (sequence, payload).
type ReplayBuffer = VecDeque<(u64, Vec<u8>)>;

/// What a request receives from the engine.
#[derive(Debug, Clone, Copy)]
enum Delta {
    Token { index: usize, cached: usize },
    Done,
}

struct Submit {
    req: Request,
    tx: mpsc::UnboundedSender<Delta>,
    at: Instant,
    /// The decode side of a disaggregated request: its prompt's KV comes
    /// from a prefill worker (`kv_transfer_params.do_remote_prefill`).
    remote: bool,
    /// ... and the transfer is done.
    received: bool,
}

/// One data-parallel rank's engine as the handlers see it.
struct Rank {
    /// What `/metrics` shows of this rank.
    stats: Mutex<Stats>,
    /// The rank's engine task.
    submit: mpsc::UnboundedSender<Submit>,
    /// Requests submitted and not finished (for the API server's balance).
    inflight: AtomicUsize,
}

struct Shared {
    opts: WorkerOptions,
    /// The HTTP address bound (`opts.http` may name port 0).
    addr: SocketAddr,
    /// The engines, in rank order (one without data parallelism).
    ranks: Vec<Rank>,
    /// Event-stream faults to inject into the next published batch
    /// (`POST /kvgate/sim/fault?kind=…`, for the fault suite).
    faults: Mutex<Vec<StreamFault>>,
    /// Step-time multiplier (`POST /kvgate/sim/slowdown?factor=…`), as f64
    /// bits: a fleet that changed speed, for the calibration benchmark.
    slowdown: std::sync::atomic::AtomicU64,
    next_id: std::sync::atomic::AtomicU64,
    created: u64,
}

/// An event-stream fault the simulator can inject (the fault suite's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamFault {
    /// The next batch is published twice (same sequence, same bytes).
    Duplicate,
    /// Two malformed messages before the next batch (one frame; a sequence
    /// frame of the wrong length).
    Garbage,
    /// The next batch's sequence jumps beyond the replay buffer, which loses
    /// what it held: a gap that replay cannot cover.
    Gap,
}

impl StreamFault {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "duplicate" => Some(Self::Duplicate),
            "garbage" => Some(Self::Garbage),
            "gap" => Some(Self::Gap),
            _ => None,
        }
    }
}

impl Shared {
    /// The rank a request goes to: the one it names, or the one with the
    /// fewest requests in flight (the lowest on a tie).
    fn choose_rank(&self, named: Option<usize>) -> usize {
        named.filter(|r| *r < self.ranks.len()).unwrap_or_else(|| {
            (0..self.ranks.len()).min_by_key(|r| (self.ranks[*r].inflight.load(Ordering::Relaxed), *r)).unwrap_or(0)
        })
    }
}

/// Why a worker could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A socket could not be bound.
    #[error("{what} {addr}: {reason}")]
    Bind {
        /// HTTP, ZMQ PUB, ZMQ replay.
        what: &'static str,
        /// The address.
        addr: String,
        /// Why.
        reason: String,
    },
}

/// An OpenAI-style error answer, as vLLM writes it.
fn error(status: StatusCode, message: impl Into<String>) -> axum::response::Response {
    let body = serde_json::json!({
        "object": "error",
        "message": message.into(),
        "type": if status == StatusCode::NOT_FOUND { "NotFoundError" } else { "BadRequestError" },
        "param": null,
        "code": status.as_u16(),
    });
    axum::response::IntoResponse::into_response((
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    ))
}

fn now_unix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The deterministic text of output token `index` of a request: one short
/// word per token (a real tokenizer would make about one token of it).
/// The words a worker streams; each is one token of the test tokenizer.
const WORDS: &[&str] = &[
    " the", " cache", " prefix", " block", " token", " worker", " route", " model", " fast", " stream", " batch",
    " query", " reply", " data", " node", " load",
];

fn word(id: u64, index: usize) -> &'static str {
    WORDS[(crate::engine::output_token(id, index) as usize) % WORDS.len()]
}

/// The token ids of [`WORDS`] when each is exactly one token of this
/// tokenizer (then the engine generates these ids, and a next turn that
/// sends the reply back hits the blocks the engine cached while decoding);
/// empty otherwise.
fn word_ids(tk: &PromptTokenizer) -> Vec<u32> {
    let ids: Vec<Vec<u32>> = WORDS.iter().map(|w| tk.inner().encode(w).unwrap_or_default()).collect();
    if ids.iter().all(|i| i.len() == 1) { ids.into_iter().flatten().collect() } else { Vec::new() }
}

/// Runs one simulated worker until `shutdown` resolves. `on_bound` gets the
/// addresses bound.
pub async fn run_worker(
    opts: WorkerOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    on_bound: impl FnOnce(&Bound) + Send,
) -> Result<(), SimError> {
    let bind_err = |what: &'static str, addr: String| {
        move |e: std::io::Error| SimError::Bind { what, addr, reason: e.to_string() }
    };
    let listener = tokio::net::TcpListener::bind(opts.http).await.map_err(bind_err("HTTP", opts.http.to_string()))?;
    let http = listener.local_addr().map_err(bind_err("HTTP", opts.http.to_string()))?;
    let mut tasks = tokio::task::JoinSet::new();
    let mut ranks = Vec::new();
    let mut engines = Vec::new();
    let mut places = replay::Places::new(&opts.events, opts.data_parallel_size.max(1))?;
    let mut bound = Bound { http, publish: None, replay: None };
    for r in 0..opts.data_parallel_size.max(1) {
        let (publish, replay_at) = places.rank(r)?;
        let publisher = match publish {
            Some(place) => Some(replay::bind_publisher(place).await?),
            None => None,
        };
        let replay_buffer: Arc<Mutex<ReplayBuffer>> = Arc::new(Mutex::new(VecDeque::new()));
        let router = match replay_at {
            Some(place) => Some(replay::bind_router(place).await?),
            None => None,
        };
        if r == 0 {
            bound.publish = publisher.as_ref().map(|(_, ep)| ep.clone());
            bound.replay = router.as_ref().map(|(_, ep)| ep.clone());
        }
        if let Some((router, _)) = router {
            tasks.spawn(replay::serve(router, replay_buffer.clone(), opts.topic.clone()));
        }
        let publisher = publisher.map(|(s, _)| s);
        let (tx, rx) = mpsc::unbounded_channel::<Submit>();
        ranks.push(Rank { stats: Mutex::new(Stats::new()), submit: tx, inflight: AtomicUsize::new(0) });
        engines.push((replay_buffer, publisher, rx));
    }
    let shared = Arc::new(Shared {
        addr: http,
        ranks,
        next_id: std::sync::atomic::AtomicU64::new(1),
        created: now_unix(),
        faults: Mutex::new(Vec::new()),
        slowdown: std::sync::atomic::AtomicU64::new(1.0f64.to_bits()),
        opts: opts.clone(),
    });
    for (r, (replay_buffer, publisher, rx)) in engines.into_iter().enumerate() {
        tasks.spawn(engine_task::EngineTask::new(shared.clone(), r, replay_buffer, publisher).run(rx));
    }
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(http::chat))
        .route("/v1/completions", post(http::completions))
        .route("/v1/models", get(http::models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics::metrics))
        .route("/kvgate/sim/cache", get(http::cache_info))
        .route("/kvgate/sim/fault", post(http::inject_fault))
        .route("/kvgate/sim/slowdown", post(http::set_slowdown))
        // vLLM (FastAPI) sets no request body limit; axum's default of 2 MB
        // refused prompts vLLM accepts. 256 MiB bounds a runaway client.
        .layer(axum::extract::DefaultBodyLimit::max(256 << 20))
        .with_state(shared);
    on_bound(&bound);
    // TCP_NODELAY, as vLLM's server (asyncio sets it on every TCP
    // transport): without it a small SSE chunk can wait for the client's
    // delayed ACK (40 ms).
    use axum::serve::ListenerExt as _;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let r = axum::serve(listener, app).with_graceful_shutdown(shutdown).await;
    tasks.abort_all();
    r.map_err(|e| SimError::Bind { what: "HTTP", addr: http.to_string(), reason: e.to_string() })
}
