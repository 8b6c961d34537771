//! `kvgate relay` end to end: real vLLM 0.32 frames published by a real
//! libzmq PUB socket (pyzmq, connecting like vLLM does for a concrete tcp
//! endpoint), the relay binary, a real nats-server. The batches on NATS equal
//! what the relay core computes for the same frames, heartbeats carry the
//! load scraped from a vLLM-style /metrics, and a snapshot requested over
//! NATS equals the mirror.

use std::process::Command;
use std::time::{Duration, Instant};

use kvgate_protocol::pb;
use kvgate_protocol::subject::Subjects;
use kvgate_relay::{Action, RelayConfig, RelayCore};
use kvgate_testkit::{NatsClient, NatsServer, Proc, StaticHttp, free_port, repo_root, scratch_dir, tool, wait_for_tcp};
use prost::Message;

const MODEL: &str = "tiny-llama";
const ENDPOINT: &str = "127.0.0.1:8101";

fn capture_named(name: &str) -> std::path::PathBuf {
    kvgate_testkit::capture_path(name).unwrap()
}

fn capture_path() -> std::path::PathBuf {
    capture_named("inst1")
}

fn unhex(s: &str) -> Vec<u8> {
    kvgate_testkit::unhex(s).unwrap()
}

/// What the relay core publishes for the inst1 capture, offline.
fn expected() -> (Vec<pb::KvEventBatch>, RelayCore) {
    expected_for("inst1")
}

/// What the relay core publishes for a capture, offline.
fn expected_for(name: &str) -> (Vec<pb::KvEventBatch>, RelayCore) {
    let mut core =
        RelayCore::new(RelayConfig { worker_id: ENDPOINT.into(), model: MODEL.into(), replay: false, relay_epoch: 0 });
    let mut out = Vec::new();
    for line in std::fs::read_to_string(capture_named(name)).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let frames: Vec<Vec<u8>> =
            v["frames_hex"].as_array().unwrap().iter().map(|f| unhex(f.as_str().unwrap())).collect();
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        for a in core.on_live(&refs) {
            if let Action::Publish(b) = a {
                out.push(b);
            }
        }
    }
    (out, core)
}

