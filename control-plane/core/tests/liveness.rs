//! Who gets a Pick, on the synchronous model state with no network: engine
//! health from heartbeats, suspects from the filter's connection-failure
//! reports, and liveness frozen across a NATS outage.

mod common;

use kvgate_core::model::{ModelConfig, ModelState, NoWorker, reached_another};
use kvgate_protocol::pb;
use kvgate_scheduler::Mode;

fn state() -> ModelState {
    ModelState::new(common::config(Mode::LeastLoad), 1)
}

fn hb(id: &str, health: pb::EngineHealth) -> pb::WorkerHeartbeat {
    pb::WorkerHeartbeat { engine_health: health as i32, ..common::heartbeat(id) }
}

/// Workers a hundred picks at `now` land on.
fn picked(st: &mut ModelState, now: u64) -> Vec<String> {
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..100 {
        let id = format!("r{now}-{i}");
        let input = common::input(&id, &[], Some(1));
        match st.pick(&input, now) {
            Ok(o) => {
                seen.insert(o.worker_id);
            }
            Err(NoWorker::NoneLive | NoWorker::NoneAllowed) => {}
        }
        st.on_report(
            &pb::CompletionReport { request_id: id, model: "m".into(), total_us: 1, ..Default::default() },
            now,
        );
    }
    seen.into_iter().collect()
}

#[test]
fn an_unhealthy_or_down_engine_gets_no_pick_and_comes_back_when_healthy() {
    use pb::EngineHealth as H;
    for (health, routed) in [(H::Unspecified, true), (H::Healthy, true), (H::Unhealthy, false), (H::Down, false)] {
        let mut st = state();
        st.on_heartbeat(&hb("w0", H::Healthy), 0);
        st.on_heartbeat(&hb("w1", health), 0);
        let got = picked(&mut st, 10);
        assert_eq!(got.contains(&"w1".to_owned()), routed, "{health:?}: {got:?}");
        assert!(got.contains(&"w0".to_owned()));
        st.on_heartbeat(&hb("w1", H::Healthy), 20);
        assert_eq!(picked(&mut st, 30), vec!["w0", "w1"], "{health:?} then healthy");
        let views = st.worker_views(30);
        assert_eq!(views[1].engine_health, "healthy");
    }
}

fn report(worker: &str, endpoint: &str, served: &str, status: u32) -> pb::CompletionReport {
    pb::CompletionReport {
        request_id: "x".into(),
        model: "m".into(),
        worker_id: worker.into(),
        endpoint: endpoint.into(),
        served_endpoint: served.into(),
        status_code: status,
        total_us: 10,
        ..Default::default()
    }
}

#[test]
fn what_counts_as_a_connection_failure() {
    // (endpoint, served, status) → failure
    for (endpoint, served, status, failed) in [
        ("10.0.0.1:8000", "10.0.0.1:8000", 200, false),
        ("10.0.0.1:8000", "10.0.0.2:8000", 200, true),
        ("10.0.0.1:8000", "", 200, false),
        ("10.0.0.1:8000", "", 0, true),
        ("10.0.0.1:8000", "", 503, true),
        ("10.0.0.1:8000", "10.0.0.1:8000", 503, false),
        ("", "10.0.0.2:8000", 200, false),
    ] {
        assert_eq!(reached_another(&report("w1", endpoint, served, status)), failed, "{endpoint} {served} {status}");
    }
}

/// Two reports within the window that Envoy served w1's requests elsewhere
/// make w1 a suspect: no Pick for `suspect_ms`, then back.
#[test]
fn a_burst_of_connection_failures_makes_a_suspect_for_a_while() {
    use pb::EngineHealth as H;
    let mut st = state();
    for w in ["w0", "w1"] {
        st.on_heartbeat(&hb(w, H::Healthy), 0);
    }
    st.on_report(&report("w1", "10.0.0.1:8000", "10.0.0.0:8000", 200), 100);
    assert_eq!(picked(&mut st, 150), vec!["w0", "w1"], "one failure is not a burst");
    st.on_report(&report("w1", "10.0.0.1:8000", "10.0.0.0:8000", 200), 200);
    for t in [250, 400] {
        st.on_heartbeat(&hb("w0", H::Healthy), t);
        st.on_heartbeat(&hb("w1", H::Healthy), t);
    }
    assert_eq!(picked(&mut st, 450), vec!["w0"]);
    assert!(st.worker_views(450)[1].suspect_ms_left > 0);
    assert_eq!(st.counters().suspects, 1);
    assert_eq!(st.counters().connection_failures, 2);
    for t in (500..=3300).step_by(100) {
        st.on_heartbeat(&hb("w0", H::Healthy), t);
        st.on_heartbeat(&hb("w1", H::Healthy), t);
    }
    assert_eq!(picked(&mut st, 3300), vec!["w0", "w1"], "suspicion lapses");
}

