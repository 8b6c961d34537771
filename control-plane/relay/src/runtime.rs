//! The relay with its sockets: a ZMQ SUB on vLLM's event endpoint, a DEALER
//! on its replay endpoint, a NATS connection for batches, heartbeats and
//! snapshot requests. One task owns the [`RelayCore`]; it runs on one core.
//!
//! vLLM binds its PUB socket only for `*`, `::`, `ipc://` and `inproc://`
//! endpoints and connects otherwise (ARCHITECTURE §5). So with vLLM's
//! `"endpoint": "tcp://127.0.0.1:5557"` the relay *binds* that address
//! ([`ZmqMode::Bind`]); with `"tcp://*:5557"` it *connects* to
//! `tcp://127.0.0.1:5557` ([`ZmqMode::Connect`]).
//!
//! A server with several data-parallel ranks ([`RelayOptions::data_parallel_size`])
//! gets one loop per rank in this process (see [`crate::ranks`]): each its own
//! sockets, mirror, worker id and heartbeats; the health probe, the metrics
//! scrape, the NATS connection and the metrics listener are shared.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use kvgate_protocol::pb;
use kvgate_protocol::subject::Subjects;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::core::{Action, RelayConfig, RelayCore};
use crate::exposition::{RankMetrics, RelayGauges, render};
use crate::health::{Change, Health, HealthTracker};
use crate::metrics::{EngineLoad, parse_vllm_metrics};
use crate::publish::Publisher;
use crate::ranks::{rank_endpoint, rank_worker_id};

/// How the SUB socket reaches vLLM's PUB socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ZmqMode {
    /// vLLM binds (`*`, `::`, ipc): connect to this endpoint.
    Connect(String),
    /// vLLM connects (a concrete tcp address): bind this endpoint.
    Bind(String),
}

/// Everything the relay needs to run.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    /// vLLM's event endpoint.
    pub zmq: ZmqMode,
    /// Topic prefix to subscribe to ("" = all).
    pub topic: String,
    /// vLLM's replay endpoint (always bound by vLLM), if configured.
    pub replay_endpoint: Option<String>,
    /// How long to wait for replay replies.
    pub replay_timeout: Duration,
    /// NATS server URL.
    pub nats_url: String,
    /// Subject namespace.
    pub subjects: Subjects,
    /// Worker id on NATS.
    pub worker_id: String,
    /// Served model name.
    pub model: String,
    /// `ip:port` Envoy routes to.
    pub endpoint: String,
    /// vLLM's `/metrics` URL (`http://host:port/metrics`), if scraped.
    pub metrics_url: Option<String>,
    /// Heartbeat period.
    pub heartbeat_interval: Duration,
    /// Block size to announce when the engine's metrics do not say.
    pub block_size: u32,
    /// The engine's running limit (`max_num_seqs`), 0 if unknown.
    pub max_num_seqs: u32,
    /// Largest snapshot chunk.
    pub snapshot_max_chunk_bytes: usize,
    /// Where to serve the relay's own Prometheus `/metrics`, if anywhere.
    pub listen_metrics: Option<std::net::SocketAddr>,
    /// The engine's health URL (`http://host:port/health`); by default the
    /// metrics URL's `/health`. None = not probed.
    pub health_url: Option<String>,
    /// Period of the health probe.
    pub health_interval: Duration,
    /// How long a probe may take before it counts as failed.
    pub health_timeout: Duration,
    /// A probe unanswered this long marks the engine unhealthy (no new
    /// request) until a probe answers; it still fails only at
    /// `health_timeout`. None, or not below the timeout: off.
    pub health_overdue: Option<Duration>,
    /// Failing probes for this long (no success in between) = engine down:
    /// the mirror is cleared and `AllBlocksCleared` published.
    pub down_after: Duration,
    /// Messages held for NATS while it is unreachable; beyond, the oldest
    /// are dropped (consumers repair the gap with a snapshot).
    pub publish_queue: usize,
    /// Data-parallel ranks of the server (vLLM `--data-parallel-size`); 1 =
    /// the server is one engine. With more, each rank is a worker of its
    /// own (`<worker_id>/dp<rank>`, events on the endpoint's port + rank).
    pub data_parallel_size: u32,
    /// The worker's part in disaggregated serving (prefill, decode, both),
    /// announced in every heartbeat.
    pub role: pb::WorkerRole,
}

