//! Disaggregated prefill and decode on the synchronous model state: roles
//! from heartbeats, the decode pick never lands on a prefill worker, the
//! prefill leg goes to the prefill worker that holds the prompt when the
//! decode worker's local prefill is long enough, and stays local otherwise
//! (below the threshold, prefill workers saturated, disaggregation off).

mod common;

use kvgate_core::model::{DisaggConfig, ModelConfig, ModelState, PickInput, PickOutput};
use kvgate_protocol::pb;
use kvgate_scheduler::Mode;

/// Worker `id` with `role`, its load as given.
fn hb(id: &str, role: pb::WorkerRole, running: u32) -> pb::WorkerHeartbeat {
    pb::WorkerHeartbeat {
        role: role as i32,
        running,
        max_num_seqs: 4,
        capacity_blocks: 10_000,
        interval_ms: 100_000,
        ..common::heartbeat(id)
    }
}

/// A local prefill of 4 blocks (64 tokens) or more is disaggregated.
fn config(enabled: bool) -> ModelConfig {
    ModelConfig {
        disaggregation: DisaggConfig { enabled, min_uncached_tokens: Some(64), ..DisaggConfig::default() },
        ..common::config(Mode::Kv)
    }
}

/// w1, w2 prefill; w3 decode; w4 both; prefill workers running `busy`.
fn fleet(enabled: bool, busy: u32) -> ModelState {
    fleet_of(config(enabled), busy)
}

fn fleet_of(config: ModelConfig, busy: u32) -> ModelState {
    let mut st = ModelState::new(config, 1);
    st.on_heartbeat(&hb("w1", pb::WorkerRole::Prefill, busy), 0);
    st.on_heartbeat(&hb("w2", pb::WorkerRole::Prefill, busy), 0);
    st.on_heartbeat(&hb("w3", pb::WorkerRole::Decode, 0), 0);
    st.on_heartbeat(&hb("w4", pb::WorkerRole::Both, 0), 0);
    st
}

fn tokens() -> Vec<u32> {
    (0..16 * 8).map(|t| 2000 + t).collect()
}

fn pick(st: &mut ModelState, id: &str, t: &[u32]) -> PickOutput {
    let input = common::input(id, t, Some(16));
    st.pick(&input, 2).unwrap()
}

fn inflight(st: &ModelState, id: &str) -> u32 {
    st.worker_views(3).into_iter().find(|v| v.id == id).unwrap().inflight
}

#[test]
fn roles_come_from_heartbeats() {
    let st = fleet(true, 0);
    let roles: Vec<(String, &str)> = st.worker_views(1).into_iter().map(|v| (v.id, v.role)).collect();
    let want = [("w1", "prefill"), ("w2", "prefill"), ("w3", "decode"), ("w4", "both")];
    assert_eq!(roles, want.map(|(i, r)| (i.to_owned(), r)).to_vec());
}

#[test]
fn a_long_uncached_prompt_is_prefilled_where_it_is_cached_and_decoded_elsewhere() {
    let mut st = fleet(true, 0);
    st.on_batch(common::stored("w2", 1, &tokens()[..96]), 1);
    let out = pick(&mut st, "a", &tokens());
    assert!(["w3", "w4"].contains(&out.worker_id.as_str()), "decode on {}", out.worker_id);
    let leg = out.prefill.expect("disaggregated");
    assert_eq!((leg.worker_id.as_str(), leg.endpoint.as_str(), leg.matched_blocks), ("w2", "10.0.0.2:8000", 6));
    assert_eq!(st.counters().disaggregated, 1);
    // The prefill worker carries the leg until the first token; the decode
    // worker carries the request until its end.
    assert_eq!((inflight(&st, "w2"), inflight(&st, &out.worker_id)), (1, 1));
    let report = |total_us| pb::CompletionReport {
        request_id: "a".into(),
        worker_id: out.worker_id.clone(),
        endpoint: out.endpoint.clone(),
        status_code: 200,
        total_us,
        ..Default::default()
    };
    st.on_report(&report(0), 3);
    assert_eq!((inflight(&st, "w2"), inflight(&st, &out.worker_id)), (0, 1));
    st.on_report(&report(1000), 4);
    assert_eq!(inflight(&st, &out.worker_id), 0);
}

