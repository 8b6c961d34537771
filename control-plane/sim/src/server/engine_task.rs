//! The task that owns one [`Engine`]: admits submitted requests, steps
//! the engine, paces each step in simulated time (`speedup` × faster than
//! the wall clock), records what `/metrics` shows, hands tokens to their
//! requests and publishes the step's KV events (with the fault suite's
//! injected stream faults).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_vllm_wire::encode::{Encoding, encode_batch};
use kvgate_vllm_wire::{Batch, BlockRemoved, BlockStored, Event};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use zeromq::SocketSend as _;

use super::{Delta, ReplayBuffer, Shared, StreamFault, Submit, word_ids};
use crate::engine::{Engine, Output, Step};
use crate::pool::CacheEvent;

/// A request in the engine.
struct Live {
    tx: mpsc::UnboundedSender<Delta>,
    /// Arrival.
    at: Instant,
    /// Its last token.
    last: Option<Instant>,
    /// Prompt tokens.
    prompt: usize,
    /// Start of the first step that scheduled it (vLLM's `scheduled_ts`;
    /// a preemption does not move it).
    scheduled: Option<Instant>,
    /// Simulated seconds from `scheduled` to its first token, and the
    /// prompt tokens it computed (prompt less cached): observed when it
    /// finishes, as vLLM observes its request histograms.
    prefill: Option<(f64, usize)>,
}

/// The engine and what the task keeps around it.
pub(super) struct EngineTask {
    sh: Arc<Shared>,
    /// The data-parallel rank this engine is.
    rank: usize,
    engine: Engine,
    live: HashMap<u64, Live>,
    seq: u64,
    speed: f64,
    clock: tokio::time::Instant,
    buf: Arc<Mutex<ReplayBuffer>>,
    publisher: Option<zeromq::PubSocket>,
}

impl EngineTask {
    pub(super) fn new(
        sh: Arc<Shared>,
        rank: usize,
        buf: Arc<Mutex<ReplayBuffer>>,
        publisher: Option<zeromq::PubSocket>,
    ) -> Self {
        let mut engine = Engine::new(sh.opts.engine);
        engine.set_output_vocab(word_ids(&sh.opts.tokenizer));
        let speed = sh.opts.speedup.max(1e-3);
        Self {
            sh,
            rank,
            engine,
            live: HashMap::new(),
            seq: 0,
            speed,
            clock: tokio::time::Instant::now(),
            buf,
            publisher,
        }
    }