impl RelayOptions {
    /// The health URL to probe: the configured one, or `/health` beside the
    /// metrics URL.
    pub fn effective_health_url(&self) -> Option<String> {
        self.health_url.clone().or_else(|| {
            let m = self.metrics_url.as_deref()?;
            let base = m.strip_suffix("/metrics").unwrap_or(m).trim_end_matches('/');
            Some(format!("{base}/health"))
        })
    }
}

/// Why the relay stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A ZMQ socket failed.
    #[error("zmq: {0}")]
    Zmq(String),
    /// NATS failed.
    #[error("nats: {0}")]
    Nats(String),
    /// The options cannot work (a rank's endpoint cannot be derived).
    #[error("config: {0}")]
    Config(String),
}

fn zmq_err(e: impl std::fmt::Display) -> RunError {
    RunError::Zmq(e.to_string())
}

fn nats_err(e: impl std::fmt::Display) -> RunError {
    RunError::Nats(e.to_string())
}

/// `GET` of an `http://host:port/path` URL over plain TCP (enough for a
/// sidecar scraping its own pod); the body as text, for a 200 answer.
pub async fn http_get(url: &str, timeout: Duration) -> Option<String> {
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/').map_or((rest, "/".to_owned()), |(h, p)| (h, format!("/{p}")));
    let work = async {
        let mut s = tokio::net::TcpStream::connect(host).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, body) = text.split_once("\r\n\r\n")?;
        let ok = head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200");
        ok.then(|| dechunk(head, body))
    };
    tokio::time::timeout(timeout, work).await.ok().flatten()
}

/// Decodes a `transfer-encoding: chunked` body (uvicorn may send one); any
/// other body is returned as it is.
fn dechunk(head: &str, body: &str) -> String {
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    if !chunked {
        return body.to_owned();
    }
    let mut out = String::with_capacity(body.len());
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        if size == 0 || after.len() < size {
            break;
        }
        out.push_str(after.get(..size).unwrap_or(""));
        rest = after.get(size..).unwrap_or("").trim_start_matches("\r\n");
    }
    out
}

/// What the probing tasks report to the relay loops (every rank reads the
/// same probes: one server).
#[derive(Debug, Clone)]
enum Probe {
    /// A health probe's end: did the engine answer 200, and in how long?
    Health { ok: bool, seconds: f64 },
    /// A health probe unanswered for the overdue time (its end follows).
    Overdue,
    /// A metrics scrape's text (None = failed); each rank reads its share.
    Load(Option<Arc<str>>),
}

/// What a health probe told the relay loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HealthProbe {
    /// It ended: did the engine answer 200?
    Ended(bool),
    /// It has gone unanswered for the overdue time.
    Overdue,
}

/// What a prober fetches.
#[derive(Debug, Clone, Copy)]
enum ProbeKind {
    /// `/health`, with the time after which an unanswered probe is overdue.
    Health { overdue: Option<Duration> },
    /// `/metrics`.
    Load,
}

