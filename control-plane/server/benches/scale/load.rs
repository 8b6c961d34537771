//! The requests (four mixes, and the transport's floor) and the open-loop
//! gRPC client.
//!
//! | mix | request | the fleet holds |
//! |---|---|---|
//! | `doks_new_turn` | one of 200 conversations (a ~3,750-token starter of 10, a question) plus a new assistant reply and user question | each conversation on one worker, its starter on a tenth of the workers |
//! | `doc_question` | one of 3 100K-token documents and a new question | each document on a seventh of the workers |
//! | `cold_8k` | an 8K-token system prompt never seen (a unique first line) | nothing of it |
//! | `cold_100k` | a 100K-token document never seen | nothing of it |
//! | `grpc_floor` | no Pick: `grpc.health.v1.Health/Check` on the same connections | – |
//!
//! `grpc_floor` times the smallest call the control plane answers, over
//! the same client, channels, server and machine as the Picks: what a Pick's
//! latency would be if routing took no time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_bench_support::Samples;
use kvgate_protocol::pb;
use kvgate_server::router_client::RouterClient;
use serde_json::{Value, json};
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use crate::MODEL;

fn words(seed: u64, n: usize) -> String {
    kvgate_bench_support::words(seed, n)
}

/// A text of about `tokens` tokens under this tokenizer.
fn text_of(tk: &kvgate_tokenize::ChatTokenizer, tokens: usize, seed: u64) -> String {
    let mut n_words = tokens;
    loop {
        let t = words(seed, n_words);
        let n = tk.encode_chat(&[json!({"role": "system", "content": t})], true).map(|v| v.len()).unwrap_or(0);
        if n.abs_diff(tokens) * 50 <= tokens || n == 0 {
            return t;
        }
        n_words = (n_words as f64 * tokens as f64 / n as f64).max(1.0) as usize;
    }
}

/// The request mixes, built once: each request is a base (its segments
/// serialized and hashed once) plus new messages, as the filter would send
/// it without eliding.
pub(crate) struct Mixes {
    /// Conversations (a starter and one question): their messages.
    pub(crate) conversations: Vec<Vec<Value>>,
    /// 100K-token documents.
    pub(crate) documents: Vec<String>,
    bases: std::collections::HashMap<(&'static str, usize), Vec<pb::Segment>>,
    /// Chain hashes the control plane said it retains (as the filter's
    /// retained table).
    retained: std::sync::Mutex<std::collections::HashSet<u64>>,
    cold_8k: String,
    cold_100k: String,
}

fn segments(messages: &[Value]) -> Vec<pb::Segment> {
    kvgate_server::chat_pick_request(MODEL, "", messages, None).segments
}

impl Mixes {
    /// Builds the texts (tokenizing to size them); the DOKS conversations
    /// start from `system_prompts` system prompts.
    pub(crate) fn new(tk: &kvgate_tokenize::ChatTokenizer, system_prompts: usize) -> Self {
        let starters: Vec<String> = (0..system_prompts.max(1) as u64).map(|s| text_of(tk, 3750, 100 + s)).collect();
        let conversations: Vec<Vec<Value>> = (0..200u64)
            .map(|c| {
                vec![
                    json!({"role": "system", "content": starters[(c % starters.len() as u64) as usize]}),
                    json!({"role": "user", "content": words(7000 + c, 40)}),
                ]
            })
            .collect();
        let documents: Vec<String> = (0..3).map(|d| text_of(tk, 100_000, 500 + d)).collect();
        let mut bases = std::collections::HashMap::new();
        for (c, m) in conversations.iter().enumerate() {
            bases.insert(("doks_new_turn", c), segments(m));
        }
        for (d, text) in documents.iter().enumerate() {
            bases.insert(("doc_question", d), segments(&[json!({"role": "system", "content": text})]));
        }
        Self {
            conversations,
            documents,
            bases,
            retained: Default::default(),
            cold_8k: text_of(tk, 8192, 900),
            cold_100k: text_of(tk, 100_000, 901),
        }
    }

    /// Records what an answer says the control plane retains.
    pub(crate) fn retain(&self, hashes: &[u64]) {
        if let Ok(mut r) = self.retained.lock() {
            r.extend(hashes);
        }
    }

    /// The chain hashes `req` elides (what a `resend` answer names).
    pub(crate) fn elided(req: &pb::PickRequest) -> Vec<u64> {
        req.segments.iter().filter(|s| s.elided).map(|s| s.chain_hash).collect()
    }

    /// Forgets what a `resend` answer said the control plane does not hold
    /// (the elided segments' chain hashes), as the filter does.
    pub(crate) fn forget(&self, elided: &[u64]) {
        if let Ok(mut r) = self.retained.lock() {
            for h in elided {
                r.remove(h);
            }
        }
    }

