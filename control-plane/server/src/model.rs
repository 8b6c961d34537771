//! One model's routing state: its index, worker registry, load tracker and
//! policy, and the per-worker event-stream synchronization. Synchronous (no
//! tokio, no NATS): the service layer feeds it decoded messages and acts on
//! the [`Need`]s it returns.
//!
//! # Worker stream synchronization
//!
//! ```text
//! Unknown ──first batch with relay_seq 1, or heartbeat with relay_seq 0──▶ Synced(epoch, seq)
//! Unknown ──any other batch / heartbeat──▶ Snapshotting (batches buffered) ──snapshot──▶ Synced
//! Synced  ──batch seq+1──▶ apply          ──batch ≤ seq──▶ duplicate, skipped
//! Synced  ──gap, new relay epoch, heartbeat ahead of seq, unknown parent──▶ Snapshotting
//! Snapshotting ──failed / timed out──▶ Unknown (retried on the next message)
//! ```
//!
//! A snapshot replaces the worker's blocks, then the buffered batches newer
//! than the snapshot's `relay_seq` are applied in order.
//!
//! # Complexity
//!
//! | operation | cost |
//! |---|---|
//! | [`ModelState::pick`] | O(prompt blocks) hashing + index lookup + O(W log W) policy |
//! | [`ModelState::on_batch`] | O(blocks in the batch) |
//! | [`ModelState::on_snapshot`] | O(blocks in the snapshot) |
//! | [`ModelState::reap`] | O(workers) |

use std::collections::HashMap;

use kvgate_index::{Index, IndexConfig, KvEvent, Origin, Overlap, Stored, Tier, WorkerIdx};
use kvgate_protocol::pb;
use kvgate_protocol::{BlockSeed, BlockSize, SequenceHash, sequence_hashes};
use kvgate_scheduler::{Candidate, KvConfig, KvPolicy, LoadTracker, Measured, Mode, Policy, Reason, RequestView};

/// Settings of one model, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `model` as clients send it.
    pub name: String,
    /// Tokens per KV block.
    pub block_size: BlockSize,
    /// Routing mode at start.
    pub mode: Mode,
    /// Weights of the `kv` mode.
    pub kv: KvConfig,
    /// Output tokens assumed when a request has no `max_tokens`.
    pub default_output_tokens: u32,
    /// Workers routed to without relays (id, `ip:port`): never expire.
    pub static_workers: Vec<(String, String)>,
    /// A worker is dropped after this long without a heartbeat; 0 = three
    /// of its announced heartbeat intervals (at least 1 s).
    pub heartbeat_timeout_ms: u64,
    /// Requests whose end was never reported are forgotten after this long.
    pub inflight_ttl_ms: u64,
    /// Connection failures (reported by the filter) within `suspect_ms`
    /// that make a worker a suspect; 0 = off.
    pub suspect_after_failures: u32,
    /// How long a suspect worker gets no Pick.
    pub suspect_ms: u64,
    /// Endpoints relays may claim; empty = any (see [`crate::endpoints`]).
    pub allowed_endpoints: Vec<crate::endpoints::EndpointRule>,
}

/// Something the service layer must do for this model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Need {
    /// Ask this worker's relay for a snapshot.
    Snapshot(String),
}

#[derive(Debug)]
enum SyncState {
    Unknown,
    Snapshotting { buffer: Vec<pb::KvEventBatch>, started_ms: u64 },
    Synced { epoch: u64, seq: u64 },
    Static,
}

/// Registry entry of one worker.
#[derive(Debug)]
struct Worker {
    idx: WorkerIdx,
    endpoint: Option<String>,
    last_seen_ms: u64,
    last_heartbeat_ms: Option<u64>,
    interval_ms: u32,
    engine_ok: bool,
    health: pb::EngineHealth,
    block_size: u32,
    sync: SyncState,
    /// Times of the recent connection failures reported by the filter.
    failures: Vec<u64>,
    /// No Pick before this time (a suspect).
    suspect_until_ms: u64,
}

impl Worker {
    fn new(idx: WorkerIdx, endpoint: Option<String>, sync: SyncState, engine_ok: bool, block_size: u32) -> Self {
        Self {
            idx,
            endpoint,
            last_seen_ms: 0,
            last_heartbeat_ms: None,
            interval_ms: 0,
            engine_ok,
            health: pb::EngineHealth::Unspecified,
            block_size,
            sync,
            failures: Vec::new(),
            suspect_until_ms: 0,
        }
    }
}

