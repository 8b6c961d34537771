//! Data-parallel ranks end to end: two simulated servers with
//! `--data-parallel-size 2` (two engines behind each address, each with its
//! own cache, event socket and metrics series), a relay per server that
//! follows each rank as a worker (`w<i>/dp<r>`), NATS, the control plane
//! and real Envoy. A document cached by rank 1 of server 0 draws its
//! request to that rank: Envoy sends it to the server's address with
//! `x-data-parallel-rank: 1`, and the engine reports the document cached.
//! Without the rank header the server would balance it to its idle rank 0,
//! which holds nothing.

mod common;

use common::{BLOCK, Fleet, FleetOpts, MODEL, until};
use kvgate_testkit::{http_request, scratch_dir};
use serde_json::{Value, json};

fn chat(text: &str) -> Vec<u8> {
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}).to_string().into_bytes()
}

#[test]
fn a_request_reaches_the_data_parallel_rank_that_holds_its_prefix() {
    let dir = scratch_dir("data-parallel").unwrap();
    let mut fleet = Fleet::start_opts(&dir, 2, "20", FleetOpts { data_parallel_size: 2, ..Default::default() });
    let ids: Vec<String> = fleet.workers()[MODEL]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            assert_eq!(
                w["endpoint"],
                fleet.http[w["id"].as_str().unwrap()[1..2].parse::<usize>().unwrap()].to_string()
            );
            w["id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(ids, ["w0/dp0", "w0/dp1", "w1/dp0", "w1/dp1"]);
    let filter = json!({"control_plane": {"timeout_ms": 2000}, "debug_headers": true});
    let envoy = fleet.envoy(&filter);

    // Rank 1 of server 0 reads a document (sent there directly).
    let doc = chat(&"Data-parallel ranks each keep their own KV cache behind one address. ".repeat(30));
    let ranked = [("content-type", "application/json"), ("x-data-parallel-rank", "1")];
    let r = http_request(fleet.http[0], "POST", "/v1/chat/completions", &ranked, &doc).unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let prompt = serde_json::from_slice::<Value>(&r.body).unwrap()["usage"]["prompt_tokens"].as_u64().unwrap();
    let blocks_of = |id: &str| {
        fleet.workers()[MODEL].as_array().and_then(|a| a.iter().find(|w| w["id"] == id).cloned()).unwrap_or_default()
            ["device_blocks"]
            .as_u64()
            .unwrap_or(0)
    };
    until(20, "the document's blocks on w0/dp1 in the index", || blocks_of("w0/dp1") >= prompt / BLOCK);
    assert_eq!(blocks_of("w0/dp0"), 0, "rank 0 holds nothing");
    fleet.wait_quiet();

    // Through the gateway, with a rank of the client's own that kvgate
    // replaces: to rank 1 of server 0, where the engine has it cached.
    let spoofed = [("content-type", "application/json"), ("x-data-parallel-rank", "0")];
    let r = http_request(envoy.listen, "POST", "/v1/chat/completions", &spoofed, &doc).unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("x-kvgate-worker"), Some("w0/dp1"));
    assert_eq!(r.header("x-kvgate-endpoint"), Some(fleet.http[0].to_string().as_str()));
    assert_eq!(r.header("x-kvgate-reason"), Some("kv"));
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= (prompt / BLOCK - 1) * BLOCK, "rank 1 served it from its cache: {cached} of {prompt}");
    let sim: Value =
        serde_json::from_slice(&http_request(fleet.http[0], "GET", "/kvgate/sim/cache", &[], b"").unwrap().body)
            .unwrap();
    assert_eq!(sim["ranks"][0]["cached_blocks"], 0, "rank 0 of server 0 never saw the document: {sim}");

    // The relay exports each rank under its own worker label.
    let m = String::from_utf8(http_request(fleet.relay_metrics[0], "GET", "/metrics", &[], b"").unwrap().body).unwrap();
    assert!(m.contains(r#"kvgate_relay_mirror_blocks{worker="w0/dp1",model="#), "{m}");
    assert!(m.contains(r#"kvgate_relay_mirror_blocks{worker="w0/dp0",model="#), "{m}");
    assert_eq!(m.matches("# TYPE kvgate_relay_mirror_blocks gauge").count(), 1, "{m}");
    fleet.check();
}
