//! A synthetic fleet on NATS: one fake relay per worker, publishing what a
//! relay publishes (heartbeats every second, `KvEventBatch`es in sequence)
//! for `workers` workers that each hold `blocks` blocks: the conversations
//! and documents the requests will ask about, and private chains of random
//! tokens; then churn (one chain removed and one stored, per worker, at a
//! set rate of block operations). The same messages can go to a control
//! plane in this process instead (`Sink::Local`), for the in-process rows.
//!
//! Over NATS each fake relay also answers snapshot requests with what its
//! worker holds as of its last batch ([`Fleet::serve_snapshots`]), and the
//! churn can skip a worker's next `relay_seq` ([`Fleet::make_gap`]): the
//! control plane then asks for a snapshot, as it does of a real relay after
//! a lost batch.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvgate_protocol::pb;
use kvgate_protocol::subject::{SubjectKind, Subjects};
use prost::Message as _;

use crate::MODEL;

/// Tokens per block.
pub(crate) const BS: usize = 16;
/// Blocks of one private chain (and of the batches that store a document).
const CHAIN: usize = 64;

fn unix_nanos() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Where a held chain's tokens come from (for snapshots).
#[derive(Clone)]
enum Tokens {
    /// `n` blocks of random tokens from this seed.
    Seeded(u64),
    /// Given (a conversation's or document's blocks).
    Given(Arc<[u32]>),
}

/// A chain of blocks a fake relay holds: engine hashes `first..first + n`.
#[derive(Clone)]
struct Chain {
    first: u64,
    n: usize,
    parent: Option<u64>,
    tokens: Tokens,
}

impl Chain {
    fn token_ids(&self) -> Vec<u32> {
        match &self.tokens {
            Tokens::Seeded(seed) => random_tokens(*seed, self.n),
            Tokens::Given(t) => t.to_vec(),
        }
    }
}

fn random_tokens(seed: u64, blocks: usize) -> Vec<u32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..blocks * BS).map(|_| rng.u32(..120_000)).collect()
}

/// One fake relay's state.
struct Relay {
    id: String,
    endpoint: String,
    epoch: u64,
    /// The conversations and documents it holds (never churned).
    given: Vec<Chain>,
    /// Private chains, oldest first.
    chains: VecDeque<Chain>,
    /// Its next batch skips a `relay_seq`.
    gap: bool,
}

/// Where the fleet's messages go.
#[derive(Clone)]
pub(crate) enum Sink {
    /// NATS, to a control plane process.
    Nats(async_nats::Client),
    /// Straight into a control plane in this process.
    Local(Arc<kvgate_server::App>),
}

impl Sink {
    async fn send(&self, subject: String, payload: Vec<u8>) -> bool {
        match self {
            Self::Nats(c) => c.publish(subject, payload.into()).await.is_ok(),
            Self::Local(app) => {
                app.on_nats(&subject, &payload);
                true
            }
        }
    }
}

/// The fleet: workers' ids, their sequence numbers, the next engine hash.
/// Deterministic: two fleets of the same size publish the same messages.
pub(crate) struct Fleet {
    sink: Sink,
    subjects: Subjects,
    /// Shared with the snapshot server: a batch's change to its relay and
    /// its `relay_seq` are made under one hold, so that a snapshot is
    /// exactly the state as of a batch.
    relays: Arc<Mutex<Vec<Relay>>>,
    workers: usize,
    seq: Arc<Vec<AtomicU64>>,
    next_hash: u64,
    rng: fastrand::Rng,
    /// Messages published on `kv` subjects.
    pub(crate) published: u64,
    /// Block operations published (stored + removed blocks).
    pub(crate) block_ops: u64,
}

impl Fleet {
    /// `workers` fake relays on `nats`.
    pub(crate) fn new(sink: Sink, workers: usize) -> Self {
        let relays = (0..workers)
            .map(|w| Relay {
                id: format!("w{w}"),
                endpoint: format!("10.{}.{}.{}:8000", w / 62_500, (w / 250) % 250, w % 250 + 1),
                epoch: 0x5ca1e ^ ((w as u64) << 20),
                given: Vec::new(),
                chains: VecDeque::new(),
                gap: false,
            })
            .collect();
        let seq = Arc::new((0..workers).map(|_| AtomicU64::new(0)).collect());
        let subjects = Subjects::new(kvgate_protocol::subject::DEFAULT_PREFIX).expect("default prefix");
        Self {
            sink,
            subjects,
            relays: Arc::new(Mutex::new(relays)),
            workers,
            seq,
            next_hash: 1,
            rng: fastrand::Rng::with_seed(11),
            published: 0,
            block_ops: 0,
        }
    }

    /// The heartbeat sender of every worker.
    pub(crate) fn beats(&self, capacity_blocks: u64) -> Beats {
        let relays = self.relays.lock().expect("relays");
        Beats {
            sink: self.sink.clone(),
            subjects: self.subjects.clone(),
            seq: self.seq.clone(),
            workers: relays.iter().map(|r| (r.id.clone(), r.endpoint.clone(), r.epoch)).collect(),
            capacity_blocks,
        }
    }