/// Probes `url` every `every`; each result goes to `tx`.
fn spawn_prober(
    url: String,
    every: Duration,
    timeout: Duration,
    kind: ProbeKind,
    tx: tokio::sync::broadcast::Sender<Probe>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut t = tokio::time::interval(every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            t.tick().await;
            let started = tokio::time::Instant::now();
            let get = http_get(&url, timeout);
            tokio::pin!(get);
            let got = match kind {
                ProbeKind::Health { overdue: Some(after) } if after < timeout => tokio::select! {
                    got = &mut get => got,
                    _ = tokio::time::sleep(after) => {
                        if tx.send(Probe::Overdue).is_err() {
                            return;
                        }
                        get.await
                    }
                },
                _ => get.await,
            };
            let p = match kind {
                ProbeKind::Health { .. } => {
                    Probe::Health { ok: got.is_some(), seconds: started.elapsed().as_secs_f64() }
                }
                ProbeKind::Load => Probe::Load(got.map(Arc::from)),
            };
            if tx.send(p).is_err() {
                return;
            }
        }
    })
}

/// Connects a SUB socket to an engine that binds, retrying until it is up.
fn spawn_connect(endpoint: String, topic: String) -> tokio::task::JoinHandle<zeromq::SubSocket> {
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(100);
        loop {
            let mut sub = zeromq::SubSocket::new();
            match sub.connect(&endpoint).await {
                Ok(()) => match sub.subscribe(&topic).await {
                    Ok(()) => {
                        tracing::info!(%endpoint, "connected to the engine's KV event socket");
                        return sub;
                    }
                    Err(e) => tracing::warn!(%endpoint, error = %e, "subscribe failed; retrying"),
                },
                Err(e) => tracing::warn!(%endpoint, error = %e, "engine's KV event socket not up yet; retrying"),
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    })
}

fn unix_nanos() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

async fn recv_sub(sub: &mut Option<zeromq::SubSocket>) -> Result<ZmqMessage, zeromq::ZmqError> {
    match sub.as_mut() {
        Some(s) => s.recv().await,
        None => std::future::pending().await,
    }
}

async fn join_connect(
    c: &mut Option<tokio::task::JoinHandle<zeromq::SubSocket>>,
) -> Result<zeromq::SubSocket, tokio::task::JoinError> {
    match c.as_mut() {
        Some(h) => h.await,
        None => std::future::pending().await,
    }
}

/// The relay loop's state (one per data-parallel rank).
struct Relay {
    /// The options, with this rank's worker id and sockets.
    opts: RelayOptions,
    /// This rank, when the server has several.
    rank: Option<u32>,
    core: RelayCore,
    nats: async_nats::Client,
    publisher: Publisher,
    kv_subject: String,
    hb_subject: String,
    epoch: u64,
    sub: Option<zeromq::SubSocket>,
    connecting: Option<tokio::task::JoinHandle<zeromq::SubSocket>>,
    dealer: Option<zeromq::DealerSocket>,
    replay_deadline: Option<tokio::time::Instant>,
    last_load: EngineLoad,
    scraped_ok: bool,
    gauges: RelayGauges,
    health: HealthTracker,
    started: tokio::time::Instant,
}

impl Relay {
    /// (Re)opens the SUB socket: binds now, or connects in the background.
    async fn open_sub(&mut self) -> Result<(), RunError> {
        self.sub = None;
        if let Some(h) = self.connecting.take() {
            h.abort();
        }
        match &self.opts.zmq {
            ZmqMode::Connect(e) => self.connecting = Some(spawn_connect(e.clone(), self.opts.topic.clone())),
            ZmqMode::Bind(e) => {
                let mut sub = zeromq::SubSocket::new();
                sub.bind(e).await.map_err(zmq_err)?;
                sub.subscribe(&self.opts.topic).await.map_err(zmq_err)?;
                self.sub = Some(sub);
            }
        }
        Ok(())
    }

    fn publish_batch(&mut self, b: pb::KvEventBatch) {
        if b.engine_ts_unix_nanos > 0 {
            self.gauges.lag_seconds = unix_nanos().saturating_sub(b.engine_ts_unix_nanos) as f64 / 1e9;
        }
        self.publisher.send(self.kv_subject.clone(), b.encode_to_vec());
    }

