//! The NATS adapter: one subscription on `<prefix>.>` fed to the core's
//! [`App::on_nats_many`] on a thread of its own (the ingest thread),
//! snapshot requests for the workers it names (`snapshots.rs`), and the replica-sync
//! publisher (this replica's decisions for the others). The connection
//! itself runs on another thread, with a one-thread runtime of its own
//! (`nats_on_own_thread`).
//!
//! Why a thread for ingest: applying a batch is synchronous work (decode,
//! hash, index updates under the model's lock). On a runtime worker, a
//! backlog of batches ran up to tokio's cooperative budget before the
//! worker's queued Picks, a few milliseconds at a time; on its own thread the
//! kernel's scheduler shares the cores and a waking Pick handler is not
//! queued behind ingest. Why one for the connection: the other way round,
//! its reader must not wait behind Picks.

use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt as _, StreamExt as _};
use kvgate_core::{App, Model, ReplicaSink};
use kvgate_protocol::pb;
use prost::Message as _;

use crate::snapshots::Snapshots;

/// The sending end of the replica-sync queue.
#[derive(Debug)]
pub(crate) struct Outbox(pub(crate) tokio::sync::mpsc::UnboundedSender<(String, pb::InflightEvent)>);

/// The receiving end of the replica-sync queue.
pub(crate) type Inbox = tokio::sync::mpsc::UnboundedReceiver<(String, pb::InflightEvent)>;

impl ReplicaSink for Outbox {
    fn share(&self, model: &str, event: pb::InflightEvent) {
        let _ = self.0.send((model.to_owned(), event));
    }
}

/// Messages queued for the ingest thread. When it falls behind, the
/// subscription waits (then the NATS server's slow-consumer rule applies, as
/// for any subscriber); small, because a queued batch is only as fresh as
/// the queue is short (a typical batch is a few KB, a large one up to the
/// server's payload limit).
const INGEST_QUEUE: usize = 256;

/// Most queued messages the ingest thread takes at once: KV batches of
/// several workers among them are applied together when the model's index
/// has shards ([`App::on_nats_many`]).
const INGEST_GROUP: usize = 64;

/// Starts the ingest thread: it applies the messages in order, taking
/// what is queued (up to [`INGEST_GROUP`]) at once, and sends back the
/// snapshots they call for. It ends when the sender is dropped.
fn spawn_ingest(
    app: Arc<App>,
    needs: tokio::sync::mpsc::UnboundedSender<(Arc<Model>, String)>,
) -> std::io::Result<tokio::sync::mpsc::Sender<async_nats::Message>> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<async_nats::Message>(INGEST_QUEUE);
    std::thread::Builder::new().name("kvgate-ingest".into()).spawn(move || {
        let mut msgs = Vec::with_capacity(INGEST_GROUP);
        while let Some(msg) = rx.blocking_recv() {
            msgs.push(msg);
            while msgs.len() < INGEST_GROUP
                && let Ok(m) = rx.try_recv()
            {
                msgs.push(m);
            }
            for need in app.on_nats_many(msgs.iter().map(|m| (m.subject.as_str(), &m.payload[..]))) {
                let _ = needs.send(need);
            }
            msgs.clear();
        }
    })?;
    Ok(tx)
}

/// Applies one NATS message and passes on the snapshots it calls for.
fn apply(app: &App, msg: &async_nats::Message, needs: &tokio::sync::mpsc::UnboundedSender<(Arc<Model>, String)>) {
    for need in app.on_nats(msg.subject.as_str(), &msg.payload) {
        let _ = needs.send(need);
    }
}

/// Runs [`nats_task`] on a thread of its own, with a one-thread runtime:
/// the NATS connection's reader and the hand-over of messages to the ingest
/// thread must not wait behind Picks on the gRPC runtime. There they did:
/// 1,000 workers past saturation, the ingest thread stood idle 85–100 % of
/// each second, handed 1–4 K of the 8.8 K messages a second (docs/DECISIONS.md
/// "Picks give way to ingest"). Without a thread or its runtime (the system
/// refused one) it runs here. Ends when the task does.
pub(crate) async fn nats_on_own_thread(
    app: Arc<App>,
    url: String,
    inflight_rx: Inbox,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let slot = Arc::new(std::sync::Mutex::new(Some((app, url, inflight_rx, stop))));
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let theirs = slot.clone();
    let spawned = std::thread::Builder::new().name("kvgate-nats".into()).spawn(move || {
        match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => {
                if let Some((app, url, rx, stop)) = theirs.lock().ok().and_then(|mut s| s.take()) {
                    rt.block_on(nats_task(app, url, rx, stop));
                }
            }
            Err(e) => tracing::error!(error = %e, "no runtime for the NATS thread; NATS runs on the gRPC runtime"),
        }
        let _ = done_tx.send(());
    });
    match spawned {
        Ok(_) => {
            let _ = done_rx.await;
        }
        Err(e) => tracing::error!(error = %e, "no NATS thread; NATS runs on the gRPC runtime"),
    }
    // The task is left here when the thread did not run it.
    let args = slot.lock().ok().and_then(|mut s| s.take());
    if let Some((app, url, rx, stop)) = args {
        nats_task(app, url, rx, stop).await;
    }
}

