//! Overload protection end to end, through real Envoy: one simulated worker
//! whose batch holds one request (`--max-num-seqs 1`), its relay, NATS and
//! the control plane with `--overload true`. While a long request runs, a
//! second one is held in the control plane instead of queueing in the
//! engine, and answered 429 with `Retry-After` when its wait runs out; once
//! the slot is free, requests go through again.

mod common;

use std::time::Duration;

use common::{Fleet, FleetOpts, MODEL, prom, until};
use kvgate_testkit::{http_request, scratch_dir};
use serde_json::json;

fn chat(text: &str, max_tokens: u32) -> Vec<u8> {
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
        .to_string()
        .into_bytes()
}

#[test]
fn a_saturated_fleet_answers_429_with_retry_after_instead_of_queueing_in_the_engine() {
    let dir = scratch_dir("overload").unwrap();
    let opts = FleetOpts {
        sim_args: &["--max-num-seqs", "1"],
        serve_args: &["--overload", "true", "--overload-max-wait-ms", "1500"],
        ..Default::default()
    };
    // Real time: the long request decodes for several seconds.
    let mut fleet = Fleet::start_opts(&dir, 1, "1", opts);
    let filter = json!({"control_plane": {"timeout_ms": 5000}, "debug_headers": true});
    let envoy = fleet.envoy(&filter);
    let listen = envoy.listen;
    let headers = [("content-type", "application/json"), ("x-tenant-id", "team-a")];

    // A long request takes the only slot (400 tokens, ~5 s at real speed).
    let long = std::thread::spawn(move || {
        http_request(listen, "POST", "/v1/chat/completions", &headers, &chat("Tell a long story.", 400)).unwrap()
    });
    until(10, "the long request running", || fleet.worker(0)["running"] == 1);
    let r = http_request(listen, "POST", "/v1/chat/completions", &headers, &chat("Quick question?", 4)).unwrap();
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("retry-after"), Some("2"), "1,500 ms rounded up to seconds");
    assert!(String::from_utf8_lossy(&r.body).contains("rate_limit_error"));
    assert_eq!(envoy.stat("wasmcustom.kvgate.overloaded").unwrap(), 1);
    let m = fleet.metrics();
    assert_eq!(prom(&m, &format!("kvgate_admission_total{{model=\"{MODEL}\",outcome=\"expired\"}}")), Some(1.0), "{m}");
    // The engine never saw it: nothing waited there.
    assert_eq!(fleet.worker(0)["waiting"], 0);

    let done = long.join().unwrap();
    assert_eq!(done.status, 200);
    fleet.wait_quiet();
    std::thread::sleep(Duration::from_millis(200));
    let r = http_request(listen, "POST", "/v1/chat/completions", &headers, &chat("Quick question?", 4)).unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    fleet.check();
}
