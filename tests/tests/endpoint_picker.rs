//! kvgate as the Gateway API Inference Extension's endpoint picker: Envoy
//! 1.40's ext_proc filter (`envoy/endpoint-picker.yaml`, no Wasm) calls
//! `kvgate serve`, whose answer (header and `envoy.lb` dynamic metadata)
//! the worker cluster's override_host policy follows, on 127.0.0.1.
//!
//! * Static workers (echo upstreams), in full-duplex and buffered body
//!   modes: a chat request lands on the endpoint the picker named first,
//!   a client's own destination header is replaced, bodies (one of 300 KB,
//!   in several chunks) arrive byte for byte, other paths are routed by
//!   load, malformed bodies get 400, unknown models 404, the picker's
//!   counters and completion reports add up; with the picker down,
//!   requests still flow in buffered mode (fail-open) and get 500 in
//!   full-duplex mode (Envoy's behaviour).
//! * The real fleet: a conversation through the picker stays on the
//!   worker that holds its prefix, and the engine's cached tokens come back.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{Fleet, MODEL, prom, until};
use kvgate_testkit::{
    EchoUpstream, Envoy, HttpResponse, Proc, envoy_validate, fnv1a, free_port, http_request, render_picker_envoy,
    scratch_dir, wait_for_tcp,
};
use serde_json::{Value, json};

struct Gateway {
    _envoy: Envoy,
    listen: SocketAddr,
}

fn gateway(
    dir: &std::path::Path,
    name: &str,
    workers: &[SocketAddr],
    picker: SocketAddr,
    modes: (&str, &str),
) -> Gateway {
    let config = dir.join(format!("envoy-{name}.yaml"));
    std::fs::write(&config, render_picker_envoy(0, 0, workers, picker, modes.0, modes.1).unwrap()).unwrap();
    envoy_validate(&config).unwrap();
    let sub = dir.join(name);
    std::fs::create_dir_all(&sub).unwrap();
    let envoy = Envoy::start(&config, &sub).unwrap();
    Gateway { listen: envoy.listen, _envoy: envoy }
}

impl Gateway {
    fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> HttpResponse {
        let mut h = vec![("content-type", "application/json")];
        h.extend_from_slice(headers);
        http_request(self.listen, method, path, &h, body).unwrap()
    }
}

fn chat(model: &str, text: &str) -> Vec<u8> {
    json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}).to_string().into_bytes()
}

fn echoed(r: &HttpResponse) -> Value {
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    serde_json::from_slice(&r.body).unwrap()
}

fn serve_static(dir: &std::path::Path, workers: &[SocketAddr]) -> (Proc, SocketAddr, SocketAddr) {
    let (gp, ap) = (free_port().unwrap(), free_port().unwrap());
    let grpc: SocketAddr = ([127, 0, 0, 1], gp).into();
    let admin: SocketAddr = ([127, 0, 0, 1], ap).into();
    let mut serve = common::kvgate(&["serve", "--nats-url", "off", "--model", MODEL, "--block-size", "16"]);
    serve.arg("--tokenizer-dir").arg(common::tokenizer_dir());
    serve.args(["--listen-grpc", &grpc.to_string(), "--listen-admin", &admin.to_string()]);
    for (i, a) in workers.iter().enumerate() {
        serve.args(["--worker", &format!("w{i}={a}")]);
    }
    let p = Proc::spawn("serve-epp", serve, dir).unwrap();
    wait_for_tcp(admin, Duration::from_secs(30)).unwrap();
    (p, grpc, admin)
}

fn metrics(admin: SocketAddr) -> String {
    String::from_utf8(http_request(admin, "GET", "/metrics", &[], b"").unwrap().body).unwrap()
}

fn outcome(admin: SocketAddr, o: &str) -> f64 {
    prom(&metrics(admin), &format!("kvgate_epp_requests_total{{outcome=\"{o}\"}}")).unwrap_or(-1.0)
}

