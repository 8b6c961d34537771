//! NVIDIA Dynamo as a benchmark mode, for real: short cache-pressure cells
//! of `dynamo` (its KV router) and `dynamo_round_robin`, Dynamo 1.6.1's own
//! frontend and mocker workers (scripts/setup-dynamo.sh), driven by the
//! benchmark binary inside a private network namespace with only loopback
//! (Dynamo binds 0.0.0.0). The rows must carry every column the reports use.

use std::process::Command;

use kvgate_bench::stack::only_loopback;

fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvgate-bench"))
}

const CELL: [&str; 15] = [
    "cache-pressure",
    "--preset",
    "dynamo-mocker",
    "--levels",
    "2",
    "--speedup",
    "10",
    "--warmup-s",
    "20",
    "--measure-s",
    "40",
    "--drain-s",
    "60",
    "--stream-interval",
    "8",
];

#[test]
fn dynamo_cells_run_in_a_private_network_namespace_and_measure_every_column() {
    let root = kvgate_testkit::repo_root();
    if let Ok(reason) = std::fs::read_to_string(root.join(".tools/dynamo.failed")) {
        panic!("Dynamo did not install (scripts/setup-dynamo.sh):\n{reason}");
    }
    let dir = kvgate_testkit::scratch_dir("bench-dynamo").unwrap();
    let out = dir.join("cache-pressure.json");
    let (out_s, dir_s) = (out.to_str().unwrap(), dir.to_str().unwrap());

    // On a machine with other interfaces, the mode refuses to start outside
    // a private namespace.
    if !only_loopback() {
        let o = bench().args(CELL).args(["--modes", "dynamo", "--out", out_s, "--run-dir", dir_s]).output().unwrap();
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("private network namespace"), "{err}");
    }

    let o = Command::new("unshare")
        .args(["-n", "sh", "-c", "ip link set lo up && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_kvgate-bench"))
        .args(CELL)
        .args(["--modes", "dynamo_round_robin,dynamo", "--out", out_s, "--run-dir", dir_s])
        .output()
        .unwrap();
    let log = format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{log}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let rows = doc["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{doc}");
    for r in rows {
        assert_eq!(r["rate_or_concurrency"], 2, "{r}");
        assert_eq!(r["errors"], 0, "{r}\n{log}");
        assert!(r["requests"].as_u64().unwrap() >= 40, "{r}");
        let ttft = |k: &str| r[k].as_f64().unwrap();
        assert!(ttft("ttft_p50_ms") > 0.0 && ttft("ttft_p90_ms") >= ttft("ttft_p50_ms"), "{r}");
        assert!(r["itl_p50_ms"].as_f64().unwrap() > 0.0 && r["output_tok_per_s"].as_f64().unwrap() > 0.0, "{r}");
        // Dynamo does not say what it predicted.
        assert!(r["mispredicted"].is_null(), "{r}");
    }
    // Tenants come back within the window: Dynamo's KV router sends them to
    // their cache (the hit rate is what its engines reported to the client).
    let kv = rows.iter().find(|r| r["mode"] == "dynamo").unwrap();
    assert!(kv["hit_rate"].as_f64().unwrap() > 0.0, "{kv}");
    assert!(doc["slo_goodput"]["p95"].get("dynamo").is_some(), "{doc}");
}