/// Counters of one model, beyond the index's own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelCounters {
    /// Batches applied.
    pub batches_applied: u64,
    /// Batches already applied (same or older `relay_seq`).
    pub batches_duplicate: u64,
    /// Batches held while a snapshot was under way.
    pub batches_buffered: u64,
    /// Batches dropped because a buffer overflowed (a snapshot is redone).
    pub batches_dropped: u64,
    /// Events that carried no event (protobuf `oneof` empty).
    pub events_empty: u64,
    /// Gaps in a worker's `relay_seq` that needed a snapshot.
    pub gaps: u64,
    /// Relay epochs that changed (relay restarts).
    pub epoch_changes: u64,
    /// Snapshots applied / failed.
    pub snapshots_applied: u64,
    /// Snapshots that failed or timed out.
    pub snapshots_failed: u64,
    /// Heartbeats accepted.
    pub heartbeats: u64,
    /// Heartbeats whose load was out of range (NaN usage...).
    pub heartbeats_invalid: u64,
    /// Heartbeats announcing another block size than the model's.
    pub heartbeats_block_size_mismatch: u64,
    /// Workers removed because their heartbeats stopped.
    pub workers_expired: u64,
    /// In-flight events from other replicas applied / ignored.
    pub replica_events: u64,
    /// Replica events that did not fit the lifecycle (duplicate, unknown).
    pub replica_events_ignored: u64,
    /// Requests forgotten because their end was never reported.
    pub inflight_expired: u64,
    /// Completion reports accepted.
    pub reports: u64,
    /// Reports for requests this replica does not know (other replica, expired).
    pub reports_unknown: u64,
    /// Sum of predicted cached tokens over reports that had `cached_tokens`.
    pub predicted_cached_tokens: u64,
    /// Sum of reported `cached_tokens`.
    pub reported_cached_tokens: u64,
    /// Reports with `cached_tokens` within one block of the prediction.
    pub reports_accurate: u64,
    /// Reports with `cached_tokens`.
    pub reports_with_cached: u64,
    /// Reports saying the chosen worker could not be reached.
    pub connection_failures: u64,
    /// Times a worker became a suspect of failed connections.
    pub suspects: u64,
    /// Changes of a worker's engine health seen in heartbeats.
    pub health_changes: u64,
    /// Heartbeats and batches refused: the claimed endpoint is not in
    /// `allowed_endpoints`, or the worker never announced an allowed one.
    pub refused_endpoints: u64,
}

/// The request as the model state needs it.
#[derive(Debug, Clone, Copy)]
pub struct PickInput<'a> {
    /// Correlation id (non-empty).
    pub request_id: &'a str,
    /// Prompt token ids.
    pub token_ids: &'a [u32],
    /// LoRA + cache salt.
    pub seed: BlockSeed,
    /// Chained segment hashes (already seeded), for `approx`.
    pub text_prefix: &'a [u64],
    /// `max_tokens`, when given.
    pub max_tokens: Option<u32>,
    /// Routed by load, not by the prompt, and why; `None` scores the prompt
    /// with the model's mode.
    pub by_load: Option<ByLoad>,
    /// The endpoints the data plane allows (an endpoint picker's subset
    /// hint); `None` = every live worker. Workers outside it are excluded
    /// from the pick, so the ranking is made among the allowed ones.
    pub allowed: Option<&'a [String]>,
}

/// Why a request is routed by load instead of by its prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByLoad {
    /// The prompt could not be tokenized: the mode's pick falls back to the
    /// least loaded worker (reason `fallback`, labelled with the mode).
    TokenizeFailed,
    /// There is no prompt to score (an endpoint picker saw no body, or one
    /// kvgate does not route by prefix): labelled mode `by_load`, reason
    /// `load`.
    NoPrompt,
}

/// A decision, in wire terms.
#[derive(Debug, Clone, PartialEq)]
pub struct PickOutput {
    /// `ip:port` of the chosen worker.
    pub endpoint: String,
    /// Runners-up' endpoints.
    pub fallbacks: Vec<String>,
    /// Chosen worker id.
    pub worker_id: String,
    /// Leading prompt blocks it holds.
    pub matched_blocks: u32,
    /// Full prompt blocks.
    pub total_blocks: u32,
    /// Why (wire enum).
    pub reason: pb::PickReason,
    /// The largest overlap of any candidate when it is larger than the
    /// chosen one's: (blocks, worker id); (0, "") otherwise.
    pub passed_over: (u32, String),
    /// Mode name.
    pub mode: &'static str,
    /// For replica sync.
    pub inflight: pb::InflightEvent,
}

/// Why a pick failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PickError {
    /// No live worker with an endpoint.
    #[error("no live worker for this model")]
    NoWorkers,
    /// Live workers, but none of them in the allowed endpoints.
    #[error("no live worker among the allowed endpoints")]
    NoneAllowed,
}

