//! The endpoint picker (EPP) of the Gateway API Inference Extension:
//! `envoy.service.ext_proc.v3.ExternalProcessor/Process` served next to
//! `kvgate.v1.Router` on the gRPC port, for gateways that route an
//! `InferencePool` through an endpoint picker instead of loading the kvgate
//! Wasm filter.
//!
//! One ext_proc stream is one HTTP request. The picker reads the OpenAI body
//! with the filter's own extraction and hashing (`kvgate-filter-core`), so a
//! request gets exactly the `Pick` the filter would have sent, and answers as
//! the endpoint-picker protocol asks: the `x-gateway-destination-endpoint`
//! header (primary, then fallbacks, comma-separated) and the same value in
//! the dynamic metadata `envoy.lb` / `x-gateway-destination-endpoint`.
//!
//! | request body mode | what the picker does |
//! |---|---|
//! | `BUFFERED` | answers the headers at once; sets the destination in its answer to the whole body |
//! | `FULL_DUPLEX_STREAMED` (what Inference Extension gateways configure) | holds the headers answer until the body is complete, then answers headers (with the destination) and streams the body back unchanged, in chunks of at most 64 KiB |
//! | `BUFFERED_PARTIAL` | as `BUFFERED`; a truncated body is routed by load |
//! | `NONE`, `STREAMED` | cannot see the body before the headers leave: routed by load at the headers |
//!
//! Outcomes, each counted in `kvgate_epp_requests_total{outcome}`:
//! * `routed`: a KV-aware pick;
//! * `load`: routed by load: other paths and methods (e.g. `GET /v1/models`,
//!   for the first configured model), bodies kvgate does not route by prefix
//!   (a batch of prompts), over the size limit, or over the message limit;
//! * `bad_request`: 400 with an OpenAI-style JSON error (not JSON, wrong shape);
//! * `unknown_model`: 404, as OpenAI answers an unknown model;
//! * `unavailable`: 503 when no live worker remains (the protocol's answer),
//!   also when a subset hint allows none of the live workers. The hint
//!   narrows the candidates before the pick: the destination is the best
//!   allowed worker, then allowed fallbacks.
//!
//! The response is watched, never changed: its first body byte is reported
//! as the first token (total 0) and its end (or the stream's end) as the
//! completion, with `usage` read from the body's tail, as the filter reports
//! them. Cost per request: the filter's single pass over the body, the Pick
//! built as a message (no protobuf round trip in-process), and one copy of
//! the body when it is echoed back in full-duplex mode.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use futures_util::Stream;
use kvgate_filter_core::extract::{Api, ExtractError, extract};
use kvgate_filter_core::pick::{RequestMeta, chain_hashes, pick_request};
use kvgate_filter_core::usage::{Tail, find_usage};
use kvgate_protocol::pb;
use prost::Message as _;
use tonic::{Request, Response, Status, Streaming};

use crate::app::App;
use crate::ext_proc::external_processor_server::ExternalProcessor;
use crate::ext_proc::{
    self as xp, BodyMutation, BodyResponse, BodySendMode, CommonResponse, HeaderMutation, HeaderValue,
    HeaderValueOption, HeadersResponse, HttpStatus, ImmediateResponse, ProcessingRequest, ProcessingResponse,
    StreamedBodyResponse, TrailersResponse, body_mutation, header_value_option, processing_request,
    processing_response,
};

/// The header and metadata key of the protocol.
pub const DESTINATION: &str = kvgate_protocol::DESTINATION_HEADER;
/// The dynamic-metadata namespace of the destination.
pub const METADATA_NAMESPACE: &str = "envoy.lb";
/// Where a data plane puts the endpoints a pick must choose from.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of that list.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Largest chunk sent back in full-duplex mode (the protocol recommends
/// at most 64 KiB).
const ECHO_CHUNK: usize = 64 << 10;
/// Bytes of the response kept to find `usage` (as the filter's default).
const TAIL_BYTES: usize = 16 << 10;

/// Outcome labels of `kvgate_epp_requests_total`.
pub const OUTCOMES: [&str; 5] = ["routed", "load", "bad_request", "unknown_model", "unavailable"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Routed = 0,
    Load = 1,
    BadRequest = 2,
    UnknownModel = 3,
    Unavailable = 4,
}

