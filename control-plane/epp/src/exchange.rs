//! One HTTP request's conversation with the data plane (an ext_proc
//! stream): a synchronous state machine, each message in, the answers out.
//! The decision is taken once, when the body is complete (or at the
//! headers when there is no body to read), with the filter's extraction and
//! hashing and the core's Pick.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kvgate_core::{App, PickError};
use kvgate_filter_core::extract::{Api, ExtractError, extract};
use kvgate_filter_core::pick::{RequestMeta, chain_hashes, pick_request};
use kvgate_filter_core::usage::{Tail, find_usage};
use kvgate_protocol::pb;

use crate::answers::{
    answer, body_continue, destination, echo_request, header_text, metadata, micros, model_of, openai_error,
    subset_hint,
};
use crate::ext_proc::{
    self as xp, BodyMutation, BodyResponse, BodySendMode, CommonResponse, HeadersResponse, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation, processing_request,
    processing_response,
};
use crate::{EppMetrics, Outcome, TAIL_BYTES};

/// A decision about where the request goes.
pub(crate) enum Decision {
    /// Set the destination to this header value.
    /// (with the data-parallel rank and a disaggregated request's prefill
    /// worker, when the decision names them).
    Route { header: String, dp_rank: Option<u32>, prefill: Option<String> },
    /// Answer locally.
    Reply(ImmediateResponse),
}

/// One HTTP request's conversation with the data plane: a synchronous state
/// machine, each message in, the answers out.
pub(crate) struct Exchange {
    app: Arc<App>,
    metrics: EppMetrics,
    observe_only: bool,
    request_mode: i32,
    response_mode: i32,
    method: String,
    path: String,
    request_id: String,
    /// `x-session-id`, when usable as a session key.
    session: String,
    subset: Option<Vec<String>>,
    /// The request body, while it is read.
    body: Vec<u8>,
    /// Full duplex: the headers answer is held until the body is complete.
    holding_headers: bool,
    decided: bool,
    model: String,
    worker_id: String,
    endpoint: String,
    stream: bool,
    t_start: Instant,
    t_first_byte: Option<Instant>,
    status: u32,
    tail: Tail,
    /// A request that went upstream through a pick is reported.
    report: bool,
    first_token_sent: bool,
    finished: bool,
}

static IDS: AtomicU64 = AtomicU64::new(0);

impl Exchange {
    pub(crate) fn new(app: Arc<App>, metrics: EppMetrics) -> Self {
        Self {
            app,
            metrics,
            observe_only: false,
            request_mode: BodySendMode::None as i32,
            response_mode: BodySendMode::None as i32,
            method: String::new(),
            path: String::new(),
            request_id: String::new(),
            session: String::new(),
            subset: None,
            body: Vec::new(),
            holding_headers: false,
            decided: false,
            model: String::new(),
            worker_id: String::new(),
            endpoint: String::new(),
            stream: false,
            t_start: Instant::now(),
            t_first_byte: None,
            status: 0,
            tail: Tail::new(TAIL_BYTES),
            report: false,
            first_token_sent: false,
            finished: false,
        }
    }

    /// Request body bytes read so far (not yet decided on).
    pub(crate) fn buffered_bytes(&self) -> usize {
        self.body.len()
    }

    pub(crate) fn on_message(&mut self, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
        if let Some(pc) = &msg.protocol_config {
            self.request_mode = pc.request_body_mode;
            self.response_mode = pc.response_body_mode;
        }
        if msg.observability_mode {
            self.observe_only = true;
        }
        if self.subset.is_none() {
            self.subset = subset_hint(msg.metadata_context.as_ref());
        }
        let answers = match msg.request {
            Some(processing_request::Request::RequestHeaders(h)) => self.on_request_headers(h),
            Some(processing_request::Request::RequestBody(b)) => self.on_request_body(b),
            Some(processing_request::Request::RequestTrailers(_)) => self.on_request_trailers(),
            Some(processing_request::Request::ResponseHeaders(h)) => self.on_response_headers(h),
            Some(processing_request::Request::ResponseBody(b)) => self.on_response_body(b),
            Some(processing_request::Request::ResponseTrailers(_)) => {
                vec![answer(processing_response::Response::ResponseTrailers(TrailersResponse::default()))]
            }
            None => Vec::new(),
        };
        // In observability mode answers are ignored: send none.
        if self.observe_only { Vec::new() } else { answers }
    }