    /// Worker `w`'s next batch: `change` applied to its relay and the
    /// events it returns numbered next in its sequence (one more skipped
    /// after [`Fleet::make_gap`]), under one hold of the relays; then sent.
    async fn publish(&mut self, w: usize, ops: u64, change: impl FnOnce(&mut Relay) -> Vec<pb::KvEvent>) {
        let (subject, batch) = {
            let mut relays = self.relays.lock().expect("relays");
            let r = &mut relays[w];
            let events = change(r);
            let seq = self.seq[w].load(Ordering::Relaxed) + 1 + u64::from(std::mem::take(&mut r.gap));
            self.seq[w].store(seq, Ordering::Release);
            let b = pb::KvEventBatch {
                worker_id: r.id.clone(),
                model: MODEL.into(),
                relay_epoch: r.epoch,
                relay_seq: seq,
                engine_seq: seq,
                engine_ts_unix_nanos: unix_nanos(),
                events,
                ..Default::default()
            };
            (self.subjects.kv_events(MODEL, &r.id), b.encode_to_vec())
        };
        if self.sink.send(subject, batch).await {
            self.published += 1;
            self.block_ops += ops;
        }
    }

    /// Worker `w`'s next batch skips a `relay_seq` (over NATS only: a
    /// control plane in this process has no one to ask for a snapshot).
    pub(crate) fn make_gap(&mut self, w: usize) {
        if matches!(self.sink, Sink::Nats(_)) {
            self.relays.lock().expect("relays")[w].gap = true;
        }
    }

    fn stored(&mut self, tokens: &[u32], parent: Option<u64>) -> (pb::KvEvent, u64) {
        let n = tokens.len() / BS;
        let first = self.next_hash;
        self.next_hash += n as u64;
        let ev = pb::KvEvent {
            event: Some(pb::kv_event::Event::Stored(pb::BlockStored {
                engine_hashes: (first..first + n as u64).collect(),
                parent_engine_hash: parent,
                token_ids: tokens[..n * BS].to_vec(),
                block_size: BS as u32,
                medium: pb::StorageMedium::Gpu as i32,
                ..Default::default()
            })),
        };
        (ev, first)
    }

    /// Worker `w` caches `tokens` (its full blocks), as chains of at most
    /// 512 blocks per batch linked by parent. Returns the blocks stored.
    pub(crate) async fn hold(&mut self, w: usize, tokens: &[u32]) -> usize {
        let mut parent = None;
        let blocks = tokens.len() / BS;
        for piece in tokens[..blocks * BS].chunks(CHAIN * BS) {
            let (ev, first) = self.stored(piece, parent);
            let n = piece.len() / BS;
            let chain = Chain { first, n, parent, tokens: Tokens::Given(piece.into()) };
            parent = Some(first + n as u64 - 1);
            self.publish(w, n as u64, |r| {
                r.given.push(chain);
                vec![ev]
            })
            .await;
        }
        blocks
    }

    /// Worker `w` caches private chains of random tokens, `blocks` in all.
    pub(crate) async fn fill_private(&mut self, w: usize, mut blocks: usize) {
        while blocks > 0 {
            let n = blocks.min(CHAIN);
            blocks -= n;
            let seed = self.rng.u64(..);
            let (ev, first) = self.stored(&random_tokens(seed, n), None);
            let chain = Chain { first, n, parent: None, tokens: Tokens::Seeded(seed) };
            self.publish(w, n as u64, |r| {
                r.chains.push_back(chain);
                vec![ev]
            })
            .await;
        }
    }

    /// One churn step on a random worker: its oldest private chain removed
    /// and a new chain of the same length stored, in one batch (the index's
    /// size stays put). Returns the block operations published.
    pub(crate) async fn churn_one(&mut self) -> u64 {
        let w = self.rng.usize(..self.workers);
        // A worker without private chains (its documents fill it) grows one.
        let oldest = self.relays.lock().expect("relays")[w].chains.front().map(|c| (c.first, c.n));
        let n = oldest.map_or(CHAIN, |c| c.1);
        let seed = self.rng.u64(..);
        let (stored, first) = self.stored(&random_tokens(seed, n), None);
        let chain = Chain { first, n, parent: None, tokens: Tokens::Seeded(seed) };
        let ops = n as u64 + oldest.map_or(0, |c| c.1 as u64);
        self.publish(w, ops, |r| {
            let mut events = Vec::with_capacity(2);
            if let Some(old) = r.chains.pop_front() {
                events.push(pb::KvEvent {
                    event: Some(pb::kv_event::Event::Removed(pb::BlockRemoved {
                        engine_hashes: (old.first..old.first + old.n as u64).collect(),
                        medium: pb::StorageMedium::Gpu as i32,
                        ..Default::default()
                    })),
                });
            }
            r.chains.push_back(chain);
            events.push(stored);
            events
        })
        .await;
        ops
    }