/// Process-wide counters of the picker.
#[derive(Debug, Default)]
pub struct EppCounters {
    /// Requests by outcome ([`OUTCOMES`]).
    pub outcomes: [AtomicU64; 5],
    /// ext_proc streams that ended with an error from the data plane.
    pub stream_errors: AtomicU64,
}

/// The ext_proc service.
#[derive(Debug, Clone)]
pub struct EndpointPicker {
    app: Arc<App>,
}

impl EndpointPicker {
    /// A picker routing with `app`.
    pub fn new(app: Arc<App>) -> Self {
        Self { app }
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for EndpointPicker {
    type ProcessStream = Answers;

    async fn process(&self, request: Request<Streaming<ProcessingRequest>>) -> Result<Response<Answers>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<ProcessingResponse, Status>>(16);
        let app = self.app.clone();
        tokio::spawn(async move {
            let mut x = Exchange::new(app.clone());
            loop {
                match inbound.message().await {
                    Ok(Some(msg)) => {
                        for answer in x.on_message(msg) {
                            if tx.send(Ok(answer)).await.is_err() {
                                x.finish();
                                return;
                            }
                        }
                    }
                    Ok(None) => break,
                    Err(_) => {
                        app.epp.stream_errors.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
            }
            x.finish();
        });
        let answers = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|a| (a, rx)) });
        Ok(Response::new(Box::pin(answers)))
    }
}

/// A decision about where the request goes.
enum Decision {
    /// Set the destination to this header value.
    Route { header: String },
    /// Answer locally.
    Reply(ImmediateResponse),
}

