//! The simulated worker at its interfaces: the real `openai` Python SDK
//! against its HTTP API (streaming and not), its `/metrics` against the
//! usage it reported, and its ZMQ KV events through the real relay core
//! against its block pool.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvgate_sim::engine::EngineConfig;
use kvgate_sim::server::{Bound, EventSockets, WorkerOptions, run_worker};
use kvgate_sim::timing::Timing;
use kvgate_tokenize::prompt::{PromptTokenizer, TokenCacheConfig};
use kvgate_vllm_wire::encode::Encoding;
use serde_json::Value;

fn tokenizer() -> Arc<PromptTokenizer> {
    let dir = std::env::var_os("KVGATE_TOKENIZER_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| kvgate_testkit::repo_root().join(".tools/models/deepseek-v3"));
    Arc::new(PromptTokenizer::from_dir(&dir, TokenCacheConfig::default()).unwrap())
}

struct Worker {
    http: SocketAddr,
    zmq: String,
    replay: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    _thread: std::thread::JoinHandle<()>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

fn start(speedup: f64, num_blocks: usize) -> Worker {
    start_with(speedup, num_blocks, 1)
}

fn start_with(speedup: f64, num_blocks: usize, stream_interval: usize) -> Worker {
    start_ranks(speedup, num_blocks, stream_interval, 1)
}

/// A worker of `ranks` data-parallel ranks on ports it picks itself: rank
/// r publishes on `zmq`'s port + r and replays on `replay`'s port + r.
fn start_ranks(speedup: f64, num_blocks: usize, stream_interval: usize, ranks: u16) -> Worker {
    let opts = WorkerOptions {
        id: "w0".into(),
        model: "deepseek-v3".into(),
        http: "127.0.0.1:0".parse().unwrap(),
        events: EventSockets::Any([127, 0, 0, 1].into()),
        topic: "kv-events".into(),
        encoding: Encoding::Map,
        engine: EngineConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 2048,
            num_blocks,
            block_size: 16,
            timing: Timing::H200_LLAMA70B_FP8,
            host: Default::default(),
            kv_transfer_ms_per_token: 0.0,
        },
        speedup,
        stream_interval,
        tokenizer: tokenizer(),
        default_max_tokens: 16,
        max_model_len: 32_768,
        replay_buffer: 1000,
        data_parallel_size: usize::from(ranks),
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (btx, brx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async move {
            run_worker(
                opts,
                async move {
                    let _ = rx.await;
                },
                move |b: &Bound| {
                    let _ = btx.send(b.clone());
                },
            )
            .await
            .unwrap();
        });
    });
    let b = brx.recv_timeout(Duration::from_secs(10)).unwrap();
    let (zmq, replay) = (b.publish.unwrap(), b.replay.unwrap());
    Worker { http: b.http, zmq, replay, stop: Some(tx), _thread: thread }
}

