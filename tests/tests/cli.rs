//! `kvgate` as a user starts it from a shell.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

mod common;

/// With `.tools/env` sourced (KVGATE_TOKENIZER_DIR exported), a config file
/// alone must start the control plane (it used to fail: "the following
/// required arguments were not provided: --model").
#[test]
fn serve_with_a_config_file_and_the_environment_starts() {
    let dir = kvgate_testkit::scratch_dir("cli-config").unwrap();
    let tk = common::tokenizer_dir();
    let config = dir.join("kvgate.toml");
    std::fs::write(
        &config,
        format!(
            "listen_grpc = \"127.0.0.1:0\"\nlisten_admin = \"off\"\nnats_url = \"off\"\n\n[[models]]\nname = \"m\"\ntokenizer_dir = {:?}\nblock_size = 16\nworkers = [{{ id = \"w0\", endpoint = \"127.0.0.1:9\" }}]\n",
            tk.to_str().unwrap()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["serve", "--config"])
        .arg(&config)
        .env("KVGATE_TOKENIZER_DIR", &tk)
        .env("KVGATE_BLOCK_SIZE", "32")
        .env_remove("KVGATE_MODEL")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let started = loop {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(l) if l.starts_with("kvgate serve: grpc=") => break true,
            Ok(l) => seen.push(l),
            Err(_) => break false,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(started, "kvgate serve did not start:\n{}", seen.join("\n"));
}

/// A per-model flag on the command line without --model is refused, and
/// the error says what to do.
#[test]
fn a_model_flag_without_model_is_refused_clearly() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["serve", "--block-size", "32", "--nats-url", "off"])
        .env_remove("KVGATE_MODEL")
        .env_remove("KVGATE_TOKENIZER_DIR")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--block-size") && err.contains("--model"), "{err}");
}

/// `kvgate envoy-config` prints a bootstrap that Envoy 1.40 accepts, with
/// the workers, the control plane and the filter configuration in it (a
/// user no longer fills envoy/kvgate.yaml's placeholders by hand).
#[test]
fn envoy_config_renders_a_bootstrap_envoy_accepts() {
    let dir = kvgate_testkit::scratch_dir("cli-envoy-config").unwrap();
    let wasm = kvgate_testkit::filter_wasm().unwrap();
    let out_file = dir.join("envoy.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["envoy-config", "--listen", "127.0.0.1:0", "--admin-port", "0"])
        .args(["--worker", "127.0.0.1:8001", "--worker", "127.0.0.1:8002", "--control-plane", "127.0.0.1:50051"])
        .arg("--wasm")
        .arg(&wasm)
        .args(["--filter-config", r#"{"failure_mode": "open", "debug_headers": true}"#])
        .arg("--out")
        .arg(&out_file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let yaml = std::fs::read_to_string(&out_file).unwrap();
    assert!(yaml.contains("port_value: 8002") && yaml.contains("debug_headers") && !yaml.contains("${"));
    kvgate_testkit::envoy_validate(&out_file).unwrap();
    // A filter configuration that is not JSON is refused with the flag's name.
    let bad = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["envoy-config", "--worker", "127.0.0.1:8001", "--wasm", "/x.wasm", "--filter-config", "{nope"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--filter-config"));
}