/// A stream's first-token report ends its prefill on the worker (the
/// prompt no longer counts as prefill to do there) but not the request;
/// when Envoy served it elsewhere the failure is counted once, by the end
/// report, not by both.
#[test]
fn a_first_token_report_ends_the_prefill_not_the_request() {
    use pb::EngineHealth as H;
    let mut st = state();
    st.on_heartbeat(&hb("w0", H::Healthy), 0);
    let tokens: Vec<u32> = (0..16 * 10).collect();
    let out = st.pick(&common::input("s", &tokens, Some(64)), 1).unwrap();
    let view = |st: &ModelState| {
        let v = &st.worker_views(2)[0];
        (v.inflight, v.prefilling_blocks)
    };
    assert_eq!(view(&st), (1, 10));
    let mut r = report(&out.worker_id, &out.endpoint, "10.0.0.9:8000", 200);
    r.request_id = "s".into();
    let first = pb::CompletionReport { total_us: 0, ttfb_us: 5, ..r.clone() };
    st.on_report(&first, 2);
    assert_eq!(view(&st), (1, 0), "in flight, its prefill done");
    assert_eq!(st.counters().connection_failures, 0);
    assert_eq!(st.counters().reports, 0, "not the end");
    st.on_report(&r, 3);
    assert_eq!(view(&st), (0, 0));
    assert_eq!((st.counters().connection_failures, st.counters().reports), (1, 1));
}

/// During a NATS outage no heartbeat arrives; the outage does not count
/// against the workers once it is thawed, so they are not reaped.
#[test]
fn thawing_after_an_outage_keeps_the_workers() {
    use pb::EngineHealth as H;
    let mut st = state();
    st.on_heartbeat(&hb("w0", H::Healthy), 0);
    st.on_heartbeat(&hb("w1", H::Healthy), 0);
    // 10 s without heartbeats (NATS down): routed all along; then thawed.
    st.freeze(50);
    assert_eq!(picked(&mut st, 9_000), vec!["w0", "w1"], "frozen: still routable");
    st.thaw(10_000);
    assert!(st.reap(10_500).is_empty());
    assert_eq!(picked(&mut st, 10_500), vec!["w0", "w1"]);
    // Without the thaw, a worker silent while another beats is gone.
    let mut st = state();
    st.on_heartbeat(&hb("w0", H::Healthy), 0);
    st.on_heartbeat(&hb("w1", H::Healthy), 10_400);
    assert_eq!(st.reap(10_500), vec!["w0"]);
}

/// Heartbeats come in the same ordered stream as the KV events, so a
/// control plane that falls behind on ingest sees every heartbeat late. That
/// backlog does not purge live workers (judged by the stream's newest
/// heartbeat), though it makes them unroutable until their heartbeats are
/// processed; a backlog longer than `MAX_STREAM_LAG_MS`, or a worker silent
/// while others beat, is reaped.
#[test]
fn a_backlog_of_late_heartbeats_does_not_purge_the_fleet() {
    use kvgate_core::model::MAX_STREAM_LAG_MS;
    use pb::EngineHealth as H;
    let mut st = state();
    st.on_heartbeat(&hb("w0", H::Healthy), 0);
    st.on_heartbeat(&hb("w1", H::Healthy), 0);
    // 10 s without a processed heartbeat: not routable, not forgotten.
    assert!(st.reap(10_000).is_empty());
    assert_eq!(picked(&mut st, 10_000), Vec::<String>::new());
    // The backlog drains: routable again, with their blocks.
    st.on_heartbeat(&hb("w0", H::Healthy), 10_100);
    st.on_heartbeat(&hb("w1", H::Healthy), 10_100);
    assert_eq!(picked(&mut st, 10_200), vec!["w0", "w1"]);
    // w1 stays silent while w0 beats: reaped as before.
    for t in (10_200..=12_000).step_by(200) {
        st.on_heartbeat(&hb("w0", H::Healthy), t);
    }
    assert_eq!(st.reap(12_000), vec!["w1"]);
    // Nothing beats for longer than the bound: reaped.
    assert!(st.reap(12_000 + MAX_STREAM_LAG_MS / 2).is_empty());
    assert_eq!(st.reap(12_000 + MAX_STREAM_LAG_MS + 2_000), vec!["w0"]);
}

