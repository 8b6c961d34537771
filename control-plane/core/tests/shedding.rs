//! Picks give way to ingest: while the event stream is processed
//! `ingest_shed_after_ms` or more behind (the relays' heartbeats are
//! processed that much later than they could be), a Pick is routed by load
//! without tokenizing or looking its prompt up, and counted; once the
//! stream catches up, Picks are scored again. With the setting at 0 they
//! never are shed. Heartbeats go through `App::on_nats` as from NATS, with
//! send stamps that say how late each is processed; the stream's delay is
//! judged per second of processing time, so the test sleeps past each.

mod common;

use std::sync::Arc;
use std::time::Duration;

use kvgate_core::config::{RawConfig, RawModel};
use kvgate_core::{App, Config};
use kvgate_protocol::pb;
use prost::Message as _;

/// A relay's clock, set far apart from the control plane's (ms).
const RELAY_CLOCK_MS: u64 = 1_700_000_000_000;

fn app(shed_after_ms: u64) -> Arc<App> {
    let raw = RawConfig {
        listen_admin: Some("off".into()),
        ingest_shed_after_ms: Some(shed_after_ms),
        models: vec![RawModel { name: "m".into(), block_size: Some(16), ..Default::default() }],
        ..Default::default()
    };
    App::new(Config::validate(raw).unwrap()).unwrap()
}

/// Worker `w1`'s heartbeat, stamped as sent `late_ms` before now.
fn heartbeat(a: &App, late_ms: u64) {
    let hb = pb::WorkerHeartbeat {
        ts_unix_nanos: (RELAY_CLOCK_MS + a.now_ms() - late_ms) * 1_000_000,
        ..common::heartbeat("w1")
    };
    a.on_nats(&a.subjects.heartbeat("m", "w1"), &hb.encode_to_vec());
}

fn pick(a: &App, tokens: &[u32]) -> pb::PickResponse {
    let req = pb::PickRequest {
        model: "m".into(),
        request_id: format!("r{}", a.now_ms()),
        api: pb::ApiKind::Completions as i32,
        prompt: Some(pb::pick_request::Prompt::PromptTokenIds(pb::TokenIds { ids: tokens.to_vec() })),
        ..Default::default()
    };
    a.pick(&req).unwrap()
}

fn shed_count(a: &App) -> String {
    a.render_metrics().lines().find(|l| l.starts_with("kvgate_picks_shed_total")).unwrap_or_default().to_owned()
}

/// Heartbeats `late_ms` behind, every 350 ms over 2.1 s of processing: a
/// window of one second (three steps or fewer) opens and closes among them.
fn two_seconds_of(apps: &[&App], late_ms: u64) {
    for _ in 0..7 {
        for a in apps {
            heartbeat(a, late_ms);
        }
        std::thread::sleep(Duration::from_millis(350));
    }
}

#[test]
fn picks_are_routed_by_load_while_the_stream_is_behind_and_scored_when_it_catches_up() {
    let (on, off) = (app(500), app(0));
    let doc: Vec<u32> = (0..64).map(|i| 100 + i).collect();
    for a in [&on, &off] {
        heartbeat(a, 0);
        a.on_nats(&a.subjects.kv_events("m", "w1"), &common::stored("w1", 1, &doc).encode_to_vec());
    }
    two_seconds_of(&[&on, &off], 0);
    let scored = pick(&on, &doc);
    assert_eq!((scored.matched_blocks, scored.total_blocks), (4, 4), "{scored:?}");

    // Ingest falls 2 s behind.
    two_seconds_of(&[&on, &off], 2000);
    let shed = pick(&on, &doc);
    assert_eq!(shed.worker_id, "w1", "still answered, by load");
    assert_eq!((shed.matched_blocks, shed.total_blocks), (0, 0), "nor tokenized nor looked up: {shed:?}");
    assert_eq!(shed.reason, pb::PickReason::Fallback as i32);
    assert_eq!(shed_count(&on), "kvgate_picks_shed_total 1");
    assert!(on.render_metrics().contains("kvgate_event_stream_delay_seconds{model=\"m\"} 2."), "the delay is exported");
    let never = pick(&off, &doc);
    assert_eq!((never.matched_blocks, never.total_blocks), (4, 4), "0 = never shed: {never:?}");
    assert_eq!(shed_count(&off), "kvgate_picks_shed_total 0");

    // It catches up.
    two_seconds_of(&[&on, &off], 10);
    let again = pick(&on, &doc);
    assert_eq!((again.matched_blocks, again.total_blocks), (4, 4), "{again:?}");
    assert_eq!(shed_count(&on), "kvgate_picks_shed_total 1");
}
