//! `make bench-sim`: 8 simulated workers × 64 concurrent streams in one
//! process, all on one thread (one core), at speedup 1, for 30 s. Reports
//! the simulator thread's CPU use, streamed tokens and the inter-token
//! latency the clients saw, in `bench/results/sim-scale.json`.
//!
//! The load generator runs on other threads (raw HTTP/1.1 over loopback,
//! one connection per stream, reading SSE until `[DONE]`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kvgate_sim::engine::EngineConfig;
use kvgate_sim::server::{Bound, EventSockets, WorkerOptions, run_worker};
use kvgate_sim::timing::Timing;
use kvgate_tokenize::prompt::{PromptTokenizer, TokenCacheConfig};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const WORKERS: usize = 8;
const STREAMS: usize = 64;
const SECONDS: f64 = 30.0;
const MAX_TOKENS: usize = 128;

/// utime + stime of the calling thread, in seconds.
fn thread_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of stat; index 11 and 12 here.
    (ticks(11) + ticks(12)) / 100.0
}

async fn stream_once(addr: SocketAddr, body: &str) -> Option<(usize, Vec<f64>)> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.set_nodelay(true).ok()?;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = vec![0u8; 64 << 10];
    let mut seen = Vec::new();
    let mut tokens = 0usize;
    let mut gaps = Vec::new();
    let mut last: Option<Instant> = None;
    loop {
        let n = s.read(&mut buf).await.ok()?;
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&buf[..n]);
        let k = text.matches("\"content\":\" ").count();
        if k > 0 {
            let now = Instant::now();
            if let Some(l) = last {
                gaps.push(now.duration_since(l).as_secs_f64() / k as f64);
            }
            last = Some(now);
            tokens += k;
        }
        if seen.ends_with(b"data: [DONE]\n\n") {
            break;
        }
    }
    Some((tokens, gaps))
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let dir = std::env::var_os("KVGATE_TOKENIZER_DIR").map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.tools/models/deepseek-v3")
    });
    let tokenizer = Arc::new(PromptTokenizer::from_dir(&dir, TokenCacheConfig::default()).expect("tokenizer"));

    // The simulator: one thread, one current-thread runtime, eight workers.
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (cpu_tx, cpu_rx) = std::sync::mpsc::channel::<f64>();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let sim = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let mut set = tokio::task::JoinSet::new();
            for i in 0..WORKERS {
                let opts = WorkerOptions {
                    id: format!("w{i}"),
                    model: "deepseek-v3".into(),
                    http: "127.0.0.1:0".parse().unwrap(),
                    events: EventSockets::Any([127, 0, 0, 1].into()),
                    topic: "kv-events".into(),
                    encoding: kvgate_vllm_wire::encode::Encoding::Map,
                    engine: EngineConfig {
                        max_num_seqs: 64,
                        max_num_batched_tokens: 8192,
                        num_blocks: 23_000,
                        block_size: 16,
                        timing: Timing::H200_LLAMA70B_FP8,
                        host: Default::default(),
                        kv_transfer_ms_per_token: 0.0,
                    },
                    speedup: 1.0,
                    stream_interval: 1,
                    tokenizer: tokenizer.clone(),
                    default_max_tokens: MAX_TOKENS,
                    max_model_len: 131_072,
                    replay_buffer: 1000,
                    data_parallel_size: 1,
                };
                let mut stop = stop_rx.clone();
                let tx = addr_tx.clone();
                set.spawn(run_worker(
                    opts,
                    async move {
                        let _ = stop.changed().await;
                    },
                    move |b: &Bound| {
                        let _ = tx.send(b.http);
                    },
                ));
            }
            // CPU of this thread at the start and end of the load.
            let mut stop = stop_rx.clone();
            let cpu0 = thread_cpu_seconds();
            let _ = cpu_tx.send(cpu0);
            let _ = stop.changed().await;
            let _ = cpu_tx.send(thread_cpu_seconds());
            while set.join_next().await.is_some() {}
        });
    });
    let addrs: Vec<SocketAddr> = (0..WORKERS).map(|_| addr_rx.recv().unwrap()).collect();
    let cpu_start = cpu_rx.recv().unwrap();

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let done_requests = Arc::new(AtomicU64::new(0));
    let done_tokens = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let gaps = rt.block_on(async {
        let mut js = tokio::task::JoinSet::new();
        for (w, addr) in addrs.iter().enumerate() {
            for k in 0..STREAMS {
                let addr = *addr;
                let (dr, dt) = (done_requests.clone(), done_tokens.clone());
                js.spawn(async move {
                    let system = format!("You are assistant number {w}. {}", "Answer carefully and briefly. ".repeat(150));
                    let mut gaps = Vec::new();
                    let mut round = 0;
                    while start.elapsed().as_secs_f64() < SECONDS {
                        let body = serde_json::json!({
                            "model": "deepseek-v3",
                            "messages": [
                                {"role": "system", "content": system},
                                {"role": "user", "content": format!("Stream {k}, question {round}: what is {} times {}?", k * 7, round + 3)},
                            ],
                            "max_tokens": MAX_TOKENS,
                            "stream": true,
                        })
                        .to_string();
                        round += 1;
                        if let Some((t, g)) = stream_once(addr, &body).await {
                            dr.fetch_add(1, Ordering::Relaxed);
                            dt.fetch_add(t as u64, Ordering::Relaxed);
                            gaps.extend(g);
                        }
                    }
                    gaps
                });
            }
        }
        let mut all = Vec::new();
        while let Some(r) = js.join_next().await {
            all.extend(r.unwrap_or_default());
        }
        all
    });
    let wall = start.elapsed().as_secs_f64();
    let _ = stop_tx.send(true);
    let cpu_end = cpu_rx.recv().unwrap();
    sim.join().unwrap();
    let cpu = cpu_end - cpu_start;
    let mut gaps = gaps;
    gaps.sort_by(|a, b| a.total_cmp(b));
    let p = |q: f64| gaps.get(((gaps.len() as f64 - 1.0) * q) as usize).copied().unwrap_or(f64::NAN) * 1e3;
    let reqs = done_requests.load(Ordering::Relaxed);
    let toks = done_tokens.load(Ordering::Relaxed);
    let (commit, machine) = kvgate_bench_support::provenance();
    let result = serde_json::json!({
        "workers": WORKERS,
        "streams_per_worker": STREAMS,
        "speedup": 1.0,
        "timing": "h200-llama70b-fp8",
        "seconds": (wall * 10.0).round() / 10.0,
        "sim_threads": 1,
        "sim_cpu_seconds": (cpu * 100.0).round() / 100.0,
        "sim_cpu_fraction_of_one_core": (cpu / wall * 1000.0).round() / 1000.0,
        "requests_completed": reqs,
        "tokens_streamed": toks,
        "tokens_per_s": (toks as f64 / wall).round(),
        "client_inter_token_ms": {"p50": (p(0.5) * 10.0).round() / 10.0, "p90": (p(0.9) * 10.0).round() / 10.0, "p99": (p(0.99) * 10.0).round() / 10.0},
        "expected_inter_token_ms_at_64_running": 13.0 + 0.65 * 64.0,
        "commit": commit,
        "machine": machine,
    });
    let out = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/results/sim-scale.json");
    std::fs::write(&out, serde_json::to_string_pretty(&result).unwrap() + "\n").unwrap();
    println!("{}", serde_json::to_string_pretty(&result).unwrap());
}