    /// Forgets everything retained: a new control plane holds nothing yet.
    /// Without it, a run's second fleet inherited the first one's table,
    /// and the same requests (the same ids in every phase) went elided to
    /// a control plane that had never seen them: every one answered
    /// `resend` and came again whole.
    pub(crate) fn forget_retained(&self) {
        if let Ok(mut r) = self.retained.lock() {
            r.clear();
        }
    }

    /// What a gateway's hash-based balancing would key the `i`-th request
    /// of `mix` on (its conversation or document; a cold request is its
    /// own), so that requests sharing messages reach the same replica.
    pub(crate) fn affinity(&self, mix: &str, i: u64) -> u64 {
        match mix {
            "doks_new_turn" => i % self.conversations.len() as u64,
            "doc_question" => i % self.documents.len() as u64,
            _ => i,
        }
    }

    /// A Pick request of `mix`, the `i`-th, sent whole.
    pub(crate) fn request(&self, mix: &str, i: u64) -> pb::PickRequest {
        self.build(mix, i, false)
    }

    /// The request as the filter sends it (`elide`): the leading messages up
    /// to the last one whose chain hash the control plane said it retains go
    /// as their chain hashes only (`Segment.elided`). A control plane that
    /// no longer holds them answers `resend`.
    pub(crate) fn build(&self, mix: &str, i: u64, elide: bool) -> pb::PickRequest {
        let q = json!({"role": "user", "content": words(i ^ 0xdef, 30)});
        let (mut segs, new): (Vec<pb::Segment>, Vec<Value>) = match mix {
            "doks_new_turn" => {
                let c = (i % self.conversations.len() as u64) as usize;
                let a = json!({"role": "assistant", "content": words(i ^ 0xabc, 50)});
                (self.bases[&("doks_new_turn", c)].clone(), vec![a, q])
            }
            "doc_question" => {
                (self.bases[&("doc_question", (i % self.documents.len() as u64) as usize)].clone(), vec![q])
            }
            "cold_8k" => {
                let s = json!({"role": "system", "content": format!("[session {i}] {}", self.cold_8k)});
                (Vec::new(), vec![s, q])
            }
            _ => {
                let s = json!({"role": "system", "content": format!("[document {i}] {}", self.cold_100k)});
                (Vec::new(), vec![s, q])
            }
        };
        let mut h = kvgate_protocol::SegmentHash(segs.last().map_or(0, |s| s.chain_hash));
        for m in new {
            let bytes = serde_json::to_vec(&m).unwrap_or_default();
            h = h.chain(&bytes);
            segs.push(pb::Segment { chain_hash: h.0, role: String::new(), message_json: bytes, elided: false });
        }
        if elide && let Ok(r) = self.retained.lock() {
            let upto = segs.iter().rposition(|s| r.contains(&s.chain_hash)).map_or(0, |i| i + 1);
            for s in &mut segs[..upto] {
                s.message_json = Vec::new();
                s.elided = true;
            }
        }
        pb::PickRequest {
            request_id: format!("{mix}-{i}"),
            model: MODEL.into(),
            api: pb::ApiKind::ChatCompletions as i32,
            segments: segs,
            max_tokens: Some(256),
            stream: true,
            ..Default::default()
        }
    }
}

/// What one open-loop step measured.
pub(crate) struct Step {
    /// Picks answered.
    pub(crate) answered: u64,
    /// Picks that failed (gRPC error) or were not sent (too many waiting).
    pub(crate) failed: u64,
    /// Picks answered `resend` (the elided messages not held) and sent
    /// again whole.
    pub(crate) resent: u64,
    /// Latency from the scheduled send time, µs.
    pub(crate) latency: Samples,
    /// Wall time of the step.
    pub(crate) secs: f64,
}

/// The mix that sends no Pick: a health check, the transport's floor.
pub(crate) const FLOOR: &str = "grpc_floor";

/// One control-plane replica as the client sees it: its gRPC channels (a
/// Router and a Health client on each connection) and its completion
/// reporter.
pub(crate) struct Replica {
    pub(crate) channels: Vec<RouterClient<Channel>>,
    health: Vec<HealthClient<Channel>>,
    pub(crate) ends: Ends,
}

impl Replica {
    /// Four connections to the replica's gRPC address; the requests it
    /// routes are reported finished `request_secs` after their Picks.
    pub(crate) async fn connect(grpc: std::net::SocketAddr, request_secs: f64) -> Self {
        let (mut channels, mut health) = (Vec::new(), Vec::new());
        for _ in 0..4 {
            let ch = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
                .expect("endpoint")
                .connect()
                .await
                .expect("gRPC");
            channels.push(RouterClient::new(ch.clone()));
            health.push(HealthClient::new(ch));
        }
        let ends = Ends::spawn(channels[0].clone(), Duration::from_secs_f64(request_secs));
        Self { channels, health, ends }
    }
}

/// Sends `rate` Picks per second of `mix` for `secs`, open loop: request k
/// is sent at k / rate whether or not earlier ones were answered, to the
/// replica its conversation hashes to (as the gateway's ring hash does). At
/// most `max_outstanding` in flight; beyond, a request is counted as failed
/// and not sent.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn open_loop(
    replicas: &[Replica],
    mixes: Arc<Mixes>,
    mix: &'static str,
    rate: f64,
    secs: f64,
    first_id: u64,
    elide: bool,
) -> Step {
    let max_outstanding = 512usize;
    let start = Instant::now();
    let n = (rate * secs).round() as u64;
    let mut js: tokio::task::JoinSet<Option<f64>> = tokio::task::JoinSet::new();
    let (mut latency, mut answered, mut failed) = (Samples::new(), 0u64, 0u64);
    let mut refused = 0u64;
    let resent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut record = |r: Result<Option<f64>, tokio::task::JoinError>| match r {
        Ok(Some(us)) => {
            latency.record(us);
            answered += 1;
        }
        _ => failed += 1,
    };
    for k in 0..n {
        let due = start + Duration::from_secs_f64(k as f64 / rate);
        tokio::time::sleep_until(due.into()).await;
        while let Some(r) = js.try_join_next() {
            record(r);
        }
        if js.len() >= max_outstanding {
            refused += 1;
            continue;
        }
        let replica = &replicas[(mixes.affinity(mix, first_id + k) % replicas.len() as u64) as usize];
        if mix == FLOOR {
            let mut h = replica.health[(k % replica.health.len() as u64) as usize].clone();
            let sent = Instant::now();
            js.spawn(async move {
                h.check(HealthCheckRequest { service: String::new() }).await.ok()?;
                Some(sent.elapsed().as_secs_f64() * 1e6)
            });
            continue;
        }
        let mut c = replica.channels[(k % replica.channels.len() as u64) as usize].clone();
        let req = mixes.build(mix, first_id + k, elide);
        let mixes = mixes.clone();
        // Sends never wait for answers, so the client does not hold back a
        // slow server (no coordinated omission); the latency counts from
        // the send, not from the timer's tick (1 ms granularity).
        let sent = Instant::now();
        let ends = replica.ends.clone();
        let elided = Mixes::elided(&req);
        let resent = resent.clone();
        js.spawn(async move {
            let id = req.request_id.clone();
            let mut answer = c.pick(req).await.ok()?.into_inner();
            if answer.resend {
                // Not held (evicted, or never seen): once more, whole.
                mixes.forget(&elided);
                resent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                answer = c.pick(mixes.build(mix, first_id + k, false)).await.ok()?.into_inner();
            }
            mixes.retain(&answer.retained_chain_hashes);
            let us = sent.elapsed().as_secs_f64() * 1e6;
            if answer.endpoint.is_empty() {
                return None;
            }
            ends.ended(id, answer.worker_id, answer.endpoint);
            Some(us)
        });
    }
    while let Some(r) = js.join_next().await {
        record(r);
    }
    let resent = resent.load(std::sync::atomic::Ordering::Relaxed);
    Step { answered, failed: failed + refused, resent, latency, secs: start.elapsed().as_secs_f64() }
}

