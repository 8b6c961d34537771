//! The kvgate Proxy-Wasm filter, built for wasm32-wasip1, inside the real
//! Envoy 1.40 (`envoy/kvgate.yaml`), on 127.0.0.1.
//!
//! * With a stub control plane (a real gRPC server whose answers the test
//!   sets) and echo upstreams: the request lands where the control plane
//!   said, a spoofed header is ignored, every failure (error, slow, unknown
//!   model, unusable answer, control plane down) still gives 200 through the
//!   fallback with bounded added latency, fail-closed answers 503/400,
//!   oversized and malformed bodies and other paths pass untouched, and
//!   the filter's Envoy stats count it all.
//! * With the real fleet (`kvgate sim` workers, relays, NATS, `kvgate serve`):
//!   a conversation through Envoy follows its cache, SSE streams pass
//!   unbuffered, and completion reports reach the control plane with the
//!   engine's cached-token counts.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{BLOCK, Fleet, MODEL, prom, until};
use kvgate_protocol::pb;
use kvgate_server::router_server::{Router, RouterServer};
use kvgate_testkit::{
    EchoUpstream, Envoy, HttpResponse, envoy_validate, fnv1a, free_port, http_request, render_kvgate_envoy, scratch_dir,
};
use serde_json::{Value, json};
use tonic::{Request, Response, Status};

// ---------------------------------------------------------------- stub --

#[derive(Debug, Clone)]
enum Behave {
    /// Answer with this endpoint and fallbacks.
    Answer(String, Vec<String>),
    /// Sleep, then answer like `Answer`.
    Slow(Duration, String),
    /// Fail with this status.
    Fail(tonic::Code),
    /// Sleep, then fail like `Fail`.
    SlowFail(Duration, tonic::Code),
    /// OK with no endpoint.
    Empty,
    /// Answer with this endpoint and say the conversation is retained; but
    /// answer `resend` to a request that elided messages (as a control
    /// plane that lost them would).
    RetainThenForget(String),
}

#[derive(Clone)]
struct Stub {
    behave: Arc<Mutex<Behave>>,
    picks: Arc<Mutex<Vec<pb::PickRequest>>>,
    reports: Arc<Mutex<Vec<pb::CompletionReport>>>,
}

#[tonic::async_trait]
impl Router for Stub {
    async fn pick(&self, request: Request<pb::PickRequest>) -> Result<Response<pb::PickResponse>, Status> {
        let req = request.into_inner();
        let last = req.segments.last().map_or(0, |s| s.chain_hash);
        let elided = req.segments.iter().any(|s| s.elided);
        self.picks.lock().unwrap().push(req);
        let b = self.behave.lock().unwrap().clone();
        let answer = |endpoint: String, fallbacks: Vec<String>| pb::PickResponse {
            endpoint,
            fallbacks,
            worker_id: "stub-worker".into(),
            matched_blocks: 1,
            total_blocks: 2,
            reason: pb::PickReason::Kv as i32,
            mode: "kv".into(),
            ..Default::default()
        };
        match b {
            Behave::Answer(e, f) => Ok(Response::new(answer(e, f))),
            Behave::Slow(d, e) => {
                tokio::time::sleep(d).await;
                Ok(Response::new(answer(e, vec![])))
            }
            Behave::Fail(code) => Err(Status::new(code, "stub says no")),
            Behave::SlowFail(d, code) => {
                tokio::time::sleep(d).await;
                Err(Status::new(code, "stub says no, late"))
            }
            Behave::Empty => Ok(Response::new(pb::PickResponse::default())),
            Behave::RetainThenForget(_) if elided => {
                Ok(Response::new(pb::PickResponse { resend: true, ..Default::default() }))
            }
            Behave::RetainThenForget(e) => {
                Ok(Response::new(pb::PickResponse { retained_chain_hashes: vec![last], ..answer(e, vec![]) }))
            }
        }
    }

    async fn report(&self, request: Request<pb::CompletionReportBatch>) -> Result<Response<pb::ReportAck>, Status> {
        let batch = request.into_inner();
        let n = batch.reports.len() as u32;
        self.reports.lock().unwrap().extend(batch.reports);
        Ok(Response::new(pb::ReportAck { accepted: n }))
    }
}

struct StubServer {
    stub: Stub,
    addr: SocketAddr,
    _rt: tokio::runtime::Runtime,
}

impl StubServer {
    fn start() -> StubServer {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let stub = Stub { behave: Arc::new(Mutex::new(Behave::Empty)), picks: Arc::default(), reports: Arc::default() };
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let svc = RouterServer::new(stub.clone());
        rt.spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            let _ = tonic::transport::Server::builder().add_service(svc).serve_with_incoming(incoming).await;
        });
        StubServer { stub, addr, _rt: rt }
    }

    fn set(&self, b: Behave) {
        *self.stub.behave.lock().unwrap() = b;
    }

    fn picks(&self) -> usize {
        self.stub.picks.lock().unwrap().len()
    }
}

// ---------------------------------------------------------------- stack --

struct Gateway {
    envoy: Envoy,
    listen: SocketAddr,
}

