//! Behaviour of the routing policies and the load tracker.

use kvgate_index::WorkerIdx;
use kvgate_protocol::SequenceHash;
use kvgate_scheduler::{
    ApproxConfig, ApproxPolicy, Candidate, EngineTiming, KvConfig, KvPolicy, Load, LoadTracker, Measured, Mode, Policy,
    Reason, RequestView, RoundRobinPolicy,
};
use proptest::prelude::*;

fn request(blocks: u32) -> RequestView<'static> {
    RequestView { prompt_blocks: blocks, expected_output_tokens: 800, block_size: 32, text_prefix: &[] }
}

fn cand(w: u32, overlap: u32, load: Load) -> Candidate {
    Candidate {
        worker: WorkerIdx(w),
        overlap_blocks: overlap,
        overlap_any_tier_blocks: overlap,
        inflight_overlap_blocks: 0,
        inflight_computing_blocks: 0,
        load,
        timing: None,
        decode_running: None,
        excluded: false,
    }
}

fn active(blocks: u64) -> Load {
    Load { active_blocks: blocks, ..Load::default() }
}

/// REFERENCE-RESULTS.md section C: a request of 100 blocks; workers with
/// 20/75/10 cached blocks and 10/5/9 decode blocks cost 90/30/99, and worker 2
/// is chosen.
#[test]
fn dynamo_worked_example() {
    let kv = KvPolicy::new(KvConfig::dynamo());
    let cands = [cand(1, 20, active(10)), cand(2, 75, active(5)), cand(3, 10, active(9))];
    let costs: Vec<f64> = cands.iter().map(|c| kv.cost(&request(100), c)).collect();
    assert_eq!(costs, vec![90.0, 30.0, 99.0]);
    let mut p = KvPolicy::new(KvConfig::dynamo());
    let mut rng = fastrand::Rng::with_seed(1);
    let d = p.pick(&request(100), &cands, &mut rng).unwrap();
    assert_eq!(cands[d.chosen].worker, WorkerIdx(2));
    assert_eq!(d.reason, Reason::Kv);
    assert_eq!(d.fallbacks, vec![0, 2], "runners-up by cost: 90 then 99");
}

/// A second request on a long document that the first worker is still
/// prefilling (no stored event yet) follows it: the blocks in flight there
/// count as overlap and their pending prefill is not charged twice. Without
/// it (weight 0, Dynamo's behaviour), the pending prefill sends the second
/// request to an idle worker, which recomputes the whole document.
#[test]
fn a_prefix_still_prefilling_draws_its_followers() {
    let busy = Load { inflight: 1, prefill_pending_blocks: 3_000, active_blocks: 3_100, ..Load::default() };
    let mut first = cand(0, 0, busy);
    first.inflight_overlap_blocks = 3_000;
    let idle = cand(1, 0, Load::default());
    let cfg = KvConfig { overlap_weight: 4.0, ..KvConfig::dynamo() };
    let mut rng = fastrand::Rng::with_seed(3);
    let d = KvPolicy::new(cfg).pick(&request(3_002), &[first, idle], &mut rng).unwrap();
    assert_eq!(d.chosen, 0);
    assert_eq!(d.reason, Reason::Kv);
    // cost = 4 × 2 new blocks + 0 pending (shared) + 3,100 active.
    assert_eq!(KvPolicy::new(cfg).cost(&request(3_002), &first), 8.0 + 3_100.0);
    let off = KvConfig { inflight_hit_weight: 0.0, ..cfg };
    let d = KvPolicy::new(off).pick(&request(3_002), &[first, idle], &mut rng).unwrap();
    assert_eq!(d.chosen, 1, "without in-flight overlap the document is recomputed elsewhere");

    // The tracker reports the shared leading blocks of what is in flight.
    let mut t = LoadTracker::new();
    let doc: Vec<SequenceHash> = (0..50).map(SequenceHash).collect();
    t.added("a", WorkerIdx(0), &doc, 0, 10, 0).unwrap();
    let mut other = doc[..30].to_vec();
    other.push(SequenceHash(999));
    assert_eq!(t.inflight_prefix(WorkerIdx(0), &other), 30);
    assert_eq!(t.inflight_prefix(WorkerIdx(1), &other), 0);
    t.done("a").unwrap();
    assert_eq!(t.inflight_prefix(WorkerIdx(0), &other), 0, "gone when the request is done");
}

