//! Data-parallel ranks on the synchronous model state: each rank of a
//! server is a worker of its own behind the server's one endpoint; a pick
//! names the rank (for `x-data-parallel-rank`), its fallbacks are other
//! servers that run that rank, and a server that refuses connections takes
//! all its ranks out of routing.

mod common;

use kvgate_core::model::{ModelState, PickOutput};
use kvgate_protocol::pb;
use kvgate_scheduler::Mode;

/// Rank `rank` of `size` at `endpoint`.
fn rank_hb(endpoint: &str, rank: u32, size: u32) -> pb::WorkerHeartbeat {
    let worker_id = if size > 1 { format!("{endpoint}/dp{rank}") } else { endpoint.to_owned() };
    pb::WorkerHeartbeat {
        worker_id,
        endpoint: endpoint.into(),
        data_parallel_rank: rank,
        data_parallel_size: size,
        interval_ms: 100_000,
        ..common::heartbeat("w0")
    }
}

/// Servers A and B with two ranks each, C without data parallelism.
fn fleet() -> ModelState {
    let mut st = ModelState::new(common::config(Mode::Kv), 1);
    for r in 0..2 {
        st.on_heartbeat(&rank_hb("10.0.0.1:8000", r, 2), 0);
        st.on_heartbeat(&rank_hb("10.0.0.2:8000", r, 2), 0);
    }
    st.on_heartbeat(&rank_hb("10.0.0.3:8000", 0, 1), 0);
    st
}

fn tokens() -> Vec<u32> {
    (0..16 * 8).map(|t| 2000 + t).collect()
}

/// `worker` caches the first 6 blocks of [`tokens`].
fn store(st: &mut ModelState, worker: &str) {
    st.on_batch(common::stored(worker, 1, &tokens()[..96]), 1);
}

fn pick(st: &mut ModelState, id: &str, now: u64) -> PickOutput {
    let t = tokens();
    let input = common::input(id, &t, Some(16));
    st.pick(&input, now).unwrap()
}

#[test]
fn a_pick_names_the_rank_that_holds_the_prompt() {
    let mut st = fleet();
    store(&mut st, "10.0.0.1:8000/dp1");
    let out = pick(&mut st, "a", 2);
    assert_eq!(out.worker_id, "10.0.0.1:8000/dp1");
    assert_eq!((out.endpoint.as_str(), out.dp_rank, out.matched_blocks), ("10.0.0.1:8000", Some(1), 6));
    assert_eq!(out.reason, pb::PickReason::Kv);
    // The admin view shows the rank.
    let views = st.worker_views(2);
    let v = views.iter().find(|v| v.id == "10.0.0.1:8000/dp1").unwrap();
    assert_eq!(v.dp_rank, Some(1));
    assert_eq!(views.iter().find(|v| v.id == "10.0.0.3:8000").unwrap().dp_rank, None);
}

#[test]
fn fallbacks_are_other_servers_that_run_the_rank() {
    let config = kvgate_core::model::ModelConfig {
        kv: kvgate_scheduler::KvConfig { fallbacks: 4, ..Default::default() },
        ..common::config(Mode::Kv)
    };
    let mut st = ModelState::new(config, 1);
    for r in 0..2 {
        st.on_heartbeat(&rank_hb("10.0.0.1:8000", r, 2), 0);
        st.on_heartbeat(&rank_hb("10.0.0.2:8000", r, 2), 0);
    }
    st.on_heartbeat(&rank_hb("10.0.0.3:8000", 0, 1), 0);
    store(&mut st, "10.0.0.1:8000/dp1");
    let out = pick(&mut st, "a", 2);
    assert_eq!(out.dp_rank, Some(1));
    // Not A again (same server), not C (no rank 1: vLLM would answer 400),
    // B once although both its ranks are runners-up.
    assert_eq!(out.fallbacks, vec!["10.0.0.2:8000".to_owned()]);
    // A worker without data parallelism: every other server qualifies.
    store(&mut st, "10.0.0.3:8000");
    let batch = pb::KvEventBatch {
        worker_id: "10.0.0.1:8000/dp1".into(),
        model: "m".into(),
        relay_epoch: 1,
        relay_seq: 2,
        events: vec![pb::KvEvent { event: Some(pb::kv_event::Event::Cleared(pb::AllBlocksCleared {})) }],
        ..Default::default()
    };
    st.on_batch(batch, 3);
    let out = pick(&mut st, "b", 4);
    assert_eq!((out.endpoint.as_str(), out.dp_rank), ("10.0.0.3:8000", None));
    let mut fb = out.fallbacks.clone();
    fb.sort();
    assert_eq!(fb, vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()]);
}

/// The runners-up that qualify are taken from the policy's whole ranking:
/// with the default two fallbacks, the best runners-up being the chosen
/// server's other rank and a server without rank 1 does not leave the
/// request with none.
#[test]
fn a_rank_keeps_its_fallbacks_when_the_best_runners_up_cannot_serve_it() {
    let mut st = ModelState::new(common::config(Mode::Kv), 1);
    let busy = |endpoint: &str, rank: u32, size: u32, running: u32| pb::WorkerHeartbeat {
        running,
        max_num_seqs: 64,
        ..rank_hb(endpoint, rank, size)
    };
    // Least loaded after A/dp1: A/dp0, then C (rank 0 only), then B and D.
    for (endpoint, loads) in [("10.0.0.1:8000", [0, 0]), ("10.0.0.2:8000", [20, 8]), ("10.0.0.4:8000", [20, 9])] {
        for r in 0..2 {
            st.on_heartbeat(&busy(endpoint, r, 2, loads[r as usize]), 0);
        }
    }
    st.on_heartbeat(&busy("10.0.0.3:8000", 0, 1, 1), 0);
    store(&mut st, "10.0.0.1:8000/dp1");
    let out = pick(&mut st, "a", 2);
    assert_eq!((out.worker_id.as_str(), out.dp_rank), ("10.0.0.1:8000/dp1", Some(1)));
    assert_eq!(out.fallbacks, vec!["10.0.0.2:8000".to_owned(), "10.0.0.4:8000".to_owned()]);
}

#[test]
fn a_server_that_refuses_connections_takes_all_its_ranks_out() {
    let mut st = fleet();
    store(&mut st, "10.0.0.1:8000/dp1");
    // Envoy could not reach A twice (the suspect threshold): served by B.
    for i in 0..2 {
        let report = pb::CompletionReport {
            request_id: format!("r{i}"),
            model: "m".into(),
            worker_id: "10.0.0.1:8000/dp1".into(),
            endpoint: "10.0.0.1:8000".into(),
            served_endpoint: "10.0.0.2:8000".into(),
            status_code: 200,
            total_us: 1,
            ..Default::default()
        };
        st.on_report(&report, 2 + i);
    }
    let live: Vec<String> = st.worker_views(5).into_iter().filter(|v| v.live).map(|v| v.id).collect();
    assert_eq!(live, vec!["10.0.0.2:8000/dp0", "10.0.0.2:8000/dp1", "10.0.0.3:8000"]);
    assert_ne!(pick(&mut st, "a", 6).endpoint, "10.0.0.1:8000");
}
