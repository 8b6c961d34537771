//! The relay's logic on real vLLM 0.32 captures and synthetic vectors:
//! normalization, the mirror, restarts, gaps (replay and resync),
//! snapshots, salt inheritance, and the whole path real frames → relay →
//! index → prefix match.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvgate_index::{Index, IndexConfig, KvEvent, Tier};
use kvgate_protocol::pb::{self, kv_event};
use kvgate_protocol::{BlockSeed, BlockSize, sequence_hashes};
use kvgate_relay::{Action, RelayConfig, RelayCore};
use serde_json::Value as Json;

fn vectors() -> PathBuf {
    kvgate_testkit::shared_dir().unwrap().join("vectors")
}

fn unhex(s: &str) -> Vec<u8> {
    kvgate_testkit::unhex(s).unwrap()
}

/// The frames of every message of a real capture file.
fn capture(name: &str) -> Vec<Vec<Vec<u8>>> {
    kvgate_testkit::capture_frames(name).unwrap()
}

fn relay(replay: bool) -> RelayCore {
    RelayCore::new(RelayConfig {
        worker_id: "127.0.0.1:8101".into(),
        model: "tiny-llama".into(),
        replay,
        relay_epoch: 7,
    })
}

fn feed(r: &mut RelayCore, msg: &[Vec<u8>]) -> Vec<Action> {
    let refs: Vec<&[u8]> = msg.iter().map(Vec::as_slice).collect();
    r.on_live(&refs)
}

fn published(actions: &[Action]) -> Vec<pb::KvEventBatch> {
    actions.iter().filter_map(|a| if let Action::Publish(b) = a { Some(b.clone()) } else { None }).collect()
}

/// Naive replay of published batches: engine hash → refs.
fn naive(batches: &[pb::KvEventBatch]) -> BTreeMap<u64, u32> {
    let mut m = BTreeMap::new();
    for b in batches {
        for e in &b.events {
            match e.event.as_ref().unwrap() {
                kv_event::Event::Stored(s) => {
                    for h in &s.engine_hashes {
                        *m.entry(*h).or_insert(0) += 1;
                    }
                }
                kv_event::Event::Removed(r) => {
                    for h in &r.engine_hashes {
                        let n = m.get_mut(h).expect("relay published a removal of an unknown block");
                        *n -= 1;
                        if *n == 0 {
                            m.remove(h);
                        }
                    }
                }
                kv_event::Event::Cleared(_) => m.clear(),
            }
        }
    }
    m
}

fn mirror_refs(r: &RelayCore) -> BTreeMap<u64, u32> {
    let mut m = BTreeMap::new();
    for (h, b) in r.mirror().ordered() {
        m.insert(h, b.refs);
    }
    m
}

#[test]
fn real_streams_relay_cleanly_and_the_mirror_matches() {
    for name in ["inst0", "inst1", "inst2"] {
        let mut r = relay(false);
        let mut out = Vec::new();
        for msg in capture(name) {
            out.extend(feed(&mut r, &msg));
        }
        let batches = published(&out);
        let c = *r.counters();
        assert_eq!(c.decode_errors_msgpack + c.decode_errors_shape + c.decode_errors_frames, 0, "{name}");
        // relay_seq counts published batches without gaps.
        for (i, b) in batches.iter().enumerate() {
            assert_eq!(b.relay_seq, i as u64 + 1);
            assert_eq!(b.relay_epoch, 7);
        }
        // Only whole chains are in the mirror's ordered view, and it equals
        // what a consumer of the published batches holds.
        assert_eq!(mirror_refs(&r), naive(&batches), "{name}");
        if name == "inst2" {
            assert_eq!(c.restarts, 1, "inst2 holds two publisher processes");
        }
        assert!(c.blocks_stored > 200, "{name}: {c:?}");
    }
}