/// A sibling of a prefix that another request started a moment ago waits
/// for that prefill as long as it would take to compute it: on idle workers
/// the burst spreads (each computes the prefix once, in parallel), on busy
/// ones it stays together (a recompute would stall their running requests).
/// Once the prefill is done (first token), the shared blocks are a plain hit.
#[test]
fn siblings_of_a_prefix_still_computing_spread_over_idle_workers_only() {
    // 1,000 shared blocks still being computed on worker 0 for one request.
    let producer = Load { inflight: 1, prefill_pending_blocks: 1_000, active_blocks: 1_010, ..Load::default() };
    let mut first = cand(0, 0, producer);
    first.inflight_overlap_blocks = 1_000;
    first.inflight_computing_blocks = 1_000;
    let sibling = request(1_006);
    let mut rng = fastrand::Rng::with_seed(5);
    let idle = cand(1, 0, Load::default());
    let d = KvPolicy::default().pick(&sibling, &[first, idle], &mut rng).unwrap();
    assert_eq!(d.chosen, 1, "an idle worker computes the prefix as soon as the producer does");
    let old = KvConfig { inflight_wait_weight: 0.0, ..KvConfig::default() };
    assert_eq!(KvPolicy::new(old).pick(&sibling, &[first, idle], &mut rng).unwrap().chosen, 0);

    // The other worker runs 20 requests: recomputing would stall them.
    let busy = cand(1, 0, Load { inflight: 20, active_blocks: 2_000, ..Load::default() });
    let mut busier_first = first;
    busier_first.load.inflight = 20;
    busier_first.load.active_blocks = 3_000;
    let d = KvPolicy::default().pick(&sibling, &[busier_first, busy], &mut rng).unwrap();
    assert_eq!(d.chosen, 0, "on busy workers the sibling joins the prefill");

    // The producer's prefill is done: a hit, whatever the other worker does.
    let mut done = first;
    done.inflight_computing_blocks = 0;
    done.load.prefill_pending_blocks = 0;
    assert_eq!(KvPolicy::default().pick(&sibling, &[done, idle], &mut rng).unwrap().chosen, 0);

    // The tracker: blocks a request computes itself are "computing" until its
    // first token; blocks it was routed onto as overlap are not.
    let mut t = LoadTracker::new();
    let doc: Vec<SequenceHash> = (0..50).map(SequenceHash).collect();
    t.added("a", WorkerIdx(0), &doc, 10, 10, 0).unwrap();
    let share = t.inflight_share(WorkerIdx(0), &doc[..40]);
    assert_eq!((share.blocks, share.computing), (40, 30));
    t.added("b", WorkerIdx(0), &doc, 50, 10, 0).unwrap();
    t.first_token("a").unwrap();
    assert_eq!(t.inflight_share(WorkerIdx(0), &doc).computing, 0, "b computes nothing; a is done");
    t.done("a").unwrap();
    assert_eq!(t.inflight_share(WorkerIdx(0), &doc).blocks, 50, "b still holds the prompt");
    t.done("b").unwrap();
    assert_eq!(t.inflight_share(WorkerIdx(0), &doc), Default::default());
}