/// Mode label of the decisions routed by load for want of a prompt
/// ([`ByLoad::NoPrompt`]).
pub const BY_LOAD: &str = "by_load";

/// One worker as the admin endpoint shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WorkerView {
    /// Worker id.
    pub id: String,
    /// `ip:port`.
    pub endpoint: Option<String>,
    /// Routable now.
    pub live: bool,
    /// Sync state.
    pub sync: String,
    /// Device blocks indexed.
    pub device_blocks: usize,
    /// Host-tier blocks indexed.
    pub host_blocks: usize,
    /// Requests in flight (all replicas).
    pub inflight: u32,
    /// Last measured running / waiting.
    pub running: Option<u32>,
    /// Last measured waiting.
    pub waiting: Option<u32>,
    /// Milliseconds since the last heartbeat.
    pub heartbeat_age_ms: Option<u64>,
    /// Whether the relay could read the engine's metrics.
    pub engine_ok: bool,
    /// The engine's health as its relay probes it.
    pub engine_health: &'static str,
    /// Out of routing for failed connections (milliseconds left).
    pub suspect_ms_left: u64,
    /// Block size the worker announced.
    pub block_size: u32,
}

/// One model's routing state.
pub struct ModelState {
    config: ModelConfig,
    index: Index,
    tracker: LoadTracker,
    policy: Box<dyn Policy>,
    mode: Mode,
    workers: HashMap<String, Worker>,
    names: HashMap<WorkerIdx, String>,
    predicted: HashMap<String, (u32, u64)>,
    rng: fastrand::Rng,
    counters: ModelCounters,
    decisions: HashMap<(&'static str, &'static str), u64>,
    scratch: Vec<Overlap>,
    /// Liveness is judged as of this time while NATS is down.
    frozen_at: Option<u64>,
}

impl std::fmt::Debug for ModelState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelState").field("model", &self.config.name).field("mode", &self.mode).finish()
    }
}

/// Largest number of batches held per worker during a snapshot.
const MAX_BUFFERED: usize = 16_384;

fn policy_for(mode: Mode, kv: KvConfig) -> Box<dyn Policy> {
    match mode {
        Mode::Kv => Box::new(KvPolicy::new(kv)),
        m => m.policy(),
    }
}

/// Wire name of a reason.
pub fn reason_pb(r: Reason) -> pb::PickReason {
    match r {
        Reason::Kv => pb::PickReason::Kv,
        Reason::Load => pb::PickReason::Load,
        Reason::Approximate => pb::PickReason::Approximate,
        Reason::RoundRobin => pb::PickReason::RoundRobin,
        Reason::Random => pb::PickReason::Random,
    }
}

/// Metric label of a wire reason.
pub fn reason_label(r: pb::PickReason) -> &'static str {
    match r {
        pb::PickReason::Kv => "kv",
        pb::PickReason::Load => "load",
        pb::PickReason::Approximate => "approximate",
        pb::PickReason::RoundRobin => "round_robin",
        pb::PickReason::Random => "random",
        pb::PickReason::Fallback => "fallback",
        pb::PickReason::Unspecified => "unspecified",
    }
}

impl ModelState {
    /// A model with no workers but its static ones.
    pub fn new(config: ModelConfig, seed: u64) -> Self {
        let mut this = Self {
            index: Index::new(IndexConfig::new(config.block_size)),
            tracker: LoadTracker::new(),
            policy: policy_for(config.mode, config.kv),
            mode: config.mode,
            workers: HashMap::new(),
            names: HashMap::new(),
            predicted: HashMap::new(),
            rng: fastrand::Rng::with_seed(seed),
            counters: ModelCounters::default(),
            decisions: HashMap::new(),
            scratch: Vec::new(),
            frozen_at: None,
            config,
        };
        for (id, endpoint) in this.config.static_workers.clone() {
            let idx = this.index.add_worker(&id);
            this.names.insert(idx, id.clone());
            let w = Worker::new(idx, Some(endpoint), SyncState::Static, true, this.config.block_size.get());
            this.workers.insert(id, w);
        }
        this
    }

    /// Its configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The index (read-only).
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Counters.
    pub fn counters(&self) -> &ModelCounters {
        &self.counters
    }

    /// Decisions by (mode, reason).
    pub fn decisions(&self) -> &HashMap<(&'static str, &'static str), u64> {
        &self.decisions
    }

    /// Current mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Switches the routing mode (learned state of the old policy is dropped).
    pub fn set_mode(&mut self, mode: Mode) {
        if mode != self.mode {
            self.mode = mode;
            self.policy = policy_for(mode, self.config.kv);
        }
    }

