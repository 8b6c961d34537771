//! Session affinity on the synchronous model state: a session stays on its
//! worker while the policy would rotate it, moves when that worker is
//! saturated or gone (and stays where it moved), lapses after its TTL, is
//! learned from another replica's in-flight event, and is ignored when off.

mod common;

use kvgate_core::model::{ModelConfig, ModelState, PickInput, PickOutput, SessionConfig};
use kvgate_protocol::pb;
use kvgate_scheduler::Mode;

const TTL: u64 = 60_000;

fn state(enabled: bool) -> ModelState {
    let config = ModelConfig {
        heartbeat_timeout_ms: 0,
        session: SessionConfig { enabled, ttl_ms: TTL, max: 1000 },
        ..common::config(Mode::RoundRobin)
    };
    let mut st = ModelState::new(config, 1);
    for w in ["w0", "w1", "w2"] {
        st.on_heartbeat(&hb(w, 0), 0);
    }
    st
}

fn hb(id: &str, running: u32) -> pb::WorkerHeartbeat {
    pb::WorkerHeartbeat { interval_ms: 100_000, running, max_num_seqs: 4, ..common::heartbeat(id) }
}

/// One request of `session` at `now`, finished at once.
fn pick(st: &mut ModelState, id: &str, session: &str, now: u64) -> PickOutput {
    let input = PickInput { session, ..common::input(id, &[5; 64], Some(16)) };
    let out = st.pick(&input, now).unwrap();
    let report = pb::CompletionReport {
        request_id: id.into(),
        model: "m".into(),
        worker_id: out.worker_id.clone(),
        total_us: 1,
        ..Default::default()
    };
    st.on_report(&report, now);
    out
}

#[test]
fn a_session_stays_on_its_worker_while_others_rotate() {
    let mut st = state(true);
    let first = pick(&mut st, "s-0", "chat-1", 10);
    let mut others = std::collections::BTreeSet::new();
    let mut overridden = 0;
    for i in 1..10 {
        let o = pick(&mut st, &format!("n-{i}"), "", 10 + i);
        others.insert(o.worker_id);
        let s = pick(&mut st, &format!("s-{i}"), "chat-1", 10 + i);
        assert_eq!(s.worker_id, first.worker_id, "request {i} of the session");
        assert_eq!(s.inflight.session_id, "chat-1", "shared with the other replicas");
        // Where round robin would have sent it elsewhere, the pin decided.
        match pb::PickReason::try_from(s.reason as i32) {
            Ok(pb::PickReason::Session) => overridden += 1,
            r => assert_eq!(r, Ok(pb::PickReason::RoundRobin)),
        }
    }
    assert_eq!(others.len(), 3, "requests without a session still rotate: {others:?}");
    assert!(overridden >= 3, "{overridden}");
    assert_eq!(st.sessions().0, 1);
}

#[test]
fn a_saturated_or_gone_worker_loses_the_session_and_the_pin_moves() {
    let mut st = state(true);
    let w = pick(&mut st, "a", "chat-1", 10).worker_id;
    // Its running limit reached: the session goes where the policy says.
    st.on_heartbeat(&hb(&w, 4), 20);
    let moved = pick(&mut st, "b", "chat-1", 30).worker_id;
    assert_ne!(moved, w);
    // ... and stays there, even once the first worker has room again.
    st.on_heartbeat(&hb(&w, 0), 40);
    for i in 0..5 {
        assert_eq!(pick(&mut st, &format!("c{i}"), "chat-1", 50 + i).worker_id, moved);
    }
    // The new worker's engine goes down: the session moves again.
    let down = pb::WorkerHeartbeat { engine_health: pb::EngineHealth::Down as i32, ..hb(&moved, 0) };
    st.on_heartbeat(&down, 60);
    let again = pick(&mut st, "d", "chat-1", 70).worker_id;
    assert_ne!(again, moved);
}

#[test]
fn a_pin_lapses_after_its_ttl_from_the_last_request() {
    let mut st = state(true);
    let w = pick(&mut st, "a", "chat-1", 10).worker_id;
    // Refreshed by each request: still pinned a TTL after the first.
    assert_eq!(pick(&mut st, "b", "chat-1", TTL - 10).worker_id, w);
    assert_eq!(pick(&mut st, "c", "chat-1", TTL + 100).worker_id, w);
    // Quiet for a whole TTL: expired on upkeep, then routed by the policy.
    st.reap(2 * TTL + 200);
    assert_eq!(st.sessions().0, 0);
    // Round robin (w0, w1, w2 in turn) is set up to send the next request
    // away from the old worker: the session follows it.
    let next = |x: &str| format!("w{}", (x[1..].parse::<usize>().unwrap() + 1) % 3);
    let mut rr = pick(&mut st, "d0", "", 2 * TTL + 300).worker_id;
    if next(&rr) == w {
        rr = pick(&mut st, "d1", "", 2 * TTL + 301).worker_id;
    }
    let after = pick(&mut st, "e", "chat-1", 2 * TTL + 302);
    assert_eq!(after.worker_id, next(&rr));
    assert_ne!(after.worker_id, w, "the lapsed pin no longer decides");
    assert_eq!(after.reason, pb::PickReason::RoundRobin);
}

#[test]
fn another_replicas_decision_pins_the_session_here() {
    let mut st = state(true);
    let ev = pb::InflightEvent {
        request_id: "elsewhere".into(),
        worker_id: "w2".into(),
        phase: pb::InflightPhase::Added as i32,
        prompt_blocks: 4,
        expected_output_tokens: 16,
        session_id: "chat-9".into(),
        ..Default::default()
    };
    st.on_replica_event(&ev, 5);
    for i in 0..4 {
        assert_eq!(pick(&mut st, &format!("r{i}"), "chat-9", 10 + i).worker_id, "w2");
    }
}

#[test]
fn off_by_default_a_session_header_changes_nothing() {
    let mut st = state(false);
    let seen: std::collections::BTreeSet<String> =
        (0..6).map(|i| pick(&mut st, &format!("r{i}"), "chat-1", 10 + i).worker_id).collect();
    assert_eq!(seen.len(), 3);
    assert_eq!(st.sessions().0, 0);
}