/// Real frames → relay → protobuf → index: the first request of capture
/// inst1 (a 325-token chat prompt tokenized with the real DeepSeek
/// tokenizer, 10 full blocks of 32) matches all 10 blocks on that worker.
#[test]
fn real_frames_through_relay_and_index_match_the_real_prompt() {
    let v: Json =
        serde_json::from_str(&std::fs::read_to_string(vectors().join("block-hash/vllm-sha256-cbor.json")).unwrap())
            .unwrap();
    let prompt: Vec<u32> = v["real_inst1"][0]["request"]["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let bs = BlockSize::new(32).unwrap();
    let mut index = Index::new(IndexConfig::new(bs));
    let w = index.add_worker("127.0.0.1:8101");
    let mut r = relay(false);
    let first = capture("inst1").into_iter().next().unwrap();
    for b in published(&feed(&mut r, &first)) {
        let wire = prost::Message::encode_to_vec(&b);
        let b: pb::KvEventBatch = prost::Message::decode(wire.as_slice()).unwrap();
        for e in &b.events {
            index.apply(w, &KvEvent::from_pb(e).unwrap()).unwrap();
        }
    }
    let seqs = sequence_hashes(&prompt, bs, BlockSeed::BASE);
    assert_eq!(seqs.len(), 10);
    let mut out = Vec::new();
    index.find_matches(&seqs, Tier::Device, &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].blocks, 10);
    // A different tenant's salt must not match.
    let salted = sequence_hashes(&prompt, bs, BlockSeed::new(None, Some("tenant-b")));
    index.find_matches(&salted, Tier::Device, &mut out);
    assert!(out.is_empty());
}

/// relay0: the last frames of one engine process (seq 192–193), then the
/// restarted process from seq 0. Removals of blocks stored before the relay
/// started are counted, not published; the restart publishes a clear.
#[test]
fn engine_restart_clears_the_worker() {
    let mut r = relay(false);
    let mut out = Vec::new();
    for msg in capture("relay0") {
        out.extend(feed(&mut r, &msg));
    }
    let c = *r.counters();
    assert_eq!(c.restarts, 1);
    assert_eq!(r.generation(), 1);
    assert!(c.unknown_removals > 0);
    let batches = published(&out);
    let clear_at = batches
        .iter()
        .position(|b| matches!(b.events.first().and_then(|e| e.event.as_ref()), Some(kv_event::Event::Cleared(_))))
        .expect("a clear is published at the restart");
    assert!(batches[clear_at + 1..].iter().all(|b| b.engine_generation == 1));
    assert_eq!(mirror_refs(&r), naive(&batches));
}

#[test]
fn a_gap_is_replayed_or_cleared() {
    let msgs = capture("inst0");
    let mut clean = relay(false);
    for m in &msgs {
        feed(&mut clean, m);
    }

    // Without a replay socket: lose seq 5 → clear and resync.
    let mut r = relay(false);
    let mut out = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        if i != 5 {
            out.extend(feed(&mut r, m));
        }
    }
    assert_eq!((r.counters().gaps, r.counters().resyncs), (1, 1));
    assert_eq!(mirror_refs(&r), naive(&published(&out)));

    // With one: the relay asks for seq 5, holds live messages, and ends in
    // exactly the state of the run without the gap.
    let mut r = relay(true);
    let mut out = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        // 5 is lost; 7 arrives live during the replay (below), only once.
        if i == 5 || i == 7 {
            continue;
        }
        let acts = feed(&mut r, m);
        if acts.contains(&Action::RequestReplay { from_seq: 5 }) {
            assert!(r.replaying());
            // Later live messages arrive during the replay and are held.
            out.extend(feed(&mut r, &msgs[7]));
            // The replay socket answers (vLLM >= 0.30 layout) and ends.
            for m in &msgs[5..=6] {
                let reply: Vec<&[u8]> = vec![b"", &m[0], &m[1], &m[2]];
                out.extend(r.on_replay(&reply));
            }
            out.extend(r.on_replay(&[b"", b"", &[0xff; 8], b""]));
            assert!(!r.replaying());
        }
        out.extend(acts.into_iter().filter(|a| matches!(a, Action::Publish(_))));
    }
    assert_eq!(r.counters().replays, 1);
    assert_eq!(r.counters().resyncs, 0);
    assert_eq!(r.counters().duplicates, 1, "seq 6 came both held live and replayed");
    assert_eq!(mirror_refs(&r), mirror_refs(&clean));
    assert_eq!(mirror_refs(&r), naive(&published(&out)));
}

