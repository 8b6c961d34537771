//! A second client (issue #23): NVIDIA's aiperf sends the same requests, at
//! the same times, to a fresh stack of the same mode, and its per-request
//! records become [`Record`]s, so one summary ([`crate::stats::summarize`])
//! computes both clients' rows the same way.
//!
//! - **Same requests.** Request `i` of the workload is one line of an aiperf
//!   `single_turn` file: its arrival (wall milliseconds, for
//!   `--fixed-schedule`), its whole chat history and `max_tokens` as fields
//!   merged into the body (`extra`), and `user = "kvgate-bench-<i>"` to find
//!   it again in aiperf's records (aiperf names requests by its own ids).
//! - **Same clock.** aiperf starts its schedule after its own start-up (a few
//!   seconds of Python services and tokenizer loading), so the sampler starts
//!   when the first request reaches a worker, and the records' start times
//!   are taken from aiperf's own schedule zero (the earliest
//!   `request_start − scheduled`).
//! - **Same counts.** `--use-server-token-count`: output tokens are what the
//!   server reported, as `kvgate-bench` counts them; ITL is then
//!   `(latency − TTFT) / (output tokens − 1)` in both.

use std::collections::HashMap;
use std::io::{BufRead as _, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use kvgate_testkit::Proc;
use serde_json::{Value, json};

use crate::runner::{CellRun, Record, Windows};
use crate::workload::Requests;

/// aiperf's launcher: `KVGATE_AIPERF`, else the venv `scripts/setup-aiperf.sh` makes.
pub fn aiperf_bin() -> PathBuf {
    std::env::var_os("KVGATE_AIPERF")
        .map(PathBuf::from)
        .unwrap_or_else(|| kvgate_testkit::repo_root().join(".tools/aiperf/bin/aiperf"))
}

/// The `user` field that names request `i`.
fn user_of(i: u64) -> String {
    format!("kvgate-bench-{i}")
}

/// Writes the workload's requests that arrive before `until_s` (wall seconds
/// at `speedup`) as an aiperf `single_turn` file; returns each one's arrival
/// in the file (wall ms), by request number.
pub fn write_dataset(wl: &Requests, speedup: f64, until_s: f64, path: &Path) -> Result<Vec<f64>> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut scheduled_ms = Vec::new();
    let mut n = 0;
    while let Some(req) = wl.request(n) {
        let at_s = req.at_s / speedup.max(1e-9);
        if at_s >= until_s {
            break;
        }
        let history = req.history();
        let messages: Vec<Value> =
            history.iter().map(|(role, content)| json!({"role": role, "content": content})).collect();
        let last = history.last().map(|(_, c)| c.as_str()).unwrap_or_default();
        let line = json!({
            "timestamp": at_s * 1e3,
            "text": last,
            "output_length": req.max_tokens,
            "extra": {"messages": messages, "max_tokens": req.max_tokens, "user": user_of(n)},
        });
        serde_json::to_writer(&mut out, &line)?;
        out.write_all(b"\n")?;
        scheduled_ms.push(at_s * 1e3);
        n += 1;
    }
    out.flush()?;
    Ok(scheduled_ms)
}

/// Reads aiperf's artifacts (`inputs.json`, `profile_export.jsonl`) back as
/// records: request number from the `user` field, times in seconds from the
/// schedule's zero. `scheduled_ms[i]` is request `i`'s arrival in the file.
pub fn read_records(dir: &Path, scheduled_ms: &[f64], group_of: impl Fn(u64) -> usize) -> Result<Vec<Record>> {
    let inputs: Value = serde_json::from_slice(&std::fs::read(dir.join("inputs.json")).context("aiperf inputs.json")?)?;
    let mut by_session: HashMap<&str, u64> = HashMap::new();
    for d in inputs["data"].as_array().map(Vec::as_slice).unwrap_or_default() {
        let user = d["payloads"][0]["user"].as_str().unwrap_or_default();
        if let (Some(s), Some(i)) = (d["session_id"].as_str(), user.strip_prefix("kvgate-bench-")) {
            by_session.insert(s, i.parse().with_context(|| format!("user {user}"))?);
        }
    }
    let file = std::fs::File::open(dir.join("profile_export.jsonl")).context("aiperf profile_export.jsonl")?;
    // (request, start ns, the record)
    let mut seen = Vec::new();
    for line in std::io::BufReader::new(file).lines() {
        let v: Value = serde_json::from_str(&line?)?;
        let meta = &v["metadata"];
        if meta["benchmark_phase"].as_str() != Some("profiling") {
            continue;
        }
        let session = meta["conversation_id"].as_str().unwrap_or_default();
        let Some(&i) = by_session.get(session) else { bail!("aiperf record of unknown session {session}") };
        let Some(start_ns) = meta["request_start_ns"].as_u64() else { bail!("aiperf record without request_start_ns") };
        seen.push((i, start_ns, v));
    }
    let late_ns = |i: u64, start: u64| start as f64 - scheduled_ms.get(i as usize).copied().unwrap_or(0.0) * 1e6;
    let zero_ns = seen.iter().map(|(i, s, _)| late_ns(*i, *s)).fold(f64::INFINITY, f64::min);
    let mut records = Vec::with_capacity(seen.len());
    for (i, start_ns, v) in seen {
        let m = &v["metrics"];
        let ms = |k: &str| m[k]["value"].as_f64();
        let count = |k: &str| m[k]["value"].as_f64().map_or(0, |x| x.round() as u64);
        let error = match &v["error"] {
            Value::Null => None,
            e => Some(e.to_string()),
        };
        records.push(Record {
            conv: i,
            starter: group_of(i),
            turn: 0,
            start: (start_ns as f64 - zero_ns) / 1e9,
            ttft: ms("time_to_first_token").map(|t| t / 1e3),
            e2e: ms("request_latency").unwrap_or(0.0) / 1e3,
            prompt_tokens: count("usage_prompt_tokens"),
            completion_tokens: count("output_sequence_length"),
            cached_tokens: count("usage_prompt_cache_read_tokens"),
            error: error.or_else(|| ms("request_latency").is_none().then(|| "no latency in aiperf's record".into())),
            route: None,
            tenant: None,
        });
    }
    records.sort_by_key(|r| r.conv);
    Ok(records)
}

