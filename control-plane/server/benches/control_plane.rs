//! `make bench-cp`: the control plane's Pick path on this machine.
//!
//! For 8K- and 100K-token chat prompts, cold and warm tokenization cache, at
//! 10 and 100 workers whose index holds a realistic amount of KV (25,000
//! 16-token blocks per worker: what an H200 running Llama-3.1-70B FP8 holds),
//! it measures:
//!
//! * `pick_p50_us` / `pick_p99_us`: the control plane's handling time of one
//!   decoded `PickRequest` (validation, tokenization, block hashing, index
//!   lookup, scheduling, in-flight accounting), sequential requests;
//! * `grpc_p50_us` / `grpc_p99_us`: the same through real gRPC on loopback
//!   (tonic client → server), sequential;
//! * `picks_per_s`: gRPC throughput with 8 concurrent clients.
//!
//! *Cold*: every request is a new conversation (nothing cached, the whole
//! prompt is rendered and tokenized). *Warm*: the conversation's tokenization
//! is cached (it was seen before: retries, n-way sampling, agents resending
//! a transcript). *New turn* (`new_turn_scenarios`): the earlier messages are
//! cached and each request adds a new assistant reply and user question, so
//! ~130 new tokens are tokenized per request (the common case behind a chat
//! product).
//!
//! Also `tokenize_mb_per_s`: whole-prompt render + tokenize throughput of
//! the 100K-token prompt text. Results: `bench/results/control-plane.json`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_bench_support::quantile;
use kvgate_protocol::pb;
use kvgate_server::config::{RawConfig, RawModel, RawWorker};
use kvgate_server::router_client::RouterClient;
use serde_json::{Value, json};

// As in the `kvgate` binary.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

const MODEL: &str = "bench";
const BS: u32 = 16;
const BLOCKS_PER_WORKER: usize = 25_000;

fn words(seed: u64, n: usize) -> String {
    kvgate_bench_support::words(seed, n)
}

struct Conversation {
    messages: Vec<Value>,
}

impl Conversation {
    /// A system prompt plus turns, about `tokens` tokens in total.
    fn new(tk: &kvgate_tokenize::ChatTokenizer, tokens: usize, seed: u64) -> Self {
        let mut n_words = tokens;
        loop {
            let system = json!({"role": "system", "content": words(seed, n_words)});
            let mut messages = vec![system];
            for t in 0..3 {
                messages.push(json!({"role": "user", "content": words(seed ^ (t + 1), 40)}));
                messages.push(json!({"role": "assistant", "content": words(seed ^ (t + 100), 60)}));
            }
            messages.push(json!({"role": "user", "content": words(seed ^ 999, 30)}));
            let n = tk.encode_chat(&messages, true).map(|v| v.len()).unwrap_or(0);
            if n.abs_diff(tokens) * 100 <= tokens || n == 0 {
                return Self { messages };
            }
            n_words = (n_words as f64 * tokens as f64 / n as f64) as usize;
        }
    }

    fn request(&self, id: &str) -> pb::PickRequest {
        pb::PickRequest { stream: true, ..kvgate_server::chat_pick_request(MODEL, id, &self.messages, Some(256)) }
    }

    fn with_turn(&self, i: u64) -> Self {
        let mut messages = self.messages.clone();
        messages.push(json!({"role": "assistant", "content": words(i ^ 0xabc, 50)}));
        messages.push(json!({"role": "user", "content": words(i ^ 0xdef, 30)}));
        Self { messages }
    }
}

/// One request of a scenario. `cold`: a new conversation (the system
/// prompt differs); `warm`: the cached conversation again; `new_turn`: the
/// cached conversation plus a new assistant reply and user question.
fn make_request(base: &[Value], cache: &str, i: u64, workers: usize) -> pb::PickRequest {
    let id = format!("{cache}-{i}");
    match cache {
        "cold" => {
            let mut c = Conversation { messages: base.to_vec() };
            let s = c.messages[0]["content"].as_str().unwrap_or_default().to_owned();
            c.messages[0]["content"] = Value::String(format!("[session {i}-{workers}] {s}"));
            c.request(&id)
        }
        "warm" => Conversation { messages: base.to_vec() }.request(&id),
        _ => Conversation { messages: base.to_vec() }.with_turn(i).request(&id),
    }
}