#[test]
fn snapshots_reproduce_the_mirror_parents_first() {
    let mut r = relay(false);
    for m in capture("inst0") {
        feed(&mut r, &m);
    }
    let chunks = r.snapshot(32, 4096);
    assert!(chunks.len() > 1, "small chunks force several");
    let mut seen = BTreeMap::new();
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!((c.chunk_index as usize, c.chunk_count as usize), (i, chunks.len()));
        assert_eq!(c.relay_seq, r.relay_seq());
        assert!(prost::Message::encoded_len(c) <= 4096 || c.blocks.len() == 1);
        for b in &c.blocks {
            if let Some(p) = b.parent_engine_hash {
                assert!(seen.contains_key(&p), "parent after child");
            }
            assert_eq!(b.token_ids.len(), 32);
            seen.insert(b.engine_hash, b.ref_count);
        }
    }
    assert_eq!(seen, mirror_refs(&r));
    // An empty mirror is one empty chunk.
    let empty = relay(false).snapshot(32, 4096);
    assert_eq!((empty.len(), empty[0].chunk_count, empty[0].blocks.len()), (1, 1, 0));
}

/// A LoRA request with a cache salt (vLLM 0.17+ synthetic vector): the root
/// block carries the salt in extra_keys[0]; its child inherits it.
#[test]
fn cache_salt_is_carried_to_child_blocks() {
    let v: Json = serde_json::from_str(
        &std::fs::read_to_string(vectors().join("vllm-kv-events/synthetic/0.30.0-lora.json")).unwrap(),
    )
    .unwrap();
    let frames: Vec<Vec<u8>> = v["frames_hex"].as_array().unwrap().iter().map(|f| unhex(f.as_str().unwrap())).collect();
    let mut r = relay(false);
    let batches = published(&feed(&mut r, &frames));
    let stored: Vec<&pb::BlockStored> = batches[0]
        .events
        .iter()
        .filter_map(|e| if let Some(kv_event::Event::Stored(s)) = &e.event { Some(s) } else { None })
        .collect();
    assert_eq!(stored.len(), 2);
    for s in stored {
        assert_eq!(s.cache_salt, "salt-A");
        assert_eq!(s.lora_name, "sql-lora");
    }
}

#[test]
fn garbage_is_counted_never_fatal() {
    let mut r = relay(true);
    assert!(r.on_live(&[b"only one frame"]).is_empty());
    assert!(r.on_live(&[b"t", &0u64.to_be_bytes(), b"\xc1garbage"]).is_empty());
    assert!(r.on_live(&[b"t", b"short", b"x"]).is_empty());
    assert!(r.on_replay(&[b"x"]).is_empty(), "no replay in progress");
    let c = r.counters();
    assert_eq!((c.decode_errors_frames, c.decode_errors_msgpack), (2, 1));
}

/// Blocks of a sliding-window (or mamba) KV group are counted and skipped;
/// full-attention blocks of the same batch go through.
#[test]
fn non_indexable_groups_are_skipped() {
    use kvgate_vllm_wire::encode::{Encoding, encode_batch};
    use kvgate_vllm_wire::{Batch, BlockStored, Event};
    let block = |h: u64, kind: &'static str| {
        Event::Stored(BlockStored {
            block_hashes: vec![h],
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            kv_cache_spec_kind: Some(kind),
            group_idx: Some(if kind == "full_attention" { 0 } else { 1 }),
            ..Default::default()
        })
    };
    let batch = Batch {
        ts: 1.0,
        dp_rank: Some(0),
        array_len: 3,
        events: vec![block(1, "sliding_window"), block(2, "full_attention"), block(3, "mamba")],
    };
    let payload = encode_batch(&batch, Encoding::Map);
    let mut r = relay(false);
    let out = published(&r.on_live(&[b"kv", &0u64.to_be_bytes(), &payload]));
    assert_eq!(r.counters().non_indexable, 2);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].events.len(), 1);
    assert_eq!(r.mirror().len(), 1);
    assert!(r.mirror().get(2).is_some());
}

