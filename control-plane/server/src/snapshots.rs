//! Workers' snapshots, asked of their relays over NATS request-reply:
//! at most [`FETCHES`] asked at once, one task per worker, each snapshot
//! decoded and applied on the blocking pool ([`threads`] at a time: half
//! the cores), in pieces of [`PIECE_BLOCKS`] blocks under the model's lock.
//!
//! Why bounded: a control plane started in front of a live fleet (a
//! deploy) needs every worker's snapshot at once. Asked all at once, the
//! answers queued behind each other, most timed out before they were read,
//! each timeout asked again, and the relays served answers nobody waited
//! for any more: 1,000 workers × 40K blocks, 202 synced after 240 s and
//! 62,058 requests (`bench-scale --restart`, docs/DECISIONS.md "A restart
//! storm"). Now a worker waits its turn; its held batches are dropped
//! meanwhile (the answer, asked later, covers them) and its timeout counts
//! from its request.
//!
//! Costs: a need is one set lookup (a worker with a task already under
//! way is served by it); a waiting worker takes the model's lock once every
//! half snapshot timeout.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::StreamExt as _;
use kvgate_core::model::snapshot::{PIECE_BLOCKS, Piece};
use kvgate_core::{App, Model};
use kvgate_protocol::pb;
use prost::Message as _;

/// Snapshots asked for (request sent, answer being read or applied) at
/// once: each is ~3.5 MB at 40K blocks, so this bounds what waits in
/// memory and lets the next transfer overlap the decoding of another.
pub(crate) const FETCHES: usize = 4;

/// Snapshot chunks decoded, and snapshots applied, at once (on the
/// blocking pool): half the cores (at least one, at most [`FETCHES`]), so
/// that a storm of resyncs leaves the other half to Picks and ingest. On 2
/// cores, one thread against two made a 1,000-worker restart storm take
/// 12 % longer and the Pick p99 during it 37–48 % lower (docs/DECISIONS.md,
/// "A restart storm").
pub(crate) fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).clamp(1, FETCHES))
}

/// Rounds one task runs back to back for its worker (a newer need came
/// while it fetched, or the batches held meanwhile did not continue the
/// snapshot) before it leaves the worker to the timeout rule.
const ROUNDS: u32 = 8;

/// The snapshot tasks of one NATS connection.
pub(crate) struct Snapshots {
    app: Arc<App>,
    client: async_nats::Client,
    fetches: tokio::sync::Semaphore,
    threads: tokio::sync::Semaphore,
    /// (model, worker) of every task under way.
    pending: Mutex<HashSet<(String, String)>>,
}

impl Snapshots {
    pub(crate) fn new(app: Arc<App>, client: async_nats::Client) -> Arc<Self> {
        Arc::new(Self {
            app,
            client,
            fetches: tokio::sync::Semaphore::new(FETCHES),
            threads: tokio::sync::Semaphore::new(threads()),
            pending: Mutex::new(HashSet::new()),
        })
    }

