//! The relay with its sockets: a ZMQ SUB on vLLM's event endpoint, a DEALER
//! on its replay endpoint, a NATS connection for batches, heartbeats and
//! snapshot requests. One task owns the [`RelayCore`]; it runs on one core.
//!
//! vLLM binds its PUB socket only for `*`, `::`, `ipc://` and `inproc://`
//! endpoints and connects otherwise (ARCHITECTURE §5). So with vLLM's
//! `"endpoint": "tcp://127.0.0.1:5557"` the relay *binds* that address
//! ([`ZmqMode::Bind`]); with `"tcp://*:5557"` it *connects* to
//! `tcp://127.0.0.1:5557` ([`ZmqMode::Connect`]).

use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt;
use kvgate_protocol::pb;
use kvgate_protocol::subject::Subjects;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::core::{Action, RelayConfig, RelayCore};
use crate::exposition::{RelayGauges, render};
use crate::metrics::{EngineLoad, parse_vllm_metrics};

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
}

fn zmq_err(e: impl std::fmt::Display) -> RunError {
    RunError::Zmq(e.to_string())
}

fn nats_err(e: impl std::fmt::Display) -> RunError {
    RunError::Nats(e.to_string())
}

/// `GET` of an `http://host:port/path` URL over plain TCP (enough for a
/// sidecar scraping its own pod); the body as text.
async fn http_get(url: &str, timeout: Duration) -> Option<String> {
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
        head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
    };
    tokio::time::timeout(timeout, work).await.ok().flatten()
}

