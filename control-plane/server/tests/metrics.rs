//! Every counter the control plane keeps is exported: a failing sampled
//! verification of cached tokenization, a hash mismatch or a failed
//! replica-sync publish must show on `/metrics`, not only in memory.

use kvgate_server::config::{RawConfig, RawModel};
use kvgate_server::{App, Config};

fn app() -> std::sync::Arc<App> {
    let raw = RawConfig {
        listen_admin: Some("off".into()),
        models: vec![RawModel {
            name: "m".into(),
            block_size: Some(16),
            tokenizer_dir: Some(kvgate_e2e::repo_root().join(".tools/models/deepseek-v3")),
            ..Default::default()
        }],
        ..Default::default()
    };
    App::new(Config::validate(raw).unwrap()).unwrap().0
}

#[test]
fn tokenizer_and_publish_counters_are_exported() {
    let m = app().render_metrics();
    for series in [
        "kvgate_tokenize_verify_failures_total{model=\"m\"} 0\n",
        "kvgate_tokenize_hash_mismatches_total{model=\"m\"} 0\n",
        "kvgate_tokenize_prefix_unstable_total{model=\"m\"} 0\n",
        "kvgate_tokenize_unsafe_boundaries_total{model=\"m\"} 0\n",
        "kvgate_inflight_publish_errors_total 0\n",
        "kvgate_index_events_total{model=\"m\",kind=\"hash_conflict\"} 0\n",
        "kvgate_index_events_total{model=\"m\",kind=\"capacity_eviction\"} 0\n",
    ] {
        assert!(m.contains(series), "missing {series:?} in\n{m}");
    }
}
