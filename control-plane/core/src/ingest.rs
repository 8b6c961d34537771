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
use crate::model::stream::StreamMessage;

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

    /// Dispatches NATS messages (subject, payload) in their order. The
    /// messages of one model in a row are applied together
    /// ([`crate::model::stream::ingest_stream`]: the stream decisions of
    /// many under one hold of the model's lock, their KV events under the
    /// index's write lock; with index shards, on parallel threads): a
    /// backlog is taken in fewer, larger holds, so that ingest, which waits
    /// for the Picks holding the model's lock at each hold, keeps up.
    /// Returns snapshot needs (model, worker).
    pub fn on_nats_many<'a>(
        &self,
        messages: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    ) -> Vec<(Arc<Model>, String)> {
        let mut needs = Vec::new();
        let mut group: Option<(Arc<Model>, Vec<StreamMessage>)> = None;
        for (subject, payload) in messages {
            let (model, msg) = match self.decode(subject, payload) {
                Decoded::Kv(m, b) => (m, StreamMessage::Kv(b)),
                Decoded::Heartbeat(m, h) => (m, StreamMessage::Heartbeat(h)),
                // Its own decisions are in its state already.
                Decoded::Inflight(m, b) if b.replica_id != self.config.replica_id => (m, StreamMessage::Replica(b)),
                Decoded::Inflight(..) | Decoded::Nothing => continue,
            };
            match &mut group {
                Some((m, msgs)) if Arc::ptr_eq(m, &model) => msgs.push(msg),
                _ => {
                    self.apply_group(group.take(), &mut needs);
                    group = Some((model, vec![msg]));
                }
            }
        }
        self.apply_group(group, &mut needs);
        needs
    }

    /// Applies one model's messages that arrived together, and publishes
    /// the stream's delay it judged.
    fn apply_group(&self, group: Option<(Arc<Model>, Vec<StreamMessage>)>, needs: &mut Vec<(Arc<Model>, String)>) {
        let Some((model, msgs)) = group else { return };
        let now = self.now_ms();
        let stamps: Vec<u64> = msgs
            .iter()
            .filter_map(|m| match m {
                StreamMessage::Kv(b) => Some(b.engine_ts_unix_nanos),
                _ => None,
            })
            .collect();
        let got = crate::model::stream::ingest_stream(&model.state, msgs, now, |held| {
            model.ingest_hold_seconds.observe(held.as_secs_f64());
        });
        for engine_ts in stamps {
            observe_lag(&model, engine_ts);
        }
        model.stream_delay_seconds.set(got.stream_delay_ms as f64 / 1000.0);
        needs.extend(got.needs.into_iter().map(|Need::Snapshot(w)| (model.clone(), w)));
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

/// The index's staleness for one applied batch: from the engine's
/// timestamp (when the relay had one) to now.
fn observe_lag(model: &Model, engine_ts: u64) {
    if engine_ts > 0 {
        let wall =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        model.event_lag_seconds.observe(wall.saturating_sub(engine_ts) as f64 / 1e9);
    }
}
