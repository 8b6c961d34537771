//! Disaggregated prefill and decode end to end, both ways: two simulated
//! prefill workers and one decode worker, their relays announcing the
//! roles, NATS, the control plane (a local prefill of 64 tokens or more is
//! disaggregated) and real Envoy with the filter.
//!
//! - [`Way::Sidecar`], llm-d's convention: the decode worker is behind
//!   `kvgate pd-sidecar`; the filter names the prefill worker in
//!   `x-prefiller-host-port` and the sidecar runs the two legs.
//! - [`Way::Filter`], no sidecar: the filter runs the prefill leg itself
//!   (an HTTP call through Envoy's `kvgate_prefill` cluster) and sends the
//!   decode leg, its body rewritten, to the decode worker.
//!
//! A long prompt is prefilled on a prefill worker
//! (`kv_transfer_params.do_remote_decode`), then decoded on the decode
//! worker's engine, which receives the prompt's KV instead of computing it,
//! and the stream reaches the client. Roles hold: no request is decoded on
//! a prefill worker. A slow prefill worker (past the leg's timeout) and dead
//! ones leave requests aggregated on the decode worker, none failed. With
//! the opt-ins, a `both` worker prefills for a busy one, and a saturated
//! decode worker overflows whole requests to a prefill worker.

mod common;

use common::{BLOCK, Fleet, FleetOpts, MODEL, prom, until};
use kvgate_testkit::{Envoy, http_request, scratch_dir};
use serde_json::{Value, json};

fn chat(text: &str, stream: bool) -> Vec<u8> {
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8, "stream": stream,
        "stream_options": {"include_usage": true}})
    .to_string()
    .into_bytes()
}

fn sim_cache(addr: std::net::SocketAddr) -> Value {
    serde_json::from_slice(&http_request(addr, "GET", "/kvgate/sim/cache", &[], b"").unwrap().body).unwrap()
}

/// The usage chunk of a streamed answer.
fn stream_usage(body: &str) -> Value {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["usage"].is_object())
        .map(|v| v["usage"].clone())
        .expect("usage")
}

/// Who runs the two legs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    Sidecar,
    Filter,
}

fn fleet(dir: &std::path::Path, way: Way) -> Fleet {
    Fleet::start_opts(
        dir,
        3,
        "20",
        FleetOpts {
            roles: &["prefill", "prefill", "decode"],
            pd_sidecar: way == Way::Sidecar,
            serve_args: &["--disaggregate-min-uncached-tokens", "64"],
            ..Default::default()
        },
    )
}

fn gateway(fleet: &Fleet, way: Way) -> Envoy {
    let mut filter = json!({"control_plane": {"timeout_ms": 2000}, "debug_headers": true});
    if way == Way::Filter {
        filter["disaggregation"] = json!({"legs": "filter", "timeout_ms": 5000});
    }
    fleet.envoy(&filter)
}