/// The same message twice (same sequence, same bytes) is a duplicate: it
/// is counted and dropped, and the worker keeps its blocks. A message with
/// a sequence that goes back and other bytes is a restart, even when the
/// old engine had published only seq 0.
#[test]
fn a_duplicate_is_dropped_and_a_restart_clears() {
    let msgs = capture("inst1");
    let mut r = relay(false);
    feed(&mut r, &msgs[0]);
    feed(&mut r, &msgs[1]);
    let held = mirror_refs(&r);
    assert!(!held.is_empty());
    // Both again, in any order: duplicates.
    assert!(published(&feed(&mut r, &msgs[1])).is_empty());
    assert!(published(&feed(&mut r, &msgs[0])).is_empty());
    assert_eq!((r.counters().duplicates, r.counters().restarts, r.generation()), (2, 0, 0));
    assert_eq!(mirror_refs(&r), held, "a duplicate changes nothing");
    // seq 0 with the bytes of another batch: a new engine process.
    let mut restarted = msgs[0].clone();
    restarted[2] = msgs[1][2].clone();
    let out = published(&feed(&mut r, &restarted));
    assert_eq!(r.counters().restarts, 1);
    assert!(matches!(out[0].events[0].event, Some(kv_event::Event::Cleared(_))));
    assert_eq!(r.generation(), 1);
}

/// The engine confirmed down: the mirror is cleared (published), and the
/// next engine process starts a fresh stream from seq 0 without being
/// taken for a restart or a gap.
#[test]
fn engine_down_clears_and_the_next_engine_starts_fresh() {
    let msgs = capture("inst1");
    let mut r = relay(false);
    feed(&mut r, &msgs[0]);
    feed(&mut r, &msgs[1]);
    let out = published(&r.engine_down());
    assert_eq!(out.len(), 1);
    assert!(matches!(out[0].events[0].event, Some(kv_event::Event::Cleared(_))));
    assert!(r.mirror().is_empty());
    assert_eq!((r.counters().engine_downs, r.generation()), (1, 1));
    // Down again (still down): nothing more to clear.
    assert!(published(&r.engine_down()).is_empty());
    let out = published(&feed(&mut r, &msgs[0]));
    assert!(!out.is_empty() && !out[0].events.iter().any(|e| matches!(e.event, Some(kv_event::Event::Cleared(_)))));
    assert_eq!((r.counters().restarts, r.counters().gaps), (0, 0));
}

/// A batch far over NATS's payload limit (40,000 blocks, ~2 MB) is
/// published as consecutive batches under the limit whose replay gives the
/// same blocks.
#[test]
fn an_oversized_batch_is_split_under_the_limit() {
    let mut r = relay(false);
    let bs = 16usize;
    let n = 40_000usize;
    let hashes: Vec<u64> = (1..=n as u64).collect();
    let tokens: Vec<u32> = (0..(n * bs) as u32).map(|t| 50_000 + (t % 70_000)).collect();
    let stored = kvgate_vllm_wire::BlockStored {
        block_hashes: hashes,
        parent_block_hash: None,
        token_ids: tokens,
        block_size: bs as u32,
        medium: Some("GPU"),
        ..Default::default()
    };
    let batch = kvgate_vllm_wire::Batch {
        ts: 1.0,
        dp_rank: None,
        array_len: 3,
        events: vec![kvgate_vllm_wire::Event::Stored(stored)],
    };
    let payload = kvgate_vllm_wire::encode::encode_batch(&batch, kvgate_vllm_wire::encode::Encoding::Map);
    let frames = vec![b"kv".to_vec(), 0u64.to_be_bytes().to_vec(), payload];
    assert!(frames[2].len() > 1 << 20, "{} bytes", frames[2].len());
    let out = published(&feed(&mut r, &frames));
    assert!(out.len() >= 3, "{} batches", out.len());
    for (i, b) in out.iter().enumerate() {
        assert!(prost::Message::encoded_len(b) <= kvgate_relay::core::DEFAULT_MAX_BATCH_BYTES);
        assert_eq!(b.relay_seq, i as u64 + 1, "consecutive relay_seq");
    }
    assert_eq!(naive(&out).len(), n);
    assert_eq!(r.counters().split_batches, out.len() as u64 - 1);
}