/// A control plane short of CPU processes heartbeats late and slower than
/// the relays send them: here each round of three heartbeats, sent 100 ms
/// apart by the relays' clocks, takes 3 s to process, so by the time of
/// processing each worker's heartbeats are 3 s apart, three timeouts. By
/// the relays' send times they are 100 ms apart: no worker is silent, all
/// stay routable, none is reaped (before, the first of each round was
/// reaped when the last was processed). A relay that stops while the others
/// go on is still found: reaped once the others' send times pass its last
/// one by a timeout. w2's relay clock runs 10 s ahead of the others' (send
/// times are compared on the control plane's clock, each relay's offset
/// learned from its heartbeats), which changes none of this.
#[test]
fn a_slow_drain_of_stamped_heartbeats_keeps_the_fleet_live() {
    use pb::EngineHealth as H;
    const BASE_MS: u64 = 1_700_000_000_000;
    let beat = |id: &str, sent_ms: u64| {
        let skew = if id == "w2" { 10_000 } else { 0 };
        pb::WorkerHeartbeat { ts_unix_nanos: (sent_ms + skew) * 1_000_000, ..hb(id, H::Healthy) }
    };
    let mut st = state();
    let all = ["w0", "w1", "w2"];
    for id in all {
        st.on_heartbeat(&beat(id, BASE_MS), 0);
    }
    let mut reaped = Vec::new();
    for round in 1..=12u64 {
        for (i, id) in all.iter().enumerate() {
            let t = round * 3_000 + i as u64 * 1_000;
            st.on_heartbeat(&beat(id, BASE_MS + round * 100), t);
            reaped.extend(st.reap(t + 900));
            assert_eq!(picked(&mut st, t + 900), all, "round {round}, after {id}'s heartbeat");
        }
    }
    assert!(reaped.is_empty(), "{reaped:?}");
    // w2's relay stops; w0's and w1's heartbeats go on, as late.
    for round in 13..=30u64 {
        for (i, id) in all[..2].iter().enumerate() {
            let t = round * 3_000 + i as u64 * 1_000;
            st.on_heartbeat(&beat(id, BASE_MS + round * 100), t);
            let now_reaped = st.reap(t + 900);
            // Its last heartbeat was sent in round 12: silent once the
            // others' are more than a timeout (1 s) newer, from round 23.
            if round < 23 {
                assert!(now_reaped.is_empty(), "round {round}: {now_reaped:?}");
            }
            reaped.extend(now_reaped);
        }
    }
    assert_eq!(reaped, vec!["w2"]);
    assert_eq!(picked(&mut st, 30 * 3_000 + 1_900), vec!["w0", "w1"]);
}

/// Only `kv` predicts cached tokens; a report of a request routed in
/// another mode is not judged (it used to count every hit as a miss).
#[test]
fn prediction_accuracy_judges_only_predictions_that_were_made() {
    use pb::EngineHealth as H;
    for (mode, judged) in [(Mode::RoundRobin, 0), (Mode::LeastLoad, 0), (Mode::Kv, 1)] {
        let mut st = state();
        st.set_mode(mode);
        st.on_heartbeat(&hb("w0", H::Healthy), 0);
        let input = common::input("a", &[7; 64], Some(1));
        let out = st.pick(&input, 1).unwrap();
        let report = pb::CompletionReport {
            request_id: "a".into(),
            model: "m".into(),
            worker_id: out.worker_id,
            total_us: 10,
            cached_tokens: Some(48),
            ..Default::default()
        };
        st.on_report(&report, 2);
        assert_eq!(st.counters().reports_with_cached, judged, "{mode:?}");
    }
}

