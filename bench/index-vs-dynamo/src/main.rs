//! `make bench-index`: one KV event trace replayed into kvgate's index and
//! into Dynamo's (crates.io `dynamo-kv-router` 1.6.1: `ThreadPoolIndexer`
//! over `ConcurrentRadixTreeCompressed`, as Dynamo's indexer service builds
//! it), on the same machine in the same run.
//!
//! Trace: `../shared/traces/mooncake/conversation_trace.jsonl`. Each request's
//! 512-token hash ids are expanded into deterministic tokens and cut into
//! blocks of the model's block size. Requests are assigned to N workers
//! (seeded random). A capacity-bounded LRU per worker turns them into
//! `Stored` events (the blocks the worker did not hold) and `Removed` events
//! (LRU evictions, leaf first, as vLLM evicts).
//!
//! kvgate's index runs with as many shards as Dynamo has index threads
//! (`--shards`, default 2), fed `Index::apply_batch` batches of `--batch`
//! events (default 1,024); the same trace is also replayed into a one-shard
//! index (events applied one by one, the layout before shards) in every
//! round, and reported beside as `ours_one_shard`.
//!
//! Measured:
//! * ingest: block operations (stored + removed blocks) per second, hashing
//!   included on both sides (kvgate hashes event tokens inside `apply`;
//!   Dynamo's event conversion computes `LocalBlockHash`es before
//!   `apply_event`, so that is timed too), until the index has applied all;
//! * lookup: `find_matches` latency for real request prefixes, p50/p99, with
//!   the two indexes queried alternately (A/B interleaved) on the final state;
//! * memory: bytes allocated and still live after ingest (counting global
//!   allocator), divided by the resident (block, worker) pairs;
//! * agreement: for every lookup, both must report the same overlap per
//!   worker (else the comparison would be meaningless).
//!
//! `--only-kvgate N` is a profiling aid: it replays only kvgate's one-shard
//! ingest N times (for `perf` or `valgrind`), then once more with every
//! event timed (stores against removals) and the stored blocks hashed alone,
//! and writes no result.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use dynamo_kv_router::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::indexer::{KvIndexerInterface, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, compute_block_hash_for_seq,
};
use kvgate_index::{Index, IndexConfig, KvEvent, Origin, Stored, Tier};
use kvgate_protocol::{BlockSeed, BlockSize, SequenceHash, sequence_hashes};

struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: delegates to the system allocator and only counts sizes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        LIVE.fetch_add(n as isize - l.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// CPU seconds used by this process so far (all threads), from /proc.
fn cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    ticks / 100.0
}

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

struct Args {
    trace: String,
    workers: u32,
    block_size: u32,
    capacity: usize,
    requests: usize,
    lookups: usize,
    /// Dynamo's index threads.
    threads: usize,
    /// kvgate's index shards (threads of `apply_batch`).
    shards: u16,
    /// Events per `apply_batch`.
    batch: usize,
    repeats: usize,
    out: String,
    /// Profiling aid: only replay kvgate's one-shard ingest this many
    /// times, print its times and write no result.
    only_kvgate: usize,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        trace: "../shared/traces/mooncake/conversation_trace.jsonl".into(),
        workers: 16,
        block_size: 16,
        capacity: 32_768,
        requests: usize::MAX,
        lookups: 2_000,
        threads: 2,
        shards: 2,
        batch: 1024,
        repeats: 5,
        out: "bench/results/index-vs-dynamo.json".into(),
        only_kvgate: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().with_context(|| format!("{k} needs a value"))?;
        match k.as_str() {
            "--trace" => a.trace = v,
            "--workers" => a.workers = v.parse()?,
            "--block-size" => a.block_size = v.parse()?,
            "--capacity" => a.capacity = v.parse()?,
            "--requests" => a.requests = v.parse()?,
            "--lookups" => a.lookups = v.parse()?,
            "--threads" => a.threads = v.parse()?,
            "--shards" => a.shards = v.parse::<u16>()?.max(1),
            "--batch" => a.batch = v.parse::<usize>()?.max(1),
            "--repeats" => a.repeats = v.parse::<usize>()?.max(1),
            "--out" => a.out = v,
            "--only-kvgate" => a.only_kvgate = v.parse()?,
            _ => bail!("unknown flag {k}"),
        }
    }
    Ok(a)
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Tokens of one request: 512 deterministic tokens per hash id, cut to the
/// input length and to full blocks.
fn request_tokens(hash_ids: &[u64], input_len: usize, bs: usize) -> Vec<u32> {
    let mut t = Vec::with_capacity(hash_ids.len() * 512);
    for h in hash_ids {
        for j in 0..512u64 {
            t.push((splitmix(h.wrapping_mul(1_000_003) ^ j) % 129_280) as u32);
        }
    }
    t.truncate(input_len.min(t.len()));
    t.truncate(t.len() / bs * bs);
    t
}