fn start_gateway(dir: &std::path::Path, workers: &[SocketAddr], cp: SocketAddr, filter_config: &Value) -> Gateway {
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, render_kvgate_envoy(0, 0, workers, &[cp], &filter_config.to_string()).unwrap()).unwrap();
    envoy_validate(&config).unwrap();
    let envoy = Envoy::start(&config, dir).unwrap();
    Gateway { listen: envoy.listen, envoy }
}

impl Gateway {
    fn post(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> HttpResponse {
        let mut h = vec![("content-type", "application/json")];
        h.extend_from_slice(headers);
        http_request(self.listen, "POST", path, &h, body).unwrap()
    }

    fn stat(&self, name: &str) -> u64 {
        self.envoy.stat(&format!("wasmcustom.kvgate.{name}")).unwrap_or(0)
    }
}

fn chat_body(text: &str) -> Vec<u8> {
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}).to_string().into_bytes()
}

/// The echo upstream's view of the request.
fn echoed(r: &HttpResponse) -> Value {
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    serde_json::from_slice(&r.body).unwrap()
}

fn upstreams(n: usize) -> (Vec<EchoUpstream>, Vec<SocketAddr>) {
    let ups: Vec<EchoUpstream> = (0..n).map(|i| EchoUpstream::start(&format!("w{i}")).unwrap()).collect();
    let addrs = ups.iter().map(|u| u.addr).collect();
    (ups, addrs)
}

// ---------------------------------------------------------------- tests --

/// The next turn of a retained conversation goes out with its earlier
/// messages elided; a control plane that lost them answers `resend`, and the
/// filter (in Envoy, from inside the first call's callback) sends the whole
/// request again and steers it.
#[test]
fn retained_messages_are_elided_and_resent_when_lost() {
    let dir = scratch_dir("gw-elide").unwrap();
    let (_ups, addrs) = upstreams(2);
    let stub = StubServer::start();
    let gw = start_gateway(&dir, &addrs, stub.addr, &json!({"control_plane": {"timeout_ms": 2000}}));
    stub.set(Behave::RetainThenForget(addrs[1].to_string()));
    let system = json!({"role": "system", "content": "A long shared document. ".repeat(50)});
    let q1 = json!({"role": "user", "content": "first question"});
    let turn1 = json!({"model": MODEL, "messages": [system, q1]}).to_string();
    assert_eq!(echoed(&gw.post("/v1/chat/completions", &[], turn1.as_bytes()))["upstream"], "w1");
    let turn2 = json!({"model": MODEL, "messages": [system, q1,
        {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "second question"}]})
    .to_string();
    let r = gw.post("/v1/chat/completions", &[], turn2.as_bytes());
    assert_eq!(echoed(&r)["upstream"], "w1", "steered after the resend");
    let picks = stub.stub.picks.lock().unwrap().clone();
    assert_eq!(picks.len(), 3);
    let elided: Vec<bool> = picks[1].segments.iter().map(|s| s.elided).collect();
    assert_eq!(elided, [true, true, false, false]);
    assert!(picks[1].segments[..2].iter().all(|s| s.message_json.is_empty()));
    assert_eq!(picks[1].segments[1].chain_hash, picks[0].segments[1].chain_hash);
    assert!(picks[2].segments.iter().all(|s| !s.elided && !s.message_json.is_empty()), "resent in full");
    assert_eq!(picks[2].segments[3].chain_hash, picks[1].segments[3].chain_hash);
    assert_eq!((gw.stat("pick_resends"), gw.stat("steered")), (1, 2));
}

