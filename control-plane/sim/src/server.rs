//! The simulated worker's interfaces (feature `server`): vLLM's OpenAI HTTP
//! API with SSE streaming, `/metrics` with vLLM's metric names, and KV
//! events on a ZMQ PUB socket with a replay ROUTER socket, in vLLM's wire
//! format. One tokio task owns each [`Engine`]; it advances in simulated
//! time (`speedup` × faster than the wall clock).
//!
//! ```text
//! HTTP handler ──Submit──▶ engine task ──step()──▶ sleep(step.ms / speedup)
//!      ▲                        │                    ├─ outputs ──▶ per-request channel ──▶ SSE / JSON
//!      └──── tokens ◀───────────┘                    └─ events ──▶ ZMQ PUB [topic, seq, msgpack] + replay buffer
//! ```

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvgate_tokenize::prompt::{PromptTokenizer, SegmentRef, chain_hashes};
use kvgate_vllm_wire::encode::{Encoding, encode_batch};
use kvgate_vllm_wire::{Batch, BlockRemoved, BlockStored, Event};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use zeromq::{Socket as _, SocketRecv as _, SocketSend as _};

use crate::engine::{Engine, EngineConfig, Output, Request};
use crate::pool::CacheEvent;

/// Settings of one simulated worker.
#[derive(Clone)]
pub struct WorkerOptions {
    /// Worker id (for logs).
    pub id: String,
    /// Served model name.
    pub model: String,
    /// HTTP listen address.
    pub http: SocketAddr,
    /// ZMQ PUB endpoint, bound (as vLLM binds `tcp://*:port`).
    pub zmq_pub: Option<String>,
    /// ZMQ ROUTER replay endpoint, bound.
    pub zmq_replay: Option<String>,
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
}

/// Fixed-bucket histogram in vLLM's exposition shape.
#[derive(Debug, Clone)]
struct Hist {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    n: u64,
}

const TTFT_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const ITL_BUCKETS: &[f64] =
    &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const QUEUE_BUCKETS: &[f64] = &[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0];

impl Hist {
    fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: vec![0; bounds.len()], sum: 0.0, n: 0 }
    }
    fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.n += 1;
    }
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        use std::fmt::Write as _;
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b:?}\"}} {cum}.0");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}.0", self.n);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}.0", self.n);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
    }
}

/// What `/metrics` shows; updated by the engine task after every step.
#[derive(Debug, Clone)]
struct Stats {
    running: usize,
    waiting: usize,
    kv_usage: f64,
    queries: u64,
    hits: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    success: u64,
    ttft: Hist,
    itl: Hist,
    queue: Hist,
    steps: u64,
    events_published: u64,
    cached_blocks: usize,
}