fn populate(app: &kvgate_server::App, workers: usize, shared: &[u32]) {
    let model = &app.models[MODEL];
    let mut st = model.state.lock();
    let mut rng = fastrand::Rng::with_seed(7);
    let chain = 500usize;
    let mut engine = 1u64;
    for w in 0..workers {
        let mut left = BLOCKS_PER_WORKER;
        // A third of the workers hold the benchmark conversation's prefix.
        if w % 3 == 0 {
            let n = shared.len() / BS as usize;
            let hashes: Vec<u64> = (0..n as u64).map(|i| engine + i).collect();
            engine += n as u64;
            left = left.saturating_sub(n);
            let ev = pb::KvEvent {
                event: Some(pb::kv_event::Event::Stored(pb::BlockStored {
                    engine_hashes: hashes,
                    token_ids: shared[..n * BS as usize].to_vec(),
                    block_size: BS,
                    medium: pb::StorageMedium::Gpu as i32,
                    ..Default::default()
                })),
            };
            st.on_batch(pb::KvEventBatch { worker_id: format!("w{w}"), events: vec![ev], ..Default::default() }, 0);
        }
        while left > 0 {
            let n = chain.min(left);
            left -= n;
            let tokens: Vec<u32> = (0..n * BS as usize).map(|_| rng.u32(..120_000)).collect();
            let hashes: Vec<u64> = (0..n as u64).map(|i| engine + i).collect();
            engine += n as u64;
            let ev = pb::KvEvent {
                event: Some(pb::kv_event::Event::Stored(pb::BlockStored {
                    engine_hashes: hashes,
                    token_ids: tokens,
                    block_size: BS,
                    medium: pb::StorageMedium::Gpu as i32,
                    ..Default::default()
                })),
            };
            st.on_batch(pb::KvEventBatch { worker_id: format!("w{w}"), events: vec![ev], ..Default::default() }, 0);
        }
    }
}

/// Whole-prompt tokenization throughput of the 100K prompt's rendered text,
/// MB/s: (the `tokenizers` library, kvgate's encoder on text it has not
/// seen, kvgate's encoder on the same text again, served from its
/// paragraph cache).
fn tokenize_mb_per_s(tk: &kvgate_tokenize::ChatTokenizer, base: &Conversation) -> [f64; 3] {
    let text = tk.render(&base.messages, true, &serde_json::Map::new()).unwrap();
    let rate = |f: &mut dyn FnMut(usize)| {
        let t = Instant::now();
        let mut n = 0;
        while t.elapsed() < Duration::from_secs(3) || n < 3 {
            f(n);
            n += 1;
        }
        (text.len() * n) as f64 / t.elapsed().as_secs_f64() / 1e6
    };
    let library = rate(&mut |_| drop(tk.encode_reference(&text).unwrap()));
    // Every paragraph new: a run number in front of each line.
    let fresh = rate(&mut |n| {
        let t: String = text.lines().map(|l| format!("{n}:{l}\n")).collect();
        drop(tk.encode(&t).unwrap())
    });
    let cached = rate(&mut |_| drop(tk.encode(&text).unwrap()));
    eprintln!(
        "tokenize MB/s: library {library:.2}, kvgate fresh {fresh:.2}, kvgate cached {cached:.2} ({} bytes)",
        text.len()
    );
    [library, fresh, cached]
}