#[test]
fn prefill_workers_never_take_a_whole_request() {
    let mut st = fleet(true, 0);
    // w1 holds the whole prompt: still not a decode candidate.
    st.on_batch(common::stored("w1", 1, &tokens()), 1);
    for i in 0..20 {
        let out = pick(&mut st, &format!("r{i}"), &tokens());
        assert!(!["w1", "w2"].contains(&out.worker_id.as_str()), "request {i} decoded on {}", out.worker_id);
        // Nor is the passed-over overlap a prefill worker's.
        assert_ne!(out.passed_over.1, "w1");
    }
    // Only prefill workers live: no decision.
    let mut only = ModelState::new(config(true), 1);
    only.on_heartbeat(&hb("w1", pb::WorkerRole::Prefill, 0), 0);
    let t = tokens();
    let input = common::input("x", &t, None);
    assert!(only.pick(&input, 1).is_err());
}

#[test]
fn a_decode_worker_that_holds_most_of_the_prompt_prefills_locally() {
    let mut st = fleet(true, 0);
    // w3 holds 7 of 8 blocks: 16 uncached tokens, below 64.
    st.on_batch(common::stored("w3", 1, &tokens()[..112]), 1);
    let out = pick(&mut st, "a", &tokens());
    assert_eq!((out.worker_id.as_str(), out.prefill.is_none()), ("w3", true));
    assert_eq!((st.counters().below_threshold, st.counters().disaggregated), (1, 0));
}

#[test]
fn saturated_prefill_workers_or_disaggregation_off_leave_the_request_aggregated() {
    // Both prefill workers at their running limit.
    let mut st = fleet(true, 4);
    let out = pick(&mut st, "a", &tokens());
    assert!(out.prefill.is_none());
    assert_eq!(st.counters().no_prefill_capacity, 1);
    // Off: prefill workers idle, the prompt long, still aggregated.
    let mut off = fleet(false, 0);
    let out = pick(&mut off, "a", &tokens());
    assert!(out.prefill.is_none());
    assert!(!["w1", "w2"].contains(&out.worker_id.as_str()));
    assert_eq!(off.counters().disaggregated + off.counters().below_threshold, 0);
}

#[test]
fn a_fleet_without_prefill_workers_counts_nothing() {
    let mut st = ModelState::new(config(true), 1);
    st.on_heartbeat(&hb("w3", pb::WorkerRole::Decode, 0), 0);
    st.on_heartbeat(&hb("w4", pb::WorkerRole::Unspecified, 0), 0);
    let out = pick(&mut st, "a", &tokens());
    assert!(out.prefill.is_none());
    let c = st.counters();
    assert_eq!((c.disaggregated, c.below_threshold, c.no_prefill_capacity), (0, 0, 0));
}

#[test]
fn each_pool_reports_its_prefill_demand_capacity_and_decode_load() {
    let mut st = fleet(true, 0);
    st.on_batch(common::stored("w2", 1, &tokens()[..96]), 1);
    let out = pick(&mut st, "a", &tokens());
    let decode_role = if out.worker_id == "w3" { "decode" } else { "both" };
    let pools = st.pool_signals(2);
    let by_role = |r: &str| pools.iter().find(|p| p.role == r).cloned().unwrap();
    assert_eq!(pools.len(), 3);
    let prefill = by_role("prefill");
    // 128 prompt tokens, 96 held by w2: 32 to prefill there; the rate is a
    // 10 s average.
    assert_eq!(prefill.workers, 2);
    assert!((prefill.prefill_tokens_per_s - 3.2).abs() < 1e-9, "{prefill:?}");
    // The prior 0.1 ms per token: 10,000 tokens/s per worker.
    assert!((prefill.prefill_capacity_tokens_per_s - 20_000.0).abs() < 1e-6, "{prefill:?}");
    assert_eq!((prefill.requests, prefill.max_running), (1, 8), "the leg, until its first token");
    let decode = by_role(decode_role);
    assert_eq!((decode.requests, decode.max_running, decode.prefill_tokens_per_s), (1, 4, 0.0));
    assert!((decode.decode_load() - 0.25).abs() < 1e-9);
    // An aggregated request counts for the pool that prefills it.
    let short: Vec<u32> = (0..40).map(|t| 9000 + t).collect();
    let out = pick(&mut st, "b", &short);
    assert!(out.prefill.is_none());
    let role = if out.worker_id == "w3" { "decode" } else { "both" };
    let p = st.pool_signals(2).into_iter().find(|p| p.role == role).unwrap();
    assert!((p.prefill_tokens_per_s - 4.0).abs() < 1e-9, "{p:?}");
}