/// Requests whose two legs ran (`outcome` "disaggregated"), or that fell
/// back to aggregated with this cause, as counted by whoever runs the legs:
/// the sidecar's metrics or the filter's Envoy stats.
fn legs(fleet: &Fleet, envoy: &Envoy, way: Way, outcome: &str) -> f64 {
    match way {
        Way::Sidecar => {
            let m = http_request(fleet.http[2], "GET", "/kvgate/pd/metrics", &[], b"").unwrap().body;
            let m = String::from_utf8(m).unwrap();
            let series = match outcome {
                "disaggregated" => r#"kvgate_pd_requests_total{outcome="disaggregated",cause=""}"#.to_owned(),
                cause => format!(r#"kvgate_pd_requests_total{{outcome="fallback",cause="{cause}"}}"#),
            };
            prom(&m, &series).unwrap_or(0.0)
        }
        Way::Filter => {
            let stat = match outcome {
                "disaggregated" => "wasmcustom.kvgate.prefill_legs".to_owned(),
                cause => format!("wasmcustom.kvgate.prefill_fallback.{cause}"),
            };
            envoy.stat(&stat).unwrap() as f64
        }
    }
}

#[test]
fn a_long_prompt_is_prefilled_on_a_prefill_worker_and_streamed_by_the_decode_worker() {
    streams_through(Way::Sidecar);
}

#[test]
fn the_filter_runs_the_prefill_leg_itself_and_the_decode_worker_streams() {
    streams_through(Way::Filter);
}

fn streams_through(way: Way) {
    let dir = scratch_dir(&format!("disaggregation-{way:?}")).unwrap();
    let mut fleet = fleet(&dir, way);
    let roles: Vec<(String, String)> = fleet.workers()[MODEL]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["id"].as_str().unwrap().to_owned(), w["role"].as_str().unwrap().to_owned()))
        .collect();
    assert_eq!(roles, [("w0", "prefill"), ("w1", "prefill"), ("w2", "decode")].map(|(a, b)| (a.into(), b.into())));
    let envoy = gateway(&fleet, way);
    let json_ct = [("content-type", "application/json")];
    let prefill_addrs = [fleet.http[0].to_string(), fleet.http[1].to_string()];

    // A document of a few hundred tokens: disaggregated.
    let doc = "Prefill workers compute prompts; decode workers stream the answers. ".repeat(30);
    let r = http_request(envoy.listen, "POST", "/v1/chat/completions", &json_ct, &chat(&doc, true)).unwrap();
    let body = String::from_utf8_lossy(&r.body).into_owned();
    assert_eq!(r.status, 200, "{body}");
    assert!(body.contains("data: [DONE]"), "the stream reaches the client: {body}");
    assert_eq!(r.header("x-kvgate-worker"), Some("w2"), "decoded on the decode worker");
    let prefiller = r.header("x-kvgate-prefill").expect("disaggregated").to_owned();
    assert!(prefill_addrs.contains(&prefiller), "{prefiller}");
    // The usage chunk: the decode engine received all but the last token.
    let usage = stream_usage(&body);
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(prompt - 1), "{usage}");
    assert_eq!(legs(&fleet, &envoy, way, "disaggregated"), 1.0);
    // Both engines hold the prompt: the prefill worker computed it, the
    // decode worker stored what it received (and announced it).
    let p = prefill_addrs.iter().position(|a| *a == prefiller).unwrap();
    assert!(sim_cache(fleet.engines[p])["cached_blocks"].as_u64().unwrap() >= prompt / BLOCK - 1);
    assert!(sim_cache(fleet.engines[2])["cached_blocks"].as_u64().unwrap() >= prompt / BLOCK - 1);
    let blocks_of = |f: &Fleet, id: &str| {
        f.workers()[MODEL].as_array().and_then(|a| a.iter().find(|w| w["id"] == id).cloned()).unwrap_or_default()
            ["device_blocks"]
            .as_u64()
            .unwrap_or(0)
    };
    until(20, "the received blocks of w2 in the index", || blocks_of(&fleet, "w2") >= prompt / BLOCK - 1);
    fleet.wait_quiet();

    // The same document again: the decode worker holds it now, its local
    // prefill is one block: aggregated, a full cache hit.
    let r = http_request(envoy.listen, "POST", "/v1/chat/completions", &json_ct, &chat(&doc, false)).unwrap();
    assert_eq!(r.status, 200);
    assert_eq!((r.header("x-kvgate-worker"), r.header("x-kvgate-prefill")), (Some("w2"), None));
    assert_eq!(legs(&fleet, &envoy, way, "disaggregated"), 1.0, "no second prefill leg");

    // Roles hold: short and long prompts alike are decoded on w2.
    for i in 0..6 {
        let text = format!("Question {i}: ").repeat(if i % 2 == 0 { 2 } else { 60 });
        let r = http_request(envoy.listen, "POST", "/v1/chat/completions", &json_ct, &chat(&text, false)).unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.header("x-kvgate-worker"), Some("w2"), "request {i}");
        assert_eq!(r.header("x-kvgate-prefill").is_some(), i % 2 == 1, "request {i}: long ones are disaggregated");
    }
    let cp = fleet.metrics();
    assert_eq!(
        prom(&cp, &format!(r#"kvgate_disaggregation_total{{model="{MODEL}",outcome="disaggregated"}}"#)),
        Some(4.0)
    );
    assert_eq!(legs(&fleet, &envoy, way, "disaggregated"), 4.0);
    fleet.check();
}

#[test]
fn slow_or_dead_prefill_workers_leave_requests_aggregated_and_none_fails() {
    survives_prefill_faults(Way::Sidecar);
}

#[test]
fn slow_or_dead_prefill_workers_behind_the_filters_legs_leave_requests_aggregated() {
    survives_prefill_faults(Way::Filter);
}

fn survives_prefill_faults(way: Way) {
    let dir = scratch_dir(&format!("disaggregation-faults-{way:?}")).unwrap();
    let mut fleet = fleet(&dir, way);
    let envoy = gateway(&fleet, way);
    let json_ct = [("content-type", "application/json")];
    let long = |i: usize| chat(&format!("Document {i} about prefill faults. ").repeat(40), false);

    // Both prefill workers 10,000 times slower: the leg outlasts its 5 s
    // timeout and the decode worker prefills itself.
    for w in 0..2 {
        let r = http_request(fleet.engines[w], "POST", "/kvgate/sim/slowdown?factor=10000", &[], b"").unwrap();
        assert_eq!(r.status, 200);
    }
    let r = http_request(envoy.listen, "POST", "/v1/chat/completions", &json_ct, &long(0)).unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.header("x-kvgate-prefill").is_some(), "the control plane chose to disaggregate");
    assert_eq!(legs(&fleet, &envoy, way, "timeout"), 1.0);
    if way == Way::Filter {
        assert_eq!(r.header("x-kvgate-prefill-fallback"), Some("timeout"));
    }
    let usage = serde_json::from_slice::<Value>(&r.body).unwrap()["usage"].clone();
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(0), "prefilled locally: {usage}");

    // Both prefill engines die. Until their relays report them down the
    // control plane may still name one; the leg then finds nobody and the
    // request is served aggregated. Every request succeeds, on the decode worker.
    fleet.kill(Fleet::sim(0));
    fleet.kill(Fleet::sim(1));
    for i in 1..=12 {
        let r = http_request(envoy.listen, "POST", "/v1/chat/completions", &json_ct, &long(i)).unwrap();
        assert_eq!(r.status, 200, "request {i}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.header("x-kvgate-worker"), Some("w2"));
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    // Once the relays report the engines unhealthy, nothing is disaggregated.
    until(30, "the prefill workers out of routing", || {
        fleet.workers()[MODEL].as_array().is_some_and(|a| a.iter().filter(|w| w["live"] == true).count() == 1)
    });
    let r = http_request(envoy.listen, "POST", "/v1/chat/completions", &json_ct, &long(99)).unwrap();
    assert_eq!((r.status, r.header("x-kvgate-prefill")), (200, None));
    let cp = fleet.metrics();
    let declined = format!(r#"kvgate_disaggregation_total{{model="{MODEL}",outcome="no_prefill_capacity"}}"#);
    assert!(prom(&cp, &declined).unwrap_or(0.0) >= 1.0, "{cp}");
    assert_eq!(legs(&fleet, &envoy, way, "status"), 0.0, "no leg reached a wrong worker");
    assert_eq!(legs(&fleet, &envoy, way, "disaggregated"), 0.0);
}

#[test]
fn a_both_worker_prefills_for_a_busy_one_behind_sidecars() {
    both_workers_share_prefill(Way::Sidecar);
}

#[test]
fn a_both_worker_prefills_for_a_busy_one_through_the_filters_legs() {
    both_workers_share_prefill(Way::Filter);
}

/// `--disaggregate-prefill-on-both`: two `both` workers (each behind a
/// sidecar, or none with the filter's legs) and session affinity. A
/// document's first half lands on a worker A, prefilled there (both idle:
/// a leg would cost as much, so none). A then decodes two slow answers of
/// the same session. The whole document follows the session to A for
/// decoding, and its uncached half, which would stall those two decodes,
/// is prefilled on the idle worker B; A's engine receives the prompt's KV.
fn both_workers_share_prefill(way: Way) {
    let dir = scratch_dir(&format!("disaggregation-both-{way:?}")).unwrap();
    let mut fleet = Fleet::start_opts(
        &dir,
        2,
        "20",
        FleetOpts {
            roles: &["both", "both"],
            pd_sidecar: way == Way::Sidecar,
            serve_args: &[
                "--disaggregate-min-uncached-tokens",
                "64",
                "--disaggregate-prefill-on-both",
                "true",
                "--session-affinity",
                "true",
            ],
            ..Default::default()
        },
    );
    let envoy = gateway(&fleet, way);
    let headers = [("content-type", "application/json"), ("x-session-id", "agent-7")];
    let post = |body: &[u8]| http_request(envoy.listen, "POST", "/v1/chat/completions", &headers, body).unwrap();
    let doc = "Both workers prefill and decode; a busy one hands its prefill over. ".repeat(30);
    let half = &doc[..doc.len() / 2];

    let r = post(&chat(half, false));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let a = r.header("x-kvgate-worker").expect("worker").to_owned();
    assert_eq!(r.header("x-kvgate-prefill"), None, "both idle: prefilled where it is decoded");
    let (ia, ib) = if a == "w0" { (0, 1) } else { (1, 0) };
    fleet.wait_quiet();

    // Two slow answers on A (its engine 40 times slower), streaming while
    // the document comes.
    let r = http_request(fleet.engines[ia], "POST", "/kvgate/sim/slowdown?factor=40", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    let (listen, body) = (envoy.listen, |i: usize| {
        json!({"model": MODEL, "messages": [{"role": "user", "content": format!("{half} Answer {i} slowly.")}],
               "max_tokens": 120, "stream": true})
        .to_string()
        .into_bytes()
    });
    let busy: Vec<_> = (0..2)
        .map(|i| {
            let b = body(i);
            std::thread::spawn(move || http_request(listen, "POST", "/v1/chat/completions", &headers, &b).unwrap())
        })
        .collect();
    until(20, "two requests in flight on A", || fleet.worker(ia)["inflight"].as_u64() == Some(2));

    let r = post(&chat(&doc, true));
    let body_text = String::from_utf8_lossy(&r.body).into_owned();
    assert_eq!(r.status, 200, "{body_text}");
    assert!(body_text.contains("data: [DONE]"), "{body_text}");
    assert_eq!(r.header("x-kvgate-worker"), Some(a.as_str()), "decoded where the session is");
    assert_eq!(r.header("x-kvgate-prefill"), Some(fleet.http[ib].to_string().as_str()), "prefilled on B");
    let usage = stream_usage(&body_text);
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(prompt - 1), "{usage}");
    assert!(sim_cache(fleet.engines[ib])["cached_blocks"].as_u64().unwrap() >= prompt / BLOCK - 1);
    for t in busy {
        let r = t.join().unwrap();
        assert_eq!((r.status, r.header("x-kvgate-worker")), (200, Some(a.as_str())));
    }
    let cp = fleet.metrics();
    let n = |o: &str| prom(&cp, &format!(r#"kvgate_disaggregation_total{{model="{MODEL}",outcome="{o}"}}"#));
    assert_eq!(n("disaggregated"), Some(1.0), "{cp}");
    fleet.check();
}

/// `--disaggregate-overflow-to-prefill`: one prefill and one decode worker,
/// each running one request at a time. While the decode worker streams a
/// slow answer it is saturated, and the next request is served whole by
/// the prefill worker (no leg); once it is free again, requests go back to
/// it.
#[test]
fn a_saturated_decode_worker_overflows_whole_requests_to_the_prefill_worker() {
    let dir = scratch_dir("disaggregation-overflow").unwrap();
    let mut fleet = Fleet::start_opts(
        &dir,
        2,
        "20",
        FleetOpts {
            roles: &["prefill", "decode"],
            pd_sidecar: true,
            sim_args: &["--max-num-seqs", "1"],
            serve_args: &["--disaggregate-min-uncached-tokens", "64", "--disaggregate-overflow-to-prefill", "true"],
            ..Default::default()
        },
    );
    let envoy = gateway(&fleet, Way::Sidecar);
    let json_ct = [("content-type", "application/json")];
    let r = http_request(fleet.engines[1], "POST", "/kvgate/sim/slowdown?factor=40", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    let listen = envoy.listen;
    let slow = std::thread::spawn(move || {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Take your time."}],
                          "max_tokens": 120, "stream": true});
        http_request(listen, "POST", "/v1/chat/completions", &json_ct, body.to_string().as_bytes()).unwrap()
    });
    until(20, "the decode worker busy", || fleet.worker(1)["inflight"].as_u64() == Some(1));
    let r = http_request(envoy.listen, "POST", "/v1/chat/completions", &json_ct, &chat("A short question.", false))
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!((r.header("x-kvgate-worker"), r.header("x-kvgate-prefill")), (Some("w0"), None), "whole, on w0");
    let r = slow.join().unwrap();
    assert_eq!((r.status, r.header("x-kvgate-worker")), (200, Some("w1")));
    let cp = fleet.metrics();
    let overflow = format!(r#"kvgate_disaggregation_total{{model="{MODEL}",outcome="overflow"}}"#);
    assert_eq!(prom(&cp, &overflow), Some(1.0), "{cp}");
    fleet.wait_quiet();
    let r = http_request(envoy.listen, "POST", "/v1/chat/completions", &json_ct, &chat("Another one.", false)).unwrap();
    assert_eq!((r.status, r.header("x-kvgate-worker")), (200, Some("w1")), "the decode worker again");
    fleet.check();
}