pub(crate) async fn nats_task(
    app: Arc<App>,
    url: String,
    inflight_rx: Inbox,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    // Connect with retries: the control plane serves (by load) meanwhile.
    let client = loop {
        let nurl = kvgate_protocol::nats_url::split_nats_url(&url);
        let opts = nurl
            .auth
            .connect_options(async_nats::ConnectOptions::new())
            .name(format!("kvgate-control-plane {}", app.config.replica_id))
            // Its own in-flight batches are not sent back to it (they were
            // decoded and dropped: one per decision batch).
            .no_echo()
            .retry_on_initial_connect()
            .max_reconnects(None);
        match opts.connect(nurl.servers.as_str()).await {
            Ok(c) => break c,
            Err(e) => {
                tracing::warn!(error = %e, "NATS connect failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {},
                    _ = stop.changed() => return,
                }
            }
        }
    };
    let mut sub = match client.subscribe(format!("{}.>", app.subjects.prefix())).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "NATS subscribe failed");
            return;
        }
    };
    let (needs_tx, mut needs) = tokio::sync::mpsc::unbounded_channel();
    let snapshots = Snapshots::new(app.clone(), client.clone());
    // Without a thread (the system refused one) messages are applied here.
    let ingest = match spawn_ingest(app.clone(), needs_tx.clone()) {
        Ok(tx) => Some(tx),
        Err(e) => {
            tracing::error!(error = %e, "no ingest thread; applying NATS messages on the runtime");
            None
        }
    };
    let publisher = tokio::spawn(publish_inflight(app.clone(), client.clone(), inflight_rx, SHARE_LINGER));
    let mut state_poll = tokio::time::interval(Duration::from_millis(100));
    let mut was_connected = false;
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            msg = sub.next() => {
                let Some(msg) = msg else { break };
                match &ingest {
                    Some(tx) => {
                        if tx.send(msg).await.is_err() {
                            tracing::error!("the ingest thread ended; NATS messages are no longer applied");
                            break;
                        }
                    }
                    None => apply(&app, &msg, &needs_tx),
                }
            }
            Some((model, worker)) = needs.recv() => snapshots.need(model, worker),
            _ = state_poll.tick() => {
                let up = client.connection_state() == async_nats::connection::State::Connected;
                app.set_nats_connected(up);
                if up && !was_connected {
                    tracing::info!("NATS connected");
                } else if !up && was_connected {
                    tracing::warn!("NATS disconnected; reconnecting");
                }
                was_connected = up;
            }
        }
    }
    publisher.abort();
    app.set_nats_connected(false);
}

/// How long the replica-sync publisher lets this replica's in-flight events
/// gather after the first of a batch before it publishes them. At 2,000
/// Picks/s (and as many reports) a publish per event cost the process ~26 µs
/// of CPU per Pick (a task wake-up, a NATS publish, the client's write);
/// gathered for 1 ms (1–2 ms with tokio's timer) they go several to a
/// batch, and cost what publishing nothing costs, within the noise. A peer
/// replica learns a decision up to this much later, which is small beside
/// NATS's own delivery and the lifetime of a request (docs/DECISIONS.md).
const SHARE_LINGER: Duration = Duration::from_millis(1);

/// In-flight events the publisher takes in its first receive.
const SHARE_FIRST: usize = 512;

/// In-flight events the publisher gathers at most before it publishes.
const SHARE_MAX: usize = 4096;