    /// Worker `worker` of `model` needs a snapshot: a task is started
    /// unless one is under way for it (that one then serves this need).
    pub(crate) fn need(self: &Arc<Self>, model: Arc<Model>, worker: String) {
        let fresh = self.pending().insert((model.name.clone(), worker.clone()));
        if fresh {
            tokio::spawn(self.clone().run(model, worker));
        }
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashSet<(String, String)>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One worker's task: rounds while its snapshot is still wanted. The
    /// last look and the task's removal happen under the pending set's
    /// lock, so a need raised meanwhile either finds the task (and this
    /// look sees the worker waiting) or finds it gone (and starts one).
    async fn run(self: Arc<Self>, model: Arc<Model>, worker: String) {
        for round in 0..ROUNDS {
            if round > 0 {
                tokio::time::sleep(Duration::from_millis(50 << round.min(4))).await;
            }
            self.round(&model, &worker).await;
            let mut pending = self.pending();
            if round + 1 == ROUNDS || !model.state.lock().wants_snapshot(&worker) {
                pending.remove(&(model.name.clone(), worker.clone()));
                return;
            }
        }
    }

    /// Waits for a fetch slot, asks for the snapshot and applies it.
    async fn round(&self, model: &Arc<Model>, worker: &str) {
        let timeout = Duration::from_millis(self.app.config.snapshot_timeout_ms);
        let asking = || model.state.lock().snapshot_asking(worker, self.app.now_ms());
        // While it waits its turn (in the semaphore's queue, kept across
        // the touches), the worker holds no batches and its snapshot does
        // not time out.
        let mut touch = tokio::time::interval(timeout / 2);
        let acquire = self.fetches.acquire();
        tokio::pin!(acquire);
        let slot = loop {
            tokio::select! {
                slot = &mut acquire => break slot,
                _ = touch.tick() => {
                    if !asking() {
                        return;
                    }
                }
            }
        };
        let Ok(_slot) = slot else { return };
        if !asking() {
            return;
        }
        self.app.metrics.global.snapshot_requests.inc();
        let subject = self.app.subjects.snapshot(&model.name, worker);
        match fetch(&self.client, subject, &self.app.config.replica_id, timeout, &self.threads).await {
            Ok(chunks) => {
                let Ok(_thread) = self.threads.acquire().await else { return };
                let (app, m, w) = (self.app.clone(), model.clone(), worker.to_owned());
                let applied = tokio::task::spawn_blocking(move || apply(&app, &m, &w, &chunks)).await;
                tracing::debug!(model = %model.name, %worker, again = ?applied.as_ref().map(Option::is_some), "snapshot applied");
            }
            Err(e) => {
                self.app.metrics.global.snapshot_failures.inc();
                tracing::warn!(model = %model.name, %worker, error = %e, "snapshot failed");
                model.state.lock().snapshot_failed(worker);
            }
        }
    }
}

/// Applies a worker's snapshot in pieces, each under the locks alone, with
/// Picks and ingest let in between (`kvgate_core::model::snapshot`).
/// Returns a new need when the batches held meanwhile do not continue it.
fn apply(app: &App, model: &Model, worker: &str, chunks: &[pb::SnapshotChunk]) -> Option<kvgate_core::model::Need> {
    let mut pieces = model.state.lock().begin_snapshot(worker, chunks, app.now_ms())?;
    loop {
        let piece = model.state.lock().snapshot_piece(&mut pieces, chunks, PIECE_BLOCKS);
        match piece {
            Piece::More => std::thread::yield_now(),
            Piece::Done => break,
            Piece::Abandoned => return None,
        }
    }
    model.state.lock().finish_snapshot(pieces, app.now_ms())
}

/// One snapshot chunk decoded on the blocking pool, holding one of `threads`.
async fn decode(msg: async_nats::Message, threads: &tokio::sync::Semaphore) -> Result<pb::SnapshotChunk, String> {
    let _slot = threads.acquire().await.map_err(|e| e.to_string())?;
    tokio::task::spawn_blocking(move || pb::SnapshotChunk::decode(msg.payload.as_ref()).map_err(|e| e.to_string()))
        .await
        .map_err(|e| e.to_string())?
}

/// Sends a `SnapshotRequest` and collects every chunk of the reply.
/// Each chunk is decoded on the blocking pool, holding one of `threads`.
async fn fetch(
    client: &async_nats::Client,
    subject: String,
    requester: &str,
    timeout: Duration,
    threads: &tokio::sync::Semaphore,
) -> Result<Vec<pb::SnapshotChunk>, String> {
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(inbox.clone()).await.map_err(|e| e.to_string())?;
    let req = pb::SnapshotRequest { requester: requester.to_owned(), max_chunk_bytes: 0 };
    client.publish_with_reply(subject, inbox, req.encode_to_vec().into()).await.map_err(|e| e.to_string())?;
    client.flush().await.map_err(|e| e.to_string())?;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut chunks: Vec<Option<pb::SnapshotChunk>> = Vec::new();
    let mut got = 0usize;
    loop {
        let msg = tokio::time::timeout_at(deadline, sub.next())
            .await
            .map_err(|_| format!("timed out after {} of {} chunks", got, chunks.len().max(1)))?
            .ok_or("subscription closed")?;
        // A status instead of a reply: "no responders" (no relay serves the
        // worker's snapshot subject) or another NATS status. Its empty
        // payload would decode as an empty snapshot and clear the worker's
        // blocks.
        if let Some(status) = msg.status {
            return Err(if status == async_nats::StatusCode::NO_RESPONDERS {
                "no relay answered (no responders)".to_owned()
            } else {
                format!("NATS status {status} instead of a snapshot chunk")
            });
        }
        let c = decode(msg, threads).await.map_err(|e| format!("malformed chunk: {e}"))?;
        let n = c.chunk_count.max(1) as usize;
        if chunks.is_empty() {
            chunks.resize_with(n, || None);
        }
        if n != chunks.len() || c.chunk_index as usize >= n {
            return Err("inconsistent chunk numbering".into());
        }
        let i = c.chunk_index as usize;
        if chunks[i].is_none() {
            got += 1;
        }
        chunks[i] = Some(c);
        if got == n {
            let _ = sub.unsubscribe().await;
            return Ok(chunks.into_iter().flatten().collect());
        }
    }
}
