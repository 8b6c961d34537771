//! Hot paths of routing, for 8K- and 100K-token prompts (block size 16) at
//! 10 / 100 / 1,000 workers:
//!
//! * `ingest`: one `BlockStored` of the whole prompt (hashing included) and
//!   its `BlockRemoved`, applied to a populated index;
//! * `lookup`: `find_matches` of the prompt;
//! * `pick`: the control plane's whole decision from token ids: sequence
//!   hashes, `find_matches`, candidates with their load, `kv` policy;
//! * `inflight`: the load tracker's `added` and `done` of one request whose
//!   prompt is in flight on every worker already (a shared system prompt on
//!   a busy fleet: each of its blocks has a holder per worker);
//! * `inflight_shares`: what each worker's requests in flight share with
//!   that prompt, on the same busy fleet.
//! * `inflight_crowd`: the load tracker alone with many requests in flight
//!   per worker, all on one shared system prompt (234 blocks, as
//!   bench-scale's DOKS mix) and each with 16 blocks of its own, one in
//!   twenty still prefilling: `shares` of
//!   a new such prompt, and `add_done` of one more request. `100w_x40` is
//!   bench-scale's 2,000 Picks/s × 2 s; `100w_x200` a fleet whose requests
//!   last ten times as long; `1000w_x64` a fleet of 1,000 engines each
//!   running 64 requests.
//!
//! Index state: 20 "documents" as long as the prompt; every worker holds one
//! of them up to a random length (so ~N/20 workers share each document at
//! different depths), and the prompt is a full document.
//! `cargo bench -p kvgate-scheduler --bench routing` (or `make bench-routing`).

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvgate_index::{Index, IndexConfig, KvEvent, Origin, Overlap, Stored, Tier, WorkerIdx};
use kvgate_protocol::{BlockSeed, BlockSize, sequence_hashes};
use kvgate_scheduler::{Candidate, KvPolicy, LoadTracker, Measured, Policy, RequestView};

const BS: u32 = 16;
const DOCS: usize = 20;

struct Fixture {
    index: Index,
    workers: Vec<WorkerIdx>,
    prompt: Vec<u32>,
    tracker: LoadTracker,
}

fn doc_tokens(doc: usize, len: usize) -> Vec<u32> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ doc as u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 129_280) as u32
        })
        .collect()
}

fn fixture(tokens: usize, workers: usize) -> Fixture {
    let bs = BlockSize::new(BS).unwrap();
    let mut index = Index::new(IndexConfig::new(bs));
    let docs: Vec<Vec<u32>> = (0..DOCS).map(|d| doc_tokens(d, tokens)).collect();
    let mut rng = fastrand::Rng::with_seed(7);
    let mut tracker = LoadTracker::new();
    let ids: Vec<WorkerIdx> =
        (0..workers).map(|w| index.add_worker(&format!("10.0.{}.{}:8000", w / 250, w % 250))).collect();
    for (i, w) in ids.iter().enumerate() {
        let doc = &docs[i % DOCS];
        let blocks = rng.usize(1..=tokens / BS as usize);
        let toks = &doc[..blocks * BS as usize];
        let hashes: Vec<u64> = sequence_hashes(toks, bs, BlockSeed::BASE).iter().map(|s| s.0 ^ i as u64).collect();
        let ev = KvEvent::Stored(Stored {
            engine_hashes: &hashes,
            parent: None,
            token_ids: toks,
            block_size: BS,
            seed: BlockSeed::BASE,
            tier: Tier::Device,
            origin: Origin::New,
        });
        index.apply(*w, &ev).unwrap();
        tracker.measured(
            *w,
            Measured {
                running: rng.u32(0..40),
                waiting: 0,
                kv_usage: rng.f32(),
                capacity_blocks: 100_000,
                max_num_seqs: 64,
            },
        );
    }
    Fixture { index, workers: ids, prompt: docs[0].clone(), tracker }
}

