//! The shared application state and the request paths that do not touch the
//! network: Pick, Report, NATS message dispatch, snapshots applied,
//! metrics rendering. The network side lives in [`crate::server`].

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvgate_protocol::BlockSeed;
use kvgate_protocol::pb;
use kvgate_protocol::subject::{SubjectKind, Subjects};
use parking_lot::Mutex;
use prost::Message as _;
use tonic::Status;

use crate::config::Config;
use crate::metrics::{self, Global, Histogram, LATENCY_BUCKETS, NATS_KINDS, PICK_ERRORS, RATIO_BUCKETS, label};
use crate::model::{ByLoad, ModelState, Need, PickInput};
use crate::tokens::{PromptTokenizer, SegmentRef, TokenCacheConfig, Tokenized};

/// One served model.
pub struct Model {
    /// Its name.
    pub name: String,
    /// Routing state.
    pub state: Mutex<ModelState>,
    /// Tokenizer, when configured.
    pub tokenizer: Option<PromptTokenizer>,
    /// Pick latency (seconds), from request receipt to answer.
    pub pick_seconds: Histogram,
    /// Predicted overlap / prompt blocks of answered picks.
    pub overlap_ratio: Histogram,
}

/// Everything the handlers share.
pub struct App {
    /// Validated configuration.
    pub config: Config,
    /// Models by name.
    pub models: HashMap<String, Arc<Model>>,
    /// Subjects of the namespace.
    pub subjects: Subjects,
    /// Process-wide counters.
    pub global: Global,
    /// The endpoint picker's counters.
    pub epp: crate::epp::EppCounters,
    start: Instant,
    /// Replica-sync events to publish (model, event).
    pub inflight_tx: tokio::sync::mpsc::UnboundedSender<(String, pb::InflightEvent)>,
    /// NATS connection state, set by the NATS task.
    pub nats_connected: std::sync::atomic::AtomicBool,
    /// Since when NATS has been down (liveness frozen), if it is.
    nats_down_since: Mutex<Option<u64>>,
    /// NATS has been connected at least once.
    nats_was_up: std::sync::atomic::AtomicBool,
    ids: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App").field("replica", &self.config.replica_id).finish()
    }
}

/// Why the application could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A model's tokenizer did not load.
    #[error("model {model}: {source}")]
    Tokenizer {
        /// The model.
        model: String,
        /// The error.
        source: kvgate_tokenize::TokenizeError,
    },
}

/// The receiving end of the replica-sync queue: (model, event).
pub type InflightRx = tokio::sync::mpsc::UnboundedReceiver<(String, pb::InflightEvent)>;

fn status(code: tonic::Code, msg: impl Into<String>) -> Status {
    Status::new(code, msg)
}