enum Op {
    Store { worker: u32, parent: Option<u64>, hashes: Vec<u64>, tokens: Vec<u32> },
    Remove { worker: u32, hashes: Vec<u64> },
}

struct Lru {
    stamp: HashMap<u64, u64>,
    heap: BinaryHeap<std::cmp::Reverse<(u64, u64)>>,
    clock: u64,
}

impl Lru {
    fn new() -> Self {
        Self { stamp: HashMap::new(), heap: BinaryHeap::new(), clock: 0 }
    }
    fn touch(&mut self, h: u64) {
        self.clock += 1;
        self.stamp.insert(h, self.clock);
        self.heap.push(std::cmp::Reverse((self.clock, h)));
    }
    fn evict(&mut self) -> Option<u64> {
        while let Some(std::cmp::Reverse((s, h))) = self.heap.pop() {
            if self.stamp.get(&h) == Some(&s) {
                self.stamp.remove(&h);
                return Some(h);
            }
        }
        None
    }
}

struct Trace {
    ops: Vec<Op>,
    lookups: Vec<Vec<u32>>,
    stored_blocks: u64,
    removed_blocks: u64,
    requests: usize,
}

fn build_trace(a: &Args) -> Result<Trace> {
    let text = std::fs::read_to_string(&a.trace).with_context(|| format!("reading {}", a.trace))?;
    let bs = BlockSize::new(a.block_size)?;
    let mut lrus: Vec<Lru> = (0..a.workers).map(|_| Lru::new()).collect();
    let mut ops = Vec::new();
    let mut lookups = Vec::new();
    let (mut stored, mut removed, mut n) = (0u64, 0u64, 0usize);
    let every = 1.max(text.lines().count().min(a.requests) / a.lookups.max(1));
    for (i, line) in text.lines().enumerate().take(a.requests) {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let ids: Vec<u64> = v["hash_ids"].as_array().context("hash_ids")?.iter().filter_map(|x| x.as_u64()).collect();
        let len = v["input_length"].as_u64().context("input_length")? as usize;
        let tokens = request_tokens(&ids, len, bs.as_usize());
        if tokens.is_empty() {
            continue;
        }
        n += 1;
        if i % every == 0 {
            lookups.push(tokens.clone());
        }
        let worker = (splitmix(i as u64 ^ 0xC0FFEE) % u64::from(a.workers)) as u32;
        let seqs: Vec<u64> = sequence_hashes(&tokens, bs, BlockSeed::BASE).iter().map(|s| s.0).collect();
        let lru = &mut lrus[worker as usize];
        let first_new = seqs.iter().position(|h| !lru.stamp.contains_key(h)).unwrap_or(seqs.len());
        if first_new < seqs.len() {
            let parent = first_new.checked_sub(1).map(|p| seqs[p]);
            let hashes = seqs[first_new..].to_vec();
            stored += hashes.len() as u64;
            ops.push(Op::Store { worker, parent, hashes, tokens: tokens[first_new * bs.as_usize()..].to_vec() });
        }
        // Children first, so that parents are more recent and evicted last.
        for h in seqs.iter().rev() {
            lru.touch(*h);
        }
        let mut evicted = Vec::new();
        while lru.stamp.len() > a.capacity {
            match lru.evict() {
                Some(h) => evicted.push(h),
                None => break,
            }
        }
        if !evicted.is_empty() {
            removed += evicted.len() as u64;
            ops.push(Op::Remove { worker, hashes: evicted });
        }
    }
    Ok(Trace { ops, lookups, stored_blocks: stored, removed_blocks: removed, requests: n })
}