struct Shared {
    opts: WorkerOptions,
    stats: Mutex<Stats>,
    /// Event-stream faults to inject into the next published batch
    /// (`POST /kvgate/sim/fault?kind=…`, for the fault suite).
    faults: Mutex<Vec<StreamFault>>,
    submit: mpsc::UnboundedSender<Submit>,
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
/// bound HTTP address.
pub async fn run_worker(
    opts: WorkerOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    on_bound: impl FnOnce(SocketAddr) + Send,
) -> Result<(), SimError> {
    let listener = tokio::net::TcpListener::bind(opts.http).await.map_err(|e| SimError::Bind {
        what: "HTTP",
        addr: opts.http.to_string(),
        reason: e.to_string(),
    })?;
    let bound = listener.local_addr().map_err(|e| SimError::Bind {
        what: "HTTP",
        addr: opts.http.to_string(),
        reason: e.to_string(),
    })?;
    let mut publisher = match &opts.zmq_pub {
        Some(ep) => {
            let mut s = zeromq::PubSocket::new();
            s.bind(ep).await.map_err(|e| SimError::Bind {
                what: "ZMQ PUB",
                addr: ep.clone(),
                reason: e.to_string(),
            })?;
            Some(s)
        }
        None => None,
    };
    let replay_buffer: Arc<Mutex<ReplayBuffer>> = Arc::new(Mutex::new(VecDeque::new()));
    let mut tasks = tokio::task::JoinSet::new();
    if let Some(ep) = &opts.zmq_replay {
        let mut router = zeromq::RouterSocket::new();
        router.bind(ep).await.map_err(|e| SimError::Bind {
            what: "ZMQ replay",
            addr: ep.clone(),
            reason: e.to_string(),
        })?;
        let buf = replay_buffer.clone();
        let topic = opts.topic.clone();
        tasks.spawn(async move {
            while let Ok(msg) = router.recv().await {
                // [identity, "", start_seq(8 bytes BE)]
                let frames: Vec<Vec<u8>> = msg.iter().map(|f| f.to_vec()).collect();
                let Some(id) = frames.first().cloned() else { continue };
                let start = frames
                    .last()
                    .and_then(|f| <[u8; 8]>::try_from(f.as_slice()).ok())
                    .map(u64::from_be_bytes)
                    .unwrap_or(0);
                let batches: Vec<(u64, Vec<u8>)> = buf.lock().iter().filter(|(s, _)| *s >= start).cloned().collect();
                // vLLM ≥ 0.30 layout: [id, "", topic, seq, payload] ... [id, "", "", ff×8, ""].
                for (seq, payload) in batches {
                    let mut m = zeromq::ZmqMessage::from(id.clone());
                    m.push_back(Vec::<u8>::new().into());
                    m.push_back(topic.as_bytes().to_vec().into());
                    m.push_back(seq.to_be_bytes().to_vec().into());
                    m.push_back(payload.into());
                    if router.send(m).await.is_err() {
                        break;
                    }
                }
                let mut end = zeromq::ZmqMessage::from(id);
                end.push_back(Vec::<u8>::new().into());
                end.push_back(Vec::<u8>::new().into());
                end.push_back(vec![0xff; 8].into());
                end.push_back(Vec::<u8>::new().into());
                let _ = router.send(end).await;
            }
        });
    }

    let (tx, mut rx) = mpsc::unbounded_channel::<Submit>();
    let shared = Arc::new(Shared {
        stats: Mutex::new(Stats {
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            queries: 0,
            hits: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            success: 0,
            ttft: Hist::new(TTFT_BUCKETS),
            itl: Hist::new(ITL_BUCKETS),
            queue: Hist::new(QUEUE_BUCKETS),
            steps: 0,
            events_published: 0,
            cached_blocks: 0,
        }),
        submit: tx,
        next_id: std::sync::atomic::AtomicU64::new(1),
        created: now_unix(),
        faults: Mutex::new(Vec::new()),
        opts: opts.clone(),
    });

    // The engine task.
    let sh = shared.clone();
    let buf = replay_buffer.clone();
    tasks.spawn(async move {
        let opts = &sh.opts;
        let mut engine = Engine::new(opts.engine);
        engine.set_output_vocab(word_ids(&opts.tokenizer));
        let mut live: HashMap<u64, (mpsc::UnboundedSender<Delta>, Instant, Option<Instant>)> = HashMap::new();
        let mut seq: u64 = 0;
        let speed = opts.speedup.max(1e-3);
        let mut clock = tokio::time::Instant::now();
        loop {
            if engine.is_idle() {
                let Some(s) = rx.recv().await else { break };
                clock = tokio::time::Instant::now();
                live.insert(s.req.id, (s.tx, s.at, None));
                engine.submit(s.req);
            }
            while let Ok(s) = rx.try_recv() {
                live.insert(s.req.id, (s.tx, s.at, None));
                engine.submit(s.req);
            }
            // Abandoned requests (client gone) are aborted, as vLLM does.
            let gone: Vec<u64> = live.iter().filter(|(_, (tx, _, _))| tx.is_closed()).map(|(id, _)| *id).collect();
            for id in gone {
                engine.abort(id);
                live.remove(&id);
            }
            let step = engine.step();
            if step.ms > 0.0 {
                clock += Duration::from_secs_f64(step.ms / 1000.0 / speed);
                tokio::time::sleep_until(clock).await;
            } else if engine.is_idle() {
                continue;
            } else {
                // Nothing could run (out of blocks with nothing to preempt):
                // wait for a change rather than spin.
                tokio::time::sleep(Duration::from_millis(1)).await;
                clock = tokio::time::Instant::now();
            }
            let now = Instant::now();
            {
                let mut st = sh.stats.lock();
                for id in &step.admitted {
                    if let Some((_, at, _)) = live.get(id) {
                        st.queue.observe(now.duration_since(*at).as_secs_f64() * speed);
                    }
                }
                for out in &step.outputs {
                    match *out {
                        Output::Token { id, index, cached_tokens, .. } => {
                            if let Some((tx, at, last)) = live.get_mut(&id) {
                                if index == 0 {
                                    st.ttft.observe(now.duration_since(*at).as_secs_f64() * speed);
                                } else if let Some(l) = last {
                                    st.itl.observe(now.duration_since(*l).as_secs_f64() * speed);
                                }
                                *last = Some(now);
                                st.generation_tokens += 1;
                                let _ = tx.send(Delta::Token { index, cached: cached_tokens });
                            }
                        }
                        Output::Finished { id } => {
                            if let Some((tx, _, _)) = live.remove(&id) {
                                st.success += 1;
                                let _ = tx.send(Delta::Done);
                            }
                        }
                    }
                }
                st.running = engine.num_running();
                st.waiting = engine.num_waiting();
                st.kv_usage = engine.pool().usage();
                st.queries = engine.pool().queries_tokens;
                st.hits = engine.pool().hits_tokens;
                st.steps += 1;
                st.cached_blocks = engine.pool().cached_copies().count();
            }
            if !step.events.is_empty() {
                let payload = encode_events(&step.events, opts.engine.block_size as u32, opts.encoding);
                {
                    let mut b = buf.lock();
                    b.push_back((seq, payload.clone()));
                    while b.len() > opts.replay_buffer {
                        b.pop_front();
                    }
                }
                let faults = std::mem::take(&mut *sh.faults.lock());
                if faults.contains(&StreamFault::Gap) {
                    // The engine's buffer moved on: what it held is gone.
                    seq += opts.replay_buffer as u64 + 10;
                    let mut b = buf.lock();
                    b.clear();
                    b.push_back((seq, payload.clone()));
                }
                if let Some(p) = publisher.as_mut() {
                    if faults.contains(&StreamFault::Garbage) {
                        let one = zeromq::ZmqMessage::from(opts.topic.as_bytes().to_vec());
                        let _ = p.send(one).await;
                        let mut bad = zeromq::ZmqMessage::from(opts.topic.as_bytes().to_vec());
                        bad.push_back(b"bad".to_vec().into());
                        bad.push_back(vec![0xc1].into());
                        let _ = p.send(bad).await;
                    }
                    let mut m = zeromq::ZmqMessage::from(opts.topic.as_bytes().to_vec());
                    m.push_back(seq.to_be_bytes().to_vec().into());
                    m.push_back(payload.into());
                    if faults.contains(&StreamFault::Duplicate) {
                        let _ = p.send(m.clone()).await;
                    }
                    let _ = p.send(m).await;
                }
                seq += 1;
                sh.stats.lock().events_published += 1;
            }
        }
    });

    let app = axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/kvgate/sim/cache", get(cache_info))
        .route("/kvgate/sim/fault", post(inject_fault))
        // vLLM (FastAPI) sets no request body limit; axum's default of 2 MB
        // refused prompts vLLM accepts. 256 MiB bounds a runaway client.
        .layer(axum::extract::DefaultBodyLimit::max(256 << 20))
        .with_state(shared);
    on_bound(bound);
    // TCP_NODELAY, as vLLM's server (asyncio sets it on every TCP
    // transport): without it a small SSE chunk can wait for the client's
    // delayed ACK (40 ms).
    use axum::serve::ListenerExt as _;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let r = axum::serve(listener, app).with_graceful_shutdown(shutdown).await;
    tasks.abort_all();
    r.map_err(|e| SimError::Bind { what: "HTTP", addr: bound.to_string(), reason: e.to_string() })
}

/// One engine step's cache events as a vLLM msgpack batch.
fn encode_events(events: &[CacheEvent], block_size: u32, encoding: Encoding) -> Vec<u8> {
    let events: Vec<Event<'_>> = events
        .iter()
        .map(|e| match e {
            CacheEvent::Stored { hashes, parent, tokens } => Event::Stored(BlockStored {
                block_hashes: hashes.clone(),
                parent_block_hash: *parent,
                token_ids: tokens.clone(),
                block_size,
                medium: Some("GPU"),
                ..Default::default()
            }),
            CacheEvent::Removed { hashes } => {
                Event::Removed(BlockRemoved { block_hashes: hashes.clone(), medium: Some("GPU"), ..Default::default() })
            }
        })
        .collect();
    let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    encode_batch(&Batch { ts, dp_rank: Some(0), array_len: 3, events }, encoding)
}

/// Tokenization off the async scheduler's hands on a multi-thread runtime
/// (inline on a current-thread one, where `block_in_place` is not allowed).
fn heavy<T>(f: impl FnOnce() -> T) -> T {
    if tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
    {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = json!({
        "object": "error",
        "message": message.into(),
        "type": if status == StatusCode::NOT_FOUND { "NotFoundError" } else { "BadRequestError" },
        "param": null,
        "code": status.as_u16(),
    });
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

struct Parsed {
    prompt: Vec<u32>,
    max_tokens: usize,
    stream: bool,
    include_usage: bool,
}

fn common(sh: &Shared, body: &Value, prompt: Vec<u32>) -> Result<Parsed, Box<Response>> {
    let model = body.get("model").and_then(Value::as_str).unwrap_or_default();
    if model != sh.opts.model {
        return Err(Box::new(error(StatusCode::NOT_FOUND, format!("The model `{model}` does not exist."))));
    }
    let max_tokens = match body.get("max_completion_tokens").or_else(|| body.get("max_tokens")) {
        None | Some(Value::Null) => sh.opts.default_max_tokens,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => n as usize,
            _ => return Err(Box::new(error(StatusCode::BAD_REQUEST, "max_tokens must be an integer ≥ 1"))),
        },
    };
    if prompt.len() + max_tokens > sh.opts.max_model_len {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the messages, {} in the completion).",
                sh.opts.max_model_len,
                prompt.len() + max_tokens,
                prompt.len(),
                max_tokens
            ),
        )));
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    Ok(Parsed { prompt, max_tokens, stream, include_usage })
}