/// Time units: a cache miss is priced by the request time it costs on the
/// worker (this request's first token, weighted, plus the stall of every
/// request running there), while a request of imbalance costs decode time.
/// A follow-up turn stays with the worker holding the previous answer for a
/// few requests of imbalance, where block units (Dynamo's) move it; a short
/// recompute on an idle worker still beats a heavily loaded one.
#[test]
fn time_units_keep_busy_conversations_on_their_cache() {
    // 32-token blocks, 800 output tokens: one request of decode is
    // 0.5 × 800 / (0.1 × 32) = 125 prefill blocks per unit of
    // (2·running + 1); a new block costs (20 + running).
    let kv = KvPolicy::default();
    let idle = cand(0, 90, Load::default());
    let c = kv.cost(&request(100), &idle);
    assert!((c - (10.0 * 20.0 + 125.0)).abs() < 1e-9, "{c}");
    let busy = cand(0, 90, Load { inflight: 60, ..Load::default() });
    let c = kv.cost(&request(100), &busy);
    assert!((c - (10.0 * 80.0 + 125.0 * 121.0)).abs() < 1e-6, "{c}");

    // Worker 0 holds the history and the last answer (200 of 205 blocks);
    // worker 1 only the shared starter (170). Worker 0 runs 2 more requests.
    let mut rng = fastrand::Rng::with_seed(9);
    for n in [18, 58] {
        let cands = [
            cand(0, 200, Load { inflight: n + 2, active_blocks: u64::from(n + 2) * 213, ..Load::default() }),
            cand(1, 170, Load { inflight: n, active_blocks: u64::from(n) * 213, ..Load::default() }),
        ];
        assert_eq!(KvPolicy::default().pick(&request(205), &cands, &mut rng).unwrap().chosen, 0, "running {n}");
        assert_eq!(KvPolicy::new(KvConfig::dynamo()).pick(&request(205), &cands, &mut rng).unwrap().chosen, 1);
    }
    // Nearly idle workers and a short history: 8 requests of imbalance
    // (≈ 3,300 blocks of decode time) outweigh recomputing 20 blocks.
    let short = [cand(0, 20, Load { inflight: 8, ..Load::default() }), cand(1, 0, Load::default())];
    assert_eq!(KvPolicy::default().pick(&request(25), &short, &mut rng).unwrap().chosen, 1);
}

/// Time units: a worker whose KV blocks would overflow with the request (the
/// engine would preempt a running request) counts as saturated even below
/// its running limit, and utilization near capacity costs more before that.
/// The learned timing of a worker's class prices its choices: the
/// configured constants given as a timing change nothing; at equal load
/// and no cache, a class that prefills three times slower loses; a class
/// whose prefill grows with context pays for a miss after a long history.
#[test]
fn time_units_price_each_worker_at_its_own_speed() {
    let kv = KvPolicy::new(KvConfig::default());
    let k = KvConfig::default();
    let busy = Load { inflight: 10, active_blocks: 500, ..Load::default() };
    let plain = cand(0, 40, busy);
    let told = Candidate { timing: Some(EngineTiming::linear(k.prefill_ms_per_token, k.decode_ms_per_seq)), ..plain };
    assert_eq!(kv.cost(&request(100), &plain), kv.cost(&request(100), &told));

    let fast = Candidate { timing: Some(EngineTiming::linear(0.05, 0.3)), ..cand(0, 0, busy) };
    let slow = Candidate { timing: Some(EngineTiming::linear(0.15, 0.3)), ..cand(1, 0, busy) };
    let mut rng = fastrand::Rng::with_seed(9);
    for order in [[fast, slow], [slow, fast]] {
        let d = KvPolicy::new(k).pick(&request(200), &order, &mut rng).unwrap();
        assert_eq!(order[d.chosen].worker, WorkerIdx(0), "the fast class wins at equal load");
    }
    // Half the prefill (cache) on the slow class: 100 blocks at 3× the rate
    // still cost more than 200 at 1×.
    let slow_hit = Candidate { overlap_blocks: 100, overlap_any_tier_blocks: 100, ..slow };
    assert!(kv.cost(&request(200), &slow_hit) > kv.cost(&request(200), &fast));

    let flat = Candidate { timing: Some(EngineTiming::linear(0.1, 0.5)), ..cand(0, 1_000, busy) };
    let growing = Candidate {
        timing: Some(EngineTiming { prefill_ms_per_token_per_kctx: 0.01, ..EngineTiming::linear(0.1, 0.5) }),
        ..flat
    };
    // 100 new blocks after 32K cached tokens: 0.1 + 0.32 ms per token.
    let ratio = kv.cost(&request(1_100), &growing) / kv.cost(&request(1_100), &flat);
    assert!(ratio > 2.0, "context growth makes the same miss dearer: {ratio}");
}

