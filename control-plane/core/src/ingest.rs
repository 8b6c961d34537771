//! What arrives over NATS, decoded and dispatched (KV event batches,
//! heartbeats, other replicas' in-flight events), and the periodic upkeep
//! that judges liveness (frozen while NATS is down). No NATS client here:
//! the NATS adapter hands over subjects and payloads and acts on the
//! snapshot needs returned.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvgate_protocol::pb;
use kvgate_protocol::subject::SubjectKind;
use prost::Message as _;

use crate::app::{App, Model};
use crate::metrics::NatsKind;
use crate::model::Need;

/// A NATS message decoded, for its model.
enum Decoded {
    Kv(Arc<Model>, pb::KvEventBatch),
    Heartbeat(Arc<Model>, pb::WorkerHeartbeat),
    Inflight(Arc<Model>, pb::InflightBatch),
    /// Not ours, malformed, or for an unknown model (counted).
    Nothing,
}

impl App {
    /// Dispatches one NATS message. Returns snapshot needs (model, worker).
    pub fn on_nats(&self, subject: &str, payload: &[u8]) -> Vec<(Arc<Model>, String)> {
        self.on_nats_many([(subject, payload)])
    }

    /// Dispatches NATS messages (subject, payload) in their order. KV
    /// batches in a row for one model whose index has more than one shard
    /// are applied together (in waves, each wave's shards on parallel
    /// threads); KV batches are applied under the index's write lock, their
    /// stream decisions under the model's ([`crate::model::ingest_batches`]);
    /// everything else one message at a time under the model's lock, as
    /// [`App::on_nats`]. Returns snapshot needs (model, worker).
    pub fn on_nats_many<'a>(
        &self,
        messages: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    ) -> Vec<(Arc<Model>, String)> {
        let mut needs = Vec::new();
        let mut group: Option<(Arc<Model>, Vec<pb::KvEventBatch>)> = None;
        for (subject, payload) in messages {
            let msg = self.decode(subject, payload);
            if let Decoded::Kv(model, batch) = msg {
                if model.index_shards > 1 {
                    match &mut group {
                        Some((m, batches)) if Arc::ptr_eq(m, &model) => batches.push(batch),
                        _ => {
                            self.apply_group(group.take(), &mut needs);
                            group = Some((model, vec![batch]));
                        }
                    }
                    continue;
                }
                self.apply_group(group.take(), &mut needs);
                let now = self.now_ms();
                let engine_ts = batch.engine_ts_unix_nanos;
                let need = ingest(&model, vec![batch], now);
                observe_lag(&model, engine_ts);
                needs.extend(need.into_iter().map(|Need::Snapshot(w)| (model.clone(), w)));
                continue;
            }
            // Anything else waits for the KV batches before it.
            self.apply_group(group.take(), &mut needs);
            let now = self.now_ms();
            match msg {
                Decoded::Heartbeat(model, h) => {
                    let need = model.state.lock().on_heartbeat(&h, now);
                    needs.extend(need.map(|Need::Snapshot(w)| (model.clone(), w)));
                }
                Decoded::Inflight(model, b) => {
                    if b.replica_id != self.config.replica_id {
                        let mut st = model.state.lock();
                        for ev in &b.events {
                            st.on_replica_event(ev, now);
                        }
                    }
                }
                Decoded::Kv(..) | Decoded::Nothing => {}
            }
        }
        self.apply_group(group, &mut needs);
        needs
    }

    /// Applies KV batches gathered for one model together.
    fn apply_group(&self, group: Option<(Arc<Model>, Vec<pb::KvEventBatch>)>, needs: &mut Vec<(Arc<Model>, String)>) {
        let Some((model, batches)) = group else { return };
        let now = self.now_ms();
        let stamps: Vec<u64> = batches.iter().map(|b| b.engine_ts_unix_nanos).collect();
        let got = ingest(&model, batches, now);
        for engine_ts in stamps {
            observe_lag(&model, engine_ts);
        }
        needs.extend(got.into_iter().map(|Need::Snapshot(w)| (model.clone(), w)));
    }

    /// One NATS message decoded and checked (subject against payload),
    /// counted in the NATS metrics; not applied.
    fn decode(&self, subject: &str, payload: &[u8]) -> Decoded {
        let g = &self.metrics.global;
        let Ok(parsed) = self.subjects.parse(subject) else {
            g.nats(NatsKind::Other, false);
            return Decoded::Nothing;
        };
        let kind = match parsed.kind {
            SubjectKind::KvEvents => NatsKind::Kv,
            SubjectKind::Heartbeat => NatsKind::Heartbeat,
            SubjectKind::Inflight => NatsKind::Inflight,
            SubjectKind::Snapshot => NatsKind::Other,
        };
        g.nats(kind, false);
        if kind == NatsKind::Other {
            return Decoded::Nothing;
        }
        let Some(model) = self.models.get(&parsed.model) else {
            g.nats_unknown_model.inc();
            return Decoded::Nothing;
        };
        let worker = parsed.worker.as_deref();
        match kind {
            NatsKind::Kv => match pb::KvEventBatch::decode(payload) {
                Ok(b) if Some(b.worker_id.as_str()) == worker && b.model == parsed.model => {
                    Decoded::Kv(model.clone(), b)
                }
                _ => self.malformed(kind),
            },
            NatsKind::Heartbeat => match pb::WorkerHeartbeat::decode(payload) {
                Ok(h) if Some(h.worker_id.as_str()) == worker && h.model == parsed.model => {
                    Decoded::Heartbeat(model.clone(), h)
                }
                _ => self.malformed(kind),
            },
            _ => match pb::InflightBatch::decode(payload) {
                Ok(b) if b.model == parsed.model => Decoded::Inflight(model.clone(), b),
                _ => self.malformed(kind),
            },
        }
    }

    fn malformed(&self, kind: NatsKind) -> Decoded {
        self.metrics.global.nats(kind, true);
        Decoded::Nothing
    }

    /// The NATS adapter's view of its connection.
    pub fn set_nats_connected(&self, up: bool) {
        self.nats_connected.store(up, Ordering::Relaxed);
        self.metrics.global.nats_connected.set(i64::from(up));
    }

    /// Whether NATS is connected.
    pub fn nats_connected(&self) -> bool {
        self.nats_connected.load(Ordering::Relaxed)
    }

    /// Periodic upkeep: dead workers, expired requests, stale snapshots.
    /// Liveness is judged on heartbeats that travel over NATS: while the
    /// connection is down nobody is reaped, and the outage does not count
    /// against any worker once it is back (ARCHITECTURE §5).
    pub fn tick(&self) {
        let now = self.now_ms();
        if self.config.nats_url.is_some() && !self.nats_allows_reaping(now) {
            return;
        }
        for m in self.models.values() {
            let mut st = m.state.lock();
            for w in st.reap(now) {
                tracing::info!(model = %m.name, worker = %w, "worker removed: heartbeats stopped");
            }
            for w in st.stale_snapshots(now, self.config.snapshot_timeout_ms * 2) {
                st.snapshot_failed(&w);
            }
        }
    }

    /// Freezes liveness when NATS goes down and thaws it when it is back;
    /// false while it is down (or was never up).
    fn nats_allows_reaping(&self, now: u64) -> bool {
        let up = self.nats_connected();
        let mut down_since = self.nats_down_since.lock();
        // Not connected yet since the start: no outage, nothing to freeze.
        if !up && !self.nats_was_up.load(Ordering::Relaxed) {
            return false;
        }
        self.nats_was_up.store(true, Ordering::Relaxed);
        match (up, *down_since) {
            (false, None) => {
                *down_since = Some(now);
                tracing::warn!("NATS down: routing goes on on the last index, worker liveness frozen");
                for m in self.models.values() {
                    m.state.lock().freeze(now);
                }
                false
            }
            (false, Some(_)) => false,
            (true, Some(t)) => {
                *down_since = None;
                let outage = now.saturating_sub(t);
                tracing::info!(outage_ms = outage, "NATS back: worker liveness resumes");
                for m in self.models.values() {
                    m.state.lock().thaw(outage);
                }
                true
            }
            (true, None) => true,
        }
    }
}

/// KV batches into the model ([`crate::model::ingest_batches`]), each hold
/// of the index's write lock observed in `kvgate_ingest_lock_hold_seconds`.
fn ingest(model: &Model, batches: Vec<pb::KvEventBatch>, now: u64) -> Vec<Need> {
    crate::model::ingest_batches(&model.state, batches, now, |held| {
        model.ingest_hold_seconds.observe(held.as_secs_f64());
    })
}

/// The index's staleness for one applied batch: from the engine's
/// timestamp (when the relay had one) to now.
fn observe_lag(model: &Model, engine_ts: u64) {
    if engine_ts > 0 {
        let wall =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        model.event_lag_seconds.observe(wall.saturating_sub(engine_ts) as f64 / 1e9);
    }
}