async fn chat(State(sh): State<Arc<Shared>>, body: axum::body::Bytes) -> Response {
    let arrived = Instant::now();
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "request body is not valid JSON");
    };
    let Some(messages) = body.get("messages").and_then(Value::as_array).filter(|m| !m.is_empty()) else {
        return error(StatusCode::BAD_REQUEST, "messages must be a non-empty array");
    };
    let bytes: Vec<Vec<u8>> = messages.iter().map(|m| serde_json::to_vec(m).unwrap_or_default()).collect();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let mut ctx = serde_json::Map::new();
    for k in ["tools", "documents", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"] {
        if let Some(v) = body.get(k) {
            ctx.insert(k.into(), v.clone());
        }
    }
    let ctx = if ctx.is_empty() { Vec::new() } else { serde_json::to_vec(&ctx).unwrap_or_default() };
    let hashes = chain_hashes(&ctx, &refs);
    let segs: Vec<SegmentRef<'_>> =
        bytes.iter().zip(&hashes).map(|(b, h)| SegmentRef { chain_hash: *h, message_json: b, elided: false }).collect();
    let tk = sh.opts.tokenizer.clone();
    let prompt = match heavy(|| tk.chat(&ctx, &segs)) {
        Ok(t) => t.ids,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    match common(&sh, &body, prompt) {
        Ok(p) => generate(sh, p, true, arrived).await,
        Err(r) => *r,
    }
}