/// With a measured fading load, the decode term prices the running
/// requests the decode lives with (`decode_running`), not those of now:
/// each one more costs `decode_ms_per_seq × O × 2` (in prefill blocks at
/// the configured rate), and the rest of the cost is unchanged. A
/// follow-up holding its history on a worker running six more than its
/// peer stays there once that difference is known to fade.
#[test]
fn a_fading_load_difference_costs_less_decode() {
    let k = KvConfig::default();
    let kv = KvPolicy::new(k);
    let busy = Load { inflight: 25, active_blocks: 500, ..Load::default() };
    let now = cand(0, 150, busy);
    let lives = |r: f64| Candidate { decode_running: Some(r), ..now };
    let per_seq = k.decode_ms_per_seq * 800.0 * 2.0 / (k.prefill_ms_per_token * 32.0);
    let d = kv.cost(&request(200), &lives(20.0)) - kv.cost(&request(200), &lives(21.0));
    assert!((d + per_seq).abs() < 1e-6, "{d} against {per_seq}");
    assert_eq!(kv.cost(&request(200), &lives(25.0)), kv.cost(&request(200), &now));

    // 30 of 40 blocks cached on a worker running 26, none on one running
    // 20: as lasting, six more running cost 0.5 ms × 800 × 2 × 6 = 4,800
    // ms against a miss of 30 blocks (5,120 − 1,472 ms of prefill and
    // stall).
    let (more, fewer) = (Load { inflight: 26, ..busy }, Load { inflight: 20, active_blocks: 400, ..Load::default() });
    let (hit, miss) = (cand(0, 30, more), cand(1, 0, fewer));
    let mut rng = fastrand::Rng::with_seed(5);
    let mut chosen = |cands: &[Candidate]| cands[kv.clone().pick(&request(40), cands, &mut rng).unwrap().chosen].worker;
    assert_eq!(chosen(&[hit, miss]), WorkerIdx(1), "priced as lasting, six more running outweigh the hit");
    let faded = [Candidate { decode_running: Some(23.0), ..hit }, Candidate { decode_running: Some(23.0), ..miss }];
    assert_eq!(chosen(&faded), WorkerIdx(0), "a difference that fades does not");
}

#[test]
fn kv_capacity_counts_as_saturation_in_time_units() {
    let load = |active: u64| Load {
        inflight: 30,
        active_blocks: active,
        max_running: Some(64),
        capacity_blocks: Some(10_000),
        ..Load::default()
    };
    let kv = KvPolicy::default();
    // 100 prompt blocks + 25 output blocks.
    let full = cand(0, 100, load(9_900));
    let room = cand(1, 0, load(6_000));
    assert!(kv.saturated(&request(100), &full));
    assert!(!kv.saturated(&request(100), &room));
    assert!(!KvPolicy::new(KvConfig::dynamo()).saturated(&request(100), &full), "block units: running limit only");
    let mut rng = fastrand::Rng::with_seed(5);
    assert_eq!(kv.clone().pick(&request(100), &[full, room], &mut rng).unwrap().chosen, 1);
    // Utilization: the larger of slots (31/65) and blocks (6,125/10,000).
    assert!((kv.utilization(&request(100), &room) - 0.6125).abs() < 1e-9);
    let near = cand(0, 0, load(8_500));
    assert!(kv.cost(&request(100), &near) > kv.cost(&request(100), &room));
}

/// A worker at its running limit is not chosen while another has room, even
/// with the whole prompt cached: waiting for a batch slot costs more than a
/// prefill. When every worker is saturated, cost decides, with a queued
/// request worth `queue_penalty_blocks`.
#[test]
fn saturated_workers_are_avoided() {
    let full = Load { inflight: 64, active_blocks: 2000, max_running: Some(64), ..Load::default() };
    let room = Load { inflight: 40, active_blocks: 2500, max_running: Some(64), ..Load::default() };
    let cands = [cand(0, 100, full), cand(1, 0, room)];
    let mut rng = fastrand::Rng::with_seed(2);
    let d = KvPolicy::default().pick(&request(100), &cands, &mut rng).unwrap();
    assert_eq!(d.chosen, 1);
    assert_eq!(d.reason, Reason::Load);

    // Measured waiting counts too (traffic the router did not see).
    let busy = Load {
        inflight: 10,
        measured_running: Some(64),
        measured_waiting: Some(3),
        max_running: Some(64),
        ..Load::default()
    };
    let cands = [cand(0, 100, busy), cand(1, 0, room)];
    assert_eq!(KvPolicy::default().pick(&request(100), &cands, &mut rng).unwrap().chosen, 1);

    // All saturated: cost decides, each queued request worth 200 blocks. With
    // 16 more requests queued, the cached worker loses despite its hit.
    let more = Load { inflight: 80, max_running: Some(64), ..Load::default() };
    let cands = [cand(0, 100, more), cand(1, 0, full)];
    assert_eq!(KvPolicy::default().pick(&request(100), &cands, &mut rng).unwrap().chosen, 1);
}

