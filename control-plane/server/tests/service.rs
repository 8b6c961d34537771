//! The control plane end to end: real nats-server, real gRPC on 127.0.0.1,
//! and the real relay logic (`kvgate_relay::RelayCore` fed vLLM wire frames)
//! publishing batches, heartbeats and snapshots in the relay's format.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use kvgate_protocol::pb;
use kvgate_protocol::subject::Subjects;
use kvgate_relay::core::{Action, RelayConfig, RelayCore};
use kvgate_server::config::{RawConfig, RawModel};
use kvgate_server::router_client::RouterClient;
use kvgate_server::{App, Config};
use kvgate_testkit::NatsServer;
use kvgate_vllm_wire::encode::{Encoding, encode_batch};
use kvgate_vllm_wire::{Batch, BlockStored, Event};
use prost::Message as _;
use tokio::sync::Mutex;

const MODEL: &str = "m";
const BS: u32 = 16;

/// One worker's relay: the real relay core, driven with vLLM frames, on a
/// real NATS connection, answering snapshot requests.
struct TestRelay {
    id: String,
    endpoint: String,
    epoch: u64,
    core: Arc<Mutex<RelayCore>>,
    nats: async_nats::Client,
    seq: u64,
    next_hash: u64,
    /// Publish batches (false: lost, as during a NATS outage).
    online: bool,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl TestRelay {
    async fn start(nats_port: u16, id: &str, endpoint: &str, epoch: u64) -> Self {
        let nats = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect(format!("127.0.0.1:{nats_port}"))
            .await
            .unwrap();
        let core = Arc::new(Mutex::new(RelayCore::new(RelayConfig {
            worker_id: id.into(),
            model: MODEL.into(),
            replay: false,
            relay_epoch: epoch,
        })));
        let subjects = Subjects::default();
        let mut sub = nats.subscribe(subjects.snapshot(MODEL, id)).await.unwrap();
        nats.flush().await.unwrap();
        let (c2, n2) = (core.clone(), nats.clone());
        let snap = tokio::spawn(async move {
            while let Some(req) = sub.next().await {
                let Some(reply) = req.reply else { continue };
                let chunks = c2.lock().await.snapshot(BS, 4096);
                for c in chunks {
                    let _ = n2.publish(reply.clone(), c.encode_to_vec().into()).await;
                }
                let _ = n2.flush().await;
            }
        });
        Self {
            id: id.into(),
            endpoint: endpoint.into(),
            epoch,
            core,
            nats,
            seq: 0,
            next_hash: epoch.wrapping_mul(1_000_003) | 1,
            online: true,
            tasks: vec![snap],
        }
    }

    async fn feed(&mut self, events: Vec<Event<'_>>) {
        let batch = Batch { ts: 1.0, dp_rank: Some(0), array_len: 3, events };
        let payload = encode_batch(&batch, Encoding::Map);
        let seq = self.seq.to_be_bytes();
        self.seq += 1;
        let frames: [&[u8]; 3] = [b"kv-events", &seq, &payload];
        let actions = self.core.lock().await.on_live(&frames);
        for a in actions {
            if let Action::Publish(b) = a
                && self.online
            {
                self.nats
                    .publish(Subjects::default().kv_events(MODEL, &self.id), b.encode_to_vec().into())
                    .await
                    .unwrap();
            }
        }
        if self.online {
            self.nats.flush().await.unwrap();
        }
    }

    /// Stores the full blocks of `tokens` as one chain; returns engine hashes.
    async fn store(&mut self, tokens: &[u32]) -> Vec<u64> {
        let n = tokens.len() / BS as usize;
        let hashes: Vec<u64> = (0..n)
            .map(|_| {
                self.next_hash = self.next_hash.wrapping_add(0x9e37_79b9_7f4a_7c15);
                self.next_hash
            })
            .collect();
        let ev = Event::Stored(BlockStored {
            block_hashes: hashes.clone(),
            parent_block_hash: None,
            token_ids: tokens[..n * BS as usize].to_vec(),
            block_size: BS,
            medium: Some("GPU"),
            ..Default::default()
        });
        self.feed(vec![ev]).await;
        hashes
    }

    async fn clear(&mut self) {
        self.feed(vec![Event::Cleared]).await;
    }

    async fn heartbeat(&self) {
        let core = self.core.lock().await;
        let hb = pb::WorkerHeartbeat {
            worker_id: self.id.clone(),
            model: MODEL.into(),
            endpoint: self.endpoint.clone(),
            relay_epoch: self.epoch,
            relay_seq: core.relay_seq(),
            block_size: BS,
            capacity_blocks: 100_000,
            interval_ms: 100,
            engine_ok: true,
            max_num_seqs: 64,
            ..Default::default()
        };
        drop(core);
        // No flush: while NATS is down a flush waits for the reconnection.
        let _ = self.nats.publish(Subjects::default().heartbeat(MODEL, &self.id), hb.encode_to_vec().into()).await;
    }
}

impl Drop for TestRelay {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn config(nats_port: u16, mode: &str, replica: &str) -> Config {
    Config::validate(RawConfig {
        listen_grpc: Some("127.0.0.1:0".into()),
        listen_admin: Some("127.0.0.1:0".into()),
        nats_url: Some(format!("nats://127.0.0.1:{nats_port}")),
        replica_id: Some(replica.into()),
        snapshot_timeout_ms: Some(1000),
        models: vec![RawModel {
            name: MODEL.into(),
            block_size: Some(BS),
            mode: Some(mode.into()),
            heartbeat_timeout_ms: Some(700),
            tokenizer_dir: Some(kvgate_testkit::repo_root().join(".tools/models/deepseek-v3")),
            ..Default::default()
        }],
        ..Default::default()
    })
    .unwrap()
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(salt) % 100_000).collect()
}

fn pick_req(id: &str, ids: &[u32]) -> pb::PickRequest {
    pb::PickRequest {
        request_id: id.into(),
        model: MODEL.into(),
        api: pb::ApiKind::Completions as i32,
        prompt: Some(pb::pick_request::Prompt::PromptTokenIds(pb::TokenIds { ids: ids.to_vec() })),
        max_tokens: Some(16),
        ..Default::default()
    }
}

async fn client(addr: std::net::SocketAddr) -> RouterClient<tonic::transport::Channel> {
    RouterClient::connect(format!("http://{addr}")).await.unwrap()
}

async fn done(c: &mut RouterClient<tonic::transport::Channel>, id: &str, worker: &str) {
    let r = pb::CompletionReport {
        request_id: id.into(),
        model: MODEL.into(),
        worker_id: worker.into(),
        status_code: 200,
        ttfb_us: 1000,
        total_us: 5000,
        ..Default::default()
    };
    c.report(pb::CompletionReportBatch { reporter_id: "t".into(), reports: vec![r] }).await.unwrap();
}

/// Polls `cond` every 20 ms for up to `secs`, while `tick` runs (heartbeats).
async fn until<F, Fut>(secs: u64, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while tokio::time::Instant::now() < deadline {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

/// Heartbeats for these relays every 100 ms until the returned handle drops.
fn heartbeats(relays: Vec<Arc<Mutex<TestRelay>>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            for r in &relays {
                r.lock().await.heartbeat().await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

fn worker_blocks(app: &App, id: &str) -> u64 {
    app.workers_json(Some(MODEL))[MODEL]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == id)
        .map_or(0, |w| w["device_blocks"].as_u64().unwrap())
}

fn worker_live(app: &App, id: &str) -> bool {
    app.workers_json(Some(MODEL))[MODEL].as_array().unwrap().iter().any(|w| w["id"] == id && w["live"] == true)
}

async fn http(addr: std::net::SocketAddr, method: &'static str, path: &'static str) -> kvgate_testkit::HttpResponse {
    tokio::task::spawn_blocking(move || kvgate_testkit::http_request(addr, method, path, &[], b"").unwrap())
        .await
        .unwrap()
}

fn metric(text: &str, series_prefix: &str) -> f64 {
    kvgate_testkit::prom::value(text, series_prefix).unwrap_or_else(|| panic!("no metric {series_prefix} in\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_change_the_pick_and_cleared_or_dead_workers_lose_overlap() {
    let dir = kvgate_testkit::scratch_dir("cp-events").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let (bound, app, handle) = kvgate_server::spawn(config(nats.port, "kv", "cp-a")).await.unwrap();
    let mut c = client(bound.grpc).await;

    let w0 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w0", "127.0.0.1:9000", 10).await));
    let w1 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w1", "127.0.0.1:9001", 11).await));
    let w2 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w2", "127.0.0.1:9002", 12).await));
    let hb_all = heartbeats(vec![w0.clone(), w2.clone()]);
    let hb_w1 = heartbeats(vec![w1.clone()]);
    until(5, "three live workers", || async { ["w0", "w1", "w2"].iter().all(|w| worker_live(&app, w)) }).await;

    let p = prompt(64 * BS as usize, 7);
    // Nothing cached: some worker, zero overlap.
    let r = c.pick(pick_req("r0", &p)).await.unwrap().into_inner();
    assert_eq!((r.matched_blocks, r.total_blocks), (0, 64));
    done(&mut c, "r0", &r.worker_id).await;

    // w1 caches 48 leading blocks.
    w1.lock().await.store(&p[..48 * BS as usize]).await;
    until(5, "w1's blocks indexed", || async { app.index_json()[MODEL]["device_blocks"] == 48 }).await;
    let r = c.pick(pick_req("r1", &p)).await.unwrap().into_inner();
    assert_eq!((r.worker_id.as_str(), r.endpoint.as_str(), r.matched_blocks), ("w1", "127.0.0.1:9001", 48));
    assert_eq!(r.reason, pb::PickReason::Kv as i32);
    assert_eq!(r.mode, "kv");
    assert_eq!(r.fallbacks.len(), 2);
    done(&mut c, "r1", "w1").await;

    // w2 caches all 64: it wins.
    w2.lock().await.store(&p).await;
    until(5, "w2's blocks indexed", || async { app.index_json()[MODEL]["device_blocks"] == 64 }).await;
    let r = c.pick(pick_req("r2", &p)).await.unwrap().into_inner();
    assert_eq!((r.worker_id.as_str(), r.matched_blocks), ("w2", 64));
    done(&mut c, "r2", "w2").await;

    // w2's engine drops everything: back to w1.
    w2.lock().await.clear().await;
    until(5, "w2 cleared", || async { app.workers_json(Some(MODEL))[MODEL][2]["device_blocks"] == 0 }).await;
    let r = c.pick(pick_req("r3", &p)).await.unwrap().into_inner();
    assert_eq!((r.worker_id.as_str(), r.matched_blocks), ("w1", 48));
    done(&mut c, "r3", "w1").await;

    // w1's heartbeats stop: it is removed and its blocks purged.
    hb_w1.abort();
    until(5, "w1 removed", || async { !worker_live(&app, "w1") && app.index_json()[MODEL]["device_blocks"] == 0 })
        .await;
    for i in 0..5 {
        let r = c.pick(pick_req(&format!("r4-{i}"), &p)).await.unwrap().into_inner();
        assert_ne!(r.worker_id, "w1");
        assert_eq!(r.matched_blocks, 0);
        done(&mut c, &format!("r4-{i}"), &r.worker_id).await;
    }
    let m = app.render_metrics();
    assert_eq!(metric(&m, "kvgate_model_events_total{model=\"m\",kind=\"worker_expired\"}"), 1.0);
    assert_eq!(metric(&m, "kvgate_pick_decisions_total{model=\"m\",mode=\"kv\",reason=\"kv\"}"), 3.0);
    assert!(metric(&m, "kvgate_pick_duration_seconds_count{model=\"m\"}") >= 9.0);
    hb_all.abort();
    handle.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_replica_converges_through_snapshots_then_follows_live_events() {
    let dir = kvgate_testkit::scratch_dir("cp-late").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let w0 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w0", "127.0.0.1:9000", 20).await));
    let w1 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w1", "127.0.0.1:9001", 21).await));
    let p = prompt(40 * BS as usize, 3);
    let q = prompt(40 * BS as usize, 4);
    // Published before any control plane runs: nobody receives these.
    w1.lock().await.store(&p[..32 * BS as usize]).await;
    w0.lock().await.store(&q[..8 * BS as usize]).await;
    let hb = heartbeats(vec![w0.clone(), w1.clone()]);

    let (bound, app, handle) = kvgate_server::spawn(config(nats.port, "kv", "cp-late")).await.unwrap();
    until(5, "snapshots applied", || async { worker_blocks(&app, "w1") == 32 && worker_blocks(&app, "w0") == 8 }).await;
    let mut c = client(bound.grpc).await;
    let r = c.pick(pick_req("a", &p)).await.unwrap().into_inner();
    assert_eq!((r.worker_id.as_str(), r.matched_blocks), ("w1", 32));
    done(&mut c, "a", "w1").await;

    // Live events continue the snapshot.
    w0.lock().await.store(&p).await;
    until(5, "live batch applied", || async { worker_blocks(&app, "w0") == 48 }).await;
    let r = c.pick(pick_req("b", &p)).await.unwrap().into_inner();
    assert_eq!((r.worker_id.as_str(), r.matched_blocks), ("w0", 40));
    let m = app.render_metrics();
    assert!(metric(&m, "kvgate_model_events_total{model=\"m\",kind=\"snapshot_applied\"}") >= 2.0);
    hb.abort();
    handle.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_mid_run_is_survived_and_the_lost_batches_are_recovered() {
    let dir = kvgate_testkit::scratch_dir("cp-nats-restart").unwrap();
    let mut nats = NatsServer::start(&dir).unwrap();
    let port = nats.port;
    let (bound, app, handle) = kvgate_server::spawn(config(port, "kv", "cp-r")).await.unwrap();
    let w0 = Arc::new(Mutex::new(TestRelay::start(port, "w0", "127.0.0.1:9000", 30).await));
    let w1 = Arc::new(Mutex::new(TestRelay::start(port, "w1", "127.0.0.1:9001", 31).await));
    let hb = heartbeats(vec![w0.clone(), w1.clone()]);
    let p = prompt(40 * BS as usize, 9);
    w1.lock().await.store(&p[..8 * BS as usize]).await;
    until(5, "first batch", || async { app.index_json()[MODEL]["device_blocks"] == 8 }).await;

    // NATS goes away; the engine keeps storing (the batch is lost).
    nats.proc.kill();
    w1.lock().await.online = false;
    w1.lock().await.store(&p[8 * BS as usize..24 * BS as usize]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    nats = NatsServer::start_on(&dir, port).unwrap();
    w1.lock().await.online = true;
    until(10, "control plane reconnected", || async { app.nats_connected() }).await;

    // The next heartbeat shows relay_seq ahead: a snapshot brings the lost
    // blocks back. (The relay's chain after the restart continues.)
    let mut c = client(bound.grpc).await;
    until(10, "lost batch recovered", || async { app.index_json()[MODEL]["device_blocks"] == 24 }).await;
    let r = c.pick(pick_req("x", &p)).await.unwrap().into_inner();
    assert_eq!(r.worker_id, "w1");
    // The first 8 blocks are one chain, the next 16 another (roots): the
    // leading match is the first chain.
    assert_eq!(r.matched_blocks, 8);
    let m = app.render_metrics();
    assert!(metric(&m, "kvgate_model_events_total{model=\"m\",kind=\"gap\"}") >= 1.0);
    hb.abort();
    drop(nats);
    handle.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_in_flight_load() {
    let dir = kvgate_testkit::scratch_dir("cp-replicas").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let (ba, app_a, ha) = kvgate_server::spawn(config(nats.port, "least_load", "cp-a")).await.unwrap();
    let (bb, app_b, hbh) = kvgate_server::spawn(config(nats.port, "least_load", "cp-b")).await.unwrap();
    let w0 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w0", "127.0.0.1:9000", 40).await));
    let w1 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w1", "127.0.0.1:9001", 41).await));
    let hb = heartbeats(vec![w0.clone(), w1.clone()]);
    until(5, "workers live on both", || async {
        ["w0", "w1"].iter().all(|w| worker_live(&app_a, w) && worker_live(&app_b, w))
    })
    .await;
    let inflight = |app: &App, w: &str| -> u64 {
        app.workers_json(Some(MODEL))[MODEL]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["id"] == w)
            .map(|x| x["inflight"].as_u64().unwrap())
            .unwrap()
    };
    let (mut ca, mut cb) = (client(ba.grpc).await, client(bb.grpc).await);
    for round in 0..4 {
        let ida = format!("a{round}");
        let ra = ca.pick(pick_req(&ida, &prompt(64, round))).await.unwrap().into_inner();
        until(5, "B sees A's request", || async { inflight(&app_b, &ra.worker_id) == 1 }).await;
        let idb = format!("b{round}");
        let rb = cb.pick(pick_req(&idb, &prompt(64, round))).await.unwrap().into_inner();
        assert_ne!(rb.worker_id, ra.worker_id, "round {round}: B must avoid the worker A just loaded");
        until(5, "A sees B's request", || async { inflight(&app_a, &rb.worker_id) == 1 }).await;
        done(&mut ca, &ida, &ra.worker_id).await;
        done(&mut cb, &idb, &rb.worker_id).await;
        until(5, "both see the ends", || async {
            ["w0", "w1"].iter().all(|w| inflight(&app_a, w) == 0 && inflight(&app_b, w) == 0)
        })
        .await;
    }
    hb.abort();
    ha.stop().await.unwrap();
    hbh.stop().await.unwrap();
}

/// Sends raw bytes as a gRPC request body.
#[derive(Debug, Clone, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        use bytes::BufMut as _;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf as _;
        let mut v = vec![0; src.remaining()];
        src.copy_to_slice(&mut v);
        Ok(Some(v))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_protobuf_on_nats_and_grpc_is_counted_and_rejected() {
    let dir = kvgate_testkit::scratch_dir("cp-malformed").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let (bound, app, handle) = kvgate_server::spawn(config(nats.port, "kv", "cp-m")).await.unwrap();
    let w0 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w0", "127.0.0.1:9000", 50).await));
    let hb = heartbeats(vec![w0.clone()]);
    until(5, "worker live", || async { worker_live(&app, "w0") }).await;

    let pubc = async_nats::connect(format!("127.0.0.1:{}", nats.port)).await.unwrap();
    let s = Subjects::default();
    for garbage in [&b"\xff\xff\xff"[..], b"\x0a\x05ab", b"not protobuf at all"] {
        pubc.publish(s.kv_events(MODEL, "w0"), garbage.to_vec().into()).await.unwrap();
        pubc.publish(s.heartbeat(MODEL, "w0"), garbage.to_vec().into()).await.unwrap();
        pubc.publish(s.inflight(MODEL), garbage.to_vec().into()).await.unwrap();
    }
    // Valid protobuf, wrong worker for the subject.
    let wrong = pb::KvEventBatch { worker_id: "w9".into(), model: MODEL.into(), ..Default::default() };
    pubc.publish(s.kv_events(MODEL, "w0"), wrong.encode_to_vec().into()).await.unwrap();
    pubc.flush().await.unwrap();
    until(5, "malformed counted", || async {
        let m = app.render_metrics();
        metric(&m, "kvgate_nats_malformed_total{kind=\"kv\"}") == 4.0
            && metric(&m, "kvgate_nats_malformed_total{kind=\"heartbeat\"}") == 3.0
            && metric(&m, "kvgate_nats_malformed_total{kind=\"inflight\"}") == 3.0
    })
    .await;

    // gRPC: undecodable bytes, then invalid requests, each a precise status.
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", bound.grpc)).unwrap().connect().await.unwrap();
    let mut raw = tonic::client::Grpc::new(channel);
    raw.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static("/kvgate.v1.Router/Pick");
    let err = raw.unary(tonic::Request::new(vec![0xff, 0xff, 0xff, 0x0f]), path, RawCodec).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Internal, "{err:?}");

    let mut c = client(bound.grpc).await;
    let mut req = pick_req("u", &prompt(32, 1));
    req.model = "nope".into();
    assert_eq!(c.pick(req).await.unwrap_err().code(), tonic::Code::NotFound);
    let mut req = pick_req("v", &[]);
    req.prompt = None;
    let e = c.pick(req).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("without a prompt"), "{}", e.message());
    let req = pb::PickRequest {
        model: MODEL.into(),
        api: pb::ApiKind::ChatCompletions as i32,
        segments: vec![pb::Segment::default(); 5000],
        ..Default::default()
    };
    let e = c.pick(req).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("5000 messages; the limit is 4096"), "{}", e.message());
    // A chat message that is not JSON: routed by load (fail-soft), counted.
    let req = pb::PickRequest {
        model: MODEL.into(),
        api: pb::ApiKind::ChatCompletions as i32,
        segments: vec![pb::Segment {
            chain_hash: 1,
            role: "user".into(),
            message_json: b"{not json".to_vec(),
            elided: false,
        }],
        ..Default::default()
    };
    let r = c.pick(req).await.unwrap().into_inner();
    assert_eq!(r.reason, pb::PickReason::Fallback as i32);

    // Still serving, everything counted.
    let r = c.pick(pick_req("ok", &prompt(32, 1))).await.unwrap().into_inner();
    assert_eq!(r.worker_id, "w0");
    let m = app.render_metrics();
    assert_eq!(metric(&m, "kvgate_grpc_responses_total{code=\"13\"}"), 1.0);
    assert_eq!(metric(&m, "kvgate_grpc_responses_total{code=\"5\"}"), 1.0);
    assert_eq!(metric(&m, "kvgate_grpc_responses_total{code=\"3\"}"), 2.0);
    assert_eq!(metric(&m, "kvgate_tokenize_errors_total"), 1.0);
    assert_eq!(metric(&m, "kvgate_pick_errors_total{cause=\"unknown_model\"}"), 1.0);
    hb.abort();
    handle.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_requests_match_blocks_stored_from_the_same_tokens_and_mode_switches_at_run_time() {
    let dir = kvgate_testkit::scratch_dir("cp-chat").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let (bound, app, handle) = kvgate_server::spawn(config(nats.port, "kv", "cp-c")).await.unwrap();
    let w0 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w0", "127.0.0.1:9000", 60).await));
    let w1 = Arc::new(Mutex::new(TestRelay::start(nats.port, "w1", "127.0.0.1:9001", 61).await));
    let hb = heartbeats(vec![w0.clone(), w1.clone()]);
    until(5, "workers live", || async { worker_live(&app, "w0") && worker_live(&app, "w1") }).await;

    let messages = [
        serde_json::json!({"role": "system", "content": "You are a meticulous assistant. ".repeat(40)}),
        serde_json::json!({"role": "user", "content": "Summarize the design in three bullet points."}),
    ];
    let bytes: Vec<Vec<u8>> = messages.iter().map(|m| serde_json::to_vec(m).unwrap()).collect();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let hashes = kvgate_server::tokens::chain_hashes(b"", &refs);
    let req = pb::PickRequest {
        request_id: "chat-1".into(),
        model: MODEL.into(),
        api: pb::ApiKind::ChatCompletions as i32,
        segments: bytes
            .iter()
            .zip(&hashes)
            .map(|(b, h)| pb::Segment { chain_hash: *h, role: "x".into(), message_json: b.clone(), elided: false })
            .collect(),
        ..Default::default()
    };
    // What vLLM would compute, via the same tokenizer files.
    let tk = kvgate_tokenize::ChatTokenizer::from_dir(&kvgate_testkit::repo_root().join(".tools/models/deepseek-v3"))
        .unwrap();
    let ids = tk.encode_chat(&messages, true).unwrap();
    let full = (ids.len() / BS as usize) as u32;
    w1.lock().await.store(&ids).await;
    until(5, "stored", || async { app.index_json()[MODEL]["device_blocks"] == u64::from(full) }).await;

    let mut c = client(bound.grpc).await;
    let r = c.pick(req.clone()).await.unwrap().into_inner();
    assert_eq!((r.worker_id.as_str(), r.matched_blocks, r.total_blocks), ("w1", full, full));
    done(&mut c, "chat-1", "w1").await;

    // Switch the model to round robin through the admin endpoint.
    let admin = bound.admin.unwrap();
    let resp = http(admin, "POST", "/admin/mode?model=m&mode=round_robin").await;
    assert_eq!(resp.status, 200, "{}", String::from_utf8_lossy(&resp.body));
    let bad = http(admin, "POST", "/admin/mode?model=m&mode=fastest").await;
    assert_eq!(bad.status, 400);
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..4 {
        let mut q = req.clone();
        q.request_id = format!("rr-{i}");
        let r = c.pick(q).await.unwrap().into_inner();
        assert_eq!(r.mode, "round_robin");
        assert_eq!(r.reason, pb::PickReason::RoundRobin as i32);
        seen.insert(r.worker_id);
    }
    assert_eq!(seen.len(), 2);
    let metrics = http(admin, "GET", "/metrics").await;
    let text = String::from_utf8(metrics.body).unwrap();
    assert_eq!(metric(&text, "kvgate_mode{model=\"m\",mode=\"round_robin\"}"), 1.0);
    assert!(metric(&text, "kvgate_tokenize_requests_total{model=\"m\",outcome=\"full_hit\"}") >= 4.0);
    hb.abort();
    handle.stop().await.unwrap();
}