    /// Runs until every submitter is gone.
    pub(super) async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Submit>) {
        loop {
            if self.engine.is_idle() {
                let Some(s) = rx.recv().await else { break };
                self.clock = tokio::time::Instant::now();
                self.admit(s);
            }
            while let Ok(s) = rx.try_recv() {
                self.admit(s);
            }
            // Abandoned requests (client gone) are aborted, as vLLM does.
            let gone: Vec<u64> = self.live.iter().filter(|(_, l)| l.tx.is_closed()).map(|(id, _)| *id).collect();
            for id in gone {
                self.engine.abort(id);
                self.live.remove(&id);
                self.sh.ranks[self.rank].inflight.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            }
            self.engine.set_slowdown(f64::from_bits(self.sh.slowdown.load(std::sync::atomic::Ordering::Relaxed)));
            let step = self.engine.step();
            if !self.pace(&step).await {
                continue;
            }
            self.record(&step);
            if !step.events.is_empty() {
                self.publish(&step.events).await;
            }
        }
    }

    /// Queues a request; the decode side of a disaggregated one first waits
    /// for the prompt KV it does not hold to arrive (see `kv_transfer`).
    fn admit(&mut self, s: Submit) {
        if s.remote && !s.received {
            let prompt = &s.req.prompt;
            let missing = prompt.len().saturating_sub(1).saturating_sub(self.engine.cached_prefix_tokens(prompt));
            let ms = missing as f64 * self.engine.config().kv_transfer_ms_per_token.max(0.0);
            if ms > 0.0 {
                let again = self.sh.ranks[self.rank].submit.clone();
                let wait = Duration::from_secs_f64(ms / 1000.0 / self.speed);
                tokio::spawn(async move {
                    tokio::time::sleep(wait).await;
                    let _ = again.send(Submit { received: true, ..s });
                });
                return;
            }
        }
        let live = Live { tx: s.tx, at: s.at, last: None, prompt: s.req.prompt.len(), scheduled: None, prefill: None };
        self.live.insert(s.req.id, live);
        if s.remote { self.engine.submit_transferred(s.req) } else { self.engine.submit(s.req) }
    }

    /// Waits the step's simulated time; false when there was nothing to do.
    async fn pace(&mut self, step: &Step) -> bool {
        if step.ms > 0.0 {
            self.clock += Duration::from_secs_f64(step.ms / 1000.0 / self.speed);
            tokio::time::sleep_until(self.clock).await;
        } else if self.engine.is_idle() {
            return false;
        } else {
            // Nothing could run (out of blocks with nothing to preempt):
            // wait for a change rather than spin.
            tokio::time::sleep(Duration::from_millis(1)).await;
            self.clock = tokio::time::Instant::now();
        }
        true
    }

    /// Latencies, tokens to their requests, and the engine's gauges.
    fn record(&mut self, step: &Step) {
        let now = Instant::now();
        let speed = self.speed;
        let rank = &self.sh.ranks[self.rank];
        let mut st = rank.stats.lock();
        // vLLM's queue time ends when a step schedules the request, at the
        // start of the step that just ended.
        let began = now.checked_sub(Duration::from_secs_f64(step.ms.max(0.0) / 1000.0 / speed)).unwrap_or(now);
        for id in &step.admitted {
            if let Some(l) = self.live.get_mut(id)
                && l.scheduled.is_none()
            {
                st.queue.observe(began.saturating_duration_since(l.at).as_secs_f64() * speed);
                l.scheduled = Some(began);
            }
        }
        for out in &step.outputs {
            match *out {
                Output::Token { id, index, cached_tokens, .. } => {
                    if let Some(l) = self.live.get_mut(&id) {
                        if index == 0 {
                            st.ttft.observe(now.duration_since(l.at).as_secs_f64() * speed);
                            let scheduled = l.scheduled.unwrap_or(began);
                            let prefill_s = now.duration_since(scheduled).as_secs_f64() * speed;
                            l.prefill = Some((prefill_s, l.prompt.saturating_sub(cached_tokens)));
                        } else if let Some(last) = l.last {
                            st.itl.observe(now.duration_since(last).as_secs_f64() * speed);
                        }
                        l.last = Some(now);
                        st.generation_tokens += 1;
                        let _ = l.tx.send(Delta::Token { index, cached: cached_tokens });
                    }
                }
                Output::Finished { id } => {
                    if let Some(l) = self.live.remove(&id) {
                        rank.inflight.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                        st.success += 1;
                        if let Some((seconds, computed)) = l.prefill {
                            st.prefill.observe(seconds);
                            st.prefill_computed.observe(computed as f64);
                        }
                        let _ = l.tx.send(Delta::Done);
                    }
                }
            }
        }
        let e = &self.engine;
        st.running = e.num_running();
        st.waiting = e.num_waiting();
        st.kv_usage = e.pool().usage();
        if step.decode_tokens > 0 {
            st.decode_context_tokens = step.decode_context_tokens;
        }
        st.queries = e.pool().queries_tokens;
        st.hits = e.pool().hits_tokens;
        st.host_hits = e.pool().host_hits_tokens;
        st.steps += 1;
        st.cached_blocks = e.pool().cached_copies().count();
    }

    /// One batch on the PUB socket and in the replay buffer, with the
    /// faults queued for it.
    async fn publish(&mut self, events: &[CacheEvent]) {
        let opts = &self.sh.opts;
        let payload = encode_events(events, opts.engine.block_size as u32, opts.encoding, self.rank);
        {
            let mut b = self.buf.lock();
            b.push_back((self.seq, payload.clone()));
            while b.len() > opts.replay_buffer {
                b.pop_front();
            }
        }
        let faults = std::mem::take(&mut *self.sh.faults.lock());
        if faults.contains(&StreamFault::Gap) {
            // The engine's buffer moved on: what it held is gone.
            self.seq += opts.replay_buffer as u64 + 10;
            let mut b = self.buf.lock();
            b.clear();
            b.push_back((self.seq, payload.clone()));
        }
        if let Some(p) = self.publisher.as_mut() {
            if faults.contains(&StreamFault::Garbage) {
                let one = zeromq::ZmqMessage::from(opts.topic.as_bytes().to_vec());
                let _ = p.send(one).await;
                let mut bad = zeromq::ZmqMessage::from(opts.topic.as_bytes().to_vec());
                bad.push_back(b"bad".to_vec().into());
                bad.push_back(vec![0xc1].into());
                let _ = p.send(bad).await;
            }
            let mut m = zeromq::ZmqMessage::from(opts.topic.as_bytes().to_vec());
            m.push_back(self.seq.to_be_bytes().to_vec().into());
            m.push_back(payload.into());
            if faults.contains(&StreamFault::Duplicate) {
                let _ = p.send(m.clone()).await;
            }
            let _ = p.send(m).await;
        }
        self.seq += 1;
        self.sh.ranks[self.rank].stats.lock().events_published += 1;
    }
}

/// One engine step's cache events as a vLLM msgpack batch.
fn encode_events(events: &[CacheEvent], block_size: u32, encoding: Encoding, rank: usize) -> Vec<u8> {
    let stored = |hashes: &[u64], parent: &Option<u64>, tokens: &[u32], medium| {
        Event::Stored(BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: *parent,
            token_ids: tokens.to_vec(),
            block_size,
            medium: Some(medium),
            ..Default::default()
        })
    };
    let removed = |hashes: &[u64], medium| {
        Event::Removed(BlockRemoved { block_hashes: hashes.to_vec(), medium: Some(medium), ..Default::default() })
    };
    // vLLM's CPU offloading connector publishes host blocks as medium "CPU".
    let events: Vec<Event<'_>> = events
        .iter()
        .map(|e| match e {
            CacheEvent::Stored { hashes, parent, tokens } => stored(hashes, parent, tokens, "GPU"),
            CacheEvent::Removed { hashes } => removed(hashes, "GPU"),
            CacheEvent::HostStored { hashes, parent, tokens } => stored(hashes, parent, tokens, "CPU"),
            CacheEvent::HostRemoved { hashes } => removed(hashes, "CPU"),
        })
        .collect();
    let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    encode_batch(&Batch { ts, dp_rank: Some(rank as i64), array_len: 3, events }, encoding)
}