/// A backed-up prefill pool does not take legs it would finish later than
/// the decode worker itself: the prefill queued on the prefill workers (the
/// legs routed there, until their first tokens) against the decode
/// worker's own.
#[test]
fn a_prefill_worker_that_would_finish_later_than_the_decode_worker_gets_no_leg() {
    // The new request's TTFT alone (the decodes' stall: next test).
    let mut cfg = config(true);
    cfg.disaggregation.stall_weight = 0.0;
    let mut st = fleet_of(cfg, 0);
    let prompt = |k: u32| -> Vec<u32> { (0..16 * 8).map(|t| 100_000 * (k + 1) + t).collect() };
    // Two legs fill both prefill workers' queues with 8 blocks each.
    for k in 0..2 {
        assert!(pick(&mut st, &format!("r{k}"), &prompt(k)).prefill.is_some(), "leg {k}");
    }
    // A third new prompt: 8 blocks queued + 8 its own on either prefill
    // worker, 8 on an idle decode worker: local.
    let out = pick(&mut st, "r2", &prompt(2));
    assert!(out.prefill.is_none());
    assert_eq!(st.counters().no_prefill_capacity, 1);
    // The legs end when their prefill should be done (128 tokens at the
    // prior 0.1 ms each: by 15 ms), before any report: legs again.
    st.reap(100);
    assert_eq!((inflight(&st, "w1"), inflight(&st, "w2")), (0, 0));
    assert!(pick(&mut st, "r3", &prompt(3)).prefill.is_some());
    // Off, the same request would queue behind them.
    let cfg = ModelConfig {
        disaggregation: DisaggConfig {
            min_uncached_tokens: Some(64),
            only_if_sooner: false,
            ..DisaggConfig::default()
        },
        ..common::config(Mode::Kv)
    };
    let mut off = ModelState::new(cfg, 1);
    for (id, role) in [("w1", pb::WorkerRole::Prefill), ("w2", pb::WorkerRole::Prefill), ("w3", pb::WorkerRole::Decode)]
    {
        off.on_heartbeat(&hb(id, role, 0), 0);
    }
    for k in 0..3 {
        assert!(pick(&mut off, &format!("r{k}"), &prompt(k)).prefill.is_some(), "leg {k}");
    }
}

/// A local prefill stalls the decodes running on the decode worker: with
/// `stall_weight` w, n requests in flight there and a prefill of c ms, the
/// local side costs its queue + c + w·n·c, so a leg that finishes later
/// than the local prefill still goes when the stall it saves is larger.
#[test]
fn the_stall_of_running_decodes_sends_a_prefill_away_that_would_finish_later() {
    let prompt = |k: u32| -> Vec<u32> { (0..16 * 8).map(|t| 100_000 * (k + 1) + t).collect() };
    let third = |w: f64| {
        let mut cfg = config(true);
        cfg.disaggregation.stall_weight = w;
        let mut st = fleet_of(cfg, 0);
        // Two legs: 8 blocks queued on each prefill worker, one decode in
        // flight on each decode worker.
        for k in 0..2 {
            let out = pick(&mut st, &format!("r{k}"), &prompt(k));
            assert!(out.prefill.is_some(), "leg {k} at weight {w}");
        }
        assert_eq!((inflight(&st, "w3"), inflight(&st, "w4")), (1, 1));
        // Remote: 8 queued + 8 = 16 blocks of prefill; local: 8 + w·1·8.
        let out = pick(&mut st, "r2", &prompt(2));
        (out.prefill.map(|l| l.worker_id), st.counters().no_prefill_capacity)
    };
    assert_eq!(third(0.0), (None, 1), "TTFT alone: local");
    assert_eq!(third(0.5), (None, 1), "8 + 4 < 16: local");
    let (leg, refused) = third(1.0);
    assert!(leg.is_some() && refused == 0, "8 + 8 = 16: away");
    assert!(third(3.0).0.is_some(), "8 + 24 > 16: away");
}

