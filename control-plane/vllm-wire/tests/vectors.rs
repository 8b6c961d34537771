//! Every file in `../shared/vectors/vllm-kv-events/` decodes to its expected
//! form: the synthetic era vectors (0.9.0 → 0.33.0, int / u64 / bin32 / LoRA
//! variants), the replay exchanges of both layouts, and the 334 real frames
//! captured from vLLM 0.32 (checked against the capture's own decode).

use std::path::PathBuf;

use kvgate_vllm_wire::msgpack::Value;
use kvgate_vllm_wire::{
    BlockStored, Event, ReplayReply, cache_salt, decode_batch, decode_frames, decode_replay_reply, replay_request,
};
use serde_json::{Value as Json, json};

fn vectors() -> PathBuf {
    kvgate_testkit::shared_dir().unwrap().join("vectors/vllm-kv-events")
}

fn unhex(s: &str) -> Vec<u8> {
    kvgate_testkit::unhex(s).unwrap()
}

fn to_json(v: &Value<'_>) -> Json {
    match v {
        Value::Nil => Json::Null,
        Value::Bool(b) => json!(b),
        Value::UInt(u) => json!(u),
        Value::Int(i) => json!(i),
        Value::Float(f) => json!(f),
        Value::Str(s) => json!(s),
        Value::Bin(b) => json!(b.iter().map(|x| format!("{x:02x}")).collect::<String>()),
        Value::Array(a) => Json::Array(a.iter().map(to_json).collect()),
        Value::UInts(u) => json!(u),
        Value::Map(m) => Json::Array(m.iter().map(|(k, v)| json!([to_json(k), to_json(v)])).collect()),
        Value::Ext(t, d) => json!([t, d.len()]),
    }
}

/// Our decode of one event in the normalized shape of the vectors' `expected`.
fn normalized(e: &Event<'_>) -> Json {
    let opt_hash = |h: Option<u64>| h.map(|h| json!(h.to_string())).unwrap_or(Json::Null);
    match e {
        Event::Stored(s) => json!({
            "type": "BlockStored",
            "block_hashes": s.block_hashes.iter().map(|h| h.to_string()).collect::<Vec<_>>(),
            "parent_block_hash": opt_hash(s.parent_block_hash),
            "token_ids": s.token_ids,
            "block_size": s.block_size,
            "lora_id": s.lora_id,
            "medium": s.medium,
            "lora_name": s.lora_name,
            "extra_keys": s.extra_keys.as_ref().map(|k| k.iter().map(to_json).collect::<Vec<_>>()),
            "group_idx": s.group_idx,
            "kv_cache_spec_kind": s.kv_cache_spec_kind,
            "kv_cache_spec_sliding_window": s.kv_cache_spec_sliding_window,
        }),
        Event::Removed(r) => json!({
            "type": "BlockRemoved",
            "block_hashes": r.block_hashes.iter().map(|h| h.to_string()).collect::<Vec<_>>(),
            "medium": r.medium,
            "group_idx": r.group_idx,
        }),
        Event::Cleared => json!({"type": "AllBlocksCleared"}),
        Event::Unknown(t) => json!({"type": t}),
    }
}

/// The expected event restricted to the keys our normalized form has.
fn expected_subset(expected: &Json, ours: &Json) -> Json {
    let mut out = serde_json::Map::new();
    for k in ours.as_object().unwrap().keys() {
        out.insert(k.clone(), expected.get(k).cloned().unwrap_or(Json::Null));
    }
    Json::Object(out)
}

#[test]
fn synthetic_eras_decode_to_expected() {
    let dir = vectors().join("synthetic");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json") && p.file_name().unwrap() != "index.json")
        .collect();
    files.sort();
    assert!(files.len() >= 30, "expected every era's vectors, found {}", files.len());
    let mut eras = std::collections::BTreeSet::new();
    for path in files {
        let case: Json = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let frames: Vec<Vec<u8>> =
            case["frames_hex"].as_array().unwrap().iter().map(|f| unhex(f.as_str().unwrap())).collect();
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        let f = decode_frames(&refs).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(f.seq, case["seq"].as_u64().unwrap(), "{name}");
        assert_eq!(f.topic, case["topic"].as_str().unwrap().as_bytes(), "{name}");
        let b = decode_batch(f.payload).unwrap_or_else(|e| panic!("{name}: {e}"));
        let exp = &case["expected"];
        assert_eq!(b.ts, exp["ts"].as_f64().unwrap(), "{name}");
        assert_eq!(b.dp_rank, exp["dp_rank"].as_i64(), "{name}");
        assert_eq!(b.array_len as u64, exp["batch_array_len"].as_u64().unwrap(), "{name}");
        let want = exp["events"].as_array().unwrap();
        assert_eq!(b.events.len(), want.len(), "{name}");
        for (i, (got, want)) in b.events.iter().zip(want).enumerate() {
            let ours = normalized(got);
            assert_eq!(ours, expected_subset(want, &ours), "{name} event {i}");
        }
        // The LoRA variants of eras with extra keys carry the salt on block 0.
        if let Some(Event::Stored(s)) = b.events.first()
            && s.extra_keys.is_some()
            && case["variant"] == "lora"
        {
            assert_eq!(cache_salt(s), Some("salt-A"), "{name}");
        }
        eras.insert(case["vllm_version"].as_str().unwrap().to_owned());
    }
    assert!(eras.len() >= 11, "eras covered: {eras:?}");
}

