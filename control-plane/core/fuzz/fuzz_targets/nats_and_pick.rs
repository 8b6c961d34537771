//! Arbitrary bytes as NATS messages (KV batches, heartbeats, replica sync)
//! and as Pick / Report requests, into one control plane with a tokenizer:
//! nothing may panic, whatever the bytes.
#![no_main]

use std::sync::{Arc, LazyLock};

use kvgate_protocol::pb;
use kvgate_core::config::{RawConfig, RawModel, RawWorker};
use kvgate_core::{App, Config};
use libfuzzer_sys::fuzz_target;
use prost::Message as _;

static APP: LazyLock<Arc<App>> = LazyLock::new(|| {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../.tools/models/deepseek-v3");
    let raw = RawConfig {
        nats_url: Some("nats://127.0.0.1:1".into()),
        models: vec![RawModel {
            name: "m".into(),
            block_size: Some(4),
            tokenizer_dir: dir.join("tokenizer.json").exists().then_some(dir),
            workers: vec![RawWorker { id: "s".into(), endpoint: "127.0.0.1:1".into() }],
            ..Default::default()
        }],
        ..Default::default()
    };
    App::new(Config::validate(raw).expect("config")).expect("app")
});

fuzz_target!(|data: &[u8]| {
    let app = &*APP;
    let Some((&sel, rest)) = data.split_first() else { return };
    let s = &app.subjects;
    match sel % 6 {
        0 => drop(app.on_nats(&s.kv_events("m", "w0"), rest)),
        1 => drop(app.on_nats(&s.heartbeat("m", "w0"), rest)),
        2 => drop(app.on_nats(&s.inflight("m"), rest)),
        3 => {
            if let Ok(req) = pb::PickRequest::decode(rest) {
                let _ = app.pick(&req);
            }
        }
        4 => {
            if let Ok(b) = pb::CompletionReportBatch::decode(rest) {
                let _ = app.report(&b);
            }
        }
        _ => {
            // A chat request whose messages are arbitrary bytes; the
            // selector's bit 6 marks the first one elided (left out by the
            // filter because the control plane said it holds it).
            let segs: Vec<pb::Segment> = rest
                .split(|b| *b == 0)
                .take(8)
                .enumerate()
                .map(|(i, m)| pb::Segment {
                    message_json: m.to_vec(),
                    elided: i == 0 && sel & 0x40 != 0,
                    ..Default::default()
                })
                .collect();
            let req = pb::PickRequest {
                model: "m".into(),
                api: pb::ApiKind::ChatCompletions as i32,
                segments: segs,
                ..Default::default()
            };
            let _ = app.pick(&req);
        }
    }
    if sel & 0x80 != 0 {
        app.tick();
    }
});
