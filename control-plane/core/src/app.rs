//! The shared application state and the Pick and Report paths: validate,
//! tokenize (with the segment cache), route with the model's state, share
//! the decision with the other replicas. Synchronous; the adapters (gRPC,
//! endpoint picker, NATS, admin) call it.
//!
//! | operation | cost |
//! |---|---|
//! | [`App::pick`] | tokenization (cached segments skip theirs) + [`crate::model::ModelState::pick`] under the model's lock |
//! | [`App::report`] | O(reports) under the model's lock |
//! | [`App::release_held`] | O(workers + released) per model with overload protection |

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use kvgate_protocol::BlockSeed;
use kvgate_protocol::pb;
use kvgate_protocol::subject::Subjects;
use kvgate_tokenize::prompt::{Outcome, PromptError, SegmentRef, Tokenized};
use parking_lot::Mutex;

use crate::config::Config;
use crate::error::{PickError, StartError};
use crate::metrics::{DecisionLabels, Metrics, PickErrorCause};
use crate::model::{Admit, ByLoad, PickInput, Released, reason_label};
pub use crate::served::Model;

/// Where the in-flight events of this replica's decisions go (the NATS
/// adapter publishes them for the other replicas).
pub trait ReplicaSink: Send + Sync {
    /// One event of `model`.
    fn share(&self, model: &str, event: pb::InflightEvent);
}

/// Everything the adapters share.
pub struct App {
    /// Validated configuration.
    pub config: Config,
    /// Models by name.
    pub models: HashMap<String, Arc<Model>>,
    /// Subjects of the namespace.
    pub subjects: Subjects,
    /// The registry and the request paths' metrics.
    pub metrics: Metrics,
    pub(crate) start: Instant,
    sink: Option<Box<dyn ReplicaSink>>,
    pub(crate) nats_connected: AtomicBool,
    /// Since when NATS has been down (liveness frozen), if it is.
    pub(crate) nats_down_since: Mutex<Option<u64>>,
    /// NATS has been connected at least once.
    pub(crate) nats_was_up: AtomicBool,
    ids: AtomicU64,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App").field("replica", &self.config.replica_id).finish()
    }
}

/// Above this many prompt bytes a Pick is CPU-heavy enough (tokenization)
/// that an async adapter should run it off its scheduler's hands.
pub const HEAVY_PROMPT_BYTES: usize = 64 << 10;

/// The bytes of prompt a request carries (messages, template context, text
/// or token ids).
pub fn prompt_bytes(req: &pb::PickRequest) -> usize {
    req.segments.iter().map(|s| s.message_json.len()).sum::<usize>()
        + req.template_context_json.len()
        + match &req.prompt {
            Some(pb::pick_request::Prompt::PromptText(t)) => t.len(),
            Some(pb::pick_request::Prompt::PromptTokenIds(t)) => t.ids.len() * 4,
            None => 0,
        }
}

impl App {
    /// Loads every model (tokenizers, self-tests); decisions are not shared
    /// with other replicas.
    pub fn new(config: Config) -> Result<Arc<Self>, StartError> {
        Self::build(config, None)
    }

    /// As [`App::new`], sharing every decision's in-flight events with
    /// `sink`.
    pub fn with_sink(config: Config, sink: Box<dyn ReplicaSink>) -> Result<Arc<Self>, StartError> {
        Self::build(config, Some(sink))
    }

    fn build(config: Config, sink: Option<Box<dyn ReplicaSink>>) -> Result<Arc<Self>, StartError> {
        let metrics = Metrics::default();
        let mut models = HashMap::new();
        for (i, settings) in config.models.iter().enumerate() {
            let m = Model::load(&config, settings, i, &metrics)?;
            m.state.lock().set_share_with_replicas(sink.is_some());
            models.insert(m.name.clone(), Arc::new(m));
        }
        let start = Instant::now();
        let collector = crate::collect::ModelCollector::new(models.values().cloned().collect(), start);
        metrics.register_collector(Box::new(collector));
        let subjects = Subjects::new(&config.subject_prefix).unwrap_or_default();
        Ok(Arc::new(Self {
            config,
            models,
            subjects,
            metrics,
            start,
            sink,
            nats_connected: AtomicBool::new(false),
            nats_down_since: Mutex::new(None),
            nats_was_up: AtomicBool::new(false),
            ids: AtomicU64::new(0),
        }))
    }