impl App {
    /// Loads every model (tokenizers, self-tests). Returns the app and the
    /// receiving end of the replica-sync queue.
    pub fn new(config: Config) -> Result<(Arc<Self>, InflightRx), StartError> {
        let mut models = HashMap::new();
        for (i, m) in config.models.iter().enumerate() {
            let tokenizer = match &m.tokenizer_dir {
                Some(dir) => Some(
                    PromptTokenizer::from_dir(
                        dir,
                        TokenCacheConfig {
                            budget_tokens: config.token_cache_tokens,
                            verify_every: config.tokenize_verify_every,
                        },
                    )
                    .map_err(|source| StartError::Tokenizer { model: m.routing.name.clone(), source })?,
                ),
                None => None,
            };
            if let Some(t) = &tokenizer {
                tracing::info!(
                    model = %m.routing.name,
                    self_test = t.self_test_result(),
                    fast_encoder = t.inner().uses_fast_encoder(),
                    paragraphs = t.inner().encodes_by_paragraph(),
                    "tokenizer loaded"
                );
            }
            models.insert(
                m.routing.name.clone(),
                Arc::new(Model {
                    name: m.routing.name.clone(),
                    state: Mutex::new(ModelState::new(m.routing.clone(), 0x6b76_6761_7465 ^ i as u64)),
                    tokenizer,
                    pick_seconds: Histogram::new(LATENCY_BUCKETS),
                    overlap_ratio: Histogram::new(RATIO_BUCKETS),
                }),
            );
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let subjects = Subjects::new(&config.subject_prefix).unwrap_or_default();
        Ok((
            Arc::new(Self {
                config,
                models,
                subjects,
                global: Global::default(),
                epp: Default::default(),
                start: Instant::now(),
                inflight_tx: tx,
                nats_connected: std::sync::atomic::AtomicBool::new(false),
                nats_down_since: Mutex::new(None),
                nats_was_up: std::sync::atomic::AtomicBool::new(false),
                ids: std::sync::atomic::AtomicU64::new(0),
            }),
            rx,
        ))
    }

    /// Milliseconds since start (monotonic).
    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Records a gRPC status (0 = OK).
    pub fn count_status(&self, code: tonic::Code) {
        if let Some(c) = self.global.grpc_status.get(code as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn pick_error(&self, i: usize) {
        if let Some(c) = self.global.pick_errors.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Validates, tokenizes and routes one request.
    pub fn pick(&self, req: &pb::PickRequest) -> Result<pb::PickResponse, Status> {
        self.pick_among(req, None)
    }

    /// Routes a request without a prompt to score (an endpoint picker saw
    /// no body, or one kvgate does not route by prefix) to the least loaded
    /// live worker of `model` among `allowed` (all when `None`).
    pub fn pick_by_load(
        &self,
        model: &str,
        request_id: &str,
        allowed: Option<&[String]>,
    ) -> Result<pb::PickResponse, Status> {
        let Some(m) = self.models.get(model) else {
            self.pick_error(0);
            return Err(status(tonic::Code::NotFound, format!("unknown model {model:?}")));
        };
        let input = PickInput {
            request_id,
            token_ids: &[],
            seed: BlockSeed::new(None, None),
            text_prefix: &[],
            max_tokens: None,
            by_load: Some(ByLoad::NoPrompt),
            allowed,
        };
        self.decide(m, &input, Instant::now())
    }

    /// As [`App::pick`], among the endpoints `allowed` (all when `None`).
    pub fn pick_among(&self, req: &pb::PickRequest, allowed: Option<&[String]>) -> Result<pb::PickResponse, Status> {
        let t0 = Instant::now();
        let Some(model) = self.models.get(&req.model) else {
            self.pick_error(0);
            return Err(status(tonic::Code::NotFound, format!("unknown model {:?}", req.model)));
        };
        if req.segments.len() > self.config.max_segments {
            self.pick_error(1);
            return Err(status(
                tonic::Code::InvalidArgument,
                format!("{} messages; the limit is {}", req.segments.len(), self.config.max_segments),
            ));
        }
        let bytes: usize = req.segments.iter().map(|s| s.message_json.len()).sum::<usize>()
            + req.template_context_json.len()
            + match &req.prompt {
                Some(pb::pick_request::Prompt::PromptText(t)) => t.len(),
                Some(pb::pick_request::Prompt::PromptTokenIds(t)) => t.ids.len() * 4,
                None => 0,
            };
        if bytes > self.config.max_prompt_bytes {
            self.pick_error(1);
            return Err(status(
                tonic::Code::InvalidArgument,
                format!("prompt of {bytes} bytes; the limit is {}", self.config.max_prompt_bytes),
            ));
        }
        let elided = req.segments.iter().take_while(|s| s.elided).count();
        if elided > 0 {
            self.global.elided_segments.fetch_add(elided as u64, Ordering::Relaxed);
        }
        let api = pb::ApiKind::try_from(req.api).unwrap_or(pb::ApiKind::Unspecified);
        let tokenized: Result<Tokenized, String> = match (api, &req.prompt, &model.tokenizer) {
            (pb::ApiKind::Completions, Some(pb::pick_request::Prompt::PromptTokenIds(t)), _) => Ok(Tokenized {
                ids: t.ids.clone(),
                outcome: crate::tokens::Outcome::Given,
                encoded_bytes: 0,
                retained: Vec::new(),
            }),
            (pb::ApiKind::Completions, Some(pb::pick_request::Prompt::PromptText(t)), Some(tk)) => {
                heavy(bytes, || tk.completion(t)).map_err(|e| e.to_string())
            }
            (pb::ApiKind::Completions, None, _) => {
                self.pick_error(1);
                return Err(status(tonic::Code::InvalidArgument, "completions request without a prompt"));
            }
            (pb::ApiKind::ChatCompletions, _, Some(tk)) => {
                let segs: Vec<SegmentRef<'_>> = req
                    .segments
                    .iter()
                    .map(|s| SegmentRef { chain_hash: s.chain_hash, message_json: &s.message_json, elided: s.elided })
                    .collect();
                match heavy(bytes, || tk.chat(&req.template_context_json, &segs)) {
                    // Elided messages this replica does not hold: no
                    // decision, the filter sends them again.
                    Err(crate::tokens::PromptError::NeedText(why)) => {
                        self.global.pick_resends.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(model = %req.model, why, "elided messages not held; asking for a resend");
                        return Ok(pb::PickResponse { resend: true, ..Default::default() });
                    }
                    r => r.map_err(|e| e.to_string()),
                }
            }
            // Without a tokenizer nothing is retained, so nothing should be
            // elided; a request that still is cannot be checked here either.
            (pb::ApiKind::ChatCompletions, _, None) if req.segments.first().is_some_and(|s| s.elided) => {
                self.global.pick_resends.fetch_add(1, Ordering::Relaxed);
                return Ok(pb::PickResponse { resend: true, ..Default::default() });
            }
            (pb::ApiKind::Unspecified, _, _) => {
                self.pick_error(1);
                return Err(status(tonic::Code::InvalidArgument, "api kind unspecified"));
            }
            (_, _, None) => Err("no tokenizer configured for this model".into()),
        };
        let (ids, by_load, retained) = match tokenized {
            Ok(t) => (t.ids, None, t.retained),
            Err(e) => {
                self.global.tokenize_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(model = %req.model, error = %e, "tokenization failed; routing by load");
                (Vec::new(), Some(ByLoad::TokenizeFailed), Vec::new())
            }
        };
        let seed = BlockSeed::new(Some(&req.lora_name), Some(&req.cache_salt));
        // The `approx` policy's text-prefix keys: the filter's chain hashes,
        // salted. They are not recomputed here (that would hash the whole
        // prompt a second time per Pick): a wrong hash can only mislead this
        // routing hint, while tokenization checks the chain itself and treats
        // a mismatch as a cache miss.
        let text_prefix: Vec<u64> = req.segments.iter().map(|s| s.chain_hash ^ seed.get().rotate_left(17)).collect();
        let generated;
        let request_id = if req.request_id.is_empty() {
            generated = format!("{}-{}", self.config.replica_id, self.ids.fetch_add(1, Ordering::Relaxed));
            generated.as_str()
        } else {
            req.request_id.as_str()
        };
        let input = PickInput {
            request_id,
            token_ids: &ids,
            seed,
            text_prefix: &text_prefix,
            max_tokens: req.max_tokens,
            by_load,
            allowed,
        };
        let mut answer = self.decide(model, &input, t0)?;
        answer.retained_chain_hashes = retained;
        Ok(answer)
    }

    /// Runs the model's pick, shares the decision with the other replicas
    /// and records its metrics.
    fn decide(&self, model: &Model, input: &PickInput<'_>, t0: Instant) -> Result<pb::PickResponse, Status> {
        let now = self.now_ms();
        let out = model.state.lock().pick(input, now);
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                self.pick_error(2);
                return Err(status(tonic::Code::Unavailable, format!("model {:?}: {e}", model.name)));
            }
        };
        if self.config.nats_url.is_some() {
            let mut ev = out.inflight.clone();
            ev.ts_unix_nanos = unix_nanos();
            let _ = self.inflight_tx.send((model.name.clone(), ev));
        }
        if out.total_blocks > 0 {
            model.overlap_ratio.observe(f64::from(out.matched_blocks) / f64::from(out.total_blocks));
        }
        model.pick_seconds.observe(t0.elapsed().as_secs_f64());
        Ok(pb::PickResponse {
            endpoint: out.endpoint,
            fallbacks: out.fallbacks,
            worker_id: out.worker_id,
            matched_blocks: out.matched_blocks,
            total_blocks: out.total_blocks,
            reason: out.reason as i32,
            mode: out.mode.to_owned(),
            retained_chain_hashes: Vec::new(),
            resend: false,
            best_overlap_blocks: out.passed_over.0,
            best_overlap_worker_id: out.passed_over.1,
        })
    }

    /// Applies a batch of completion reports.
    pub fn report(&self, batch: &pb::CompletionReportBatch) -> pb::ReportAck {
        let mut accepted = 0;
        let now = self.now_ms();
        for r in &batch.reports {
            let Some(model) = self.models.get(&r.model) else { continue };
            let events = model.state.lock().on_report(r, now);
            accepted += 1;
            if self.config.nats_url.is_some() {
                for mut ev in events {
                    ev.ts_unix_nanos = unix_nanos();
                    let _ = self.inflight_tx.send((r.model.clone(), ev));
                }
            }
        }
        pb::ReportAck { accepted }
    }

    fn nats_kind(&self, kind: usize, malformed: bool) {
        let arr = if malformed { &self.global.nats_malformed } else { &self.global.nats_messages };
        if let Some(c) = arr.get(kind) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Dispatches one NATS message. Returns snapshot needs (model, worker).
    pub fn on_nats(&self, subject: &str, payload: &[u8]) -> Vec<(Arc<Model>, String)> {
        let Ok(parsed) = self.subjects.parse(subject) else {
            self.nats_kind(3, false);
            return Vec::new();
        };
        let kind = match parsed.kind {
            SubjectKind::KvEvents => 0,
            SubjectKind::Heartbeat => 1,
            SubjectKind::Inflight => 2,
            SubjectKind::Snapshot => 3,
        };
        self.nats_kind(kind, false);
        if kind == 3 {
            return Vec::new();
        }
        let Some(model) = self.models.get(&parsed.model) else {
            self.global.nats_unknown_model.fetch_add(1, Ordering::Relaxed);
            return Vec::new();
        };
        let now = self.now_ms();
        let need = match parsed.kind {
            SubjectKind::KvEvents => match pb::KvEventBatch::decode(payload) {
                Ok(b) if Some(&b.worker_id) == parsed.worker.as_ref() && b.model == parsed.model => {
                    model.state.lock().on_batch(b, now)
                }
                _ => {
                    self.nats_kind(kind, true);
                    None
                }
            },
            SubjectKind::Heartbeat => match pb::WorkerHeartbeat::decode(payload) {
                Ok(h) if Some(&h.worker_id) == parsed.worker.as_ref() && h.model == parsed.model => {
                    model.state.lock().on_heartbeat(&h, now)
                }
                _ => {
                    self.nats_kind(kind, true);
                    None
                }
            },
            SubjectKind::Inflight => {
                match pb::InflightBatch::decode(payload) {
                    Ok(b) if b.model == parsed.model => {
                        if b.replica_id != self.config.replica_id {
                            let mut st = model.state.lock();
                            for ev in &b.events {
                                st.on_replica_event(ev, now);
                            }
                        }
                    }
                    _ => self.nats_kind(kind, true),
                }
                None
            }
            SubjectKind::Snapshot => None,
        };
        match need {
            Some(Need::Snapshot(w)) => vec![(model.clone(), w)],
            None => Vec::new(),
        }
    }

    /// Periodic upkeep: dead workers, expired requests, stale snapshots.
    /// Returns workers whose snapshot must be retried later (none now).
    pub fn tick(&self) {
        let now = self.now_ms();
        // Liveness is judged on heartbeats that travel over NATS: while the
        // connection is down nobody is reaped, and the outage does not count
        // against any worker once it is back (ARCHITECTURE §5).
        if self.config.nats_url.is_some() {
            let up = self.nats_connected.load(Ordering::Relaxed);
            let mut down_since = self.nats_down_since.lock();
            // Not connected yet since the start: no outage, nothing to freeze.
            if !up && !self.nats_was_up.load(Ordering::Relaxed) {
                return;
            }
            self.nats_was_up.store(true, Ordering::Relaxed);
            match (up, *down_since) {
                (false, None) => {
                    *down_since = Some(now);
                    tracing::warn!("NATS down: routing goes on on the last index, worker liveness frozen");
                    for m in self.models.values() {
                        m.state.lock().freeze(now);
                    }
                    return;
                }
                (false, Some(_)) => return,
                (true, Some(t)) => {
                    *down_since = None;
                    let outage = now.saturating_sub(t);
                    tracing::info!(outage_ms = outage, "NATS back: worker liveness resumes");
                    for m in self.models.values() {
                        m.state.lock().thaw(outage);
                    }
                }
                (true, None) => {}
            }
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

    /// Prometheus exposition of everything.
    pub fn render_metrics(&self) -> String {
        let mut o = String::with_capacity(16 << 10);
        let now = self.now_ms();
        let g = &self.global;
        metrics::header(&mut o, "kvgate_pick_duration_seconds", "histogram", "Pick latency, receipt to answer.");
        for m in self.models.values() {
            m.pick_seconds.render(&mut o, "kvgate_pick_duration_seconds", &format!("model=\"{}\"", label(&m.name)));
        }
        metrics::header(
            &mut o,
            "kvgate_pick_overlap_ratio",
            "histogram",
            "Predicted cached prompt blocks / prompt blocks of the chosen worker.",
        );
        for m in self.models.values() {
            m.overlap_ratio.render(&mut o, "kvgate_pick_overlap_ratio", &format!("model=\"{}\"", label(&m.name)));
        }
        metrics::header(&mut o, "kvgate_pick_decisions_total", "counter", "Answered picks by mode and reason.");
        for m in self.models.values() {
            let st = m.state.lock();
            let mut d: Vec<_> = st.decisions().iter().collect();
            d.sort();
            for ((mode, reason), n) in d {
                let _ = writeln!(
                    o,
                    "kvgate_pick_decisions_total{{model=\"{}\",mode=\"{mode}\",reason=\"{reason}\"}} {n}",
                    label(&m.name)
                );
            }
        }
        metrics::header(&mut o, "kvgate_pick_errors_total", "counter", "Picks refused, by cause.");
        for (i, c) in PICK_ERRORS.iter().enumerate() {
            let _ =
                writeln!(o, "kvgate_pick_errors_total{{cause=\"{c}\"}} {}", g.pick_errors[i].load(Ordering::Relaxed));
        }
        metrics::header(
            &mut o,
            "kvgate_epp_requests_total",
            "counter",
            "Requests the endpoint picker (ext_proc) answered, by outcome.",
        );
        for (i, c) in crate::epp::OUTCOMES.iter().enumerate() {
            let _ = writeln!(
                o,
                "kvgate_epp_requests_total{{outcome=\"{c}\"}} {}",
                self.epp.outcomes[i].load(Ordering::Relaxed)
            );
        }
        metrics::header(
            &mut o,
            "kvgate_epp_stream_errors_total",
            "counter",
            "ext_proc streams the data plane ended with an error.",
        );
        let _ = writeln!(o, "kvgate_epp_stream_errors_total {}", self.epp.stream_errors.load(Ordering::Relaxed));
        metrics::header(&mut o, "kvgate_grpc_responses_total", "counter", "gRPC responses by status code.");
        for (i, c) in g.grpc_status.iter().enumerate() {
            let n = c.load(Ordering::Relaxed);
            if n > 0 {
                let _ = writeln!(o, "kvgate_grpc_responses_total{{code=\"{i}\"}} {n}");
            }
        }
        metrics::header(&mut o, "kvgate_nats_messages_total", "counter", "NATS messages received, by kind.");
        metrics::header(
            &mut o,
            "kvgate_nats_malformed_total",
            "counter",
            "NATS messages rejected as malformed, by kind.",
        );
        for (i, k) in NATS_KINDS.iter().enumerate() {
            let _ = writeln!(
                o,
                "kvgate_nats_messages_total{{kind=\"{k}\"}} {}",
                g.nats_messages[i].load(Ordering::Relaxed)
            );
            let _ = writeln!(
                o,
                "kvgate_nats_malformed_total{{kind=\"{k}\"}} {}",
                g.nats_malformed[i].load(Ordering::Relaxed)
            );
        }
        let scalar = |o: &mut String, name: &str, kind: &str, help: &str, v: u64| {
            metrics::header(o, name, kind, help);
            let _ = writeln!(o, "{name} {v}");
        };
        scalar(
            &mut o,
            "kvgate_nats_unknown_model_total",
            "counter",
            "NATS messages for models not served here.",
            g.nats_unknown_model.load(Ordering::Relaxed),
        );
        scalar(
            &mut o,
            "kvgate_pick_elided_messages_total",
            "counter",
            "Chat messages whose bytes the filter left out because this replica retains them.",
            g.elided_segments.load(Ordering::Relaxed),
        );
        scalar(
            &mut o,
            "kvgate_pick_resends_total",
            "counter",
            "Picks answered resend: the filter elided messages this replica does not hold.",
            g.pick_resends.load(Ordering::Relaxed),
        );
        scalar(
            &mut o,
            "kvgate_nats_connected",
            "gauge",
            "1 when the NATS connection is up.",
            u64::from(self.nats_connected.load(Ordering::Relaxed)),
        );
        scalar(
            &mut o,
            "kvgate_snapshot_requests_total",
            "counter",
            "Snapshot requests sent to relays.",
            g.snapshot_requests.load(Ordering::Relaxed),
        );
        scalar(
            &mut o,
            "kvgate_snapshot_failures_total",
            "counter",
            "Snapshot requests that failed or timed out.",
            g.snapshot_failures.load(Ordering::Relaxed),
        );
        scalar(
            &mut o,
            "kvgate_tokenize_errors_total",
            "counter",
            "Prompts that could not be tokenized (routed by load).",
            g.tokenize_errors.load(Ordering::Relaxed),
        );
        scalar(
            &mut o,
            "kvgate_inflight_published_total",
            "counter",
            "Replica-sync batches published.",
            g.inflight_published.load(Ordering::Relaxed),
        );
        scalar(
            &mut o,
            "kvgate_inflight_publish_errors_total",
            "counter",
            "Replica-sync batches that could not be published.",
            g.inflight_publish_errors.load(Ordering::Relaxed),
        );

        // Per model, read under the model's lock.
        metrics::header(&mut o, "kvgate_events_applied_total", "counter", "KV events applied to the index.");
        metrics::header(&mut o, "kvgate_events_skipped_total", "counter", "KV events skipped, by cause.");
        metrics::header(&mut o, "kvgate_batches_total", "counter", "KV event batches by outcome.");
        metrics::header(&mut o, "kvgate_index_blocks", "gauge", "Distinct blocks in the index, by tier.");
        metrics::header(&mut o, "kvgate_index_heap_bytes", "gauge", "Approximate heap bytes of the index.");
        metrics::header(&mut o, "kvgate_worker_up", "gauge", "1 when the worker is routable.");
        metrics::header(&mut o, "kvgate_worker_inflight", "gauge", "Requests in flight on the worker (all replicas).");
        metrics::header(&mut o, "kvgate_worker_running", "gauge", "vllm:num_requests_running at the last heartbeat.");
        metrics::header(&mut o, "kvgate_worker_waiting", "gauge", "vllm:num_requests_waiting at the last heartbeat.");
        metrics::header(&mut o, "kvgate_worker_blocks", "gauge", "Device blocks indexed for the worker.");
        metrics::header(&mut o, "kvgate_model_events_total", "counter", "Stream events of the model, by kind.");
        metrics::header(
            &mut o,
            "kvgate_report_cached_tokens_total",
            "counter",
            "Cached prompt tokens: predicted at pick vs reported by the engine (usage.prompt_tokens_details.cached_tokens).",
        );
        metrics::header(
            &mut o,
            "kvgate_reports_total",
            "counter",
            "Completion reports: all, with cached_tokens, and within one block of the prediction.",
        );
        metrics::header(&mut o, "kvgate_tokenize_requests_total", "counter", "Tokenizations by cache outcome.");
        metrics::header(
            &mut o,
            "kvgate_tokenize_bytes_total",
            "counter",
            "Prompt text bytes run through the tokenizer.",
        );
        metrics::header(&mut o, "kvgate_tokenize_cache_tokens", "gauge", "Token ids held by the segment cache.");
        let token_counters = kvgate_tokenize::prompt::TokenStats::default().counters();
        for (name, help, _) in &token_counters {
            metrics::header(&mut o, &format!("kvgate_tokenize_{name}_total"), "counter", help);
        }
        metrics::header(&mut o, "kvgate_index_events_total", "counter", "Index changes and anomalies, by kind.");
        metrics::header(&mut o, "kvgate_tokenize_segmented", "gauge", "1 when the segment cache is in use.");
        metrics::header(&mut o, "kvgate_mode", "gauge", "1 for the current routing mode of the model.");
        let mut names: Vec<&String> = self.models.keys().collect();
        names.sort();
        for name in names {
            let m = &self.models[name];
            let ml = label(name);
            let st = m.state.lock();
            let c = st.index().counters();
            let _ = writeln!(o, "kvgate_events_applied_total{{model=\"{ml}\"}} {}", c.events_applied);
            for (cause, n) in st.skips() {
                let _ = writeln!(o, "kvgate_events_skipped_total{{model=\"{ml}\",cause=\"{cause}\"}} {n}");
            }
            let _ = writeln!(
                o,
                "kvgate_events_skipped_total{{model=\"{ml}\",cause=\"empty\"}} {}",
                st.counters().events_empty
            );
            let mc = st.counters();
            for (k, v) in [
                ("applied", mc.batches_applied),
                ("duplicate", mc.batches_duplicate),
                ("buffered", mc.batches_buffered),
                ("dropped", mc.batches_dropped),
            ] {
                let _ = writeln!(o, "kvgate_batches_total{{model=\"{ml}\",outcome=\"{k}\"}} {v}");
            }
            for (k, v) in [
                ("gap", mc.gaps),
                ("epoch_change", mc.epoch_changes),
                ("snapshot_applied", mc.snapshots_applied),
                ("snapshot_failed", mc.snapshots_failed),
                ("heartbeat", mc.heartbeats),
                ("heartbeat_invalid", mc.heartbeats_invalid),
                ("heartbeat_block_size_mismatch", mc.heartbeats_block_size_mismatch),
                ("worker_expired", mc.workers_expired),
                ("replica_event", mc.replica_events),
                ("replica_event_ignored", mc.replica_events_ignored),
                ("inflight_expired", mc.inflight_expired),
                ("report_unknown", mc.reports_unknown),
                ("connection_failure", mc.connection_failures),
                ("suspect", mc.suspects),
                ("health_change", mc.health_changes),
                ("refused_endpoint", mc.refused_endpoints),
            ] {
                let _ = writeln!(o, "kvgate_model_events_total{{model=\"{ml}\",kind=\"{k}\"}} {v}");
            }
            let _ = writeln!(
                o,
                "kvgate_report_cached_tokens_total{{model=\"{ml}\",source=\"predicted\"}} {}",
                mc.predicted_cached_tokens
            );
            let _ = writeln!(
                o,
                "kvgate_report_cached_tokens_total{{model=\"{ml}\",source=\"reported\"}} {}",
                mc.reported_cached_tokens
            );
            let _ = writeln!(o, "kvgate_reports_total{{model=\"{ml}\",kind=\"all\"}} {}", mc.reports);
            let _ =
                writeln!(o, "kvgate_reports_total{{model=\"{ml}\",kind=\"with_cached\"}} {}", mc.reports_with_cached);
            let _ = writeln!(o, "kvgate_reports_total{{model=\"{ml}\",kind=\"accurate\"}} {}", mc.reports_accurate);
            for (tier, t) in [("device", kvgate_index::Tier::Device), ("host", kvgate_index::Tier::Host)] {
                let _ = writeln!(
                    o,
                    "kvgate_index_blocks{{model=\"{ml}\",tier=\"{tier}\"}} {}",
                    st.index().distinct_blocks(t)
                );
            }
            let _ = writeln!(o, "kvgate_index_heap_bytes{{model=\"{ml}\"}} {}", st.index().approx_heap_bytes());
            for (kind, v) in c.by_kind() {
                let _ = writeln!(o, "kvgate_index_events_total{{model=\"{ml}\",kind=\"{kind}\"}} {v}");
            }
            for mode in kvgate_scheduler::Mode::ALL {
                let _ = writeln!(
                    o,
                    "kvgate_mode{{model=\"{ml}\",mode=\"{}\"}} {}",
                    mode.name(),
                    u8::from(mode == st.mode())
                );
            }
            for w in st.worker_views(now) {
                let wl = format!("model=\"{ml}\",worker=\"{}\"", label(&w.id));
                let _ = writeln!(o, "kvgate_worker_up{{{wl}}} {}", u8::from(w.live));
                let _ = writeln!(o, "kvgate_worker_engine_health{{{wl},health=\"{}\"}} 1", w.engine_health);
                let _ = writeln!(o, "kvgate_worker_inflight{{{wl}}} {}", w.inflight);
                let _ = writeln!(o, "kvgate_worker_blocks{{{wl}}} {}", w.device_blocks);
                if let Some(r) = w.running {
                    let _ = writeln!(o, "kvgate_worker_running{{{wl}}} {r}");
                }
                if let Some(r) = w.waiting {
                    let _ = writeln!(o, "kvgate_worker_waiting{{{wl}}} {r}");
                }
            }
            drop(st);
            if let Some(tk) = &m.tokenizer {
                for (i, outcome) in ["full_hit", "partial_hit", "miss", "whole", "given"].iter().enumerate() {
                    let _ = writeln!(
                        o,
                        "kvgate_tokenize_requests_total{{model=\"{ml}\",outcome=\"{outcome}\"}} {}",
                        tk.stats.outcomes[i].load(Ordering::Relaxed)
                    );
                }
                let _ = writeln!(
                    o,
                    "kvgate_tokenize_bytes_total{{model=\"{ml}\"}} {}",
                    tk.stats.encoded_bytes.load(Ordering::Relaxed)
                );
                let _ = writeln!(o, "kvgate_tokenize_cache_tokens{{model=\"{ml}\"}} {}", tk.cache_size().0);
                let _ = writeln!(o, "kvgate_tokenize_segmented{{model=\"{ml}\"}} {}", u8::from(tk.segmented()));
                for (name, _, v) in tk.stats.counters() {
                    let _ = writeln!(o, "kvgate_tokenize_{name}_total{{model=\"{ml}\"}} {v}");
                }
            }
        }
        o
    }

    /// The admin view of workers (all models, or one).
    pub fn workers_json(&self, model: Option<&str>) -> serde_json::Value {
        let now = self.now_ms();
        let mut out = serde_json::Map::new();
        for (name, m) in &self.models {
            if model.is_some_and(|x| x != name) {
                continue;
            }
            let views = m.state.lock().worker_views(now);
            out.insert(name.clone(), serde_json::to_value(views).unwrap_or_default());
        }
        serde_json::Value::Object(out)
    }

    /// The admin view of the indexes and tokenizers.
    pub fn index_json(&self) -> serde_json::Value {
        let mut out = serde_json::Map::new();
        for (name, m) in &self.models {
            let st = m.state.lock();
            let c = st.index().counters();
            let mut v = serde_json::json!({
                "mode": st.mode().name(),
                "block_size": st.config().block_size.get(),
                "workers": st.index().worker_count(),
                "device_blocks": st.index().distinct_blocks(kvgate_index::Tier::Device),
                "host_blocks": st.index().distinct_blocks(kvgate_index::Tier::Host),
                "heap_bytes": st.index().approx_heap_bytes(),
                "events_applied": c.events_applied,
                "inflight": st.inflight(),
            });
            drop(st);
            if let Some(tk) = &m.tokenizer {
                let (tokens, entries) = tk.cache_size();
                v["tokenizer"] = serde_json::json!({
                    "segmented": tk.segmented(),
                    "fast_encoder": tk.inner().uses_fast_encoder(),
                    "paragraphs": tk.inner().encodes_by_paragraph(),
                    "self_test": tk.self_test_result(),
                    "cache_tokens": tokens,
                    "cache_entries": entries,
                });
            }
            out.insert(name.clone(), v);
        }
        serde_json::Value::Object(out)
    }

    /// Switches a model's routing mode.
    pub fn set_mode(&self, model: &str, mode: &str) -> Result<(), String> {
        let m = self.models.get(model).ok_or_else(|| format!("unknown model {model:?}"))?;
        let mode: kvgate_scheduler::Mode = mode.parse()?;
        m.state.lock().set_mode(mode);
        tracing::info!(model, mode = mode.name(), "routing mode switched");
        Ok(())
    }
}

/// Runs CPU-heavy work off the async scheduler's hands when the prompt is
/// large (multi-thread runtime only).
fn heavy<T>(bytes: usize, f: impl FnOnce() -> T) -> T {
    if bytes > 64 << 10
        && tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
    {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

/// Wall-clock nanoseconds (for replica-sync timestamps).
pub fn unix_nanos() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}
