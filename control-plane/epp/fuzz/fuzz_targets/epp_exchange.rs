//! Arbitrary sequences of ext_proc messages (decoded ProcessingRequests,
//! headers in every body mode, request and response body chunks of arbitrary
//! bytes) through one endpoint-picker exchange of a control plane with a
//! tokenizer and static workers: nothing may panic, whatever the order or
//! the bytes (`kvgate_epp::drive_exchange`).
#![no_main]

use std::sync::{Arc, LazyLock};

use kvgate_core::config::{RawConfig, RawModel, RawWorker};
use kvgate_core::{App, Config};
use libfuzzer_sys::fuzz_target;

static APP: LazyLock<Arc<App>> = LazyLock::new(|| {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../.tools/models/deepseek-v3");
    let raw = RawConfig {
        models: vec![RawModel {
            name: "deepseek-v3".into(),
            block_size: Some(16),
            tokenizer_dir: dir.join("tokenizer.json").exists().then_some(dir),
            workers: (0..3).map(|i| RawWorker { id: format!("w{i}"), endpoint: format!("127.0.0.{i}:8000") }).collect(),
            ..Default::default()
        }],
        ..Default::default()
    };
    App::new(Config::validate(raw).expect("config")).expect("app")
});

fuzz_target!(|data: &[u8]| {
    let _ = kvgate_epp::drive_exchange(APP.clone(), data);
});