#[test]
fn replay_exchanges_decode_in_both_layouts() {
    let dir = vectors().join("synthetic/replay");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let v: Json = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        for ex in v["exchanges"].as_array().unwrap() {
            let start = ex["start_seq"].as_u64().unwrap();
            let req: Vec<String> =
                replay_request(start).iter().map(|f| f.iter().map(|b| format!("{b:02x}")).collect()).collect();
            let sent: Vec<String> = ex["request_frames_hex_as_sent_by_dealer"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_str().unwrap().to_owned())
                .collect();
            assert_eq!(req, sent, "{name}: our replay request");
            let mut seqs = Vec::new();
            for msg in ex["reply_messages_hex_as_received_by_dealer"].as_array().unwrap() {
                let frames: Vec<Vec<u8>> = msg.as_array().unwrap().iter().map(|f| unhex(f.as_str().unwrap())).collect();
                let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
                match decode_replay_reply(&refs).unwrap_or_else(|e| panic!("{name}: {e}")) {
                    ReplayReply::Batch { seq, payload, topic } => {
                        decode_batch(payload).unwrap_or_else(|e| panic!("{name} seq {seq}: {e}"));
                        assert_eq!(
                            topic.is_some(),
                            v["layout"].as_str().unwrap_or("").contains("0.30"),
                            "{name}: layout"
                        );
                        seqs.push(seq as i64);
                    }
                    ReplayReply::End => seqs.push(-1),
                }
            }
            let want: Vec<i64> = ex["reply_seqs"].as_array().unwrap().iter().map(|s| s.as_i64().unwrap()).collect();
            assert_eq!(seqs, want, "{name} start {start}");
            n += 1;
        }
    }
    assert!(n >= 8, "replay exchanges checked: {n}");
}

/// The real captures: every frame decodes, and each event equals the
/// capture's own decode (msgspec, untyped).
#[test]
fn real_vllm_032_frames_decode_like_vllm() {
    let dir = vectors().join("real-0.32-cpu");
    let (mut messages, mut stored, mut removed, mut cleared) = (0, 0, 0, 0);
    for name in ["inst0", "inst1", "inst2", "relay0", "relay1", "relay2"] {
        let raw = std::fs::read_to_string(dir.join(format!("{name}.raw.jsonl"))).unwrap();
        let dec = std::fs::read_to_string(dir.join(format!("{name}.decoded.jsonl"))).unwrap();
        for (line, (r, d)) in raw.lines().zip(dec.lines()).enumerate() {
            let r: Json = serde_json::from_str(r).unwrap();
            let d: Json = serde_json::from_str(d).unwrap();
            let frames: Vec<Vec<u8>> =
                r["frames_hex"].as_array().unwrap().iter().map(|f| unhex(f.as_str().unwrap())).collect();
            let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
            let f = decode_frames(&refs).unwrap();
            assert_eq!(f.seq, d["seq"].as_u64().unwrap(), "{name}:{line}");
            let b = decode_batch(f.payload).unwrap_or_else(|e| panic!("{name}:{line}: {e}"));
            let batch = d["batch"].as_array().unwrap();
            // serde_json's default float parsing is not correctly rounded: compare within 1 µs.
            assert!((b.ts - batch[0].as_f64().unwrap()).abs() < 1e-6, "{name}:{line}");
            assert_eq!(b.dp_rank, batch[2].as_i64());
            let want = batch[1].as_array().unwrap();
            assert_eq!(b.events.len(), want.len(), "{name}:{line}");
            for (got, want) in b.events.iter().zip(want) {
                match got {
                    Event::Stored(s) => {
                        stored += 1;
                        check_real_stored(s, want, name, line);
                    }
                    Event::Removed(rm) => {
                        removed += rm.block_hashes.len();
                        let hashes: Vec<u64> =
                            want["block_hashes"].as_array().unwrap().iter().map(|h| h.as_u64().unwrap()).collect();
                        assert_eq!(rm.block_hashes, hashes);
                        assert_eq!(rm.medium, want["medium"].as_str());
                    }
                    Event::Cleared => {
                        cleared += 1;
                        assert_eq!(want["type"], "AllBlocksCleared");
                    }
                    Event::Unknown(t) => panic!("{name}:{line}: unknown event {t}"),
                }
            }
            messages += 1;
        }
    }
    // The capture's README: 334 messages, 287 BlockStored, 991 removed hashes, 1 clear.
    assert_eq!((messages, stored, removed, cleared), (334, 287, 991, 1));
}

