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
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvgate_e2e::{Envoy, NatsServer, Proc, envoy_validate, free_port, http_request, render_kvgate_envoy, repo_root};
use serde_json::{Value, json};

mod common;

use common::{prom, until};

const MODEL: &str = "deepseek-v3";

fn tools() -> PathBuf {
    repo_root().join(".tools")
}

/// The engine's Python, or the reason it is missing.
fn vllm_python() -> PathBuf {
    let py = tools().join("vllm/bin/python");
    if !py.exists() {
        let why = std::fs::read_to_string(tools().join("vllm.failed")).unwrap_or_else(|_| "not installed".into());
        panic!(
            "real vLLM is not installed ({}): run `make setup` (scripts/setup-vllm.sh); reason: {why}",
            py.display()
        );
    }
    py
}

struct Engine {
    proc: Proc,
    http: SocketAddr,
    args: Vec<String>,
    core: usize,
}

fn engine_args(http: u16, zmq: u16) -> Vec<String> {
    let events = json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        // A concrete tcp address: vLLM connects, the relay binds.
        "endpoint": format!("tcp://127.0.0.1:{zmq}"),
        "replay_endpoint": format!("tcp://127.0.0.1:{}", zmq + 1),
        "topic": "kv",
    });
    [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        tools().join("models/tiny-llama").to_str().unwrap(),
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        &http.to_string(),
        "--block-size",
        "32",
        "--enable-prefix-caching",
        "--kv-events-config",
        &events.to_string(),
        "--enable-prompt-tokens-details",
        // 8,192 tokens (256 blocks) of KV: conversations evict each other.
        "--kv-cache-memory-bytes",
        "4194304",
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "16",
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .collect()
}

fn spawn_engine(dir: &Path, name: &str, args: &[String], core: usize) -> Proc {
    let mut cmd = Command::new("taskset");
    cmd.arg("-c").arg(core.to_string()).arg(vllm_python()).args(args);
    cmd.env("HF_HUB_OFFLINE", "1").env("VLLM_CPU_OMP_THREADS_BIND", core.to_string()).env("VLLM_NO_USAGE_STATS", "1");
    Proc::spawn(name, cmd, dir).unwrap()
}

fn wait_healthy(e: &mut Engine) {
    let t = Instant::now();
    loop {
        if http_request(e.http, "GET", "/health", &[], b"").is_ok_and(|r| r.status == 200) {
            return;
        }
        e.proc.ensure_running().unwrap();
        assert!(t.elapsed() < Duration::from_secs(400), "vLLM not healthy after 400 s:\n{}", e.proc.log());
        std::thread::sleep(Duration::from_millis(500));
    }
}

struct Stack {
    dir: PathBuf,
    _nats: NatsServer,
    engines: Vec<Engine>,
    relays: Vec<(Proc, SocketAddr)>,
    serve: Proc,
    admin: SocketAddr,
    envoy: Envoy,
}

impl Stack {
    fn workers(&self) -> Value {
        http_request(self.admin, "GET", "/admin/workers", &[], b"")
            .ok()
            .and_then(|r| serde_json::from_slice(&r.body).ok())
            .unwrap_or_default()
    }

    fn worker(&self, id: &str) -> Value {
        self.workers()[MODEL].as_array().and_then(|a| a.iter().find(|w| w["id"] == id).cloned()).unwrap_or_default()
    }

    fn metrics(&self) -> String {
        String::from_utf8(http_request(self.admin, "GET", "/metrics", &[], b"").unwrap().body).unwrap()
    }

    fn relay_metric(&self, i: usize, name: &str) -> f64 {
        let body = http_request(self.relays[i].1, "GET", "/metrics", &[], b"").unwrap().body;
        prom(&String::from_utf8(body).unwrap(), &format!("kvgate_relay_{name}{{worker=\"v{i}\",model=\"{MODEL}\"}}"))
            .unwrap_or(-1.0)
    }

    fn set_mode(&self, mode: &str) {
        let r = http_request(self.admin, "POST", &format!("/admin/mode?model={MODEL}&mode={mode}"), &[], b"").unwrap();
        assert_eq!(r.status, 200);
    }

