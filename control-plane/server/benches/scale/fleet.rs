//! A synthetic fleet on NATS: one fake relay per worker, publishing what a
//! relay publishes (heartbeats every second, `KvEventBatch`es in sequence)
//! for `workers` workers that each hold `blocks` blocks: the conversations
//! and documents the requests will ask about, and private chains of random
//! tokens; then churn (one chain removed and one stored, per worker, at a
//! set rate of block operations). The same messages can go to a control
//! plane in this process instead (`Sink::Local`), for the in-process rows.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvgate_protocol::pb;
use kvgate_protocol::subject::Subjects;
use prost::Message as _;

use crate::MODEL;

/// Tokens per block.
pub(crate) const BS: usize = 16;
/// Blocks of one private chain (and of the batches that store a document).
const CHAIN: usize = 64;

fn unix_nanos() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// One fake relay's state.
struct Relay {
    id: String,
    endpoint: String,
    epoch: u64,
    /// Private chains, oldest first: (first engine hash, blocks).
    chains: VecDeque<(u64, usize)>,
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
    relays: Vec<Relay>,
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
                chains: VecDeque::new(),
            })
            .collect();
        let seq = Arc::new((0..workers).map(|_| AtomicU64::new(0)).collect());
        let subjects = Subjects::new(kvgate_protocol::subject::DEFAULT_PREFIX).expect("default prefix");
        Self {
            sink,
            subjects,
            relays,
            seq,
            next_hash: 1,
            rng: fastrand::Rng::with_seed(11),
            published: 0,
            block_ops: 0,
        }
    }

    /// The heartbeat sender of every worker.
    pub(crate) fn beats(&self, capacity_blocks: u64) -> Beats {
        Beats {
            sink: self.sink.clone(),
            subjects: self.subjects.clone(),
            seq: self.seq.clone(),
            workers: self.relays.iter().map(|r| (r.id.clone(), r.endpoint.clone(), r.epoch)).collect(),
            capacity_blocks,
        }
    }

    /// Publishes one batch of worker `w`, next in its sequence.
    async fn publish(&mut self, w: usize, events: Vec<pb::KvEvent>, ops: u64) {
        let r = &self.relays[w];
        let seq = self.seq[w].load(Ordering::Relaxed) + 1;
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
        let subject = self.subjects.kv_events(MODEL, &r.id);
        if self.sink.send(subject, b.encode_to_vec()).await {
            self.seq[w].store(seq, Ordering::Release);
            self.published += 1;
            self.block_ops += ops;
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
            parent = Some(first + n as u64 - 1);
            self.publish(w, vec![ev], n as u64).await;
        }
        blocks
    }

    fn random_tokens(&mut self, blocks: usize) -> Vec<u32> {
        (0..blocks * BS).map(|_| self.rng.u32(..120_000)).collect()
    }

    /// Worker `w` caches private chains of random tokens, `blocks` in all.
    pub(crate) async fn fill_private(&mut self, w: usize, mut blocks: usize) {
        while blocks > 0 {
            let n = blocks.min(CHAIN);
            blocks -= n;
            let tokens = self.random_tokens(n);
            let (ev, first) = self.stored(&tokens, None);
            self.relays[w].chains.push_back((first, n));
            self.publish(w, vec![ev], n as u64).await;
        }
    }

    /// One churn step on a random worker: its oldest private chain removed
    /// and a new chain of the same length stored, in one batch (the index's
    /// size stays put). Returns the block operations published.
    pub(crate) async fn churn_one(&mut self) -> u64 {
        let w = self.rng.usize(..self.relays.len());
        let mut events = Vec::with_capacity(2);
        // A worker without private chains (its documents fill it) grows one.
        let (mut ops, n) = (0, self.relays[w].chains.front().map_or(CHAIN, |c| c.1));
        if let Some((first, n)) = self.relays[w].chains.pop_front() {
            events.push(pb::KvEvent {
                event: Some(pb::kv_event::Event::Removed(pb::BlockRemoved {
                    engine_hashes: (first..first + n as u64).collect(),
                    medium: pb::StorageMedium::Gpu as i32,
                    ..Default::default()
                })),
            });
            ops += n as u64;
        }
        let tokens = self.random_tokens(n);
        let (stored, new_first) = self.stored(&tokens, None);
        self.relays[w].chains.push_back((new_first, n));
        events.push(stored);
        ops += n as u64;
        self.publish(w, events, ops).await;
        ops
    }

    /// Workers.
    pub(crate) fn workers(&self) -> usize {
        self.relays.len()
    }
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