/// A control plane of `workers` static workers, kv mode, no NATS.
fn bench_config(tk_dir: &std::path::Path, workers: usize) -> kvgate_server::Config {
    let raw = RawConfig {
        listen_grpc: Some("127.0.0.1:0".into()),
        listen_admin: Some("off".into()),
        nats_url: Some("off".into()),
        replica_id: Some("bench".into()),
        tokenize_verify_every: Some(0),
        models: vec![RawModel {
            name: MODEL.into(),
            tokenizer_dir: Some(tk_dir.to_owned()),
            block_size: Some(BS),
            mode: Some("kv".into()),
            workers: (0..workers)
                .map(|w| RawWorker { id: format!("w{w}"), endpoint: format!("10.0.{}.{}:8000", w / 250, w % 250 + 1) })
                .collect(),
            ..Default::default()
        }],
        ..Default::default()
    };
    kvgate_server::Config::validate(raw).unwrap()
}

/// One scenario: what is measured and how long.
struct Scenario {
    base: Arc<Vec<Value>>,
    cache: &'static str,
    workers: usize,
    iters: usize,
    secs: f64,
}

/// In-process Pick latency (µs): the service's handling of a decoded
/// request, p50 and p99.
fn in_process(app: &kvgate_server::App, sc: &Scenario) -> (f64, f64) {
    // Pre-build requests so that building them is not measured.
    let reqs: Vec<pb::PickRequest> =
        (0..sc.iters as u64).map(|i| make_request(&sc.base, sc.cache, i, sc.workers)).collect();
    let mut lat = Vec::with_capacity(sc.iters);
    let model = &app.models[MODEL];
    for r in &reqs {
        let t = Instant::now();
        let out = app.pick(r).unwrap();
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(out);
        // Keep the in-flight table at a steady size.
        let done = pb::CompletionReport {
            request_id: r.request_id.clone(),
            model: MODEL.into(),
            total_us: 1,
            ..Default::default()
        };
        model.state.lock().on_report(&done, 0);
    }
    (quantile(&lat, 0.50), quantile(&lat, 0.99))
}

/// gRPC Pick over loopback: one client in sequence (p50, p99), then 8
/// concurrent clients for `secs` (p50, p99 under that load, picks/s).
async fn over_grpc(grpc: std::net::SocketAddr, sc: &Scenario) -> [f64; 5] {
    let mut c = RouterClient::connect(format!("http://{grpc}")).await.unwrap();
    let (from, n) = (sc.iters as u64, sc.iters.min(300) as u64);
    let reqs: Vec<pb::PickRequest> =
        (from..from + n).map(|i| make_request(&sc.base, sc.cache, i, sc.workers)).collect();
    let mut seq = Vec::new();
    for r in &reqs {
        let t = Instant::now();
        let _ = c.pick(r.clone()).await.unwrap();
        seq.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let start = Instant::now();
    let mut js = tokio::task::JoinSet::new();
    for k in 0..8usize {
        let (mut c, base, cache, workers, secs) = (c.clone(), sc.base.clone(), sc.cache, sc.workers, sc.secs);
        js.spawn(async move {
            // Fresh requests: a repeated cold or new-turn request would be a
            // cache hit.
            let (mut i, mut lat) = (1_000_000 + k as u64, Vec::new());
            while start.elapsed().as_secs_f64() < secs {
                let r = make_request(&base, cache, i, workers);
                let t = Instant::now();
                let _ = c.pick(r).await;
                lat.push(t.elapsed().as_secs_f64() * 1e6);
                i += 8;
            }
            lat
        });
    }
    let mut loaded = Vec::new();
    while let Some(Ok(l)) = js.join_next().await {
        loaded.extend(l);
    }
    let pps = loaded.len() as f64 / start.elapsed().as_secs_f64();
    [quantile(&seq, 0.5), quantile(&seq, 0.99), quantile(&loaded, 0.5), quantile(&loaded, 0.99), pps]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let tk_dir = std::env::var_os("KVGATE_TOKENIZER_DIR").map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.tools/models/deepseek-v3")
    });
    let tk = kvgate_tokenize::ChatTokenizer::from_dir(&tk_dir).expect("tokenizer (run scripts/setup.sh)");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut rows = Vec::new();
    let sizes = [8192usize, 100_000];
    let bases: Vec<Conversation> = sizes.iter().map(|t| Conversation::new(&tk, *t, *t as u64)).collect();
    let tokenize = tokenize_mb_per_s(&tk, &bases[1]);
    for workers in [10usize, 100] {
        let (bound, app, handle) = rt.block_on(kvgate_server::spawn(bench_config(&tk_dir, workers))).unwrap();
        let t = Instant::now();
        populate(&app, workers, &tk.encode_chat(&bases[1].messages, true).unwrap());
        let idx_blocks = app.index_json()[MODEL]["device_blocks"].as_u64().unwrap_or(0);
        eprintln!("{workers} workers: index of {idx_blocks} blocks built in {:.1} s", t.elapsed().as_secs_f64());
        for (si, tokens) in sizes.iter().enumerate() {
            for cache in ["cold", "warm", "new_turn"] {
                let (iters, secs) = match (*tokens, cache) {
                    (8192, "warm") => (3000, 2.0),
                    (8192, _) => (300, 2.0),
                    (_, "cold") => (15, 3.0),
                    _ => (300, 2.0),
                };
                if cache != "cold" {
                    app.pick(&bases[si].request("prewarm")).unwrap();
                }
                let sc = Scenario { base: Arc::new(bases[si].messages.clone()), cache, workers, iters, secs };
                let (p50, p99) = in_process(&app, &sc);
                let [g50, g99, l50, l99, pps] = rt.block_on(over_grpc(bound.grpc, &sc));
                eprintln!(
                    "{tokens:>6} tokens {workers:>3} workers {cache}: pick p50 {p50:.0} p99 {p99:.0} µs | gRPC p50 {g50:.0} p99 {g99:.0} µs | 8 clients p50 {l50:.0} p99 {l99:.0} µs, {pps:.0} picks/s"
                );
                rows.push(json!({
                    "tokens": tokens, "workers": workers, "cache": cache,
                    "pick_p50_us": p50.round(), "pick_p99_us": p99.round(),
                    "grpc_p50_us": g50.round(), "grpc_p99_us": g99.round(),
                    "grpc_loaded_p50_us": l50.round(), "grpc_loaded_p99_us": l99.round(),
                    "picks_per_s": pps.round(), "samples": iters, "index_blocks": idx_blocks,
                }));
            }
        }
        rt.block_on(handle.stop()).unwrap();
    }
    write_result(rows, tokenize);
}