#[test]
fn relay_forwards_real_frames_to_nats() {
    let dir = scratch_dir("relay-e2e").unwrap();
    let nats = NatsServer::start(&dir).unwrap();
    let metrics = StaticHttp::start(
        "vllm:num_requests_running{engine=\"0\"} 3.0\nvllm:num_requests_waiting{engine=\"0\"} 1.0\n\
         vllm:kv_cache_usage_perc{engine=\"0\"} 0.25\n\
         vllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"128\"} 1.0\n"
            .to_owned(),
        "text/plain",
    )
    .unwrap();
    let zmq_port = free_port().unwrap();
    let subjects = Subjects::default();
    let mut client = NatsClient::connect(nats.port).unwrap();
    client.subscribe(&subjects.kv_events(MODEL, ENDPOINT), "kv").unwrap();
    client.subscribe(&subjects.heartbeat(MODEL, ENDPOINT), "hb").unwrap();
    client.flush().unwrap();

    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    cmd.args(["relay", "--zmq-endpoint", &format!("tcp://127.0.0.1:{zmq_port}")])
        .args(["--nats-url", &format!("nats://127.0.0.1:{}", nats.port)])
        .args(["--model", MODEL, "--endpoint", ENDPOINT, "--block-size", "32", "--max-num-seqs", "8"])
        .args(["--metrics-url", &format!("http://{}/metrics", metrics.addr), "--heartbeat-ms", "200"]);
    let mut relay = Proc::spawn("relay", cmd, &dir).unwrap();
    // vLLM with "tcp://127.0.0.1:PORT" connects: the relay binds.
    wait_for_tcp(([127, 0, 0, 1], zmq_port).into(), Duration::from_secs(10)).unwrap();

    let python = tool("KVGATE_PYTHON", "../venv/bin/python").unwrap();
    let out = Command::new(python)
        .arg(repo_root().join("tests/tools/zmq_pub.py"))
        .args(["connect", &format!("tcp://127.0.0.1:{zmq_port}")])
        .arg(capture_path())
        .output()
        .unwrap();
    assert!(out.status.success(), "publisher failed: {}", String::from_utf8_lossy(&out.stderr));

    let (want, core) = expected();
    let mut got = Vec::new();
    let mut heartbeats = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while got.len() < want.len() && Instant::now() < deadline {
        if let Some(m) = client.next_msg(Duration::from_millis(500)).unwrap() {
            match m.sid.as_str() {
                "kv" => got.push(pb::KvEventBatch::decode(m.payload.as_slice()).unwrap()),
                _ => heartbeats.push(pb::WorkerHeartbeat::decode(m.payload.as_slice()).unwrap()),
            }
        }
    }
    relay.ensure_running().unwrap();
    assert_eq!(got.len(), want.len(), "batches on NATS; relay log:\n{}", relay.log());
    let epoch = got[0].relay_epoch;
    assert_ne!(epoch, 0);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.relay_epoch, epoch);
        assert_eq!(pb::KvEventBatch { relay_epoch: 0, ..g.clone() }, *w);
    }

    // Heartbeats carry the scraped load.
    while heartbeats.is_empty() {
        let m = client.next_msg(Duration::from_secs(2)).unwrap().expect("a heartbeat");
        if m.sid == "hb" {
            heartbeats.push(pb::WorkerHeartbeat::decode(m.payload.as_slice()).unwrap());
        }
    }
    let hb = heartbeats.last().unwrap();
    assert_eq!((hb.running, hb.waiting, hb.block_size, hb.capacity_blocks, hb.max_num_seqs), (3, 1, 32, 128, 8));
    assert!((hb.kv_usage - 0.25).abs() < 1e-6 && hb.engine_ok);
    assert_eq!((hb.endpoint.as_str(), hb.relay_epoch), (ENDPOINT, epoch));

    // A snapshot over NATS request-reply equals the relay core's mirror.
    let mut snap = NatsClient::connect(nats.port).unwrap();
    snap.subscribe("_INBOX.snap-test", "s").unwrap();
    snap.flush().unwrap();
    let req = pb::SnapshotRequest { requester: "test".into(), max_chunk_bytes: 4096 };
    snap.request(&subjects.snapshot(MODEL, ENDPOINT), "_INBOX.snap-test", &req.encode_to_vec()).unwrap();
    snap.flush().unwrap();
    let mut chunks = Vec::new();
    loop {
        let m = snap.next_msg(Duration::from_secs(5)).unwrap().expect("snapshot chunks");
        let c = pb::SnapshotChunk::decode(m.payload.as_slice()).unwrap();
        let done = c.chunk_index + 1 == c.chunk_count;
        chunks.push(c);
        if done {
            break;
        }
    }
    let want_chunks: Vec<pb::SnapshotChunk> =
        core.snapshot(32, 4096).into_iter().map(|c| pb::SnapshotChunk { relay_epoch: epoch, ..c }).collect();
    assert_eq!(chunks, want_chunks);
    assert!(chunks.len() > 1);
    relay.kill();
}

/// Runs `kvgate relay` against a pyzmq publisher of `capture` (with extra
/// publisher flags), collects the kv batches on NATS until `want` arrived,
/// and returns them with the relay's own /metrics text.
fn run_capture(
    capture: &str,
    relay_flags: &[String],
    pub_flags: &[String],
    want: usize,
) -> (Vec<pb::KvEventBatch>, String) {
    let dir = scratch_dir(&format!("relay-{capture}")).unwrap();
    run_capture_file(&dir, &capture_named(capture), relay_flags, pub_flags, want)
}

/// [`run_capture`] of a capture file, in `dir`.
fn run_capture_file(
    dir: &std::path::Path,
    capture: &std::path::Path,
    relay_flags: &[String],
    pub_flags: &[String],
    want: usize,
) -> (Vec<pb::KvEventBatch>, String) {
    let dir = dir.to_owned();
    let nats = NatsServer::start(&dir).unwrap();
    let zmq_port = free_port().unwrap();
    let metrics_port = free_port().unwrap();
    let subjects = Subjects::default();
    let mut client = NatsClient::connect(nats.port).unwrap();
    client.subscribe(&subjects.kv_events(MODEL, ENDPOINT), "kv").unwrap();
    client.flush().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    cmd.args(["relay", "--zmq-endpoint", &format!("tcp://127.0.0.1:{zmq_port}")])
        .args(["--nats-url", &format!("nats://127.0.0.1:{}", nats.port)])
        .args(["--model", MODEL, "--endpoint", ENDPOINT, "--block-size", "32"])
        .args(["--listen-metrics", &format!("127.0.0.1:{metrics_port}")])
        .args(relay_flags);
    let mut relay = Proc::spawn("relay", cmd, &dir).unwrap();
    wait_for_tcp(([127, 0, 0, 1], zmq_port).into(), Duration::from_secs(10)).unwrap();
    let out = Command::new(tool("KVGATE_PYTHON", "../venv/bin/python").unwrap())
        .arg(repo_root().join("tests/tools/zmq_pub.py"))
        .args(["connect", &format!("tcp://127.0.0.1:{zmq_port}")])
        .arg(capture)
        .args(pub_flags)
        .output()
        .unwrap();
    assert!(out.status.success(), "publisher failed: {}", String::from_utf8_lossy(&out.stderr));
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while got.len() < want && Instant::now() < deadline {
        if let Some(m) = client.next_msg(Duration::from_millis(500)).unwrap() {
            got.push(pb::KvEventBatch::decode(m.payload.as_slice()).unwrap());
        }
    }
    relay.ensure_running().unwrap();
    let metrics =
        kvgate_testkit::http_request(([127, 0, 0, 1], metrics_port).into(), "GET", "/metrics", &[], b"").unwrap();
    assert_eq!(metrics.status, 200);
    relay.kill();
    (got, String::from_utf8(metrics.body).unwrap())
}

