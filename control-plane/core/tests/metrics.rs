//! Every counter the control plane keeps is exported: a failing sampled
//! verification of cached tokenization, a hash mismatch or a failed
//! replica-sync publish must show on `/metrics`, not only in memory. The
//! walk checks every registered family has its help and at least one
//! sample; the named series are the ones that were once counted and never
//! exported.

use std::collections::BTreeMap;

use kvgate_core::config::{RawConfig, RawModel, RawWorker};
use kvgate_core::{App, Config};

fn app() -> std::sync::Arc<App> {
    let raw = RawConfig {
        listen_admin: Some("off".into()),
        models: vec![RawModel {
            name: "m".into(),
            block_size: Some(16),
            tokenizer_dir: Some(kvgate_testkit::repo_root().join(".tools/models/deepseek-v3")),
            workers: vec![RawWorker { id: "w0".into(), endpoint: "10.0.0.1:8000".into() }],
            ..Default::default()
        }],
        ..Default::default()
    };
    App::new(Config::validate(raw).unwrap()).unwrap()
}

/// `# TYPE` families with their help and sample count.
fn families(text: &str) -> BTreeMap<String, (String, String, usize)> {
    let mut out: BTreeMap<String, (String, String, usize)> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            out.entry(name.to_owned()).or_default().0 = help.to_owned();
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            out.entry(name.to_owned()).or_default().1 = kind.to_owned();
        }
    }
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name = line.split(['{', ' ']).next().unwrap();
        let family = out.keys().filter(|f| name.starts_with(f.as_str())).max_by_key(|f| f.len()).cloned();
        let family = family.unwrap_or_else(|| panic!("sample {line:?} belongs to no family"));
        out.get_mut(&family).unwrap().2 += 1;
    }
    out
}

#[test]
fn every_registered_family_has_help_a_type_and_samples() {
    let a = app();
    // One pick, so that the request paths' families have samples too.
    let req = kvgate_core::chat_pick_request("m", "r1", &[serde_json::json!({"role": "user", "content": "hi"})], None);
    let picked = a.pick(&req).unwrap();
    // Its end, so that the engine-timing families have a class.
    let done = kvgate_protocol::pb::CompletionReport {
        request_id: "r1".into(),
        model: "m".into(),
        worker_id: picked.worker_id.clone(),
        endpoint: picked.endpoint.clone(),
        status_code: 200,
        ttfb_us: 20_000,
        total_us: 90_000,
        prompt_tokens: Some(12),
        cached_tokens: Some(0),
        output_tokens: Some(8),
        stream: true,
        ..Default::default()
    };
    a.report(&kvgate_protocol::pb::CompletionReportBatch { reports: vec![done], ..Default::default() });
    let text = a.render_metrics();
    assert!(text.ends_with("# EOF\n"), "OpenMetrics text ends with # EOF");
    let fams = families(&text);
    assert!(fams.len() > 30, "{} families", fams.len());
    for family in [
        "kvgate_engine_timing_observations",
        "kvgate_engine_timing_samples",
        "kvgate_engine_timing_rejected",
        "kvgate_engine_timing_changes",
        "kvgate_engine_timing",
        "kvgate_engine_timing_stderr",
        "kvgate_engine_timing_used",
    ] {
        assert!(fams.contains_key(family), "{family} missing in\n{text}");
    }
    assert!(text.contains("kvgate_engine_timing_observations_total{model=\"m\",kind=\"first_token\"} 1\n"), "{text}");
    // The one configured worker has no relay: its stream is static.
    assert!(text.contains("kvgate_worker_streams{model=\"m\",state=\"static\"} 1\n"), "{text}");
    assert!(text.contains("kvgate_worker_streams{model=\"m\",state=\"synced\"} 0\n"), "{text}");
    for (name, (help, kind, samples)) in &fams {
        assert!(!help.trim().is_empty(), "{name} has no help");
        assert!(["counter", "gauge", "histogram"].contains(&kind.as_str()), "{name}: type {kind:?}");
        assert!(*samples > 0, "{name} has no sample");
    }
}

#[test]
fn counters_once_kept_but_not_exported_are_exported() {
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

#[test]
fn every_ingest_hold_of_the_index_is_observed() {
    let a = app();
    let count = |a: &App| {
        let text = a.render_metrics();
        let line = text
            .lines()
            .find(|l| l.starts_with("kvgate_ingest_lock_hold_seconds_count{model=\"m\"}"))
            .unwrap_or_else(|| panic!("no hold count in\n{text}"))
            .to_owned();
        line.rsplit(' ').next().unwrap().parse::<u64>().unwrap()
    };
    assert_eq!(count(&a), 0);
    let subjects = kvgate_protocol::subject::Subjects::new(kvgate_protocol::subject::DEFAULT_PREFIX).unwrap();
    for seq in 1..=3u64 {
        let batch = kvgate_protocol::pb::KvEventBatch {
            worker_id: "w0".into(),
            model: "m".into(),
            relay_epoch: 1,
            relay_seq: seq,
            ..Default::default()
        };
        a.on_nats(&subjects.kv_events("m", "w0"), &prost::Message::encode_to_vec(&batch));
    }
    // A malformed message takes no hold.
    a.on_nats(&subjects.kv_events("m", "w0"), b"\xff\xff");
    assert_eq!(count(&a), 3);
}