/// Without any overlap the cost reduces to load: the least loaded worker
/// wins, and equal workers are chosen at random (not always the first).
#[test]
fn ties_go_to_load_then_random() {
    let mut rng = fastrand::Rng::with_seed(3);
    let cands = [
        cand(0, 0, Load { inflight: 5, ..Load::default() }),
        cand(1, 0, Load { inflight: 2, ..Load::default() }),
        cand(2, 0, Load { inflight: 9, ..Load::default() }),
    ];
    assert_eq!(KvPolicy::default().pick(&request(10), &cands, &mut rng).unwrap().chosen, 1);
    let same = [cand(0, 0, Load::default()), cand(1, 0, Load::default()), cand(2, 0, Load::default())];
    let mut seen = [0; 3];
    for _ in 0..300 {
        seen[KvPolicy::default().pick(&request(10), &same, &mut rng).unwrap().chosen] += 1;
    }
    assert!(seen.iter().all(|n| *n > 50), "ties not spread: {seen:?}");
}

/// A burst of one conversation's turns, routed with the load tracker: `kv`
/// keeps them on the worker with the prefix until its running limit, then
/// spills; no worker ever exceeds its limit while another has room. This is
/// the DOKS failure at concurrency 180, in miniature.
#[test]
fn sticky_bursts_never_overflow_a_worker() {
    let mut tracker = LoadTracker::new();
    let workers = [WorkerIdx(0), WorkerIdx(1), WorkerIdx(2)];
    for w in workers {
        tracker.measured(
            w,
            Measured { running: 0, waiting: 0, kv_usage: 0.0, capacity_blocks: 100_000, max_num_seqs: 64 },
        );
    }
    let prefix: Vec<SequenceHash> = (0..120).map(SequenceHash).collect();
    let mut policy = KvPolicy::default();
    let mut rng = fastrand::Rng::with_seed(4);
    let mut placed = [0u32; 3];
    for i in 0..180 {
        // Worker 0 holds the shared 120-block prefix; each turn adds 5 new blocks.
        let mut prompt = prefix.clone();
        prompt.extend((0..5).map(|k| SequenceHash(1_000_000 + i * 10 + k)));
        let cands: Vec<Candidate> =
            workers.iter().map(|w| cand(w.0, if w.0 == 0 { 120 } else { 0 }, tracker.load(*w))).collect();
        let d = policy.pick(&request(prompt.len() as u32), &cands, &mut rng).unwrap();
        let w = workers[d.chosen];
        tracker.added(&format!("r{i}"), w, &prompt, cands[d.chosen].overlap_blocks, 26, 0).unwrap();
        placed[d.chosen] += 1;
        let max = placed.iter().copied().max().unwrap();
        let min = placed.iter().copied().min().unwrap();
        assert!(max <= 64 || min >= 64, "after {} requests: {placed:?}", i + 1);
    }
    // The prefix holder is filled to its limit, the rest spills evenly.
    assert_eq!(placed[0], 64, "{placed:?}");
    assert!(placed[1].abs_diff(placed[2]) <= 1, "{placed:?}");
}

