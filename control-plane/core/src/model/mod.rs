//! One model's routing state: its index, worker registry, load tracker and
//! policy, and the per-worker event-stream synchronization. Synchronous:
//! the adapters feed it decoded messages and act on the [`Need`]s it
//! returns.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the state; KV event batches, reports, replica events |
//! | [`snapshot`] | a worker's snapshot applied in pieces, Picks let in between |
//! | [`sync`] | the stream-sync state machine (one `accept` per batch) |
//! | [`pick`] | candidates, the policy's decision, its bookkeeping |
//! | [`sessions`] | session affinity: session key → worker, sliding TTL |
//! | [`admission`] | overload protection: requests held while every worker is saturated |
//! | [`disagg`] | disaggregated prefill/decode: whether a prefill goes to a prefill worker, and which |
//! | [`pools`] | scaling signals per role: prefill demand vs learned capacity, decode load, queueing |
//! | [`workers`] | registry, liveness, heartbeats, expiry, admin view |
//! | [`counters`] | the model's counters and their metric labels |
//!
//! | operation | cost |
//! |---|---|
//! | [`ModelState::pick`] | O(prompt blocks) hashing + index lookup + policy (`kv`: O(W)) |
//! | [`ModelState::on_batch`] | O(events in the batch) |
//! | [`ModelState::on_snapshot`] | O(blocks in the snapshot + events held meanwhile); in pieces of O(b) each ([`snapshot`]) |
//! | [`ModelState::reap`] | O(workers + requests in flight) |

pub mod admission;
pub mod clock_offset;
pub mod counters;
pub mod disagg;
pub mod pick;
pub mod pools;
pub mod sessions;
pub mod snapshot;
pub mod stream;
pub mod stream_delay;
pub mod sync;
pub mod workers;

use std::collections::HashMap;

use indexmap::IndexMap;
use std::sync::Arc;

use parking_lot::{RwLock, RwLockReadGuard};

use kvgate_index::{Index, IndexConfig, KvEvent, Tier, WorkerIdx};
use kvgate_protocol::pb;
use kvgate_protocol::{BlockSize, SequenceHash};
use kvgate_scheduler::{KvConfig, KvPolicy, LoadTracker, Mode, Policy};

use crate::timing::{Calibration, Prior};

pub use admission::{AdmissionCounters, Admit, Released};
pub use counters::ModelCounters;
pub use disagg::DisaggConfig;
pub use pick::{BY_LOAD, ByLoad, Found, NoWorker, PickInput, PickOutput, reason_label, reason_pb};
pub use pools::PoolSignals;
pub use sessions::SessionConfig;
use sessions::Sessions;
use sync::{Accept, Resync, StreamSync};
use workers::Worker;
pub use workers::{MAX_STREAM_LAG_MS, WorkerView, reached_another};

/// Settings of one model, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `model` as clients send it.
    pub name: String,
    /// Tokens per KV block.
    pub block_size: BlockSize,
    /// Routing mode at start.
    pub mode: Mode,
    /// Weights of the `kv` mode; its `prefill_ms_per_token` and
    /// `decode_ms_per_seq` are the priors of the learned timing.
    pub kv: KvConfig,
    /// Whether `kv` uses the engine timing learned online (else the
    /// configured constants).
    pub learn_timing: bool,
    /// Whether `kv` prices a request's decode by the load it lives with
    /// while later decisions even differences out (measured), rather than
    /// the load now.
    pub fading_load: bool,
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
    /// Session affinity (off by default).
    pub session: SessionConfig,
    /// Overload protection: the admission queue's settings; `None` = off.
    pub overload: Option<kvgate_scheduler::FairQueueConfig>,
    /// Disaggregated prefill and decode.
    pub disaggregation: DisaggConfig,
    /// Shards of the block index (at least 1). With more than one, KV
    /// batches that arrive together from several workers are applied on
    /// that many threads ([`stream::ingest_stream`]), and every lookup asks
    /// each shard. 1 = one thread, lookups as fast as they go.
    pub index_shards: u16,
}

/// What the stream decision made of one KV batch.
enum Accepted {
    /// Apply it: the worker's id and index, and the batch.
    Apply(String, WorkerIdx, pb::KvEventBatch),
    /// Nothing to apply; maybe a need.
    Done(Option<Need>),
}

/// Something the adapters must do for this model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Need {
    /// Ask this worker's relay for a snapshot.
    Snapshot(String),
}