    async fn act(&mut self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Publish(b) => self.publish_batch(b),
                Action::RequestReplay { from_seq } => self.request_replay(from_seq).await,
            }
        }
    }

    async fn request_replay(&mut self, from_seq: u64) {
        let Some(endpoint) = self.opts.replay_endpoint.clone() else { return };
        if self.dealer.is_none() {
            let mut d = zeromq::DealerSocket::new();
            // A DEALER connect to an absent engine retries for its timeout:
            // bound it by ours, and time the replay out if it fails.
            match tokio::time::timeout(self.opts.replay_timeout, d.connect(&endpoint)).await {
                Ok(Ok(())) => self.dealer = Some(d),
                Ok(Err(e)) => tracing::warn!(%endpoint, error = %e, "replay socket connect failed"),
                Err(_) => tracing::warn!(%endpoint, "replay socket connect timed out"),
            }
        }
        if let Some(d) = self.dealer.as_mut() {
            let mut m = ZmqMessage::from(Vec::<u8>::new());
            m.push_back(from_seq.to_be_bytes().to_vec().into());
            if let Err(e) = d.send(m).await {
                tracing::warn!(error = %e, "replay request failed");
                self.dealer = None;
            }
        }
        self.replay_deadline = Some(tokio::time::Instant::now() + self.opts.replay_timeout);
    }

    fn heartbeat(&mut self) {
        let max_payload = self.nats.server_info().max_payload;
        if max_payload > 0 {
            self.core
                .set_max_batch_bytes(max_payload.saturating_sub(8 * 1024).min(crate::core::DEFAULT_MAX_BATCH_BYTES));
        }
        let l = &self.last_load;
        let hb = pb::WorkerHeartbeat {
            worker_id: self.opts.worker_id.clone(),
            model: self.opts.model.clone(),
            endpoint: self.opts.endpoint.clone(),
            relay_epoch: self.epoch,
            relay_seq: self.core.relay_seq(),
            block_size: l.block_size.unwrap_or(self.opts.block_size),
            capacity_blocks: l.capacity_blocks.unwrap_or(0),
            running: l.running.unwrap_or(0),
            waiting: l.waiting.unwrap_or(0),
            kv_usage: l.kv_usage.unwrap_or(0.0),
            max_num_seqs: self.opts.max_num_seqs,
            ts_unix_nanos: unix_nanos(),
            interval_ms: self.opts.heartbeat_interval.as_millis() as u32,
            engine_ok: self.scraped_ok,
            engine_health: self.health.state().to_pb() as i32,
            health_failures: self.health.failures(),
            data_parallel_rank: self.rank.unwrap_or(0),
            data_parallel_size: self.opts.data_parallel_size.max(1),
            role: self.opts.role as i32,
            engine_counters: l.counters,
        };
        self.publisher.send(self.hb_subject.clone(), hb.encode_to_vec());
    }

    /// A health probe's end or its being overdue: a change is announced at
    /// once; a confirmed death clears the mirror; a return from death
    /// reopens the SUB socket (the new engine process binds a new socket).
    async fn on_health(&mut self, probe: HealthProbe) -> Result<(), RunError> {
        let was = self.health.state();
        let change = match probe {
            HealthProbe::Ended(ok) => {
                self.gauges.health_failures += u64::from(!ok);
                let now = self.started.elapsed().as_millis() as u64;
                self.health.on_probe(ok, now)
            }
            HealthProbe::Overdue => {
                self.gauges.health_overdue += 1;
                self.health.on_overdue()
            }
        };
        let Change::To(state) = change else { return Ok(()) };
        tracing::warn!(engine = %self.opts.endpoint, rank = ?self.rank, from = ?was, to = ?state, "engine health changed");
        if state == Health::Down {
            let actions = self.core.engine_down();
            self.replay_deadline = None;
            self.dealer = None;
            self.act(actions).await;
        }
        if state == Health::Healthy && was == Health::Down && matches!(self.opts.zmq, ZmqMode::Connect(_)) {
            self.open_sub().await?;
        }
        self.heartbeat();
        Ok(())
    }

    fn on_snapshot_request(&mut self, req: async_nats::Message) {
        let Some(reply) = req.reply else { return };
        let max = pb::SnapshotRequest::decode(req.payload.as_ref())
            .ok()
            .map(|r| r.max_chunk_bytes as usize)
            .filter(|m| *m > 0)
            .unwrap_or(self.opts.snapshot_max_chunk_bytes);
        let bs = self.last_load.block_size.unwrap_or(self.opts.block_size);
        for chunk in self.core.snapshot(bs, max) {
            self.publisher.send(reply.to_string(), chunk.encode_to_vec());
        }
    }

    /// This rank's counters and gauges, for the metrics listener.
    fn exported(&mut self) -> RankMetrics {
        let g = &mut self.gauges;
        g.mirror_blocks = self.core.mirror().len();
        g.relay_seq = self.core.relay_seq();
        g.engine_generation = self.core.generation();
        g.nats_connected = self.nats.connection_state() == async_nats::connection::State::Connected;
        g.engine_health = self.health.state().to_pb() as u8;
        let pc = self.publisher.counters();
        g.publish_errors = pc.errors.load(std::sync::atomic::Ordering::Relaxed);
        g.publish_dropped = pc.dropped.load(std::sync::atomic::Ordering::Relaxed);
        g.publish_queued = self.publisher.queued();
        RankMetrics { counters: *self.core.counters(), gauges: self.gauges, worker: self.opts.worker_id.clone() }
    }

    /// A probe's result: what a health probe told (None for a scrape,
    /// which only updates the load).
    fn on_probe(&mut self, p: Probe) -> Option<HealthProbe> {
        match p {
            Probe::Health { ok, seconds } => {
                self.gauges.health_probe_seconds = seconds;
                return Some(HealthProbe::Ended(ok));
            }
            Probe::Overdue => return Some(HealthProbe::Overdue),
            Probe::Load(Some(text)) => {
                self.last_load = parse_vllm_metrics(&text, self.rank);
                self.scraped_ok = true;
            }
            Probe::Load(None) => {
                self.scraped_ok = false;
                self.gauges.scrape_failures += 1;
            }
        }
        None
    }
}

