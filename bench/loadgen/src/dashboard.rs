//! The live dashboard: every mode's stack under the same DOKS load at once,
//! a web page with a concurrency slider and rolling metrics for every mode,
//! like the load-generator UI of the DOKS demo.
//!
//! - [`Live`] drives the load: per mode, `target` closed-loop users run DOKS
//!   conversations through that mode's front door (user `i` runs while
//!   `i < target`, so moving the slider down lets users finish their turn
//!   and leave). Every mode gets the same conversations in the same order.
//! - [`Live::snapshot`] summarizes the last `window` of wall time per mode,
//!   in simulated time (× speedup) as the benchmark reports: TTFT p50/p95,
//!   ITL p50, E2E p50, output tokens/s, requests/s, the prefix hit rate
//!   (cached over prompt tokens, from the usage every reply reports) and
//!   errors; plus the host's CPU use over the same window.
//! - [`serve`] is the HTTP side: `GET /` (the page), `GET /api/metrics`
//!   (the snapshot as JSON), `POST /api/concurrency` (`{"concurrency": n}`).
//!
//! The modes share one machine while the dashboard runs: it shows the
//! behaviour live; the numbers of record come from `kvgate-bench doks`,
//! which measures one mode at a time.

use std::collections::{BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Serialize;

use crate::client::ChatClient;
use crate::probe::HostCpu;
use crate::stats::quantile;
use crate::workload::Doks;

/// The page (self-contained: its script and charts are inline).
pub const PAGE: &str = include_str!("dashboard.html");

/// One finished request, as the dashboard keeps it.
#[derive(Debug, Clone, Copy)]
struct Done {
    at: Instant,
    ttft: Option<f64>,
    e2e: f64,
    prompt: u64,
    cached: u64,
    tokens: u64,
    error: bool,
}

/// One mode's load and what it measured.
pub struct ModeLoad {
    name: String,
    front: SocketAddr,
    done: Mutex<VecDeque<Done>>,
    alive: Mutex<BTreeSet<usize>>,
    next_conv: AtomicU64,
}

/// Everything the dashboard drives and shows.
pub struct Live {
    modes: Vec<Arc<ModeLoad>>,
    target: AtomicUsize,
    max: usize,
    speedup: f64,
    window: Duration,
    workload: Doks,
    cpu: Mutex<VecDeque<(Instant, HostCpu)>>,
}

/// One mode's rolling metrics (simulated time).
#[derive(Debug, Clone, Serialize)]
pub struct ModeSnapshot {
    pub mode: String,
    pub users: usize,
    pub requests: usize,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p95_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub e2e_p50_s: Option<f64>,
    pub output_tok_per_s: f64,
    pub rps: f64,
    pub hit_rate: Option<f64>,
    pub errors: usize,
}

/// What `GET /api/metrics` answers.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub concurrency: usize,
    pub max_concurrency: usize,
    pub speedup: f64,
    pub window_s: f64,
    pub host_cpu: Option<f64>,
    pub modes: Vec<ModeSnapshot>,
}

fn opt(v: f64) -> Option<f64> {
    v.is_finite().then_some(v)
}

impl Live {
    /// `modes`: (name, front door) of every stack; `concurrency`: the
    /// starting number of users per mode, at most `max`.
    pub fn new(
        modes: Vec<(String, SocketAddr)>,
        concurrency: usize,
        max: usize,
        speedup: f64,
        window: Duration,
        workload: Doks,
    ) -> Arc<Live> {
        Arc::new(Live {
            modes: modes
                .into_iter()
                .map(|(name, front)| {
                    Arc::new(ModeLoad {
                        name,
                        front,
                        done: Mutex::new(VecDeque::new()),
                        alive: Mutex::new(BTreeSet::new()),
                        next_conv: AtomicU64::new(0),
                    })
                })
                .collect(),
            target: AtomicUsize::new(concurrency.min(max)),
            max,
            speedup,
            window,
            workload,
            cpu: Mutex::new(VecDeque::new()),
        })
    }

    /// Sets the users per mode (clamped to the maximum); returns the value set.
    pub fn set_concurrency(&self, n: usize) -> usize {
        let n = n.min(self.max);
        self.target.store(n, Ordering::Relaxed);
        n
    }

    /// Users per mode asked for.
    pub fn concurrency(&self) -> usize {
        self.target.load(Ordering::Relaxed)
    }