fn check_real_stored(s: &BlockStored<'_>, want: &Json, name: &str, line: usize) {
    assert_eq!(want["type"], "BlockStored");
    let hashes: Vec<u64> = want["block_hashes"].as_array().unwrap().iter().map(|h| h.as_u64().unwrap()).collect();
    assert_eq!(s.block_hashes, hashes, "{name}:{line}");
    assert_eq!(s.parent_block_hash, want["parent_block_hash"].as_u64());
    let tokens: Vec<u32> = want["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    assert_eq!(s.token_ids, tokens);
    assert_eq!(s.token_ids.len(), s.block_hashes.len() * s.block_size as usize, "full blocks only");
    assert_eq!(s.block_size, 32);
    assert_eq!(s.medium, Some("GPU"));
    assert_eq!(s.kv_cache_spec_kind, Some("full_attention"));
    assert!(s.is_indexable());
    assert_eq!(cache_salt(s), None);
}

#[test]
fn malformed_input_is_an_error_not_a_panic() {
    for bad in [&b""[..], b"\xc1", b"\x93", b"\x92\xcb", b"\x93\xcb\0\0\0\0\0\0\0\0\x91\xc0\x00", b"\x91\x01"] {
        assert!(decode_batch(bad).is_err(), "{bad:?}");
    }
    // Trailing garbage after a valid batch.
    assert!(decode_batch(b"\x92\x00\x90\x00").unwrap_err().to_string().contains("trailing"));
    assert!(decode_frames(&[b"t", b"123", b"x"]).unwrap_err().to_string().contains("8"));
    assert!(decode_replay_reply(&[b"x", b"y"]).is_err());
}

/// `examples.json` (four frames picked for docs) decodes like its `decoded`
/// form, and `summary.json`'s per-file statistics are what we decode.
#[test]
fn real_examples_and_summary_agree() {
    let dir = vectors().join("real-0.32-cpu");
    let ex: Json = serde_json::from_str(&std::fs::read_to_string(dir.join("examples.json")).unwrap()).unwrap();
    let ex = ex.as_object().unwrap();
    assert_eq!(ex.len(), 4);
    for (name, e) in ex {
        let frames: Vec<Vec<u8>> =
            e["frames_hex"].as_array().unwrap().iter().map(|f| unhex(f.as_str().unwrap())).collect();
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        let f = decode_frames(&refs).unwrap();
        let b = decode_batch(f.payload).unwrap();
        let want = e["decoded"]["batch"][1].as_array().unwrap_or_else(|| panic!("{name}: {}", e["decoded"]));
        assert_eq!(b.events.len(), want.len(), "{name}");
        for (got, want) in b.events.iter().zip(want) {
            let t = want["type"].as_str().unwrap();
            match got {
                Event::Stored(s) => {
                    assert_eq!(t, "BlockStored", "{name}");
                    let h: Vec<u64> =
                        want["block_hashes"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
                    assert_eq!(s.block_hashes, h, "{name}");
                }
                Event::Removed(r) => {
                    assert_eq!(t, "BlockRemoved", "{name}");
                    let h: Vec<u64> =
                        want["block_hashes"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
                    assert_eq!(r.block_hashes, h, "{name}");
                }
                Event::Cleared => assert_eq!(t, "AllBlocksCleared", "{name}"),
                Event::Unknown(u) => panic!("{name}: unknown {u}"),
            }
        }
    }

    let summary: Json = serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    for file in summary["files"].as_array().unwrap() {
        let name = file["file"].as_str().unwrap();
        let (mut frames, mut stored_events, mut stored_blocks, mut removed) = (0u64, 0u64, 0u64, 0u64);
        for line in std::fs::read_to_string(dir.join(name)).unwrap().lines() {
            let r: Json = serde_json::from_str(line).unwrap();
            let fr: Vec<Vec<u8>> =
                r["frames_hex"].as_array().unwrap().iter().map(|f| unhex(f.as_str().unwrap())).collect();
            let refs: Vec<&[u8]> = fr.iter().map(Vec::as_slice).collect();
            let b = decode_batch(decode_frames(&refs).unwrap().payload).unwrap();
            frames += 1;
            for e in &b.events {
                match e {
                    Event::Stored(s) => {
                        stored_events += 1;
                        stored_blocks += s.block_hashes.len() as u64;
                    }
                    Event::Removed(r) => removed += r.block_hashes.len() as u64,
                    _ => {}
                }
            }
        }
        assert_eq!(frames, file["frames"].as_u64().unwrap(), "{name}");
        assert_eq!(stored_events, file["events_by_type"]["BlockStored"].as_u64().unwrap(), "{name}");
        assert_eq!(stored_blocks, file["stored_blocks"].as_u64().unwrap(), "{name}");
        assert_eq!(removed, file["removed_hashes"].as_u64().unwrap(), "{name}");
    }
}