/// Replica A disaggregates a request; replica B hears of the decode request
/// and of its prefill leg (`prefill_leg_ms`): the leg is load on the
/// prefill worker at B too, until the request's first token there, or
/// until its estimated end if no token comes.
#[test]
fn another_replicas_prefill_leg_is_load_on_its_prefill_worker() {
    let mut a = fleet(true, 0);
    let out = pick(&mut a, "a", &tokens());
    let leg = out.prefill.clone().expect("disaggregated");
    assert_eq!((leg.inflight.worker_id.as_str(), leg.inflight.request_id.as_str()), (leg.worker_id.as_str(), "a"));
    assert!(leg.inflight.prefill_leg_ms > 0, "{:?}", leg.inflight);
    assert_eq!(out.inflight.prefill_leg_ms, 0, "the decode request is a plain one");

    let mut b = fleet(true, 0);
    b.on_replica_event(&out.inflight, 3);
    b.on_replica_event(&leg.inflight, 3);
    assert_eq!((inflight(&b, &leg.worker_id), inflight(&b, &out.worker_id)), (1, 1));
    let first_token = pb::InflightEvent {
        request_id: "a".into(),
        phase: pb::InflightPhase::FirstToken as i32,
        ..out.inflight.clone()
    };
    b.on_replica_event(&first_token, 4);
    assert_eq!((inflight(&b, &leg.worker_id), inflight(&b, &out.worker_id)), (0, 1), "the leg ended");

    // No first token: the leg ends at its estimate, on B's next pick.
    let mut b = fleet(true, 0);
    b.on_replica_event(&leg.inflight, 3);
    assert_eq!(inflight(&b, &leg.worker_id), 1);
    let later = 3 + u64::from(leg.inflight.prefill_leg_ms);
    b.pick(&common::input("other", &[1, 2, 3], Some(4)), later).unwrap();
    assert_eq!(inflight(&b, &leg.worker_id), 0);
}

/// `prefill_on_both`: on a fleet of `both` workers, a long prefill leaves a
/// decode worker busy decoding for another `both` worker whose queue, this
/// prefill and the stall of its own decodes cost less; it stays when they
/// cost the same, never goes to the decode worker itself, and without the
/// setting such a fleet never disaggregates.
#[test]
fn both_workers_take_a_leg_when_the_prefill_stalls_fewer_decodes_there() {
    let fleet = |on: bool, n: u32| {
        let mut cfg = config(true);
        cfg.disaggregation.prefill_on_both = on;
        let mut st = ModelState::new(cfg, 1);
        for w in 1..=n {
            st.on_heartbeat(&hb(&format!("w{w}"), pb::WorkerRole::Both, 0), 0);
        }
        st
    };
    let on = |w: u32| vec![format!("10.0.0.{w}:8000")];
    let short = |k: u32| -> Vec<u32> { (0..40).map(|t| 50_000 * (k + 1) + t).collect() };
    // `n` short requests (below the threshold: local) on worker `w`.
    let decodes = |st: &mut ModelState, w: u32, n: u32| {
        for k in 0..n {
            let (id, t, at) = (format!("s{w}-{k}"), short(10 * w + k), on(w));
            let out = st.pick(&PickInput { allowed: Some(&at), ..common::input(&id, &t, Some(16)) }, 2).unwrap();
            assert!(out.prefill.is_none());
        }
    };
    let long = |st: &mut ModelState| {
        let (t, at) = (tokens(), on(1));
        let out = st.pick(&PickInput { allowed: Some(&at), ..common::input("long", &t, Some(16)) }, 2).unwrap();
        assert_eq!(out.worker_id, "w1", "the decode worker the hint allows");
        out.prefill.map(|l| l.worker_id)
    };

    // w1 decodes two requests: 8 + 4·2·8 block-times here, 8 on w2 or w3.
    let mut st = fleet(true, 3);
    decodes(&mut st, 1, 2);
    let leg = long(&mut st).expect("a leg");
    assert!(["w2", "w3"].contains(&leg.as_str()), "leg on {leg}");
    assert_eq!(st.counters().disaggregated, 1);
    assert_eq!(inflight(&st, &leg), 1, "the leg is load on its worker until its first token");

    // Every worker decodes one: 8 + 4·1·8 everywhere, a tie: local.
    let mut st = fleet(true, 3);
    (1..=3).for_each(|w| decodes(&mut st, w, 1));
    assert_eq!(long(&mut st), None);
    assert_eq!(st.counters().no_prefill_capacity, 1);

    // One worker: no other to take the leg, and nothing counted.
    let mut st = fleet(true, 1);
    decodes(&mut st, 1, 2);
    assert_eq!(long(&mut st), None);
    // Off (the default): a fleet of `both` workers routes aggregated.
    let mut off = fleet(false, 3);
    decodes(&mut off, 1, 2);
    assert_eq!(long(&mut off), None);
    for c in [st.counters(), off.counters()] {
        assert_eq!((c.disaggregated, c.below_threshold, c.no_prefill_capacity), (0, 0, 0));
    }
}