/// Runs the relay until `shutdown` resolves.
pub async fn run(opts: RelayOptions, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
    // Credentials in the URL become connect options (the client ignores them there).
    let url = kvgate_protocol::nats_url::split_nats_url(&opts.nats_url);
    let connect = async_nats::ConnectOptions::new().name(format!("kvgate-relay {}", opts.worker_id));
    let connect = url.auth.connect_options(connect);
    let nats = connect.connect(url.servers.as_str()).await.map_err(nats_err)?;
    let kv_subject = opts.subjects.kv_events(&opts.model, &opts.worker_id);
    let hb_subject = opts.subjects.heartbeat(&opts.model, &opts.worker_id);
    let mut snapshots = nats.subscribe(opts.subjects.snapshot(&opts.model, &opts.worker_id)).await.map_err(nats_err)?;

    tokio::pin!(shutdown);
    let mut sub = zeromq::SubSocket::new();
    match &opts.zmq {
        // The engine binds and may not be up yet (vLLM takes minutes to load
        // a model, and in a pod both containers start together): retry with
        // backoff until it is, or until shutdown.
        ZmqMode::Connect(e) => {
            let mut backoff = Duration::from_millis(100);
            loop {
                match sub.connect(e).await {
                    Ok(()) => break,
                    Err(err) => {
                        tracing::warn!(endpoint = %e, error = %err, "engine's KV event socket not up yet; retrying")
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = &mut shutdown => return Ok(()),
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
        ZmqMode::Bind(e) => {
            sub.bind(e).await.map_err(zmq_err)?;
        }
    }
    sub.subscribe(&opts.topic).await.map_err(zmq_err)?;

    let epoch = {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        (t.as_nanos() as u64) ^ (u64::from(std::process::id()) << 32)
    };
    let mut core = RelayCore::new(RelayConfig {
        worker_id: opts.worker_id.clone(),
        model: opts.model.clone(),
        replay: opts.replay_endpoint.is_some(),
        relay_epoch: epoch,
    });
    let mut dealer: Option<zeromq::DealerSocket> = None;
    let mut replay_deadline: Option<tokio::time::Instant> = None;
    let mut heartbeat = tokio::time::interval(opts.heartbeat_interval);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_load = EngineLoad::default();
    let mut gauges = RelayGauges::default();
    let metrics_listener = match opts.listen_metrics {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| RunError::Zmq(format!("metrics listener {addr}: {e}")))?,
        ),
        None => None,
    };

    loop {
        let mut actions = Vec::new();
        tokio::select! {
            _ = &mut shutdown => break,
            msg = sub.recv() => {
                let msg = msg.map_err(zmq_err)?;
                let frames: Vec<&[u8]> = msg.iter().map(|f| f.as_ref()).collect();
                actions = core.on_live(&frames);
            }
            reply = async { match dealer.as_mut() { Some(d) => d.recv().await, None => std::future::pending().await } },
                if core.replaying() => {
                match reply {
                    Ok(msg) => {
                        let frames: Vec<&[u8]> = msg.iter().map(|f| f.as_ref()).collect();
                        actions = core.on_replay(&frames);
                    }
                    Err(_) => actions = core.replay_timed_out(),
                }
                if !core.replaying() {
                    replay_deadline = None;
                }
            }
            _ = async { match replay_deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } },
                if replay_deadline.is_some() => {
                actions = core.replay_timed_out();
                replay_deadline = None;
            }
            req = snapshots.next() => {
                let Some(req) = req else { return Err(RunError::Nats("snapshot subscription closed".into())) };
                if let Some(reply) = req.reply {
                    let max = pb::SnapshotRequest::decode(req.payload.as_ref())
                        .ok()
                        .map(|r| r.max_chunk_bytes as usize)
                        .filter(|m| *m > 0)
                        .unwrap_or(opts.snapshot_max_chunk_bytes);
                    let bs = last_load.block_size.unwrap_or(opts.block_size);
                    for chunk in core.snapshot(bs, max) {
                        nats.publish(reply.clone(), chunk.encode_to_vec().into()).await.map_err(nats_err)?;
                    }
                }
            }
            conn = async { match &metrics_listener { Some(l) => l.accept().await, None => std::future::pending().await } } => {
                if let Ok((mut stream, _)) = conn {
                    gauges.mirror_blocks = core.mirror().len();
                    gauges.relay_seq = core.relay_seq();
                    gauges.engine_generation = core.generation();
                    gauges.nats_connected = nats.connection_state() == async_nats::connection::State::Connected;
                    let body = render(core.counters(), &gauges, &opts.worker_id, &opts.model);
                    tokio::spawn(async move {
                        let mut buf = [0u8; 1024];
                        let _ = tokio::time::timeout(Duration::from_secs(1), stream.read(&mut buf)).await;
                        let head = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                            body.len()
                        );
                        let _ = stream.write_all(head.as_bytes()).await;
                        let _ = stream.write_all(body.as_bytes()).await;
                    });
                }
            }
            _ = heartbeat.tick() => {
                let scraped = match &opts.metrics_url {
                    Some(url) => http_get(url, Duration::from_millis(500)).await.map(|t| parse_vllm_metrics(&t)),
                    None => None,
                };
                match scraped {
                    Some(l) => last_load = l,
                    None if opts.metrics_url.is_some() => gauges.scrape_failures += 1,
                    None => {}
                }
                let hb = pb::WorkerHeartbeat {
                    worker_id: opts.worker_id.clone(),
                    model: opts.model.clone(),
                    endpoint: opts.endpoint.clone(),
                    relay_epoch: epoch,
                    relay_seq: core.relay_seq(),
                    block_size: last_load.block_size.unwrap_or(opts.block_size),
                    capacity_blocks: last_load.capacity_blocks.unwrap_or(0),
                    running: last_load.running.unwrap_or(0),
                    waiting: last_load.waiting.unwrap_or(0),
                    kv_usage: last_load.kv_usage.unwrap_or(0.0),
                    max_num_seqs: opts.max_num_seqs,
                    ts_unix_nanos: std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_nanos() as u64)
                        .unwrap_or(0),
                    interval_ms: opts.heartbeat_interval.as_millis() as u32,
                    engine_ok: scraped.is_some(),
                };
                nats.publish(hb_subject.clone(), hb.encode_to_vec().into()).await.map_err(nats_err)?;
            }
        }
        for a in actions {
            match a {
                Action::Publish(b) => {
                    if b.engine_ts_unix_nanos > 0 {
                        let now = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map(|d| d.as_nanos() as u64)
                            .unwrap_or(0);
                        gauges.lag_seconds = now.saturating_sub(b.engine_ts_unix_nanos) as f64 / 1e9;
                    }
                    nats.publish(kv_subject.clone(), b.encode_to_vec().into()).await.map_err(nats_err)?;
                }
                Action::RequestReplay { from_seq } => {
                    let Some(endpoint) = &opts.replay_endpoint else { continue };
                    if dealer.is_none() {
                        let mut d = zeromq::DealerSocket::new();
                        d.connect(endpoint).await.map_err(zmq_err)?;
                        dealer = Some(d);
                    }
                    if let Some(d) = dealer.as_mut() {
                        let mut m = ZmqMessage::from(Vec::<u8>::new());
                        m.push_back(from_seq.to_be_bytes().to_vec().into());
                        d.send(m).await.map_err(zmq_err)?;
                    }
                    replay_deadline = Some(tokio::time::Instant::now() + opts.replay_timeout);
                }
            }
        }
    }
    nats.flush().await.map_err(nats_err)?;
    Ok(())
}