/// The load tracker deduplicates shared prompt blocks per worker, releases
/// prefill at the first token and everything at the end, expires lost
/// requests, and rejects nonsense measurements.
#[test]
fn load_tracker_lifecycle() {
    let mut t = LoadTracker::new();
    let w = WorkerIdx(7);
    let shared: Vec<SequenceHash> = (0..10).map(SequenceHash).collect();
    let mut a = shared.clone();
    a.push(SequenceHash(100));
    let mut b = shared.clone();
    b.push(SequenceHash(200));
    t.added("a", w, &a, 0, 3, 1_000).unwrap();
    t.added("b", w, &b, 10, 3, 1_000).unwrap();
    assert_eq!(t.added("b", w, &b, 10, 3, 1_000), Err(kvgate_scheduler::LifecycleError::Duplicate));
    let l = t.load(w);
    assert_eq!((l.inflight, l.prefill_pending_blocks, l.active_blocks), (2, 11 + 1, 12 + 6));
    t.first_token("a").unwrap();
    assert_eq!(t.load(w).prefill_pending_blocks, 1);
    t.done("a").unwrap();
    let l = t.load(w);
    assert_eq!((l.inflight, l.prefill_pending_blocks, l.active_blocks), (1, 1, 11 + 3));
    assert_eq!(t.done("a"), Err(kvgate_scheduler::LifecycleError::Unknown));
    assert_eq!(t.expire(1_000 + 600_001, 600_000), 1);
    assert_eq!(t.load(w), Load::default());
    assert!(
        !t.measured(w, Measured { running: 1, waiting: 0, kv_usage: f32::NAN, capacity_blocks: 10, max_num_seqs: 8 })
    );
    assert!(!t.measured(w, Measured { running: 1, waiting: 0, kv_usage: 1.5, capacity_blocks: 10, max_num_seqs: 8 }));
    assert!(t.measured(w, Measured { running: 1, waiting: 2, kv_usage: 0.5, capacity_blocks: 10, max_num_seqs: 8 }));
    let l = t.load(w);
    assert_eq!((l.measured_active_blocks, l.max_running, l.effective_requests()), (Some(5), Some(8), 3));
}

/// `approx` sends a conversation back where it went, keeps tenants apart,
/// forgets after its TTL, and never sends to a saturated worker.
#[test]
fn approx_learns_its_own_decisions() {
    let mut p = ApproxPolicy::new(ApproxConfig { ttl_ms: 1_000, max_entries: 100 });
    let mut rng = fastrand::Rng::with_seed(5);
    let cands = [cand(0, 0, Load::default()), cand(1, 0, Load::default()), cand(2, 0, Load::default())];
    let turn1 = [11u64, 12];
    let turn2 = [11u64, 12, 13, 14];
    let r1 = RequestView { text_prefix: &turn1, ..request(10) };
    let first = p.pick(&r1, &cands, &mut rng).unwrap();
    p.observe(&r1, cands[first.chosen].worker, 0);
    let r2 = RequestView { text_prefix: &turn2, ..request(20) };
    for _ in 0..20 {
        let d = p.pick(&r2, &cands, &mut rng).unwrap();
        assert_eq!(d.chosen, first.chosen);
        assert_eq!(d.reason, Reason::Approximate);
        assert!(!d.fallbacks.contains(&first.chosen));
    }
    // Another tenant's keys (mixed with its seed) are different keys.
    let other = [91u64, 92];
    let d = p.pick(&RequestView { text_prefix: &other, ..request(10) }, &cands, &mut rng).unwrap();
    assert_eq!(d.reason, Reason::Load);
    // Saturated: not sent there.
    let mut sat = cands;
    sat[first.chosen].load = Load { inflight: 8, max_running: Some(8), ..Load::default() };
    assert_ne!(p.pick(&r2, &sat, &mut rng).unwrap().chosen, first.chosen);
    // Expired after the TTL.
    p.observe(&RequestView { text_prefix: &[500], ..request(1) }, WorkerIdx(0), 5_000);
    assert_eq!(p.pick(&r2, &cands, &mut rng).unwrap().reason, Reason::Load);
    p.forget_worker(WorkerIdx(0));
    assert!(p.len() <= 4);
}

