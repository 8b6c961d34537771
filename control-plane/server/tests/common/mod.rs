//! What the control plane's network tests share: a test relay (the real
//! relay core, fed vLLM frames, on a real NATS connection), configurations,
//! clients and waits.
#![allow(dead_code, unreachable_pub)]

use futures_util::StreamExt as _;
use kvgate_protocol::pb;
use kvgate_protocol::subject::Subjects;
use kvgate_relay::core::{Action, RelayConfig, RelayCore};
use kvgate_server::config::{RawConfig, RawModel};
use kvgate_server::router_client::RouterClient;
use kvgate_server::{App, Config};
use kvgate_vllm_wire::encode::{Encoding, encode_batch};
use kvgate_vllm_wire::{Batch, BlockStored, Event};
use prost::Message as _;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

pub const MODEL: &str = "m";
pub const BS: u32 = 16;

/// One worker's relay: the real relay core, driven with vLLM frames, on a
/// real NATS connection, answering snapshot requests.
pub struct TestRelay {
    pub id: String,
    pub endpoint: String,
    pub epoch: u64,
    pub core: Arc<Mutex<RelayCore>>,
    pub nats: async_nats::Client,
    pub seq: u64,
    pub next_hash: u64,
    /// Publish batches (false: lost, as during a NATS outage).
    pub online: bool,
    /// `max_num_seqs` its heartbeats announce.
    pub max_num_seqs: u32,
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl TestRelay {
    pub async fn start(nats_port: u16, id: &str, endpoint: &str, epoch: u64) -> Self {
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
            max_num_seqs: 64,
            tasks: vec![snap],
        }
    }

    pub async fn feed(&mut self, events: Vec<Event<'_>>) {
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
    pub async fn store(&mut self, tokens: &[u32]) -> Vec<u64> {
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

    /// Stops answering snapshot requests (as a relay that is down or
    /// predates snapshots): its subscription is gone from the NATS server
    /// when this returns (the unsubscription goes out before the flush's
    /// ping).
    pub async fn stop_answering_snapshots(&mut self) {
        if !self.tasks.is_empty() {
            let snap = self.tasks.remove(0);
            snap.abort();
            let _ = snap.await;
        }
        self.nats.flush().await.unwrap();
    }

    pub async fn clear(&mut self) {
        self.feed(vec![Event::Cleared]).await;
    }

    pub async fn heartbeat(&self) {
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
            max_num_seqs: self.max_num_seqs,
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

pub fn config(nats_port: u16, mode: &str, replica: &str) -> Config {
    Config::validate(raw_config(nats_port, mode, replica)).unwrap()
}

/// The configuration of [`config`], before validation.
pub fn raw_config(nats_port: u16, mode: &str, replica: &str) -> RawConfig {
    RawConfig {
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
    }
}

pub fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(salt) % 100_000).collect()
}

pub fn pick_req(id: &str, ids: &[u32]) -> pb::PickRequest {
    pb::PickRequest {
        request_id: id.into(),
        model: MODEL.into(),
        api: pb::ApiKind::Completions as i32,
        prompt: Some(pb::pick_request::Prompt::PromptTokenIds(pb::TokenIds { ids: ids.to_vec() })),
        max_tokens: Some(16),
        ..Default::default()
    }
}

pub async fn client(addr: std::net::SocketAddr) -> RouterClient<tonic::transport::Channel> {
    RouterClient::connect(format!("http://{addr}")).await.unwrap()
}

pub async fn done(c: &mut RouterClient<tonic::transport::Channel>, id: &str, worker: &str) {
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
pub async fn until<F, Fut>(secs: u64, what: &str, mut cond: F)
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
pub fn heartbeats(relays: Vec<Arc<Mutex<TestRelay>>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            for r in &relays {
                r.lock().await.heartbeat().await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

pub fn worker_blocks(app: &App, id: &str) -> u64 {
    app.workers_json(Some(MODEL))[MODEL]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == id)
        .map_or(0, |w| w["device_blocks"].as_u64().unwrap())
}

pub fn worker_live(app: &App, id: &str) -> bool {
    app.workers_json(Some(MODEL))[MODEL].as_array().unwrap().iter().any(|w| w["id"] == id && w["live"] == true)
}

pub async fn http(
    addr: std::net::SocketAddr,
    method: &'static str,
    path: &'static str,
) -> kvgate_testkit::HttpResponse {
    tokio::task::spawn_blocking(move || kvgate_testkit::http_request(addr, method, path, &[], b"").unwrap())
        .await
        .unwrap()
}

pub fn metric(text: &str, series_prefix: &str) -> f64 {
    kvgate_testkit::prom::value(text, series_prefix).unwrap_or_else(|| panic!("no metric {series_prefix} in\n{text}"))
}
