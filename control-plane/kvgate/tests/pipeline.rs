//! The control-plane pipeline with every part a real process: two simulated
//! vLLM workers (`kvgate sim`), a relay next to each (`kvgate relay`: ZMQ →
//! NATS), nats-server, and the control plane (`kvgate serve`). A
//! conversation served by one worker makes `Pick` choose that worker for
//! its next turn, and the worker's reported `cached_tokens` equal what the
//! control plane predicted.

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use kvgate_e2e::{NatsServer, Proc, free_port, http_request, wait_for_tcp};
use kvgate_protocol::pb;
use kvgate_server::router_client::RouterClient;
use serde_json::{Value, json};

const MODEL: &str = "deepseek-v3";

fn tokenizer_dir() -> std::path::PathBuf {
    std::env::var_os("KVGATE_TOKENIZER_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| kvgate_e2e::repo_root().join(".tools/models/deepseek-v3"))
}

fn kvgate(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    c.args(args);
    c
}

/// Two consecutive free ports (ZMQ PUB and replay).
fn port_pair() -> u16 {
    for _ in 0..50 {
        let p = free_port().unwrap();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no free port pair")
}

fn until(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(secs) {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}");
}

fn chat(addr: SocketAddr, messages: &Value) -> Value {
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 20}).to_string();
    let r =
        http_request(addr, "POST", "/v1/chat/completions", &[("content-type", "application/json")], body.as_bytes())
            .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    serde_json::from_slice(&r.body).unwrap()
}

fn pick_request(id: &str, messages: &Value) -> pb::PickRequest {
    let bytes: Vec<Vec<u8>> = messages.as_array().unwrap().iter().map(|m| serde_json::to_vec(m).unwrap()).collect();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let hashes = kvgate_server::tokens::chain_hashes(b"", &refs);
    pb::PickRequest {
        request_id: id.into(),
        model: MODEL.into(),
        api: pb::ApiKind::ChatCompletions as i32,
        segments: bytes
            .into_iter()
            .zip(hashes)
            .map(|(b, h)| pb::Segment { chain_hash: h, role: String::new(), message_json: b })
            .collect(),
        max_tokens: Some(20),
        ..Default::default()
    }
}

#[test]
fn sim_relay_nats_and_control_plane_agree_on_the_cache() {
    let dir = kvgate_e2e::scratch_dir("pipeline").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let nats_url = format!("nats://127.0.0.1:{}", nats.port);
    let tk = tokenizer_dir();
    let tk = tk.to_str().unwrap();
    let mut procs: Vec<Proc> = Vec::new();
    let mut http = Vec::new();
    for w in 0..2 {
        let hp = free_port().unwrap();
        let zp = port_pair();
        let (hp_s, zp_s) = (hp.to_string(), zp.to_string());
        let sim = kvgate(&[
            "sim",
            "--workers",
            "1",
            "--tokenizer-dir",
            tk,
            "--http-port",
            &hp_s,
            "--zmq-port",
            &zp_s,
            "--block-size",
            "16",
            "--num-blocks",
            "4096",
            "--speedup",
            "20",
        ]);
        procs.push(Proc::spawn(&format!("sim-{w}"), sim, &dir).unwrap());
        let addr: SocketAddr = ([127, 0, 0, 1], hp).into();
        wait_for_tcp(addr, Duration::from_secs(30)).unwrap();
        http.push(addr);
        let (pub_ep, connect, replay) =
            (format!("tcp://*:{zp}"), format!("tcp://127.0.0.1:{zp}"), format!("tcp://127.0.0.1:{}", zp + 1));
        let (endpoint, metrics, worker) = (addr.to_string(), format!("http://{addr}/metrics"), format!("w{w}"));
        let relay = kvgate(&[
            "relay",
            "--zmq-endpoint",
            &pub_ep,
            "--zmq-connect",
            &connect,
            "--replay-endpoint",
            &replay,
            "--nats-url",
            &nats_url,
            "--model",
            MODEL,
            "--endpoint",
            &endpoint,
            "--worker-id",
            &worker,
            "--metrics-url",
            &metrics,
            "--block-size",
            "16",
            "--max-num-seqs",
            "64",
            "--heartbeat-ms",
            "100",
        ]);
        procs.push(Proc::spawn(&format!("relay-{w}"), relay, &dir).unwrap());
    }
    let (gp, ap) = (free_port().unwrap(), free_port().unwrap());
    let (grpc, admin) = (format!("127.0.0.1:{gp}"), format!("127.0.0.1:{ap}"));
    let serve = kvgate(&[
        "serve",
        "--model",
        MODEL,
        "--tokenizer-dir",
        tk,
        "--block-size",
        "16",
        "--nats-url",
        &nats_url,
        "--listen-grpc",
        &grpc,
        "--listen-admin",
        &admin,
        "--replica-id",
        "cp-e2e",
    ]);
    procs.push(Proc::spawn("serve", serve, &dir).unwrap());
    let admin: SocketAddr = admin.parse().unwrap();
    wait_for_tcp(admin, Duration::from_secs(30)).unwrap();
    let workers = || -> Value {
        serde_json::from_slice(&http_request(admin, "GET", "/admin/workers", &[], b"").unwrap().body).unwrap()
    };
    until(30, "both workers live in the control plane", || {
        workers()[MODEL].as_array().is_some_and(|a| a.len() == 2 && a.iter().all(|w| w["live"] == true))
    });

    // A conversation served by w1.
    let mut messages = json!([
        {"role": "system", "content": "You are a network engineer. ".repeat(60)},
        {"role": "user", "content": "How does Envoy pick an upstream host?"},
    ]);
    let first = chat(http[1], &messages);
    let prompt1 = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let blocks = |w: usize| -> u64 { workers()[MODEL][w]["device_blocks"].as_u64().unwrap_or(0) };
    until(20, "w1's blocks in the index", || blocks(1) >= prompt1 / 16);
    assert_eq!(blocks(0), 0);

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
    assert!(u64::from(picked.matched_blocks) >= prompt1 / 16 - 1, "{picked:?} after a {prompt1}-token prompt");
    let second = chat(http[1], &messages);
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert_eq!(cached, u64::from(picked.matched_blocks) * 16, "prediction = engine's cached tokens");
    for p in &mut procs {
        p.ensure_running().unwrap();
    }
}
