//! The core is synchronous: its manifest names no async runtime, RPC, HTTP
//! or NATS crate.

#[test]
fn the_core_has_no_runtime_or_network_dependency() {
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).unwrap();
    let deps = manifest.split("[dependencies]").nth(1).unwrap().split("\n[").next().unwrap();
    for banned in ["tokio", "tonic", "axum", "hyper", "async-nats", "futures", "reqwest", "tower", "http "] {
        let names: Vec<&str> = deps.lines().filter_map(|l| l.split('=').next()).map(str::trim).collect();
        assert!(!names.iter().any(|n| n.starts_with(banned.trim())), "kvgate-core depends on {banned}: {names:?}");
    }
}
