//! Criterion: `ModelState::pick`, the whole decision of one request in the
//! model state (candidates for every live worker with their overlap, load
//! and learned timing, the `kv` ranking, in-flight bookkeeping), at 10, 100
//! and 1,000 workers.
//!
//! Every worker holds a 1,024-block private chain and one of ten 234-block
//! shared starters (a DOKS-like fleet); each measured request is a starter
//! plus ~100 new tokens, and each is reported finished right after, so the
//! in-flight table stays at its warm-up size (two requests per worker).
//!
//! `…w_cold_8mib`: the same Pick after the core's L2 cache was overwritten
//! (8 MiB written just before, not timed), as in the control plane, where
//! the ingest thread streams through the index between Picks: what a
//! Pick's working set costs when it comes from the shared L3.
//! `KVGATE_BENCH_EVICT_MIB=640` (more than the L3) makes it come from
//! memory (then `--sample-size 20 --measurement-time 10`: each eviction
//! takes ~30 ms).
//!
//! `replica_event/<n>w`: what another replica's decision costs this one
//! (its in-flight events applied: added with the prompt's hashes, first
//! token, done).
//!
//! `cargo bench -p kvgate-core --bench pick`

#[path = "../tests/common/mod.rs"]
mod common;

use criterion::{BatchSize, BenchmarkId, Criterion, criterion_group, criterion_main};
use kvgate_core::model::{ModelConfig, ModelState, PickInput};
use kvgate_protocol::{BlockSeed, pb};
use kvgate_scheduler::Mode;

const BS: usize = 16;

/// The tests' model settings: `kv`, and nothing expires during a run.
fn config() -> ModelConfig {
    ModelConfig {
        default_output_tokens: 256,
        heartbeat_timeout_ms: 3_600_000,
        inflight_ttl_ms: 3_600_000,
        ..common::config(Mode::Kv)
    }
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 100_000).collect()
}

fn stored(id: &str, seq: u64, first_hash: u64, tokens: &[u32]) -> pb::KvEventBatch {
    let n = (tokens.len() / BS) as u64;
    pb::KvEventBatch {
        worker_id: id.into(),
        model: "m".into(),
        relay_epoch: 1,
        relay_seq: seq,
        events: vec![pb::KvEvent {
            event: Some(pb::kv_event::Event::Stored(pb::BlockStored {
                engine_hashes: (first_hash..first_hash + n).collect(),
                token_ids: tokens.to_vec(),
                block_size: BS as u32,
                ..Default::default()
            })),
        }],
        ..Default::default()
    }
}

fn fleet(workers: usize, starters: &[Vec<u32>]) -> ModelState {
    let mut st = ModelState::new(config(), 7);
    for w in 0..workers {
        let id = format!("w{w}");
        let hb = pb::WorkerHeartbeat {
            worker_id: id.clone(),
            model: "m".into(),
            endpoint: format!("10.{}.{}.{}:8000", w / 65_536, (w / 256) % 256, w % 256),
            relay_epoch: 1,
            block_size: BS as u32,
            interval_ms: 1000,
            engine_ok: true,
            capacity_blocks: 40_000,
            ..Default::default()
        };
        st.on_heartbeat(&hb, 0);
        st.on_batch(stored(&id, 1, 1, &starters[w % starters.len()]), 0);
        st.on_batch(stored(&id, 2, 1_000_000, &tokens(1000 + w as u32, 1024 * BS)), 0);
    }
    st
}

fn request(starters: &[Vec<u32>], i: u64) -> Vec<u32> {
    let mut t = starters[(i % starters.len() as u64) as usize].clone();
    t.extend(tokens(0x5eed ^ i as u32, 100));
    t
}

