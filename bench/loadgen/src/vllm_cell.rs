//! `kvgate-bench vllm`: the routing modes on real engines (issue #20).
//!
//! Two vLLM 0.32 engines (CPU build, the locally built tiny Llama, block
//! size 32, 8,192 tokens of KV cache each so that conversations evict each
//! other; `kvgate_testkit::vllm`), one fleet for every mode. Before each mode
//! the engines' prefix caches are reset (`/reset_prefix_cache`, which
//! publishes `AllBlocksCleared`), then the same conversations (the OpenAI
//! SDK, `tests/tools/openai_conversations.py`, same seed) run through the
//! mode's frontend: Envoy with the filter and the control plane in `kv` or
//! `round_robin`, or sglang-router's `cache_aware` policy.
//!
//! Timings on CPU mean little; what is real: the hit rate (vLLM's own
//! `cached_tokens`), the oracle (one unbounded cache shared by both
//! engines, from vLLM's own prompt token ids), how often kvgate's
//! predicted overlap equals what vLLM reported, errors, and the load skew
//! (requests served by the busiest engine / the mean).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use kvgate_testkit::vllm::{Fleet, MODEL, conversations};
use kvgate_testkit::{Envoy, Proc, free_port, http_request, render_kvgate_envoy, repo_root};
use serde_json::{Value, json};

use crate::stack::{kvgate_bin, spawn_sglang, tokenizer_dir, wait_until};

/// The cell's arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct VllmArgs {
    /// Conversations per mode (4 turns each, then a completions request).
    #[arg(long, default_value_t = 12)]
    pub convs: usize,
    /// Concurrent conversations.
    #[arg(long, default_value_t = 2)]
    pub concurrency: usize,
    /// Workload seed (the same for every mode).
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Modes, in order.
    #[arg(long, value_delimiter = ',', default_value = "kv,round_robin,sglang_cache_aware")]
    pub modes: Vec<String>,
    /// Result file.
    #[arg(long, default_value = "bench/results/vllm.json")]
    pub out: PathBuf,
}

/// The control plane and Envoy in front of the fleet.
struct Kvgate {
    _serve: Proc,
    admin: SocketAddr,
    envoy: Envoy,
}

fn start_kvgate(fleet: &Fleet, dir: &Path) -> Result<Kvgate> {
    let (gp, ap) = (free_port()?, free_port()?);
    let tk = tokenizer_dir();
    let mut serve = Command::new(kvgate_bin());
    serve.args(["serve", "--model", MODEL, "--tokenizer-dir"]).arg(&tk);
    serve.args(["--block-size", "32", "--nats-url", &fleet.nats_url()]);
    serve.args(["--listen-grpc", &format!("127.0.0.1:{gp}"), "--listen-admin", &format!("127.0.0.1:{ap}")]);
    serve.args(["--replica-id", "cp-bench-vllm"]);
    let serve = Proc::spawn("serve", serve, dir)?;
    let admin: SocketAddr = ([127, 0, 0, 1], ap).into();
    kvgate_testkit::wait_for_tcp(admin, Duration::from_secs(60))?;
    let filter = json!({"control_plane": {"timeout_ms": 1000}, "debug_headers": true, "reports": {"interval_ms": 100}});
    let config = dir.join("envoy.yaml");
    let grpc: SocketAddr = ([127, 0, 0, 1], gp).into();
    std::fs::write(&config, render_kvgate_envoy(0, 0, &fleet.http(), &[grpc], &filter.to_string())?)?;
    let envoy = Envoy::start(&config, dir)?;
    let k = Kvgate { _serve: serve, admin, envoy };
    wait_until("both engines live in the control plane", 60, || {
        let w = workers(k.admin);
        Ok(w.len() == fleet.engines.len() && w.iter().all(|x| x["live"] == true))
    })?;
    Ok(k)
}

fn workers(admin: SocketAddr) -> Vec<Value> {
    http_request(admin, "GET", "/admin/workers", &[], b"")
        .ok()
        .and_then(|r| serde_json::from_slice::<Value>(&r.body).ok())
        .and_then(|v| v[MODEL].as_array().cloned())
        .unwrap_or_default()
}

fn cp_metric(admin: SocketAddr, series: &str) -> f64 {
    let body = http_request(admin, "GET", "/metrics", &[], b"").map(|r| r.body).unwrap_or_default();
    String::from_utf8_lossy(&body)
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

fn start_sglang(fleet: &Fleet, dir: &Path, policy: &str) -> Result<(Proc, SocketAddr)> {
    let (p, front) = spawn_sglang(&fleet.http(), dir, policy)?;
    wait_until("sglang-router to route", 60, || {
        Ok(http_request(front, "GET", "/v1/models", &[], b"").is_ok_and(|r| r.status == 200))
    })?;
    Ok((p, front))
}

/// Empties both engines' prefix caches. vLLM queues `AllBlocksCleared` and
/// publishes it with its next scheduler step: a request shorter than one
/// block (it stores nothing) makes that step.
fn reset_caches(fleet: &Fleet) -> Result<()> {
    for e in &fleet.engines {
        let r = http_request(e.http, "POST", "/reset_prefix_cache", &[], b"")?;
        ensure!(r.status == 200, "reset_prefix_cache: {}", r.status);
        let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 1}).to_string();
        let r =
            http_request(e.http, "POST", "/v1/completions", &[("content-type", "application/json")], body.as_bytes())?;
        ensure!(r.status == 200, "a step after the reset: {}", r.status);
    }
    Ok(())
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { (a / b * 1000.0).round() / 1000.0 } else { 0.0 }
}

