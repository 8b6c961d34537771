//! The per-request state machine.
//!
//! ```text
//!  headers ──not POST to a steered path──▶ Ignored (destination header stripped)
//!     │ Content-Length > limit / no body ──▶ fail(cause)
//!     ▼ Pause
//!  Buffering ──body > limit──▶ fail(body_too_large)
//!     │ end of body: extract + encode + dispatch_pick   (fail(malformed | unsupported | dispatch_failed))
//!     ▼ Pause
//!  Picking ──gRPC answer──▶ usable: set header, resume ─▶ Forwarded
//!     ▲                     │ a prefill worker named, legs "filter": prefill leg (HTTP call)
//!     │                     ▼ Pause
//!     │                  Prefilling ──answer with kv_transfer_params──▶ decode body, resume ─▶ Forwarded
//!     │                           └─error, timeout, no parameters──▶ body untouched, resume (aggregated)
//!     │                     resend (elided messages not held): ─┐
//!     └──── re-extract, encode in full, dispatch_pick ◀─────────┘
//!                           else fail(timeout | unavailable | unknown_model | grpc_error | unusable_answer)
//!
//!  Elision: the leading messages up to the last chain hash found in the
//!  thread's [`Retained`] table go out without their bytes.
//!
//!  fail(cause): count it; fail-open → no header, continue/resume (Envoy's
//!  fallback LB picks); fail-closed → local reply (cause.status(), JSON).
//! ```
//!
//! The response side never delays data: the first body byte stamps the time
//! to first byte, each chunk's last bytes feed a bounded [`Tail`], and at the
//! end [`RequestFilter::finish`] builds the completion report.

use std::rc::Rc;

use kvgate_protocol::pd::{self, Fallback};
use kvgate_protocol::{DESTINATION_HEADER, DP_RANK_HEADER, PREFILLER_HEADER, pb};
use serde_json::{Map, Value};

use crate::config::{Config, FailureMode, Legs};
use crate::extract::{Api, extract};
use crate::host::{Action, Cause, Host, Metric};
use crate::pick::{Answer, Decision, RequestMeta, answer, chain_hashes, encode_pick};
use crate::retained::Retained;
use crate::usage::{Tail, find_usage};

/// What Envoy's gRPC status message carries when its own per-call timer
/// ended the call (response code details, `upstream request
/// timeout{response_timeout}` in Envoy 1.40).
const TIMEOUT_MARK: &str = "{response_timeout}";

/// The body of a 429 (OpenAI's error shape).
const OVERLOADED_BODY: &[u8] = br#"{"error":{"message":"Every model server is saturated; retry after the time in Retry-After.","type":"rate_limit_error","code":"overloaded"}}"#;

/// Longest session header value sent to the control plane (bytes).
pub const MAX_SESSION_BYTES: usize = 256;

/// Debug response headers (`debug_headers: true`).
pub const DEBUG_ENDPOINT: &str = "x-kvgate-endpoint";
/// Worker id of the primary endpoint.
pub const DEBUG_WORKER: &str = "x-kvgate-worker";
/// Pick reason, or `fallback`.
pub const DEBUG_REASON: &str = "x-kvgate-reason";
/// `matched/total` prompt blocks.
pub const DEBUG_BLOCKS: &str = "x-kvgate-blocks";
/// The failure cause of a request that was not steered.
pub const DEBUG_FALLBACK: &str = "x-kvgate-fallback";
/// Debug header: a larger prompt overlap the decision passed over, as
/// `blocks@worker` (why a conversation moved).
pub const DEBUG_PASSED_OVER: &str = "x-kvgate-passed-over";
/// Debug header: the prefill worker (`ip:port`) of a disaggregated request.
pub const DEBUG_PREFILL: &str = "x-kvgate-prefill";
/// Debug header: why the filter's prefill leg left a disaggregated request
/// aggregated.
pub const DEBUG_PREFILL_FALLBACK: &str = "x-kvgate-prefill-fallback";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not a steered request.
    Ignored,
    /// Waiting for the whole body.
    Buffering,
    /// Waiting for the Pick answer.
    Picking,
    /// Waiting for the prefill leg the filter runs.
    Prefilling,
    /// Sent upstream (steered or failed open).
    Forwarded,
    /// Answered locally (fail-closed).
    Local,
}

/// One HTTP request through the filter.
#[derive(Debug)]
pub struct RequestFilter {
    cfg: Rc<Config>,
    state: State,
    api: Api,
    request_id: String,
    /// The session header's value, when usable (visible ASCII, ≤ 256 bytes).
    session: String,
    /// The tenant header's value, when usable (same rules).
    tenant: String,
    /// The priority header's digit, 0 when absent or not one digit.
    priority: u32,
    model: String,
    stream: bool,
    decision: Option<Decision>,
    cause: Option<Cause>,
    token: Option<u32>,
    t_start: u64,
    t_pick: u64,
    t_first_byte: Option<u64>,
    status: u32,
    tail: Option<Tail>,
    retained: Option<Rc<Retained>>,
    /// Chain hash through which the Pick in flight elided messages (0 = none).
    elided_through: u64,
    body_size: usize,
    /// The prefill leg in flight.
    prefill: Option<PrefillLeg>,
    /// Why the filter's prefill leg fell back to aggregated.
    prefill_fallback: Option<Fallback>,
    /// The stream's first-token report was made.
    first_token_reported: bool,
}

/// A prefill leg the filter runs.
#[derive(Debug)]
struct PrefillLeg {
    token: u32,
    started_ns: u64,
    /// The client's body, parsed once for both legs.
    original: Map<String, Value>,
}

fn steered_api(cfg: &Config, path: &str) -> Option<Api> {
    let path = path.split('?').next().unwrap_or(path);
    if cfg.chat_paths.iter().any(|p| p == path) {
        Some(Api::Chat)
    } else if cfg.completions_paths.iter().any(|p| p == path) {
        Some(Api::Completions)
    } else {
        None
    }
}

impl RequestFilter {
    /// A filter for a new request.
    pub fn new(cfg: Rc<Config>) -> Self {
        Self {
            cfg,
            state: State::Ignored,
            api: Api::Chat,
            request_id: String::new(),
            session: String::new(),
            tenant: String::new(),
            priority: 0,
            model: String::new(),
            stream: false,
            decision: None,
            cause: None,
            token: None,
            t_start: 0,
            t_pick: 0,
            t_first_byte: None,
            status: 0,
            tail: None,
            retained: None,
            elided_through: 0,
            body_size: 0,
            prefill: None,
            prefill_fallback: None,
            first_token_reported: false,
        }
    }

    /// Shares the thread's table of retained conversations: Picks then elide
    /// the messages the control plane said it holds.
    pub fn with_retained(mut self, retained: Rc<Retained>) -> Self {
        self.retained = Some(retained);
        self
    }

    /// The failure cause, if the request took the failure path.
    pub fn cause(&self) -> Option<Cause> {
        self.cause
    }

