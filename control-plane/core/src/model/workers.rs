//! The worker registry of one model: who is routable (liveness, engine
//! health, suspects of failed connections), heartbeats, expiry, and the
//! admin view.
//!
//! | operation | cost |
//! |---|---|
//! | [`ModelState::on_heartbeat`] | O(1) |
//! | [`ModelState::reap`] | O(workers + requests in flight) |
//! | [`ModelState::worker_views`] | O(workers) |

use kvgate_index::{Tier, WorkerIdx};
use kvgate_protocol::pb;
use kvgate_scheduler::Measured;

use super::clock_offset::ClockOffset;
use super::sync::StreamSync;
use super::{ModelState, Need};

/// Registry entry of one worker.
#[derive(Debug)]
pub(super) struct Worker {
    pub(super) idx: WorkerIdx,
    pub(super) endpoint: Option<String>,
    /// The data-parallel rank the worker is at its endpoint, when the
    /// server there runs several (requests carry it in `x-data-parallel-rank`).
    pub(super) dp_rank: Option<u32>,
    /// Its part in disaggregated serving (from heartbeats; `Both` until
    /// one says otherwise).
    pub(super) role: pb::WorkerRole,
    last_seen_ms: u64,
    last_heartbeat_ms: Option<u64>,
    /// When the relay sent that heartbeat, on this process's clock (ms):
    /// its send stamp plus the relay clock's offset from ours, when it
    /// stamps them.
    last_heartbeat_sent_ms: Option<u64>,
    /// The relay clock's offset from ours (see [`ClockOffset`]).
    clock_offset: ClockOffset,
    interval_ms: u32,
    engine_ok: bool,
    health: pb::EngineHealth,
    block_size: u32,
    pub(super) sync: StreamSync,
    /// Times of the recent connection failures reported by the filter.
    failures: Vec<u64>,
    /// No Pick before this time (a suspect).
    suspect_until_ms: u64,
}

impl Worker {
    pub(super) fn new(idx: WorkerIdx, endpoint: Option<String>, sync: StreamSync, block_size: u32) -> Self {
        Self {
            idx,
            endpoint,
            dp_rank: None,
            role: pb::WorkerRole::Both,
            last_seen_ms: 0,
            last_heartbeat_ms: None,
            last_heartbeat_sent_ms: None,
            clock_offset: ClockOffset::default(),
            interval_ms: 0,
            engine_ok: sync.is_static(),
            health: pb::EngineHealth::Unspecified,
            block_size,
            sync,
            failures: Vec::new(),
            suspect_until_ms: 0,
        }
    }
}

/// One worker as the admin endpoint shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WorkerView {
    /// Worker id.
    pub id: String,
    /// `ip:port`.
    pub endpoint: Option<String>,
    /// Data-parallel rank at the endpoint (servers with several ranks).
    pub dp_rank: Option<u32>,
    /// `both`, `prefill` or `decode`.
    pub role: &'static str,
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
    /// Prompt blocks of its requests in flight not yet past their first
    /// token (the prefill the worker still has to do, as reported).
    pub prefilling_blocks: u64,
    /// Last measured running / waiting.
    pub running: Option<u32>,
    /// Last measured waiting.
    pub waiting: Option<u32>,
    /// Requests on the worker as the cost counts them: the larger of those
    /// routed and not done, and the measured running + waiting.
    pub requests: u32,
    /// KV fill as the cost and the timing fits see it: active blocks (the
    /// larger of the prediction, which counts expected output blocks, and
    /// the measurement) over the capacity; `None` while the capacity is
    /// unknown.
    pub kv_fill: Option<f64>,
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

/// Longest backlog of the event stream [`ModelState::reap`] waits out
/// before purging workers whose heartbeats it has not seen.
pub const MAX_STREAM_LAG_MS: u64 = 60_000;