fn python() -> std::path::PathBuf {
    std::env::var("KVGATE_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| kvgate_testkit::repo_root().join(".tools/venv/bin/python"))
}

fn get(addr: SocketAddr, path: &str) -> kvgate_testkit::HttpResponse {
    kvgate_testkit::http_request(addr, "GET", path, &[], b"").unwrap()
}

/// [`get`] from inside an async context (the blocking client must not run
/// on a runtime's thread).
fn get_from_async(addr: SocketAddr, path: &'static str) -> kvgate_testkit::HttpResponse {
    std::thread::scope(|s| s.spawn(|| get(addr, path)).join().unwrap())
}

fn metric(text: &str, name: &str) -> f64 {
    kvgate_testkit::prom::samples(text)
        .find(|s| s.name == name)
        .map(|s| s.value)
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

const SDK_SCRIPT: &str = r#"
import json, sys
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=30)
out = {}
out["models"] = [m.id for m in c.models.list().data]
system = "You are a careful assistant who answers briefly. " * 30
msgs = [{"role": "system", "content": system}, {"role": "user", "content": "What is a KV cache?"}]
r1 = c.chat.completions.create(model="deepseek-v3", messages=msgs, max_tokens=12)
r2 = c.chat.completions.create(model="deepseek-v3", messages=msgs, max_tokens=12)
out["chat"] = [
    {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
     "prompt": r.usage.prompt_tokens, "completion": r.usage.completion_tokens,
     "cached": r.usage.prompt_tokens_details.cached_tokens, "object": r.object}
    for r in (r1, r2)]
chunks = list(c.chat.completions.create(model="deepseek-v3", messages=msgs, max_tokens=9, stream=True,
                                        stream_options={"include_usage": True}))
out["stream"] = {
    "n": len(chunks),
    "role": chunks[0].choices[0].delta.role,
    "text": "".join((ch.choices[0].delta.content or "") for ch in chunks if ch.choices),
    "finish": [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1],
    "usage": chunks[-1].usage.model_dump() if chunks[-1].usage else None,
    "last_choices": len(chunks[-1].choices),
}
cp = c.completions.create(model="deepseek-v3", prompt="Once upon a time", max_tokens=5)
out["completion"] = {"text": cp.choices[0].text, "completion": cp.usage.completion_tokens, "object": cp.object}
cs = list(c.completions.create(model="deepseek-v3", prompt=[1, 2, 3, 4, 5], max_tokens=4, stream=True))
out["completion_stream"] = {"text": "".join(ch.choices[0].text for ch in cs if ch.choices), "n": len(cs)}
try:
    c.chat.completions.create(model="nope", messages=msgs, max_tokens=2)
    out["unknown_model"] = None
except Exception as e:
    out["unknown_model"] = getattr(e, "status_code", None)
try:
    c.chat.completions.create(model="deepseek-v3", messages=[], max_tokens=2)
    out["empty"] = None
except Exception as e:
    out["empty"] = getattr(e, "status_code", None)
print(json.dumps(out))
"#;

#[test]
fn the_openai_sdk_streams_and_non_streams_against_it() {
    let w = start(50.0, 4096);
    let out = std::process::Command::new(python())
        .arg("-c")
        .arg(SDK_SCRIPT)
        .arg(format!("http://{}/v1", w.http))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["models"], serde_json::json!(["deepseek-v3"]));
    let (a, b) = (&v["chat"][0], &v["chat"][1]);
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["completion"], 12);
    assert_eq!(a["finish"], "length");
    assert_eq!(a["text"], b["text"].as_str().map(|_| a["text"].clone()).unwrap(), "deterministic text");
    assert_eq!(a["cached"], 0, "first request: nothing cached");
    let prompt = b["prompt"].as_u64().unwrap();
    // Every full block of the repeated prompt is a hit (vLLM recomputes the
    // last block when the prompt is block-aligned).
    let want = if prompt % 16 == 0 { prompt - 16 } else { prompt / 16 * 16 };
    assert_eq!(b["cached"].as_u64().unwrap(), want, "{v}");
    let s = &v["stream"];
    assert_eq!(s["role"], "assistant");
    assert_eq!(s["finish"], "length");
    assert_eq!(s["last_choices"], 0, "usage arrives in a final chunk without choices");
    assert_eq!(s["usage"]["completion_tokens"], 9);
    assert_eq!(s["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(), want);
    assert!(!s["text"].as_str().unwrap().is_empty());
    assert_eq!(v["completion"]["object"], "text_completion");
    assert_eq!(v["completion"]["completion"], 5);
    assert_eq!(v["completion_stream"]["n"].as_u64().unwrap(), 5);
    assert_eq!(v["unknown_model"], 404);
    assert_eq!(v["empty"], 400);

    // /metrics agrees with the usage the API reported.
    let m = String::from_utf8(get(w.http, "/metrics").body).unwrap();
    let hits = metric(&m, "vllm:prefix_cache_hits_total");
    assert_eq!(hits as u64, 2 * want, "two cached requests of `want` tokens each\n{m}");
    assert_eq!(metric(&m, "vllm:num_requests_running"), 0.0);
    assert_eq!(metric(&m, "vllm:num_requests_waiting"), 0.0);
    assert!(m.contains("vllm:cache_config_info{block_size=\"16\""), "{m}");
    assert!(m.contains("num_gpu_blocks=\"4096\""), "{m}");
    // Five generations: two chats, one chat stream, two completions.
    assert_eq!(metric(&m, "vllm:time_to_first_token_seconds_count"), 5.0);
    // Each finished request's prefill, as vLLM observes it at the end: its
    // time from scheduling to first token, and the prompt tokens it
    // computed (every prompt token but the cache hits).
    assert_eq!(metric(&m, "vllm:request_prefill_time_seconds_count"), 5.0);
    assert!(metric(&m, "vllm:request_prefill_time_seconds_sum") > 0.0, "{m}");
    let computed = metric(&m, "vllm:request_prefill_kv_computed_tokens_sum");
    assert_eq!(computed, metric(&m, "vllm:prompt_tokens_total") - hits, "{m}");
    assert_eq!(get(w.http, "/health").status, 200);
}

#[test]
fn kv_events_through_the_relay_core_mirror_the_engine_cache() {
    let w = start(200.0, 256);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        use zeromq::{Socket as _, SocketRecv as _};
        let mut sub = zeromq::SubSocket::new();
        sub.connect(&w.zmq).await.unwrap();
        sub.subscribe("").await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut core = kvgate_relay::core::RelayCore::new(kvgate_relay::core::RelayConfig {
            worker_id: "w0".into(),
            model: "deepseek-v3".into(),
            replay: false,
            relay_epoch: 1,
        });
        // Enough distinct prompts to overflow 256 blocks: stores and evictions.
        let http = w.http;
        let load = tokio::task::spawn_blocking(move || {
            for i in 0..40 {
                let body = format!(
                    r#"{{"model":"deepseek-v3","prompt":"request number {i}: {}","max_tokens":8}}"#,
                    "lorem ipsum dolor sit amet ".repeat(30)
                );
                let r = kvgate_testkit::http_request(
                    http,
                    "POST",
                    "/v1/completions",
                    &[("content-type", "application/json")],
                    body.as_bytes(),
                )
                .unwrap();
                assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            }
        });
        // Received until every batch the worker published is in: the load
        // is over and the count equals the worker's own (not "quiet for a
        // while", which a loaded machine breaks).
        let published = || {
            let sim: Value = serde_json::from_slice(&get_from_async(http, "/kvgate/sim/cache").body).unwrap();
            sim["event_batches"].as_u64().unwrap()
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        let mut batches = 0u64;
        loop {
            tokio::select! {
                m = sub.recv() => {
                    let m = m.unwrap();
                    let frames: Vec<&[u8]> = m.iter().map(|f| f.as_ref()).collect();
                    let _ = core.on_live(&frames);
                    batches += 1;
                }
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    if load.is_finished() && batches == published() { break; }
                    assert!(std::time::Instant::now() < deadline, "{batches} of {} batches", published());
                }
            }
        }
        load.await.unwrap();
        let c = core.counters();
        assert!(batches > 10, "{batches} batches");
        assert_eq!(c.decode_errors_msgpack + c.decode_errors_shape + c.decode_errors_frames, 0, "{c:?}");
        assert_eq!(c.gaps, 0, "{c:?}");
        assert!(c.blocks_removed > 0, "the cache overflowed, so blocks were evicted: {c:?}");
        assert_eq!(c.orphan_stores + c.unknown_removals, 0, "every event continues the stream: {c:?}");
        // The relay's mirror holds exactly the blocks the engine caches.
        let sim: Value = serde_json::from_slice(&get_from_async(w.http, "/kvgate/sim/cache").body).unwrap();
        assert_eq!(core.mirror().len() as u64, sim["cached_blocks"].as_u64().unwrap(), "{sim}");

        // Replay from the start over the ROUTER socket (a DEALER client, as
        // the relay uses): the same batches, ending with the end marker, and
        // a relay core fed only the replay reaches the same mirror.
        use zeromq::SocketSend as _;
        let mut dealer = zeromq::DealerSocket::new();
        dealer.connect(&w.replay).await.unwrap();
        let [empty, start] = kvgate_vllm_wire::replay_request(0);
        let mut req = zeromq::ZmqMessage::from(empty);
        req.push_back(start.into());
        dealer.send(req).await.unwrap();
        let mut replayed = kvgate_relay::core::RelayCore::new(kvgate_relay::core::RelayConfig {
            worker_id: "w0".into(),
            model: "deepseek-v3".into(),
            replay: false,
            relay_epoch: 2,
        });
        let mut n = 0;
        loop {
            let m = tokio::time::timeout(Duration::from_secs(5), dealer.recv()).await.unwrap().unwrap();
            let frames: Vec<&[u8]> = m.iter().map(|f| f.as_ref()).collect();
            match kvgate_vllm_wire::decode_replay_reply(&frames).unwrap() {
                kvgate_vllm_wire::ReplayReply::Batch { seq, payload, .. } => {
                    let seq = seq.to_be_bytes();
                    let _ = replayed.on_live(&[b"kv-events", &seq, payload]);
                    n += 1;
                }
                kvgate_vllm_wire::ReplayReply::End => break,
            }
        }
        assert_eq!(n, batches, "every published batch is replayed");
        assert_eq!(replayed.mirror().len(), core.mirror().len());
    });
}