fn metric(text: &str, name: &str) -> f64 {
    kvgate_testkit::prom::value(text, &format!("kvgate_relay_{name}{{"))
        .unwrap_or_else(|| panic!("metric {name} not found in:\n{text}"))
}

fn without_epoch(b: &[pb::KvEventBatch]) -> Vec<pb::KvEventBatch> {
    b.iter().map(|b| pb::KvEventBatch { relay_epoch: 0, ..b.clone() }).collect()
}

/// Messages 5 and 6 of inst0 are not published live; the relay sees the gap,
/// asks the (pyzmq ROUTER) replay socket, and publishes exactly what it would
/// have without the gap.
#[test]
fn relay_repairs_a_gap_through_the_replay_socket() {
    let replay_port = free_port().unwrap();
    let replay = format!("tcp://127.0.0.1:{replay_port}");
    let (want, _) = expected_for("inst0");
    let (got, metrics) = run_capture(
        "inst0",
        &["--replay-endpoint".into(), replay.clone()],
        &["--skip".into(), "5,6".into(), "--replay".into(), replay],
        want.len(),
    );
    assert_eq!(without_epoch(&got), want);
    assert_eq!(metric(&metrics, "gaps_total"), 1.0);
    assert_eq!(metric(&metrics, "replays_total"), 1.0);
    assert_eq!(metric(&metrics, "resyncs_total"), 0.0);
    assert_eq!(metric(&metrics, "nats_connected"), 1.0);
}

/// relay0 holds the end of one engine process and the restarted process from
/// seq 0: the relay publishes a clear and counts the restart.
#[test]
fn relay_clears_the_worker_when_the_engine_restarts() {
    let (want, _) = expected_for("relay0");
    let (got, metrics) = run_capture("relay0", &[], &[], want.len());
    assert_eq!(without_epoch(&got), want);
    assert!(got.iter().any(|b| b.events.iter().any(|e| matches!(e.event, Some(pb::kv_event::Event::Cleared(_))))));
    assert_eq!(metric(&metrics, "restarts_total"), 1.0);
    assert_eq!(metric(&metrics, "engine_generation"), 1.0);
    assert!(metric(&metrics, "unknown_removals_total") > 0.0);
}