#[test]
fn kvgate_envoy_config_validates() {
    let dir = scratch_dir("gw-validate").unwrap();
    let config = dir.join("envoy.yaml");
    let workers: Vec<SocketAddr> = vec!["127.0.0.1:9001".parse().unwrap(), "[::1]:9002".parse().unwrap()];
    let cp: SocketAddr = "127.0.0.1:9100".parse().unwrap();
    let text = render_kvgate_envoy(10000, 10001, &workers, &[cp], r#"{"failure_mode":"open"}"#).unwrap();
    for must in ["allow_on_headers_stop_iteration: true", "FAIL_RELOAD", "envoy.wasm.runtime.v8", "override_host"] {
        assert!(text.contains(must), "{must}");
    }
    std::fs::write(&config, text).unwrap();
    envoy_validate(&config).unwrap();
}

/// Three echo upstreams behind Envoy with the filter, and a stub control
/// plane whose answers each test sets. (Bind `_ups` when destructuring: the
/// upstreams stop when it is dropped.)
struct StubRig {
    _ups: Vec<EchoUpstream>,
    addrs: Vec<SocketAddr>,
    stub: StubServer,
    gw: Gateway,
}

/// The Pick timeout of [`stub_rig`]'s filter.
const STUB_TIMEOUT_MS: u64 = 400;

fn stub_rig(name: &str) -> StubRig {
    let dir = scratch_dir(name).unwrap();
    let (ups, addrs) = upstreams(3);
    let stub = StubServer::start();
    let gw = start_gateway(
        &dir,
        &addrs,
        stub.addr,
        &json!({"control_plane": {"timeout_ms": STUB_TIMEOUT_MS}, "max_body_bytes": 65536, "debug_headers": true,
                "reports": {"interval_ms": 50}}),
    );
    StubRig { _ups: ups, addrs, stub, gw }
}

#[test]
fn the_control_planes_choice_wins_over_a_spoofed_header() {
    let StubRig { _ups, addrs, stub, gw } = stub_rig("gw-choice");
    // Fallbacks ride along in the destination header.
    for (i, a) in addrs.iter().enumerate() {
        let other = addrs[(i + 1) % 3].to_string();
        stub.set(Behave::Answer(a.to_string(), vec![other.clone()]));
        let spoof = addrs[(i + 2) % 3].to_string();
        let r = gw.post("/v1/chat/completions", &[("x-gateway-destination-endpoint", &spoof)], &chat_body("hi"));
        let e = echoed(&r);
        assert_eq!(e["upstream"], format!("w{i}"));
        assert_eq!(e["headers"]["x-gateway-destination-endpoint"], format!("{a},{other}"));
        assert_eq!(r.header("x-kvgate-worker"), Some("stub-worker"));
        assert_eq!(r.header("x-kvgate-blocks"), Some("1/2"));
    }
    assert_eq!(gw.stat("steered"), 3);
    assert_eq!(gw.stat("spoofed_header_removed"), 3);
    let picks = stub.stub.picks.lock().unwrap();
    let p = &picks[0];
    assert_eq!((p.model.as_str(), p.api, p.max_tokens), (MODEL, pb::ApiKind::ChatCompletions as i32, Some(4)));
    // The message's bytes exactly as sent (serde_json sorts the keys).
    assert_eq!(p.segments[0].message_json, br#"{"content":"hi","role":"user"}"#);
    assert_eq!(p.segments[0].role, "user");
    assert!(!p.request_id.is_empty(), "x-request-id from Envoy");
}

#[test]
fn every_control_plane_failure_falls_back_with_its_cause() {
    let StubRig { _ups, addrs, stub, gw } = stub_rig("gw-failures");
    let cases = [
        (Behave::Fail(tonic::Code::Internal), "grpc_error"),
        (Behave::Fail(tonic::Code::NotFound), "unknown_model"),
        (Behave::Fail(tonic::Code::Unavailable), "unavailable"),
        // The control plane's own UNAVAILABLE just before the deadline is
        // not a timeout: Envoy's status message tells them apart, where
        // elapsed time cannot (a loaded machine delivers late).
        (Behave::SlowFail(Duration::from_millis(STUB_TIMEOUT_MS - 30), tonic::Code::Unavailable), "unavailable"),
        (Behave::Empty, "unusable_answer"),
        (Behave::Answer("not-an-endpoint".into(), vec![]), "unusable_answer"),
        // An answer later than the Pick timeout: Envoy's timer ends the
        // call, so the added latency is the timeout's, not the answer's
        // (measured by `make bench-gateway`, not asserted in wall-clock
        // time here).
        (Behave::Slow(Duration::from_millis(3000), addrs[0].to_string()), "timeout"),
        // What a tonic server answers when the `grpc-timeout` Envoy sent
        // runs out; it races Envoy's own timer for the same instant.
        (Behave::Fail(tonic::Code::Cancelled), "timeout"),
    ];
    // Envoy's timer is the one wall clock here: when it fired (the
    // cluster's `upstream_rq_timeout` grew, say on a busy machine that
    // delivered the stub's answer late), `timeout` is the true cause.
    let envoy_timeouts = || gw.envoy.stat("cluster.kvgate_control_plane.upstream_rq_timeout").unwrap();
    let mut counted: BTreeMap<&str, u64> = BTreeMap::new();
    for (i, (b, cause)) in cases.into_iter().enumerate() {
        let before = envoy_timeouts();
        stub.set(b);
        let r = gw.post("/v1/chat/completions", &[], &chat_body("fallback"));
        echoed(&r);
        let expected = if envoy_timeouts() > before { "timeout" } else { cause };
        assert_eq!(r.header("x-kvgate-fallback"), Some(expected), "case {i} ({cause})");
        assert!(r.header("x-kvgate-worker").is_none());
        *counted.entry(expected).or_default() += 1;
    }
    for cause in ["timeout", "unusable_answer", "grpc_error", "unavailable", "unknown_model"] {
        assert_eq!(gw.stat(&format!("fallback.{cause}")), counted.get(cause).copied().unwrap_or(0), "{cause}");
    }
}

#[test]
fn bodies_the_filter_does_not_route_pass_through_byte_for_byte() {
    let StubRig { _ups, stub, gw, .. } = stub_rig("gw-passthrough");
    let big = chat_body(&"x".repeat(200_000));
    let malformed = br#"{"model": "deepseek-v3", "messages": [ {"role": "user""#.to_vec();
    let batch = br#"{"model":"deepseek-v3","prompt":["a","b"]}"#.to_vec();
    for (path, body, cause) in [
        ("/v1/chat/completions", &big, "body_too_large"),
        ("/v1/chat/completions", &malformed, "malformed"),
        ("/v1/completions", &batch, "unsupported"),
    ] {
        let r = gw.post(path, &[], body);
        let e = echoed(&r);
        assert_eq!(e["body_bytes"], body.len(), "{cause}");
        assert_eq!(e["body_fnv"], fnv1a(body), "{cause}");
        assert_eq!(r.header("x-kvgate-fallback"), Some(cause));
    }
    assert_eq!(stub.picks(), 0, "no Pick for unroutable bodies");
}

#[test]
fn other_paths_and_methods_are_untouched_but_never_steered_by_the_client() {
    let StubRig { _ups, addrs, stub, gw } = stub_rig("gw-paths");
    stub.set(Behave::Answer(addrs[0].to_string(), vec![]));
    let spoof = ("x-gateway-destination-endpoint", addrs[2].to_string());
    for (method, path) in [("GET", "/v1/models"), ("POST", "/v1/embeddings"), ("GET", "/v1/chat/completions")] {
        let r = http_request(gw.listen, method, path, &[(spoof.0, &spoof.1)], b"{}").unwrap();
        let e = echoed(&r);
        assert!(e["headers"].get("x-gateway-destination-endpoint").is_none(), "{method} {path}: {e}");
        assert!(r.header("x-kvgate-reason").is_none());
    }
    assert_eq!(stub.picks(), 0);
    assert_eq!(gw.stat("requests"), 0, "not requests of the steering path");
}

#[test]
fn steered_requests_are_reported_with_their_timings() {
    let StubRig { _ups, addrs, stub, gw } = stub_rig("gw-reports");
    stub.set(Behave::Answer(addrs[1].to_string(), vec![]));
    for _ in 0..3 {
        echoed(&gw.post("/v1/chat/completions", &[], &chat_body("report me")));
    }
    until(10, "completion reports", || stub.stub.reports.lock().unwrap().len() >= 3);
    let reports = stub.stub.reports.lock().unwrap().clone();
    assert_eq!(reports.len(), 3);
    for r in &reports {
        assert_eq!((r.worker_id.as_str(), r.status_code), ("stub-worker", 200));
        assert!(r.ttfb_us > 0 && r.total_us >= r.ttfb_us, "{r:?}");
        assert_eq!(r.endpoint, addrs[1].to_string());
    }
    assert!(gw.stat("reports_sent") >= 3);
    let hist =
        http_request(gw.envoy.admin, "GET", "/stats?filter=wasmcustom.kvgate.pick_latency_us", &[], b"").unwrap();
    let hist = String::from_utf8_lossy(&hist.body);
    assert!(hist.contains("wasmcustom.kvgate.pick_latency_us"), "latency histogram: {hist}");
}

/// Nothing listens on the control plane's port: every request is still
/// served, by the fallback. How quickly is Envoy's connect failure or Pick
/// timer (the cause says which), not a wall-clock bound here.
#[test]
fn control_plane_down_fails_open() {
    let dir = scratch_dir("gw-down").unwrap();
    let (_ups, addrs) = upstreams(2);
    // Nothing listens on the control plane's port.
    let cp: SocketAddr = ([127, 0, 0, 1], free_port().unwrap()).into();
    let gw = start_gateway(&dir, &addrs, cp, &json!({"debug_headers": true, "reports": {"interval_ms": 50}}));
    let mut seen = BTreeMap::<String, usize>::new();
    for _ in 0..10 {
        let r = gw.post("/v1/chat/completions", &[], &chat_body("anyone there?"));
        *seen.entry(echoed(&r)["upstream"].as_str().unwrap().to_owned()).or_default() += 1;
        let cause = r.header("x-kvgate-fallback").unwrap();
        assert!(["unavailable", "timeout"].contains(&cause), "{cause}");
    }
    assert_eq!(seen.values().sum::<usize>(), 10);
    assert_eq!(gw.stat("fallback.unavailable") + gw.stat("fallback.timeout"), 10);
    // Reports cannot be delivered: they wait (bounded), the errors are counted.
    until(5, "report errors counted", || gw.stat("report_errors") > 0);
    gw.envoy.stat("listener_manager.total_listeners_active").unwrap();
}

#[test]
fn fail_closed_answers_locally() {
    let dir = scratch_dir("gw-closed").unwrap();
    let (ups, addrs) = upstreams(1);
    let stub = StubServer::start();
    stub.set(Behave::Fail(tonic::Code::Unavailable));
    let gw = start_gateway(
        &dir,
        &addrs,
        stub.addr,
        &json!({"failure_mode": "closed", "control_plane": {"timeout_ms": 2000}}),
    );
    let r = gw.post("/v1/chat/completions", &[], &chat_body("hi"));
    assert_eq!(r.status, 503);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["kvgate_cause"], "unavailable");
    let r = gw.post("/v1/chat/completions", &[], b"{oops");
    assert_eq!(r.status, 400);
    assert_eq!(ups[0].served.load(std::sync::atomic::Ordering::Relaxed), 0, "nothing reached the worker");
    // And a good answer still steers.
    stub.set(Behave::Answer(addrs[0].to_string(), vec![]));
    assert_eq!(echoed(&gw.post("/v1/chat/completions", &[], &chat_body("hi")))["upstream"], "w0");
}

/// Sends a streaming request over raw HTTP/1.1 and returns (time to the
/// first SSE event, time to the end, the raw response).
/// Posts a streaming chat request and reads its SSE body; `at_first_event`
/// runs when the first `data:` event has arrived, before the rest is read.
/// Returns the worker header and the whole body.
fn stream(addr: SocketAddr, body: &[u8], at_first_event: impl FnOnce(&str)) -> (String, String) {
    use std::io::Read as _;
    let mut r =
        kvgate_testkit::http::send(addr, "POST", "/v1/chat/completions", &[("content-type", "application/json")], body)
            .unwrap();
    assert_eq!(r.status(), 200);
    let worker = r.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let (mut raw, mut buf, mut first) = (Vec::new(), [0u8; 4096], Some(at_first_event));
    loop {
        let n = r.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if raw.windows(6).any(|w| w == b"data: ")
            && let Some(f) = first.take()
        {
            f(&worker);
        }
    }
    (worker, String::from_utf8(raw).unwrap())
}

#[test]
fn real_fleet_conversation_follows_its_cache_streams_and_reports() {
    let dir = scratch_dir("gw-fleet").unwrap();
    // Real time (speedup 1): streams take long enough to see them flow.
    let mut fleet = Fleet::start(&dir, 2, "1");
    let gw = start_gateway(
        &dir,
        &fleet.http,
        fleet.grpc,
        &json!({"control_plane": {"timeout_ms": 2000}, "debug_headers": true, "reports": {"interval_ms": 100}}),
    );
    let mut messages = json!([
        {"role": "system", "content": "You are a network engineer. ".repeat(60)},
        {"role": "user", "content": "How does Envoy pick an upstream host?"},
    ]);
    let mut workers = Vec::new();
    let mut client_cached = 0;
    for turn in 0..3 {
        let body = json!({"model": MODEL, "messages": messages, "max_tokens": 8}).to_string();
        let r = gw.post("/v1/chat/completions", &[], body.as_bytes());
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        let worker = r.header("x-kvgate-worker").unwrap().to_owned();
        let endpoint = r.header("x-kvgate-endpoint").unwrap();
        assert_eq!(endpoint, fleet.http[worker[1..].parse::<usize>().unwrap()].to_string());
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        let blocks: Vec<u64> = r.header("x-kvgate-blocks").unwrap().split('/').map(|x| x.parse().unwrap()).collect();
        if turn > 0 {
            assert_eq!(worker, workers[0], "turn {turn} follows the conversation's cache");
            assert!(blocks[0] > 0, "turn {turn}: {blocks:?}");
            assert_eq!(cached, blocks[0] * BLOCK, "prediction = engine's cached tokens");
        }
        client_cached += cached;
        workers.push(worker);
        // Its completion report releases the request's load in the control
        // plane (until then the worker counts it as busy prefilling).
        let series = format!("kvgate_reports_total{{model=\"{MODEL}\",kind=\"all\"}}");
        until(10, "the turn's report", || prom(&fleet.metrics(), &series) == Some(f64::from(turn + 1)));
        fleet.wait_quiet();
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let w = workers[0][1..].parse::<usize>().unwrap();
        until(20, "the turn's blocks in the index", || fleet.blocks(w) >= prompt / BLOCK);
        let reply = v["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
        messages.as_array_mut().unwrap().push(json!({"role": "assistant", "content": reply}));
        messages.as_array_mut().unwrap().push(json!({"role": "user", "content": format!("And then {turn}?")}));
    }

    // A stream passes through as it is produced: when the first event
    // arrives, the engine is still generating the request (320 tokens, about
    // 4 s here). Causal, not a comparison of two clocks.
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 320, "stream": true,
                      "stream_options": {"include_usage": true}})
    .to_string();
    // Requests the workers finished, read from their /metrics.
    let finished = || -> f64 {
        fleet
            .http
            .iter()
            .map(|w| {
                let m = String::from_utf8(http_request(*w, "GET", "/metrics", &[], b"").unwrap().body).unwrap();
                m.lines()
                    .find(|l| l.starts_with("vllm:request_success_total{"))
                    .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .unwrap_or(0.0)
            })
            .sum()
    };
    let before = finished();
    let mut at_first = None;
    let (worker, body) = stream(gw.listen, body.as_bytes(), |worker| {
        at_first = Some(finished());
        // The filter reports the first token while the stream runs: the
        // control plane stops counting the prompt as prefill still to do
        // on that worker, and the request is still in flight there.
        let series = |name: &str| format!("{name}{{model=\"{MODEL}\",worker=\"{worker}\"}}");
        until(10, "the first token reported before the end", || {
            let m = fleet.metrics();
            prom(&m, &series("kvgate_worker_inflight")) == Some(1.0)
                && prom(&m, &series("kvgate_worker_prefilling_blocks")) == Some(0.0)
        });
    });
    assert!(body.contains("data: [DONE]"), "{body}");
    assert!(worker.starts_with('w'), "x-kvgate-worker: {worker:?}");
    assert_eq!(at_first, Some(before), "the first event arrived before the engine finished the request");
    until(10, "the request finished", || finished() == before + 1.0);
    let usage_line = body.lines().rev().find(|l| l.contains("\"usage\":{")).unwrap();
    let usage: Value = serde_json::from_str(usage_line.trim_start_matches("data: ")).unwrap();
    client_cached += usage["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(client_cached > 0);

    // The control plane received every report, with the engine's counts.
    let series = format!("kvgate_report_cached_tokens_total{{model=\"{MODEL}\",source=\"reported\"}}");
    until(10, "reports in the control plane", || prom(&fleet.metrics(), &series) == Some(client_cached as f64));
    let m = fleet.metrics();
    let all = prom(&m, &format!("kvgate_reports_total{{model=\"{MODEL}\",kind=\"all\"}}")).unwrap();
    let accurate = prom(&m, &format!("kvgate_reports_total{{model=\"{MODEL}\",kind=\"accurate\"}}")).unwrap();
    assert_eq!(all, 4.0, "{m}");
    assert_eq!(accurate, 4.0, "every prediction within one block: {m}");
    assert_eq!(gw.stat("steered"), 4);
    // Each later turn left out the bytes of the messages the control plane
    // retained from the turn before (one Envoy worker thread): 2 + 4 + 6.
    assert_eq!(prom(&m, "kvgate_pick_elided_messages_total"), Some(12.0), "{m}");
    assert_eq!(prom(&m, "kvgate_pick_resends_total"), Some(0.0), "{m}");
    assert_eq!(gw.stat("pick_resends"), 0);
    fleet.check();
}

/// Session affinity through real Envoy: with it on in the control plane
/// (round robin here, so that only the pin keeps a request in place), the
/// filter sends `x-session-id` with the Pick and every request of the
/// session lands on one worker, with reason `session` where round robin
/// would have moved it; requests without the header keep rotating.
#[test]
fn a_session_header_keeps_a_conversation_on_its_worker() {
    let dir = scratch_dir("gw-session").unwrap();
    let mut fleet = Fleet::start_full(&dir, 2, "20", None, &["--mode", "round_robin", "--session-affinity", "true"]);
    let gw = start_gateway(
        &dir,
        &fleet.http,
        fleet.grpc,
        &json!({"control_plane": {"timeout_ms": 2000}, "debug_headers": true}),
    );
    let worker = |r: &HttpResponse| {
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        (r.header("x-kvgate-worker").unwrap().to_owned(), r.header("x-kvgate-reason").unwrap().to_owned())
    };
    let mut session = Vec::new();
    let mut others = BTreeSet::new();
    for i in 0..4 {
        let body = chat_body(&format!("Turn {i} of a conversation about Envoy."));
        session.push(worker(&gw.post("/v1/chat/completions", &[("x-session-id", "conv-1")], &body)));
        // Two in between, so that round robin's turn and the pin disagree.
        for _ in 0..2 {
            others.insert(worker(&gw.post("/v1/chat/completions", &[], &body)).0);
        }
    }
    let first = session[0].0.clone();
    assert!(session.iter().all(|(w, _)| *w == first), "{session:?}");
    assert!(session.iter().any(|(_, reason)| reason == "session"), "{session:?}");
    assert_eq!(others.len(), 2, "without the header round robin rotates: {others:?}");
    let m = fleet.metrics();
    assert_eq!(prom(&m, &format!("kvgate_sessions{{model=\"{MODEL}\"}}")), Some(1.0), "{m}");
    fleet.check();
}

// ------------------------------------------------------- monitoring --

/// Metric names in a Prometheus text exposition (`name{...} v` or `name v`).
fn metric_names(text: &str) -> BTreeSet<String> {
    kvgate_testkit::prom::names(text)
}

/// Every metric name a Grafana expression uses: the identifiers with the
/// components' prefixes (kvgate_, vllm:, envoy_).
fn dashboard_metrics(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = expr.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let rest = &expr[i..];
        let starts = ["kvgate_", "vllm:", "envoy_"].iter().any(|p| rest.starts_with(p));
        let boundary = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b':');
        if starts && boundary {
            let len = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')).unwrap_or(rest.len());
            out.push(rest[..len].to_owned());
            i += len;
        } else {
            i += 1;
        }
    }
    out
}

