//! `make bench-gateway`: what the kvgate filter adds to a request in Envoy.
//!
//! Two Envoy 1.40 processes run side by side on 127.0.0.1 with one worker
//! thread each, in front of the same two upstreams (HTTP/1.1 echo servers):
//!
//! * **baseline**: `envoy/local.yaml`, no filter (the worker cluster's
//!   fallback balancer picks);
//! * **kvgate**: `envoy/kvgate.yaml`, the built `.wasm` filter calling the
//!   real control plane (`kvgate serve`, release build, the DeepSeek-V3
//!   tokenizer, the two upstreams as static workers).
//!
//! Requests are chat completions whose system prompt has ~8K or ~100K
//! tokens followed by a new user question each time (the multi-turn case:
//! the control plane's tokenization cache holds the prefix, so only the
//! question is tokenized). They alternate A/B/B/A… on keep-alive
//! connections, one at a time, so both sides see the same machine noise.
//! Reported per size: client-side latency p50/p99 of each side, their
//! difference (the added latency), and on-CPU time per request of each Envoy
//! (and of the control plane), summed over all their threads from
//! `/proc/<pid>/task/*/schedstat`. Every kvgate request must have been
//! steered (no fallback), or the run fails.
//!
//! Result: `bench/results/gateway-overhead.json` with the commit and machine.
//! `KVGATE_BENCH_QUICK=1` runs a tenth of the requests.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvgate_e2e::{
    EchoUpstream, Envoy, Proc, bench_provenance, bench_words, envoy_validate, free_port, render_kvgate_envoy,
    render_local_envoy, scratch_dir, wait_for_tcp,
};
use kvgate_protocol::pb;
use kvgate_server::router_client::RouterClient;
use serde_json::{Value, json};

const MODEL: &str = "bench";

/// A keep-alive HTTP/1.1 client for one Envoy.
struct Client {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Client {
    fn connect(addr: SocketAddr) -> Client {
        let s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        Client { r: BufReader::new(s.try_clone().unwrap()), w: s }
    }

    /// One POST; returns the latency to the end of the response.
    fn post(&mut self, body: &[u8]) -> Duration {
        let t = Instant::now();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        self.w.write_all(head.as_bytes()).unwrap();
        self.w.write_all(body).unwrap();
        let mut line = String::new();
        self.r.read_line(&mut line).unwrap();
        assert!(line.starts_with("HTTP/1.1 200"), "{line}");
        let mut len = 0usize;
        loop {
            line.clear();
            self.r.read_line(&mut line).unwrap();
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                len = v.trim().parse().unwrap();
            }
        }
        let mut buf = vec![0; len];
        self.r.read_exact(&mut buf).unwrap();
        t.elapsed()
    }
}

/// On-CPU nanoseconds of all threads of a process.
fn cpu_ns(pid: u32) -> u64 {
    let mut total = 0;
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
                total += s.split_whitespace().next().and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
            }
        }
    }
    total
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn body(system: &str, i: usize) -> Vec<u8> {
    json!({"model": MODEL, "max_tokens": 16, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": format!("Question {i}: which worker holds the prefix, and how fast can it answer?")},
    ]})
    .to_string()
    .into_bytes()
}

/// Prompt tokens of a request, from the control plane's own answer.
fn prompt_tokens(rt: &tokio::runtime::Runtime, grpc: SocketAddr, b: &[u8]) -> u64 {
    let v: Value = serde_json::from_slice(b).unwrap();
    let msgs: Vec<Vec<u8>> = v["messages"].as_array().unwrap().iter().map(|m| serde_json::to_vec(m).unwrap()).collect();
    let refs: Vec<&[u8]> = msgs.iter().map(Vec::as_slice).collect();
    let hashes = kvgate_server::tokens::chain_hashes(b"", &refs);
    let req = pb::PickRequest {
        model: MODEL.into(),
        api: pb::ApiKind::ChatCompletions as i32,
        segments: msgs
            .iter()
            .zip(hashes)
            .map(|(m, h)| pb::Segment { chain_hash: h, role: String::new(), message_json: m.clone() })
            .collect(),
        ..Default::default()
    };
    let r = rt.block_on(async {
        let mut c = RouterClient::connect(format!("http://{grpc}")).await.unwrap();
        c.pick(req).await.unwrap().into_inner()
    });
    u64::from(r.total_blocks) * 16
}

fn start_envoy(dir: &Path, name: &str, yaml: String, admin: u16) -> Envoy {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    let config = d.join("envoy.yaml");
    std::fs::write(&config, yaml).unwrap();
    envoy_validate(&config).unwrap();
    Envoy::start(&config, admin, &d).unwrap()
}

