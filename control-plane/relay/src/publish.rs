//! The relay's NATS side: one task owns the client and publishes what the
//! relay loop hands it through a bounded queue, so that the loop never
//! waits on NATS (a slow or absent server cannot stall the ZMQ socket, the
//! health probe or the heartbeats).
//!
//! * The queue holds [`Publisher::new`]'s `capacity` messages. When it is
//!   full (NATS down for long) the new message is dropped and counted:
//!   consumers see a gap in `relay_seq` and repair it with a snapshot.
//! * A publish that fails is retried with backoff (bounded), then dropped
//!   and counted; the task never ends on an error.
//! * The client itself connects in the background and reconnects forever
//!   (`retry_on_initial_connect`), so the relay starts without NATS.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;

/// One message for NATS.
#[derive(Debug)]
pub struct Outgoing {
    /// Subject.
    pub subject: String,
    /// Payload.
    pub payload: Bytes,
}

/// Counters shared with the relay loop.
#[derive(Debug, Default)]
pub struct PublishCounters {
    /// Publishes that failed after retries.
    pub errors: AtomicU64,
    /// Messages dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Messages published.
    pub published: AtomicU64,
}

/// The sending side, held by the relay loop.
#[derive(Debug, Clone)]
pub struct Publisher {
    tx: tokio::sync::mpsc::Sender<Outgoing>,
    counters: Arc<PublishCounters>,
}

/// How many times a failed publish is tried again before it is dropped.
const RETRIES: u32 = 5;

impl Publisher {
    /// Starts the publishing task on the current runtime.
    pub fn new(client: async_nats::Client, capacity: usize) -> Self {
        let (tx, rx) = tokio::sync::mpsc::channel(capacity.max(1));
        let counters = Arc::new(PublishCounters::default());
        tokio::spawn(run(client, rx, counters.clone()));
        Self { tx, counters }
    }

    /// Queues a message; never waits. Returns false (and counts) when the
    /// queue is full or the task is gone.
    pub fn send(&self, subject: String, payload: Vec<u8>) -> bool {
        match self.tx.try_send(Outgoing { subject, payload: payload.into() }) {
            Ok(()) => true,
            Err(_) => {
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Messages waiting.
    pub fn queued(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }

    /// The counters.
    pub fn counters(&self) -> &PublishCounters {
        &self.counters
    }
}

async fn run(client: async_nats::Client, mut rx: tokio::sync::mpsc::Receiver<Outgoing>, c: Arc<PublishCounters>) {
    while let Some(msg) = rx.recv().await {
        let mut backoff = Duration::from_millis(50);
        let mut attempt = 0;
        loop {
            match client.publish(msg.subject.clone(), msg.payload.clone()).await {
                Ok(()) => {
                    c.published.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                // Too large for the server: retrying cannot help. (The relay
                // splits batches under the server's limit; a lower limit
                // announced later lands here once.)
                Err(e) if matches!(e.kind(), async_nats::client::PublishErrorKind::MaxPayloadExceeded) => {
                    tracing::error!(subject = %msg.subject, bytes = msg.payload.len(), error = %e, "publish refused: over the server's max payload; dropped");
                    c.errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(e) if attempt < RETRIES => {
                    tracing::warn!(subject = %msg.subject, error = %e, attempt, "publish failed; retrying");
                    attempt += 1;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    tracing::error!(subject = %msg.subject, error = %e, "publish failed; dropped");
                    c.errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
    }
}