#[test]
fn round_robin_cycles_and_skips_excluded() {
    let mut p = RoundRobinPolicy::default();
    let mut rng = fastrand::Rng::with_seed(6);
    let mut cands = vec![cand(0, 0, Load::default()), cand(1, 0, Load::default()), cand(2, 0, Load::default())];
    let order: Vec<usize> = (0..6).map(|_| p.pick(&request(1), &cands, &mut rng).unwrap().chosen).collect();
    assert_eq!(order, vec![0, 1, 2, 0, 1, 2]);
    cands[1].excluded = true;
    let order: Vec<usize> = (0..4).map(|_| p.pick(&request(1), &cands, &mut rng).unwrap().chosen).collect();
    assert_eq!(order, vec![0, 2, 0, 2]);
}

#[test]
fn modes_parse_by_name() {
    for m in Mode::ALL {
        assert_eq!(m.name().parse::<Mode>().unwrap(), m);
        assert_eq!(m.policy().name(), m.name());
    }
    assert!("kv-aware".parse::<Mode>().unwrap_err().contains("unknown routing mode"));
}

fn arb_load() -> impl Strategy<Value = Load> {
    (
        0u32..100,
        0u64..5000,
        0u64..5000,
        proptest::option::of(0u32..100),
        proptest::option::of(0u32..20),
        proptest::option::of(0u64..5000),
        proptest::option::of(0u32..80),
        proptest::option::of(0u64..20_000),
    )
        .prop_map(|(inflight, pending, active, mr, mw, ma, max, cap)| Load {
            inflight,
            prefill_pending_blocks: pending,
            active_blocks: active,
            measured_running: mr,
            measured_waiting: mw,
            measured_active_blocks: ma,
            max_running: max,
            capacity_blocks: cap,
        })
}

proptest! {
    /// No policy ever picks an excluded worker; each returns a decision iff
    /// some worker is eligible; fallbacks are eligible, distinct and not the
    /// chosen one.
    #[test]
    fn never_picks_an_excluded_worker(
        cands in proptest::collection::vec((0u32..200, 0u32..200, arb_load(), any::<bool>()), 0..12),
        blocks in 0u32..200,
        seed in any::<u64>(),
        temperature in prop_oneof![Just(0.0), 0.01f64..2.0],
        learned in proptest::collection::vec(0u64..4, 0..4),
    ) {
        let cands: Vec<Candidate> = cands.into_iter().enumerate().map(|(i, (o, extra, load, excluded))| Candidate {
            worker: WorkerIdx(i as u32), overlap_blocks: o, overlap_any_tier_blocks: o + extra,
            inflight_overlap_blocks: extra, inflight_computing_blocks: extra / 2, load, timing: None, decode_running: None, excluded,
        }).collect();
        let any_eligible = cands.iter().any(|c| !c.excluded);
        let keys = [1u64, 2, 3, 4];
        let req = RequestView { prompt_blocks: blocks, expected_output_tokens: 100, block_size: 16, text_prefix: &keys };
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut policies: Vec<Box<dyn Policy>> = Mode::ALL.iter().map(|m| m.policy()).collect();
        policies.push(Box::new(KvPolicy::new(kvgate_scheduler::KvConfig { temperature, ..Default::default() })));
        for p in &mut policies {
            for (i, k) in learned.iter().enumerate() {
                p.observe(&RequestView { text_prefix: &keys[..=i], ..req }, WorkerIdx(*k as u32), 0);
            }
            let d = p.pick(&req, &cands, &mut rng);
            prop_assert_eq!(d.is_some(), any_eligible, "{}", p.name());
            if let Some(d) = d {
                prop_assert!(!cands[d.chosen].excluded, "{} chose an excluded worker", p.name());
                let mut seen = vec![d.chosen];
                for f in &d.fallbacks {
                    prop_assert!(!cands[*f].excluded && !seen.contains(f), "{} bad fallback", p.name());
                    seen.push(*f);
                }
            }
        }
    }
}