fn bench(c: &mut Criterion) {
    let starters: Vec<Vec<u32>> = (0..10).map(|s| tokens(s, 234 * BS)).collect();
    let mut g = c.benchmark_group("model_pick");
    for workers in [10usize, 100, 1000] {
        let mut st = fleet(workers, &starters);
        // Two requests in flight per worker.
        for i in 0..2 * workers as u64 {
            let t = request(&starters, i);
            let id = format!("warm-{i}");
            let _ = st.pick(&input(&id, &t), 1);
        }
        let mut i = 0u64;
        g.bench_function(BenchmarkId::from_parameter(format!("{workers}w")), |b| {
            b.iter(|| {
                i += 1;
                one(&mut st, &starters, i)
            });
        });
        if workers >= 100 {
            let mib = std::env::var("KVGATE_BENCH_EVICT_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(8usize);
            let mut evict = vec![0u8; mib << 20];
            g.bench_function(BenchmarkId::from_parameter(format!("{workers}w_cold_{mib}mib")), |b| {
                b.iter_batched(
                    || {
                        i += 1;
                        for (k, line) in evict.chunks_mut(64).enumerate() {
                            line[0] = line[0].wrapping_add(k as u8);
                        }
                        std::hint::black_box(&evict);
                        i
                    },
                    |i| one(&mut st, &starters, i),
                    BatchSize::PerIteration,
                );
            });
        }
    }
    g.finish();
    replica_events(c, &starters);
}

/// `replica_event/<n>w`: what another replica's decision costs this one,
/// the in-flight events of one request (added with its prompt's hashes as
/// shared, first token, done) applied to a replica that did not route it.
/// The events come from decisions made on a twin of the fleet; each
/// request is done by the end of its iteration, so the tracker stays at
/// its warm-up size (two requests per worker).
fn replica_events(c: &mut Criterion, starters: &[Vec<u32>]) {
    let mut g = c.benchmark_group("replica_event");
    for workers in [100usize, 1000] {
        let mut origin = fleet(workers, starters);
        let mut peer = fleet(workers, starters);
        origin.set_share_with_replicas(true);
        for i in 0..2 * workers as u64 {
            let t = request(starters, i);
            let id = format!("warm-{i}");
            if let Ok(o) = origin.pick(&input(&id, &t), 1) {
                peer.on_replica_event(&o.inflight, 1);
            }
        }
        // One request's events, for a pool of requests (ids made unique
        // per iteration below).
        let pool: Vec<Vec<pb::InflightEvent>> = (0..64u64)
            .filter_map(|i| {
                let t = request(starters, 1_000_000 + i);
                let id = format!("pool-{i}");
                let o = origin.pick(&input(&id, &t), 1).ok()?;
                let done = pb::CompletionReport {
                    request_id: id.clone(),
                    worker_id: o.worker_id.clone(),
                    model: "m".into(),
                    total_us: 1,
                    ..Default::default()
                };
                let mut evs = vec![o.inflight];
                evs.extend(origin.on_report(&done, 2));
                Some(evs)
            })
            .collect();
        // The events are applied, not ignored: the added one is in flight
        // at the peer until its done event.
        let before = (peer.inflight(), peer.counters().replica_events);
        if let Some(evs) = pool.first() {
            peer.on_replica_event(&evs[0], 2);
            assert_eq!(peer.inflight(), before.0 + 1, "the peer took the added event");
            for ev in &evs[1..] {
                peer.on_replica_event(ev, 2);
            }
            assert_eq!(peer.inflight(), before.0);
            assert_eq!(peer.counters().replica_events, before.1 + evs.len() as u64, "every event applied");
            assert!(evs[0].block_hashes.len() > 200, "the added event carries the prompt's hashes");
        }
        let mut i = 0usize;
        g.bench_function(BenchmarkId::from_parameter(format!("{workers}w")), |b| {
            b.iter(|| {
                i += 1;
                let Some(evs) = pool.get(i % pool.len()) else { return };
                for ev in evs {
                    peer.on_replica_event(ev, 2);
                }
            });
        });
    }
    g.finish();
}

/// The `i`-th measured Pick, reported finished at once.
fn one(st: &mut ModelState, starters: &[Vec<u32>], i: u64) -> u32 {
    let t = request(starters, i);
    let id = format!("r{i}");
    let out = st.pick(&input(&id, &t), 2);
    let done = pb::CompletionReport { request_id: id, model: "m".into(), total_us: 1, ..Default::default() };
    st.on_report(&done, 2);
    out.map(|o| o.matched_blocks).unwrap_or(0)
}

fn input<'a>(request_id: &'a str, tokens: &'a [u32]) -> PickInput<'a> {
    PickInput {
        request_id,
        token_ids: tokens,
        seed: BlockSeed::default(),
        text_prefix: &[],
        max_tokens: Some(256),
        by_load: None,
        allowed: None,
        session: "",
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