    /// Milliseconds since start (monotonic).
    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// The OpenMetrics text of every metric (`/metrics`).
    pub fn render_metrics(&self) -> String {
        self.metrics.render()
    }

    fn model(&self, name: &str) -> Result<&Arc<Model>, PickError> {
        self.models.get(name).ok_or_else(|| {
            self.metrics.global.pick_error(PickErrorCause::UnknownModel);
            PickError::UnknownModel(name.to_owned())
        })
    }

    fn invalid(&self, why: String) -> PickError {
        self.metrics.global.pick_error(PickErrorCause::Invalid);
        PickError::Invalid(why)
    }

    /// Validates, tokenizes and routes one request. With the model's
    /// overload protection on and every worker saturated, the request is
    /// held instead ([`PickError::Held`]): the caller waits for its ticket
    /// ([`App::release_held`]) and then calls [`App::pick_released`].
    pub fn pick(&self, req: &pb::PickRequest) -> Result<pb::PickResponse, PickError> {
        self.pick_with(req, None, true)
    }

    /// As [`App::pick`] for a request the admission queue released: it is
    /// not held again.
    pub fn pick_released(&self, req: &pb::PickRequest) -> Result<pb::PickResponse, PickError> {
        self.pick_with(req, None, false)
    }

    /// As [`App::pick`], among the endpoints `allowed` (all when `None`),
    /// never held (the endpoint picker cannot wait).
    pub fn pick_among(&self, req: &pb::PickRequest, allowed: Option<&[String]>) -> Result<pb::PickResponse, PickError> {
        self.pick_with(req, allowed, false)
    }

    /// Held requests to wake, per model: released to pick, or expired.
    pub fn release_held(&self) -> Vec<(String, Released)> {
        let now = self.now_ms();
        let mut out = Vec::new();
        for (name, m) in &self.models {
            let r = m.state.lock().release(now);
            if !(r.go.is_empty() && r.expired.is_empty()) {
                out.push((name.clone(), r));
            }
        }
        out
    }

    /// Forgets a held request whose caller went away.
    pub fn cancel_held(&self, model: &str, ticket: kvgate_scheduler::Ticket) {
        if let Some(m) = self.models.get(model) {
            m.state.lock().cancel_held(ticket);
        }
    }

    /// The longest a request of `model` is held (its `Retry-After` when
    /// refused), ms.
    pub fn retry_after_ms(&self, model: &str) -> u32 {
        self.models.get(model).map_or(1000, |m| m.state.lock().retry_after_ms())
    }

    /// The refusal of a request of `model` that the fleet cannot take.
    pub fn overloaded(&self, model: &str) -> PickError {
        PickError::Overloaded { retry_after_ms: self.retry_after_ms(model) }
    }