#[test]
fn endpoint_picker_routes_through_envoy_ext_proc() {
    let dir = scratch_dir("epp-static").unwrap();
    let ups: Vec<EchoUpstream> = (0..3).map(|i| EchoUpstream::start(&format!("w{i}")).unwrap()).collect();
    let addrs: Vec<SocketAddr> = ups.iter().map(|u| u.addr).collect();
    let (mut cp, grpc, admin) = serve_static(&dir, &addrs);
    let big = chat(MODEL, &"a long shared document. ".repeat(12_500));
    assert!(big.len() > 300_000);

    let mut routed = 0.0;
    for (name, modes) in
        [("full-duplex", ("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED")), ("buffered", ("BUFFERED", "STREAMED"))]
    {
        let gw = gateway(&dir, name, &addrs, grpc, modes);
        // The picker's first endpoint is where the request lands, whatever
        // the client claimed.
        for body in [chat(MODEL, "hello there"), chat(MODEL, "another question"), big.clone()].iter() {
            let r = gw.send("POST", "/v1/chat/completions", &[("x-gateway-destination-endpoint", "10.9.9.9:1")], body);
            let e = echoed(&r);
            let header = e["headers"]["x-gateway-destination-endpoint"].as_str().unwrap().to_owned();
            assert_ne!(header, "10.9.9.9:1", "{name}: the client's header survived");
            let first: SocketAddr = header.split(',').next().unwrap().parse().unwrap();
            let landed = addrs.iter().position(|a| *a == first).unwrap();
            assert_eq!(e["upstream"], format!("w{landed}"), "{name}: routed elsewhere than {header}");
            assert_eq!(header.split(',').count(), 3, "{name}: primary and fallbacks: {header}");
            assert_eq!(e["body_bytes"], body.len(), "{name}");
            assert_eq!(e["body_fnv"], fnv1a(body), "{name}: the body changed on the way");
            routed += 1.0;
        }
        assert_eq!(outcome(admin, "routed"), routed, "{name}");

        // Other paths and methods: routed by load (every request through a
        // pool needs an endpoint).
        let r = gw.send("GET", "/v1/models", &[], b"");
        let e = echoed(&r);
        assert!(e["headers"]["x-gateway-destination-endpoint"].is_string(), "{name}: {e}");

        // A body that is not JSON: 400, an OpenAI-style error, no upstream.
        let served_before: u64 = ups.iter().map(|u| u.served.load(std::sync::atomic::Ordering::Relaxed)).sum();
        let r = gw.send("POST", "/v1/chat/completions", &[], br#"{"model": "deepseek-v3", "messages": [ {"#);
        assert_eq!(r.status, 400, "{name}: {}", String::from_utf8_lossy(&r.body));
        let err: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(err["error"]["type"], "invalid_request_error");
        // An unknown model: 404, as OpenAI answers.
        let r = gw.send("POST", "/v1/chat/completions", &[], &chat("no-such-model", "hi"));
        assert_eq!(r.status, 404, "{name}: {}", String::from_utf8_lossy(&r.body));
        let err: Value = serde_json::from_slice(&r.body).unwrap();
        assert!(err["error"]["message"].as_str().unwrap().contains("no-such-model"));
        let served_after: u64 = ups.iter().map(|u| u.served.load(std::sync::atomic::Ordering::Relaxed)).sum();
        assert_eq!(served_after, served_before, "{name}: a refused request reached a worker");
    }
    assert_eq!(outcome(admin, "load"), 2.0);
    assert_eq!(outcome(admin, "bad_request"), 2.0);
    assert_eq!(outcome(admin, "unknown_model"), 2.0);

    // Every routed request was reported done: nothing stays in flight.
    let reports = format!("kvgate_reports_total{{model=\"{MODEL}\",kind=\"all\"}}");
    until(10, "a completion report per routed request", || {
        prom(&metrics(admin), &reports).is_some_and(|v| v >= routed + 2.0)
    });
    let workers: Value =
        serde_json::from_slice(&http_request(admin, "GET", "/admin/workers", &[], b"").unwrap().body).unwrap();
    for w in workers[MODEL].as_array().unwrap() {
        assert_eq!(w["inflight"], 0, "{w}");
    }

    // The picker is gone. In BUFFERED mode ext_proc fails open
    // (failure_mode_allow) and least request picks. In FULL_DUPLEX_STREAMED
    // mode Envoy 1.40 answers 500 when the body was already handed to the
    // stream (it cannot be recovered), and fails open when the stream failed
    // before that: a race between the refused connection and the body
    // (both seen here; docs/INSTALL.md says to run the picker with replicas
    // for that reason). Either way, never a pick and never a damaged body.
    let buffered = gateway(&dir, "picker-down-buffered", &addrs, grpc, ("BUFFERED", "STREAMED"));
    let duplex = gateway(&dir, "picker-down-duplex", &addrs, grpc, ("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED"));
    cp.kill();
    for _ in 0..3 {
        let r = buffered.send("POST", "/v1/chat/completions", &[], &chat(MODEL, "still answered"));
        let e = echoed(&r);
        assert!(e["headers"].get("x-gateway-destination-endpoint").is_none(), "{e}");
        let body = chat(MODEL, "maybe answered");
        let r = duplex.send("POST", "/v1/chat/completions", &[], &body);
        match r.status {
            500 => {}
            200 => {
                let e = echoed(&r);
                assert!(e["headers"].get("x-gateway-destination-endpoint").is_none(), "{e}");
                assert_eq!(e["body_bytes"], body.len(), "{e}");
            }
            other => panic!("picker down, full duplex: {other} {}", String::from_utf8_lossy(&r.body)),
        }
    }
}

#[test]
fn a_conversation_through_the_endpoint_picker_follows_its_cache() {
    let dir = scratch_dir("epp-fleet").unwrap();
    let fleet = Fleet::start(&dir, 2, "1");
    let gw = gateway(&dir, "fleet", &fleet.http, fleet.grpc, ("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED"));
    let mut messages = json!([
        {"role": "system", "content": "You are a storage engineer. ".repeat(60)},
        {"role": "user", "content": "How does a log-structured merge tree compact?"},
    ]);
    let mut workers = Vec::new();
    let mut cached = Vec::new();
    for turn in 0..3 {
        fleet.wait_quiet();
        let body = json!({"model": MODEL, "messages": messages, "max_tokens": 8}).to_string();
        let r = gw.send("POST", "/v1/chat/completions", &[], body.as_bytes());
        assert_eq!(r.status, 200, "turn {turn}: {}", String::from_utf8_lossy(&r.body));
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        cached.push(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0));
        let answer = v["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
        // Which worker served it: the picker's counters per worker.
        let blocks: Vec<u64> = (0..2).map(|w| fleet.blocks(w)).collect();
        workers.push(blocks);
        let m = messages.as_array_mut().unwrap();
        m.push(json!({"role": "assistant", "content": answer}));
        m.push(json!({"role": "user", "content": format!("And what happens at level {turn}?")}));
        until(10, "the turn's blocks in the index", || (0..2).any(|w| fleet.blocks(w) > 0));
    }
    // The first turn computes the prefix; the next ones find it cached.
    assert!(cached[1] > 0 && cached[2] > 0, "no cached tokens on later turns: {cached:?}");
    // Only one worker ever stored blocks: the conversation never moved.
    let holders: Vec<usize> = (0..2).filter(|&w| fleet.blocks(w) > 0).collect();
    assert_eq!(holders.len(), 1, "blocks on more than one worker: {workers:?}");
    let m = fleet.metrics();
    assert!(prom(&m, "kvgate_epp_requests_total{outcome=\"routed\"}").is_some_and(|v| v >= 3.0), "{m}");
    let reports = format!("kvgate_reports_total{{model=\"{MODEL}\",kind=\"with_cached\"}}");
    until(10, "reports carrying cached tokens", || prom(&fleet.metrics(), &reports).is_some_and(|v| v >= 2.0));
}