/// The options of rank `rank` of `size`: its worker id and sockets.
fn rank_options(base: &RelayOptions, rank: u32, size: u32) -> Result<RelayOptions, RunError> {
    let cfg = |e: crate::ranks::RankError| RunError::Config(e.to_string());
    let mut o = base.clone();
    o.worker_id = rank_worker_id(&base.worker_id, rank, size);
    o.zmq = match &base.zmq {
        ZmqMode::Connect(e) => ZmqMode::Connect(rank_endpoint(e, rank).map_err(cfg)?),
        ZmqMode::Bind(e) => ZmqMode::Bind(rank_endpoint(e, rank).map_err(cfg)?),
    };
    o.replay_endpoint = base.replay_endpoint.as_deref().map(|e| rank_endpoint(e, rank)).transpose().map_err(cfg)?;
    Ok(o)
}

fn serve_metrics(mut stream: tokio::net::TcpStream, body: String) {
    tokio::spawn(async move {
        let mut buf = [0u8; 1024];
        let _ = tokio::time::timeout(Duration::from_secs(1), stream.read(&mut buf)).await;
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let _ = stream.write_all(head.as_bytes()).await;
        let _ = stream.write_all(body.as_bytes()).await;
    });
}

/// Runs the relay until `shutdown` resolves: one loop per data-parallel
/// rank, sharing the probes, the NATS connection and the metrics listener.
/// It starts whether or not NATS and the engine are up, and never stops on
/// their failures: it errs only when a socket it must bind cannot be bound
/// or a rank's endpoint cannot be derived.
pub async fn run(opts: RelayOptions, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
    let size = opts.data_parallel_size.max(1);
    let ranks = (0..size).map(|r| rank_options(&opts, r, size)).collect::<Result<Vec<_>, _>>()?;
    // Credentials in the URL become connect options (the client ignores them there).
    let url = kvgate_protocol::nats_url::split_nats_url(&opts.nats_url);
    let connect = || {
        let o = async_nats::ConnectOptions::new()
            .name(format!("kvgate-relay {}", opts.worker_id))
            .max_reconnects(None)
            .event_callback(|e| async move { tracing::info!(event = %e, "NATS") });
        url.auth.clone().connect_options(o)
    };
    // Refused credentials are final (the relay exits and says so); a server
    // that is not up yet is not: the relay runs, holds what it must publish,
    // and connects in the background.
    let nats = match connect().connect(url.servers.as_str()).await {
        Ok(c) => c,
        Err(e)
            if matches!(
                e.kind(),
                async_nats::ConnectErrorKind::AuthorizationViolation | async_nats::ConnectErrorKind::Authentication
            ) =>
        {
            return Err(nats_err(e));
        }
        Err(e) => {
            tracing::warn!(error = %e, "NATS not reachable yet; relaying and connecting in the background");
            connect().retry_on_initial_connect().connect(url.servers.as_str()).await.map_err(nats_err)?
        }
    };
    let metrics_listener = match opts.listen_metrics {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| RunError::Zmq(format!("metrics listener {addr}: {e}")))?,
        ),
        None => None,
    };
    let (probe_tx, _) = tokio::sync::broadcast::channel(16);
    let mut probers = Vec::new();
    if let Some(u) = opts.effective_health_url() {
        let kind = ProbeKind::Health { overdue: opts.health_overdue };
        probers.push(spawn_prober(u, opts.health_interval, opts.health_timeout, kind, probe_tx.clone()));
    }
    if let Some(u) = opts.metrics_url.clone() {
        let every = opts.heartbeat_interval;
        probers.push(spawn_prober(u, every, Duration::from_millis(500), ProbeKind::Load, probe_tx.clone()));
    }
    let probing = !probers.is_empty();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut exports = Vec::new();
    let mut loops = Vec::new();
    for (r, o) in ranks.into_iter().enumerate() {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        exports.push(tx);
        let probes = probing.then(|| probe_tx.subscribe());
        let rank = (size > 1).then_some(r as u32);
        loops.push(run_rank(o, rank, nats.clone(), probes, rx, stop_rx.clone()));
    }
    drop(probe_tx);
    let listen = serve_listener(metrics_listener, exports, opts.model.clone(), stop_rx);
    let stop = async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    };
    let (result, (), ()) = tokio::join!(futures_util::future::try_join_all(loops), stop, listen);
    for p in probers {
        p.abort();
    }
    // Let queued messages go out (bounded: NATS may be down).
    let _ = tokio::time::timeout(Duration::from_secs(2), nats.flush()).await;
    result.map(|_| ())
}