#[test]
fn nats_credentials_work_and_the_grafana_dashboard_uses_only_exported_metrics() {
    let dir = scratch_dir("gw-monitoring").unwrap();
    // NATS requires a password: workers only become live in the control
    // plane if both the relays and the control plane authenticated.
    let mut fleet = Fleet::start_with(&dir, 2, "1", Some(("kvgate", "s3cret-pw")));
    // A relay with a wrong password is refused and says so.
    let bad = common::kvgate(&[
        "relay",
        "--zmq-endpoint",
        "tcp://127.0.0.1:1",
        "--nats-url",
        &format!("nats://kvgate:wrong@127.0.0.1:{}", fleet.nats.port),
        "--model",
        MODEL,
        "--endpoint",
        "127.0.0.1:9",
    ])
    .output()
    .unwrap();
    assert!(!bad.status.success(), "a relay with a wrong NATS password kept running");
    let err = String::from_utf8_lossy(&bad.stderr).to_lowercase();
    assert!(err.contains("authori") || err.contains("auth"), "no authentication error: {err}");

    let gw = start_gateway(&dir, &fleet.http, fleet.grpc, &json!({"reports": {"interval_ms": 100}}));
    for turn in 0..3 {
        let r = gw.post("/v1/chat/completions", &[], &chat_body(&format!("monitoring turn {turn} ").repeat(40)));
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    let reports = format!("kvgate_reports_total{{model=\"{MODEL}\",kind=\"all\"}}");
    until(10, "the three completion reports at the control plane", || {
        prom(&fleet.metrics(), &reports).is_some_and(|v| v >= 3.0)
    });
    until(10, "stored blocks in the index", || (0..2).any(|w| fleet.blocks(w) > 0));

    let get = |addr: SocketAddr, path: &str| {
        let r = http_request(addr, "GET", path, &[], b"").unwrap();
        assert_eq!(r.status, 200, "GET {addr}{path}");
        String::from_utf8(r.body).unwrap()
    };
    let mut exported = metric_names(&fleet.metrics());
    for (i, w) in fleet.http.iter().enumerate() {
        exported.extend(metric_names(&get(*w, "/metrics")));
        exported.extend(metric_names(&get(fleet.relay_metrics[i], "/metrics")));
    }
    let envoy_admin = gw.envoy.admin;
    exported.extend(metric_names(&get(envoy_admin, "/stats/prometheus")));

    let dashboard: Value = serde_json::from_slice(
        &std::fs::read(kvgate_testkit::repo_root().join("deploy/monitoring/kvgate-dashboard.json")).unwrap(),
    )
    .unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    let mut missing = BTreeSet::new();
    let mut used = 0;
    for p in panels.iter().filter(|p| p["type"] != "row") {
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().unwrap();
            let names = dashboard_metrics(expr);
            assert!(!names.is_empty(), "panel {}: no kvgate/vLLM/Envoy metric in {expr}", p["title"]);
            for n in names {
                used += 1;
                let base = ["_bucket", "_sum", "_count"].iter().find_map(|s| n.strip_suffix(s)).unwrap_or(&n);
                let known = exported.contains(&n)
                    || ["_bucket", "_sum", "_count"].iter().any(|s| exported.contains(&format!("{base}{s}")));
                if !known {
                    missing.insert(n);
                }
            }
        }
    }
    assert!(used >= 30, "the dashboard uses only {used} metrics");
    let envoyish: Vec<&String> =
        exported.iter().filter(|n| n.contains("kvgate") || n.contains("steered") || n.contains("fallback")).collect();
    assert!(
        missing.is_empty(),
        "the dashboard uses metrics no component exports: {missing:?}; Envoy exports for kvgate: {envoyish:?}"
    );
    fleet.check();
}

