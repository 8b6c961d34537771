//! What the model-state tests share: a model's settings and a worker's
//! heartbeat, each with the defaults a test then overrides.
#![allow(dead_code, unreachable_pub)]

use kvgate_core::model::{ModelConfig, PickInput};
use kvgate_protocol::{BlockSeed, BlockSize, pb};
use kvgate_scheduler::{KvConfig, Mode};

/// Model `m`, block size 16, `mode`, a 1 s heartbeat timeout, session
/// affinity and overload protection off.
pub fn config(mode: Mode) -> ModelConfig {
    ModelConfig {
        name: "m".into(),
        block_size: BlockSize::new(16).unwrap(),
        mode,
        kv: KvConfig::default(),
        learn_timing: true,
        fading_load: false,
        default_output_tokens: 16,
        static_workers: Vec::new(),
        heartbeat_timeout_ms: 1000,
        inflight_ttl_ms: 600_000,
        suspect_after_failures: 2,
        suspect_ms: 3000,
        allowed_endpoints: Vec::new(),
        session: Default::default(),
        overload: None,
        disaggregation: Default::default(),
        index_shards: 1,
    }
}

/// A heartbeat of worker `wN` at `10.0.0.N:8000`, every 100 ms, engine up.
pub fn heartbeat(id: &str) -> pb::WorkerHeartbeat {
    pb::WorkerHeartbeat {
        worker_id: id.into(),
        model: "m".into(),
        endpoint: format!("10.0.0.{}:8000", &id[1..]),
        relay_epoch: 1,
        block_size: 16,
        interval_ms: 100,
        engine_ok: true,
        ..Default::default()
    }
}

/// Batch `relay_seq` of worker `id` (relay epoch 1): `tokens` stored as
/// blocks of 16 under engine hashes 1, 2, 3...
pub fn stored(id: &str, relay_seq: u64, tokens: &[u32]) -> pb::KvEventBatch {
    pb::KvEventBatch {
        worker_id: id.into(),
        model: "m".into(),
        relay_epoch: 1,
        relay_seq,
        events: vec![pb::KvEvent {
            event: Some(pb::kv_event::Event::Stored(pb::BlockStored {
                engine_hashes: (1..=(tokens.len() / 16) as u64).collect(),
                token_ids: tokens.to_vec(),
                block_size: 16,
                ..Default::default()
            })),
        }],
        ..Default::default()
    }
}

/// A Pick of `tokens` (no salt, LoRA, text prefix, subset or session),
/// scored by the model's mode.
pub fn input<'a>(request_id: &'a str, tokens: &'a [u32], max_tokens: Option<u32>) -> PickInput<'a> {
    PickInput {
        request_id,
        token_ids: tokens,
        seed: BlockSeed::default(),
        text_prefix: &[],
        max_tokens,
        by_load: None,
        allowed: None,
        session: "",
    }
}

/// Workers of [`batches`].
pub const WORKERS: u64 = 5;

/// Document `doc`'s first `blocks` blocks of tokens.
pub fn tokens(doc: u64, blocks: usize) -> Vec<u32> {
    (0..blocks * 16).map(|i| (doc as u32).wrapping_mul(7919).wrapping_add(i as u32 * 31) % 50_000).collect()
}

/// Batch `relay_seq` of worker `w{w}` (relay epoch 1).
pub fn batch(w: u64, relay_seq: u64, events: Vec<pb::kv_event::Event>) -> pb::KvEventBatch {
    pb::KvEventBatch {
        worker_id: format!("w{w}"),
        model: "m".into(),
        relay_epoch: 1,
        relay_seq,
        events: events.into_iter().map(|e| pb::KvEvent { event: Some(e) }).collect(),
        ..Default::default()
    }
}

/// Stores `hashes` (16-token blocks) under `parent`.
pub fn store(hashes: std::ops::Range<u64>, parent: Option<u64>, token_ids: Vec<u32>) -> pb::kv_event::Event {
    pb::kv_event::Event::Stored(pb::BlockStored {
        engine_hashes: hashes.collect(),
        parent_engine_hash: parent,
        token_ids,
        block_size: 16,
        ..Default::default()
    })
}

/// Removes `hashes`.
pub fn remove(hashes: std::ops::Range<u64>) -> pb::kv_event::Event {
    pb::kv_event::Event::Removed(pb::BlockRemoved { engine_hashes: hashes.collect(), ..Default::default() })
}

/// Rounds of batches from five workers: each stores a document (some
/// shared between workers), later removes part of it; one batch is sent
/// twice, one worker skips a sequence number, one stores under a parent it
/// never had.
pub fn batches() -> Vec<pb::KvEventBatch> {
    let mut out = Vec::new();
    let mut seq = [0u64; WORKERS as usize];
    for round in 0..6u64 {
        for k in 0..WORKERS {
            let w = (k * 3 + round) % WORKERS;
            let s = &mut seq[w as usize];
            *s += 1;
            if w == 2 && round == 3 {
                *s += 1; // a gap: the relay's batch before this one was lost
            }
            let base = 1000 * (round + 1) + 100 * w;
            let doc = if w.is_multiple_of(2) { round } else { 100 + round * WORKERS + w };
            let mut events = vec![store(base..base + 8, None, tokens(doc, 8))];
            if round > 0 {
                let old = 1000 * round + 100 * w;
                events.push(remove(old + 4..old + 8));
            }
            if w == 4 && round == 2 {
                events.push(store(base + 50..base + 52, Some(999_999), tokens(7, 2)));
            }
            out.push(batch(w, *s, events));
            if w == 1 && round == 1 {
                out.push(batch(w, *s, vec![store(base..base + 8, None, tokens(doc, 8))]));
            }
        }
    }
    out
}