proptest! {
    /// A control plane that learns every time 8× smaller (its clock sees a
    /// simulated fleet at 8× speed) makes the same decisions: the cost's
    /// unit is the fastest candidate's block, so scale cancels exactly.
    #[test]
    fn decisions_do_not_depend_on_the_scale_of_learned_times(
        cands in proptest::collection::vec((0u32..200, arb_load(), 0.01f64..1.0, 0.01f64..2.0), 1..6),
        blocks in 1u32..300,
        seed in any::<u64>(),
    ) {
        let make = |scale: f64| -> Vec<Candidate> {
            cands.iter().enumerate().map(|(i, (o, load, p, d))| Candidate {
                timing: Some(EngineTiming::linear(p * scale, d * scale)),
                ..cand(i as u32, *o, *load)
            }).collect()
        };
        let req = request(blocks);
        let a = KvPolicy::new(KvConfig::default()).pick(&req, &make(1.0), &mut fastrand::Rng::with_seed(seed));
        let b = KvPolicy::new(KvConfig::default()).pick(&req, &make(0.125), &mut fastrand::Rng::with_seed(seed));
        prop_assert_eq!(a, b);
    }
}

/// A request another replica routed, known by its leading block hashes
/// (capped) and its block count: the hashed blocks are in-flight overlap
/// and deduplicated like this replica's own; the rest are counted.
#[test]
fn a_replicas_request_lends_its_hashed_blocks_and_counts_the_rest() {
    let mut t = LoadTracker::new();
    let doc: Vec<SequenceHash> = (0..100).map(SequenceHash).collect();
    // 100 blocks, of which the first 60 are shared by hash; 20 were cached.
    t.added_shared("r", WorkerIdx(0), &doc[..60], 100, 20, 4, 0).unwrap();
    let share = t.inflight_share(WorkerIdx(0), &doc);
    assert_eq!((share.blocks, share.computing), (60, 40));
    let load = t.load(WorkerIdx(0));
    assert_eq!((load.prefill_pending_blocks, load.active_blocks), (80, 60 + 40 + 4));
    // A local request on the same document: the hashed part counts once.
    t.added("l", WorkerIdx(0), &doc[..60], 60, 4, 0).unwrap();
    assert_eq!(t.load(WorkerIdx(0)).active_blocks, 60 + 40 + 8);
    // Without hashes (an older replica) everything is counted.
    t.added_shared("old", WorkerIdx(1), &[], 100, 0, 0, 0).unwrap();
    assert_eq!((t.inflight_share(WorkerIdx(1), &doc).blocks, t.load(WorkerIdx(1)).active_blocks), (0, 100));
    // More hashes than blocks is a malformed event: only `prompt_blocks` are used.
    t.added_shared("odd", WorkerIdx(2), &doc, 10, 0, 0, 0).unwrap();
    assert_eq!(t.inflight_share(WorkerIdx(2), &doc).blocks, 10);
    for id in ["r", "l", "old", "odd"] {
        t.done(id).unwrap();
    }
    assert_eq!(t.load(WorkerIdx(0)).active_blocks, 0);
}

/// A prefix held in host memory (an offloading engine evicted it from the
/// device) loads back for about a tenth of its recompute: `kv` sends the
/// request there even when that worker is somewhat busier; blind to the
/// host tier (weight 0) it goes to the idler worker and recomputes.
#[test]
fn a_prefix_in_host_memory_is_worth_a_reload() {
    let mut offloaded = cand(0, 10, Load { inflight: 6, active_blocks: 600, ..Load::default() });
    offloaded.overlap_any_tier_blocks = 190;
    let idle = cand(1, 0, Load { inflight: 2, active_blocks: 200, ..Load::default() });
    let mut rng = fastrand::Rng::with_seed(9);
    let r = request(200);
    assert_eq!(KvPolicy::default().pick(&r, &[offloaded, idle], &mut rng).unwrap().chosen, 0);
    let blind = KvConfig { host_hit_weight: 0.0, ..KvConfig::default() };
    assert_eq!(KvPolicy::new(blind).pick(&r, &[offloaded, idle], &mut rng).unwrap().chosen, 1);
    // Costs: the host blocks count at 0.9 of a device hit.
    let p = KvPolicy::new(KvConfig { unit: kvgate_scheduler::CostUnit::Blocks, ..KvConfig::default() });
    let device_only = cand(0, 10, Load::default());
    assert!((p.cost(&r, &device_only) - p.cost(&r, &offloaded) - 0.9 * 180.0 + 600.0).abs() < 1e-9);
}