/// After the event socket (re)connects, the relay asks the replay socket
/// for what it may have missed: from 0 on a fresh stream, after the last
/// applied batch otherwise; live messages wait for the replay's end.
#[test]
fn catch_up_after_a_reconnect_replays_what_was_missed() {
    let msgs = capture("inst1");
    // Without a replay socket there is nothing to ask.
    assert!(relay(false).catch_up().is_empty());
    let mut r = relay(true);
    assert_eq!(r.catch_up(), vec![Action::RequestReplay { from_seq: 0 }]);
    assert!(r.catch_up().is_empty(), "one replay at a time");
    // A live message arrives meanwhile: held.
    assert!(feed(&mut r, &msgs[2]).is_empty());
    // The replay brings 0 and 1, then ends: 0, 1, then the held 2.
    let reply = |m: &[Vec<u8>]| -> Vec<Vec<u8>> { vec![Vec::new(), m[0].clone(), m[1].clone(), m[2].clone()] };
    let mut out = Vec::new();
    for m in &msgs[..2] {
        let f = reply(m);
        let refs: Vec<&[u8]> = f.iter().map(Vec::as_slice).collect();
        out.extend(published(&r.on_replay(&refs)));
    }
    let end: Vec<Vec<u8>> = vec![Vec::new(), Vec::new(), vec![0xff; 8], Vec::new()];
    let refs: Vec<&[u8]> = end.iter().map(Vec::as_slice).collect();
    out.extend(published(&r.on_replay(&refs)));
    assert!(!r.replaying());
    assert_eq!(out.iter().map(|b| b.engine_seq).collect::<Vec<_>>(), vec![0, 1, 2]);
    // Reconnected again: from the last applied batch, to compare it.
    assert_eq!(r.catch_up(), vec![Action::RequestReplay { from_seq: 2 }]);
}

/// An engine that restarted while the event socket was down: its
/// numbering began again and already passed ours, so the live stream alone
/// would take its batches for the old process's next ones. The replay after
/// the reconnect asks for the last applied batch again: the same bytes are
/// the same process (a duplicate), other bytes a new one: the mirror is
/// cleared and the new process's batches are asked for from 0.
#[test]
fn a_restart_while_the_socket_was_down_is_found_by_the_catch_up_replay() {
    let msgs = capture("inst1");
    let reply = |seq: u64, m: &[Vec<u8>]| -> Vec<Vec<u8>> {
        vec![Vec::new(), m[0].clone(), seq.to_be_bytes().to_vec(), m[2].clone()]
    };
    let end: Vec<Vec<u8>> = vec![Vec::new(), Vec::new(), vec![0xff; 8], Vec::new()];
    let on = |r: &mut RelayCore, f: &[Vec<u8>]| {
        let refs: Vec<&[u8]> = f.iter().map(Vec::as_slice).collect();
        r.on_replay(&refs)
    };
    let mut r = relay(true);
    for m in &msgs[..3] {
        feed(&mut r, m);
    }
    // The same process: its batch 2 again, a duplicate; nothing cleared.
    assert_eq!(r.catch_up(), vec![Action::RequestReplay { from_seq: 2 }]);
    assert!(published(&on(&mut r, &reply(2, &msgs[2]))).is_empty());
    assert!(published(&on(&mut r, &end)).is_empty());
    assert_eq!((r.replaying(), r.counters().restarts, r.generation()), (false, 0, 0));

    // A new process whose batch 2 differs: cleared, the rest of this
    // replay ignored, then everything from 0.
    assert_eq!(r.catch_up(), vec![Action::RequestReplay { from_seq: 2 }]);
    let out = published(&on(&mut r, &reply(2, &msgs[0])));
    assert!(matches!(out[0].events[0].event, Some(kv_event::Event::Cleared(_))), "{out:?}");
    assert!(r.mirror().is_empty());
    assert!(published(&on(&mut r, &reply(3, &msgs[1]))).is_empty(), "the rest waits for the replay from 0");
    assert_eq!(on(&mut r, &end), vec![Action::RequestReplay { from_seq: 0 }]);
    let mut applied = Vec::new();
    for (seq, m) in [(0, &msgs[0]), (1, &msgs[1]), (2, &msgs[2])] {
        applied.extend(published(&on(&mut r, &reply(seq, m))));
    }
    applied.extend(published(&on(&mut r, &end)));
    assert!(!r.replaying());
    assert_eq!(applied.iter().map(|b| b.engine_seq).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert!(applied.iter().all(|b| b.engine_generation == 1));
    assert_eq!((r.counters().restarts, r.generation()), (1, 1));
    assert!(!r.mirror().is_empty(), "the new process's blocks");
}