/// One trace operation as kvgate's event.
fn to_event<'t>(op: &'t Op, idx: &[kvgate_index::WorkerIdx], block_size: u32) -> (kvgate_index::WorkerIdx, KvEvent<'t>) {
    match op {
        Op::Store { worker, parent, hashes, tokens } => (idx[*worker as usize], KvEvent::Stored(Stored {
            engine_hashes: hashes, parent: *parent, token_ids: tokens, block_size,
            seed: BlockSeed::BASE, tier: Tier::Device, origin: Origin::Unspecified,
        })),
        Op::Remove { worker, hashes } => (idx[*worker as usize], KvEvent::Removed { engine_hashes: hashes, tier: Tier::Device }),
    }
}

/// Replays the trace into a fresh kvgate index of `shards` shards, in
/// batches of `a.batch` events (`Index::apply_batch`; one shard applies them
/// one by one): (index, workers, wall s, CPU s, bytes allocated and still
/// live). With `timed` (one shard only), every event is timed and the
/// seconds of stores and of removals are added to it.
fn ingest_ours<'t>(
    trace: &'t Trace,
    a: &Args,
    names: &[String],
    shards: u16,
    mut timed: Option<&mut (f64, f64)>,
) -> Result<(Index, Vec<kvgate_index::WorkerIdx>, f64, f64, f64)> {
    let bs = BlockSize::new(a.block_size)?;
    let before = live();
    let mut ours = Index::new(IndexConfig { shards, ..IndexConfig::new(bs) });
    let idx: Vec<_> = names.iter().map(|n| ours.add_worker(n)).collect();
    let block_size = a.block_size;
    let event = |op: &'t Op| -> (kvgate_index::WorkerIdx, KvEvent<'t>) { to_event(op, &idx, block_size) };
    let mut batch = Vec::with_capacity(a.batch);
    let t = Instant::now();
    let c0 = cpu_s();
    if shards <= 1 {
        for op in &trace.ops {
            let (w, ev) = event(op);
            let t = timed.is_some().then(Instant::now);
            ours.apply(w, &ev).map_err(|e| anyhow::anyhow!("kvgate skipped an event: {e}"))?;
            if let (Some(t), Some((st, rm))) = (t, timed.as_deref_mut()) {
                match op {
                    Op::Store { .. } => *st += t.elapsed().as_secs_f64(),
                    Op::Remove { .. } => *rm += t.elapsed().as_secs_f64(),
                }
            }
        }
    } else {
        for ops in trace.ops.chunks(a.batch.max(1)) {
            batch.clear();
            batch.extend(ops.iter().map(event));
            if let Some(e) = ours.apply_batch(&batch).into_iter().find_map(Result::err) {
                bail!("kvgate skipped an event: {e}");
            }
        }
    }
    let s = t.elapsed().as_secs_f64();
    let cpu = cpu_s() - c0;
    drop(batch);
    Ok((ours, idx, s, cpu, (live() - before) as f64))
}

/// Replays the trace into a fresh Dynamo indexer: (indexer, wall s, CPU s,
/// bytes allocated and still live).
fn ingest_dynamo(
    rt: &tokio::runtime::Runtime,
    trace: &Trace,
    a: &Args,
) -> Result<(ThreadPoolIndexer<ConcurrentRadixTreeCompressed>, f64, f64, f64)> {
    let before = live();
    let dynamo = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), a.threads, a.block_size);
    let t = Instant::now();
    let c0 = cpu_s();
    rt.block_on(async {
        for (i, op) in trace.ops.iter().enumerate() {
            let (worker, data) = match op {
                Op::Store { worker, parent, hashes, tokens } => {
                    let local = compute_block_hash_for_seq(tokens, a.block_size, BlockHashOptions::default());
                    let blocks = local
                        .into_iter()
                        .zip(hashes)
                        .map(|(tokens_hash, h)| KvCacheStoredBlockData {
                            block_hash: ExternalSequenceBlockHash(*h), tokens_hash, mm_extra_info: None,
                        })
                        .collect();
                    (*worker, KvCacheEventData::Stored(KvCacheStoreData {
                        parent_hash: parent.map(ExternalSequenceBlockHash), start_position: None, blocks,
                    }))
                }
                Op::Remove { worker, hashes } => (*worker, KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: hashes.iter().map(|h| ExternalSequenceBlockHash(*h)).collect(),
                })),
            };
            dynamo.apply_event(RouterEvent::new(u64::from(worker), KvCacheEvent { event_id: i as u64, data, dp_rank: 0 })).await;
        }
        dynamo.flush_and_wait().await
    })
    .map_err(|e| anyhow::anyhow!("dynamo flush: {e:?}"))?;
    let s = t.elapsed().as_secs_f64();
    let cpu = cpu_s() - c0;
    Ok((dynamo, s, cpu, (live() - before) as f64))
}