impl ModelState {
    pub(super) fn worker_entry(&mut self, id: &str, now_ms: u64) -> &mut Worker {
        let index = &self.index;
        let names = &mut self.names;
        let stale = &mut self.order_stale;
        let w = self.workers.entry(id.to_owned()).or_insert_with(|| {
            *stale = true;
            let idx = index.write().add_worker(id);
            names.insert(idx, id.to_owned());
            Worker::new(idx, None, StreamSync::Unknown, 0)
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
    pub(super) fn live(&self, w: &Worker, now_ms: u64) -> bool {
        if now_ms < w.suspect_until_ms {
            return false;
        }
        if w.sync.is_static() {
            return true;
        }
        let engine_up = matches!(w.health, pb::EngineHealth::Unspecified | pb::EngineHealth::Healthy);
        let judged_at = self.frozen_now(now_ms);
        engine_up && w.endpoint.is_some() && w.last_heartbeat_ms.is_some() && !self.silent(w, judged_at, now_ms)
    }

    /// Whether `w`'s heartbeats stopped: none processed for a heartbeat
    /// timeout before `judged_at`, unless the stream is behind. Heartbeats
    /// share one ordered stream with the KV events, so when ingest falls
    /// behind (a control plane short of CPU) every heartbeat is processed
    /// late, and at fewer per second than the relays send: by the time of
    /// processing, live workers' heartbeats come further apart than the
    /// timeout. So while heartbeats are still being processed (one within a
    /// timeout of now) and the backlog is under [`MAX_STREAM_LAG_MS`], a
    /// worker whose last heartbeat was sent no more than a timeout before
    /// the newest one processed is waiting in the queue, not silent. Send
    /// times are the relays' stamps moved to this process's clock by each
    /// relay's offset (learned as the least recent processing − send difference),
    /// so a relay whose clock is set apart is judged like the others. A
    /// worker whose relay stops while others go on falls behind their send
    /// times and is silent a timeout later, as before; when every relay stops, nothing is processed and the
    /// processing time decides. Without send times (a relay that does not
    /// stamp its heartbeats) the processing time decides.
    pub(super) fn silent(&self, w: &Worker, judged_at: u64, now_ms: u64) -> bool {
        let timeout = self.timeout_ms(w);
        let heard = w.last_heartbeat_ms.unwrap_or(w.last_seen_ms);
        if judged_at.saturating_sub(heard) <= timeout {
            return false;
        }
        let streaming = self.newest_heartbeat_ms.is_some_and(|t| now_ms.saturating_sub(t) <= timeout)
            && now_ms.saturating_sub(heard) <= MAX_STREAM_LAG_MS;
        match (w.last_heartbeat_sent_ms, self.newest_heartbeat_sent_ms) {
            (Some(sent), Some(newest)) if streaming => newest.saturating_sub(sent) > timeout,
            _ => true,
        }
    }

    /// The filter could not reach `worker_id` (Envoy retried on a fallback,
    /// or no upstream answered): enough of those within `suspect_ms` make
    /// it a suspect, with no Pick for `suspect_ms`, before its relay's next
    /// heartbeat says anything. The other data-parallel ranks of its server
    /// (same endpoint) become suspects with it: one address, one server.
    pub(super) fn connection_failed(&mut self, worker_id: &str, now_ms: u64) {
        let (n, window) = (self.config.suspect_after_failures, self.config.suspect_ms);
        let Some(w) = self.workers.get_mut(worker_id) else { return };
        self.counters.connection_failures += 1;
        if n == 0 {
            return;
        }
        w.failures.retain(|t| now_ms.saturating_sub(*t) <= window);
        w.failures.push(now_ms);
        if w.failures.len() < n as usize {
            return;
        }
        w.failures.clear();
        let endpoint = w.endpoint.clone();
        let same_server = |id: &str, o: &Worker| id == worker_id || (o.dp_rank.is_some() && o.endpoint == endpoint);
        for (_, o) in self.workers.iter_mut().filter(|(id, o)| same_server(id, o)) {
            if now_ms >= o.suspect_until_ms {
                self.counters.suspects += 1;
            }
            o.suspect_until_ms = now_ms + window;
        }
    }

    /// The time [`ModelState::reap`] judges heartbeats' processing age at:
    /// now, but not more than half a heartbeat timeout past the newest
    /// heartbeat of any worker (nor past the start of a NATS outage), and
    /// at least [`MAX_STREAM_LAG_MS`] before now. When ingest stops (no
    /// heartbeat processed at all) the workers are not reaped for it, until
    /// the bound; when it goes on behind, [`ModelState::silent`] judges by
    /// the relays' send times. Routing (`live`) judges the processing age
    /// at now (or the start of an outage), with the same allowance for a
    /// stream that is behind.
    fn reap_clock(&self, now_ms: u64) -> u64 {
        let frozen = self.frozen_now(now_ms);
        let slack = self.config.heartbeat_timeout_ms.max(1000) / 2;
        let stream = self.newest_heartbeat_ms.map_or(frozen, |t| frozen.min(t.saturating_add(slack)));
        stream.max(now_ms.saturating_sub(MAX_STREAM_LAG_MS))
    }

    /// How far behind the event stream is processed, ms (see
    /// [`super::stream_delay`]; 0 without stamped heartbeats).
    pub fn stream_delay_ms(&self) -> u64 {
        self.stream_delay.delay_ms()
    }

    /// Now, or the moment NATS went down during an outage.
    fn frozen_now(&self, now_ms: u64) -> u64 {
        self.frozen_at.map_or(now_ms, |f| f.min(now_ms))
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

    /// A heartbeat from a worker's relay.
    pub fn on_heartbeat(&mut self, hb: &pb::WorkerHeartbeat, now_ms: u64) -> Option<Need> {
        if !crate::endpoints::allowed(&self.config.allowed_endpoints, &hb.endpoint) {
            self.counters.refused_endpoints += 1;
            return None;
        }
        if hb.block_size != 0 && hb.block_size != self.config.block_size.get() {
            self.counters.heartbeats_block_size_mismatch += 1;
        }
        self.newest_heartbeat_ms = Some(self.newest_heartbeat_ms.map_or(now_ms, |t| t.max(now_ms)));
        let w = self.worker_entry(&hb.worker_id, now_ms);
        let idx = w.idx;
        w.last_heartbeat_ms = Some(now_ms);
        // Its send time on our clock (relays' clocks may be set apart).
        let stamp = i64::try_from(hb.ts_unix_nanos / 1_000_000).ok().filter(|s| *s > 0);
        w.last_heartbeat_sent_ms = stamp.and_then(|stamp| {
            let offset = w.clock_offset.observe(hb.relay_epoch, stamp, now_ms);
            u64::try_from(stamp.saturating_add(offset)).ok()
        });
        let sent = w.last_heartbeat_sent_ms;
        w.interval_ms = hb.interval_ms;
        w.engine_ok = hb.engine_ok;
        let health = pb::EngineHealth::try_from(hb.engine_health).unwrap_or(pb::EngineHealth::Unspecified);
        let health_changed = health != w.health;
        w.health = health;
        w.block_size = hb.block_size;
        if !hb.endpoint.is_empty() {
            w.endpoint = Some(hb.endpoint.clone());
        }
        w.dp_rank = (hb.data_parallel_size > 1).then_some(hb.data_parallel_rank);
        w.role = match pb::WorkerRole::try_from(hb.role) {
            Ok(pb::WorkerRole::Prefill) => pb::WorkerRole::Prefill,
            Ok(pb::WorkerRole::Decode) => pb::WorkerRole::Decode,
            _ => pb::WorkerRole::Both,
        };
        let resync = w.sync.heartbeat(hb.relay_epoch, hb.relay_seq);
        if let Some(sent) = sent {
            self.newest_heartbeat_sent_ms = Some(self.newest_heartbeat_sent_ms.map_or(sent, |t| t.max(sent)));
            self.stream_delay.observe(now_ms.saturating_sub(sent), now_ms);
        }
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
            self.calibration.touch(idx, &self.tracker.load(idx), now_ms);
            if let Some(totals) = hb.engine_counters.as_ref() {
                self.calibration.engine_counters(idx, totals);
            }
            if hb.capacity_blocks > 0 {
                self.index.write().set_capacity(idx, usize::try_from(hb.capacity_blocks).ok());
            }
        } else {
            self.counters.heartbeats_invalid += 1;
        }
        let cause = resync?;
        self.count_resync(cause);
        self.start_snapshot(&hb.worker_id, now_ms, None)
    }

    /// Removes workers whose heartbeats stopped (and those never heard from
    /// again after a first event), and forgets requests whose end was
    /// never reported. Returns the removed workers' ids.
    pub fn reap(&mut self, now_ms: u64) -> Vec<String> {
        let judged_at = self.reap_clock(now_ms);
        let dead: Vec<String> = self
            .workers
            .iter()
            .filter(|(_, w)| !w.sync.is_static() && self.silent(w, judged_at, now_ms))
            .map(|(k, _)| k.clone())
            .collect();
        for id in &dead {
            if let Some(w) = self.workers.shift_remove(id) {
                self.order_stale = true;
                let mut index = self.index.write();
                index.remove_worker(w.idx);
                self.removals = index.removals();
                drop(index);
                self.tracker.remove_worker(w.idx);
                self.calibration.remove_worker(w.idx);
                self.policy.forget_worker(w.idx);
                self.names.remove(&w.idx);
                self.counters.workers_expired += 1;
            }
        }
        let expired = self.tracker.expire(now_ms, self.config.inflight_ttl_ms);
        self.counters.inflight_expired += expired as u64;
        self.calibration.expire(now_ms, self.config.inflight_ttl_ms);
        if expired > 0 {
            for w in self.workers.values() {
                self.calibration.touch(w.idx, &self.tracker.load(w.idx), now_ms);
            }
        }
        self.sessions.expire(now_ms);
        let ttl = self.config.inflight_ttl_ms;
        self.predicted.retain(|_, (_, t)| now_ms.saturating_sub(*t) <= ttl);
        self.end_prefill_legs(now_ms);
        dead
    }

    /// Every worker, for the admin endpoint and metrics.
    pub fn worker_views(&self, now_ms: u64) -> Vec<WorkerView> {
        let index = self.index.read();
        let mut v: Vec<WorkerView> = self.workers.iter().map(|(id, w)| self.view(&index, id, w, now_ms)).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    fn view(&self, index: &kvgate_index::Index, id: &str, w: &Worker, now_ms: u64) -> WorkerView {
        let load = self.tracker.load(w.idx);
        WorkerView {
            id: id.to_owned(),
            endpoint: w.endpoint.clone(),
            dp_rank: w.dp_rank,
            role: role_label(w.role),
            live: self.live(w, now_ms),
            sync: w.sync.describe(),
            device_blocks: index.worker_blocks(w.idx, Tier::Device),
            host_blocks: index.worker_blocks(w.idx, Tier::Host),
            inflight: load.inflight,
            prefilling_blocks: load.prefill_pending_blocks,
            running: load.measured_running,
            waiting: load.measured_waiting,
            requests: load.effective_requests(),
            kv_fill: load.kv_fill(),
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
    }
}

/// Label of a role (admin view, metrics).
pub fn role_label(r: pb::WorkerRole) -> &'static str {
    match r {
        pb::WorkerRole::Prefill => "prefill",
        pb::WorkerRole::Decode => "decode",
        pb::WorkerRole::Both | pb::WorkerRole::Unspecified => "both",
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