/// When `kv` moves a request away from the worker holding more of its
/// prompt (for load), the answer names what it passed over and where.
#[test]
fn a_move_for_load_names_the_overlap_it_passed_over() {
    use pb::EngineHealth as H;
    let mut st = state();
    st.set_mode(Mode::Kv);
    let tokens: Vec<u32> = (0..16 * 8).map(|t| 1000 + t).collect();
    for w in ["w0", "w1"] {
        st.on_heartbeat(&hb(w, H::Healthy), 0);
    }
    st.on_batch(common::stored("w0", 1, &tokens[..64]), 1);
    let pick = |st: &mut ModelState, id: &str| {
        let input = common::input(id, &tokens, Some(16));
        st.pick(&input, 2).unwrap()
    };
    let calm = pick(&mut st, "a");
    assert_eq!((calm.worker_id.as_str(), calm.matched_blocks, calm.passed_over.0), ("w0", 4, 0));
    // w0 saturated: its queue costs more than recomputing 4 blocks.
    let busy = pb::WorkerHeartbeat { running: 64, waiting: 400, max_num_seqs: 64, ..hb("w0", H::Healthy) };
    st.on_heartbeat(&busy, 3);
    let moved = pick(&mut st, "b");
    assert_eq!(moved.worker_id, "w1", "{moved:?}");
    assert_eq!(moved.passed_over, (4, "w0".to_owned()));
    assert_eq!(moved.reason, pb::PickReason::Load);
}

/// With `allowed_endpoints`, a relay claiming another endpoint registers
/// no worker: its heartbeats and batches are refused and counted.
#[test]
fn an_endpoint_outside_the_worker_set_is_refused() {
    use pb::EngineHealth as H;
    let mut st = ModelState::new(
        ModelConfig {
            allowed_endpoints: vec![kvgate_core::endpoints::EndpointRule::parse("10.0.0.0/30").unwrap()],
            ..state().config().clone()
        },
        1,
    );
    st.on_heartbeat(&hb("w1", H::Healthy), 0); // 10.0.0.1:8000: inside
    st.on_heartbeat(&hb("w9", H::Healthy), 0); // 10.0.0.9:8000: outside
    st.on_batch(pb::KvEventBatch { worker_id: "w9".into(), model: "m".into(), relay_seq: 1, ..Default::default() }, 1);
    assert_eq!(picked(&mut st, 10), vec!["w1"]);
    assert_eq!(st.worker_views(10).len(), 1);
    assert_eq!(st.counters().refused_endpoints, 2);
}

/// The candidates are listed by worker id whatever the order workers joined
/// or left in, so that two replicas (or two runs) with the same seed break
/// ties alike; a worker that joins after Picks were made, or leaves, is
/// placed or dropped correctly.
#[test]
fn ties_do_not_depend_on_the_order_workers_joined_and_left() {
    let run = |ids: &[&str]| {
        let mut st = ModelState::new(common::config(Mode::Kv), 9);
        let mut seq = Vec::new();
        for id in ids {
            st.on_heartbeat(&common::heartbeat(id), 0);
            // A Pick between joins: the order is rebuilt after each.
            let r = format!("join-{id}");
            let _ = st.pick(&common::input(&r, &[7; 64], Some(1)), 1);
            st.on_report(
                &pb::CompletionReport { request_id: r, model: "m".into(), total_us: 1, ..Default::default() },
                1,
            );
        }
        for i in 0..20 {
            let r = format!("r{i}");
            seq.push(st.pick(&common::input(&r, &[i; 64], Some(1)), 2).map(|o| o.worker_id).unwrap_or_default());
            st.on_report(
                &pb::CompletionReport { request_id: r, model: "m".into(), total_us: 1, ..Default::default() },
                2,
            );
        }
        seq
    };
    let forward = run(&["w1", "w2", "w3", "w4", "w5"]);
    assert_eq!(forward, run(&["w5", "w3", "w1", "w4", "w2"]));
    assert_eq!(forward.iter().collect::<std::collections::BTreeSet<_>>().len(), 5, "{forward:?}");

    // A worker that stops heartbeating leaves the candidates, one that
    // joins late enters them.
    let mut st = ModelState::new(common::config(Mode::Kv), 9);
    for id in ["w1", "w2"] {
        st.on_heartbeat(&common::heartbeat(id), 0);
    }
    assert_eq!(picked(&mut st, 10), ["w1", "w2"]);
    st.on_heartbeat(&common::heartbeat("w2"), 2_000);
    st.on_heartbeat(&common::heartbeat("w3"), 2_000);
    assert_eq!(picked(&mut st, 2_000), ["w2", "w3"]);
}