/// Runs aiperf against `front` with the workload's requests up to the end of
/// the measured window and measures the stack as `kvgate-bench` does.
pub async fn run(
    front: SocketAddr,
    workers: &[SocketAddr],
    pids: &[(String, u32)],
    wl: &Requests,
    speedup: f64,
    windows: Windows,
    dir: &Path,
) -> Result<CellRun> {
    let art = dir.join("aiperf");
    std::fs::create_dir_all(&art)?;
    let dataset = dir.join("aiperf-requests.jsonl");
    let until = (windows.warmup + windows.measure).as_secs_f64();
    let scheduled_ms = write_dataset(wl, speedup, until, &dataset)?;
    let first_s = scheduled_ms.first().copied().unwrap_or(0.0) / 1e3;
    let mut cmd = Command::new(aiperf_bin());
    cmd.args(["profile", "--model", crate::stack::MODEL, "--endpoint-type", "chat", "--streaming"])
        .arg("--url")
        .arg(format!("http://{front}"))
        .arg("--tokenizer")
        .arg(crate::stack::tokenizer_dir())
        .arg("--input-file")
        .arg(&dataset)
        .args(["--custom-dataset-type", "single_turn", "--fixed-schedule", "--use-server-token-count"])
        .args(["--export-level", "records", "--no-gpu-telemetry", "--no-server-metrics", "--ui-type", "none"])
        .arg("--request-timeout-seconds")
        .arg(format!("{:.0}", (windows.measure + windows.drain).as_secs_f64().ceil()))
        .arg("--output-artifact-dir")
        .arg(&art)
        // A local tokenizer directory: no hub look-up (aiperf's offline mode
        // would look the path up in the hub cache instead).
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("TRANSFORMERS_OFFLINE")
        .env("HF_HUB_DISABLE_TELEMETRY", "1");
    let mut proc = Proc::spawn_group("aiperf", cmd, dir)?;
    // Start-up, the whole schedule, the drain, and the export.
    let limit = Duration::from_secs(120) + windows.warmup + windows.measure + windows.drain;
    let client = async move {
        let status = tokio::task::spawn_blocking(move || -> Result<std::process::ExitStatus> {
            let deadline = Instant::now() + limit;
            loop {
                if let Some(status) = proc.try_wait()? {
                    return Ok(status);
                }
                if Instant::now() > deadline {
                    bail!("aiperf still running after {limit:?}:\n{}", proc.log());
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        })
        .await??;
        if !status.success() {
            bail!("aiperf exited with {status}; see {}", dir.join("aiperf.log").display());
        }
        read_records(&art, &scheduled_ms, |i| wl.request(i).map_or(0, |r| r.group))
    };
    crate::runner::measure_external(workers, pids, windows, Duration::from_secs_f64(first_s), client).await
}

/// What each row of aiperf says against `kvgate-bench`'s row of the same
/// mode and level (mode `<m>_aiperf` against `<m>`): aiperf's value over
/// ours, minus one, per metric; and each client's frontend share (TTFT at
/// the client less the engines' own), which holds the clients' own costs.
pub fn agreement(rows: &[crate::stats::Row]) -> Vec<Value> {
    let mut out = Vec::new();
    for a in rows {
        let Some(mode) = a.mode.strip_suffix("_aiperf") else { continue };
        let Some(o) = rows.iter().find(|o| o.mode == mode && o.concurrency == a.concurrency) else { continue };
        let diff = |x: f64, y: f64| if y > 0.0 { x / y - 1.0 } else { f64::NAN };
        out.push(json!({
            "mode": mode,
            "level": a.concurrency,
            "requests": [o.requests, a.requests],
            "aiperf_over_kvgate_bench": {
                "ttft_p50": diff(a.ttft_p50_ms, o.ttft_p50_ms),
                "ttft_p95": diff(a.ttft_p95_ms, o.ttft_p95_ms),
                "itl_p50": diff(a.itl_p50_ms, o.itl_p50_ms),
                "itl_p95": diff(a.itl_p95_ms, o.itl_p95_ms),
                "e2e_p50": diff(a.e2e_p50_s, o.e2e_p50_s),
                "output_tok_per_s": diff(a.output_tok_per_s, o.output_tok_per_s),
            },
            "frontend_share_ms": [o.ttft_mean_ms - o.worker_ttft_mean_ms, a.ttft_mean_ms - a.worker_ttft_mean_ms],
            "worker_ttft_mean_ms": [o.worker_ttft_mean_ms, a.worker_ttft_mean_ms],
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Groups;

    #[test]
    fn the_dataset_holds_each_request_with_its_history_and_arrival() {
        let wl = Requests::Groups(Groups::new(4.0, 30.0));
        let dir = std::env::temp_dir().join(format!("kvgate-aiperf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.jsonl");
        let scheduled_ms = write_dataset(&wl, 2.0, 5.0, &path).unwrap();
        let n = scheduled_ms.len() as u64;
        let lines: Vec<Value> =
            std::fs::read_to_string(&path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len() as u64, n);
        assert!(n > 10, "{n}");
        for (i, l) in lines.iter().enumerate() {
            let req = wl.request(i as u64).unwrap();
            assert!((l["timestamp"].as_f64().unwrap() - req.at_s / 2.0 * 1e3).abs() < 1e-6);
            assert!(l["timestamp"].as_f64().unwrap() < 5_000.0);
            assert!((l["timestamp"].as_f64().unwrap() - scheduled_ms[i]).abs() < 1e-6);
            assert_eq!(l["extra"]["user"], format!("kvgate-bench-{i}"));
            assert_eq!(l["extra"]["max_tokens"], req.max_tokens);
            let history = req.history();
            assert_eq!(l["extra"]["messages"].as_array().unwrap().len(), history.len());
            assert_eq!(l["extra"]["messages"][0]["content"], history[0].1);
        }
        // The next request arrives at or after the bound.
        assert!(wl.request(n).unwrap().at_s / 2.0 >= 5.0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// aiperf 0.13's artifacts, cut to what is read (two requests, one
    /// failed, one warm-up record ignored).
    #[test]
    fn records_are_read_back_by_request_on_the_schedule_clock() {
        let dir = std::env::temp_dir().join(format!("kvgate-aiperf-rec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let inputs = json!({"data": [
            {"session_id": "a", "payloads": [{"user": "kvgate-bench-1", "messages": []}]},
            {"session_id": "b", "payloads": [{"user": "kvgate-bench-0", "messages": []}]},
        ]});
        std::fs::write(dir.join("inputs.json"), inputs.to_string()).unwrap();
        let rec = |session: &str, phase: &str, start: u64, metrics: Value, error: Value| {
            json!({"metadata": {"conversation_id": session, "benchmark_phase": phase, "request_start_ns": start},
                   "metrics": metrics, "error": error})
            .to_string()
        };
        let ok = json!({
            "time_to_first_token": {"value": 250.0, "unit": "ms"},
            "request_latency": {"value": 1250.0, "unit": "ms"},
            "output_sequence_length": {"value": 51, "unit": "tokens"},
            "usage_prompt_tokens": {"value": 700, "unit": "tokens"},
            "usage_prompt_cache_read_tokens": {"value": 640, "unit": "tokens"},
        });
        let lines = [
            rec("b", "warmup", 1_000, ok.clone(), Value::Null),
            // Request 0 scheduled at 0 ms, sent 10 ms after the zero.
            rec("b", "profiling", 5_010_000_000, ok, Value::Null),
            // Request 1 scheduled at 500 ms, sent on time (it sets the zero).
            rec("a", "profiling", 5_500_000_000, json!({}), json!({"code": 503, "message": "no healthy upstream"})),
        ];
        std::fs::write(dir.join("profile_export.jsonl"), lines.join("\n")).unwrap();
        let r = read_records(&dir, &[0.0, 500.0], |i| i as usize + 7).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].conv, r[0].starter), (0, 7));
        assert!((r[0].start - 0.010).abs() < 1e-9, "{}", r[0].start);
        assert_eq!(r[0].ttft, Some(0.25));
        assert!((r[0].e2e - 1.25).abs() < 1e-9);
        assert_eq!((r[0].prompt_tokens, r[0].cached_tokens, r[0].completion_tokens), (700, 640, 51));
        assert!(r[0].error.is_none());
        assert_eq!(r[1].conv, 1);
        assert!((r[1].start - 0.5).abs() < 1e-9, "{}", r[1].start);
        assert!(r[1].error.as_deref().unwrap().contains("503"), "{:?}", r[1].error);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