/// Publishes this replica's in-flight events for the other replicas: waits
/// for one, lets more gather for `linger`, then publishes what is queued,
/// per model in batches of at most [`MAX_INFLIGHT_BATCH_BYTES`], in order.
/// Idle, it waits without waking. It ends when the queue's sender is gone.
async fn publish_inflight(app: Arc<App>, client: async_nats::Client, mut rx: Inbox, linger: Duration) {
    let mut queued = Vec::with_capacity(SHARE_FIRST);
    while rx.recv_many(&mut queued, SHARE_FIRST).await > 0 {
        tokio::time::sleep(linger).await;
        // What has gathered meanwhile, without waiting for more.
        let room = SHARE_MAX.saturating_sub(queued.len());
        let _ = rx.recv_many(&mut queued, room).now_or_never();
        for (model, events) in by_model(queued.drain(..)) {
            for events in in_batches(events, MAX_INFLIGHT_BATCH_BYTES) {
                let batch =
                    pb::InflightBatch { replica_id: app.config.replica_id.clone(), model: model.clone(), events };
                match client.publish(app.subjects.inflight(&model), batch.encode_to_vec().into()).await {
                    Ok(()) => app.metrics.global.inflight_published.inc(),
                    Err(_) => app.metrics.global.inflight_publish_errors.inc(),
                };
            }
        }
    }
}

/// Events grouped by model, each group in its order, the models in the
/// order of their first event.
fn by_model(events: impl Iterator<Item = (String, pb::InflightEvent)>) -> Vec<(String, Vec<pb::InflightEvent>)> {
    let mut out: Vec<(String, Vec<pb::InflightEvent>)> = Vec::new();
    for (model, ev) in events {
        match out.iter_mut().find(|(m, _)| *m == model) {
            Some((_, v)) => v.push(ev),
            None => out.push((model, vec![ev])),
        }
    }
    out
}

/// Largest in-flight batch published, in encoded event bytes: well under
/// NATS's default 1 MiB payload limit (an event carries up to 4096 block
/// hashes, 32 KiB).
const MAX_INFLIGHT_BATCH_BYTES: usize = 256 << 10;

/// `events` in order, cut into batches of at most `max_bytes` of encoded
/// events each (an event larger than that alone in its batch).
fn in_batches(events: Vec<pb::InflightEvent>, max_bytes: usize) -> Vec<Vec<pb::InflightEvent>> {
    let mut out: Vec<Vec<pb::InflightEvent>> = Vec::new();
    let mut bytes = 0;
    for e in events {
        let n = e.encoded_len() + 4;
        match out.last_mut() {
            Some(last) if bytes + n <= max_bytes => last.push(e),
            _ => {
                out.push(vec![e]);
                bytes = 0;
            }
        }
        bytes += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inflight_events_are_cut_into_bounded_batches_in_order() {
        let ev = |i: u64, hashes: usize| pb::InflightEvent {
            request_id: format!("r{i}"),
            block_hashes: (0..hashes as u64).collect(),
            ..Default::default()
        };
        let events: Vec<_> = (0..100).map(|i| ev(i, 4096)).collect();
        let batches = in_batches(events, MAX_INFLIGHT_BATCH_BYTES);
        assert!(batches.len() > 1);
        let mut seen = 0;
        for b in &batches {
            let batch = pb::InflightBatch { events: b.clone(), ..Default::default() };
            assert!(batch.encoded_len() <= MAX_INFLIGHT_BATCH_BYTES, "{}", batch.encoded_len());
            for e in b {
                assert_eq!(e.request_id, format!("r{seen}"));
                seen += 1;
            }
        }
        assert_eq!(seen, 100);
        // Small events share one batch; an oversized one stands alone.
        assert_eq!(in_batches((0..10).map(|i| ev(i, 0)).collect(), 1024).len(), 1);
        assert_eq!(in_batches(vec![ev(0, 0), ev(1, 1000), ev(2, 0)], 1024).len(), 3);
    }

    #[test]
    fn gathered_events_keep_their_order_within_each_model() {
        let ev =
            |m: &str, i: u64| (m.to_owned(), pb::InflightEvent { request_id: format!("r{i}"), ..Default::default() });
        let got = by_model([ev("b", 0), ev("a", 1), ev("b", 2), ev("a", 3), ev("b", 4)].into_iter());
        let ids: Vec<(&str, Vec<&str>)> =
            got.iter().map(|(m, v)| (m.as_str(), v.iter().map(|e| e.request_id.as_str()).collect())).collect();
        assert_eq!(ids, vec![("b", vec!["r0", "r2", "r4"]), ("a", vec!["r1", "r3"])]);
    }
}
