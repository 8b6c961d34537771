//! Relay throughput on one core (`make bench-relay`): blocks per second
//! through decode → normalize → mirror → protobuf encode, and the same with
//! each batch published to a real local nats-server (async-nats, current-
//! thread runtime, flushed at the end). Two workloads:
//!
//! * `real-mix`: the 334 real vLLM 0.32 messages (small batches: ~5-block
//!   stores and single-hash removals), looped;
//! * `long-prompt`: one 100K-token prompt (6,250 blocks of 16) stored and
//!   then removed, in vLLM's map encoding.
//!
//! Writes `bench/results/relay-throughput.json` with the commit and machine.

use std::time::{Duration, Instant};

use kvgate_relay::{Action, RelayConfig, RelayCore};
use kvgate_vllm_wire::encode::{Encoding, encode_batch};
use kvgate_vllm_wire::{Batch, BlockRemoved, BlockStored, Event};
use prost::Message;

fn real_messages() -> Vec<Vec<Vec<u8>>> {
    ["inst0", "inst1", "inst2"].iter().flat_map(|n| kvgate_testkit::capture_frames(n).unwrap()).collect()
}

fn long_prompt() -> Vec<Vec<Vec<u8>>> {
    let n = 6_250u64;
    let hashes: Vec<u64> = (0..n).map(|i| 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i + 1)).collect();
    let stored = Batch {
        ts: 1.0,
        dp_rank: Some(0),
        array_len: 3,
        events: vec![Event::Stored(BlockStored {
            block_hashes: hashes.clone(),
            token_ids: (0..n as u32 * 16).map(|t| t % 129_280).collect(),
            block_size: 16,
            medium: Some("GPU"),
            extra_keys: Some(vec![kvgate_vllm_wire::msgpack::Value::Nil; n as usize]),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention"),
            ..Default::default()
        })],
    };
    let removed = Batch {
        ts: 2.0,
        dp_rank: Some(0),
        array_len: 3,
        events: vec![Event::Removed(BlockRemoved { block_hashes: hashes, medium: Some("GPU"), group_idx: Some(0) })],
    };
    [stored, removed]
        .iter()
        .enumerate()
        .map(|(i, b)| vec![b"kv-events".to_vec(), (i as u64).to_be_bytes().to_vec(), encode_batch(b, Encoding::Map)])
        .collect()
}

/// Runs passes over `msgs` for about `secs`; returns (blocks, seconds).
fn run(msgs: &[Vec<Vec<u8>>], secs: f64, mut sink: impl FnMut(Vec<u8>)) -> (u64, f64) {
    let start = Instant::now();
    let mut blocks = 0u64;
    while start.elapsed().as_secs_f64() < secs {
        let mut core =
            RelayCore::new(RelayConfig { worker_id: "w".into(), model: "m".into(), replay: false, relay_epoch: 1 });
        for m in msgs {
            let refs: Vec<&[u8]> = m.iter().map(Vec::as_slice).collect();
            for a in core.on_live(&refs) {
                if let Action::Publish(b) = a {
                    sink(b.encode_to_vec());
                }
            }
        }
        let c = core.counters();
        blocks += c.blocks_stored + c.blocks_removed;
    }
    (blocks, start.elapsed().as_secs_f64())
}

fn main() {
    let secs: f64 = std::env::var("RELAY_BENCH_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let workloads = [("real-mix", real_messages()), ("long-prompt", long_prompt())];
    let mut rows = Vec::new();
    for (name, msgs) in &workloads {
        let mut bytes = 0usize;
        let (blocks, s) = run(msgs, secs, |b| bytes += b.len());
        rows.push(serde_json::json!({"workload": name, "path": "decode+normalize+mirror+encode", "blocks_per_s": (blocks as f64 / s).round(), "blocks": blocks, "seconds": s}));
        eprintln!("{name}: {:.0} blocks/s (cpu path)", blocks as f64 / s);
    }
    // With a real nats-server, if the tools are installed.
    if let Ok(dir) = kvgate_testkit::scratch_dir("relay-bench")
        && let Ok(server) = kvgate_testkit::NatsServer::start(&dir)
    {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let client = rt.block_on(async_nats::connect(format!("nats://127.0.0.1:{}", server.port))).unwrap();
        for (name, msgs) in &workloads {
            // As the relay does: publish from the async loop, flush at the end.
            let (blocks, s) = rt.block_on(async {
                let t = Instant::now();
                let mut blocks = 0u64;
                while t.elapsed().as_secs_f64() < secs {
                    let mut core = RelayCore::new(RelayConfig {
                        worker_id: "w".into(),
                        model: "m".into(),
                        replay: false,
                        relay_epoch: 1,
                    });
                    for m in msgs {
                        let refs: Vec<&[u8]> = m.iter().map(Vec::as_slice).collect();
                        for a in core.on_live(&refs) {
                            if let Action::Publish(b) = a {
                                client.publish("bench.kv", b.encode_to_vec().into()).await.unwrap();
                            }
                        }
                    }
                    let c = core.counters();
                    blocks += c.blocks_stored + c.blocks_removed;
                }
                client.flush().await.unwrap();
                (blocks, t.elapsed().as_secs_f64())
            });
            rows.push(serde_json::json!({"workload": name, "path": "decode+normalize+mirror+encode+nats publish", "blocks_per_s": (blocks as f64 / s).round(), "blocks": blocks, "seconds": s}));
            eprintln!("{name}: {:.0} blocks/s (with NATS)", blocks as f64 / s);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let (commit, machine) = kvgate_bench_support::provenance();
    let result = serde_json::json!({
        "rows": rows,
        "goal_blocks_per_s": 1_000_000,
        "threads": 1,
        "commit": commit,
        "machine": machine,
    });
    let out = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/results/relay-throughput.json");
    std::fs::write(&out, serde_json::to_string_pretty(&result).unwrap() + "\n").unwrap();
    println!("{}", serde_json::to_string_pretty(&result["rows"]).unwrap());
}
