//! The exchange's state machine, message by message.

use std::sync::Arc;

use kvgate_core::App;
use kvgate_core::config::{RawConfig, RawModel, RawWorker};

use crate::drive_exchange;
use crate::exchange::Exchange;
use crate::ext_proc::{
    self as xp, BodySendMode, HeaderValue, ProcessingRequest, ProcessingResponse, body_mutation, processing_request,
    processing_response,
};
use crate::{DESTINATION, ECHO_CHUNK, EppMetrics, METADATA_NAMESPACE, Outcome, SUBSET_KEY, SUBSET_NAMESPACE};

/// An app with the picker's metrics registered once.
struct Fx {
    app: Arc<App>,
    m: EppMetrics,
}

impl Fx {
    fn x(&self) -> Exchange {
        Exchange::new(self.app.clone(), self.m.clone())
    }
}

fn app() -> Fx {
    app_of(3)
}

fn app_of(workers: usize) -> Fx {
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
    let app = App::new(kvgate_core::Config::validate(raw).unwrap()).unwrap();
    let m = EppMetrics::register(&app);
    Fx { app, m }
}

fn headers(method: &str, path: &str, eos: bool) -> ProcessingRequest {
    let hv = |k: &str, v: &str| HeaderValue { key: k.into(), value: String::new(), raw_value: v.as_bytes().to_vec() };
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
        request: Some(processing_request::Request::RequestBody(xp::HttpBody { body: b.to_vec(), end_of_stream: eos })),
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
    let mut x = app().x();
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
    let mut x = app().x();
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
    let fx = app();
    let mut x = fx.x();
    let h = with_modes(headers("POST", "/v1/completions", false), BodySendMode::Buffered, BodySendMode::Streamed);
    let a = x.on_message(h);
    assert_eq!(a.len(), 1);
    assert_eq!(destination_of(&a[0]), None, "no decision before the body");
    let a = x.on_message(body(br#"{"model":"m","prompt":"hello"}"#, true));
    assert!(destination_of(&a[0]).is_some());
    assert_eq!(fx.m.outcome(Outcome::Routed), 1);
}

#[test]
fn bad_bodies_unknown_models_and_other_paths() {
    let a = app();
    let run = |path: &str, b: &[u8]| {
        let mut x = a.x();
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
    let mut x = a.x();
    let r = x.on_message(with_modes(headers("GET", "/v1/models", true), BodySendMode::Buffered, BodySendMode::None));
    assert!(destination_of(&r[0]).is_some());
    let count = |o: Outcome| a.m.outcome(o);
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
        let mut x = a.x();
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
        let mut x = a.x();
        let mut h =
            with_modes(headers("POST", "/v1/chat/completions", false), BodySendMode::Buffered, BodySendMode::None);
        h.metadata_context = Some(hint(&[&allowed]));
        x.on_message(h);
        let r = x.on_message(body(CHAT, true)).remove(0);
        assert_eq!(destination_of(&r).as_deref(), Some(allowed.as_str()), "hint {allowed}");
    }
    // Two allowed endpoints: the destination names both and nothing else.
    let mut x = a.x();
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
    let mut x = a.x();
    let r = x.on_message(with_modes(headers("GET", "/v1/models", true), BodySendMode::Buffered, BodySendMode::None));
    assert!(destination_of(&r[0]).is_some());
    let m = a.app.render_metrics();
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
    assert_eq!(drive_exchange(app().app, &data), 2);
    // Garbage is skipped, never a panic.
    assert_eq!(drive_exchange(app().app, &[0xff, 0xff, 0, 1, 2, 3]), 0);
}

#[test]
fn observability_mode_is_never_answered() {
    let mut x = app().x();
    let mut h = headers("GET", "/v1/models", true);
    h.observability_mode = true;
    assert!(x.on_message(h).is_empty());
}

#[test]
fn a_routed_request_is_reported_once_when_it_ends() {
    let a = app();
    let mut x = a.x();
    x.on_message(with_modes(
        headers("POST", "/v1/chat/completions", false),
        BodySendMode::Buffered,
        BodySendMode::Streamed,
    ));
    x.on_message(body(CHAT, true));
    let rh = ProcessingRequest {
        request: Some(processing_request::Request::ResponseHeaders(xp::HttpHeaders {
            headers: Some(xp::HeaderMap {
                headers: vec![HeaderValue { key: ":status".into(), value: String::new(), raw_value: b"200".to_vec() }],
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
    let m = a.app.render_metrics();
    assert!(m.contains("kvgate_reports_total{model=\"m\",kind=\"all\"} 1\n"), "{m}");
    // No tokenizer here: the request was routed by load, so no overlap
    // was predicted and the accuracy metric has nothing to judge.
    assert!(m.contains("kvgate_reports_total{model=\"m\",kind=\"with_cached\"} 0\n"), "{m}");
}