/// Decision agreement between replicas `a` and `b` over `n` DOKS new
/// turns: the same messages (two request ids) sent to both, and each
/// answer reported finished at once. `concurrent`: both at the same
/// moment (the race a gateway's two Envoy threads make); otherwise one
/// after the other, 150 ms apart, so that the second replica has seen the
/// first decision and its end (their views converged). With `a == b` it
/// measures one replica against itself under the same schedule. Ties are
/// broken at random, so even one replica need not repeat a worker; equal
/// `matched_blocks` says the two chose an equally cached worker.
pub(crate) async fn agreement(
    replicas: &[Replica],
    (a, b): (usize, usize),
    concurrent: bool,
    mixes: &Mixes,
    n: u64,
    first_id: u64,
) -> Agreement {
    let mut out = Agreement::default();
    for k in 0..n {
        let i = first_id + k;
        let mut ra = mixes.request("doks_new_turn", i);
        let mut rb = ra.clone();
        ra.request_id.push_str("-a");
        rb.request_id.push_str("-b");
        let (ida, idb) = (ra.request_id.clone(), rb.request_id.clone());
        let mut ca = replicas[a].channels[0].clone();
        let mut cb = replicas[b].channels[1 % replicas[b].channels.len()].clone();
        // Every answered Pick is reported finished at once (none stays in flight).
        let end = |r: usize, id: &str, x: &Result<tonic::Response<pb::PickResponse>, tonic::Status>| {
            if let Ok(x) = x {
                replicas[r].ends.ended_now(id.to_owned(), x.get_ref().worker_id.clone(), x.get_ref().endpoint.clone());
            }
        };
        let (x, y) = if concurrent {
            tokio::join!(ca.pick(ra), cb.pick(rb))
        } else {
            let x = ca.pick(ra).await;
            end(a, &ida, &x);
            tokio::time::sleep(Duration::from_millis(150)).await;
            (x, cb.pick(rb).await)
        };
        if concurrent {
            end(a, &ida, &x);
        }
        end(b, &idb, &y);
        if let (Ok(x), Ok(y)) = (x, y) {
            let (x, y) = (x.get_ref(), y.get_ref());
            out.pairs += 1;
            out.same_worker += u64::from(x.worker_id == y.worker_id);
            out.same_matched += u64::from(x.matched_blocks == y.matched_blocks);
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    out
}

/// What [`agreement`] counted.
#[derive(Default, Debug)]
pub(crate) struct Agreement {
    /// Pairs both answered.
    pub(crate) pairs: u64,
    /// Pairs that chose the same worker.
    pub(crate) same_worker: u64,
    /// Pairs whose workers held the same number of the prompt's blocks.
    pub(crate) same_matched: u64,
}

/// The first tokens and ends of the requests routed: each request's first
/// token is reported [`FIRST_TOKEN`] after its Pick (or at its end, if
/// sooner) and its end `duration` after it, as the filter reports a
/// streamed request, in batches, so that the control plane holds a
/// realistic number of requests in flight, most of them decoding.
#[derive(Clone)]
pub(crate) struct Ends(tokio::sync::mpsc::UnboundedSender<(Instant, pb::CompletionReport)>, Duration);

/// When a routed request's first token is reported, after its Pick.
const FIRST_TOKEN: Duration = Duration::from_millis(200);

impl Ends {
    /// Starts the reporting task on `client`.
    fn spawn(client: RouterClient<Channel>, duration: Duration) -> Self {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, pb::CompletionReport)>();
        let first_after = FIRST_TOKEN.min(duration);
        tokio::spawn(async move {
            let mut c = client;
            // Each queue is due in order: the same delay after each Pick.
            let mut firsts: std::collections::VecDeque<(Instant, pb::CompletionReport)> = Default::default();
            let mut due: std::collections::VecDeque<(Instant, pb::CompletionReport)> = Default::default();
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            loop {
                tokio::select! {
                    m = rx.recv() => match m {
                        Some((t, r)) => {
                            let first = pb::CompletionReport { total_us: 0, ..r.clone() };
                            firsts.push_back((t + first_after, first));
                            due.push_back((t + duration, r));
                        }
                        None => return,
                    },
                    _ = tick.tick() => {
                        let now = Instant::now();
                        let mut batch = Vec::new();
                        for q in [&mut firsts, &mut due] {
                            while q.front().is_some_and(|(t, _)| *t <= now) && batch.len() < 1000 {
                                if let Some((_, r)) = q.pop_front() {
                                    batch.push(r);
                                }
                            }
                        }
                        if !batch.is_empty() {
                            let b = pb::CompletionReportBatch { reporter_id: "bench-scale".into(), reports: batch };
                            let _ = c.report(b).await;
                        }
                    }
                }
            }
        });
        Self(tx, duration)
    }

    fn ended(&self, request_id: String, worker_id: String, endpoint: String) {
        self.end_at(Instant::now(), request_id, worker_id, endpoint);
    }

    /// Reported with the next batch, not after the usual duration.
    pub(crate) fn ended_now(&self, request_id: String, worker_id: String, endpoint: String) {
        let back = Instant::now().checked_sub(self.1).unwrap_or_else(Instant::now);
        self.end_at(back, request_id, worker_id, endpoint);
    }

    fn end_at(&self, picked: Instant, request_id: String, worker_id: String, endpoint: String) {
        let r = pb::CompletionReport {
            request_id,
            model: MODEL.into(),
            worker_id,
            served_endpoint: endpoint.clone(),
            endpoint,
            status_code: 200,
            ttfb_us: u64::try_from(FIRST_TOKEN.as_micros()).unwrap_or(u64::MAX),
            total_us: 2_000_000,
            stream: true,
            ..Default::default()
        };
        let _ = self.0.send((picked, r));
    }
}