    /// Workers.
    pub(crate) fn workers(&self) -> usize {
        self.workers
    }

    /// Answers snapshot requests for every worker on `on` (over NATS; none
    /// for a control plane in this process), until the task is aborted:
    /// what the worker holds as of its last batch, in chunks of 4,096
    /// blocks. Counts the snapshots served.
    pub(crate) fn serve_snapshots(
        &self,
        on: &tokio::runtime::Handle,
        served: Arc<AtomicU64>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let Sink::Nats(client) = self.sink.clone() else { return None };
        let (subjects, relays, seq) = (self.subjects.clone(), self.relays.clone(), self.seq.clone());
        Some(on.spawn(async move {
            use futures_util::StreamExt as _;
            let Ok(mut requests) = client.subscribe(subjects.model(SubjectKind::Snapshot, MODEL)).await else { return };
            while let Some(req) = requests.next().await {
                let Some(reply) = req.reply else { continue };
                let Some(w) = subjects
                    .parse(&req.subject)
                    .ok()
                    .and_then(|p| p.worker)
                    .and_then(|id| id.strip_prefix('w')?.parse::<usize>().ok())
                else {
                    continue;
                };
                // What it holds, taken under the lock; its blocks made apart
                // (a real relay is another machine: the churn goes on).
                let held = {
                    let relays = relays.lock().expect("relays");
                    let Some(r) = relays.get(w) else { continue };
                    let chains: Vec<Chain> = r.given.iter().chain(&r.chains).cloned().collect();
                    (r.id.clone(), r.epoch, seq[w].load(Ordering::Acquire), chains)
                };
                let Ok(chunks) = tokio::task::spawn_blocking(move || snapshot(held)).await else { continue };
                for c in chunks {
                    let _ = client.publish(reply.clone(), c.encode_to_vec().into()).await;
                }
                served.fetch_add(1, Ordering::Relaxed);
            }
        }))
    }
}

/// A relay's snapshot: (worker id, relay epoch, relay_seq, chains held).
fn snapshot((id, epoch, relay_seq, chains): (String, u64, u64, Vec<Chain>)) -> Vec<pb::SnapshotChunk> {
    let mut blocks = Vec::new();
    for c in &chains {
        let tokens = c.token_ids();
        for (i, t) in tokens.chunks_exact(BS).enumerate() {
            let h = c.first + i as u64;
            let parent_engine_hash = if i == 0 { c.parent } else { Some(h - 1) };
            blocks.push(pb::SnapshotBlock {
                engine_hash: h,
                parent_engine_hash,
                token_ids: t.to_vec(),
                medium: pb::StorageMedium::Gpu as i32,
                ref_count: 1,
                ..Default::default()
            });
        }
    }
    let count = blocks.len().div_ceil(4096).max(1) as u32;
    let mut out: Vec<pb::SnapshotChunk> = blocks
        .chunks(4096)
        .enumerate()
        .map(|(i, b)| pb::SnapshotChunk { chunk_index: i as u32, blocks: b.to_vec(), ..Default::default() })
        .collect();
    if out.is_empty() {
        out.push(pb::SnapshotChunk::default());
    }
    for c in &mut out {
        (c.worker_id, c.model, c.relay_epoch, c.relay_seq) = (id.clone(), MODEL.into(), epoch, relay_seq);
        (c.block_size, c.chunk_count) = (BS as u32, count);
    }
    out
}

/// Heartbeats of every worker (one fake relay each), with the sequence
/// number each has reached.
#[derive(Clone)]
pub(crate) struct Beats {
    sink: Sink,
    subjects: Subjects,
    seq: Arc<Vec<AtomicU64>>,
    workers: Vec<(String, String, u64)>,
    capacity_blocks: u64,
}

impl Beats {
    /// One heartbeat of every worker.
    pub(crate) async fn send(&self) {
        for (w, (id, endpoint, epoch)) in self.workers.iter().enumerate() {
            let hb = pb::WorkerHeartbeat {
                worker_id: id.clone(),
                model: MODEL.into(),
                endpoint: endpoint.clone(),
                relay_epoch: *epoch,
                relay_seq: self.seq[w].load(Ordering::Acquire),
                block_size: BS as u32,
                capacity_blocks: self.capacity_blocks,
                max_num_seqs: 256,
                ts_unix_nanos: unix_nanos(),
                interval_ms: 1000,
                engine_ok: true,
                engine_health: pb::EngineHealth::Healthy as i32,
                ..Default::default()
            };
            self.sink.send(self.subjects.heartbeat(MODEL, id), hb.encode_to_vec()).await;
        }
    }

    /// Every second on `on`, until the task is aborted.
    pub(crate) fn spawn(self, on: &tokio::runtime::Handle) -> tokio::task::JoinHandle<()> {
        on.spawn(async move {
            let mut t = tokio::time::interval(Duration::from_secs(1));
            loop {
                t.tick().await;
                self.send().await;
            }
        })
    }
}
