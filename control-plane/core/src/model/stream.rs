//! A model's event stream into its state and index, with as few holds of
//! the model's lock as keep the stream's order: the messages that arrived
//! together (KV batches, heartbeats, other replicas' in-flight events) are
//! cut into segments in which no worker has two KV batches; a segment's
//! stream decisions are made under one hold of the model's lock, in order,
//! then its KV events are applied under the index's write lock alone, then
//! the resync checks (the model's lock again only when a worker needs
//! one). Picks hold the model's lock for their decision, so each hold
//! ingest takes waits for theirs: when ingest falls behind, its segments
//! grow and it takes fewer holds for the same messages (one per message
//! could not keep up with a busy control plane, docs/DECISIONS.md "Picks
//! give way to ingest").
//!
//! Within a segment a worker has at most one KV batch, so its next batch
//! is decided (in a later segment) after this one is in the index, as when
//! each batch is taken alone.
//!
//! | operation | locks |
//! |---|---|
//! | `ingest_stream` of n messages in s segments | model's lock ≤ 2s times, index's write lock s times |

use std::collections::HashSet;

use kvgate_protocol::pb;
use parking_lot::{Mutex, RwLockUpgradableReadGuard};

use super::{Accepted, ModelState, Need, ToApply, apply_segment, stores_of};

/// One message of a model's event stream, decoded.
#[derive(Debug)]
pub enum StreamMessage {
    /// A relay's KV event batch.
    Kv(pb::KvEventBatch),
    /// A relay's heartbeat.
    Heartbeat(pb::WorkerHeartbeat),
    /// Another replica's in-flight events.
    Replica(pb::InflightBatch),
}

/// What a model's stream did.
#[derive(Debug, Default)]
pub struct Ingested {
    /// Snapshots to ask for.
    pub needs: Vec<Need>,
    /// The stream's delay as judged after the messages, ms
    /// ([`ModelState::stream_delay_ms`]).
    pub stream_delay_ms: u64,
}

/// The messages cut where a worker's second KV batch would join a segment
/// (found by borrowed worker ids, then split from the back).
fn segments(mut messages: Vec<StreamMessage>) -> Vec<Vec<StreamMessage>> {
    let mut cuts = Vec::new();
    let mut workers: HashSet<&str> = HashSet::new();
    for (i, m) in messages.iter().enumerate() {
        if let StreamMessage::Kv(b) = m
            && !workers.insert(&b.worker_id)
        {
            cuts.push(i);
            workers.clear();
            workers.insert(&b.worker_id);
        }
    }
    drop(workers);
    let mut out = Vec::with_capacity(cuts.len() + 1);
    for &at in cuts.iter().rev() {
        out.push(messages.split_off(at));
    }
    if !messages.is_empty() {
        out.push(messages);
    }
    out.reverse();
    out
}

/// Applies a model's messages in their order (see the module's header).
/// The index's lock is taken (upgradable: lookups go on) before the
/// model's is released, so no worker leaves (and no index is handed to
/// another) between the decisions and the events. Before the write lock,
/// still beside lookups, the bucket arrays of the engine tables the
/// segment may grow are made ([`kvgate_index::Index::spares_for`]): a
/// growth's fresh pages are its slow part. `held` is told how long each
/// hold of the index's write lock lasted.
pub fn ingest_stream(
    state: &Mutex<ModelState>,
    messages: Vec<StreamMessage>,
    now_ms: u64,
    mut held: impl FnMut(std::time::Duration),
) -> Ingested {
    let mut needs = Vec::new();
    let mut stream_delay_ms = None;
    for segment in segments(messages) {
        let mut st = state.lock();
        let mut applied: Vec<ToApply> = Vec::new();
        for m in segment {
            match m {
                StreamMessage::Kv(b) => match st.accept_batch(b, now_ms) {
                    Accepted::Apply(id, idx, b) => {
                        st.count_applied(&b);
                        applied.push((id, idx, b));
                    }
                    Accepted::Done(need) => needs.extend(need),
                },
                StreamMessage::Heartbeat(h) => needs.extend(st.on_heartbeat(&h, now_ms)),
                StreamMessage::Replica(b) => {
                    for ev in &b.events {
                        st.on_replica_event(ev, now_ms);
                    }
                }
            }
        }
        stream_delay_ms = Some(st.stream_delay_ms());
        if applied.is_empty() {
            continue;
        }
        let shared = st.shared_index();
        let index = shared.upgradable_read();
        drop(st);
        let spares = index.spares_for(&stores_of(&applied));
        let mut index = RwLockUpgradableReadGuard::upgrade(index);
        let t = std::time::Instant::now();
        index.give_spares(spares);
        apply_segment(&mut index, &applied);
        let resync: Vec<&str> =
            applied.iter().filter(|(_, idx, _)| index.take_resync(*idx)).map(|(id, _, _)| id.as_str()).collect();
        drop(index);
        held(t.elapsed());
        if !resync.is_empty() {
            let mut st = state.lock();
            needs.extend(resync.into_iter().filter_map(|id| st.start_snapshot(id, now_ms, None)));
        }
    }
    let stream_delay_ms = stream_delay_ms.unwrap_or_else(|| state.lock().stream_delay_ms());
    Ingested { needs, stream_delay_ms }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(w: &str) -> StreamMessage {
        StreamMessage::Kv(pb::KvEventBatch { worker_id: w.into(), ..Default::default() })
    }

    fn hb(w: &str) -> StreamMessage {
        StreamMessage::Heartbeat(pb::WorkerHeartbeat { worker_id: w.into(), ..Default::default() })
    }

    fn shape(s: &[Vec<StreamMessage>]) -> Vec<String> {
        s.iter()
            .map(|seg| {
                seg.iter()
                    .map(|m| match m {
                        StreamMessage::Kv(b) => format!("k{}", b.worker_id),
                        StreamMessage::Heartbeat(h) => format!("h{}", h.worker_id),
                        StreamMessage::Replica(_) => "r".into(),
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    }

    #[test]
    fn a_segment_holds_one_kv_batch_per_worker_and_keeps_the_order() {
        let msgs = vec![kv("1"), hb("1"), kv("2"), hb("2"), kv("1"), kv("3"), hb("1"), kv("3"), kv("1")];
        assert_eq!(shape(&segments(msgs)), ["k1 h1 k2 h2", "k1 k3 h1", "k3 k1"]);
        assert!(segments(Vec::new()).is_empty());
        assert_eq!(shape(&segments(vec![hb("1"), hb("1")])), ["h1 h1"]);
    }
}