/// The relay keeps its state across a NATS outage: half of inst1, nats-server
/// killed and started again on the same port, the relay reconnects (its
/// /metrics say so), the other half arrives, and a snapshot still holds the
/// blocks stored before the outage.
#[test]
fn relay_survives_a_nats_restart_without_losing_state() {
    let dir = scratch_dir("relay-nats-restart").unwrap();
    let mut nats = NatsServer::start(&dir).unwrap();
    let port = nats.port;
    let zmq_port = free_port().unwrap();
    let metrics_port = free_port().unwrap();
    let subjects = Subjects::default();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    cmd.args(["relay", "--zmq-endpoint", &format!("tcp://127.0.0.1:{zmq_port}")])
        .args(["--nats-url", &format!("nats://127.0.0.1:{port}")])
        .args(["--model", MODEL, "--endpoint", ENDPOINT, "--block-size", "32"])
        .args(["--listen-metrics", &format!("127.0.0.1:{metrics_port}")]);
    let mut relay = Proc::spawn("relay", cmd, &dir).unwrap();
    wait_for_tcp(([127, 0, 0, 1], zmq_port).into(), Duration::from_secs(10)).unwrap();
    let publish = |range: &str| {
        let out = Command::new(tool("KVGATE_PYTHON", "../venv/bin/python").unwrap())
            .arg(repo_root().join("tests/tools/zmq_pub.py"))
            .args(["connect", &format!("tcp://127.0.0.1:{zmq_port}")])
            .arg(capture_path())
            .args(["--range", range])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    let metrics = || {
        let r =
            kvgate_testkit::http_request(([127, 0, 0, 1], metrics_port).into(), "GET", "/metrics", &[], b"").unwrap();
        String::from_utf8(r.body).unwrap()
    };
    let collect = |client: &mut NatsClient, n: usize| {
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(15);
        while got.len() < n && Instant::now() < deadline {
            if let Some(m) = client.next_msg(Duration::from_millis(300)).unwrap() {
                got.push(pb::KvEventBatch::decode(m.payload.as_slice()).unwrap());
            }
        }
        got
    };
    let (want, core) = expected();
    // Batches the first 25 messages produce.
    let first = {
        let mut c = RelayCore::new(RelayConfig {
            worker_id: ENDPOINT.into(),
            model: MODEL.into(),
            replay: false,
            relay_epoch: 0,
        });
        let text = std::fs::read_to_string(capture_path()).unwrap();
        let mut n = 0;
        for line in text.lines().take(25) {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let frames: Vec<Vec<u8>> =
                v["frames_hex"].as_array().unwrap().iter().map(|f| unhex(f.as_str().unwrap())).collect();
            let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
            n += c.on_live(&refs).len();
        }
        n
    };

    let mut client = NatsClient::connect(port).unwrap();
    client.subscribe(&subjects.kv_events(MODEL, ENDPOINT), "kv").unwrap();
    client.flush().unwrap();
    publish("0:25");
    let before = collect(&mut client, first);
    assert_eq!(before.len(), first);

    nats.proc.kill();
    drop(client);
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&metrics(), "nats_connected") != 0.0 {
        assert!(Instant::now() < deadline, "relay never noticed the outage");
        std::thread::sleep(Duration::from_millis(100));
    }
    nats = NatsServer::start_on(&dir, port).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&metrics(), "nats_connected") != 1.0 {
        assert!(Instant::now() < deadline, "relay did not reconnect:\n{}", relay.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut client = NatsClient::connect(nats.port).unwrap();
    client.subscribe(&subjects.kv_events(MODEL, ENDPOINT), "kv").unwrap();
    client.flush().unwrap();
    publish("25:1000");
    let after = collect(&mut client, want.len() - first);
    let mut all = before;
    all.extend(after);
    assert_eq!(without_epoch(&all), want);

    // The mirror survived: the snapshot equals the relay core's after all messages.
    client.subscribe("_INBOX.snap2", "s").unwrap();
    client.flush().unwrap();
    let req = pb::SnapshotRequest { requester: "test".into(), max_chunk_bytes: 0 };
    client.request(&subjects.snapshot(MODEL, ENDPOINT), "_INBOX.snap2", &req.encode_to_vec()).unwrap();
    let m = client.next_msg(Duration::from_secs(5)).unwrap().expect("a snapshot");
    let chunk = pb::SnapshotChunk::decode(m.payload.as_slice()).unwrap();
    let want_blocks: Vec<u64> =
        core.snapshot(32, 1 << 20).into_iter().flat_map(|c| c.blocks).map(|b| b.engine_hash).collect();
    assert_eq!(chunk.chunk_count, 1);
    assert_eq!(chunk.blocks.iter().map(|b| b.engine_hash).collect::<Vec<_>>(), want_blocks);
    relay.ensure_running().unwrap();
    relay.kill();
}

// ------------------------------------------------------ relay faults --
//
// Faults of the event stream, each with a real libzmq publisher, the relay
// binary and nats-server: the relay keeps running, counts what it skipped,
// and what it publishes equals what the relay core computes for the same
// frames (so an index fed from NATS equals the engine's cache as far as
// its events tell).

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Writes frames as a capture file for `zmq_pub.py`.
fn write_capture(dir: &std::path::Path, name: &str, msgs: &[Vec<Vec<u8>>]) -> std::path::PathBuf {
    let path = dir.join(format!("{name}.raw.jsonl"));
    let lines: Vec<String> = msgs
        .iter()
        .map(|m| serde_json::json!({"frames_hex": m.iter().map(|f| hex(f)).collect::<Vec<_>>()}).to_string())
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// The relay core's output for `msgs` (no replay socket).
fn offline(msgs: &[Vec<Vec<u8>>]) -> (Vec<pb::KvEventBatch>, RelayCore) {
    let mut core =
        RelayCore::new(RelayConfig { worker_id: ENDPOINT.into(), model: MODEL.into(), replay: false, relay_epoch: 0 });
    let mut out = Vec::new();
    for m in msgs {
        let refs: Vec<&[u8]> = m.iter().map(Vec::as_slice).collect();
        for a in core.on_live(&refs) {
            if let Action::Publish(b) = a {
                out.push(b);
            }
        }
    }
    (out, core)
}

/// Runs the relay on a capture file made of `msgs`; returns what reached
/// NATS and the relay's metrics.
fn run_frames(name: &str, msgs: &[Vec<Vec<u8>>], want: usize) -> (Vec<pb::KvEventBatch>, String) {
    let dir = scratch_dir(&format!("relay-fault-{name}")).unwrap();
    let path = write_capture(&dir, name, msgs);
    run_capture_file(&dir, &path, &[], &[], want)
}

fn frames(seq: u64, payload: Vec<u8>) -> Vec<Vec<u8>> {
    vec![b"kv-events".to_vec(), seq.to_be_bytes().to_vec(), payload]
}

/// A valid batch of 40,000 blocks (~2.1 MB, over NATS's 1 MiB payload
/// limit) stopped the relay ("max payload size exceeded"). It is now split
/// under the limit; nothing is lost and the relay goes on.
#[test]
fn relay_fault_oversized_batch() {
    let real = kvgate_testkit::capture_frames("inst1").unwrap();
    let n = 40_000usize;
    let stored = kvgate_vllm_wire::BlockStored {
        block_hashes: (1..=n as u64).map(|h| h << 20).collect(),
        token_ids: (0..(n * 32) as u32).map(|t| 1_000 + t % 100_000).collect(),
        block_size: 32,
        medium: Some("GPU"),
        ..Default::default()
    };
    let batch = kvgate_vllm_wire::Batch {
        ts: 1.0,
        dp_rank: Some(0),
        array_len: 3,
        events: vec![kvgate_vllm_wire::Event::Stored(stored)],
    };
    let big = kvgate_vllm_wire::encode::encode_batch(&batch, kvgate_vllm_wire::encode::Encoding::Map);
    assert!(big.len() > 2_000_000);
    let last = real.len() as u64;
    let mut msgs = real.clone();
    msgs.push(frames(last, big));
    msgs.push(
        real[1]
            .iter()
            .enumerate()
            .map(|(i, f)| if i == 1 { (last + 1).to_be_bytes().to_vec() } else { f.clone() })
            .collect(),
    );
    let (want, core) = offline(&msgs);
    let (got, metrics) = run_frames("oversized", &msgs, want.len());
    assert_eq!(without_epoch(&got), want, "every batch, split the same way");
    assert!(metric(&metrics, "split_batches_total") >= 2.0, "{metrics}");
    assert_eq!(metric(&metrics, "publish_errors_total"), 0.0, "{metrics}");
    assert!(core.mirror().len() >= n);
}

/// The same batch delivered twice is dropped as a duplicate: the worker's
/// blocks are not wiped (it used to be taken for an engine restart).
#[test]
fn relay_fault_duplicated_batch() {
    let real = kvgate_testkit::capture_frames("inst1").unwrap();
    let mut msgs = real[..6].to_vec();
    msgs.insert(4, real[3].clone());
    let (want, _) = offline(&msgs);
    let (got, metrics) = run_frames("duplicate", &msgs, want.len());
    assert_eq!(without_epoch(&got), want);
    assert_eq!(metric(&metrics, "duplicates_total"), 1.0, "{metrics}");
    assert_eq!(metric(&metrics, "restarts_total"), 0.0, "{metrics}");
    // Exactly what the stream without the duplicate gives.
    assert_eq!(without_epoch(&got), offline(&real[..6]).0);
}

/// Garbage frames (not msgpack, wrong frame counts, msgpack of another
/// shape) are counted and skipped; the valid batches around them all pass.
#[test]
fn relay_fault_garbage_frames() {
    let real = kvgate_testkit::capture_frames("inst1").unwrap();
    let mut msgs = real[..3].to_vec();
    msgs.push(frames(3, vec![0xc1, 0xff, 0x00]));
    msgs.push(vec![b"kv-events".to_vec()]);
    msgs.push(frames(4, vec![0x93, 0x01, 0x02, 0x03]));
    msgs.extend(real[3..6].iter().map(|m| {
        let seq = u64::from_be_bytes(m[1].as_slice().try_into().unwrap()) + 2;
        vec![m[0].clone(), seq.to_be_bytes().to_vec(), m[2].clone()]
    }));
    let (want, _) = offline(&msgs);
    let (got, metrics) = run_frames("garbage", &msgs, want.len());
    assert_eq!(without_epoch(&got), want);
    let errors = metric(&metrics, "decode_errors_msgpack_total")
        + metric(&metrics, "decode_errors_shape_total")
        + metric(&metrics, "decode_errors_frames_total");
    assert_eq!(errors, 3.0, "{metrics}");
}

/// A gap the engine's replay buffer no longer covers: the relay clears the
/// worker (published, so every index forgets a state with a hole in it)
/// and resynchronizes from the batches that follow.
#[test]
fn relay_fault_gap_beyond_the_replay_buffer() {
    let replay_port = free_port().unwrap();
    let replay = format!("tcp://127.0.0.1:{replay_port}");
    let (got, metrics) = run_capture(
        "inst1",
        &["--replay-endpoint".into(), replay.clone()],
        // Lines 5 and 6 are lost live, and the replay buffer starts at 7.
        &["--skip".into(), "5,6".into(), "--replay".into(), replay, "--replay-from".into(), "7".into()],
        10,
    );
    assert_eq!(metric(&metrics, "gaps_total"), 1.0, "{metrics}");
    assert_eq!(metric(&metrics, "resyncs_total"), 1.0, "{metrics}");
    assert!(got.iter().flat_map(|b| &b.events).any(|e| matches!(e.event, Some(pb::kv_event::Event::Cleared(_)))));
}

/// The relay starts before NATS and publishes what it received once NATS
/// is up (held in its bounded queue).
#[test]
fn relay_starts_without_nats_and_delivers_when_it_comes() {
    let dir = scratch_dir("relay-no-nats").unwrap();
    let nats_port = free_port().unwrap();
    let zmq_port = free_port().unwrap();
    let real = kvgate_testkit::capture_frames("inst1").unwrap();
    let msgs = real[..8].to_vec();
    let path = write_capture(&dir, "early", &msgs);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    cmd.args(["relay", "--zmq-endpoint", &format!("tcp://127.0.0.1:{zmq_port}")])
        .args(["--nats-url", &format!("nats://127.0.0.1:{nats_port}")])
        .args(["--model", MODEL, "--endpoint", ENDPOINT, "--block-size", "32"]);
    let mut relay = Proc::spawn("relay", cmd, &dir).unwrap();
    wait_for_tcp(([127, 0, 0, 1], zmq_port).into(), Duration::from_secs(10)).unwrap();
    let out = Command::new(tool("KVGATE_PYTHON", "../venv/bin/python").unwrap())
        .arg(repo_root().join("tests/tools/zmq_pub.py"))
        .args(["connect", &format!("tcp://127.0.0.1:{zmq_port}")])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success());
    relay.ensure_running().unwrap();
    let nats = NatsServer::start_on(&dir, nats_port).unwrap();
    let mut client = NatsClient::connect(nats.port).unwrap();
    // What was queued may be published before this subscription: ask for
    // a snapshot instead, which equals the relay core's mirror.
    client.subscribe("_INBOX.early", "s").unwrap();
    client.flush().unwrap();
    let (_, core) = offline(&msgs);
    let want = core.snapshot(32, 900 * 1024);
    let mut chunks = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while chunks.len() < want.len() && Instant::now() < deadline {
        let req = pb::SnapshotRequest { requester: "test".into(), max_chunk_bytes: 0 };
        client.request(&Subjects::default().snapshot(MODEL, ENDPOINT), "_INBOX.early", &req.encode_to_vec()).unwrap();
        client.flush().unwrap();
        while let Some(m) = client.next_msg(Duration::from_millis(500)).unwrap() {
            chunks.push(pb::SnapshotChunk::decode(m.payload.as_slice()).unwrap());
        }
    }
    relay.ensure_running().unwrap();
    let blocks: usize = chunks.iter().take(want.len()).map(|c| c.blocks.len()).sum();
    assert_eq!(blocks, want.iter().map(|c| c.blocks.len()).sum::<usize>(), "relay log:\n{}", relay.log());
    relay.kill();
}
