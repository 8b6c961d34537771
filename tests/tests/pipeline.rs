//! The control-plane pipeline with every part a real process: two simulated
//! vLLM workers (`kvgate sim`), a relay next to each (`kvgate relay`: ZMQ →
//! NATS), nats-server, and the control plane (`kvgate serve`). A
//! conversation served by one worker makes `Pick` choose that worker for
//! its next turn, and the worker's reported `cached_tokens` equal what the
//! control plane predicted.

use std::net::SocketAddr;

use kvgate_protocol::pb;
use kvgate_server::router_client::RouterClient;
use kvgate_testkit::http_request;
use serde_json::{Value, json};

mod common;

use common::{BLOCK, Fleet, MODEL, until};

fn chat(addr: SocketAddr, messages: &Value) -> Value {
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 20}).to_string();
    let r =
        http_request(addr, "POST", "/v1/chat/completions", &[("content-type", "application/json")], body.as_bytes())
            .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    serde_json::from_slice(&r.body).unwrap()
}

fn pick_request(id: &str, messages: &Value) -> pb::PickRequest {
    kvgate_server::chat_pick_request(MODEL, id, messages.as_array().unwrap(), Some(20))
}

#[test]
fn sim_relay_nats_and_control_plane_agree_on_the_cache() {
    agree_on_the_cache("pipeline", &[]);
}

/// The same with the index in two shards: the ingest thread applies the
/// KV batches it takes together, shard by shard on two threads.
#[test]
fn the_same_with_the_index_in_two_shards() {
    agree_on_the_cache("pipeline-shards", &["--index-shards", "2"]);
}

fn agree_on_the_cache(name: &str, serve_args: &[&str]) {
    let dir = kvgate_testkit::scratch_dir(name).unwrap();
    let mut fleet = Fleet::start_full(&dir, 2, "20", None, serve_args);
    let (http, grpc) = (fleet.http.clone(), fleet.grpc);
    // A conversation served by w1.
    let mut messages = json!([
        {"role": "system", "content": "You are a network engineer. ".repeat(60)},
        {"role": "user", "content": "How does Envoy pick an upstream host?"},
    ]);
    let first = chat(http[1], &messages);
    let prompt1 = first["usage"]["prompt_tokens"].as_u64().unwrap();
    until(20, "w1's blocks in the index", || fleet.blocks(1) >= prompt1 / BLOCK);
    assert_eq!(fleet.blocks(0), 0);
    fleet.wait_quiet();

    // The next turn: Pick chooses w1 and predicts its cache exactly.
    let reply = first["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    messages.as_array_mut().unwrap().push(json!({"role": "assistant", "content": reply}));
    messages.as_array_mut().unwrap().push(json!({"role": "user", "content": "And with override_host?"}));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let picked = rt.block_on(async {
        let mut c = RouterClient::connect(format!("http://{grpc}")).await.unwrap();
        c.pick(pick_request("turn-2", &messages)).await.unwrap().into_inner()
    });
    assert_eq!(picked.worker_id, "w1", "{picked:?}");
    assert_eq!(picked.endpoint, http[1].to_string());
    assert_eq!(picked.reason, pb::PickReason::Kv as i32);
    assert!(u64::from(picked.matched_blocks) >= prompt1 / BLOCK - 1, "{picked:?} after a {prompt1}-token prompt");
    let second = chat(http[1], &messages);
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert_eq!(cached, u64::from(picked.matched_blocks) * BLOCK, "prediction = engine's cached tokens");
    fleet.check();
}