async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    if stop.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Serves the relay's `/metrics`: every rank's counters in one exposition.
async fn serve_listener(
    listener: Option<tokio::net::TcpListener>,
    ranks: Vec<tokio::sync::mpsc::Sender<tokio::sync::oneshot::Sender<RankMetrics>>>,
    model: String,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let Some(listener) = listener else { return };
    loop {
        let conn = tokio::select! {
            _ = stopped(&mut stop) => return,
            c = listener.accept() => c,
        };
        let Ok((stream, _)) = conn else { continue };
        let mut all = Vec::with_capacity(ranks.len());
        for tx in &ranks {
            let (reply, got) = tokio::sync::oneshot::channel();
            if tx.send(reply).await.is_ok()
                && let Ok(e) = got.await
            {
                all.push(e);
            }
        }
        serve_metrics(stream, render(&all, &model));
    }
}

/// One rank's relay loop until `stop`.
async fn run_rank(
    opts: RelayOptions,
    rank: Option<u32>,
    nats: async_nats::Client,
    mut probes: Option<tokio::sync::broadcast::Receiver<Probe>>,
    mut exports: tokio::sync::mpsc::Receiver<tokio::sync::oneshot::Sender<RankMetrics>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), RunError> {
    let mut snapshots = nats.subscribe(opts.subjects.snapshot(&opts.model, &opts.worker_id)).await.map_err(nats_err)?;
    let epoch = {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        (t.as_nanos() as u64) ^ (u64::from(std::process::id()) << 32) ^ u64::from(rank.unwrap_or(0))
    };
    let core = RelayCore::new(RelayConfig {
        worker_id: opts.worker_id.clone(),
        model: opts.model.clone(),
        replay: opts.replay_endpoint.is_some(),
        relay_epoch: epoch,
    });
    let mut r = Relay {
        kv_subject: opts.subjects.kv_events(&opts.model, &opts.worker_id),
        hb_subject: opts.subjects.heartbeat(&opts.model, &opts.worker_id),
        publisher: Publisher::new(nats.clone(), opts.publish_queue),
        nats,
        core,
        epoch,
        sub: None,
        connecting: None,
        dealer: None,
        replay_deadline: None,
        last_load: EngineLoad::default(),
        scraped_ok: false,
        gauges: RelayGauges::default(),
        health: HealthTracker::new(opts.down_after.as_millis() as u64),
        started: tokio::time::Instant::now(),
        rank,
        opts,
    };
    r.open_sub().await?;
    let mut heartbeat = tokio::time::interval(r.opts.heartbeat_interval);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tracing::info!(worker = %r.opts.worker_id, model = %r.opts.model, endpoint = %r.opts.endpoint, rank = ?rank, "relay started");
    loop {
        tokio::select! {
            _ = stopped(&mut stop) => break,
            msg = recv_sub(&mut r.sub) => match msg {
                Ok(msg) => {
                    let frames: Vec<&[u8]> = msg.iter().map(|f| f.as_ref()).collect();
                    let actions = r.core.on_live(&frames);
                    r.act(actions).await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "KV event socket failed; reopening");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    r.open_sub().await?;
                }
            },
            s = join_connect(&mut r.connecting) => {
                r.connecting = None;
                if let Ok(s) = s {
                    r.sub = Some(s);
                    let actions = r.core.catch_up();
                    r.act(actions).await;
                }
            }
            reply = async { match r.dealer.as_mut() { Some(d) => d.recv().await, None => std::future::pending().await } },
                if r.core.replaying() => {
                let actions = match reply {
                    Ok(msg) => {
                        let frames: Vec<&[u8]> = msg.iter().map(|f| f.as_ref()).collect();
                        r.core.on_replay(&frames)
                    }
                    Err(_) => r.core.replay_timed_out(),
                };
                if !r.core.replaying() {
                    r.replay_deadline = None;
                }
                r.act(actions).await;
            }
            _ = async { match r.replay_deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } },
                if r.replay_deadline.is_some() => {
                r.replay_deadline = None;
                let actions = r.core.replay_timed_out();
                r.act(actions).await;
            }
            req = snapshots.next() => match req {
                Some(req) => r.on_snapshot_request(req),
                None => {
                    tracing::warn!("snapshot subscription closed; subscribing again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    if let Ok(s) = r.nats.subscribe(r.opts.subjects.snapshot(&r.opts.model, &r.opts.worker_id)).await {
                        snapshots = s;
                    }
                }
            },
            Some(reply) = exports.recv() => {
                let _ = reply.send(r.exported());
            }
            p = async { match probes.as_mut() { Some(p) => p.recv().await, None => std::future::pending().await } } => match p {
                Ok(p) => {
                    if let Some(health) = r.on_probe(p) {
                        r.on_health(health).await?;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => probes = None,
            },
            _ = heartbeat.tick() => r.heartbeat(),
        }
    }
    if let Some(h) = r.connecting.take() {
        h.abort();
    }
    // Let queued messages go out (bounded: NATS may be down).
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while r.publisher.queued() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    Ok(())
}