#[test]
fn stream_interval_sends_the_first_token_alone_then_chunks() {
    let w = start_with(50.0, 1024, 4);
    let body = br#"{"model":"deepseek-v3","messages":[{"role":"user","content":"count"}],"max_tokens":10,"stream":true,"stream_options":{"include_usage":true}}"#;
    let r = kvgate_testkit::http_request(
        w.http,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        body,
    )
    .unwrap();
    assert_eq!(r.status, 200);
    let text = String::from_utf8(r.body).unwrap();
    let chunks: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    // Content chunks: 1 token at once, then 4, 4 and the last 1.
    let words: Vec<usize> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .filter(|t| !t.is_empty())
        .map(|t| t.split_whitespace().count())
        .collect();
    assert_eq!(words, [1, 4, 4, 1], "{text}");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 10);
}

#[test]
fn a_next_turn_that_sends_the_reply_back_hits_the_blocks_decoded() {
    // As with a real model: the reply re-tokenizes to the ids the engine
    // generated, so the whole previous turn (prompt and output) is cached.
    let w = start(50.0, 1024);
    let post = |body: Value| {
        let r = kvgate_testkit::http_request(
            w.http,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            body.to_string().as_bytes(),
        )
        .unwrap();
        assert_eq!(r.status, 200);
        serde_json::from_slice::<Value>(&r.body).unwrap()
    };
    let first = serde_json::json!({"role": "user", "content": kvgate_bench_support::words(3, 300)});
    let a = post(serde_json::json!({"model": "deepseek-v3", "messages": [first], "max_tokens": 100}));
    let reply = a["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    let (p1, c1) = (a["usage"]["prompt_tokens"].as_u64().unwrap(), a["usage"]["completion_tokens"].as_u64().unwrap());
    let b = post(serde_json::json!({"model": "deepseek-v3", "max_tokens": 4, "messages": [
        first, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]}));
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    // Everything but the last, partial block of prompt + output (16 tokens a block).
    assert!(cached >= (p1 + c1 - 1) / 16 * 16 - 16, "cached {cached} of a first turn of {p1} + {c1}");
    assert!(cached > p1 + 64, "cached {cached}: the reply's blocks hit");
}

/// Two data-parallel ranks behind one address, as vLLM's
/// `--data-parallel-size 2`: `x-data-parallel-rank` picks the rank (its own
/// cache: the repeat hits there only), an unnamed request goes to the idle
/// rank 0, a rank beyond the server's is a 400, each rank publishes its
/// events (with its rank) on its own socket and has its own metrics series.
#[test]
fn data_parallel_ranks_have_their_own_cache_events_and_metrics() {
    let w = start_ranks(200.0, 1024, 1, 2);
    let rank1 = kvgate_vllm_wire::dp::rank_endpoint(&w.zmq, 1).unwrap();
    let body = format!(r#"{{"model":"deepseek-v3","prompt":"{}","max_tokens":2}}"#, "ranked words ".repeat(40));
    let post = |rank: Option<&str>| {
        let mut h = vec![("content-type", "application/json")];
        if let Some(r) = rank {
            h.push(("x-data-parallel-rank", r));
        }
        let r = kvgate_testkit::http_request(w.http, "POST", "/v1/completions", &h, body.as_bytes()).unwrap();
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        (r.status, v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0), v)
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let batch_rank = rt.block_on(async {
        use zeromq::{Socket as _, SocketRecv as _};
        let mut sub = zeromq::SubSocket::new();
        sub.connect(&rank1).await.unwrap();
        sub.subscribe("").await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let first = std::thread::scope(|s| s.spawn(|| post(Some("1"))).join().unwrap());
        assert_eq!((first.0, first.1), (200, 0), "{}", first.2);
        let m = tokio::time::timeout(Duration::from_secs(30), sub.recv()).await.unwrap().unwrap();
        let frames: Vec<&[u8]> = m.iter().map(|f| f.as_ref()).collect();
        let f = kvgate_vllm_wire::decode_frames(&frames).unwrap();
        kvgate_vllm_wire::decode_batch(f.payload).unwrap().dp_rank
    });
    assert_eq!(batch_rank, Some(1), "rank 1's events name rank 1");
    let (status, cached, _) = post(Some("1"));
    assert!(status == 200 && cached > 0, "the repeat on rank 1 hits its cache: {cached}");
    let (status, cached, _) = post(None);
    assert_eq!((status, cached), (200, 0), "unnamed: the idle rank 0, whose cache is empty");
    let (status, _, err) = post(Some("2"));
    assert_eq!(status, 400, "{err}");
    assert!(err["message"].as_str().unwrap().contains("out of range"), "{err}");
    let sim: Value = serde_json::from_slice(&get(w.http, "/kvgate/sim/cache").body).unwrap();
    let per_rank: Vec<u64> = (0..2).map(|r| sim["ranks"][r]["cached_blocks"].as_u64().unwrap()).collect();
    assert!(per_rank.iter().all(|b| *b > 0), "{sim}");
    assert_eq!(sim["cached_blocks"].as_u64().unwrap(), per_rank.iter().sum::<u64>());
    // Each rank's series under its engine label; the relay reads one rank.
    let m = String::from_utf8(get(w.http, "/metrics").body).unwrap();
    assert_eq!(m.matches("# TYPE vllm:prefix_cache_hits_total counter").count(), 1, "one family\n{m}");
    assert!(m.contains("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"deepseek-v3\"} 0.0"), "{m}");
    assert!(!m.contains("vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"deepseek-v3\"} 0.0"), "{m}");
    let load = kvgate_relay::metrics::parse_vllm_metrics(&m, Some(1));
    assert_eq!((load.capacity_blocks, load.running), (Some(1024), Some(0)));
}

/// vLLM's KV-connector protocol on both sides: a prefill leg answers the
/// parameters the decode side needs (at the address bound, even from port
/// 0); a decode leg with them receives all but the last prompt token; one
/// that names too few remote blocks is refused.
#[test]
fn prefill_and_decode_legs_speak_kv_transfer_params() {
    let (p, d) = (start(50.0, 2048), start(50.0, 2048));
    let prompt: Vec<u32> = (1000..1400).collect();
    // POSTs the prompt with `extra` fields to `addr`: (status, JSON body).
    let post = |addr: SocketAddr, extra: serde_json::Value| {
        let mut b = serde_json::json!({"model": "deepseek-v3", "prompt": prompt, "max_tokens": 4});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let ct = [("content-type", "application/json")];
        let r = kvgate_testkit::http_request(addr, "POST", "/v1/completions", &ct, b.to_string().as_bytes()).unwrap();
        (r.status, serde_json::from_slice::<serde_json::Value>(&r.body).unwrap_or_default())
    };
    let leg = serde_json::json!({"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}});
    let (status, v) = post(p.http, leg);
    assert_eq!(status, 200, "{v}");
    let params = v["kv_transfer_params"].clone();
    assert_eq!(params["remote_port"].as_u64(), Some(u64::from(p.http.port())), "{params}");
    assert_eq!(params["remote_block_ids"].as_array().map(Vec::len), Some(400usize.div_ceil(16)));
    // The decode leg, with the prefill side's parameters.
    let (status, v) = post(d.http, serde_json::json!({"kv_transfer_params": params}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(399), "{v}");
    assert!(v["kv_transfer_params"].is_null());
    // Too few remote blocks for this prompt.
    let mut short = params;
    short["remote_block_ids"] = serde_json::json!([0, 1]);
    let (status, v) = post(d.http, serde_json::json!({"kv_transfer_params": short}));
    assert_eq!(status, 400, "{v}");
}