    /// The decision, if the request was steered.
    pub fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }

    /// The token of the Pick call in flight.
    pub fn pick_token(&self) -> Option<u32> {
        self.token
    }

    /// The token of the prefill leg in flight.
    pub fn prefill_token(&self) -> Option<u32> {
        self.prefill.as_ref().map(|l| l.token)
    }

    /// Why the filter's prefill leg left the request aggregated.
    pub fn prefill_fallback(&self) -> Option<Fallback> {
        self.prefill_fallback
    }

    /// Request headers.
    pub fn on_request_headers(&mut self, host: &impl Host, end_of_stream: bool) -> Action {
        // The client never chooses the worker, nor its data-parallel rank,
        // nor a prefill worker.
        for name in [DESTINATION_HEADER, DP_RANK_HEADER, PREFILLER_HEADER] {
            if host.request_header(name).is_some() {
                host.set_request_header(name, None);
                host.metric(Metric::SpoofedHeaders, 1);
            }
        }
        let post = host.request_header(":method").is_some_and(|m| m == "POST");
        let api = if post { host.request_header(":path").and_then(|p| steered_api(&self.cfg, &p)) } else { None };
        let Some(api) = api else {
            return Action::Continue;
        };
        self.api = api;
        self.t_start = host.now_ns();
        self.request_id = host.request_header("x-request-id").unwrap_or_default();
        // A value that could not be a key (too long, control bytes) is not
        // sent: the request is routed as if it had none.
        let key = |name: &str| {
            if name.is_empty() {
                return String::new();
            }
            host.request_header(name)
                .filter(|v| v.len() <= MAX_SESSION_BYTES && v.bytes().all(|b| (b' '..=b'~').contains(&b)))
                .unwrap_or_default()
        };
        self.session = key(&self.cfg.session_header);
        self.tenant = key(&self.cfg.tenant_header);
        self.priority = key(&self.cfg.priority_header).trim().parse::<u32>().ok().filter(|p| *p <= 9).unwrap_or(0);
        host.metric(Metric::Requests, 1);
        if end_of_stream {
            return self.fail(host, Cause::Malformed, false);
        }
        let too_long = host
            .request_header("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > self.cfg.max_body_bytes as u64);
        if too_long {
            return self.fail(host, Cause::BodyTooLarge, false);
        }
        self.state = State::Buffering;
        Action::Pause
    }

    /// A request body callback; `body_size` is all body buffered so far.
    pub fn on_request_body(&mut self, host: &impl Host, body_size: usize, end_of_stream: bool) -> Action {
        if self.state != State::Buffering {
            return match self.state {
                State::Picking | State::Prefilling | State::Local => Action::Pause,
                _ => Action::Continue,
            };
        }
        if body_size > self.cfg.max_body_bytes {
            return self.fail(host, Cause::BodyTooLarge, false);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.body_size = body_size;
        match self.send_pick(host, true) {
            Ok(()) => Action::Pause,
            Err(cause) => self.fail(host, cause, false),
        }
    }

    /// Extracts the buffered body, encodes the Pick (eliding retained
    /// messages when `elide`) and dispatches it.
    fn send_pick(&mut self, host: &impl Host, elide: bool) -> Result<(), Cause> {
        let body_size = self.body_size;
        let Some(body) = host.request_body(0, body_size) else {
            return Err(Cause::Malformed);
        };
        let e = match extract(&body, self.api) {
            Ok(e) => e,
            Err(crate::extract::ExtractError::Unsupported(_)) => return Err(Cause::Unsupported),
            Err(_) => return Err(Cause::Malformed),
        };
        let (model, lora) = match self.cfg.lora_adapters.get(e.model.as_ref()) {
            Some(base) => (base.as_str(), e.model.as_ref()),
            None => (e.model.as_ref(), ""),
        };
        let meta = RequestMeta {
            request_id: &self.request_id,
            lora_name: lora,
            model,
            body_bytes: u32::try_from(body_size).unwrap_or(u32::MAX),
            session_id: &self.session,
            tenant: &self.tenant,
            priority: self.priority,
        };
        let hashes = chain_hashes(&e);
        let through = if elide { self.retained.as_ref().and_then(|r| r.last_retained(&hashes)) } else { None };
        self.elided_through = through.and_then(|k| hashes.get(k)).copied().unwrap_or(0);
        let msg = encode_pick(&e, self.api, &meta, &hashes, through);
        if self.model.is_empty() {
            self.model.push_str(&e.model);
        }
        self.stream = e.stream;
        drop(e);
        drop(body);
        self.t_pick = host.now_ns();
        match host.dispatch_pick(&self.cfg.grpc_service, &msg, self.cfg.timeout_ms) {
            Some(token) => {
                self.token = Some(token);
                self.state = State::Picking;
                Ok(())
            }
            None => Err(Cause::DispatchFailed),
        }
    }

    /// The Pick call ended: gRPC `status` (0 = OK) and, when OK, the
    /// encoded answer.
    pub fn on_pick_response(&mut self, host: &impl Host, token: u32, status: u32, answer_bytes: Option<&[u8]>) {
        if self.state != State::Picking || self.token != Some(token) {
            return;
        }
        self.token = None;
        let now = host.now_ns();
        let elapsed_us = now.saturating_sub(self.t_pick) / 1000;
        host.metric(Metric::PickLatencyUs, elapsed_us);
        let cause = match status {
            0 => match answer_bytes.map_or(Answer::Unusable, |a| answer(a, self.cfg.max_fallbacks)) {
                Answer::Route(d, retained) => {
                    if let Some(r) = &self.retained {
                        for h in retained {
                            r.insert(h);
                        }
                    }
                    host.set_request_header(DESTINATION_HEADER, Some(&d.header));
                    if let Some(rank) = d.dp_rank {
                        host.set_request_header(DP_RANK_HEADER, Some(&rank.to_string()));
                    }
                    host.metric(Metric::Steered, 1);
                    let prefill = d.prefill.clone();
                    self.decision = Some(d);
                    self.state = State::Forwarded;
                    if let Some(p) = prefill {
                        match self.cfg.disaggregation.legs {
                            Legs::Sidecar => host.set_request_header(PREFILLER_HEADER, Some(&p)),
                            Legs::Filter => match self.start_prefill(host, &p) {
                                // Resumed when the leg answers.
                                Ok(()) => return,
                                Err(f) => self.prefill_failed(host, f),
                            },
                        }
                    }
                    host.resume_request();
                    return;
                }
                // The control plane no longer holds what was elided: once
                // more, in full (a fresh deadline).
                Answer::Resend if self.elided_through != 0 => {
                    if let Some(r) = &self.retained {
                        r.forget(self.elided_through);
                    }
                    host.metric(Metric::PickResends, 1);
                    match self.send_pick(host, false) {
                        Ok(()) => return,
                        Err(cause) => cause,
                    }
                }
                Answer::Refused(retry_after_ms) => {
                    self.refuse(host, retry_after_ms);
                    return;
                }
                Answer::Resend | Answer::Unusable => Cause::UnusableAnswer,
            },
            // DEADLINE_EXCEEDED; CANCELLED, which is what a tonic server
            // answers when the deadline Envoy sent in `grpc-timeout` runs
            // out (it races Envoy's own timer, and wins on a busy gateway);
            // or UNAVAILABLE that Envoy's own timer raised: its status
            // message says so (see `timed_out`).
            1 | 4 => Cause::Timeout,
            14 if self.timed_out(host, elapsed_us) => Cause::Timeout,
            14 => Cause::Unavailable,
            5 => Cause::UnknownModel,
            _ => Cause::GrpcError,
        };
        self.fail(host, cause, true);
    }

    /// Starts the prefill leg on `prefiller` (`ip:port`): the client's body
    /// as a one-token, non-streamed request that asks for a remote decode,
    /// through the worker cluster with the destination header naming it.
    fn start_prefill(&mut self, host: &impl Host, prefiller: &str) -> Result<(), Fallback> {
        let body = host.request_body(0, self.body_size).ok_or(Fallback::NotJson)?;
        let original = pd::parse(&body)?;
        drop(body);
        let leg = serde_json::to_vec(&pd::prefill_body(&original)).map_err(|_| Fallback::NotJson)?;
        let path = host.request_header(":path").unwrap_or_default();
        let auth = host.request_header("authorization");
        let mut headers: Vec<(&str, &str)> = vec![
            (":method", "POST"),
            (":path", &path),
            (":authority", prefiller),
            ("content-type", "application/json"),
            (DESTINATION_HEADER, prefiller),
        ];
        if let Some(a) = &auth {
            headers.push(("authorization", a));
        }
        if !self.request_id.is_empty() {
            headers.push(("x-request-id", &self.request_id));
        }
        let d = &self.cfg.disaggregation;
        let token = host.dispatch_http(&d.cluster, &headers, &leg, d.timeout_ms).ok_or(Fallback::Unreachable)?;
        self.prefill = Some(PrefillLeg { token, started_ns: host.now_ns(), original });
        self.state = State::Prefilling;
        Ok(())
    }

    /// The prefill leg ended: its HTTP `status` (0 = no answer: reset,
    /// refused, timed out) and body (`None` when absent or larger than a
    /// prefill answer can be). With `kv_transfer_params` the body becomes
    /// the decode leg's; otherwise it stays the client's (aggregated).
    /// Either way the request goes on to its decode worker.
    pub fn on_prefill_response(&mut self, host: &impl Host, token: u32, status: u32, body: Option<&[u8]>) {
        if self.state != State::Prefilling || self.prefill_token() != Some(token) {
            return;
        }
        let Some(leg) = self.prefill.take() else { return };
        let elapsed_us = host.now_ns().saturating_sub(leg.started_ns) / 1000;
        host.metric(Metric::PrefillLegUs, elapsed_us);
        let timed_out = at_timeout(elapsed_us, self.cfg.disaggregation.timeout_ms);
        let decode = match status {
            200..=299 => body
                .ok_or(Fallback::NoParams)
                .and_then(|b| pd::decode_body(leg.original, b))
                .and_then(|v| serde_json::to_vec(&v).map_err(|_| Fallback::NoParams)),
            // Envoy's own timer (504, or no answer at all).
            0 | 504 if timed_out => Err(Fallback::Timeout),
            // No answer, or Envoy's own reply that it reached nobody.
            0 => Err(Fallback::Unreachable),
            503 if body.is_some_and(envoy_found_nobody) => Err(Fallback::Unreachable),
            _ => Err(Fallback::Status),
        };
        match decode {
            Ok(bytes) => {
                host.replace_request_body(self.body_size, &bytes);
                host.set_request_header("transfer-encoding", None);
                host.set_request_header("content-length", Some(&bytes.len().to_string()));
                self.body_size = bytes.len();
                host.metric(Metric::PrefillLegs, 1);
            }
            Err(f) => self.prefill_failed(host, f),
        }
        self.state = State::Forwarded;
        host.resume_request();
    }

    /// A disaggregated request is served aggregated: counted, and named in
    /// the debug headers.
    fn prefill_failed(&mut self, host: &impl Host, f: Fallback) {
        self.prefill_fallback = Some(f);
        host.metric(Metric::PrefillFallback(f), 1);
    }

    /// Whether an UNAVAILABLE status is Envoy's own timeout. Envoy says so
    /// in the status message (`…{response_timeout}`); a status sent by the
    /// control plane says `{via_upstream}`, a refused connection names its
    /// own cause. Elapsed time is only the last resort, when the host gives
    /// no message: on a loaded machine an immediate UNAVAILABLE can arrive
    /// late ([`at_timeout`]).
    fn timed_out(&self, host: &impl Host, elapsed_us: u64) -> bool {
        match host.grpc_status_message() {
            Some(m) => m.contains(TIMEOUT_MARK),
            None => at_timeout(elapsed_us, self.cfg.timeout_ms),
        }
    }

    /// The control plane refused the request (every worker saturated):
    /// 429 with `Retry-After` in whole seconds, whatever the failure mode
    /// (this is an answer, not a failure).
    fn refuse(&mut self, host: &impl Host, retry_after_ms: u32) {
        self.state = State::Local;
        host.metric(Metric::Overloaded, 1);
        let secs = retry_after_ms.div_ceil(1000).max(1).to_string();
        let headers = [("content-type", "application/json"), ("retry-after", secs.as_str())];
        host.send_local_response(429, &headers, OVERLOADED_BODY);
    }

    /// The one failure path.
    fn fail(&mut self, host: &impl Host, cause: Cause, paused: bool) -> Action {
        self.cause = Some(cause);
        host.metric(Metric::Fallback(cause), 1);
        match self.cfg.failure_mode {
            FailureMode::Open => {
                self.state = State::Forwarded;
                if paused {
                    host.resume_request();
                }
                Action::Continue
            }
            FailureMode::Closed => {
                self.state = State::Local;
                let mut headers: [(&str, &str); 2] = [("content-type", "application/json"), ("", "")];
                let n = if self.cfg.debug_headers {
                    if let Some(h) = headers.get_mut(1) {
                        *h = (DEBUG_FALLBACK, cause.name());
                    }
                    2
                } else {
                    1
                };
                host.send_local_response(cause.status(), headers.get(..n).unwrap_or(&[]), cause.error_body());
                Action::Pause
            }
        }
    }

    /// Response headers.
    pub fn on_response_headers(&mut self, host: &impl Host) -> Action {
        if self.state != State::Forwarded {
            return Action::Continue;
        }
        self.status = host.response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        if self.cfg.reports.enabled && (200..300).contains(&self.status) {
            self.tail = Some(Tail::new(self.cfg.reports.tail_bytes));
        }
        if self.cfg.debug_headers {
            match (&self.decision, self.cause) {
                (Some(d), _) => {
                    host.add_response_header(DEBUG_ENDPOINT, d.endpoint());
                    host.add_response_header(DEBUG_WORKER, &d.worker_id);
                    host.add_response_header(DEBUG_REASON, d.reason);
                    let mut blocks = String::with_capacity(24);
                    push_u32(&mut blocks, d.matched_blocks);
                    blocks.push('/');
                    push_u32(&mut blocks, d.total_blocks);
                    host.add_response_header(DEBUG_BLOCKS, &blocks);
                    let (best, worker) = &d.passed_over;
                    if *best > d.matched_blocks && !worker.is_empty() {
                        let mut v = String::with_capacity(12 + worker.len());
                        push_u32(&mut v, *best);
                        v.push('@');
                        v.push_str(worker);
                        host.add_response_header(DEBUG_PASSED_OVER, &v);
                    }
                    if let Some(p) = &d.prefill {
                        host.add_response_header(DEBUG_PREFILL, p);
                    }
                    if let Some(f) = self.prefill_fallback {
                        host.add_response_header(DEBUG_PREFILL_FALLBACK, f.label());
                    }
                }
                (None, Some(c)) => {
                    host.add_response_header(DEBUG_REASON, "fallback");
                    host.add_response_header(DEBUG_FALLBACK, c.name());
                }
                (None, None) => {}
            }
        }
        Action::Continue
    }

    /// A response body chunk of `chunk_size` bytes (never delayed).
    pub fn on_response_body(&mut self, host: &impl Host, chunk_size: usize, _end_of_stream: bool) -> Action {
        if self.state != State::Forwarded {
            return Action::Continue;
        }
        if chunk_size > 0 && self.t_first_byte.is_none() {
            self.t_first_byte = Some(host.now_ns());
        }
        if let Some(tail) = self.tail.as_mut() {
            let want = tail.wanted(chunk_size);
            if want > 0
                && let Some(bytes) = host.response_body(chunk_size - want, want)
            {
                tail.push(&bytes);
            }
        }
        Action::Continue
    }

    /// A streamed answer's first body byte arrived: once per request, a
    /// report with its time to first byte and no end (`total_us` 0), so
    /// that the control plane learns the chosen worker's prefill is over
    /// while the stream still runs (a stream decodes for seconds; until its
    /// first token is known the worker counts its prompt as prefill still
    /// to do). Only for a request the control plane routed, answered 2xx,
    /// and with `reports.first_token` on; the end is reported by
    /// [`RequestFilter::finish`] as before.
    pub fn first_token_report(&mut self, host: &impl Host) -> Option<pb::CompletionReport> {
        let r = &self.cfg.reports;
        let due = self.state == State::Forwarded
            && r.enabled
            && r.first_token
            && self.stream
            && !self.first_token_reported
            && (200..300).contains(&self.status)
            && self.decision.is_some()
            && self.t_first_byte.is_some();
        if !due {
            return None;
        }
        self.first_token_reported = true;
        Some(self.report(host, 0))
    }

    /// The stream is over: the completion report of a request that went
    /// upstream through the steering path (steered or failed open).
    pub fn finish(&mut self, host: &impl Host) -> Option<pb::CompletionReport> {
        if self.state != State::Forwarded || !self.cfg.reports.enabled {
            return None;
        }
        let usage = self.tail.as_ref().and_then(|t| find_usage(t.bytes())).unwrap_or_default();
        // Never 0: a report with no end marks a first token only.
        let total_us = (host.now_ns().saturating_sub(self.t_start) / 1000).max(1);
        Some(pb::CompletionReport {
            output_tokens: usage.completion_tokens,
            prompt_tokens: usage.prompt_tokens,
            cached_tokens: usage.cached_tokens,
            ..self.report(host, total_us)
        })
    }

    /// A report of this request as it stands, `total_us` after its start
    /// (0: its first token only), without usage.
    fn report(&self, host: &impl Host, total_us: u64) -> pb::CompletionReport {
        let (worker_id, endpoint) = self
            .decision
            .as_ref()
            .map_or((String::new(), String::new()), |d| (d.worker_id.clone(), d.endpoint().to_owned()));
        pb::CompletionReport {
            request_id: self.request_id.clone(),
            model: self.model.clone(),
            worker_id,
            endpoint,
            status_code: self.status,
            ttfb_us: self.t_first_byte.map_or(0, |t| t.saturating_sub(self.t_start) / 1000),
            total_us,
            stream: self.stream,
            served_endpoint: host.upstream_address().unwrap_or_default(),
            ..Default::default()
        }
    }
}

/// Whether a call that ended after `elapsed_us` ended at its timeout: Envoy's
/// timers run on the event loop's cached clock and fire up to a few ms early
/// (seen: 398.6 ms for 400 ms), hence 10 % slack, at least 5 ms.
fn at_timeout(elapsed_us: u64, timeout_ms: u32) -> bool {
    let timeout_us = u64::from(timeout_ms) * 1000;
    elapsed_us + (timeout_us / 10).max(5000) >= timeout_us
}

/// Envoy's local reply when a call found no upstream to talk to (connect
/// failure, reset before headers, no healthy host).
fn envoy_found_nobody(body: &[u8]) -> bool {
    body.starts_with(b"upstream connect error") || body.starts_with(b"no healthy upstream")
}

fn push_u32(s: &mut String, mut v: u32) {
    let mut d = [0u8; 10];
    let mut i = d.len();
    loop {
        i -= 1;
        if let Some(x) = d.get_mut(i) {
            *x = b'0' + (v % 10) as u8;
        }
        v /= 10;
        if v == 0 || i == 0 {
            break;
        }
    }
    for &b in d.get(i..).unwrap_or(&[]) {
        s.push(char::from(b));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::{Call, MockHost};
    use prost::Message as _;

    fn cfg(extra: &str) -> Rc<Config> {
        Rc::new(Config::parse(format!("{{\"debug_headers\":true{extra}}}").as_bytes()).unwrap())
    }

    const CHAT: &[u8] = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}"#;

    fn answer(endpoint: &str) -> Vec<u8> {
        pb::PickResponse {
            endpoint: endpoint.into(),
            fallbacks: vec!["10.0.0.9:80".into()],
            worker_id: "w1".into(),
            matched_blocks: 2,
            total_blocks: 3,
            reason: pb::PickReason::Kv as i32,
            mode: "kv".into(),
            ..Default::default()
        }
        .encode_to_vec()
    }

    /// Turn 1 is sent in full and the control plane says it retains it;
    /// turn 2 elides those messages; a `resend` answer (the control plane
    /// lost them) sends turn 2 again in full and forgets the hash; a resend
    /// to a request that elided nothing is unusable.
    #[test]
    fn retained_messages_are_elided_and_resent_on_demand() {
        let retained = Rc::new(Retained::new(64));
        let turn1 = br#"{"model":"m","messages":[{"role":"system","content":"long"},{"role":"user","content":"q1"}]}"#;
        let turn2 = br#"{"model":"m","messages":[{"role":"system","content":"long"},{"role":"user","content":"q1"},{"role":"assistant","content":"a1"},{"role":"user","content":"q2"}]}"#;
        let h = MockHost::post("/v1/chat/completions");
        let mut f = RequestFilter::new(cfg("")).with_retained(retained.clone());
        let t = to_pick(&mut f, &h, turn1);
        let req = pb::PickRequest::decode(h.picks()[0].as_slice()).unwrap();
        assert!(req.segments.iter().all(|s| !s.elided && !s.message_json.is_empty()));
        let keep = req.segments[1].chain_hash;
        let mut a = pb::PickResponse::decode(answer("10.0.0.1:8000").as_slice()).unwrap();
        a.retained_chain_hashes = vec![keep];
        f.on_pick_response(&h, t, 0, Some(&a.encode_to_vec()));
        assert!(retained.contains(keep));

        let h = MockHost::post("/v1/chat/completions");
        let mut f = RequestFilter::new(cfg("")).with_retained(retained.clone());
        let t = to_pick(&mut f, &h, turn2);
        let req = pb::PickRequest::decode(h.picks()[0].as_slice()).unwrap();
        let elided: Vec<bool> = req.segments.iter().map(|s| s.elided).collect();
        assert_eq!(elided, [true, true, false, false]);
        assert!(req.segments[..2].iter().all(|s| s.message_json.is_empty()));
        assert_eq!(req.segments[1].chain_hash, keep, "hashes are still sent");
        let resend = pb::PickResponse { resend: true, ..Default::default() }.encode_to_vec();
        f.on_pick_response(&h, t, 0, Some(&resend));
        assert_eq!(h.metric_value(Metric::PickResends), 1);
        assert!(!retained.contains(keep), "forgotten");
        let again = pb::PickRequest::decode(h.picks()[1].as_slice()).unwrap();
        assert!(again.segments.iter().all(|s| !s.elided && !s.message_json.is_empty()));
        let t2 = f.pick_token().unwrap();
        assert_ne!(t2, t);
        f.on_pick_response(&h, t2, 0, Some(&answer("10.0.0.2:8000")));
        assert_eq!(h.request_header(DESTINATION_HEADER).as_deref(), Some("10.0.0.2:8000,10.0.0.9:80"));
        assert_eq!(f.cause(), None);

        // Nothing elided: a resend answer is unusable (fail open).
        let h = MockHost::post("/v1/chat/completions");
        let mut f = RequestFilter::new(cfg("")).with_retained(retained);
        let t = to_pick(&mut f, &h, turn1);
        f.on_pick_response(&h, t, 0, Some(&resend));
        assert_eq!(f.cause(), Some(Cause::UnusableAnswer));
        assert_eq!(h.picks().len(), 1);
    }

    /// Runs a request up to the Pick call; returns its token.
    fn to_pick(f: &mut RequestFilter, h: &MockHost, body: &[u8]) -> u32 {
        assert_eq!(f.on_request_headers(h, false), Action::Pause);
        h.set_body(body);
        assert_eq!(f.on_request_body(h, body.len() / 2, false), Action::Pause);
        assert_eq!(f.on_request_body(h, body.len(), true), Action::Pause);
        f.pick_token().unwrap()
    }

    #[test]
    fn steers_and_reports() {
        let h = MockHost::post("/v1/chat/completions?x=1");
        h.set_request_header("x-gateway-destination-endpoint", Some("6.6.6.6:1"));
        h.set_request_header("x-request-id", Some("r1"));
        let mut f = RequestFilter::new(cfg(""));
        let t = to_pick(&mut f, &h, CHAT);
        assert_eq!(h.request_header(DESTINATION_HEADER), None, "spoofed header removed");
        let sent = h.picks();
        let req = pb::PickRequest::decode(sent[0].as_slice()).unwrap();
        assert_eq!((req.request_id.as_str(), req.model.as_str(), req.stream), ("r1", "m", true));
        assert_eq!(req.segments[0].message_json, br#"{"role":"user","content":"hello"}"#);
        h.advance_us(300);
        f.on_pick_response(&h, t, 0, Some(&answer("10.0.0.1:8000")));
        assert_eq!(h.request_header(DESTINATION_HEADER).as_deref(), Some("10.0.0.1:8000,10.0.0.9:80"));
        assert!(h.calls().contains(&Call::Resume));
        assert_eq!(h.metric_value(Metric::Steered), 1);
        assert_eq!(h.metric_value(Metric::SpoofedHeaders), 1);
        assert_eq!(h.metric_value(Metric::PickLatencyUs), 300);
        // Response: SSE through, usage at the end.
        h.set_response_header(":status", "200");
        assert_eq!(f.on_response_headers(&h), Action::Continue);
        assert_eq!(h.response_headers_added(DEBUG_BLOCKS).as_deref(), Some("2/3"));
        assert_eq!(h.response_headers_added(DEBUG_PASSED_OVER), None, "nothing larger was passed over");
        assert_eq!(h.response_headers_added(DEBUG_REASON).as_deref(), Some("kv"));
        assert_eq!(f.first_token_report(&h), None, "no byte yet");
        h.advance_us(1000);
        let first = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
        h.set_response_chunk(first);
        assert_eq!(f.on_response_body(&h, first.len(), false), Action::Continue);
        // The first token is reported while the stream runs, once.
        let ft = f.first_token_report(&h).unwrap();
        assert_eq!(
            (ft.request_id.as_str(), ft.worker_id.as_str(), ft.endpoint.as_str()),
            ("r1", "w1", "10.0.0.1:8000")
        );
        assert_eq!((ft.ttfb_us, ft.total_us, ft.status_code, ft.stream), (1300, 0, 200, true));
        assert_eq!(ft.output_tokens, None);
        assert_eq!(f.first_token_report(&h), None, "once");
        h.advance_us(5000);
        let last = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n";
        h.set_response_chunk(last);
        assert_eq!(f.on_response_body(&h, last.len(), true), Action::Continue);
        // Envoy retried on a fallback: the report names the host that served.
        h.set_upstream_address("10.0.0.2:8000");
        let r = f.finish(&h).unwrap();
        assert_eq!((r.worker_id.as_str(), r.endpoint.as_str(), r.status_code), ("w1", "10.0.0.1:8000", 200));
        assert_eq!(r.served_endpoint, "10.0.0.2:8000");
        assert_eq!((r.ttfb_us, r.total_us), (1300, 6300));
        assert_eq!((r.prompt_tokens, r.output_tokens, r.cached_tokens), (Some(9), Some(4), Some(0)));
        assert!(r.stream);
    }

    /// No first-token report without a stream, a routed worker, a 2xx
    /// answer or the setting: the end report alone.
    #[test]
    fn a_first_token_is_reported_only_for_a_routed_stream() {
        let first_report = |extra: &str, body: &[u8], status: &str, routed: bool| {
            let h = MockHost::post("/v1/chat/completions");
            let mut f = RequestFilter::new(cfg(extra));
            let t = to_pick(&mut f, &h, body);
            match routed {
                true => f.on_pick_response(&h, t, 0, Some(&answer("10.0.0.1:8000"))),
                false => f.on_pick_response(&h, t, 14, None),
            }
            h.set_response_header(":status", status);
            f.on_response_headers(&h);
            h.advance_us(700);
            h.set_response_chunk(b"data: {}\n\n");
            f.on_response_body(&h, 10, false);
            let ft = f.first_token_report(&h);
            assert!(f.finish(&h).is_some_and(|r| r.total_us > 0), "the end is always reported");
            ft.map(|r| r.ttfb_us)
        };
        assert_eq!(first_report("", CHAT, "200", true), Some(700));
        let plain = br#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#;
        assert_eq!(first_report("", plain, "200", true), None, "not a stream");
        assert_eq!(first_report("", CHAT, "500", true), None, "an error");
        assert_eq!(first_report("", CHAT, "200", false), None, "failed open: no worker of the control plane's");
        assert_eq!(first_report(r#","reports":{"first_token":false}"#, CHAT, "200", true), None, "off");
    }

    /// A request steered with the answer `edit` makes of a plain one, the
    /// client having sent its own `header: spoofed`: the header as the
    /// engine receives it (the client's is always removed and counted).
    fn steered_header(header: &str, spoofed: &str, edit: impl FnOnce(&mut pb::PickResponse)) -> Option<String> {
        let h = MockHost::post("/v1/chat/completions");
        h.set_request_header(header, Some(spoofed));
        let mut f = RequestFilter::new(cfg(""));
        let t = to_pick(&mut f, &h, CHAT);
        assert_eq!(h.request_header(header), None, "the client's {header} is removed");
        let mut a = pb::PickResponse::decode(answer("10.0.0.1:8000").as_slice()).unwrap();
        edit(&mut a);
        f.on_pick_response(&h, t, 0, Some(&a.encode_to_vec()));
        assert_eq!(h.metric_value(Metric::SpoofedHeaders), 1);
        assert!(h.request_header(DESTINATION_HEADER).is_some_and(|d| d.starts_with("10.0.0.1:8000")));
        h.request_header(header)
    }

    /// A worker that is one data-parallel rank of its server: the rank goes
    /// to vLLM in `x-data-parallel-rank`; a client's own rank header never
    /// reaches the engine, steered or not.
    #[test]
    fn a_data_parallel_rank_goes_in_the_rank_header() {
        let steer = |rank: Option<u32>| steered_header(DP_RANK_HEADER, "7", |a| a.data_parallel_rank = rank);
        assert_eq!(steer(Some(3)).as_deref(), Some("3"));
        assert_eq!(steer(Some(0)).as_deref(), Some("0"));
        assert_eq!(steer(None), None);
    }

    /// A disaggregated decision names its prefill worker in
    /// `x-prefiller-host-port` (llm-d's convention); a client's own never
    /// reaches the decode side, and an unusable one is not sent.
    #[test]
    fn a_prefill_worker_goes_in_the_prefiller_header() {
        let steer = |p: &str| steered_header(PREFILLER_HEADER, "6.6.6.6:80", |a| a.prefill_endpoint = p.to_owned());
        assert_eq!(steer("10.0.0.9:8000").as_deref(), Some("10.0.0.9:8000"));
        assert_eq!(steer(""), None);
        assert_eq!(steer("10.0.0.9:8000\r\nx-evil: 1"), None);
    }

    const PREFILL_ANSWER: &[u8] = br#"{"id":"c1","choices":[{"text":"x"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e7","remote_block_ids":[4,5],"remote_host":"10.0.0.9","remote_port":5600}}"#;

    /// A request the control plane disaggregates, with the filter running
    /// the legs: up to its prefill call; returns the host, filter and token.
    fn to_prefill_leg() -> (MockHost, RequestFilter, u32) {
        let h = MockHost::post("/v1/chat/completions");
        h.set_request_header("x-request-id", Some("r9"));
        h.set_request_header("authorization", Some("Bearer k"));
        let mut f = RequestFilter::new(cfg(r#","disaggregation":{"legs":"filter","timeout_ms":30000}"#));
        let t = to_pick(&mut f, &h, CHAT);
        let mut a = pb::PickResponse::decode(answer("10.0.0.1:8000").as_slice()).unwrap();
        a.prefill_endpoint = "10.0.0.9:8000".into();
        f.on_pick_response(&h, t, 0, Some(&a.encode_to_vec()));
        let token = f.prefill_token().expect("a prefill leg in flight");
        (h, f, token)
    }

    /// Legs in the filter: the prefill leg goes through the worker cluster
    /// to the prefill worker (one token, not streamed, a remote decode); the
    /// request waits; the answer's `kv_transfer_params` make the body of the
    /// decode leg, which goes to the decode worker; no prefiller header.
    #[test]
    fn the_filter_runs_the_prefill_leg_and_sends_the_decode_leg() {
        let (h, mut f, token) = to_prefill_leg();
        assert!(!h.calls().contains(&Call::Resume), "the request waits for its prefill leg");
        assert_eq!(f.on_request_body(&h, CHAT.len(), true), Action::Pause);
        assert_eq!(h.request_header(PREFILLER_HEADER), None, "no sidecar is told");
        let calls = h.http_calls();
        let (cluster, headers, body) = &calls[0];
        assert_eq!(cluster, "kvgate_prefill");
        let header = |k: &str| headers.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(header(DESTINATION_HEADER), Some("10.0.0.9:8000"));
        assert_eq!((header(":path"), header(":authority")), (Some("/v1/chat/completions"), Some("10.0.0.9:8000")));
        assert_eq!((header("x-request-id"), header("authorization")), (Some("r9"), Some("Bearer k")));
        let leg: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!((leg["max_tokens"].as_u64(), leg["stream"].as_bool()), (Some(1), Some(false)));
        assert_eq!(leg["kv_transfer_params"]["do_remote_decode"].as_bool(), Some(true));

        h.advance_us(40_000);
        f.on_prefill_response(&h, token + 1, 200, Some(PREFILL_ANSWER));
        assert!(!h.calls().contains(&Call::Resume), "another call's answer is ignored");
        f.on_prefill_response(&h, token, 200, Some(PREFILL_ANSWER));
        assert!(h.calls().contains(&Call::Resume));
        let decode: serde_json::Value = serde_json::from_slice(&h.body()).unwrap();
        let k = &decode["kv_transfer_params"];
        assert_eq!((k["do_remote_prefill"].as_bool(), k["remote_engine_id"].as_str()), (Some(true), Some("e7")));
        assert_eq!(decode["stream"].as_bool(), Some(true), "the client's request otherwise");
        assert_eq!(h.request_header("content-length"), Some(h.body().len().to_string()));
        assert_eq!(h.request_header(DESTINATION_HEADER).as_deref(), Some("10.0.0.1:8000,10.0.0.9:80"));
        assert_eq!((h.metric_value(Metric::PrefillLegs), h.metric_value(Metric::PrefillLegUs)), (1, 40_000));
        h.set_response_header(":status", "200");
        f.on_response_headers(&h);
        assert_eq!(h.response_headers_added(DEBUG_PREFILL).as_deref(), Some("10.0.0.9:8000"));
        assert_eq!(h.response_headers_added(DEBUG_PREFILL_FALLBACK), None);
        assert_eq!(f.finish(&h).unwrap().worker_id, "w1");
    }

    /// Every way a prefill leg can fail leaves the client's body untouched
    /// and sends it on to its decode worker (aggregated), counted by cause.
    #[test]
    fn a_failed_prefill_leg_leaves_the_request_aggregated() {
        let connect =
            &b"upstream connect error or disconnect/reset before headers. reset reason: connection failure"[..];
        for (status, body, after_ms, cause) in [
            (0, None, 3, Fallback::Unreachable),
            (0, None, 30_000, Fallback::Timeout),
            (504, Some(&b"upstream request timeout"[..]), 29_900, Fallback::Timeout),
            (504, Some(&b"gateway timeout"[..]), 10, Fallback::Status),
            (503, Some(connect), 2, Fallback::Unreachable),
            (503, Some(&br#"{"error":"busy"}"#[..]), 2, Fallback::Status),
            (400, Some(&br#"{"error":"bad"}"#[..]), 2, Fallback::Status),
            (200, Some(&br#"{"choices":[]}"#[..]), 2, Fallback::NoParams),
            (200, None, 2, Fallback::NoParams),
        ] {
            let (h, mut f, token) = to_prefill_leg();
            h.advance_us(after_ms * 1000);
            f.on_prefill_response(&h, token, status, body);
            assert_eq!(f.prefill_fallback(), Some(cause), "status {status} after {after_ms} ms");
            assert_eq!(h.body(), CHAT, "untouched");
            assert!(h.calls().contains(&Call::Resume));
            assert_eq!(h.metric_value(Metric::PrefillFallback(cause)), 1);
            assert_eq!(h.metric_value(Metric::PrefillLegs), 0);
            h.set_response_header(":status", "200");
            f.on_response_headers(&h);
            assert_eq!(h.response_headers_added(DEBUG_PREFILL_FALLBACK).as_deref(), Some(cause.label()));
            assert_eq!(f.cause(), None, "steered all the same");
        }
        // The call cannot even start: on at once, aggregated.
        let h = MockHost::post("/v1/chat/completions");
        h.refuse_http_calls();
        let mut f = RequestFilter::new(cfg(r#","disaggregation":{"legs":"filter"}"#));
        let t = to_pick(&mut f, &h, CHAT);
        let mut a = pb::PickResponse::decode(answer("10.0.0.1:8000").as_slice()).unwrap();
        a.prefill_endpoint = "10.0.0.9:8000".into();
        f.on_pick_response(&h, t, 0, Some(&a.encode_to_vec()));
        assert_eq!(f.prefill_fallback(), Some(Fallback::Unreachable));
        assert!(h.calls().contains(&Call::Resume));
    }

    proptest::proptest! {
        /// Any status and any answer to a prefill leg: the request resumes
        /// exactly once, to its decode worker, with either the client's
        /// body untouched or a decode leg that asks for the remote prefill.
        #[test]
        fn any_prefill_answer_resumes_once(status in 0u32..700, answer in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
                                           wrap in proptest::prelude::any::<bool>()) {
            let (h, mut f, token) = to_prefill_leg();
            let answer = if wrap {
                format!(r#"{{"kv_transfer_params":{}}}"#, String::from_utf8_lossy(&answer)).into_bytes()
            } else {
                answer
            };
            f.on_prefill_response(&h, token, status, Some(&answer));
            f.on_prefill_response(&h, token, status, Some(&answer));
            proptest::prop_assert_eq!(h.calls().iter().filter(|c| **c == Call::Resume).count(), 1);
            match f.prefill_fallback() {
                Some(_) => proptest::prop_assert_eq!(h.body(), CHAT.to_vec()),
                None => {
                    let v: serde_json::Value = serde_json::from_slice(&h.body()).unwrap();
                    proptest::prop_assert_eq!(v["kv_transfer_params"]["do_remote_prefill"].as_bool(), Some(true));
                }
            }
        }
    }

    #[test]
    fn the_session_header_goes_with_the_pick_when_usable() {
        let sent = |config: &str, value: Option<&str>| {
            let h = MockHost::post("/v1/chat/completions");
            h.set_request_header("x-session-id", value);
            h.set_request_header("x-conv", Some("c-9"));
            let mut f = RequestFilter::new(cfg(config));
            to_pick(&mut f, &h, CHAT);
            pb::PickRequest::decode(h.picks()[0].as_slice()).unwrap().session_id
        };
        assert_eq!(sent("", Some("chat-42")), "chat-42");
        assert_eq!(sent("", None), "");
        assert_eq!(sent("", Some(&"s".repeat(MAX_SESSION_BYTES + 1))), "", "too long: not a key");
        assert_eq!(sent("", Some("a\u{7f}b")), "", "control bytes: not a key");
        assert_eq!(sent(r#","session_header":"x-conv""#, Some("chat-42")), "c-9");
        assert_eq!(sent(r#","session_header":"""#, Some("chat-42")), "", "none configured");
    }

    #[test]
    fn a_refusal_is_a_429_with_retry_after_in_either_failure_mode() {
        for mode in ["", r#","failure_mode":"closed""#] {
            let h = MockHost::post("/v1/chat/completions");
            h.set_request_header("x-tenant-id", Some("team-a"));
            h.set_request_header("x-priority", Some("7"));
            let mut f = RequestFilter::new(cfg(mode));
            let t = to_pick(&mut f, &h, CHAT);
            let req = pb::PickRequest::decode(h.picks()[0].as_slice()).unwrap();
            assert_eq!((req.tenant.as_str(), req.priority), ("team-a", 7));
            let refused = pb::PickResponse { retry_after_ms: 2_500, ..Default::default() }.encode_to_vec();
            f.on_pick_response(&h, t, 0, Some(&refused));
            let (status, body) = h.local_response().unwrap();
            assert_eq!(status, 429);
            assert!(String::from_utf8_lossy(&body).contains("rate_limit_error"));
            assert!(h.calls().contains(&Call::LocalHeader("retry-after".into(), "3".into())));
            assert_eq!((h.metric_value(Metric::Overloaded), f.cause()), (1, None), "an answer, not a failure");
            assert_eq!(h.request_header(DESTINATION_HEADER), None);
        }
        // A priority that is not one digit is 0.
        let h = MockHost::post("/v1/chat/completions");
        h.set_request_header("x-priority", Some("high"));
        let mut f = RequestFilter::new(cfg(""));
        to_pick(&mut f, &h, CHAT);
        assert_eq!(pb::PickRequest::decode(h.picks()[0].as_slice()).unwrap().priority, 0);
    }

    #[test]
    fn every_grpc_failure_fails_open_with_its_cause() {
        // Envoy 1.40's messages: its own timer, a status the server sent,
        // a refused connection.
        let own_timeout = Some("upstream request timeout{response_timeout}");
        let from_server = Some("no%20worker{via_upstream}");
        let refused = Some("upstream connect error or disconnect/reset before headers{remote_connection_failure}");
        for (status, message, answer_bytes, after_us, cause) in [
            (14, own_timeout, None, 50_000, Cause::Timeout),
            // The message decides, not the clock: a loaded machine can
            // deliver the server's immediate UNAVAILABLE late, and a timer
            // can fire early.
            (14, from_server, None, 50_000, Cause::Unavailable),
            (14, refused, None, 49_000, Cause::Unavailable),
            (14, own_timeout, None, 40_000, Cause::Timeout),
            // No message: the clock, with 10 % slack.
            (14, None, None, 45_000, Cause::Timeout),
            (14, None, None, 100, Cause::Unavailable),
            (4, None, None, 10, Cause::Timeout),
            // The server's own end of the deadline (tonic's words).
            (1, Some("Timeout%20expired{via_upstream}"), None, 50_000, Cause::Timeout),
            (5, from_server, None, 100, Cause::UnknownModel),
            (13, from_server, None, 100, Cause::GrpcError),
            (0, None, Some(answer("")), 100, Cause::UnusableAnswer),
            (0, None, Some(vec![0xff; 3]), 100, Cause::UnusableAnswer),
        ] {
            let h = MockHost::post("/v1/chat/completions");
            h.set_grpc_message(message);
            let mut f = RequestFilter::new(cfg(""));
            let t = to_pick(&mut f, &h, CHAT);
            h.advance_us(after_us);
            f.on_pick_response(&h, t, status, answer_bytes.as_deref());
            assert_eq!(f.cause(), Some(cause), "status {status} {message:?} after {after_us} us");
            assert_eq!(h.request_header(DESTINATION_HEADER), None);
            assert!(h.calls().contains(&Call::Resume));
            assert_eq!(h.metric_value(Metric::Fallback(cause)), 1);
            h.set_response_header(":status", "200");
            f.on_response_headers(&h);
            assert_eq!(h.response_headers_added(DEBUG_FALLBACK).as_deref(), Some(cause.name()));
            let r = f.finish(&h).unwrap();
            assert_eq!(r.worker_id, "");
        }
    }

    #[test]
    fn fail_closed_answers_locally() {
        let h = MockHost::post("/v1/chat/completions");
        let mut f = RequestFilter::new(cfg(r#","failure_mode":"closed""#));
        let t = to_pick(&mut f, &h, CHAT);
        f.on_pick_response(&h, t, 14, None);
        let (status, body) = h.local_response().unwrap();
        assert_eq!(status, 503);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["kvgate_cause"], "unavailable");
        assert!(!h.calls().contains(&Call::Resume));
        assert!(f.finish(&h).is_none());
        // Malformed body, fail-closed: a precise 400 at end of body.
        let h = MockHost::post("/v1/chat/completions");
        let mut f = RequestFilter::new(cfg(r#","failure_mode":"closed""#));
        f.on_request_headers(&h, false);
        h.set_body(b"{nope");
        assert_eq!(f.on_request_body(&h, 5, true), Action::Pause);
        assert_eq!(h.local_response().unwrap().0, 400);
    }

    #[test]
    fn body_problems_pass_through_untouched() {
        // Malformed, unsupported, too large (by header and by size), no body.
        let cases: [(&[u8], Cause); 3] = [
            (b"{not json", Cause::Malformed),
            (br#"{"model":"m","messages":"x"}"#, Cause::Malformed),
            (br#"{"model":"m","prompt":["a","b"]}"#, Cause::Unsupported),
        ];
        for (body, cause) in cases {
            let path = if cause == Cause::Unsupported { "/v1/completions" } else { "/v1/chat/completions" };
            let h = MockHost::post(path);
            let mut f = RequestFilter::new(cfg(""));
            f.on_request_headers(&h, false);
            h.set_body(body);
            assert_eq!(f.on_request_body(&h, body.len(), true), Action::Continue);
            assert_eq!(f.cause(), Some(cause));
            assert!(h.picks().is_empty());
            assert!(h.calls().iter().all(|c| !matches!(c, Call::SetRequestHeader(..) | Call::Local(..))));
        }
        let h = MockHost::post("/v1/chat/completions");
        h.set_request_header("content-length", Some("99999999"));
        let mut f = RequestFilter::new(cfg(r#","max_body_bytes":1024"#));
        assert_eq!(f.on_request_headers(&h, false), Action::Continue);
        assert_eq!(f.cause(), Some(Cause::BodyTooLarge));
        assert_eq!(f.on_request_body(&h, 5000, false), Action::Continue);
        let h = MockHost::post("/v1/chat/completions");
        let mut f = RequestFilter::new(cfg(r#","max_body_bytes":1024"#));
        assert_eq!(f.on_request_headers(&h, false), Action::Pause);
        assert_eq!(f.on_request_body(&h, 1000, false), Action::Pause);
        assert_eq!(f.on_request_body(&h, 2000, false), Action::Continue);
        assert_eq!(f.cause(), Some(Cause::BodyTooLarge));
        assert_eq!(f.on_request_body(&h, 3000, true), Action::Continue);
        let h = MockHost::post("/v1/chat/completions");
        let mut f = RequestFilter::new(cfg(""));
        assert_eq!(f.on_request_headers(&h, true), Action::Continue);
        assert_eq!(f.cause(), Some(Cause::Malformed));
    }

    #[test]
    fn other_paths_and_methods_are_untouched_but_lose_a_spoofed_header() {
        for (method, path) in [("GET", "/v1/chat/completions"), ("POST", "/v1/embeddings"), ("GET", "/v1/models")] {
            let h = MockHost::new(method, path);
            h.set_request_header(DESTINATION_HEADER, Some("1.2.3.4:5"));
            let mut f = RequestFilter::new(cfg(""));
            assert_eq!(f.on_request_headers(&h, false), Action::Continue);
            assert_eq!(f.on_request_body(&h, 10, true), Action::Continue);
            assert_eq!(h.request_header(DESTINATION_HEADER), None);
            assert_eq!(h.metric_value(Metric::Requests), 0);
            h.set_response_header(":status", "200");
            f.on_response_headers(&h);
            assert!(f.finish(&h).is_none());
        }
    }

    #[test]
    fn lora_adapter_asks_for_its_base_model() {
        let h = MockHost::post("/v1/completions");
        let mut f = RequestFilter::new(cfg(r#","lora_adapters":{"sql":"base"}"#));
        to_pick(&mut f, &h, br#"{"model":"sql","prompt":[1,2,3],"max_tokens":5}"#);
        let req = pb::PickRequest::decode(h.picks()[0].as_slice()).unwrap();
        assert_eq!((req.model.as_str(), req.lora_name.as_str(), req.max_tokens), ("base", "sql", Some(5)));
        assert_eq!(req.prompt, Some(pb::pick_request::Prompt::PromptTokenIds(pb::TokenIds { ids: vec![1, 2, 3] })));
    }

    #[test]
    fn a_stale_or_unknown_token_is_ignored() {
        let h = MockHost::post("/v1/chat/completions");
        let mut f = RequestFilter::new(cfg(""));
        let t = to_pick(&mut f, &h, CHAT);
        f.on_pick_response(&h, t + 1, 0, Some(&answer("1.1.1.1:1")));
        assert_eq!(h.request_header(DESTINATION_HEADER), None);
        f.on_pick_response(&h, t, 0, Some(&answer("1.1.1.1:1")));
        f.on_pick_response(&h, t, 14, None);
        assert_eq!(f.cause(), None);
        assert_eq!(h.calls().iter().filter(|c| **c == Call::Resume).count(), 1);
    }

    #[test]
    fn dispatch_failure() {
        let h = MockHost::post("/v1/chat/completions");
        h.refuse_dispatch();
        let mut f = RequestFilter::new(cfg(""));
        f.on_request_headers(&h, false);
        h.set_body(CHAT);
        assert_eq!(f.on_request_body(&h, CHAT.len(), true), Action::Continue);
        assert_eq!(f.cause(), Some(Cause::DispatchFailed));
    }

    #[test]
    fn numbers_print() {
        for v in [0u32, 7, 10, 4_294_967_295] {
            let mut s = String::new();
            push_u32(&mut s, v);
            assert_eq!(s, v.to_string());
        }
    }
}