// ----------------------------------------------------------------- mTLS --

/// A CA, and certificates it signs, as PEM files in `dir`.
struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    ca_file: std::path::PathBuf,
}

impl TestCa {
    fn new(dir: &std::path::Path, name: &str) -> TestCa {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        let ca_file = dir.join(format!("{name}.crt"));
        std::fs::write(&ca_file, cert.pem()).unwrap();
        TestCa { issuer: rcgen::Issuer::new(params, key), ca_file }
    }

    /// A leaf certificate for `dns` (server and client use), as
    /// (certificate file, key file).
    fn leaf(&self, dir: &std::path::Path, name: &str, dns: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec![dns.to_owned()]).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.extended_key_usages =
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let (c, k) = (dir.join(format!("{name}.crt")), dir.join(format!("{name}.key")));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }
}

#[test]
fn mutual_tls_between_filter_and_control_plane() {
    const SNI: &str = "kvgate-control-plane.kvgate.svc";
    let dir = scratch_dir("gw-mtls").unwrap();
    let ca = TestCa::new(&dir, "kvgate-ca");
    let (server_crt, server_key) = ca.leaf(&dir, "control-plane", SNI);
    let (client_crt, client_key) = ca.leaf(&dir, "gateway", "gateway.kvgate.svc");
    let rogue = TestCa::new(&dir, "rogue-ca");
    let (rogue_crt, rogue_key) = rogue.leaf(&dir, "rogue-gateway", "gateway.kvgate.svc");

    // The real control plane, static workers (the echo upstreams), TLS on
    // its gRPC port with client certificates required.
    let (_ups, addrs) = upstreams(2);
    let (gp, ap) = (free_port().unwrap(), free_port().unwrap());
    let grpc: SocketAddr = ([127, 0, 0, 1], gp).into();
    let mut serve = common::kvgate(&["serve", "--nats-url", "off", "--model", MODEL, "--block-size", "16"]);
    serve.env_remove("KVGATE_TOKENIZER_DIR");
    serve.args(["--listen-grpc", &grpc.to_string(), "--listen-admin", &format!("127.0.0.1:{ap}")]);
    serve.arg("--tls-cert-file").arg(&server_crt).arg("--tls-key-file").arg(&server_key);
    serve.env("KVGATE_TLS_CLIENT_CA_FILE", &ca.ca_file);
    for (i, a) in addrs.iter().enumerate() {
        serve.args(["--worker", &format!("w{i}={a}")]);
    }
    let mut cp = kvgate_testkit::Proc::spawn("serve-tls", serve, &dir).unwrap();
    kvgate_testkit::wait_for_tcp(grpc, Duration::from_secs(30)).unwrap();

    let filter = json!({"control_plane": {"timeout_ms": 2000}, "debug_headers": true}).to_string();
    let gateway = |name: &str, tls: Option<kvgate_testkit::ControlPlaneTls<'_>>| {
        let config = dir.join(format!("envoy-{name}.yaml"));
        let text = kvgate_testkit::render_kvgate_envoy_tls(0, 0, &addrs, &[grpc], &filter, tls.as_ref()).unwrap();
        std::fs::write(&config, text).unwrap();
        envoy_validate(&config).unwrap();
        let sub = dir.join(name);
        std::fs::create_dir_all(&sub).unwrap();
        let envoy = Envoy::start(&config, &sub).unwrap();
        Gateway { listen: envoy.listen, envoy }
    };
    let ask = |gw: &Gateway| {
        let r = gw.post("/v1/chat/completions", &[], &chat_body("over mutual TLS"));
        echoed(&r);
        (r.header("x-kvgate-worker").map(str::to_owned), r.header("x-kvgate-fallback").map(str::to_owned))
    };

    // The gateway's certificate is signed by the CA the control plane
    // trusts, and it trusts the control plane's: routed.
    let good = gateway(
        "good",
        Some(kvgate_testkit::ControlPlaneTls {
            ca_file: &ca.ca_file,
            cert_file: &client_crt,
            key_file: &client_key,
            sni: SNI,
        }),
    );
    for _ in 0..3 {
        let (worker, fallback) = ask(&good);
        assert!(worker.as_deref().is_some_and(|w| w.starts_with('w')), "not routed: {worker:?} {fallback:?}");
        assert_eq!(fallback, None);
    }
    assert_eq!(good.stat("steered"), 3);
    let ssl = |gw: &Gateway, s: &str| gw.envoy.stat(&format!("cluster.kvgate_control_plane.ssl.{s}")).unwrap_or(0);
    assert!(ssl(&good, "handshake") >= 1);

    // Refused, and every request still answered through the fallback:
    // a client certificate of another CA (the control plane refuses it),
    let stranger = gateway(
        "stranger",
        Some(kvgate_testkit::ControlPlaneTls {
            ca_file: &ca.ca_file,
            cert_file: &rogue_crt,
            key_file: &rogue_key,
            sni: SNI,
        }),
    );
    // a control plane Envoy cannot verify (it trusts only the rogue CA),
    let distrustful = gateway(
        "distrustful",
        Some(kvgate_testkit::ControlPlaneTls {
            ca_file: &rogue.ca_file,
            cert_file: &client_crt,
            key_file: &client_key,
            sni: SNI,
        }),
    );
    // a certificate name that is not the one Envoy asks for,
    let misnamed = gateway(
        "misnamed",
        Some(kvgate_testkit::ControlPlaneTls {
            ca_file: &ca.ca_file,
            cert_file: &client_crt,
            key_file: &client_key,
            sni: "someone-else.kvgate.svc",
        }),
    );
    // and plaintext to the TLS port.
    let plaintext = gateway("plaintext", None);
    for (name, gw) in
        [("stranger", &stranger), ("distrustful", &distrustful), ("misnamed", &misnamed), ("plaintext", &plaintext)]
    {
        let (worker, fallback) = ask(gw);
        assert_eq!(worker, None, "{name}");
        assert_eq!(fallback.as_deref(), Some("unavailable"), "{name}");
        assert_eq!(gw.stat("steered"), 0, "{name}");
    }
    // Each for its own reason: Envoy refused the server's certificate (not
    // signed by its CA; not the name asked for); the control plane refused
    // the stranger's (Envoy's handshake completes, the server's check ends
    // the connection).
    assert!(ssl(&distrustful, "fail_verify_error") >= 1);
    assert!(ssl(&misnamed, "fail_verify_san") >= 1);
    for gw in [&stranger, &plaintext] {
        assert_eq!(ssl(gw, "fail_verify_error") + ssl(gw, "fail_verify_san"), 0);
    }
    // The refused handshakes did not disturb the control plane.
    assert_eq!(ask(&good).1, None);
    cp.ensure_running().unwrap();

    // A key that does not hold PEM stops the start with the field's name.
    let junk = dir.join("junk.key");
    std::fs::write(&junk, "not a key").unwrap();
    let out = common::kvgate(&["serve", "--nats-url", "off", "--model", MODEL, "--block-size", "16"])
        .env_remove("KVGATE_TOKENIZER_DIR")
        .args(["--listen-grpc", "127.0.0.1:0", "--listen-admin", "off"])
        .arg("--tls-cert-file")
        .arg(&server_crt)
        .arg("--tls-key-file")
        .arg(&junk)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tls_key_file") && err.contains("no PEM block"), "{err}");
}