    /// Runs the OpenAI-SDK client through Envoy; one record per request.
    fn client(&self, extra: &[&str]) -> Vec<Value> {
        let out = Command::new(tools().join("venv/bin/python"))
            .arg(repo_root().join("tests/tools/openai_conversations.py"))
            .arg(format!("http://{}/v1", self.envoy.listen))
            .arg(MODEL)
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "client failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    }
}

fn start(name: &str) -> Stack {
    let dir = kvgate_e2e::scratch_dir(name).unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let nats_url = format!("nats://127.0.0.1:{}", nats.port);
    let mut engines = Vec::new();
    let mut relays = Vec::new();
    for i in 0..2 {
        let hp = free_port().unwrap();
        let zp = kvgate_e2e::port_pair().unwrap();
        let http: SocketAddr = ([127, 0, 0, 1], hp).into();
        let rm: SocketAddr = ([127, 0, 0, 1], free_port().unwrap()).into();
        let relay = common::kvgate_args(
            &[
                "relay",
                "--zmq-endpoint",
                &format!("tcp://127.0.0.1:{zp}"),
                "--replay-endpoint",
                &format!("tcp://127.0.0.1:{}", zp + 1),
                "--nats-url",
                &nats_url,
                "--model",
                MODEL,
                "--endpoint",
                &http.to_string(),
                "--worker-id",
                &format!("v{i}"),
                "--metrics-url",
                &format!("http://{http}/metrics"),
                "--block-size",
                "32",
                "--max-num-seqs",
                "16",
                "--heartbeat-ms",
                "200",
                "--health-ms",
                "100",
                "--down-after-ms",
                "2000",
                "--listen-metrics",
                &rm.to_string(),
            ]
            .map(str::to_owned),
        );
        relays.push((Proc::spawn(&format!("relay-{i}"), relay, &dir).unwrap(), rm));
        let args = engine_args(hp, zp);
        let proc = spawn_engine(&dir, &format!("vllm-{i}"), &args, i);
        engines.push(Engine { proc, http, args, core: i });
    }
    for e in &mut engines {
        wait_healthy(e);
    }
    let (gp, ap) = (free_port().unwrap(), free_port().unwrap());
    let tk = tools().join("models/deepseek-v3");
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
            &nats_url,
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
    kvgate_e2e::wait_for_tcp(admin, Duration::from_secs(60)).unwrap();
    let filter = json!({"control_plane": {"timeout_ms": 1000}, "debug_headers": true, "reports": {"interval_ms": 100}});
    let config = dir.join("envoy.yaml");
    let workers: Vec<SocketAddr> = engines.iter().map(|e| e.http).collect();
    std::fs::write(&config, render_kvgate_envoy(0, 0, &workers, &[grpc], &filter.to_string()).unwrap()).unwrap();
    envoy_validate(&config).unwrap();
    let envoy = Envoy::start(&config, &dir).unwrap();
    let s = Stack { dir, _nats: nats, engines, relays, serve, admin, envoy };
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
    let kv = s.client(&["--convs", "6", "--turns", "4", "--concurrency", "2", "--seed", "1"]);
    let failed: Vec<&Value> = kv.iter().filter(|r| r["ok"] != true).collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert_eq!(kv.len(), 6 * 5);
    for i in 0..2 {
        for cause in ["msgpack", "shape", "frames"] {
            assert_eq!(s.relay_metric(i, &format!("decode_errors_{cause}_total")), 0.0, "relay {i}: {cause}");
        }
        assert!(s.relay_metric(i, "messages_total") > 0.0, "relay {i} received real events");
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
                assert!(t["reason"].as_str().is_some_and(|r| !r.is_empty()), "a move without a reason: {t}");
            }
        }
    }
    let kv_hit = hit_rate(&kv);

    // 2. round robin, the same kind of load (other conversations).
    s.set_mode("round_robin");
    let rr = s.client(&["--convs", "6", "--turns", "4", "--concurrency", "2", "--seed", "2"]);
    assert!(rr.iter().all(|r| r["ok"] == true));
    let rr_hit = hit_rate(&rr);
    println!("vllm hit rate: kv {kv_hit:.3}, round_robin {rr_hit:.3}; follow-up moves under kv: {moves}");
    assert!(kv_hit > rr_hit + 0.05, "kv {kv_hit:.3} vs round robin {rr_hit:.3}");

    // 3. An engine killed mid-load.
    s.set_mode("kv");
    let log = s.dir.join("kill-load.jsonl");
    let mut load = Command::new(tools().join("venv/bin/python"));
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
    let t = Instant::now();
    s.engines[1].proc.kill();
    until(10, "the dead engine out of rotation", || s.worker("v1")["live"] != true);
    let out_ms = t.elapsed().as_millis();
    until(10, "the dead engine's blocks cleared", || s.worker("v1")["device_blocks"] == 0);
    assert!(load.wait().unwrap().success());
    let recs: Vec<Value> =
        std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let before: Vec<&Value> = recs.iter().filter(|r| r["ok"] != true && r["started"] != true).collect();
    let running = recs.iter().filter(|r| r["ok"] != true && r["started"] == true).count();
    println!("vllm kill: {} requests, {} failed while running, out of rotation in {out_ms} ms", recs.len(), running);
    assert!(before.is_empty(), "requests failed before they started: {before:?}");
    assert!(out_ms <= 1000, "out of rotation after {out_ms} ms");

    // 4. Restarted on its port: back, and not predicted to hold old blocks.
    let (args, core) = (s.engines[1].args.clone(), s.engines[1].core);
    s.engines[1].proc = spawn_engine(&s.dir, "vllm-1-again", &args, core);
    wait_healthy(&mut s.engines[1]);
    until(30, "the restarted engine live", || s.worker("v1")["live"] == true);
    assert_eq!(s.worker("v1")["device_blocks"], 0, "a restarted engine holds nothing");
    let again = s.client(&["--convs", "2", "--turns", "2", "--concurrency", "1", "--seed", "1"]);
    assert!(again.iter().all(|r| r["ok"] == true));
    for (p, _) in &mut s.relays {
        p.ensure_running().unwrap();
    }
    s.serve.ensure_running().unwrap();
}