async fn completions(State(sh): State<Arc<Shared>>, body: axum::body::Bytes) -> Response {
    let arrived = Instant::now();
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "request body is not valid JSON");
    };
    let prompt = match body.get("prompt") {
        Some(Value::String(s)) => match sh.opts.tokenizer.completion(s) {
            Ok(t) => t.ids,
            Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
        },
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => {
            a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect()
        }
        _ => return error(StatusCode::BAD_REQUEST, "prompt must be a string or an array of token ids"),
    };
    match common(&sh, &body, prompt) {
        Ok(p) => generate(sh, p, false, arrived).await,
        Err(r) => *r,
    }
}

async fn generate(sh: Arc<Shared>, p: Parsed, chat: bool, arrived: Instant) -> Response {
    let id = sh.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let prompt_tokens = p.prompt.len();
    sh.stats.lock().prompt_tokens += prompt_tokens as u64;
    let req = Request { id, prompt: p.prompt, max_tokens: p.max_tokens };
    // Time to first token and queue time count from arrival, before parsing
    // and tokenizing, as vLLM counts them from the request's arrival at its
    // API server.
    let at = arrived;
    // The frontend's share of time to first token (see the timing preset),
    // counted from arrival: it includes the time this worker really spent
    // parsing and tokenizing (else that time, multiplied by the speedup,
    // would count twice).
    let overhead = sh.opts.engine.timing.first_token_overhead_ms() / 1000.0 / sh.opts.speedup.max(1e-3);
    if overhead > 0.0 {
        tokio::time::sleep_until((arrived + Duration::from_secs_f64(overhead)).into()).await;
    }
    if sh.submit.send(Submit { req, tx, at }).is_err() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped");
    }
    let rid = if chat { format!("chatcmpl-{id:032x}") } else { format!("cmpl-{id:032x}") };
    let model = sh.opts.model.clone();
    let created = sh.created;
    let usage = move |completion: usize, cached: usize| {
        json!({
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    };
    if !p.stream {
        let mut text = String::new();
        let (mut n, mut cached) = (0usize, 0usize);
        while let Some(d) = rx.recv().await {
            match d {
                Delta::Token { index, cached: c } => {
                    text.push_str(word(id, index));
                    n += 1;
                    cached = c;
                }
                Delta::Done => break,
            }
        }
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text, "refusal": null, "annotations": null, "audio": null, "function_call": null, "tool_calls": [], "reasoning_content": null}, "logprobs": null, "finish_reason": "length", "stop_reason": null})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length", "stop_reason": null, "prompt_logprobs": null})
        };
        let body = json!({
            "id": rid,
            "object": if chat { "chat.completion" } else { "text_completion" },
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage(n, cached),
            "prompt_logprobs": null,
        });
        return ([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response();
    }
    let include_usage = p.include_usage;
    let object = if chat { "chat.completion.chunk" } else { "text_completion" };
    let (out_tx, out_rx) = mpsc::channel::<axum::body::Bytes>(64);
    tokio::spawn(async move {
        let chunk = |choice: Value| -> axum::body::Bytes {
            let c = json!({"id": rid, "object": object, "created": created, "model": model, "choices": [choice]});
            format!("data: {c}\n\n").into()
        };
        if chat {
            let first = json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
            if out_tx.send(chunk(first)).await.is_err() {
                return;
            }
        }
        let (mut n, mut cached) = (0usize, 0usize);
        // As vLLM's `--stream-interval`: the first token goes out at once,
        // later ones in chunks of `interval` tokens (and the rest at the end).
        let (interval, mut pending, mut text) = (sh.opts.stream_interval.max(1), 0usize, String::new());
        let content = |text: &str| {
            if chat {
                json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": null})
            } else {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": null, "stop_reason": null})
            }
        };
        loop {
            let done = match rx.recv().await {
                Some(Delta::Token { index, cached: c }) => {
                    n += 1;
                    cached = c;
                    text.push_str(word(id, index));
                    pending += 1;
                    false
                }
                Some(Delta::Done) | None => true,
            };
            if pending > 0 && (done || n == 1 || pending >= interval) {
                // A closed body (client gone) drops `rx`: the engine aborts.
                if out_tx.send(chunk(content(&text))).await.is_err() {
                    return;
                }
                text.clear();
                pending = 0;
            }
            if done {
                break;
            }
        }
        let last = if chat {
            json!({"index": 0, "delta": {"content": ""}, "logprobs": null, "finish_reason": "length", "stop_reason": null})
        } else {
            json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "length", "stop_reason": null})
        };
        let _ = out_tx.send(chunk(last)).await;
        if include_usage {
            let u = json!({"id": rid, "object": object, "created": created, "model": model, "choices": [], "usage": usage(n, cached)});
            let _ = out_tx.send(format!("data: {u}\n\n").into()).await;
        }
        let _ = out_tx.send("data: [DONE]\n\n".into()).await;
    });
    let stream = futures_util::stream::unfold(out_rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "stream"))
}