/// A body over the filter's `max_body_bytes` passes through unrouted,
/// chunked (no content-length: the filter finds out while buffering) or
/// not, instead of getting Envoy's 413.
#[test]
fn a_body_over_the_limit_passes_through_unrouted() {
    let dir = scratch_dir("gw-big-body").unwrap();
    let (_ups, addrs) = upstreams(2);
    let stub = StubServer::start();
    let gw = start_gateway(&dir, &addrs, stub.addr, &json!({"control_plane": {"timeout_ms": 2000}}));
    // 9 MiB of JSON: over the default max_body_bytes (8 MiB).
    let big = json!({"model": MODEL, "messages": [{"role": "user", "content": "x".repeat(9 << 20)}]}).to_string();
    let r = gw.post("/v1/chat/completions", &[], big.as_bytes());
    assert_eq!(r.status, 200, "content-length body: {:.300}", String::from_utf8_lossy(&r.body));
    let mut s = TcpStream::connect(gw.listen).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n").unwrap();
    for chunk in big.as_bytes().chunks(256 << 10) {
        write!(s, "{:x}\r\n", chunk.len()).unwrap();
        s.write_all(chunk).unwrap();
        s.write_all(b"\r\n").unwrap();
    }
    s.write_all(b"0\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 200"), "chunked body: {text:.300}");
    assert_eq!(gw.stat("fallback.body_too_large"), 2, "both passed through unrouted");
    assert_eq!(stub.picks(), 0);
}
