//! Criterion benches of the filter's per-request hot paths, natively (the
//! Wasm build runs the same code; `make bench-gateway` measures it inside
//! Envoy). Bodies: a chat request with an ~8K- and an ~100K-token system
//! prompt (~44 KB and ~550 KB of JSON) and a short question.
//!
//! * `extract`: UTF-8 check + JSON scan + field extraction;
//! * `encode_pick`: segment hashing + PickRequest encoding from the spans;
//! * `request_path`: the state machine from headers to the Pick call, with
//!   the mock host (includes copying the body out of the host);
//! * `prefill_legs`: the filter's own two legs of a disaggregated request
//!   (`disaggregation.legs: "filter"`), from the Pick answer naming a
//!   prefill worker to the decode leg's body in place: JSON parse, the
//!   prefill leg's body, the answer's `kv_transfer_params` into the decode
//!   leg's body (the round trip to the prefill worker is not in it);
//! * `usage_tail`: finding `usage` in a 16 KiB response tail.

use std::hint::black_box;
use std::rc::Rc;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvgate_filter_core::extract::{Api, extract};
use kvgate_filter_core::mock::MockHost;
use kvgate_filter_core::pick::{RequestMeta, chain_hashes, encode_pick};
use kvgate_filter_core::usage::find_usage;
use kvgate_filter_core::{Config, RequestFilter};
use kvgate_protocol::pb;
use prost::Message as _;

fn body(words: usize) -> Vec<u8> {
    const W: &[&str] = &["the", "kv", "cache", "router", "prefix", "token", "block", "worker", "latency", "envoy"];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut text = String::new();
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        text.push_str(W[(x % W.len() as u64) as usize]);
        text.push(if i % 17 == 16 { '\n' } else { ' ' });
    }
    serde_json::to_vec(&serde_json::json!({"model": "m", "max_tokens": 16, "messages": [
        {"role": "system", "content": text},
        {"role": "user", "content": "Which worker holds the prefix?"},
    ]}))
    .unwrap()
}

fn benches(c: &mut Criterion) {
    for (label, words) in [("8k", 6_500), ("100k", 80_000)] {
        let b = body(words);
        let mut g = c.benchmark_group(label);
        g.throughput(Throughput::Bytes(b.len() as u64));
        g.bench_function("extract", |bench| bench.iter(|| extract(black_box(&b), Api::Chat).unwrap().messages.len()));
        let e = extract(&b, Api::Chat).unwrap();
        let meta = RequestMeta { request_id: "0123456789abcdef", model: "m", body_bytes: 1, ..Default::default() };
        g.bench_function("encode_pick", |bench| {
            bench.iter(|| encode_pick(black_box(&e), Api::Chat, &meta, &chain_hashes(black_box(&e)), None).len())
        });
        let cfg = Rc::new(Config::parse(b"{}").unwrap());
        g.bench_function("request_path", |bench| {
            bench.iter(|| {
                let h = MockHost::post("/v1/chat/completions");
                h.set_body(&b);
                let mut f = RequestFilter::new(cfg.clone());
                f.on_request_headers(&h, false);
                f.on_request_body(&h, b.len(), true);
                f.pick_token()
            })
        });
        let legs = Rc::new(Config::parse(br#"{"disaggregation":{"legs":"filter"}}"#).unwrap());
        let answer = pb::PickResponse {
            endpoint: "10.0.0.1:8000".into(),
            worker_id: "w1".into(),
            prefill_endpoint: "10.0.0.9:8000".into(),
            ..Default::default()
        }
        .encode_to_vec();
        let prefilled = br#"{"id":"c","choices":[],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e","remote_block_ids":[1,2,3],"remote_host":"10.0.0.9","remote_port":5600}}"#;
        g.bench_function("prefill_legs", |bench| {
            bench.iter_batched(
                || {
                    let h = MockHost::post("/v1/chat/completions");
                    h.set_body(&b);
                    let mut f = RequestFilter::new(legs.clone());
                    f.on_request_headers(&h, false);
                    f.on_request_body(&h, b.len(), true);
                    let t = f.pick_token().unwrap();
                    (h, f, t)
                },
                |(h, mut f, t)| {
                    f.on_pick_response(&h, t, 0, Some(&answer));
                    let leg = f.prefill_token().unwrap();
                    f.on_prefill_response(&h, leg, 200, Some(prefilled));
                    (h, f)
                },
                BatchSize::LargeInput,
            )
        });
        g.finish();
    }
    let mut tail = Vec::new();
    while tail.len() < 16 << 10 {
        tail.extend_from_slice(b"data: {\"choices\":[{\"delta\":{\"content\":\"tok\"}}],\"usage\":null}\n\n");
    }
    tail.extend_from_slice(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":16,\"prompt_tokens_details\":{\"cached_tokens\":96}}}\n\ndata: [DONE]\n\n");
    c.bench_function("usage_tail_16k", |bench| bench.iter(|| find_usage(black_box(&tail))));
}

criterion_group!(filter, benches);
criterion_main!(filter);