async fn models(State(sh): State<Arc<Shared>>) -> impl IntoResponse {
    let m = &sh.opts.model;
    let body = json!({
        "object": "list",
        "data": [{
            "id": m, "object": "model", "created": sh.created, "owned_by": "vllm", "root": m, "parent": null,
            "max_model_len": sh.opts.max_model_len,
            "permission": [{"id": "modelperm-kvgate-sim", "object": "model_permission", "created": sh.created,
                "allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
                "allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
                "organization": "*", "group": null, "is_blocking": false}],
        }],
    });
    ([(header::CONTENT_TYPE, "application/json")], body.to_string())
}

/// Simulator-only: the engine's cache, for tests that compare it with what
/// the KV events describe.
/// `POST /kvgate/sim/fault?kind=duplicate|garbage|gap`: the next published
/// batch carries that event-stream fault.
async fn inject_fault(
    State(sh): State<Arc<Shared>>,
    axum::extract::Query(q): axum::extract::Query<HashMap<String, String>>,
) -> impl IntoResponse {
    match q.get("kind").and_then(|k| StreamFault::parse(k)) {
        Some(f) => {
            sh.faults.lock().push(f);
            (StatusCode::OK, "queued\n")
        }
        None => (StatusCode::BAD_REQUEST, "expected ?kind=duplicate|garbage|gap\n"),
    }
}

