//! How long applying one worker's snapshot holds the model's lock and the
//! index's write lock, in process: W workers each holding 40K blocks of 16
//! tokens (chains of 64), then five workers' snapshots of 40K new blocks,
//! applied in pieces of PIECE blocks (`PIECE=100000000`: whole, as before
//! pieces). `distinct`: every worker holds its own blocks; `shared`: every
//! worker holds the same blocks (each block's worker set has W members).
//!
//! ```text
//! cargo run --release -p kvgate-core --example snapshot_holds -- 1000 distinct
//! PIECE=100000000 cargo run --release -p kvgate-core --example snapshot_holds -- 1000 shared
//! ```

use std::time::Instant;

use kvgate_core::model::snapshot::{PIECE_BLOCKS, Piece};
use kvgate_core::model::{ModelConfig, ModelState};
use kvgate_protocol::{BlockSize, pb};
use kvgate_scheduler::{KvConfig, Mode};

const BLOCKS: usize = 40_000;

fn config() -> ModelConfig {
    ModelConfig {
        name: "m".into(),
        block_size: BlockSize::new(16).expect("16 is a block size"),
        mode: Mode::Kv,
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

/// Worker `w`'s snapshot number `round`: 40K blocks in chains of 64, in
/// chunks of 4,096.
fn chunks(w: usize, round: u64, shared: bool) -> Vec<pb::SnapshotChunk> {
    let own = if shared { 0 } else { (w as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03) };
    let mut x = (round.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ own) | 1;
    let blocks: Vec<pb::SnapshotBlock> = (0..BLOCKS)
        .map(|b| {
            let h = (w as u64) << 40 | round << 32 | b as u64;
            let token_ids = (0..16)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 120_000) as u32
                })
                .collect();
            let parent_engine_hash = (b % 64 != 0).then(|| h - 1);
            pb::SnapshotBlock { engine_hash: h, parent_engine_hash, token_ids, ref_count: 1, ..Default::default() }
        })
        .collect();
    let count = BLOCKS.div_ceil(4096) as u32;
    blocks
        .chunks(4096)
        .enumerate()
        .map(|(i, c)| pb::SnapshotChunk {
            worker_id: format!("w{w}"),
            model: "m".into(),
            relay_epoch: 1,
            block_size: 16,
            chunk_index: i as u32,
            chunk_count: count,
            blocks: c.to_vec(),
            ..Default::default()
        })
        .collect()
}

fn main() {
    let workers: usize = std::env::args().nth(1).and_then(|v| v.parse().ok()).unwrap_or(100);
    let shared = std::env::args().nth(2).as_deref() == Some("shared");
    let piece: usize = std::env::var("PIECE").ok().and_then(|v| v.parse().ok()).unwrap_or(PIECE_BLOCKS);
    let mut st = ModelState::new(config(), 1);
    for w in 0..workers {
        let hb = pb::WorkerHeartbeat {
            worker_id: format!("w{w}"),
            model: "m".into(),
            endpoint: format!("10.0.{}.{}:8000", w / 250, w % 250),
            relay_epoch: 1,
            block_size: 16,
            interval_ms: 100,
            engine_ok: true,
            capacity_blocks: 50_000,
            ..Default::default()
        };
        st.on_heartbeat(&hb, 0);
        st.on_snapshot(&format!("w{w}"), &chunks(w, 0, shared), 0);
    }
    let (mut totals, mut holds) = (Vec::new(), Vec::new());
    for round in 1..=5u64 {
        let w = (round as usize * 7) % workers;
        let c = chunks(w, round, shared);
        let start = Instant::now();
        let Some(mut p) = st.begin_snapshot(&format!("w{w}"), &c, 0) else { return };
        loop {
            let hold = Instant::now();
            let piece = st.snapshot_piece(&mut p, &c, piece);
            holds.push(hold.elapsed().as_secs_f64() * 1e3);
            if piece != Piece::More {
                break;
            }
        }
        st.finish_snapshot(p, 0);
        totals.push((start.elapsed().as_secs_f64() * 10e3).round() / 10.0);
    }
    holds.sort_by(f64::total_cmp);
    let q = |f: f64| holds.get(((holds.len() - 1) as f64 * f) as usize).copied().unwrap_or(0.0);
    println!(
        "{} {workers} workers x 40K blocks, pieces of {piece}: per snapshot {totals:?} ms; {} holds: p50 {:.3}, p99 {:.3}, max {:.3} ms",
        if shared { "shared" } else { "distinct" },
        holds.len(),
        q(0.5),
        q(0.99),
        q(1.0)
    );
}