/// `overflow_to_prefill`: when the decode side is saturated (here its
/// running limit), a prefill worker that is not takes the whole request,
/// without a leg; off (the default), or with the prefill workers saturated
/// too, the request stays on the decode side.
#[test]
fn a_saturated_decode_pool_overflows_whole_requests_to_prefill_workers() {
    let run = |overflow: bool, prefill_busy: u32| {
        let mut cfg = config(true);
        cfg.disaggregation.overflow_to_prefill = overflow;
        let mut st = ModelState::new(cfg, 1);
        st.on_heartbeat(&hb("w1", pb::WorkerRole::Prefill, prefill_busy), 0);
        st.on_heartbeat(&hb("w2", pb::WorkerRole::Prefill, prefill_busy), 0);
        st.on_heartbeat(&hb("w3", pb::WorkerRole::Decode, 4), 0);
        let out = pick(&mut st, "a", &tokens());
        (out, st.counters().overflowed)
    };
    let (out, n) = run(true, 0);
    assert!(["w1", "w2"].contains(&out.worker_id.as_str()), "whole on {}", out.worker_id);
    assert!(out.prefill.is_none(), "a whole request, no leg");
    assert!(out.fallbacks.contains(&"10.0.0.3:8000".to_owned()), "the decode worker stays a fallback: {out:?}");
    assert_eq!(n, 1);
    for (overflow, busy) in [(false, 0), (true, 4)] {
        let (out, n) = run(overflow, busy);
        assert_eq!((out.worker_id.as_str(), n), ("w3", 0), "overflow {overflow}, prefill running {busy}");
    }
}

/// A prefill worker that decodes requests it took by overflow pays their
/// stall when it takes a leg, like a decode worker: with two of them
/// decoding there, a leg costs its queue + 8 + 4·2·8 block-times against
/// the decode worker's 2 + 8 + 4·1·8, so the prefill stays local (without
/// the stall the leg would go: 4 + 8 < 42). Its legs are not decodes.
#[test]
fn a_prefill_worker_decoding_overflowed_requests_counts_their_stall_for_a_leg() {
    let mut cfg = config(true);
    cfg.disaggregation.overflow_to_prefill = true;
    let mut st = ModelState::new(cfg, 1);
    st.on_heartbeat(&hb("w1", pb::WorkerRole::Prefill, 0), 0);
    st.on_heartbeat(&hb("w3", pb::WorkerRole::Decode, 4), 0);
    let short = |k: u32| -> Vec<u32> { (0..40).map(|t| 70_000 * (k + 1) + t).collect() };
    for k in 0..2 {
        assert_eq!(pick(&mut st, &format!("s{k}"), &short(k)).worker_id, "w1", "overflow {k}");
    }
    st.on_heartbeat(&hb("w3", pb::WorkerRole::Decode, 0), 1);
    assert_eq!(pick(&mut st, "s2", &short(2)).worker_id, "w3");
    let out = pick(&mut st, "long", &tokens());
    assert_eq!((out.worker_id.as_str(), out.prefill), ("w3", None));
    assert_eq!(st.counters().no_prefill_capacity, 1);
    assert_eq!(st.counters().overflowed, 2);
}