async fn cache_info(State(sh): State<Arc<Shared>>) -> impl IntoResponse {
    let st = sh.stats.lock().clone();
    let body = json!({
        "cached_blocks": st.cached_blocks,
        "capacity_blocks": sh.opts.engine.num_blocks,
        "kv_usage": st.kv_usage,
        "steps": st.steps,
        "event_batches": st.events_published,
    });
    ([(header::CONTENT_TYPE, "application/json")], body.to_string())
}

async fn metrics(State(sh): State<Arc<Shared>>) -> impl IntoResponse {
    use std::fmt::Write as _;
    let st = sh.stats.lock().clone();
    let o = &sh.opts;
    let l = format!("engine=\"0\",model_name=\"{}\"", o.model.replace('"', "\\\""));
    let mut s = String::with_capacity(8192);
    let gauge = |s: &mut String, name: &str, help: &str, v: f64| {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{l}}} {v:?}");
    };
    let counter = |s: &mut String, name: &str, help: &str, v: u64| {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{l}}} {v}.0");
    };
    gauge(&mut s, "vllm:num_requests_running", "Number of requests in model execution batches.", st.running as f64);
    gauge(&mut s, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", st.waiting as f64);
    gauge(&mut s, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", st.kv_usage);
    counter(
        &mut s,
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        st.queries,
    );
    counter(&mut s, "vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", st.hits);
    counter(&mut s, "vllm:prompt_tokens_total", "Number of prefill tokens processed.", st.prompt_tokens);
    counter(&mut s, "vllm:generation_tokens_total", "Number of generation tokens processed.", st.generation_tokens);
    let _ = writeln!(
        s,
        "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\nvllm:request_success_total{{{l},finished_reason=\"length\"}} {}.0",
        st.success
    );
    let _ = writeln!(
        s,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"sha256\"}} 1.0",
        o.engine.block_size, o.engine.num_blocks
    );
    let _ = writeln!(s, "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.");
    st.ttft.render(&mut s, "vllm:time_to_first_token_seconds", &l);
    let _ = writeln!(s, "# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.");
    st.itl.render(&mut s, "vllm:inter_token_latency_seconds", &l);
    let _ = writeln!(s, "# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.");
    st.queue.render(&mut s, "vllm:request_queue_time_seconds", &l);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], s)
}