fn main() {
    // `cargo bench` passes --bench; nothing else is accepted.
    let quick = std::env::var_os("KVGATE_BENCH_QUICK").is_some();
    let dir = scratch_dir("bench-gateway").unwrap();
    let ups: Vec<EchoUpstream> = (0..2).map(|i| EchoUpstream::start(&format!("w{i}")).unwrap()).collect();
    let addrs: Vec<SocketAddr> = ups.iter().map(|u| u.addr).collect();

    // The real control plane, static workers.
    let tk = std::env::var_os("KVGATE_TOKENIZER_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| kvgate_e2e::repo_root().join(".tools/models/deepseek-v3"));
    let (gp, ap) = (free_port().unwrap(), free_port().unwrap());
    let grpc: SocketAddr = ([127, 0, 0, 1], gp).into();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    cmd.args(["serve", "--nats-url", "off", "--model", MODEL, "--block-size", "16", "--tokenizer-dir"])
        .arg(&tk)
        .args(["--listen-grpc", &grpc.to_string(), "--listen-admin", &format!("127.0.0.1:{ap}")]);
    for (i, a) in addrs.iter().enumerate() {
        cmd.args(["--worker", &format!("w{i}={a}")]);
    }
    let serve = Proc::spawn("serve", cmd, &dir).unwrap();
    wait_for_tcp(grpc, Duration::from_secs(30)).unwrap();

    let (lb, ab, lk, ak) = (free_port().unwrap(), free_port().unwrap(), free_port().unwrap(), free_port().unwrap());
    let base = start_envoy(&dir, "baseline", render_local_envoy(lb, ab, &addrs).unwrap(), ab);
    let filter_config = json!({"control_plane": {"timeout_ms": 1000}, "reports": {"interval_ms": 1000}}).to_string();
    let kv = start_envoy(&dir, "kvgate", render_kvgate_envoy(lk, ak, &addrs, &[grpc], &filter_config).unwrap(), ak);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();

    let mut rows = serde_json::Map::new();
    let mut table = Vec::new();
    for (label, target_tokens, pairs, goal_p50, goal_p99) in
        [("8k", 8192u64, 2000usize, 300.0, 1000.0), ("100k", 102_400, 300, 1000.0, 3000.0)]
    {
        let pairs = if quick { pairs / 10 } else { pairs };
        // Size the system prompt to the target token count.
        let probe_words = 2000;
        let probe = prompt_tokens(&rt, grpc, &body(&bench_words(7, probe_words), 0));
        let words = (target_tokens as f64 * probe_words as f64 / probe as f64) as usize;
        let system = bench_words(7, words);
        let tokens = prompt_tokens(&rt, grpc, &body(&system, 0));
        let bodies: Vec<Vec<u8>> = (0..pairs + 20).map(|i| body(&system, i)).collect();
        let (mut a, mut b) = (Client::connect(([127, 0, 0, 1], lb).into()), Client::connect(([127, 0, 0, 1], lk).into()));
        for x in bodies.iter().take(20) {
            a.post(x);
            b.post(x);
        }
        let steered0 = kv.stat("wasmcustom.kvgate.steered").unwrap_or(0);
        let (ca0, cb0, cs0) = (cpu_ns(base.proc.pid()), cpu_ns(kv.proc.pid()), cpu_ns(serve.pid()));
        let (mut la, mut lb_) = (Vec::with_capacity(pairs), Vec::with_capacity(pairs));
        for (i, x) in bodies.iter().skip(20).enumerate() {
            if i % 2 == 0 {
                la.push(a.post(x).as_secs_f64() * 1e6);
                lb_.push(b.post(x).as_secs_f64() * 1e6);
            } else {
                lb_.push(b.post(x).as_secs_f64() * 1e6);
                la.push(a.post(x).as_secs_f64() * 1e6);
            }
        }
        let (ca1, cb1, cs1) = (cpu_ns(base.proc.pid()), cpu_ns(kv.proc.pid()), cpu_ns(serve.pid()));
        let steered = kv.stat("wasmcustom.kvgate.steered").unwrap_or(0) - steered0;
        assert_eq!(steered, pairs as u64, "every kvgate request must be steered (no fallback)");
        la.sort_by(f64::total_cmp);
        lb_.sort_by(f64::total_cmp);
        let r = |x: f64| (x * 10.0).round() / 10.0;
        let (b50, b99, k50, k99) = (pct(&la, 0.5), pct(&la, 0.99), pct(&lb_, 0.5), pct(&lb_, 0.99));
        let per = |d: u64| r(d as f64 / pairs as f64 / 1000.0);
        let row = json!({
            "prompt_tokens": tokens,
            "body_bytes": bodies[20].len(),
            "requests_per_side": pairs,
            "baseline_p50_us": r(b50), "baseline_p99_us": r(b99),
            "kvgate_p50_us": r(k50), "kvgate_p99_us": r(k99),
            "added_p50_us": r(k50 - b50), "added_p99_us": r(k99 - b99),
            "envoy_cpu_us_per_req": {"baseline": per(ca1 - ca0), "kvgate": per(cb1 - cb0)},
            "control_plane_cpu_us_per_req": per(cs1 - cs0),
            "goal": {"added_p50_us": goal_p50, "added_p99_us": goal_p99,
                     "met": k50 - b50 <= goal_p50 && k99 - b99 <= goal_p99},
        });
        table.push(format!(
            "{label:>5} {tokens:>7} tok {:>7} B | baseline p50 {:>7.1} p99 {:>7.1} | kvgate p50 {:>7.1} p99 {:>7.1} | added p50 {:>7.1} p99 {:>7.1} µs | envoy CPU/req {:>6.1} → {:>6.1} µs, control plane {:>6.1} µs",
            bodies[20].len(),
            b50,
            b99,
            k50,
            k99,
            k50 - b50,
            k99 - b99,
            per(ca1 - ca0),
            per(cb1 - cb0),
            per(cs1 - cs0)
        ));
        rows.insert(label.into(), row);
    }
    let (commit, machine) = bench_provenance();
    let mut result = Value::Object(rows);
    result["what"] = json!("client latency through Envoy 1.40 with the kvgate filter + real control plane vs the same Envoy without the filter, A/B interleaved, sequential keep-alive requests, 1 Envoy worker thread each");
    result["commit"] = json!(commit);
    result["machine"] = json!(machine);
    result["quick"] = json!(quick);
    let out = kvgate_e2e::repo_root().join("bench/results/gateway-overhead.json");
    std::fs::write(&out, serde_json::to_string_pretty(&result).unwrap() + "\n").unwrap();
    for l in &table {
        println!("{l}");
    }
    println!("wrote {}", out.display());
}