/// One HTTP request's conversation with the data plane: a synchronous state
/// machine, each message in, the answers out.
struct Exchange {
    app: Arc<App>,
    observe_only: bool,
    request_mode: i32,
    response_mode: i32,
    method: String,
    path: String,
    request_id: String,
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
    fn new(app: Arc<App>) -> Self {
        Self {
            app,
            observe_only: false,
            request_mode: BodySendMode::None as i32,
            response_mode: BodySendMode::None as i32,
            method: String::new(),
            path: String::new(),
            request_id: String::new(),
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

    fn on_message(&mut self, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
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
        if let Some(c) = self.app.epp.outcomes.get(o as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
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
        };
        let req = pick_request(&e, api, &meta, &hashes);
        let model = e.model.clone().into_owned();
        drop(e);
        self.body = body;
        match self.app.pick_among(&req, self.subset.as_deref()) {
            Ok(p) if !p.endpoint.is_empty() => self.route(p, &model, Outcome::Routed),
            Ok(_) => self.load_decision(Some(model)),
            Err(s) => self.failed_pick(s, model),
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
            Err(s) => self.failed_pick(s, model),
        }
    }

    fn failed_pick(&mut self, s: Status, model: String) -> Decision {
        match s.code() {
            tonic::Code::NotFound => {
                self.count(Outcome::UnknownModel);
                self.decided = true;
                Decision::Reply(openai_error(404, "not_found_error", &format!("The model `{model}` does not exist.")))
            }
            tonic::Code::InvalidArgument => self.load_decision(Some(model)),
            _ => self.unavailable(s.message()),
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
        let ranked: Vec<String> = std::iter::once(p.endpoint).chain(p.fallbacks).collect();
        self.count(outcome);
        self.decided = true;
        self.report = true;
        self.model = model.to_owned();
        self.worker_id = p.worker_id;
        self.endpoint = ranked.first().cloned().unwrap_or_default();
        Decision::Route { header: ranked.join(",") }
    }

    /// The answer to the request headers carrying the decision.
    fn headers_answer(&mut self, d: Decision) -> ProcessingResponse {
        self.holding_headers = false;
        self.decided = true;
        match d {
            Decision::Reply(r) => answer(processing_response::Response::ImmediateResponse(r)),
            Decision::Route { header } => {
                let r = CommonResponse {
                    header_mutation: Some(destination(&header)),
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
            Decision::Route { header } => {
                let r = CommonResponse { header_mutation: Some(destination(&header)), ..Default::default() };
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
    fn finish(&mut self) {
        if self.finished || !self.report {
            return;
        }
        self.finished = true;
        let r = self.completion(micros(self.t_start.elapsed()).max(1));
        self.app.report(&pb::CompletionReportBatch { reporter_id: "epp".into(), reports: vec![r] });
    }
}

/// Drives one ext_proc exchange from arbitrary bytes (the fuzz target
/// `epp_exchange`; tests). `data` is a sequence of parts, each a 2-byte
/// little-endian length and that many bytes, whose first byte selects: an
/// encoded `ProcessingRequest` (decoded; undecodable parts are skipped as the
/// gRPC layer would refuse them), request headers of a routed POST in a body
/// mode, a request body chunk, or a response body chunk. Returns the number
/// of answers; must never panic.
#[doc(hidden)]
pub fn drive_exchange(app: Arc<App>, mut data: &[u8]) -> usize {
    let mut x = Exchange::new(app);
    let mut answers = 0;
    while let [a, b, rest @ ..] = data {
        let len = usize::from(u16::from_le_bytes([*a, *b])).min(rest.len());
        let (part, next) = rest.split_at(len);
        data = next;
        let Some((&sel, part)) = part.split_first() else { continue };
        let flag = part.first().copied().unwrap_or(0);
        let msg = match sel % 4 {
            0 => match ProcessingRequest::decode(part) {
                Ok(m) => m,
                Err(_) => continue,
            },
            1 => {
                let hv = |k: &str, v: &str| HeaderValue { key: k.into(), value: String::new(), raw_value: v.into() };
                let path = if flag & 1 == 0 { "/v1/chat/completions" } else { "/v1/completions" };
                ProcessingRequest {
                    request: Some(processing_request::Request::RequestHeaders(xp::HttpHeaders {
                        headers: Some(xp::HeaderMap { headers: vec![hv(":method", "POST"), hv(":path", path)] }),
                        end_of_stream: flag & 2 != 0,
                    })),
                    protocol_config: Some(xp::ProtocolConfiguration {
                        request_body_mode: i32::from(flag >> 2) % 6,
                        response_body_mode: i32::from(flag >> 5) % 6,
                        send_body_without_waiting_for_header_response: false,
                    }),
                    ..Default::default()
                }
            }
            2 => ProcessingRequest {
                request: Some(processing_request::Request::RequestBody(xp::HttpBody {
                    body: part.get(1..).unwrap_or_default().to_vec(),
                    end_of_stream: flag & 1 != 0,
                })),
                ..Default::default()
            },
            _ => ProcessingRequest {
                request: Some(processing_request::Request::ResponseBody(xp::HttpBody {
                    body: part.get(1..).unwrap_or_default().to_vec(),
                    end_of_stream: flag & 1 != 0,
                })),
                ..Default::default()
            },
        };
        answers += x.on_message(msg).len();
    }
    x.finish();
    answers
}

fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn answer(r: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse { response: Some(r), dynamic_metadata: None }
}

fn body_continue(request: bool) -> ProcessingResponse {
    let b = BodyResponse::default();
    answer(if request {
        processing_response::Response::RequestBody(b)
    } else {
        processing_response::Response::ResponseBody(b)
    })
}

/// The request body sent back in full-duplex mode, in chunks.
fn echo_request(body: &[u8], end_of_stream: bool) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = if body.is_empty() { vec![&[][..]] } else { body.chunks(ECHO_CHUNK).collect() };
    let n = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let m = BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
                    body: c.to_vec(),
                    end_of_stream: end_of_stream && i + 1 == n,
                })),
            };
            let r = CommonResponse { body_mutation: Some(m), ..Default::default() };
            answer(processing_response::Response::RequestBody(BodyResponse { response: Some(r) }))
        })
        .collect()
}

/// Sets the destination header (a client's own value is replaced).
fn destination(value: &str) -> HeaderMutation {
    HeaderMutation {
        set_headers: vec![HeaderValueOption {
            header: Some(HeaderValue {
                key: DESTINATION.into(),
                value: String::new(),
                raw_value: value.as_bytes().to_vec(),
            }),
            append_action: header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        }],
        remove_headers: Vec::new(),
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": value}}`.
fn metadata(value: &str) -> prost_types::Struct {
    use prost_types::value::Kind;
    let inner = prost_types::Struct {
        fields: [(DESTINATION.to_owned(), prost_types::Value { kind: Some(Kind::StringValue(value.to_owned())) })]
            .into_iter()
            .collect(),
    };
    prost_types::Struct {
        fields: [(METADATA_NAMESPACE.to_owned(), prost_types::Value { kind: Some(Kind::StructValue(inner)) })]
            .into_iter()
            .collect(),
    }
}

/// The endpoints a data plane allows, when it says.
fn subset_hint(md: Option<&xp::Metadata>) -> Option<Vec<String>> {
    use prost_types::value::Kind;
    let ns = md?.filter_metadata.get(SUBSET_NAMESPACE)?;
    let Kind::ListValue(list) = ns.fields.get(SUBSET_KEY)?.kind.as_ref()? else { return Some(Vec::new()) };
    Some(
        list.values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.clone()),
                _ => None,
            })
            .collect(),
    )
}