    fn full_duplex(&self) -> bool {
        self.request_mode == BodySendMode::FullDuplexStreamed as i32
    }

    fn on_request_headers(&mut self, h: xp::HttpHeaders) -> Vec<ProcessingResponse> {
        self.t_start = Instant::now();
        for hv in h.headers.map(|m| m.headers).unwrap_or_default() {
            let value = header_text(&hv);
            match hv.key.as_str() {
                ":method" => self.method = value,
                ":path" => self.path = value,
                "x-request-id" => self.request_id = value,
                // The filter's default session header, with its rules.
                "x-session-id"
                    if value.len() <= kvgate_filter_core::filter::MAX_SESSION_BYTES
                        && value.bytes().all(|b| (b' '..=b'~').contains(&b)) =>
                {
                    self.session = value
                }
                _ => {}
            }
        }
        if self.request_id.is_empty() {
            self.request_id = format!("epp-{}-{}", self.app.config.replica_id, IDS.fetch_add(1, Ordering::Relaxed));
        }
        let reads_body = matches!(
            BodySendMode::try_from(self.request_mode),
            Ok(BodySendMode::Buffered | BodySendMode::BufferedPartial | BodySendMode::FullDuplexStreamed)
        );
        let routed_path = self.api().is_some() && self.method == "POST";
        if h.end_of_stream || !routed_path || !reads_body {
            // Nothing to read (or the body is not shown to us before the
            // headers leave): decide now.
            let d = self.load_decision(None);
            return vec![self.headers_answer(d)];
        }
        if self.full_duplex() {
            self.holding_headers = true;
            return Vec::new();
        }
        // BUFFERED: the headers wait in Envoy until the body answer, which
        // may still change them.
        vec![answer(processing_response::Response::RequestHeaders(HeadersResponse::default()))]
    }

    fn on_request_body(&mut self, b: xp::HttpBody) -> Vec<ProcessingResponse> {
        if self.decided {
            // Full duplex after an early decision: echo as it comes.
            return if self.full_duplex() { echo_request(&b.body, b.end_of_stream) } else { vec![body_continue(true)] };
        }
        let limit = self.app.config.max_prompt_bytes.saturating_add(1 << 20);
        self.body.extend_from_slice(&b.body);
        let complete = b.end_of_stream || !self.full_duplex();
        let too_large =
            self.body.len() > limit || (!b.end_of_stream && self.request_mode == BodySendMode::BufferedPartial as i32);
        if !complete && !too_large {
            return Vec::new();
        }
        let d = if too_large { self.load_decision(None) } else { self.decide() };
        if self.full_duplex() {
            let mut out = vec![self.headers_answer(d)];
            let body = std::mem::take(&mut self.body);
            if !self.is_reply() {
                out.extend(echo_request(&body, b.end_of_stream));
            }
            out
        } else {
            vec![self.body_answer(d)]
        }
    }

    fn on_request_trailers(&mut self) -> Vec<ProcessingResponse> {
        let mut out = Vec::new();
        if !self.decided {
            // Full duplex with trailers: the body ended without
            // end_of_stream.
            let d = self.decide();
            out.push(self.headers_answer(d));
            let body = std::mem::take(&mut self.body);
            if !self.is_reply() {
                out.extend(echo_request(&body, false));
            }
        }
        if !self.is_reply() {
            out.push(answer(processing_response::Response::RequestTrailers(TrailersResponse::default())));
        }
        out
    }