/// Runs the cell and writes its result file.
pub fn run(a: &VllmArgs) -> Result<()> {
    let dir = repo_root().join(".run/bench-vllm");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    println!("starting two vLLM engines (a minute or two)...");
    let fleet = Fleet::start(&dir, &kvgate_bin(), 2)?;
    let kvgate = start_kvgate(&fleet, &dir)?;
    let mut rows = Vec::new();
    for mode in &a.modes {
        reset_caches(&fleet)?;
        wait_until("the index emptied by the reset", 30, || {
            Ok(workers(kvgate.admin).iter().all(|w| w["device_blocks"] == 0))
        })?;
        let served_before: Vec<f64> = fleet.engines.iter().map(|e| e.metric("vllm:request_success_total")).collect();
        let acc = format!("kvgate_reports_total{{model=\"{MODEL}\",kind=\"accurate\"}}");
        let withc = format!("kvgate_reports_total{{model=\"{MODEL}\",kind=\"with_cached\"}}");
        let (acc0, with0) = (cp_metric(kvgate.admin, &acc), cp_metric(kvgate.admin, &withc));
        let (_router, base) = match mode.strip_prefix("sglang_") {
            Some(policy) => {
                let (p, front) = start_sglang(&fleet, &dir, policy)?;
                (Some(p), format!("http://{front}/v1"))
            }
            None => {
                let r =
                    http_request(kvgate.admin, "POST", &format!("/admin/mode?model={MODEL}&mode={mode}"), &[], b"")?;
                ensure!(r.status == 200, "mode {mode}: {}", String::from_utf8_lossy(&r.body));
                (None, format!("http://{}/v1", kvgate.envoy.listen))
            }
        };
        let args = ["--convs", &a.convs.to_string(), "--turns", "4", "--concurrency", &a.concurrency.to_string()];
        let records = conversations(&base, &[&args[..], &["--seed", &a.seed.to_string()]].concat())
            .with_context(|| format!("mode {mode}"))?;
        let ok: Vec<&Value> = records.iter().filter(|r| r["ok"] == true).collect();
        let sum = |k: &str| ok.iter().map(|r| r[k].as_u64().unwrap_or(0)).sum::<u64>() as f64;
        let (prompt, cached, oracle) = (sum("prompt_tokens"), sum("cached_tokens"), sum("oracle_cached_tokens"));
        // The oracle needs vLLM's prompt token ids in the answer
        // (`return_token_ids`); a frontend that drops them (sglang-router
        // does) has none: the workload is the same in every mode (same
        // seed), so the other modes' oracle applies.
        let oracle_known = ok.iter().all(|r| r["oracle_cached_tokens"].is_u64());
        let served: Vec<f64> =
            fleet.engines.iter().zip(&served_before).map(|(e, b)| e.metric("vllm:request_success_total") - b).collect();
        let mean = served.iter().sum::<f64>() / served.len() as f64;
        let max = served.iter().cloned().fold(0.0, f64::max);
        let kv_modes = !mode.starts_with("sglang_");
        // Reports reach the control plane in batches every 100 ms.
        std::thread::sleep(Duration::from_millis(500));
        let (accurate, predictions) = if kv_modes {
            (cp_metric(kvgate.admin, &acc) - acc0, cp_metric(kvgate.admin, &withc) - with0)
        } else {
            (0.0, 0.0)
        };
        let row = json!({
            "mode": mode,
            "requests": records.len(),
            "hit_rate": ratio(cached, prompt),
            "oracle_hit_rate": if oracle_known { json!(ratio(oracle, prompt)) } else { Value::Null },
            "predicted_equal_reported": if kv_modes && predictions > 0.0 { json!(ratio(accurate, predictions)) } else { Value::Null },
            "predictions": predictions,
            "load_skew": ratio(max, mean),
            "requests_per_engine": served,
            "errors": records.len() - ok.len(),
        });
        println!("vllm {mode:<20} {row}");
        rows.push(row);
    }
    let (commit, machine) = kvgate_bench_support::provenance();
    let result = json!({
        "rows": rows,
        "vllm_version": kvgate_testkit::vllm::version(),
        "commit": commit,
        "machine": machine,
        "settings": {
            "engines": 2,
            "model": "tiny-llama (random weights, hidden 128, 2 layers) with the DeepSeek-V3 tokenizer, built locally",
            "block_size": 32,
            "kv_cache_tokens_per_engine": 8192,
            "max_num_seqs": 16,
            "conversations": a.convs,
            "turns": 4,
            "concurrency": a.concurrency,
            "seed": a.seed,
            "control_plane": "defaults (kvgate serve --model deepseek-v3 --block-size 32); mode switched at run time",
            "caches": "reset before each mode (/reset_prefix_cache)",
        },
    });
    let out = repo_root().join(&a.out);
    std::fs::write(&out, serde_json::to_string_pretty(&result)? + "\n")?;
    println!("wrote {}", out.display());
    Ok(())
}
