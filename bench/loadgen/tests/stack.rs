//! The benchmark's own parts against the real stack on 127.0.0.1: a short
//! DOKS cell through Envoy + kvgate (kv mode) and through sglang-router, with
//! the rows the report is made of. Uses the `kvgate` binary of this build
//! (target/debug, which `cargo nextest run --workspace` builds) unless
//! KVGATE_BIN names another.

use std::time::Duration;

use kvgate_bench::runner::{Windows, run_doks};
use kvgate_bench::stack::{FleetSpec, Frontend, Stack, tokenizer_dir};
use kvgate_bench::stats::summarize;
use kvgate_bench::workload::Doks;

/// A cell's row, and the polls of the control plane's `/admin/timing`
/// kept while it ran (none without a kvgate control plane).
fn cell(front: Frontend) -> (kvgate_bench::stats::Row, Vec<serde_json::Value>) {
    let dir = kvgate_testkit::scratch_dir(&format!("bench-{}", front.name())).unwrap();
    // Fast simulated time, few users, short windows: a smoke cell.
    let mut fleet = FleetSpec { num_blocks: 4_000, ..FleetSpec::doks(25.0, 8) };
    if std::env::var_os("KVGATE_BIN").is_none() {
        fleet.kvgate = kvgate_testkit::repo_root().join("target/debug/kvgate");
    }
    assert!(fleet.kvgate.exists(), "{} not built: cargo build -p kvgate", fleet.kvgate.display());
    let mut stack = Stack::start(&dir, &fleet, &front).unwrap();
    // Shorter conversations keep the cell small: ~600-word starters.
    let workload = Doks { starter_words: (500, 700), output_tokens: (40, 80), ..Doks::default() };
    let shared = workload.starter_shared_tokens(&tokenizer_dir()).unwrap();
    let windows =
        Windows { warmup: Duration::from_secs(2), measure: Duration::from_secs(4), drain: Duration::from_secs(20) };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let polls = stack.poll_timing(Duration::from_millis(200));
    let run = rt.block_on(run_doks(stack.front, &stack.workers, &stack.pids, &workload, 6, windows, 0)).unwrap();
    let polls = polls.map(|p| {
        p.finish(&dir).unwrap();
        serde_json::from_slice(&std::fs::read(dir.join("timing-polls.json")).unwrap()).unwrap()
    });
    stack.check().unwrap();
    let row = summarize(&front.name(), 6, &run, 25.0, 32, kvgate_bench::stats::Oracle::Doks(&shared), 1.01);
    (row, polls.unwrap_or_default())
}

#[test]
fn a_cell_through_kvgate_measures_every_column() {
    let (r, polls) = cell(Frontend::Kvgate("kv".into()));
    assert_eq!(r.errors, 0, "{r:?}");
    assert!(r.requests >= 6, "{r:?}");
    assert!(r.ttft_p50_ms > 0.0 && r.ttft_p95_ms >= r.ttft_p50_ms, "{r:?}");
    // The workers' own TTFT, in the same unit and time base (the sets of
    // requests differ a little at the window edges, hence the margin).
    assert!(r.worker_ttft_mean_ms > 0.0 && r.worker_ttft_mean_ms < 1.5 * r.ttft_mean_ms, "{r:?}");
    assert!(r.itl_p50_ms > 5.0 && r.e2e_p50_s > 0.0 && r.output_tok_per_s > 0.0, "{r:?}");
    // Later turns reuse the earlier ones: the workers report hits.
    assert!(r.hit_rate > 0.3 && r.oracle_hit_rate > 0.3, "{r:?}");
    assert!(r.cpu_by_role.iter().any(|(role, s)| role == "envoy" && *s > 0.0), "{r:?}");
    // The router names each request's worker: later turns are counted,
    // the moved among them.
    assert!(r.follow_ups.is_some_and(|n| n > 0 && r.moved.is_some_and(|m| m <= n)), "{r:?}");
    // The learned timing was polled while the load ran (six seconds of
    // it, a poll every 200 ms), each poll the model's classes.
    assert!(polls.len() >= 5, "{}", polls.len());
    assert!(polls.iter().all(|p| p["t"].is_f64() && p["timing"]["deepseek-v3"]["classes"].is_object()), "{polls:?}");
}

#[test]
fn a_cell_through_sglang_router_measures_every_column() {
    let (r, polls) = cell(Frontend::Sglang("cache_aware".into()));
    // No kvgate route to count moves by, no control plane to poll.
    assert!(r.moved.is_none() && r.follow_ups.is_none() && polls.is_empty(), "{r:?}");
    assert_eq!(r.errors, 0, "{r:?}");
    assert!(r.requests >= 6, "{r:?}");
    assert!(r.hit_rate > 0.3, "{r:?}");
    assert!(r.worker_ttft_mean_ms > 0.0 && r.worker_ttft_mean_ms < 1.5 * r.ttft_mean_ms, "{r:?}");
    assert!(r.cpu_by_role.iter().any(|(role, _)| role == "sglang-router"), "{r:?}");
}