    fn worker_entry(&mut self, id: &str, now_ms: u64) -> &mut Worker {
        let index = &mut self.index;
        let names = &mut self.names;
        let w = self.workers.entry(id.to_owned()).or_insert_with(|| {
            let idx = index.add_worker(id);
            names.insert(idx, id.to_owned());
            Worker { last_seen_ms: now_ms, ..Worker::new(idx, None, SyncState::Unknown, false, 0) }
        });
        w.last_seen_ms = now_ms;
        w
    }

    fn timeout_ms(&self, w: &Worker) -> u64 {
        if self.config.heartbeat_timeout_ms > 0 {
            self.config.heartbeat_timeout_ms
        } else {
            (3 * u64::from(w.interval_ms)).max(1000)
        }
    }

    /// Routable now: heard from recently, its engine not reported unhealthy,
    /// and not a suspect of failed connections.
    fn live(&self, w: &Worker, now_ms: u64) -> bool {
        if now_ms < w.suspect_until_ms {
            return false;
        }
        if matches!(w.sync, SyncState::Static) {
            return true;
        }
        let engine_up = matches!(w.health, pb::EngineHealth::Unspecified | pb::EngineHealth::Healthy);
        let judged_at = self.frozen_at.map_or(now_ms, |f| f.min(now_ms));
        engine_up
            && w.endpoint.is_some()
            && w.last_heartbeat_ms.is_some_and(|t| judged_at.saturating_sub(t) <= self.timeout_ms(w))
    }

    /// The filter could not reach `worker_id` (Envoy retried on a fallback,
    /// or no upstream answered): enough of those within `suspect_ms` make
    /// it a suspect, with no Pick for `suspect_ms`, before its relay's next
    /// heartbeat says anything.
    fn connection_failed(&mut self, worker_id: &str, now_ms: u64) {
        let (n, window) = (self.config.suspect_after_failures, self.config.suspect_ms);
        let Some(w) = self.workers.get_mut(worker_id) else { return };
        self.counters.connection_failures += 1;
        if n == 0 {
            return;
        }
        w.failures.retain(|t| now_ms.saturating_sub(*t) <= window);
        w.failures.push(now_ms);
        if w.failures.len() >= n as usize {
            if now_ms >= w.suspect_until_ms {
                self.counters.suspects += 1;
            }
            w.suspect_until_ms = now_ms + window;
            w.failures.clear();
        }
    }

    /// NATS went down at `now_ms`: liveness is judged as of then until
    /// [`ModelState::thaw`] (heartbeats cannot arrive; routing goes on on
    /// the last index).
    pub fn freeze(&mut self, now_ms: u64) {
        self.frozen_at.get_or_insert(now_ms);
    }

    /// NATS is back after `outage_ms`: the time without heartbeats does not
    /// count against any worker.
    pub fn thaw(&mut self, outage_ms: u64) {
        self.frozen_at = None;
        for w in self.workers.values_mut() {
            if let Some(t) = w.last_heartbeat_ms.as_mut() {
                *t = t.saturating_add(outage_ms);
            }
            w.last_seen_ms = w.last_seen_ms.saturating_add(outage_ms);
        }
    }

    fn apply_events(&mut self, idx: WorkerIdx, batch: &pb::KvEventBatch) {
        for ev in &batch.events {
            match KvEvent::from_pb(ev) {
                Some(e) => {
                    let _ = self.index.apply(idx, &e);
                }
                None => self.counters.events_empty += 1,
            }
        }
        self.counters.batches_applied += 1;
    }

    fn start_snapshot(&mut self, id: &str, now_ms: u64, first: Option<pb::KvEventBatch>) -> Option<Need> {
        let w = self.workers.get_mut(id)?;
        let mut buffer = Vec::new();
        if let Some(b) = first {
            buffer.push(b);
            self.counters.batches_buffered += 1;
        }
        w.sync = SyncState::Snapshotting { buffer, started_ms: now_ms };
        Some(Need::Snapshot(id.to_owned()))
    }