/// The admin view shows the load the cost and the timing fits see: the
/// larger of the requests routed and those measured, and the active
/// blocks (the larger of the prediction and the measurement) over the
/// capacity, none while the capacity is unknown.
#[test]
fn the_view_shows_the_requests_and_kv_fill_the_cost_sees() {
    use pb::EngineHealth as H;
    let mut st = state();
    st.on_heartbeat(&hb("w0", H::Healthy), 0);
    let view = |st: &ModelState| {
        let v = &st.worker_views(2)[0];
        (v.requests, v.kv_fill)
    };
    assert_eq!(view(&st), (0, None), "no capacity reported");
    let measured =
        pb::WorkerHeartbeat { running: 3, waiting: 1, kv_usage: 0.25, capacity_blocks: 200, ..hb("w0", H::Healthy) };
    st.on_heartbeat(&measured, 1);
    assert_eq!(view(&st), (4, Some(0.25)), "the measurement, nothing routed");
    // 60 prompt blocks routed: the prediction (more than the 50 measured
    // active blocks) is what counts.
    let tokens: Vec<u32> = (0..16 * 60).collect();
    st.pick(&common::input("long", &tokens, Some(16)), 1).unwrap();
    let (requests, fill) = view(&st);
    assert_eq!(requests, 4, "one routed is fewer than the four measured");
    let fill = fill.unwrap();
    assert!(fill > 0.3 && fill < 0.32, "{fill}");
}

/// The stream's delay is read from each relay's send stamps moved by the
/// relay clock's learned offset. A fleet of one relay whose clock steps
/// back 5 s (an NTP step) reads 5 s behind at first, which would shed every
/// Pick past `ingest_shed_after_ms`; the offset forgets its old least
/// within two windows (before, it never did and the stream read 5 s behind
/// for ever). A relay restarted on a clock 3 s further back (a new epoch)
/// is taken afresh at once.
#[test]
fn a_relay_clock_stepped_back_stops_reading_as_delay() {
    use kvgate_core::model::clock_offset::WINDOW_MS;
    const BASE_MS: u64 = 1_700_000_000_000;
    let beat = |epoch: u64, sent_ms: u64| pb::WorkerHeartbeat {
        ts_unix_nanos: sent_ms * 1_000_000,
        relay_epoch: epoch,
        ..hb("w0", pb::EngineHealth::Healthy)
    };
    let mut st = state();
    // Heartbeats every second, each processed 2 ms after it was sent.
    let mut t = 0;
    while t <= 5_000 {
        st.on_heartbeat(&beat(1, BASE_MS + t), t + 2);
        t += 1_000;
    }
    assert_eq!(st.stream_delay_ms(), 0);
    // The relay's clock steps back 5 s.
    let step = 5_000;
    let mut delays = Vec::new();
    while t <= 2 * WINDOW_MS + 5_000 {
        st.on_heartbeat(&beat(1, BASE_MS + t - step), t + 2);
        delays.push(st.stream_delay_ms());
        t += 1_000;
    }
    assert_eq!(delays[2], step, "read as delay at first");
    assert_eq!(*delays.last().unwrap(), 0, "forgotten within two windows");
    // A new relay process on a host 3 s further back.
    for _ in 0..3 {
        st.on_heartbeat(&beat(2, BASE_MS + t - step - 3_000), t + 2);
        t += 1_000;
    }
    assert_eq!(st.stream_delay_ms(), 0);
    assert!(st.worker_views(t)[0].live);
}