fn routing(c: &mut Criterion) {
    let bs = BlockSize::new(BS).unwrap();
    for tokens in [8_192usize, 100_000] {
        for workers in [10usize, 100, 1_000] {
            let mut f = fixture(tokens, workers);
            let label = format!("{}k_tokens/{workers}_workers", tokens / 1000);
            let blocks = (tokens / BS as usize) as u64;

            let mut g = c.benchmark_group("ingest");
            g.throughput(Throughput::Elements(blocks));
            g.sample_size(20);
            let hashes: Vec<u64> = (0..blocks).map(|b| 0xABCD_0000_0000 + b).collect();
            let toks = f.prompt[..blocks as usize * BS as usize].to_vec();
            let w = f.workers[1 % f.workers.len()];
            g.bench_function(BenchmarkId::from_parameter(&label), |b| {
                b.iter(|| {
                    let ev = KvEvent::Stored(Stored {
                        engine_hashes: &hashes,
                        parent: None,
                        token_ids: &toks,
                        block_size: BS,
                        seed: BlockSeed::BASE,
                        tier: Tier::Device,
                        origin: Origin::New,
                    });
                    f.index.apply(w, &ev).unwrap();
                    f.index.apply(w, &KvEvent::Removed { engine_hashes: &hashes, tier: Tier::Device }).unwrap();
                })
            });
            g.finish();

            let seqs = sequence_hashes(&f.prompt, bs, BlockSeed::BASE);
            let mut out: Vec<Overlap> = Vec::new();
            let mut g = c.benchmark_group("lookup");
            g.sample_size(30);
            g.bench_function(BenchmarkId::from_parameter(&label), |b| {
                b.iter(|| {
                    f.index.find_matches(black_box(&seqs), Tier::Device, &mut out);
                    black_box(out.len())
                })
            });
            g.finish();

            let mut g = c.benchmark_group("inflight");
            g.sample_size(20);
            let mut busy = LoadTracker::new();
            for (i, w) in f.workers.iter().enumerate() {
                busy.added(&format!("r{i}"), *w, &seqs, 0, 16, 0).unwrap();
            }
            let last = *f.workers.last().unwrap();
            g.bench_function(BenchmarkId::from_parameter(&label), |b| {
                b.iter(|| {
                    busy.added("new", last, black_box(&seqs), 0, 16, 1).unwrap();
                    busy.done("new").unwrap();
                })
            });
            g.finish();
            let mut g = c.benchmark_group("inflight_shares");
            g.sample_size(20);
            g.bench_function(BenchmarkId::from_parameter(&label), |b| {
                b.iter(|| busy.inflight_shares(black_box(&seqs)).len())
            });
            g.finish();

            let mut policy = KvPolicy::default();
            let mut rng = fastrand::Rng::with_seed(9);
            let mut g = c.benchmark_group("pick");
            g.sample_size(30);
            g.bench_function(BenchmarkId::from_parameter(&label), |b| {
                b.iter(|| {
                    let seqs = sequence_hashes(black_box(&f.prompt), bs, BlockSeed::BASE);
                    f.index.find_matches(&seqs, Tier::Device, &mut out);
                    // What each worker's requests in flight share, in one walk (as the core does).
                    let shares = f.tracker.inflight_shares(&seqs);
                    let share = |w: &WorkerIdx| shares.get(w.0 as usize).copied().unwrap_or_default();
                    let mut cands: Vec<Candidate> = f
                        .workers
                        .iter()
                        .map(|w| Candidate {
                            worker: *w,
                            overlap_blocks: 0,
                            overlap_any_tier_blocks: 0,
                            inflight_overlap_blocks: share(w).blocks,
                            inflight_computing_blocks: share(w).computing,
                            load: f.tracker.load(*w),
                            timing: None,
                            decode_running: None,
                            excluded: false,
                        })
                        .collect();
                    for o in &out {
                        if let Some(c) = cands.get_mut(o.worker.0 as usize) {
                            c.overlap_blocks = o.blocks;
                            c.overlap_any_tier_blocks = o.blocks;
                        }
                    }
                    let req = RequestView {
                        prompt_blocks: seqs.len() as u32,
                        expected_output_tokens: 800,
                        block_size: BS,
                        text_prefix: &[],
                    };
                    black_box(policy.pick(&req, &cands, &mut rng))
                })
            });
            g.finish();
        }
    }
}

/// The tracker with `per` requests in flight on each of `workers`, all on
/// one shared 234-block prefix, each with 16 blocks of its own.
fn crowd(c: &mut Criterion) {
    use kvgate_protocol::SequenceHash;
    let prompt = |id: u64| -> Vec<SequenceHash> {
        (0..234u64).map(SequenceHash).chain((0..16u64).map(|i| SequenceHash((id + 1) << 32 | i))).collect()
    };
    for (workers, per) in [(100u32, 40u64), (100, 200), (1_000, 4), (1_000, 64)] {
        let mut t = LoadTracker::new();
        let mut rng = fastrand::Rng::with_seed(3);
        for r in 0..u64::from(workers) * per {
            let w = WorkerIdx(rng.u32(0..workers));
            t.added(&format!("r{r}"), w, &prompt(r), 0, 16, 0).unwrap();
            // One in twenty still prefilling, the rest decoding.
            if r % 20 != 0 {
                t.first_token(&format!("r{r}")).unwrap();
            }
        }
        let label = format!("{workers}w_x{per}");
        let fresh = prompt(u64::MAX >> 33);
        let mut g = c.benchmark_group("inflight_crowd");
        g.sample_size(30);
        g.bench_function(BenchmarkId::new("shares", &label), |b| b.iter(|| t.inflight_shares(black_box(&fresh)).len()));
        g.bench_function(BenchmarkId::new("add_done", &label), |b| {
            b.iter(|| {
                t.added("new", WorkerIdx(workers / 2), black_box(&fresh), 0, 16, 1).unwrap();
                t.done("new").unwrap();
            })
        });
        g.finish();
    }
}

criterion_group!(benches, routing, crowd);
criterion_main!(benches);
