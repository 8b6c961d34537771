//! `fading_load` on the synchronous model state: in a closed loop of
//! requests that the `kv` policy balances, a worker's difference in running
//! requests from the fleet's mean fades within a fraction of a request's
//! life, and the control plane measures it; without the setting nothing is
//! measured.

mod common;

use kvgate_core::model::{ModelConfig, ModelState};
use kvgate_protocol::pb;
use kvgate_scheduler::Mode;

/// Runs `requests` through three workers, 30 in flight, each living
/// 1.5–2.5 s of simulated time, every prompt new (no cache anywhere: load
/// decides).
fn closed_loop(fading_load: bool, requests: usize) -> ModelState {
    let config = ModelConfig { heartbeat_timeout_ms: 0, fading_load, ..common::config(Mode::Kv) };
    let mut st = ModelState::new(config, 1);
    for w in ["w0", "w1", "w2"] {
        let hb = pb::WorkerHeartbeat { interval_ms: 1_000_000, max_num_seqs: 64, ..common::heartbeat(w) };
        st.on_heartbeat(&hb, 0);
    }
    let mut rng = fastrand::Rng::with_seed(11);
    let mut open: Vec<(u64, u64, String, String)> = Vec::new();
    let mut now = 0u64;
    for i in 0..requests {
        if open.len() >= 30 {
            // The next request to end ends now.
            open.sort_by_key(|o| std::cmp::Reverse(o.0));
            let (end, start, id, worker) = open.pop().unwrap();
            now = end;
            let report = pb::CompletionReport {
                request_id: id,
                model: "m".into(),
                worker_id: worker,
                status_code: 200,
                ttfb_us: 1,
                total_us: (end - start) * 1000,
                ..Default::default()
            };
            st.on_report(&report, now);
        }
        let tokens: Vec<u32> = (0..64).map(|_| rng.u32(..)).collect();
        let id = format!("r{i}");
        let out = st.pick(&common::input(&id, &tokens, Some(16)), now).unwrap();
        let life_ms = rng.u64(1_500..2_500);
        open.push((now + life_ms, now, id, out.worker_id));
    }
    st
}

#[test]
fn load_differences_a_balancing_router_evens_out_are_measured_as_fading() {
    let st = closed_loop(true, 3_000);
    let p = st.persistence();
    let life = p.life_ms().expect("lives measured");
    assert!(life > 0.0, "{life}");
    let h = p.factor().expect("fading measured");
    // Every arrival goes to the least loaded worker: a difference lasts
    // about one arrival, far less than a request's life.
    assert!(h < 0.5, "factor {h}, decay {:?} ms, life {life} ms", p.decay_ms());
}

#[test]
fn nothing_is_measured_without_the_setting() {
    let st = closed_loop(false, 500);
    assert_eq!(st.persistence().factor(), None);
    assert_eq!(st.persistence().life_ms(), None);
}

#[test]
fn failed_answers_are_not_counted_as_lives() {
    let mut st = closed_loop(true, 500);
    let life = st.persistence().life_ms().expect("lives measured");
    for i in 0..200 {
        let report = pb::CompletionReport {
            request_id: format!("refused{i}"),
            model: "m".into(),
            worker_id: "w0".into(),
            status_code: 503,
            ttfb_us: 1,
            total_us: 1_000,
            ..Default::default()
        };
        st.on_report(&report, 1_000_000);
    }
    assert_eq!(st.persistence().life_ms(), Some(life));
}