/// One model's routing state.
pub struct ModelState {
    config: ModelConfig,
    /// Shared with the model's ingest, which applies KV batches under its
    /// write lock alone, and with the Picks' lookups, which read it before
    /// they take the model's lock (see [`stream::ingest_stream`] and [`Found`]).
    index: Arc<RwLock<Index>>,
    /// [`Index::removals`] as of the last worker this state removed (the
    /// index's changes only with it, under this state's lock).
    removals: u64,
    tracker: LoadTracker,
    calibration: Calibration,
    /// How fast load differences between its workers fade (`fading_load`).
    persistence: kvgate_scheduler::LoadPersistence,
    policy: Box<dyn Policy>,
    mode: Mode,
    /// By id, kept in id order (sorted when `order_stale`): a Pick lists the
    /// candidates by walking it, front to back through one array.
    workers: IndexMap<String, Worker>,
    /// Every registered worker's id, sorted (candidates are listed in this
    /// order, for reproducible ties): the map's keys, snapshotted for the
    /// candidates a Pick carries past `&mut self`.
    order: std::sync::Arc<[String]>,
    /// A worker was added or removed since `order` was built.
    order_stale: bool,
    names: HashMap<WorkerIdx, String>,
    /// Predicted cached tokens and pick time, by request id (kv mode).
    predicted: HashMap<String, (u32, u64)>,
    /// Disaggregated requests whose prefill leg is in flight.
    prefill_legs: disagg::Legs,
    /// Uncached prompt tokens routed for prefill, per role (see [`pools`]).
    prefill_rates: [pools::DecayingRate; 3],
    sessions: Sessions,
    /// Decisions are shared with other replicas (their in-flight events
    /// then carry the prompt's block hashes).
    share_with_replicas: bool,
    /// Requests held while the fleet is saturated (overload protection on).
    held: Option<kvgate_scheduler::FairQueue>,
    admission: admission::AdmissionCounters,
    rng: fastrand::Rng,
    counters: ModelCounters,
    /// Liveness is judged as of this time while NATS is down.
    frozen_at: Option<u64>,
    /// When the newest heartbeat of any worker was processed: the time the
    /// event stream has delivered up to (see `ModelState::reap`).
    newest_heartbeat_ms: Option<u64>,
    /// The newest send time (on this process's clock, ms; see
    /// [`clock_offset`]) of the heartbeats processed: how far the
    /// stream has delivered, by the relays' clocks.
    newest_heartbeat_sent_ms: Option<u64>,
    /// How far behind the event stream is processed.
    stream_delay: stream_delay::StreamDelay,
    /// The last snapshot ticket handed out (see [`snapshot`]).
    snapshot_tickets: u64,
}

impl std::fmt::Debug for ModelState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelState").field("model", &self.config.name).field("mode", &self.mode).finish()
    }
}

/// A batch the stream decision let through: worker id, its index, batch.
type ToApply = (String, WorkerIdx, pb::KvEventBatch);

/// One batch's events into the index (empty events skipped; counted by
/// [`ModelState::count_applied`]).
fn apply_to(index: &mut Index, idx: WorkerIdx, batch: &pb::KvEventBatch) {
    for e in batch.events.iter().filter_map(KvEvent::from_pb) {
        let _ = index.apply(idx, &e);
    }
}