    /// A KV event batch from a worker's relay.
    pub fn on_batch(&mut self, batch: pb::KvEventBatch, now_ms: u64) -> Option<Need> {
        // With an endpoint list, only workers whose heartbeat was allowed
        // get an index entry (their first heartbeat asks for a snapshot).
        if !self.config.allowed_endpoints.is_empty() && !self.workers.contains_key(&batch.worker_id) {
            self.counters.refused_endpoints += 1;
            return None;
        }
        let id = batch.worker_id.clone();
        let w = self.worker_entry(&id, now_ms);
        let idx = w.idx;
        match &mut w.sync {
            SyncState::Static => {
                self.apply_events(idx, &batch);
                None
            }
            SyncState::Unknown if batch.relay_seq == 1 => {
                w.sync = SyncState::Synced { epoch: batch.relay_epoch, seq: 1 };
                self.apply_events(idx, &batch);
                self.resync_if_needed(&id, idx, now_ms)
            }
            SyncState::Unknown => self.start_snapshot(&id, now_ms, Some(batch)),
            SyncState::Snapshotting { buffer, .. } => {
                if buffer.len() < MAX_BUFFERED {
                    buffer.push(batch);
                    self.counters.batches_buffered += 1;
                    return None;
                }
                // Start over: the snapshot under way will be too old.
                w.sync = SyncState::Unknown;
                self.counters.batches_dropped += MAX_BUFFERED as u64;
                self.start_snapshot(&id, now_ms, Some(batch))
            }
            SyncState::Synced { epoch, seq } => {
                if batch.relay_epoch != *epoch {
                    self.counters.epoch_changes += 1;
                    return self.start_snapshot(&id, now_ms, Some(batch));
                }
                if batch.relay_seq <= *seq {
                    self.counters.batches_duplicate += 1;
                    return None;
                }
                if batch.relay_seq != *seq + 1 {
                    self.counters.gaps += 1;
                    return self.start_snapshot(&id, now_ms, Some(batch));
                }
                *seq = batch.relay_seq;
                self.apply_events(idx, &batch);
                self.resync_if_needed(&id, idx, now_ms)
            }
        }
    }

    fn resync_if_needed(&mut self, id: &str, idx: WorkerIdx, now_ms: u64) -> Option<Need> {
        if self.index.take_resync(idx) { self.start_snapshot(id, now_ms, None) } else { None }
    }

    /// A heartbeat from a worker's relay.
    pub fn on_heartbeat(&mut self, hb: &pb::WorkerHeartbeat, now_ms: u64) -> Option<Need> {
        if !crate::endpoints::allowed(&self.config.allowed_endpoints, &hb.endpoint) {
            self.counters.refused_endpoints += 1;
            return None;
        }
        let model_bs = self.config.block_size.get();
        if hb.block_size != 0 && hb.block_size != model_bs {
            self.counters.heartbeats_block_size_mismatch += 1;
        }
        let w = self.worker_entry(&hb.worker_id, now_ms);
        let idx = w.idx;
        w.last_heartbeat_ms = Some(now_ms);
        w.interval_ms = hb.interval_ms;
        w.engine_ok = hb.engine_ok;
        let health = pb::EngineHealth::try_from(hb.engine_health).unwrap_or(pb::EngineHealth::Unspecified);
        let health_changed = health != w.health;
        w.health = health;
        w.block_size = hb.block_size;
        if !hb.endpoint.is_empty() {
            w.endpoint = Some(hb.endpoint.clone());
        }
        let need = match &w.sync {
            SyncState::Unknown if hb.relay_seq == 0 => {
                w.sync = SyncState::Synced { epoch: hb.relay_epoch, seq: 0 };
                None
            }
            SyncState::Unknown => Some(()),
            SyncState::Synced { epoch, seq } if *epoch != hb.relay_epoch => {
                let _ = seq;
                self.counters.epoch_changes += 1;
                Some(())
            }
            SyncState::Synced { seq, .. } if hb.relay_seq > *seq => {
                self.counters.gaps += 1;
                Some(())
            }
            _ => None,
        };
        self.counters.heartbeats += 1;
        self.counters.health_changes += u64::from(health_changed);
        let m = Measured {
            running: hb.running,
            waiting: hb.waiting,
            kv_usage: hb.kv_usage,
            capacity_blocks: hb.capacity_blocks,
            max_num_seqs: hb.max_num_seqs,
        };
        if self.tracker.measured(idx, m) {
            if hb.capacity_blocks > 0 {
                self.index.set_capacity(idx, usize::try_from(hb.capacity_blocks).ok());
            }
        } else {
            self.counters.heartbeats_invalid += 1;
        }
        let id = hb.worker_id.clone();
        need.and_then(|()| self.start_snapshot(&id, now_ms, None))
    }

