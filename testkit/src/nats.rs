//! A blocking NATS client for tests, over `async-nats` on a one-thread
//! runtime of its own: subscribe with a label, publish, request-reply,
//! a flush that is a real round trip to the server, and the next message
//! with a timeout.

use std::time::Duration;

use anyhow::{Context, Result};
use futures_util::StreamExt as _;
use tokio::sync::mpsc;

/// A message received by [`NatsClient`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsMsg {
    /// The subject it was published on.
    pub subject: String,
    /// The label of the subscription it arrived for.
    pub sid: String,
    /// Reply subject, if any.
    pub reply: Option<String>,
    /// Payload bytes.
    pub payload: Vec<u8>,
}

/// The client. Messages of every subscription arrive in one queue, in
/// order per subscription.
pub struct NatsClient {
    rt: tokio::runtime::Runtime,
    client: async_nats::Client,
    tx: mpsc::UnboundedSender<NatsMsg>,
    rx: mpsc::UnboundedReceiver<NatsMsg>,
    /// Messages that arrived during a flush, before the rest.
    pending: std::collections::VecDeque<NatsMsg>,
    /// This client's own subject for flush round trips.
    ping: String,
    pings: u64,
}

const PING_SID: &str = "\0ping";

impl NatsClient {
    /// Connects to the server on 127.0.0.1:`port`.
    pub fn connect(port: u16) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let client = rt
            .block_on(async_nats::ConnectOptions::new().name("kvgate-testkit").connect(format!("127.0.0.1:{port}")))
            .with_context(|| format!("connecting to NATS on port {port}"))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let ping = format!("_kvgate_testkit.ping.{}", client.new_inbox().replace('.', "_"));
        let mut c = Self { rt, client, tx, rx, pending: Default::default(), ping: ping.clone(), pings: 0 };
        c.subscribe(&ping, PING_SID)?;
        Ok(c)
    }

    /// Subscribes `sid` (a label carried by its messages) to `subject`
    /// (wildcards allowed). A subject the client library refuses (spaces,
    /// empty tokens) is an error.
    pub fn subscribe(&mut self, subject: &str, sid: &str) -> Result<()> {
        let mut sub = self.rt.block_on(self.client.subscribe(subject.to_owned()))?;
        let (tx, sid) = (self.tx.clone(), sid.to_owned());
        self.rt.spawn(async move {
            while let Some(m) = sub.next().await {
                // The server's own status messages (503 "no responders" to
                // a request nobody subscribes to yet) are not messages of
                // the subject: a test retries its request instead.
                if m.status.is_some() {
                    continue;
                }
                let msg = NatsMsg {
                    subject: m.subject.to_string(),
                    sid: sid.clone(),
                    reply: m.reply.map(|r| r.to_string()),
                    payload: m.payload.to_vec(),
                };
                if tx.send(msg).is_err() {
                    break;
                }
            }
        });
        Ok(())
    }

    /// Publishes `payload` on `subject`.
    pub fn publish(&mut self, subject: &str, payload: &[u8]) -> Result<()> {
        let p = bytes::Bytes::copy_from_slice(payload);
        Ok(self.rt.block_on(self.client.publish(subject.to_owned(), p))?)
    }

    /// Publishes `payload` on `subject` with a reply subject (request-reply).
    pub fn request(&mut self, subject: &str, reply: &str, payload: &[u8]) -> Result<()> {
        let p = bytes::Bytes::copy_from_slice(payload);
        Ok(self.rt.block_on(self.client.publish_with_reply(subject.to_owned(), reply.to_owned(), p))?)
    }

    /// A round trip to the server: everything sent before (subscriptions,
    /// publications) has been processed when it returns. Messages that
    /// arrive meanwhile stay queued for [`NatsClient::next_msg`].
    pub fn flush(&mut self) -> Result<()> {
        self.pings += 1;
        let token = self.pings.to_string();
        let (ping, p) = (self.ping.clone(), bytes::Bytes::from(token.clone()));
        self.rt.block_on(async { self.client.publish(ping, p).await.map(|_| ()) })?;
        loop {
            match recv(&self.rt, &mut self.rx, Duration::from_secs(10)) {
                Ok(Some(m)) if m.sid == PING_SID && m.payload == token.as_bytes() => return Ok(()),
                Ok(Some(m)) if m.sid == PING_SID => {}
                Ok(Some(m)) => self.pending.push_back(m),
                Ok(None) => anyhow::bail!("NATS connection closed"),
                Err(_) => anyhow::bail!("no answer from NATS within 10 s"),
            }
        }
    }

    /// The next message, or `None` when none arrives within `timeout`.
    pub fn next_msg(&mut self, timeout: Duration) -> Result<Option<NatsMsg>> {
        if let Some(m) = self.pending.pop_front() {
            return Ok(Some(m));
        }
        loop {
            match recv(&self.rt, &mut self.rx, timeout) {
                Ok(Some(m)) if m.sid == PING_SID => continue,
                Ok(Some(m)) => return Ok(Some(m)),
                Ok(None) => anyhow::bail!("NATS connection closed"),
                Err(_) => return Ok(None),
            }
        }
    }
}

/// The next message of the queue within `timeout` (`Err` on timeout).
fn recv(
    rt: &tokio::runtime::Runtime,
    rx: &mut mpsc::UnboundedReceiver<NatsMsg>,
    timeout: Duration,
) -> Result<Option<NatsMsg>, tokio::time::error::Elapsed> {
    rt.block_on(async move { tokio::time::timeout(timeout, rx.recv()).await })
}