/// The last round's indexes, kept for memory and lookups: kvgate's index,
/// its workers and live bytes, Dynamo's indexer and its live bytes.
type Kept = (Index, Vec<kvgate_index::WorkerIdx>, f64, ThreadPoolIndexer<ConcurrentRadixTreeCompressed>, f64);

/// One replay's line on stderr: wall seconds, CPU seconds, live bytes.
fn ingest_line(round: usize, what: &str, s: f64, cpu: f64, bytes: f64) {
    eprintln!("round {round}: {what} ingest {s:.3} s ({cpu:.2} CPU-s), {:.1} MB live", bytes / 1e6);
}

fn main() -> Result<()> {
    let a = parse_args()?;
    let bs = BlockSize::new(a.block_size)?;
    eprintln!("building trace from {} ({} workers, block size {}, capacity {} blocks/worker)", a.trace, a.workers, a.block_size, a.capacity);
    let trace = build_trace(&a)?;
    let block_ops = trace.stored_blocks + trace.removed_blocks;
    eprintln!("{} requests -> {} events, {} stored + {} removed blocks; {} lookups", trace.requests, trace.ops.len(), trace.stored_blocks, trace.removed_blocks, trace.lookups.len());

    // ---- ingest, A/B alternated `repeats` times (Dynamo's two index
    // threads make its wall time vary run to run); the medians are reported,
    // and the last pair of indexes is kept for memory and lookups ----
    let names: Vec<String> = (0..a.workers).map(|w| format!("worker-{w}")).collect();
    if a.only_kvgate > 0 {
        for round in 0..a.only_kvgate {
            let (_, _, s, cpu, bytes) = ingest_ours(&trace, &a, &names, 1, None)?;
            ingest_line(round, "kvgate one shard", s, cpu, bytes);
        }
        // The same replay with each event timed: stores against removals.
        let mut timed = (0f64, 0f64);
        ingest_ours(&trace, &a, &names, 1, Some(&mut timed))?;
        let (st, rm) = timed;
        let t = Instant::now();
        let mut sink = 0u64;
        for op in &trace.ops {
            if let Op::Store { tokens, .. } = op {
                sink ^= sequence_hashes(tokens, bs, BlockSeed::BASE).last().map_or(0, |h| h.0);
            }
        }
        eprintln!("hashing the stored blocks alone: {:.1} ns/block ({sink:x})", t.elapsed().as_secs_f64() * 1e9 / trace.stored_blocks as f64);
        eprintln!("timed: stores {st:.3} s ({:.1} ns/block), removals {rm:.3} s ({:.1} ns/block)", st * 1e9 / trace.stored_blocks as f64, rm * 1e9 / trace.removed_blocks as f64);
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let mut ours_runs: Vec<(f64, f64)> = Vec::new();
    let mut one_runs: Vec<(f64, f64, f64)> = Vec::new();
    // The last one-shard index, for lookups beside the sharded one.
    let mut kept_one: Option<Index> = None;
    let mut dyn_runs: Vec<(f64, f64)> = Vec::new();
    let mut kept: Option<Kept> = None;
    for round in 0..a.repeats {
        kept_one = None;
        if let Some((o, _, _, d, _)) = kept.take() {
            drop(o);
            d.shutdown();
            drop(d);
        }
        if a.shards > 1 {
            let (one, _, s, cpu, bytes) = ingest_ours(&trace, &a, &names, 1, None)?;
            ingest_line(round, "kvgate one shard", s, cpu, bytes);
            one_runs.push((s, cpu, bytes));
            kept_one = Some(one);
        }
        let (ours, idx, s, cpu, bytes) = ingest_ours(&trace, &a, &names, a.shards, None)?;
        ingest_line(round, "kvgate", s, cpu, bytes);
        ours_runs.push((s, cpu));
        let (dynamo, s, cpu, dbytes) = ingest_dynamo(&rt, &trace, &a)?;
        ingest_line(round, "dynamo", s, cpu, dbytes);
        dyn_runs.push((s, cpu));
        kept = Some((ours, idx, bytes, dynamo, dbytes));
    }
    let Some((ours, idx, ours_bytes, dynamo, dyn_bytes)) = kept else { bail!("no rounds") };
    let median = |runs: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (ours_ingest_s, ours_cpu_s) = (median(&ours_runs, |r| r.0), median(&ours_runs, |r| r.1));
    let (dyn_ingest_s, dyn_cpu_s) = (median(&dyn_runs, |r| r.0), median(&dyn_runs, |r| r.1));
    let resident: usize = idx.iter().map(|w| ours.worker_blocks(*w, Tier::Device)).sum();

    // ---- lookups, A/B interleaved ----
    let mut ours_ns = Vec::new();
    let mut one_ns = Vec::new();
    let mut dyn_ns = Vec::new();
    let mut mismatches = 0usize;
    let mut out = Vec::new();
    for tokens in &trace.lookups {
        let seqs: Vec<SequenceHash> = sequence_hashes(tokens, bs, BlockSeed::BASE);
        let local: Vec<LocalBlockHash> = compute_block_hash_for_seq(tokens, a.block_size, BlockHashOptions::default());
        let t = Instant::now();
        ours.find_matches(&seqs, Tier::Device, &mut out);
        ours_ns.push(t.elapsed().as_nanos() as f64);
        if let Some(one) = &kept_one {
            let mut out_one = Vec::new();
            let t = Instant::now();
            one.find_matches(&seqs, Tier::Device, &mut out_one);
            one_ns.push(t.elapsed().as_nanos() as f64);
            if out_one.len() != out.len() {
                mismatches += 1;
            }
        }
        let t = Instant::now();
        let scores = rt.block_on(dynamo.find_matches(local)).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        dyn_ns.push(t.elapsed().as_nanos() as f64);
        let a_map: BTreeMap<u64, u32> = out
            .iter()
            .map(|o| (ours.worker_name(o.worker).and_then(|n| n.strip_prefix("worker-")).and_then(|n| n.parse().ok()).unwrap_or(u64::MAX), o.blocks))
            .collect();
        let b_map: BTreeMap<u64, u32> = scores.scores.iter().filter(|(_, s)| **s > 0).map(|(w, s)| (w.worker_id, *s)).collect();
        if a_map != b_map {
            mismatches += 1;
        }
    }
    dynamo.shutdown();
    ours_ns.sort_by(f64::total_cmp);
    one_ns.sort_by(f64::total_cmp);
    dyn_ns.sort_by(f64::total_cmp);

    let side = |ingest_s: f64, cpu: f64, ns: &[f64], bytes: f64| {
        serde_json::json!({
            "ingest_block_ops_per_s": (block_ops as f64 / ingest_s).round(),
            "ingest_s": ingest_s,
            "ingest_cpu_s": cpu,
            "ingest_block_ops_per_cpu_s": (block_ops as f64 / cpu.max(0.01)).round(),
            "lookup_p50_us": kvgate_bench_support::quantile(ns, 0.50) / 1e3,
            "lookup_p99_us": kvgate_bench_support::quantile(ns, 0.99) / 1e3,
            "live_bytes_after_ingest": bytes,
            "bytes_per_block_worker": bytes / resident.max(1) as f64,
        })
    };
    let o = side(ours_ingest_s, ours_cpu_s, &ours_ns, ours_bytes);
    let d = side(dyn_ingest_s, dyn_cpu_s, &dyn_ns, dyn_bytes);
    // kvgate on one shard (events applied one by one, as before shards), in
    // the same rounds: what the shards buy and what they cost.
    let one = (!one_runs.is_empty()).then(|| {
        let runs: Vec<(f64, f64)> = one_runs.iter().map(|r| (r.0, r.1)).collect();
        let bytes = one_runs.last().map_or(0.0, |r| r.2);
        side(median(&runs, |r| r.0), median(&runs, |r| r.1), &one_ns, bytes)
    });
    let ratio = |k: &str| o[k].as_f64().unwrap_or(0.0) / d[k].as_f64().unwrap_or(1.0).max(f64::MIN_POSITIVE);
    let commit = std::process::Command::new("git").args(["rev-parse", "--short", "HEAD"]).output().ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default().lines()
        .find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).unwrap_or("").trim().to_owned();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let result = serde_json::json!({
        "ours": o,
        "ours_setup": format!("kvgate Index, {} shards, Index::apply_batch of {} events (one thread per shard)", a.shards, a.batch),
        "ours_one_shard": one,
        "dynamo": d,
        "ratios_ours_over_dynamo": {
            "ingest_block_ops_per_s": ratio("ingest_block_ops_per_s"),
            "ingest_block_ops_per_cpu_s": ratio("ingest_block_ops_per_cpu_s"),
            "lookup_p50_us": ratio("lookup_p50_us"),
            "lookup_p99_us": ratio("lookup_p99_us"),
            "bytes_per_block_worker": ratio("bytes_per_block_worker"),
        },
        "lookup_disagreements": mismatches,
        "lookups": trace.lookups.len(),
        "trace": {
            "file": a.trace, "requests": trace.requests, "events": trace.ops.len(),
            "stored_blocks": trace.stored_blocks, "removed_blocks": trace.removed_blocks,
            "block_size": a.block_size, "capacity_blocks_per_worker": a.capacity,
            "resident_block_worker_pairs": resident,
        },
        "workers": a.workers,
        "ingest_rounds": {
            "note": "ingest alternated kvgate / Dynamo; the medians are reported above",
            "kvgate_s": ours_runs.iter().map(|r| r.0).collect::<Vec<_>>(),
            "kvgate_one_shard_s": one_runs.iter().map(|r| r.0).collect::<Vec<_>>(),
            "dynamo_s": dyn_runs.iter().map(|r| r.0).collect::<Vec<_>>(),
        },
        "dynamo_setup": format!("dynamo-kv-router 1.6.1 ThreadPoolIndexer<ConcurrentRadixTreeCompressed>, {} threads", a.threads),
        "commit": commit,
        "machine": format!("{} {} cores, {}", std::env::consts::ARCH, cores, cpu),
    });
    std::fs::write(&a.out, serde_json::to_string_pretty(&result)? + "\n")?;
    println!("| metric | kvgate | Dynamo 1.6.1 | kvgate / Dynamo |");
    println!("|---|---:|---:|---:|");
    for (k, label) in [
        ("ingest_block_ops_per_s", "ingest block-ops/s"),
        ("ingest_block_ops_per_cpu_s", "ingest block-ops per CPU-s"),
        ("lookup_p50_us", "lookup p50 µs"),
        ("lookup_p99_us", "lookup p99 µs"),
        ("bytes_per_block_worker", "bytes per block×worker"),
    ] {
        println!("| {label} | {:.1} | {:.1} | {:.2} |", o[k].as_f64().unwrap_or(0.0), d[k].as_f64().unwrap_or(0.0), ratio(k));
    }
    if let Some(one) = &one {
        println!("kvgate on one shard: ingest {:.1} M block-ops/s, lookup p50 {:.1} / p99 {:.1} µs, {:.1} bytes per block×worker",
            one["ingest_block_ops_per_s"].as_f64().unwrap_or(0.0) / 1e6, one["lookup_p50_us"].as_f64().unwrap_or(0.0),
            one["lookup_p99_us"].as_f64().unwrap_or(0.0), one["bytes_per_block_worker"].as_f64().unwrap_or(0.0));
    }
    println!("lookups where the two disagree: {mismatches} of {}", trace.lookups.len());
    println!("wrote {}", a.out);
    Ok(())
}
