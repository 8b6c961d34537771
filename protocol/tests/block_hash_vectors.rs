//! Every vector in `../shared/vectors/block-hash/` (produced by
//! dynamo-kv-router 1.6.1 itself and by vLLM 0.32's own hash functions) must
//! come out of our hasher bit for bit.
//!
//! The shared folder is found at `$KVGATE_SHARED_DIR`, else next to the
//! repository (`<repo>/../shared`). A missing folder fails the test: the
//! vectors are the contract, not an optional extra.

use std::path::PathBuf;

use kvgate_protocol::{BlockSeed, BlockSize, SequenceHasher, local_block_hashes, sequence_hashes};
use serde_json::Value;

fn shared_dir() -> PathBuf {
    let dir = std::env::var_os("KVGATE_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"));
    assert!(
        dir.join("vectors/block-hash").is_dir(),
        "shared vectors not found at {} (set KVGATE_SHARED_DIR)",
        dir.display()
    );
    dir
}

fn load(name: &str) -> Value {
    let path = shared_dir().join("vectors/block-hash").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_str().unwrap().parse::<u64>().unwrap()).collect()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Checks one Dynamo case: seed, local hashes, sequence hashes, and the
/// incremental hasher fed one token at a time.
fn check_dynamo_case(case: &Value) -> usize {
    let name = case["name"].as_str().unwrap();
    let bs = BlockSize::new(case["block_size"].as_u64().unwrap() as u32).unwrap();
    let seed = BlockSeed::new(case["lora"].as_str(), case["salt"].as_str());
    let expected_seed: u64 = case["block_seed"].as_str().unwrap().parse().unwrap();
    assert_eq!(seed.get(), expected_seed, "{name}: block seed");
    let tokens = u32s(&case["tokens"]);
    let local: Vec<u64> = local_block_hashes(&tokens, bs, seed).map(|h| h.0).collect();
    assert_eq!(local, u64s(&case["local_hashes"]), "{name}: local hashes");
    let seq: Vec<u64> = sequence_hashes(&tokens, bs, seed).iter().map(|h| h.0).collect();
    let expected_seq = u64s(&case["sequence_hashes"]);
    assert_eq!(seq, expected_seq, "{name}: sequence hashes");
    let mut h = SequenceHasher::new(bs, seed);
    let mut inc = Vec::new();
    for t in &tokens {
        h.push(std::slice::from_ref(t), &mut inc);
    }
    assert_eq!(inc.iter().map(|s| s.0).collect::<Vec<_>>(), expected_seq, "{name}: incremental");
    expected_seq.len()
}

#[test]
fn dynamo_xxh3_vectors() {
    let v = load("dynamo-xxh3.json");
    let cases = v["cases"].as_array().unwrap();
    assert!(cases.len() >= 17, "expected the full vector set, got {}", cases.len());
    let blocks: usize = cases.iter().map(check_dynamo_case).sum();
    assert!(blocks > 300, "vectors cover {blocks} blocks");
}

#[test]
fn dynamo_xxh3_lora_and_salt_vectors() {
    let v = load("dynamo-xxh3-lora-salt.json");
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 14);
    for c in cases {
        check_dynamo_case(c);
    }
}

/// Real blocks captured from vLLM 0.32 (inst1) and synthetic vLLM requests:
/// our hash of each block's tokens (over the request's full prefix) must equal
/// the Dynamo columns recorded next to vLLM's own hash.
#[test]
fn vllm_linked_vectors() {
    let v = load("vllm-sha256-cbor.json");
    let mut checked = 0;
    for r in v["real_inst1"].as_array().unwrap() {
        let bs = BlockSize::new(r["block_size"].as_u64().unwrap() as u32).unwrap();
        let prompt = u32s(&r["request"]["prompt_token_ids"]);
        let all = sequence_hashes(&prompt, bs, BlockSeed::BASE);
        let first = r["prefix_tokens_before_event"].as_u64().unwrap() as usize / bs.as_usize();
        for (i, b) in r["blocks"].as_array().unwrap().iter().enumerate() {
            let tokens = u32s(&b["tokens"]);
            let start = (first + i) * bs.as_usize();
            assert_eq!(&prompt[start..start + bs.as_usize()], &tokens[..], "block tokens");
            let local = local_block_hashes(&tokens, bs, BlockSeed::BASE).next().unwrap();
            assert_eq!(local.0.to_string(), b["dynamo_local_hash"].as_str().unwrap());
            assert_eq!(all[first + i].0.to_string(), b["dynamo_sequence_hash"].as_str().unwrap());
            checked += 1;
        }
    }
    for s in v["synthetic"].as_array().unwrap() {
        let bs = BlockSize::new(s["block_size"].as_u64().unwrap() as u32).unwrap();
        let seed = BlockSeed::new(s["lora_name"].as_str(), s["cache_salt"].as_str());
        assert_eq!(seed.get().to_string(), s["dynamo_block_seed"].as_str().unwrap());
        let tokens = u32s(&s["tokens"]);
        let seq = sequence_hashes(&tokens, bs, seed);
        let blocks = s["blocks"].as_array().unwrap();
        assert_eq!(seq.len(), blocks.len(), "{}", s["name"]);
        for (h, b) in seq.iter().zip(blocks) {
            assert_eq!(h.0.to_string(), b["dynamo_sequence_hash"].as_str().unwrap());
            checked += 1;
        }
    }
    assert!(checked >= 20, "checked {checked} blocks");
}

/// A new vector file must not be ignored silently: every JSON file in the
/// folder is one the tests above read.
#[test]
fn every_vector_file_is_covered() {
    let known = ["dynamo-xxh3.json", "dynamo-xxh3-lora-salt.json", "vllm-sha256-cbor.json"];
    for entry in std::fs::read_dir(shared_dir().join("vectors/block-hash")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".json") {
            assert!(known.contains(&name.as_str()), "vector file {name} is not tested");
        }
    }
}