    /// Workers whose snapshot started before `now_ms - timeout_ms` (the
    /// service layer gave up on them).
    pub fn stale_snapshots(&self, now_ms: u64, timeout_ms: u64) -> Vec<String> {
        self.workers
            .iter()
            .filter(|(_, w)| {
                matches!(w.sync, SyncState::Snapshotting { started_ms, .. } if now_ms.saturating_sub(started_ms) > timeout_ms)
            })
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// A snapshot request failed or timed out: back to unknown, so that the
    /// next message retries.
    pub fn snapshot_failed(&mut self, id: &str) {
        if let Some(w) = self.workers.get_mut(id)
            && matches!(w.sync, SyncState::Snapshotting { .. })
        {
            w.sync = SyncState::Unknown;
            self.counters.snapshots_failed += 1;
        }
    }

    /// A complete snapshot (all chunks, in order) of a worker. Returns a new
    /// need when the buffered batches do not continue it.
    pub fn on_snapshot(&mut self, id: &str, chunks: &[pb::SnapshotChunk], now_ms: u64) -> Option<Need> {
        let Some(first) = chunks.first() else {
            self.snapshot_failed(id);
            return None;
        };
        let (epoch, seq) = (first.relay_epoch, first.relay_seq);
        if chunks.iter().any(|c| c.relay_epoch != epoch || c.relay_seq != seq) {
            self.snapshot_failed(id);
            return None;
        }
        let w = self.worker_entry(id, now_ms);
        let idx = w.idx;
        let buffer = match std::mem::replace(&mut w.sync, SyncState::Synced { epoch, seq }) {
            SyncState::Snapshotting { buffer, .. } => buffer,
            _ => Vec::new(),
        };
        let _ = self.index.apply(idx, &KvEvent::Cleared);
        for chunk in chunks {
            let bs = if chunk.block_size > 0 { chunk.block_size } else { self.config.block_size.get() };
            for b in &chunk.blocks {
                let hashes = [b.engine_hash];
                let stored = Stored {
                    engine_hashes: &hashes,
                    parent: b.parent_engine_hash,
                    token_ids: &b.token_ids,
                    block_size: bs,
                    seed: BlockSeed::from_fields(&b.lora_name, &b.cache_salt),
                    tier: Tier::from_medium(b.medium),
                    origin: Origin::New,
                };
                for _ in 0..b.ref_count.clamp(1, 16) {
                    let _ = self.index.apply(idx, &KvEvent::Stored(stored));
                }
            }
        }
        let _ = self.index.take_resync(idx);
        self.counters.snapshots_applied += 1;
        let mut cur = seq;
        for batch in buffer {
            if batch.relay_epoch != epoch {
                self.counters.epoch_changes += 1;
                return self.start_snapshot(id, now_ms, Some(batch));
            }
            if batch.relay_seq <= cur {
                self.counters.batches_duplicate += 1;
                continue;
            }
            if batch.relay_seq != cur + 1 {
                self.counters.gaps += 1;
                return self.start_snapshot(id, now_ms, Some(batch));
            }
            cur = batch.relay_seq;
            self.apply_events(idx, &batch);
        }
        if let Some(w) = self.workers.get_mut(id) {
            w.sync = SyncState::Synced { epoch, seq: cur };
        }
        self.resync_if_needed(id, idx, now_ms)
    }

    /// Removes workers whose heartbeats stopped (and those never heard from
    /// again after a first event). Returns their ids.
    pub fn reap(&mut self, now_ms: u64) -> Vec<String> {
        let dead: Vec<String> = self
            .workers
            .iter()
            .filter(|(_, w)| {
                !matches!(w.sync, SyncState::Static)
                    && now_ms.saturating_sub(w.last_heartbeat_ms.unwrap_or(w.last_seen_ms)) > self.timeout_ms(w)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for id in &dead {
            if let Some(w) = self.workers.remove(id) {
                self.index.remove_worker(w.idx);
                self.tracker.remove_worker(w.idx);
                self.policy.forget_worker(w.idx);
                self.names.remove(&w.idx);
                self.counters.workers_expired += 1;
            }
        }
        let expired = self.tracker.expire(now_ms, self.config.inflight_ttl_ms);
        self.counters.inflight_expired += expired as u64;
        let ttl = self.config.inflight_ttl_ms;
        self.predicted.retain(|_, (_, t)| now_ms.saturating_sub(*t) <= ttl);
        dead
    }

    /// Chooses a worker for a request and records it as in flight.
    pub fn pick(&mut self, input: &PickInput<'_>, now_ms: u64) -> Result<PickOutput, PickError> {
        let bs = self.config.block_size;
        let hashes: Vec<SequenceHash> =
            if input.by_load.is_some() { Vec::new() } else { sequence_hashes(input.token_ids, bs, input.seed) };
        let mut device: HashMap<WorkerIdx, u32> = HashMap::new();
        let mut any: HashMap<WorkerIdx, u32> = HashMap::new();
        if !hashes.is_empty() && self.mode == Mode::Kv {
            self.index.find_matches(&hashes, Tier::Device, &mut self.scratch);
            for o in &self.scratch {
                device.insert(o.worker, o.blocks);
            }
            self.index.find_matches(&hashes, Tier::Host, &mut self.scratch);
            for o in &self.scratch {
                any.insert(o.worker, o.blocks);
            }
        }
        let mut cands: Vec<Candidate> = Vec::with_capacity(self.workers.len());
        let mut order: Vec<&str> = Vec::with_capacity(self.workers.len());
        for (id, w) in &self.workers {
            if !self.live(w, now_ms) {
                continue;
            }
            let d = device.get(&w.idx).copied().unwrap_or(0);
            let h = any.get(&w.idx).copied().unwrap_or(0);
            let inflight = if self.mode == Mode::Kv { self.tracker.inflight_prefix(w.idx, &hashes) } else { 0 };
            let excluded = input.allowed.is_some_and(|a| !w.endpoint.as_ref().is_some_and(|e| a.contains(e)));
            cands.push(Candidate {
                worker: w.idx,
                overlap_blocks: d,
                overlap_any_tier_blocks: d.max(h),
                inflight_overlap_blocks: inflight,
                load: self.tracker.load(w.idx),
                excluded,
            });
            order.push(id.as_str());
        }
        // HashMap order is random per process: sort for reproducible ties.
        let mut perm: Vec<usize> = (0..cands.len()).collect();
        perm.sort_by(|a, b| order[*a].cmp(order[*b]));
        let cands: Vec<Candidate> = perm.iter().map(|i| cands[*i]).collect();
        let order: Vec<String> = perm.iter().map(|i| order[*i].to_owned()).collect();

        let expected_output_tokens = input.max_tokens.unwrap_or(self.config.default_output_tokens);
        let view = RequestView {
            prompt_blocks: hashes.len() as u32,
            expected_output_tokens,
            block_size: bs.get(),
            text_prefix: input.text_prefix,
        };
        let decision = if input.by_load.is_some() {
            kvgate_scheduler::LeastLoadPolicy.pick(&view, &cands, &mut self.rng)
        } else {
            self.policy.pick(&view, &cands, &mut self.rng)
        };
        let decision = decision.ok_or(if cands.is_empty() { PickError::NoWorkers } else { PickError::NoneAllowed })?;
        let chosen = cands[decision.chosen];
        let endpoint_of =
            |i: usize| -> String { self.workers.get(&order[i]).and_then(|w| w.endpoint.clone()).unwrap_or_default() };
        let endpoint = endpoint_of(decision.chosen);
        let fallbacks = decision.fallbacks.iter().map(|i| endpoint_of(*i)).collect();
        let worker_id = order[decision.chosen].clone();
        if !self.policy.name().is_empty() {
            self.policy.observe(&view, chosen.worker, now_ms);
        }
        let output_blocks = u64::from(expected_output_tokens.div_ceil(bs.get()));
        // Its new prefill excludes what requests in flight there compute.
        let shared = chosen.overlap_blocks.max(chosen.inflight_overlap_blocks);
        let _ = self.tracker.added(input.request_id, chosen.worker, &hashes, shared, output_blocks, now_ms);
        // Only `kv` looks the prompt up in the index: other modes make no
        // prediction for the accuracy metric to judge.
        if self.mode == Mode::Kv && input.by_load.is_none() {
            self.predicted.insert(input.request_id.to_owned(), (chosen.overlap_blocks * bs.get(), now_ms));
        }
        let (mode, reason) = match input.by_load {
            None => (self.mode.name(), reason_pb(decision.reason)),
            Some(ByLoad::TokenizeFailed) => (self.mode.name(), pb::PickReason::Fallback),
            Some(ByLoad::NoPrompt) => (BY_LOAD, pb::PickReason::Load),
        };
        let passed_over = match cands.iter().enumerate().max_by_key(|(i, c)| (c.overlap_blocks, std::cmp::Reverse(*i)))
        {
            Some((i, c)) if c.overlap_blocks > chosen.overlap_blocks => (c.overlap_blocks, order[i].clone()),
            _ => (0, String::new()),
        };
        *self.decisions.entry((mode, reason_label(reason))).or_insert(0) += 1;
        Ok(PickOutput {
            endpoint,
            fallbacks,
            worker_id: worker_id.clone(),
            matched_blocks: chosen.overlap_blocks,
            total_blocks: hashes.len() as u32,
            reason,
            passed_over,
            mode,
            inflight: pb::InflightEvent {
                request_id: input.request_id.to_owned(),
                worker_id,
                phase: pb::InflightPhase::Added as i32,
                prompt_blocks: hashes.len() as u32,
                overlap_blocks: chosen.overlap_blocks,
                expected_output_tokens,
                ts_unix_nanos: 0,
            },
        })
    }

    /// A completion report from a filter. Returns the in-flight events to
    /// share with other replicas.
    pub fn on_report(&mut self, r: &pb::CompletionReport, now_ms: u64) -> Vec<pb::InflightEvent> {
        let mut out = Vec::new();
        if !r.worker_id.is_empty() && reached_another(r) {
            self.connection_failed(&r.worker_id, now_ms);
        }
        let known = self.tracker.first_token(&r.request_id).is_ok();
        if !known {
            self.counters.reports_unknown += 1;
        }
        let event = |phase: pb::InflightPhase| pb::InflightEvent {
            request_id: r.request_id.clone(),
            worker_id: r.worker_id.clone(),
            phase: phase as i32,
            ..Default::default()
        };
        out.push(event(pb::InflightPhase::FirstToken));
        if r.total_us > 0 {
            let _ = self.tracker.done(&r.request_id);
            out.push(event(pb::InflightPhase::Done));
            self.counters.reports += 1;
            if let Some((predicted, _)) = self.predicted.remove(&r.request_id)
                && let Some(cached) = r.cached_tokens
            {
                self.counters.reports_with_cached += 1;
                self.counters.predicted_cached_tokens += u64::from(predicted);
                self.counters.reported_cached_tokens += u64::from(cached);
                if predicted.abs_diff(cached) < self.config.block_size.get() {
                    self.counters.reports_accurate += 1;
                }
            }
        }
        out
    }

    /// An in-flight event from another replica.
    pub fn on_replica_event(&mut self, ev: &pb::InflightEvent, now_ms: u64) {
        let Some(w) = self.workers.get(&ev.worker_id) else {
            self.counters.replica_events_ignored += 1;
            return;
        };
        let idx = w.idx;
        let r = match pb::InflightPhase::try_from(ev.phase) {
            Ok(pb::InflightPhase::Added) => {
                let out = u64::from(ev.expected_output_tokens.div_ceil(self.config.block_size.get()));
                self.tracker.added_counted(&ev.request_id, idx, ev.prompt_blocks, ev.overlap_blocks, out, now_ms)
            }
            Ok(pb::InflightPhase::FirstToken) => self.tracker.first_token(&ev.request_id),
            Ok(pb::InflightPhase::Done) => self.tracker.done(&ev.request_id),
            _ => Err(kvgate_scheduler::LifecycleError::Unknown),
        };
        match r {
            Ok(()) => self.counters.replica_events += 1,
            Err(_) => self.counters.replica_events_ignored += 1,
        }
    }

    /// Requests in flight (all replicas).
    pub fn inflight(&self) -> usize {
        self.tracker.inflight()
    }

    /// Every worker, for the admin endpoint and metrics.
    pub fn worker_views(&self, now_ms: u64) -> Vec<WorkerView> {
        let mut v: Vec<WorkerView> = self
            .workers
            .iter()
            .map(|(id, w)| {
                let load = self.tracker.load(w.idx);
                WorkerView {
                    id: id.clone(),
                    endpoint: w.endpoint.clone(),
                    live: self.live(w, now_ms),
                    sync: match &w.sync {
                        SyncState::Unknown => "unknown".into(),
                        SyncState::Snapshotting { buffer, .. } => format!("snapshotting ({} buffered)", buffer.len()),
                        SyncState::Synced { seq, .. } => format!("synced (relay_seq {seq})"),
                        SyncState::Static => "static".into(),
                    },
                    device_blocks: self.index.worker_blocks(w.idx, Tier::Device),
                    host_blocks: self.index.worker_blocks(w.idx, Tier::Host),
                    inflight: load.inflight,
                    running: load.measured_running,
                    waiting: load.measured_waiting,
                    heartbeat_age_ms: w.last_heartbeat_ms.map(|t| now_ms.saturating_sub(t)),
                    engine_ok: w.engine_ok,
                    engine_health: match w.health {
                        pb::EngineHealth::Unspecified => "unknown",
                        pb::EngineHealth::Healthy => "healthy",
                        pb::EngineHealth::Unhealthy => "unhealthy",
                        pb::EngineHealth::Down => "down",
                    },
                    suspect_ms_left: w.suspect_until_ms.saturating_sub(now_ms),
                    block_size: w.block_size,
                }
            })
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// Skip counters of the index by cause, for metrics.
    pub fn skips(&self) -> [(&'static str, u64); 4] {
        let c = self.index.counters();
        [
            ("unknown_worker", c.skipped_unknown_worker),
            ("malformed", c.skipped_malformed),
            ("block_size", c.skipped_block_size),
            ("unknown_parent", c.skipped_unknown_parent),
        ]
    }
}

/// Whether a report says the chosen endpoint could not be reached: Envoy
/// served the request from another endpoint (a retry on a fallback), or no
/// upstream answered at all.
pub fn reached_another(r: &pb::CompletionReport) -> bool {
    if r.endpoint.is_empty() {
        return false;
    }
    if r.served_endpoint.is_empty() {
        return r.status_code == 0 || r.status_code == 503;
    }
    r.served_endpoint != r.endpoint
}