    fn pick_with(
        &self,
        req: &pb::PickRequest,
        allowed: Option<&[String]>,
        may_hold: bool,
    ) -> Result<pb::PickResponse, PickError> {
        let t0 = Instant::now();
        let model = self.model(&req.model)?;
        self.check_limits(req)?;
        let elided = req.segments.iter().take_while(|s| s.elided).count();
        self.metrics.global.elided_segments.inc_by(elided as u64);
        let (ids, by_load, retained) = if self.sheds(model) {
            // The cheapest answer that still keeps load even: ingest gets
            // the CPU that tokenizing and scoring would take.
            self.metrics.global.picks_shed.inc();
            (Vec::new(), Some(ByLoad::Shed), Vec::new())
        } else {
            match self.tokenize(model, req)? {
                Ok(t) => (t.ids, None, t.retained),
                Err(e) => {
                    self.metrics.global.tokenize_errors.inc();
                    tracing::debug!(model = %req.model, error = %e, "tokenization failed; routing by load");
                    (Vec::new(), Some(ByLoad::TokenizeFailed), Vec::new())
                }
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
        // Without overload protection every request goes on (no hold of
        // the model's lock for it).
        if may_hold && model.admission {
            let priority = u8::try_from(req.priority.min(9)).unwrap_or(9);
            // Bound first: the model's lock is released before a refusal
            // takes it again.
            let admit = model.state.lock().admit(&req.tenant, priority, ids.len() as u64, self.now_ms());
            match admit {
                Admit::Go => {}
                Admit::Wait(ticket) => return Err(PickError::Held { ticket }),
                Admit::Refuse => return Err(self.overloaded(&req.model)),
            }
        }
        let input = PickInput {
            request_id,
            token_ids: &ids,
            seed,
            text_prefix: &text_prefix,
            max_tokens: req.max_tokens,
            by_load,
            allowed,
            session: &req.session_id,
        };
        let mut answer = self.decide(model, &input, t0)?;
        answer.retained_chain_hashes = retained;
        Ok(answer)
    }

    /// Whether `model`'s Picks give way to ingest: its event stream is
    /// processed `ingest_shed_after_ms` or more behind (a control plane
    /// short of CPU), so they are routed by load until it catches up.
    fn sheds(&self, model: &Model) -> bool {
        let after = self.config.ingest_shed_after_ms;
        // The gauge holds the delay as last judged (ms / 1000, as `after` is
        // divided here: equal delays compare equal).
        after > 0 && model.stream_delay_seconds.get() >= after as f64 / 1000.0
    }

    /// Routes a request without a prompt to score (an endpoint picker saw
    /// no body, or one kvgate does not route by prefix) to the least loaded
    /// live worker of `model` among `allowed` (all when `None`).
    pub fn pick_by_load(
        &self,
        model: &str,
        request_id: &str,
        allowed: Option<&[String]>,
    ) -> Result<pb::PickResponse, PickError> {
        let m = self.model(model)?;
        let input = PickInput {
            request_id,
            token_ids: &[],
            seed: BlockSeed::new(None, None),
            text_prefix: &[],
            max_tokens: None,
            by_load: Some(ByLoad::NoPrompt),
            allowed,
            session: "",
        };
        self.decide(m, &input, Instant::now())
    }

    fn check_limits(&self, req: &pb::PickRequest) -> Result<(), PickError> {
        if req.segments.len() > self.config.max_segments {
            let n = req.segments.len();
            return Err(self.invalid(format!("{n} messages; the limit is {}", self.config.max_segments)));
        }
        let bytes = prompt_bytes(req);
        if bytes > self.config.max_prompt_bytes {
            return Err(self.invalid(format!("prompt of {bytes} bytes; the limit is {}", self.config.max_prompt_bytes)));
        }
        Ok(())
    }

    /// The prompt's token ids: `Ok(Err(_))` when it cannot be tokenized
    /// (routed by load), `Err(_)` when the request gets no decision.
    fn tokenize(&self, model: &Model, req: &pb::PickRequest) -> Result<Result<Tokenized, String>, PickError> {
        use pb::pick_request::Prompt;
        let api = pb::ApiKind::try_from(req.api).unwrap_or(pb::ApiKind::Unspecified);
        let given = |ids: &[u32]| Tokenized {
            ids: ids.to_vec(),
            outcome: Outcome::Given,
            encoded_bytes: 0,
            retained: Vec::new(),
        };
        Ok(match (api, &req.prompt, &model.tokenizer) {
            (pb::ApiKind::Completions, Some(Prompt::PromptTokenIds(t)), _) => Ok(given(&t.ids)),
            (pb::ApiKind::Completions, Some(Prompt::PromptText(t)), Some(tk)) => {
                tk.completion(t).map_err(|e| e.to_string())
            }
            (pb::ApiKind::Completions, None, _) => {
                return Err(self.invalid("completions request without a prompt".into()));
            }
            (pb::ApiKind::ChatCompletions, _, Some(tk)) => {
                let segs: Vec<SegmentRef<'_>> = req
                    .segments
                    .iter()
                    .map(|s| SegmentRef { chain_hash: s.chain_hash, message_json: &s.message_json, elided: s.elided })
                    .collect();
                match tk.chat(&req.template_context_json, &segs) {
                    // Elided messages this replica does not hold: no
                    // decision, the filter sends them again.
                    Err(PromptError::NeedText(why)) => return Err(self.resend(&req.model, why)),
                    r => r.map_err(|e| e.to_string()),
                }
            }
            // Without a tokenizer nothing is retained, so nothing should be
            // elided; a request that still is cannot be checked here either.
            (pb::ApiKind::ChatCompletions, _, None) if req.segments.first().is_some_and(|s| s.elided) => {
                return Err(self.resend(&req.model, "no tokenizer"));
            }
            (pb::ApiKind::Unspecified, _, _) => return Err(self.invalid("api kind unspecified".into())),
            (_, _, None) => Err("no tokenizer configured for this model".into()),
        })
    }

    fn resend(&self, model: &str, why: &str) -> PickError {
        self.metrics.global.pick_resends.inc();
        tracing::debug!(model, why, "elided messages not held; asking for a resend");
        PickError::Resend
    }

    /// Runs the model's pick, shares the decision with the other replicas
    /// and records its metrics.
    fn decide(&self, model: &Model, input: &PickInput<'_>, t0: Instant) -> Result<pb::PickResponse, PickError> {
        let now = self.now_ms();
        let kv = model.looks_up.load(std::sync::atomic::Ordering::Relaxed);
        let found = crate::model::Found::lookup(&model.index, input, model.block_size, kv);
        let out = model.state.lock().pick_found(input, found, now).map_err(|why| {
            self.metrics.global.pick_error(PickErrorCause::NoWorkers);
            PickError::NoWorkers { model: model.name.clone(), why }
        })?;
        if let Some(sink) = &self.sink {
            let mut ev = out.inflight.clone();
            ev.ts_unix_nanos = unix_nanos();
            sink.share(&model.name, ev);
            if let Some(p) = &out.prefill {
                let mut leg = p.inflight.clone();
                leg.ts_unix_nanos = unix_nanos();
                sink.share(&model.name, leg);
            }
        }
        if out.total_blocks > 0 {
            model.overlap_ratio.observe(f64::from(out.matched_blocks) / f64::from(out.total_blocks));
        }
        let labels = DecisionLabels { model: model.name.clone(), mode: out.mode, reason: reason_label(out.reason) };
        self.metrics.global.decisions.get_or_create(&labels).inc();
        model.pick_seconds.observe(t0.elapsed().as_secs_f64());
        Ok(pb::PickResponse {
            endpoint: out.endpoint,
            data_parallel_rank: out.dp_rank,
            fallbacks: out.fallbacks,
            worker_id: out.worker_id,
            matched_blocks: out.matched_blocks,
            total_blocks: out.total_blocks,
            reason: out.reason as i32,
            mode: out.mode.to_owned(),
            retained_chain_hashes: Vec::new(),
            resend: false,
            retry_after_ms: 0,
            best_overlap_blocks: out.passed_over.0,
            best_overlap_worker_id: out.passed_over.1,
            prefill_endpoint: out.prefill.as_ref().map(|p| p.endpoint.clone()).unwrap_or_default(),
            prefill_worker_id: out.prefill.as_ref().map(|p| p.worker_id.clone()).unwrap_or_default(),
            prefill_matched_blocks: out.prefill.as_ref().map_or(0, |p| p.matched_blocks),
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
            if let Some(sink) = &self.sink {
                for mut ev in events {
                    ev.ts_unix_nanos = unix_nanos();
                    sink.share(&r.model, ev);
                }
            }
        }
        pb::ReportAck { accepted }
    }
}

/// Wall-clock nanoseconds (for replica-sync timestamps).
pub fn unix_nanos() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}