    /// Runs the load until `stop` resolves: starts users up to the target
    /// every 200 ms, samples host CPU every second, forgets what left the
    /// window. Users still in a turn are left to the runtime's shutdown.
    pub async fn drive(self: Arc<Self>, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let mut n = 0u64;
        loop {
            tokio::select! {
                _ = &mut stop => return,
                _ = tick.tick() => {}
            }
            let target = self.concurrency();
            for m in &self.modes {
                let new: Vec<usize> = {
                    let mut alive = m.alive.lock().unwrap_or_else(|e| e.into_inner());
                    let new: Vec<usize> = (0..target).filter(|u| !alive.contains(u)).collect();
                    alive.extend(new.iter().copied());
                    new
                };
                for u in new {
                    tokio::spawn(user(self.clone(), m.clone(), u));
                }
            }
            n += 1;
            if n.is_multiple_of(5) {
                let now = Instant::now();
                let mut cpu = self.cpu.lock().unwrap_or_else(|e| e.into_inner());
                cpu.push_back((now, HostCpu::read()));
                while cpu.len() > 2 && cpu.front().is_some_and(|(t, _)| now.duration_since(*t) > self.window) {
                    cpu.pop_front();
                }
                drop(cpu);
                for m in &self.modes {
                    let mut d = m.done.lock().unwrap_or_else(|e| e.into_inner());
                    while d.front().is_some_and(|x| now.duration_since(x.at) > self.window) {
                        d.pop_front();
                    }
                }
            }
        }
    }

    /// The rolling metrics of every mode.
    pub fn snapshot(&self) -> Snapshot {
        let now = Instant::now();
        let sp = self.speedup;
        let modes = self
            .modes
            .iter()
            .map(|m| {
                let done: Vec<Done> = m
                    .done
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .filter(|d| now.duration_since(d.at) <= self.window)
                    .copied()
                    .collect();
                let ok: Vec<&Done> = done.iter().filter(|d| !d.error).collect();
                let ttft: Vec<f64> = ok.iter().filter_map(|d| d.ttft).map(|t| t * sp * 1000.0).collect();
                let itl: Vec<f64> = ok
                    .iter()
                    .filter(|d| d.tokens > 1)
                    .filter_map(|d| d.ttft.map(|t| (d.e2e - t) / (d.tokens - 1) as f64 * sp * 1000.0))
                    .collect();
                let e2e: Vec<f64> = ok.iter().map(|d| d.e2e * sp).collect();
                let prompt: u64 = ok.iter().map(|d| d.prompt).sum();
                let cached: u64 = ok.iter().map(|d| d.cached).sum();
                let tokens: u64 = ok.iter().map(|d| d.tokens).sum();
                let sim_window = self.window.as_secs_f64() * sp;
                ModeSnapshot {
                    mode: m.name.clone(),
                    users: m.alive.lock().unwrap_or_else(|e| e.into_inner()).len(),
                    requests: ok.len(),
                    ttft_p50_ms: opt(quantile(&ttft, 0.5)),
                    ttft_p95_ms: opt(quantile(&ttft, 0.95)),
                    itl_p50_ms: opt(quantile(&itl, 0.5)),
                    e2e_p50_s: opt(quantile(&e2e, 0.5)),
                    output_tok_per_s: tokens as f64 / sim_window,
                    rps: ok.len() as f64 / sim_window,
                    hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
                    errors: done.len() - ok.len(),
                }
            })
            .collect();
        let host_cpu = {
            let cpu = self.cpu.lock().unwrap_or_else(|e| e.into_inner());
            match (cpu.front(), cpu.back()) {
                (Some((t0, a)), Some((t1, b))) if t1 > t0 => Some(b.since(a)),
                _ => None,
            }
        };
        Snapshot {
            concurrency: self.concurrency(),
            max_concurrency: self.max,
            speedup: sp,
            window_s: self.window.as_secs_f64(),
            host_cpu,
            modes,
        }
    }
}