/// `bench/results/control-plane.json`, with provenance.
fn write_result(rows: Vec<Value>, tokenize: [f64; 3]) {
    let (commit, machine) = kvgate_bench_support::provenance();
    let goal = rows
        .iter()
        .find(|r| r["tokens"] == 8192 && r["workers"] == 100 && r["cache"] == "warm")
        .and_then(|r| r["pick_p99_us"].as_f64())
        .unwrap_or(f64::NAN);
    let (new_turn, rows): (Vec<Value>, Vec<Value>) = rows.into_iter().partition(|r| r["cache"] == "new_turn");
    let result = json!({
        "scenarios": rows,
        "new_turn_scenarios": new_turn,
        "tokenize_mb_per_s": {
            "what": "the 100K prompt's rendered text, whole",
            "tokenizers_library": (tokenize[0] * 100.0).round() / 100.0,
            "kvgate_fresh_text": (tokenize[1] * 100.0).round() / 100.0,
            "kvgate_paragraph_cache": (tokenize[2] * 100.0).round() / 100.0,
        },
        "goal": {"what": "pick p99 ≤ 200 µs, warm 8K-token prompt, 100 workers", "pick_p99_us": goal, "met": goal <= 200.0},
        "grpc_loaded": "8 concurrent tonic clients on loopback, sharing the 2 cores with the server",
        "percentiles": "hdrhistogram, 3 significant digits",
        "block_size": BS,
        "blocks_per_worker": BLOCKS_PER_WORKER,
        "commit": commit,
        "machine": machine,
    });
    let out = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/results/control-plane.json");
    std::fs::write(&out, serde_json::to_string_pretty(&result).unwrap() + "\n").unwrap();
    println!("{}", serde_json::to_string_pretty(&result).unwrap());
}