    fn on_response_headers(&mut self, h: xp::HttpHeaders) -> Vec<ProcessingResponse> {
        for hv in h.headers.map(|m| m.headers).unwrap_or_default() {
            if hv.key == ":status" {
                self.status = header_text(&hv).parse().unwrap_or(0);
            }
        }
        if h.end_of_stream {
            self.mark_first_byte();
            self.finish();
        }
        vec![answer(processing_response::Response::ResponseHeaders(HeadersResponse::default()))]
    }

    fn on_response_body(&mut self, b: xp::HttpBody) -> Vec<ProcessingResponse> {
        if !b.body.is_empty() {
            self.mark_first_byte();
            self.tail.push(&b.body);
        }
        if b.end_of_stream {
            self.finish();
        }
        if self.response_mode == BodySendMode::FullDuplexStreamed as i32 {
            let m = BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
                    body: b.body,
                    end_of_stream: b.end_of_stream,
                })),
            };
            let r = CommonResponse { body_mutation: Some(m), ..Default::default() };
            return vec![answer(processing_response::Response::ResponseBody(BodyResponse { response: Some(r) }))];
        }
        vec![body_continue(false)]
    }

    fn api(&self) -> Option<Api> {
        let path = self.path.split('?').next().unwrap_or_default();
        match path {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/completions" => Some(Api::Completions),
            _ => None,
        }
    }

    fn is_reply(&self) -> bool {
        self.decided && self.endpoint.is_empty()
    }

    fn count(&self, o: Outcome) {
        self.metrics.count(o);
    }

    /// The KV-aware decision for the whole body.
    fn decide(&mut self) -> Decision {
        let Some(api) = self.api() else { return self.load_decision(None) };
        let body = std::mem::take(&mut self.body);
        let e = match extract(&body, api) {
            Ok(e) => e,
            Err(ExtractError::Unsupported(_)) => {
                let model = model_of(&body);
                self.body = body;
                return self.load_decision(model);
            }
            Err(err) => {
                self.count(Outcome::BadRequest);
                self.body = body;
                return Decision::Reply(openai_error(400, "invalid_request_error", &err.to_string()));
            }
        };
        self.stream = e.stream;
        let hashes = chain_hashes(&e);
        let meta = RequestMeta {
            request_id: &self.request_id,
            lora_name: "",
            model: &e.model,
            body_bytes: u32::try_from(body.len()).unwrap_or(u32::MAX),
            session_id: &self.session,
            tenant: "",
            priority: 0,
        };
        let req = pick_request(&e, api, &meta, &hashes);
        let model = e.model.clone().into_owned();
        drop(e);
        self.body = body;
        match self.app.pick_among(&req, self.subset.as_deref()) {
            Ok(p) if !p.endpoint.is_empty() => self.route(p, &model, Outcome::Routed),
            Ok(_) => self.load_decision(Some(model)),
            Err(e) => self.failed_pick(e, model),
        }
    }

    /// Routed by load: no prompt is scored, the least loaded live worker of
    /// `model` (else of the first configured model) wins.
    fn load_decision(&mut self, model: Option<String>) -> Decision {
        let model = model
            .filter(|m| self.app.models.contains_key(m))
            .or_else(|| self.app.config.models.first().map(|m| m.routing.name.clone()))
            .unwrap_or_default();
        match self.app.pick_by_load(&model, &self.request_id, self.subset.as_deref()) {
            Ok(p) if !p.endpoint.is_empty() => self.route(p, &model, Outcome::Load),
            Ok(_) => self.unavailable("no endpoint"),
            Err(e) => self.failed_pick(e, model),
        }
    }

    fn failed_pick(&mut self, e: PickError, model: String) -> Decision {
        match e {
            PickError::UnknownModel(_) => {
                self.count(Outcome::UnknownModel);
                self.decided = true;
                Decision::Reply(openai_error(404, "not_found_error", &format!("The model `{model}` does not exist.")))
            }
            // Over a limit, or (never from this picker) elided messages:
            // balanced by load.
            PickError::Invalid(_) | PickError::Resend => self.load_decision(Some(model)),
            // The picker never holds a request (it uses `pick_among`).
            PickError::NoWorkers { .. } | PickError::Held { .. } | PickError::Overloaded { .. } => {
                self.unavailable(&e.to_string())
            }
        }
    }

    fn unavailable(&mut self, why: &str) -> Decision {
        self.count(Outcome::Unavailable);
        self.decided = true;
        Decision::Reply(openai_error(503, "service_unavailable", &format!("no endpoint available: {why}")))
    }

    fn route(&mut self, p: pb::PickResponse, model: &str, outcome: Outcome) -> Decision {
        // A subset hint was applied in the pick: every ranked endpoint is
        // allowed.
        let dp_rank = p.data_parallel_rank;
        let prefill = (!p.prefill_endpoint.is_empty()).then_some(p.prefill_endpoint);
        let ranked: Vec<String> = std::iter::once(p.endpoint).chain(p.fallbacks).collect();
        self.count(outcome);
        self.decided = true;
        self.report = true;
        self.model = model.to_owned();
        self.worker_id = p.worker_id;
        self.endpoint = ranked.first().cloned().unwrap_or_default();
        Decision::Route { header: ranked.join(","), dp_rank, prefill }
    }

    /// The answer to the request headers carrying the decision.
    fn headers_answer(&mut self, d: Decision) -> ProcessingResponse {
        self.holding_headers = false;
        self.decided = true;
        match d {
            Decision::Reply(r) => answer(processing_response::Response::ImmediateResponse(r)),
            Decision::Route { header, dp_rank, prefill } => {
                let r = CommonResponse {
                    header_mutation: Some(destination(&header, dp_rank, prefill.as_deref())),
                    clear_route_cache: false,
                    ..Default::default()
                };
                let mut a =
                    answer(processing_response::Response::RequestHeaders(HeadersResponse { response: Some(r) }));
                a.dynamic_metadata = Some(metadata(&header));
                a
            }
        }
    }

    /// The answer to a buffered body carrying the decision (header
    /// mutations still apply: the headers have not left).
    fn body_answer(&mut self, d: Decision) -> ProcessingResponse {
        self.decided = true;
        match d {
            Decision::Reply(r) => answer(processing_response::Response::ImmediateResponse(r)),
            Decision::Route { header, dp_rank, prefill } => {
                let r = CommonResponse {
                    header_mutation: Some(destination(&header, dp_rank, prefill.as_deref())),
                    ..Default::default()
                };
                let mut a = answer(processing_response::Response::RequestBody(BodyResponse { response: Some(r) }));
                a.dynamic_metadata = Some(metadata(&header));
                a
            }
        }
    }

    fn mark_first_byte(&mut self) {
        if self.t_first_byte.is_none() {
            self.t_first_byte = Some(Instant::now());
        }
        if self.report && !self.first_token_sent {
            self.first_token_sent = true;
            let r = self.completion(0);
            self.app.report(&pb::CompletionReportBatch { reporter_id: "epp".into(), reports: vec![r] });
        }
    }

    fn completion(&self, total_us: u64) -> pb::CompletionReport {
        let usage = find_usage(self.tail.bytes()).unwrap_or_default();
        pb::CompletionReport {
            request_id: self.request_id.clone(),
            model: self.model.clone(),
            worker_id: self.worker_id.clone(),
            endpoint: self.endpoint.clone(),
            status_code: self.status,
            ttfb_us: self.t_first_byte.map_or(0, |t| micros(t.duration_since(self.t_start))),
            total_us,
            output_tokens: usage.completion_tokens,
            prompt_tokens: usage.prompt_tokens,
            cached_tokens: usage.cached_tokens,
            stream: self.stream,
            // ext_proc does not see which upstream host Envoy used.
            served_endpoint: String::new(),
        }
    }

    /// The request is over (its response ended, or the data plane closed
    /// the stream): report it once.
    pub(crate) fn finish(&mut self) {
        if self.finished || !self.report {
            return;
        }
        self.finished = true;
        let r = self.completion(micros(self.t_start.elapsed()).max(1));
        self.app.report(&pb::CompletionReportBatch { reporter_id: "epp".into(), reports: vec![r] });
    }
}