/// User `u` of mode `m`: DOKS conversations back to back while `u` is below
/// the target.
async fn user(live: Arc<Live>, m: Arc<ModeLoad>, u: usize) {
    let mut client = ChatClient::new(m.front);
    'conversations: while u < live.concurrency() {
        let conv = live.workload.conversation(m.next_conv.fetch_add(1, Ordering::Relaxed));
        let mut history: Vec<(&'static str, String)> = Vec::new();
        for t in &conv.turns {
            if u >= live.concurrency() {
                break 'conversations;
            }
            history.push(("user", t.user.clone()));
            let body = crate::runner::chat_body(&history, t.max_tokens);
            // A turn that takes longer than ten windows is given up.
            let result = tokio::time::timeout(live.window * 10, client.chat(body)).await;
            let mut d = Done { at: Instant::now(), ttft: None, e2e: 0.0, prompt: 0, cached: 0, tokens: 0, error: true };
            let reply = match result {
                Ok(Ok(reply)) => {
                    d.error = false;
                    d.ttft = reply.ttft.map(|t| t.as_secs_f64());
                    d.e2e = reply.e2e.as_secs_f64();
                    d.prompt = reply.prompt_tokens;
                    d.cached = reply.cached_tokens;
                    d.tokens = reply.completion_tokens;
                    Some(reply.text)
                }
                _ => None,
            };
            m.done.lock().unwrap_or_else(|e| e.into_inner()).push_back(d);
            match reply {
                Some(text) => history.push(("assistant", text)),
                None => {
                    // Do not hammer a broken front door.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue 'conversations;
                }
            }
        }
    }
    m.alive.lock().unwrap_or_else(|e| e.into_inner()).remove(&u);
}

fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r.headers_mut().insert(hyper::header::CACHE_CONTROL, hyper::header::HeaderValue::from_static("no-store"));
    r
}

fn json_reply<T: Serialize>(v: &T) -> Response<Full<Bytes>> {
    match serde_json::to_vec(v) {
        Ok(b) => reply(StatusCode::OK, "application/json", b),
        Err(e) => reply(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", e.to_string()),
    }
}

async fn handle(live: Arc<Live>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/") | (&Method::GET, "/index.html") => reply(StatusCode::OK, "text/html; charset=utf-8", PAGE),
        (&Method::GET, "/api/metrics") => json_reply(&live.snapshot()),
        (&Method::POST, "/api/concurrency") => {
            let body = match req.into_body().collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return reply(StatusCode::BAD_REQUEST, "text/plain", e.to_string()),
            };
            #[derive(serde::Deserialize)]
            struct Set {
                concurrency: usize,
            }
            match serde_json::from_slice::<Set>(&body) {
                Ok(s) => {
                    let n = live.set_concurrency(s.concurrency);
                    json_reply(&serde_json::json!({"concurrency": n}))
                }
                Err(e) => reply(
                    StatusCode::BAD_REQUEST,
                    "application/json",
                    serde_json::json!({"error": format!("expected {{\"concurrency\": n}}: {e}")}).to_string(),
                ),
            }
        }
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found"),
    }
}

/// Serves the page and its API on `listener` until `stop` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    live: Arc<Live>,
    stop: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    tokio::pin!(stop);
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut stop => return Ok(()),
            r = listener.accept() => r?,
        };
        let live = live.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let live = live.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(live, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_snapshot_is_in_simulated_time_over_the_window() {
        let live = Live::new(
            vec![("kv".into(), ([127, 0, 0, 1], 9).into())],
            5,
            10,
            4.0,
            Duration::from_secs(60),
            Doks::default(),
        );
        assert_eq!(live.set_concurrency(50), 10, "clamped to the maximum");
        let now = Instant::now();
        let m = &live.modes[0];
        {
            let mut d = m.done.lock().unwrap();
            // 11 tokens in 1.1 s of wall time, first after 0.1 s: ITL 0.1 s wall.
            for _ in 0..4 {
                d.push_back(Done {
                    at: now,
                    ttft: Some(0.1),
                    e2e: 1.1,
                    prompt: 100,
                    cached: 75,
                    tokens: 11,
                    error: false,
                });
            }
            d.push_back(Done { at: now, ttft: None, e2e: 0.0, prompt: 0, cached: 0, tokens: 0, error: true });
        }
        let s = live.snapshot();
        let k = &s.modes[0];
        assert_eq!((k.requests, k.errors), (4, 1));
        // Percentiles carry hdrhistogram's precision (3 significant digits).
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() <= b * 1e-3);
        assert!(close(k.ttft_p50_ms, 400.0), "{:?}", k.ttft_p50_ms);
        assert!(close(k.itl_p50_ms, 400.0), "{:?}", k.itl_p50_ms);
        assert!(close(k.e2e_p50_s, 4.4), "{:?}", k.e2e_p50_s);
        assert_eq!(k.hit_rate, Some(0.75));
        // 44 tokens over 60 s of wall time = 240 s simulated.
        assert!((k.output_tok_per_s - 44.0 / 240.0).abs() < 1e-9);
        let j = serde_json::to_value(&s).unwrap();
        assert_eq!(j["modes"][0]["mode"], "kv");
        assert_eq!(j["concurrency"], 10);
    }
}
