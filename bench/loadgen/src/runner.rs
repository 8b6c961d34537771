//! One measured cell: `concurrency` simulated users, each running DOKS
//! conversations back to back (closed loop, no think time), through the
//! stack's front door, for a warm-up window and then a measurement window.
//!
//! Users start spread over the first half of the warm-up. At the end of the
//! measurement window no new request starts; requests in flight finish (up
//! to the drain limit) so that those started inside the window are measured
//! whole. A sampler scrapes every worker's `/metrics` beside the load.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;
use tokio::sync::Mutex;

use crate::client::ChatClient;
use crate::probe::{HostCpu, WorkerMetrics, process_cpu_s, scrape};
use crate::workload::{Doks, Req, Requests};

/// Wall-clock windows of one cell.
#[derive(Debug, Clone, Copy)]
pub struct Windows {
    /// Before measuring.
    pub warmup: Duration,
    /// Measured.
    pub measure: Duration,
    /// Longest wait for in-flight requests after the window.
    pub drain: Duration,
}

/// One request as the client saw it (seconds of wall time since the start).
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// Conversation number.
    pub conv: u64,
    /// Its starter.
    pub starter: usize,
    /// Turn (0-based).
    pub turn: usize,
    /// Sent at.
    pub start: f64,
    /// First content token after `start`.
    pub ttft: Option<f64>,
    /// Stream end after `start`.
    pub e2e: f64,
    /// Reported by the server.
    pub prompt_tokens: u64,
    /// Reported by the server.
    pub completion_tokens: u64,
    /// Reported by the server.
    pub cached_tokens: u64,
    /// Why it failed.
    pub error: Option<String>,
    /// What a kvgate router said about its choice (debug headers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route: Option<crate::client::Route>,
    /// The tenant that sent it (`x-tenant-id`), when the workload has tenants.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<&'static str>,
}

/// Load on each worker at one moment.
#[derive(Debug, Clone, Serialize)]
pub struct LoadSample {
    /// Seconds since the start.
    pub t: f64,
    /// `num_requests_running + num_requests_waiting` per worker.
    pub inflight: Vec<f64>,
    /// `num_requests_waiting` per worker.
    pub waiting: Vec<f64>,
    /// `kv_cache_usage_perc` per worker (a fraction).
    pub kv_usage: Vec<f64>,
    /// Context tokens the last decoding step attended over, per worker,
    /// where the engine reports it (the simulator; for the calibration's
    /// truth, not written out).
    #[serde(skip)]
    pub decode_context: Vec<Option<f64>>,
}

/// Everything one cell measured.
#[derive(Debug, Clone)]
pub struct CellRun {
    /// Every request (warm-up included).
    pub records: Vec<Record>,
    /// Worker load during the measurement window.
    pub samples: Vec<LoadSample>,
    /// Worker counters at the start and end of the measurement window.
    pub metrics: (Vec<WorkerMetrics>, Vec<WorkerMetrics>),
    /// Host CPU busy share during the measurement window (0–1).
    pub host_cpu: f64,
    /// CPU seconds per process role (and `client`) during the window.
    pub cpu_by_role: Vec<(String, f64)>,
    /// The windows.
    pub windows: Windows,
}

async fn scrape_all(workers: &[SocketAddr]) -> Vec<Option<WorkerMetrics>> {
    let ws = workers.to_vec();
    tokio::task::spawn_blocking(move || ws.iter().map(|&w| scrape(w)).collect()).await.unwrap_or_default()
}

fn cpu_snapshot(pids: &[(String, u32)]) -> Vec<(String, f64)> {
    let mut v: Vec<(String, f64)> = pids.iter().map(|(r, p)| (r.clone(), process_cpu_s(*p))).collect();
    v.push(("client".into(), process_cpu_s(std::process::id())));
    v
}