/// A header's value: Envoy sends it in `raw_value`.
fn header_text(h: &HeaderValue) -> String {
    if h.raw_value.is_empty() { h.value.clone() } else { String::from_utf8_lossy(&h.raw_value).into_owned() }
}

/// The `model` of a body kvgate does not route by prefix (to balance it
/// over that model's workers).
fn model_of(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct M {
        model: String,
    }
    serde_json::from_slice::<M>(body).ok().map(|m| m.model)
}

/// A local answer with an OpenAI-style JSON error.
fn openai_error(code: u16, kind: &str, message: &str) -> ImmediateResponse {
    let body = serde_json::json!({"error": {"message": message, "type": kind, "code": code}}).to_string();
    ImmediateResponse {
        status: Some(HttpStatus { code: i32::from(code) }),
        headers: Some(HeaderMutation {
            set_headers: vec![HeaderValueOption {
                header: Some(HeaderValue {
                    key: "content-type".into(),
                    value: String::new(),
                    raw_value: b"application/json".to_vec(),
                }),
                append_action: header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            }],
            remove_headers: Vec::new(),
        }),
        body: body.into_bytes(),
        details: format!("kvgate_epp_{kind}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{RawConfig, RawModel, RawWorker};

    fn app() -> Arc<App> {
        app_of(3)
    }

    fn app_of(workers: usize) -> Arc<App> {
        let raw = RawConfig {
            listen_admin: Some("off".into()),
            models: vec![RawModel {
                name: "m".into(),
                block_size: Some(16),
                workers: (0..workers)
                    .map(|i| RawWorker { id: format!("w{i}"), endpoint: format!("10.0.0.{i}:8000") })
                    .collect(),
                ..Default::default()
            }],
            ..Default::default()
        };
        App::new(crate::Config::validate(raw).unwrap()).unwrap().0
    }

    fn headers(method: &str, path: &str, eos: bool) -> ProcessingRequest {
        let hv =
            |k: &str, v: &str| HeaderValue { key: k.into(), value: String::new(), raw_value: v.as_bytes().to_vec() };
        ProcessingRequest {
            request: Some(processing_request::Request::RequestHeaders(xp::HttpHeaders {
                headers: Some(xp::HeaderMap { headers: vec![hv(":method", method), hv(":path", path)] }),
                end_of_stream: eos,
            })),
            ..Default::default()
        }
    }

    fn with_modes(mut r: ProcessingRequest, request: BodySendMode, response: BodySendMode) -> ProcessingRequest {
        r.protocol_config = Some(xp::ProtocolConfiguration {
            request_body_mode: request as i32,
            response_body_mode: response as i32,
            send_body_without_waiting_for_header_response: false,
        });
        r
    }

    fn body(b: &[u8], eos: bool) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(processing_request::Request::RequestBody(xp::HttpBody {
                body: b.to_vec(),
                end_of_stream: eos,
            })),
            ..Default::default()
        }
    }

    fn destination_of(a: &ProcessingResponse) -> Option<String> {
        let common = match a.response.as_ref()? {
            processing_response::Response::RequestHeaders(h) => h.response.as_ref()?,
            processing_response::Response::RequestBody(b) => b.response.as_ref()?,
            _ => return None,
        };
        let set = common.header_mutation.as_ref()?.set_headers.first()?.header.as_ref()?;
        assert_eq!(set.key, DESTINATION);
        let md = a.dynamic_metadata.as_ref().expect("metadata with the header");
        let Some(prost_types::value::Kind::StructValue(ns)) = md.fields.get(METADATA_NAMESPACE)?.kind.as_ref() else {
            panic!("no {METADATA_NAMESPACE} namespace")
        };
        let Some(prost_types::value::Kind::StringValue(v)) = ns.fields.get(DESTINATION)?.kind.as_ref() else {
            panic!("no destination in the metadata")
        };
        let header = String::from_utf8(set.raw_value.clone()).unwrap();
        assert_eq!(&header, v, "header and metadata must agree");
        Some(header)
    }

    fn echoed(answers: &[ProcessingResponse]) -> (Vec<u8>, usize, bool) {
        let mut out = Vec::new();
        let mut chunks = 0;
        let mut eos = false;
        for a in answers {
            if let Some(processing_response::Response::RequestBody(b)) = &a.response
                && let Some(m) = b.response.as_ref().and_then(|r| r.body_mutation.as_ref())
                && let Some(body_mutation::Mutation::StreamedResponse(s)) = &m.mutation
            {
                assert!(!eos, "a chunk after end_of_stream");
                assert!(s.body.len() <= ECHO_CHUNK);
                out.extend_from_slice(&s.body);
                chunks += 1;
                eos = s.end_of_stream;
            }
        }
        (out, chunks, eos)
    }

    const CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

    #[test]
    fn full_duplex_holds_the_headers_then_routes_and_echoes_the_body() {
        let mut x = Exchange::new(app());
        let h = with_modes(
            headers("POST", "/v1/chat/completions", false),
            BodySendMode::FullDuplexStreamed,
            BodySendMode::FullDuplexStreamed,
        );
        assert!(x.on_message(h).is_empty(), "headers answered before the body is known");
        let big = {
            let text = "y".repeat(200_000);
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": text}]}).to_string().into_bytes()
        };
        let (a, b) = big.split_at(70_000);
        assert!(x.on_message(body(a, false)).is_empty());
        let answers = x.on_message(body(b, true));
        // Headers (with the decision) first, then the body, unchanged.
        let dest = destination_of(&answers[0]).expect("destination on the headers answer");
        assert!(dest.starts_with("10.0.0."), "{dest}");
        assert_eq!(dest.split(',').count(), 3);
        let (echo, chunks, eos) = echoed(&answers[1..]);
        assert_eq!(echo, big);
        assert_eq!(chunks, big.len().div_ceil(ECHO_CHUNK));
        assert!(eos);
    }

    #[test]
    fn full_duplex_with_trailers_ends_the_body_at_the_trailers() {
        let mut x = Exchange::new(app());
        let h = with_modes(
            headers("POST", "/v1/chat/completions", false),
            BodySendMode::FullDuplexStreamed,
            BodySendMode::None,
        );
        assert!(x.on_message(h).is_empty());
        assert!(x.on_message(body(CHAT, false)).is_empty());
        let t = ProcessingRequest {
            request: Some(processing_request::Request::RequestTrailers(xp::HttpTrailers::default())),
            ..Default::default()
        };
        let answers = x.on_message(t);
        assert!(destination_of(&answers[0]).is_some());
        let (echo, _, eos) = echoed(&answers);
        assert_eq!((echo.as_slice(), eos), (CHAT, false));
        assert!(matches!(answers.last().unwrap().response, Some(processing_response::Response::RequestTrailers(_))));
    }

    #[test]
    fn buffered_routes_in_the_body_answer() {
        let mut x = Exchange::new(app());
        let h = with_modes(headers("POST", "/v1/completions", false), BodySendMode::Buffered, BodySendMode::Streamed);
        let a = x.on_message(h);
        assert_eq!(a.len(), 1);
        assert_eq!(destination_of(&a[0]), None, "no decision before the body");
        let a = x.on_message(body(br#"{"model":"m","prompt":"hello"}"#, true));
        assert!(destination_of(&a[0]).is_some());
        assert_eq!(x.app.epp.outcomes[Outcome::Routed as usize].load(Ordering::Relaxed), 1);
    }

    #[test]
    fn bad_bodies_unknown_models_and_other_paths() {
        let a = app();
        let run = |path: &str, b: &[u8]| {
            let mut x = Exchange::new(a.clone());
            x.on_message(with_modes(headers("POST", path, false), BodySendMode::Buffered, BodySendMode::None));
            x.on_message(body(b, true)).remove(0)
        };
        let status = |r: &ProcessingResponse| match &r.response {
            Some(processing_response::Response::ImmediateResponse(i)) => i.status.as_ref().map(|s| s.code),
            _ => None,
        };
        assert_eq!(status(&run("/v1/chat/completions", b"{not json")), Some(400));
        assert_eq!(
            status(&run("/v1/chat/completions", br#"{"model":"other","messages":[{"role":"user","content":"hi"}]}"#)),
            Some(404)
        );
        // A batch of prompts is valid but not routed by prefix: by load.
        let r = run("/v1/completions", br#"{"model":"m","prompt":["a","b"]}"#);
        assert!(destination_of(&r).is_some());
        // Another path: decided at the headers, by load.
        let mut x = Exchange::new(a.clone());
        let r =
            x.on_message(with_modes(headers("GET", "/v1/models", true), BodySendMode::Buffered, BodySendMode::None));
        assert!(destination_of(&r[0]).is_some());
        let count = |o: Outcome| a.epp.outcomes[o as usize].load(Ordering::Relaxed);
        assert_eq!((count(Outcome::BadRequest), count(Outcome::UnknownModel), count(Outcome::Load)), (1, 1, 2));
    }

    #[test]
    fn a_subset_hint_limits_the_endpoints_and_an_empty_one_is_503() {
        use prost_types::value::Kind;
        let hint = |eps: &[&str]| {
            let list = prost_types::ListValue {
                values: eps.iter().map(|e| prost_types::Value { kind: Some(Kind::StringValue((*e).into())) }).collect(),
            };
            let ns = prost_types::Struct {
                fields: [(SUBSET_KEY.to_owned(), prost_types::Value { kind: Some(Kind::ListValue(list)) })]
                    .into_iter()
                    .collect(),
            };
            xp::Metadata { filter_metadata: [(SUBSET_NAMESPACE.to_owned(), ns)].into_iter().collect() }
        };
        let a = app();
        for (allowed, expect) in [(vec!["10.0.0.2:8000"], Some("10.0.0.2:8000")), (vec!["10.9.9.9:1"], None)] {
            let mut x = Exchange::new(a.clone());
            let mut h =
                with_modes(headers("POST", "/v1/chat/completions", false), BodySendMode::Buffered, BodySendMode::None);
            h.metadata_context = Some(hint(&allowed));
            x.on_message(h);
            let r = x.on_message(body(CHAT, true)).remove(0);
            match expect {
                Some(e) => assert_eq!(destination_of(&r).as_deref(), Some(e)),
                None => assert!(matches!(
                    &r.response,
                    Some(processing_response::Response::ImmediateResponse(i)) if i.status.as_ref().map(|s| s.code) == Some(503)
                )),
            }
        }
    }

    fn hint(eps: &[&str]) -> xp::Metadata {
        use prost_types::value::Kind;
        let list = prost_types::ListValue {
            values: eps.iter().map(|e| prost_types::Value { kind: Some(Kind::StringValue((*e).into())) }).collect(),
        };
        let ns = prost_types::Struct {
            fields: [(SUBSET_KEY.to_owned(), prost_types::Value { kind: Some(Kind::ListValue(list)) })]
                .into_iter()
                .collect(),
        };
        xp::Metadata { filter_metadata: [(SUBSET_NAMESPACE.to_owned(), ns)].into_iter().collect() }
    }

    /// With more workers than one pick ranks (1 + 2 fallbacks), a hint
    /// naming any live worker must route there: the hint narrows the
    /// candidates before the pick, not the ranked list after it.
    #[test]
    fn a_subset_hint_outside_the_ranked_three_still_routes() {
        let a = app_of(5);
        for i in 0..5 {
            let allowed = format!("10.0.0.{i}:8000");
            let mut x = Exchange::new(a.clone());
            let mut h =
                with_modes(headers("POST", "/v1/chat/completions", false), BodySendMode::Buffered, BodySendMode::None);
            h.metadata_context = Some(hint(&[&allowed]));
            x.on_message(h);
            let r = x.on_message(body(CHAT, true)).remove(0);
            assert_eq!(destination_of(&r).as_deref(), Some(allowed.as_str()), "hint {allowed}");
        }
        // Two allowed endpoints: the destination names both and nothing else.
        let mut x = Exchange::new(a.clone());
        let mut h = with_modes(headers("GET", "/v1/models", true), BodySendMode::Buffered, BodySendMode::None);
        h.metadata_context = Some(hint(&["10.0.0.3:8000", "10.0.0.4:8000"]));
        let r = x.on_message(h).remove(0);
        let mut got: Vec<String> = destination_of(&r).unwrap().split(',').map(str::to_owned).collect();
        got.sort();
        assert_eq!(got, ["10.0.0.3:8000", "10.0.0.4:8000"]);
    }

    /// A request routed by load because it has no body to score is its own
    /// kind of decision, not one of the configured mode's.
    #[test]
    fn routing_by_load_without_a_body_has_its_own_label() {
        let a = app();
        let mut x = Exchange::new(a.clone());
        let r =
            x.on_message(with_modes(headers("GET", "/v1/models", true), BodySendMode::Buffered, BodySendMode::None));
        assert!(destination_of(&r[0]).is_some());
        let m = a.render_metrics();
        assert!(m.contains("kvgate_pick_decisions_total{model=\"m\",mode=\"by_load\",reason=\"load\"} 1\n"), "{m}");
        assert!(!m.contains("kvgate_pick_decisions_total{model=\"m\",mode=\"kv\""), "{m}");
    }

    #[test]
    fn the_fuzz_driver_runs_a_whole_exchange() {
        let part = |sel: u8, bytes: &[u8]| {
            let mut p = ((bytes.len() + 1) as u16).to_le_bytes().to_vec();
            p.push(sel);
            p.extend_from_slice(bytes);
            p
        };
        let mut data = part(1, &[(BodySendMode::FullDuplexStreamed as u8) << 2]);
        let mut chunk = vec![1u8];
        chunk.extend_from_slice(CHAT);
        data.extend(part(2, &chunk));
        // headers answer + one echoed chunk
        assert_eq!(drive_exchange(app(), &data), 2);
        // Garbage is skipped, never a panic.
        assert_eq!(drive_exchange(app(), &[0xff, 0xff, 0, 1, 2, 3]), 0);
    }

    #[test]
    fn observability_mode_is_never_answered() {
        let mut x = Exchange::new(app());
        let mut h = headers("GET", "/v1/models", true);
        h.observability_mode = true;
        assert!(x.on_message(h).is_empty());
    }

    #[test]
    fn a_routed_request_is_reported_once_when_it_ends() {
        let a = app();
        let mut x = Exchange::new(a.clone());
        x.on_message(with_modes(
            headers("POST", "/v1/chat/completions", false),
            BodySendMode::Buffered,
            BodySendMode::Streamed,
        ));
        x.on_message(body(CHAT, true));
        let rh = ProcessingRequest {
            request: Some(processing_request::Request::ResponseHeaders(xp::HttpHeaders {
                headers: Some(xp::HeaderMap {
                    headers: vec![HeaderValue {
                        key: ":status".into(),
                        value: String::new(),
                        raw_value: b"200".to_vec(),
                    }],
                }),
                end_of_stream: false,
            })),
            ..Default::default()
        };
        x.on_message(rh);
        let usage = br#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}"#;
        let rb = ProcessingRequest {
            request: Some(processing_request::Request::ResponseBody(xp::HttpBody {
                body: usage.to_vec(),
                end_of_stream: true,
            })),
            ..Default::default()
        };
        let answers = x.on_message(rb);
        assert!(matches!(answers[0].response, Some(processing_response::Response::ResponseBody(_))));
        x.finish();
        let m = a.render_metrics();
        assert!(m.contains("kvgate_reports_total{model=\"m\",kind=\"all\"} 1\n"), "{m}");
        // No tokenizer here: the request was routed by load, so no overlap
        // was predicted and the accuracy metric has nothing to judge.
        assert!(m.contains("kvgate_reports_total{model=\"m\",kind=\"with_cached\"} 0\n"), "{m}");
    }
}
