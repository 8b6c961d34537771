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