/// Runs one cell of the DOKS workload. Conversation numbers start at
/// `first_conv` (the same in every mode, so every mode gets the same text).
pub async fn run_doks(
    front: SocketAddr,
    workers: &[SocketAddr],
    pids: &[(String, u32)],
    workload: &Doks,
    concurrency: usize,
    windows: Windows,
    first_conv: u64,
) -> Result<CellRun> {
    let t0 = Instant::now();
    let measure_at = t0 + windows.warmup;
    let stop_at = measure_at + windows.measure;
    let hard_stop = stop_at + windows.drain;
    let next = Arc::new(AtomicU64::new(first_conv));
    let records = Arc::new(Mutex::new(Vec::<Record>::new()));
    let ramp = windows.warmup / 2;
    let mut users = tokio::task::JoinSet::new();
    for u in 0..concurrency {
        let (next, records, workload) = (next.clone(), records.clone(), workload.clone());
        let delay = ramp.mul_f64(u as f64 / concurrency.max(1) as f64);
        users.spawn(async move {
            tokio::time::sleep(delay).await;
            let mut client = ChatClient::new(front);
            'conversations: while Instant::now() < stop_at {
                let conv = workload.conversation(next.fetch_add(1, Ordering::Relaxed));
                let mut history: Vec<(&'static str, String)> = Vec::new();
                for (turn, t) in conv.turns.iter().enumerate() {
                    if Instant::now() >= stop_at {
                        break 'conversations;
                    }
                    history.push(("user", t.user.clone()));
                    let body = chat_body(&history, t.max_tokens);
                    let (rec, text) = timed_chat(&mut client, t0, hard_stop, body, (conv.id, conv.starter, turn)).await;
                    records.lock().await.push(rec);
                    // After an error the conversation starts over; after the
                    // drain limit, `stop_at` has passed and the loop ends.
                    let Some(text) = text else { continue 'conversations };
                    history.push(("assistant", text));
                }
            }
        });
    }

    let sampled = sample(t0, measure_at, stop_at, workers, pids).await;
    while users.join_next().await.is_some() {}
    let records = std::mem::take(&mut *records.lock().await);
    Ok(sampled.into_run(records, windows))
}

/// Measures a cell whose requests another client sends (`client`, which
/// returns their records on its own clock): the sampler's clock starts when
/// the first request reaches a worker, less `lead` (the first request's
/// scheduled offset), as the client's schedule cannot be started from here.
pub async fn measure_external(
    workers: &[SocketAddr],
    pids: &[(String, u32)],
    windows: Windows,
    lead: Duration,
    client: impl std::future::Future<Output = Result<Vec<Record>>>,
) -> Result<CellRun> {
    let sampler = async {
        // Bounded: a client that sends nothing still gets its window.
        let give_up = Instant::now() + Duration::from_secs(300);
        while Instant::now() < give_up {
            let m = scrape_all(workers).await;
            if m.iter().flatten().any(|x| x.queries > 0.0 || x.running + x.waiting > 0.0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let t0 = Instant::now().checked_sub(lead).unwrap_or_else(Instant::now);
        let measure_at = t0 + windows.warmup;
        sample(t0, measure_at, measure_at + windows.measure, workers, pids).await
    };
    // A client that fails ends the cell at once.
    let (records, sampled) = tokio::try_join!(client, async { Ok(sampler.await) })?;
    Ok(sampled.into_run(records, windows))
}

/// What the sampler measured beside the load.
struct Sampled {
    samples: Vec<LoadSample>,
    first: Vec<Option<WorkerMetrics>>,
    last: Vec<Option<WorkerMetrics>>,
    host_cpu: f64,
    cpu_by_role: Vec<(String, f64)>,
}

impl Sampled {
    fn into_run(self, records: Vec<Record>, windows: Windows) -> CellRun {
        let unwrap = |v: Vec<Option<WorkerMetrics>>| v.into_iter().map(Option::unwrap_or_default).collect();
        CellRun {
            records,
            samples: self.samples,
            metrics: (unwrap(self.first), unwrap(self.last)),
            host_cpu: self.host_cpu,
            cpu_by_role: self.cpu_by_role,
            windows,
        }
    }
}

/// The sampler: counters and CPU at both window edges, load every 250 ms
/// in between. Returns at `stop_at`.
async fn sample(
    t0: Instant,
    measure_at: Instant,
    stop_at: Instant,
    workers: &[SocketAddr],
    pids: &[(String, u32)],
) -> Sampled {
    tokio::time::sleep_until(measure_at.into()).await;
    let first = scrape_all(workers).await;
    let (cpu0, procs0) = (HostCpu::read(), cpu_snapshot(pids));
    let mut samples = Vec::new();
    let every = Duration::from_millis(250);
    let mut tick = measure_at;
    while tick + every < stop_at {
        tick += every;
        tokio::time::sleep_until(tick.into()).await;
        let m = scrape_all(workers).await;
        samples.push(LoadSample {
            t: (Instant::now() - t0).as_secs_f64(),
            inflight: m.iter().map(|x| x.map_or(0.0, |x| x.running + x.waiting)).collect(),
            waiting: m.iter().map(|x| x.map_or(0.0, |x| x.waiting)).collect(),
            kv_usage: m.iter().map(|x| x.map_or(0.0, |x| x.kv_usage)).collect(),
            decode_context: m.iter().map(|x| x.and_then(|x| x.decode_context)).collect(),
        });
    }
    tokio::time::sleep_until(stop_at.into()).await;
    let last = scrape_all(workers).await;
    let (cpu1, procs1) = (HostCpu::read(), cpu_snapshot(pids));
    let cpu_by_role = procs1.into_iter().zip(procs0).map(|((r, b), (_, a))| (r, (b - a).max(0.0))).collect();
    Sampled { samples, first, last, host_cpu: cpu1.since(&cpu0), cpu_by_role }
}

/// Sends one chat request (given up at `hard_stop`) and records what the
/// client saw; `id` is (conversation or request number, starter or group,
/// turn). Returns the reply's text, or `None` when it failed.
async fn timed_chat(
    client: &mut ChatClient,
    t0: Instant,
    hard_stop: Instant,
    body: Vec<u8>,
    (conv, starter, turn): (u64, usize, usize),
) -> (Record, Option<String>) {
    let start = Instant::now();
    let left = hard_stop.saturating_duration_since(start);
    let result = tokio::time::timeout(left, client.chat(body)).await;
    let mut rec = Record {
        conv,
        starter,
        turn,
        start: (start - t0).as_secs_f64(),
        ttft: None,
        e2e: start.elapsed().as_secs_f64(),
        prompt_tokens: 0,
        completion_tokens: 0,
        cached_tokens: 0,
        error: None,
        route: None,
        tenant: client.tenant,
    };
    let text = match result {
        Ok(Ok(reply)) => {
            rec.ttft = reply.ttft.map(|d| d.as_secs_f64());
            rec.e2e = reply.e2e.as_secs_f64();
            rec.prompt_tokens = reply.prompt_tokens;
            rec.completion_tokens = reply.completion_tokens;
            rec.cached_tokens = reply.cached_tokens;
            rec.route = reply.route;
            Some(reply.text)
        }
        Ok(Err(e)) => {
            rec.error = Some(format!("{e:#}"));
            None
        }
        Err(_) => {
            rec.error = Some("timed out at the drain limit".into());
            None
        }
    };
    (rec, text)
}

/// How requests of a [`Requests`] workload are sent.
#[derive(Debug, Clone, Copy)]
pub enum Load {
    /// `n` users, each sending the next request when its last one ended.
    Closed(usize),
    /// Every request at its own arrival time (open loop), the workload's
    /// simulated arrival times divided by `speedup`.
    Open { speedup: f64 },
}

/// Sends request `i` of a request-level workload and keeps its record.
async fn record_request(
    client: &mut ChatClient,
    t0: Instant,
    hard_stop: Instant,
    i: u64,
    req: &Req,
    records: &Mutex<Vec<Record>>,
    tenant: Option<&'static str>,
) {
    client.tenant = tenant;
    let (rec, _) =
        timed_chat(client, t0, hard_stop, chat_body(&req.history(), req.max_tokens), (i, req.group, 0)).await;
    records.lock().await.push(rec);
}

/// Runs a request-level workload (each request independent: no history is
/// carried between them) through `front`. Request `i` is `wl.request(i)`;
/// the same `i` gives the same request in every mode.
pub async fn run_requests(
    front: SocketAddr,
    workers: &[SocketAddr],
    pids: &[(String, u32)],
    wl: &Requests,
    load: Load,
    windows: Windows,
) -> Result<CellRun> {
    let t0 = Instant::now();
    let measure_at = t0 + windows.warmup;
    let stop_at = measure_at + windows.measure;
    let hard_stop = stop_at + windows.drain;
    let records = Arc::new(Mutex::new(Vec::<Record>::new()));
    let mut tasks = tokio::task::JoinSet::new();
    match load {
        Load::Closed(n) => {
            let next = Arc::new(AtomicU64::new(0));
            let ramp = windows.warmup / 2;
            for u in 0..n {
                let (next, records, wl) = (next.clone(), records.clone(), wl.clone());
                let delay = ramp.mul_f64(u as f64 / n.max(1) as f64);
                tasks.spawn(async move {
                    tokio::time::sleep(delay).await;
                    let mut client = ChatClient::new(front);
                    while Instant::now() < stop_at {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(req) = wl.request(i) else { break };
                        record_request(&mut client, t0, hard_stop, i, &req, &records, wl.tenant(i)).await;
                    }
                });
            }
        }
        Load::Open { speedup } => {
            let (records, wl) = (records.clone(), wl.clone());
            tasks.spawn(async move {
                let mut inflight = tokio::task::JoinSet::new();
                for i in 0.. {
                    let Some(req) = wl.request(i) else { break };
                    let at = t0 + Duration::from_secs_f64(req.at_s / speedup.max(1e-9));
                    if at >= stop_at {
                        break;
                    }
                    tokio::time::sleep_until(at.into()).await;
                    // One connection per request in flight, as independent
                    // clients arriving do.
                    let mut client = ChatClient::new(front);
                    let records = records.clone();
                    let tenant = wl.tenant(i);
                    inflight.spawn(async move {
                        record_request(&mut client, t0, hard_stop, i, &req, &records, tenant).await;
                    });
                }
                while inflight.join_next().await.is_some() {}
            });
        }
    }
    let sampled = sample(t0, measure_at, stop_at, workers, pids).await;
    while tasks.join_next().await.is_some() {}
    let records = std::mem::take(&mut *records.lock().await);
    Ok(sampled.into_run(records, windows))
}

/// The served model name (the test tokenizer's).
pub const MODEL: &str = "deepseek-v3";

/// The streaming chat request of one turn.
pub fn chat_body(history: &[(&str, String)], max_tokens: u32) -> Vec<u8> {
    #[derive(Serialize)]
    struct Msg<'a> {
        role: &'a str,
        content: &'a str,
    }
    #[derive(Serialize)]
    struct Body<'a> {
        model: &'a str,
        messages: Vec<Msg<'a>>,
        max_tokens: u32,
        stream: bool,
        stream_options: serde_json::Value,
    }
    let body = Body {
        model: MODEL,
        messages: history.iter().map(|(r, c)| Msg { role: r, content: c }).collect(),
        max_tokens,
        stream: true,
        stream_options: serde_json::json!({"include_usage": true}),
    };
    serde_json::to_vec(&body).unwrap_or_default()
}
