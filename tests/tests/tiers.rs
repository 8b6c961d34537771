//! KV tiers end to end: simulated workers that offload evicted blocks to
//! host memory and publish them as vLLM's CPU offloading connector does
//! (medium `CPU`), relays, NATS, the control plane and real Envoy. A
//! document evicted from a worker's device cache into its host memory
//! still draws its next request to that worker (reason `kv`), where the
//! engine loads it back instead of recomputing it.

mod common;

use common::{BLOCK, Fleet, FleetOpts, MODEL, prom, until};
use kvgate_testkit::{http_request, scratch_dir};
use serde_json::{Value, json};

fn chat(text: &str) -> Vec<u8> {
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}).to_string().into_bytes()
}

#[test]
fn a_prefix_offloaded_to_host_memory_still_draws_its_requests() {
    let dir = scratch_dir("tiers").unwrap();
    // 96 device blocks (1,536 tokens) and 1,024 host blocks per worker.
    let sim_args = ["--num-blocks", "96", "--host-blocks", "1024"];
    let mut fleet = Fleet::start_opts(&dir, 2, "20", FleetOpts { sim_args: &sim_args, ..Default::default() });
    let filter = json!({"control_plane": {"timeout_ms": 2000}, "debug_headers": true});
    let envoy = fleet.envoy(&filter);
    let json_ct = [("content-type", "application/json")];
    let post = |body: &[u8]| {
        let r = http_request(envoy.listen, "POST", "/v1/chat/completions", &json_ct, body).unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        (r, v)
    };
    let doc = chat(&"Offloading keeps the KV cache of evicted blocks in host memory. ".repeat(30));
    let (r, v) = post(&doc);
    let worker = r.header("x-kvgate-worker").unwrap().to_owned();
    let w: usize = worker[1..].parse().unwrap();
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    fleet.wait_quiet();
    until(20, "the document's blocks in the index", || fleet.blocks(w) >= prompt / BLOCK);

    // Other prompts sent straight to that worker fill its device cache three
    // times over: every block of the document goes to host memory.
    for i in 0..8 {
        let other = chat(&format!("Unrelated request number {i} about the weather in spring. ").repeat(40));
        let r = http_request(fleet.http[w], "POST", "/v1/chat/completions", &json_ct, &other).unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    fleet.wait_quiet();
    until(20, "host blocks in the index", || {
        fleet.worker(w)["host_blocks"].as_u64().unwrap_or(0) >= prompt / BLOCK - 1
    });
    let series = format!("kvgate_index_blocks{{model=\"{MODEL}\",tier=\"host\"}}");
    assert!(prom(&fleet.metrics(), &series).unwrap_or(0.0) > 0.0);

    // The document again: to the worker holding it in host memory, because
    // of that (reason kv), and the engine reports it cached (loaded back).
    let (r, v) = post(&doc);
    assert_eq!(r.header("x-kvgate-worker"), Some(worker.as_str()));
    assert_eq!(r.header("x-kvgate-reason"), Some("kv"));
    let device = r.header("x-kvgate-blocks").and_then(|b| b.split('/').next()?.parse::<u64>().ok());
    assert_eq!(device, Some(0), "nothing of it left on the device: the host tier decided");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= (prompt / BLOCK - 1) * BLOCK, "cached {cached} of {prompt}");
    fleet.check();
}