/// A segment's events into the index: one batch directly, several at once
/// ([`Index::apply_batch`]: an index's shards on parallel threads).
fn apply_segment(index: &mut Index, applied: &[ToApply]) {
    if let [(_, idx, b)] = applied {
        apply_to(index, *idx, b);
        return;
    }
    let events: Vec<(WorkerIdx, KvEvent<'_>)> = applied
        .iter()
        .flat_map(|(_, idx, b)| b.events.iter().filter_map(KvEvent::from_pb).map(move |e| (*idx, e)))
        .collect();
    let _ = index.apply_batch(&events);
}

/// The blocks a segment stores, per worker and tier (batched events, counted
/// from their protobuf form).
fn stores_of(applied: &[ToApply]) -> Vec<(WorkerIdx, Tier, usize)> {
    let stored = |e: &pb::KvEvent| match &e.event {
        Some(pb::kv_event::Event::Stored(s)) => Some((Tier::from_medium(s.medium), s.engine_hashes.len())),
        _ => None,
    };
    applied
        .iter()
        .flat_map(|(_, idx, b)| b.events.iter().filter_map(stored).map(move |(tier, n)| (*idx, tier, n)))
        .collect()
}

fn policy_for(mode: Mode, kv: KvConfig) -> Box<dyn Policy> {
    match mode {
        Mode::Kv => Box::new(KvPolicy::new(kv)),
        m => m.policy(),
    }
}

impl ModelState {
    /// A model with no workers but its static ones.
    pub fn new(config: ModelConfig, seed: u64) -> Self {
        let mut this = Self {
            index: Arc::new(RwLock::new(Index::new(IndexConfig {
                shards: config.index_shards.max(1),
                ..IndexConfig::new(config.block_size)
            }))),
            removals: 0,
            tracker: LoadTracker::new(),
            persistence: kvgate_scheduler::LoadPersistence::new(),
            calibration: Calibration::new(
                Prior {
                    prefill_ms_per_token: config.kv.prefill_ms_per_token,
                    decode_ms_per_seq: config.kv.decode_ms_per_seq,
                },
                config.learn_timing,
                config.block_size.get(),
            ),
            policy: policy_for(config.mode, config.kv),
            mode: config.mode,
            workers: IndexMap::new(),
            order: std::sync::Arc::from(Vec::new()),
            order_stale: true,
            names: HashMap::new(),
            predicted: HashMap::new(),
            prefill_legs: Default::default(),
            prefill_rates: Default::default(),
            sessions: Sessions::new(config.session),
            share_with_replicas: false,
            held: config.overload.map(kvgate_scheduler::FairQueue::new),
            admission: Default::default(),
            rng: fastrand::Rng::with_seed(seed),
            counters: ModelCounters::default(),
            frozen_at: None,
            newest_heartbeat_ms: None,
            newest_heartbeat_sent_ms: None,
            stream_delay: Default::default(),
            snapshot_tickets: 0,
            config,
        };
        for (id, endpoint) in this.config.static_workers.clone() {
            let idx = this.index.write().add_worker(&id);
            this.names.insert(idx, id.clone());
            let w = Worker::new(idx, Some(endpoint), StreamSync::Static, this.config.block_size.get());
            this.workers.insert(id, w);
        }
        this
    }

    /// Its configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The index (read-only; a read lock of it).
    pub fn index(&self) -> RwLockReadGuard<'_, Index> {
        self.index.read()
    }

    /// The index, shared (the model's ingest and Picks use it without the
    /// model's lock).
    pub fn shared_index(&self) -> Arc<RwLock<Index>> {
        Arc::clone(&self.index)
    }

    /// The engine timing learned so far.
    pub fn calibration(&self) -> &Calibration {
        &self.calibration
    }

    /// The engine timing learned so far, to take its journal
    /// ([`Calibration::journal_take`]).
    pub fn calibration_mut(&mut self) -> &mut Calibration {
        &mut self.calibration
    }

    /// How fast load differences between its workers fade (measured only
    /// with `fading_load`).
    pub fn persistence(&self) -> &kvgate_scheduler::LoadPersistence {
        &self.persistence
    }

    /// Counters.
    pub fn counters(&self) -> &ModelCounters {
        &self.counters
    }

    /// Current mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Requests in flight (all replicas).
    pub fn inflight(&self) -> usize {
        self.tracker.inflight()
    }

    /// Sessions pinned now, and sessions refused a pin (table full).
    pub fn sessions(&self) -> (usize, u64) {
        (self.sessions.len(), self.sessions.refused)
    }

    /// Whether decisions are shared with other replicas (set by the app
    /// when it has a replica sink).
    pub fn set_share_with_replicas(&mut self, share: bool) {
        self.share_with_replicas = share;
    }

    /// Switches the routing mode (learned state of the old policy is dropped).
    pub fn set_mode(&mut self, mode: Mode) {
        if mode != self.mode {
            self.mode = mode;
            self.policy = policy_for(mode, self.config.kv);
        }
    }

    /// A KV event batch from a worker's relay (all of it under `&mut self`;
    /// the model's ingest uses [`stream::ingest_stream`], which gives the index
    /// alone to the events).
    pub fn on_batch(&mut self, batch: pb::KvEventBatch, now_ms: u64) -> Option<Need> {
        match self.accept_batch(batch, now_ms) {
            Accepted::Apply(id, idx, b) => {
                self.apply_events(idx, &b);
                self.resync_if_needed(&id, idx, now_ms)
            }
            Accepted::Done(need) => need,
        }
    }

    /// The stream decision for one KV batch: to apply (with the worker's
    /// id and index), or done (buffered, a duplicate, refused, or a
    /// snapshot asked for).
    fn accept_batch(&mut self, batch: pb::KvEventBatch, now_ms: u64) -> Accepted {
        // With an endpoint list, only workers whose heartbeat was allowed
        // get an index entry (their first heartbeat asks for a snapshot).
        if !self.config.allowed_endpoints.is_empty() && !self.workers.contains_key(&batch.worker_id) {
            self.counters.refused_endpoints += 1;
            return Accepted::Done(None);
        }
        let id = batch.worker_id.clone();
        let w = self.worker_entry(&id, now_ms);
        let idx = w.idx;
        match w.sync.accept(batch) {
            Accept::Apply(b) => Accepted::Apply(id, idx, b),
            Accept::Duplicate => {
                self.counters.batches_duplicate += 1;
                Accepted::Done(None)
            }
            Accept::Held => {
                self.counters.batches_buffered += 1;
                Accepted::Done(None)
            }
            Accept::Resync(cause, b) => {
                self.count_resync(cause);
                Accepted::Done(self.start_snapshot(&id, now_ms, Some(b)))
            }
        }
    }

    fn apply_events(&mut self, idx: WorkerIdx, batch: &pb::KvEventBatch) {
        self.count_applied(batch);
        apply_to(&mut self.index.write(), idx, batch);
    }

    /// A batch about to be applied, in the counters.
    fn count_applied(&mut self, batch: &pb::KvEventBatch) {
        self.counters.events_empty += batch.events.iter().filter(|e| e.event.is_none()).count() as u64;
        self.counters.batches_applied += 1;
    }

    fn count_resync(&mut self, cause: Resync) {
        match cause {
            Resync::Gap => self.counters.gaps += 1,
            Resync::Epoch => self.counters.epoch_changes += 1,
            // The held batches are dropped with the snapshot under way.
            Resync::Overflow => self.counters.batches_dropped += sync::MAX_HELD as u64,
            Resync::Unknown => {}
        }
    }

    fn start_snapshot(&mut self, id: &str, now_ms: u64, first: Option<pb::KvEventBatch>) -> Option<Need> {
        let w = self.workers.get_mut(id)?;
        if first.is_some() {
            self.counters.batches_buffered += 1;
        }
        self.snapshot_tickets += 1;
        w.sync.start_snapshot(now_ms, first, self.snapshot_tickets);
        Some(Need::Snapshot(id.to_owned()))
    }

    /// The index met a store whose parent it does not hold: the worker's
    /// blocks are incomplete, so a snapshot is asked for.
    fn resync_if_needed(&mut self, id: &str, idx: WorkerIdx, now_ms: u64) -> Option<Need> {
        let resync = self.index.write().take_resync(idx);
        if resync { self.start_snapshot(id, now_ms, None) } else { None }
    }

    /// The snapshot of worker `id` is about to be asked for, or waits its
    /// turn (`StreamSync::snapshot_asking`): the batches held for it are
    /// dropped (its answer covers them) and its timeout restarts. False
    /// when no snapshot of `id` is wanted any more.
    pub fn snapshot_asking(&mut self, id: &str, now_ms: u64) -> bool {
        let Some(n) = self.workers.get_mut(id).and_then(|w| w.sync.snapshot_asking(now_ms)) else { return false };
        self.counters.batches_covered += n as u64;
        true
    }

    /// Whether worker `id` wants a snapshot (one asked for, waiting its
    /// turn or being applied).
    pub fn wants_snapshot(&self, id: &str) -> bool {
        self.workers.get(id).is_some_and(|w| w.sync.wants_snapshot())
    }

    /// How many workers' event streams are in each state (synced,
    /// snapshotting, unknown, static): how far a resync storm has come.
    pub fn stream_states(&self) -> [(&'static str, u64); 4] {
        let mut out = [("synced", 0), ("snapshotting", 0), ("unknown", 0), ("static", 0)];
        for w in self.workers.values() {
            let name = w.sync.state_name();
            if let Some(n) = out.iter_mut().find(|(k, _)| *k == name) {
                n.1 += 1;
            }
        }
        out
    }

    /// Workers whose snapshot started before `now_ms - timeout_ms` (the
    /// adapter gave up on them).
    pub fn stale_snapshots(&self, now_ms: u64, timeout_ms: u64) -> Vec<String> {
        self.workers.iter().filter(|(_, w)| w.sync.snapshot_stale(now_ms, timeout_ms)).map(|(k, _)| k.clone()).collect()
    }

    /// A snapshot request failed or timed out: back to unknown, so that the
    /// next message retries.
    pub fn snapshot_failed(&mut self, id: &str) {
        if let Some(w) = self.workers.get_mut(id)
            && w.sync.snapshot_failed()
        {
            self.counters.snapshots_failed += 1;
        }
    }

    /// A completion report from a filter. Returns the in-flight events to
    /// share with other replicas.
    pub fn on_report(&mut self, r: &pb::CompletionReport, now_ms: u64) -> Vec<pb::InflightEvent> {
        // A failed connection is counted once per request, by its end
        // report (a first-token report of the same request may come first).
        let elsewhere = !r.worker_id.is_empty() && reached_another(r);
        if elsewhere && r.total_us > 0 {
            self.connection_failed(&r.worker_id, now_ms);
        }
        if self.tracker.first_token(&r.request_id).is_err() {
            self.counters.reports_unknown += 1;
        }
        // Its prefill worker finished the leg by the first token.
        self.end_leg(&r.request_id);
        // A report before the end marks the first token (the filter sends
        // one for a stream, the ext_proc adapter for every answer; without
        // it the calibration takes the routing time).
        if r.total_us == 0 {
            self.calibration.first_token(&r.request_id, r.ttfb_us, now_ms);
        }
        let event = |phase: pb::InflightPhase| pb::InflightEvent {
            request_id: r.request_id.clone(),
            worker_id: r.worker_id.clone(),
            phase: phase as i32,
            ..Default::default()
        };
        let mut out = vec![event(pb::InflightPhase::FirstToken)];
        if r.total_us > 0 {
            // Served by a fallback: its times are not the chosen worker's.
            if elsewhere {
                self.calibration.forget(&r.request_id);
            } else {
                self.calibration.done(r, now_ms);
            }
            let _ = self.tracker.done(&r.request_id);
            // A failed answer's time is not a served request's life (a
            // refusal ends in microseconds): the fade is measured against
            // lives as the calibration learns them.
            if self.config.fading_load && (200..300).contains(&r.status_code) {
                self.persistence.ended(r.total_us as f64 / 1000.0);
            }
            if let Some(idx) = self.workers.get(&r.worker_id).map(|w| w.idx) {
                self.calibration.touch(idx, &self.tracker.load(idx), now_ms);
            }
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
            // Another replica's prefill leg: load on its prefill worker
            // until its estimated end or the request's first token.
            Ok(pb::InflightPhase::Added) if ev.prefill_leg_ms > 0 => {
                let leg = disagg::leg_id(&ev.request_id);
                let r = self.tracker.added_shared(&leg, idx, &[], ev.prompt_blocks, ev.overlap_blocks, 1, now_ms);
                if r.is_ok() {
                    self.prefill_legs.insert(&ev.request_id, now_ms + u64::from(ev.prefill_leg_ms), idx);
                }
                r
            }
            Ok(pb::InflightPhase::Added) => {
                self.sessions.pin(&ev.session_id, idx, now_ms);
                let out = u64::from(ev.expected_output_tokens.div_ceil(self.config.block_size.get()));
                let hashes: Vec<SequenceHash> = ev.block_hashes.iter().map(|h| SequenceHash(*h)).collect();
                let (prompt, overlap) = (ev.prompt_blocks, ev.overlap_blocks);
                self.tracker.added_shared(&ev.request_id, idx, &hashes, prompt, overlap, out, now_ms)
            }
            Ok(pb::InflightPhase::FirstToken) => {
                self.end_leg(&ev.request_id);
                self.tracker.first_token(&ev.request_id)
            }
            Ok(pb::InflightPhase::Done) => {
                self.end_leg(&ev.request_id);
                self.tracker.done(&ev.request_id)
            }
            _ => Err(kvgate_scheduler::LifecycleError::Unknown),
        };
        self.calibration.touch(idx, &self.tracker.load(idx), now_ms);
        match r {
            Ok(()) => self.counters.replica_events += 1,
            Err(_) => self.counters.replica_events_ignored += 1,
        }
    }

    /// Skip counters of the index by cause, for metrics.
    pub fn skips(&self) -> [(&'static str, u64); 4] {
        let c = self.index.read().counters();
        [
            ("unknown_worker", c.skipped_unknown_worker),
            ("malformed", c.skipped_malformed),
            ("block_size", c.skipped_block_size),
            ("unknown_parent", c.skipped_unknown_parent),
        ]
    }
}
