//! `make bench-scale`: the control plane at fleet scale, as a process.
//!
//! For each fleet size (`--workers`, default 100 and 1,000), a synthetic
//! fleet of fake relays ([`fleet`]) fills the control plane's index over
//! real NATS (`--blocks` per worker, default 40,000: what an H200 serving
//! Llama-70B FP8 holds in 16-token blocks), then keeps churning it
//! (`--ingest` block operations per second, default 1 M) while an
//! open-loop gRPC client ([`load`]) sends Picks of each request mix at a
//! ladder of rates, up to saturation. Per step: Pick latency p50/p99/p999
//! from the scheduled send time, the rate answered, the ingest rate
//! reached, the index's staleness (p99 of `kvgate_event_lag_seconds`, the
//! engine timestamp of a batch to its application), the control plane's
//! RSS and CPU per Pick. Beside them, the same mixes against a control
//! plane in this process fed the same messages (`path: in_process`,
//! sequential Picks, no ingest running).
//!
//! Everything shares this machine's cores: the client, the fleet's
//! generator, nats-server and the control plane. Results:
//! `bench/results/scale.json`.

mod fleet;
mod load;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet::{Fleet, Sink};
use kvgate_bench_support::Samples;
use kvgate_server::router_client::RouterClient;
use load::Mixes;
use serde_json::{Value, json};

// As in the `kvgate` binary.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The served model.
pub(crate) const MODEL: &str = "bench";

struct Args {
    workers: Vec<usize>,
    blocks: usize,
    ingest: u64,
    secs: f64,
    request_secs: f64,
    elide: bool,
    mixes: Vec<&'static str>,
    out: PathBuf,
}

const MIXES: [&str; 4] = ["doks_new_turn", "doc_question", "cold_8k", "cold_100k"];

fn args() -> Args {
    let mut a = Args {
        workers: vec![100, 1000],
        blocks: 40_000,
        ingest: 1_000_000,
        secs: 5.0,
        request_secs: 2.0,
        elide: true,
        mixes: MIXES.to_vec(),
        out: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/results/scale.json"),
    };
    let v: Vec<String> = std::env::args().skip(1).filter(|x| x != "--bench").collect();
    let mut it = v.iter();
    while let Some(k) = it.next() {
        let val = it.next().map(String::as_str).unwrap_or_default();
        match k.as_str() {
            "--workers" => a.workers = val.split(',').filter_map(|x| x.parse().ok()).collect(),
            "--blocks" => a.blocks = val.parse().unwrap_or(a.blocks),
            "--ingest" => a.ingest = val.parse().unwrap_or(a.ingest),
            "--secs" => a.secs = val.parse().unwrap_or(a.secs),
            "--request-secs" => a.request_secs = val.parse().unwrap_or(a.request_secs),
            "--elide" => a.elide = val != "false",
            "--mixes" => a.mixes = MIXES.iter().copied().filter(|m| val.split(',').any(|x| x == *m)).collect(),
            "--out" => a.out = PathBuf::from(val),
            _ => eprintln!("ignored argument {k}"),
        }
    }
    a
}

/// Offered rates (Picks/s) per mix, low to past saturation on 2 cores.
fn ladder(mix: &str) -> &'static [f64] {
    match mix {
        "doks_new_turn" => &[250.0, 500.0, 1000.0, 2000.0, 4000.0],
        "doc_question" => &[50.0, 100.0, 250.0, 500.0, 1000.0],
        "cold_8k" => &[50.0, 100.0, 200.0, 400.0],
        _ => &[5.0, 10.0, 20.0, 40.0],
    }
}

fn kvgate_bin() -> PathBuf {
    std::env::var_os("KVGATE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/release/kvgate"))
}

/// The control plane process's (CPU seconds, RSS MB).
fn proc_usage(pid: u32) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis: utime is the 12th, stime the 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let cpu = (ticks(11) + ticks(12)) / 100.0;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss_kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    (cpu, rss_kb / 1024.0)
}

/// The control plane's Prometheus text.
fn metrics(admin: std::net::SocketAddr) -> String {
    kvgate_testkit::http_request(admin, "GET", "/metrics", &[], b"")
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .unwrap_or_default()
}

/// `kvgate_event_lag_seconds` buckets: (upper bound, cumulative count).
fn lag_buckets(text: &str) -> Vec<(f64, f64)> {
    kvgate_testkit::prom::samples(text)
        .filter(|s| s.name == "kvgate_event_lag_seconds_bucket")
        .filter_map(|s| {
            let le = s.labels.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, s.value))
        })
        .collect()
}

/// The p99 of the lag between two bucket readings, as the upper bound of
/// its bucket, ms (None without batches in between).
fn lag_p99_ms(before: &[(f64, f64)], after: &[(f64, f64)]) -> Option<f64> {
    let delta: Vec<(f64, f64)> =
        after.iter().map(|(le, n)| (*le, n - before.iter().find(|(l, _)| l == le).map_or(0.0, |(_, m)| *m))).collect();
    let total = delta.iter().map(|(_, n)| *n).fold(0.0, f64::max);
    if total <= 0.0 {
        return None;
    }
    delta.iter().find(|(_, n)| *n >= 0.99 * total).map(|(le, _)| le * 1000.0)
}

fn kv_messages(text: &str) -> f64 {
    kvgate_testkit::prom::samples(text)
        .filter(|s| s.name == "kvgate_nats_messages_total" && s.labels.contains("\"kv\""))
        .map(|s| s.value)
        .sum()
}

/// Fills `fleet`'s workers: the conversations and documents of `mixes`,
/// then private chains up to `blocks` each. `settle` is awaited every few
/// thousand messages (flow control against the consumer).
async fn fill<F, Fut>(fleet: &mut Fleet, tk: &kvgate_tokenize::ChatTokenizer, mixes: &Mixes, blocks: usize, settle: F)
where
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let w = fleet.workers();
    let mut held = vec![0usize; w];
    for (c, m) in mixes.conversations.iter().enumerate() {
        let tokens = tk.encode_chat(m, true).unwrap_or_default();
        held[c % w] += fleet.hold(c % w, &tokens).await;
    }
    let docs: Vec<Vec<u32>> = mixes
        .documents
        .iter()
        .map(|d| tk.encode_chat(&[json!({"role": "system", "content": d})], true).unwrap_or_default())
        .collect();
    for k in (0..w).step_by(7) {
        held[k] += fleet.hold(k, &docs[(k / 7) % docs.len()]).await;
    }
    let mut last = fleet.published;
    for (k, h) in held.iter().enumerate() {
        fleet.fill_private(k, blocks.saturating_sub(*h)).await;
        if fleet.published - last > 5000 {
            settle(fleet.published).await;
            last = fleet.published;
        }
    }
    settle(fleet.published).await;
}

/// Churn at `ops_per_s` until `stop`; returns the block operations sent.
async fn churn(fleet: &mut Fleet, ops_per_s: u64, stop: tokio::sync::watch::Receiver<bool>) -> u64 {
    let start = Instant::now();
    let mut sent = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    while !*stop.borrow() {
        tick.tick().await;
        let due = (start.elapsed().as_secs_f64() * ops_per_s as f64) as u64;
        while sent < due && !*stop.borrow() {
            let n = fleet.churn_one().await;
            if n == 0 {
                return sent;
            }
            sent += n;
        }
    }
    sent
}

fn row(workers: usize, path: &str, mix: &str, lat: &Samples, extra: Value) -> Value {
    let mut r = json!({
        "workers": workers, "path": path, "mix": mix, "replicas": 1,
        "pick_p50_us": lat.quantile(0.5).round(), "pick_p99_us": lat.quantile(0.99).round(),
        "pick_p999_us": lat.quantile(0.999).round(),
    });
    if let (Some(r), Some(e)) = (r.as_object_mut(), extra.as_object()) {
        r.extend(e.clone());
    }
    r
}

/// The in-process rows: a control plane in this process, fed the same
/// fleet, sequential Picks of each mix.
fn in_process(
    rt: &tokio::runtime::Runtime,
    a: &Args,
    workers: usize,
    tk_dir: &std::path::Path,
    mixes: &Arc<Mixes>,
) -> Vec<Value> {
    use kvgate_server::config::{RawConfig, RawModel};
    let tk = kvgate_tokenize::ChatTokenizer::from_dir(tk_dir).expect("tokenizer");
    let raw = RawConfig {
        listen_admin: Some("off".into()),
        nats_url: Some("off".into()),
        replica_id: Some("scale-in-process".into()),
        models: vec![RawModel {
            name: MODEL.into(),
            tokenizer_dir: Some(tk_dir.to_owned()),
            block_size: Some(fleet::BS as u32),
            mode: Some("kv".into()),
            ..Default::default()
        }],
        ..Default::default()
    };
    let app = kvgate_server::App::new(kvgate_server::Config::validate(raw).expect("config")).expect("app");
    let mut fleet = Fleet::new(Sink::Local(app.clone()), workers);
    let beats = fleet.beats(2 * a.blocks as u64);
    rt.block_on(async {
        beats.send().await;
        // Heartbeats go on while it fills (a worker silent for 3 s is not
        // routable).
        let last = std::cell::Cell::new(Instant::now());
        let beat = |_| {
            let due = last.get().elapsed() > Duration::from_millis(500);
            if due {
                last.set(Instant::now());
            }
            let beats = beats.clone();
            async move {
                if due {
                    beats.send().await;
                }
            }
        };
        fill(&mut fleet, &tk, mixes, a.blocks, beat).await;
        beats.send().await;
    });
    let mut rows = Vec::new();
    // The conversations and documents were seen before (their earlier
    // turns are cached).
    for i in 0..mixes.conversations.len() as u64 {
        if let Ok(r) = app.pick(&mixes.request("doks_new_turn", i)) {
            mixes.retain(&r.retained_chain_hashes);
        }
    }
    for i in 0..mixes.documents.len() as u64 {
        if let Ok(r) = app.pick(&mixes.request("doc_question", i)) {
            mixes.retain(&r.retained_chain_hashes);
        }
    }
    for mix in &a.mixes {
        let n: u64 = if mix.starts_with("cold_100k") {
            20
        } else if *mix == "doc_question" {
            200
        } else {
            500
        };
        let mut lat = Samples::new();
        let mut total = 0.0;
        let mut last_beat = Instant::now();
        for i in 0..n {
            if last_beat.elapsed() > Duration::from_millis(500) {
                rt.block_on(beats.send());
                last_beat = Instant::now();
            }
            let req = mixes.build(mix, 10_000_000 + i, a.elide);
            let t = Instant::now();
            // A resend is an error in process (PickError::Resend).
            let r = app.pick(&req).or_else(|_| app.pick(&mixes.build(mix, 10_000_000 + i, false)));
            let ok = r.as_ref().is_ok_and(|r| {
                mixes.retain(&r.retained_chain_hashes);
                true
            });
            let us = t.elapsed().as_secs_f64() * 1e6;
            if ok {
                lat.record(us);
                total += us;
            }
            let done = kvgate_protocol::pb::CompletionReport {
                request_id: req.request_id.clone(),
                model: MODEL.into(),
                total_us: 1,
                ..Default::default()
            };
            let _ =
                app.report(&kvgate_protocol::pb::CompletionReportBatch { reports: vec![done], ..Default::default() });
        }
        let pps = if lat.is_empty() { 0.0 } else { lat.len() as f64 / (total / 1e6) };
        eprintln!(
            "in process, {workers} workers, {mix}: p50 {:.0} p99 {:.0} µs",
            lat.quantile(0.5),
            lat.quantile(0.99)
        );
        rows.push(row(
            workers,
            "in_process",
            mix,
            &lat,
            json!({"picks_per_s": pps.round(), "ingest_block_ops_per_s": 0}),
        ));
    }
    rows
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let a = args();
    let tk_dir = std::env::var_os("KVGATE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.tools/models/deepseek-v3"));
    let tk = kvgate_tokenize::ChatTokenizer::from_dir(&tk_dir).expect("tokenizer (run scripts/setup.sh)");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let mixes = Arc::new(Mixes::new(&tk));
    let mut rows = Vec::new();
    for &workers in &a.workers {
        rows.extend(in_process(&rt, &a, workers, &tk_dir, &mixes));
        rows.extend(rt.block_on(over_grpc(&a, workers, &tk, &tk_dir, &mixes)));
    }
    let (commit, machine) = kvgate_bench_support::provenance();
    let result = json!({
        "rows": rows,
        "blocks_per_worker": a.blocks,
        "ingest_offered_block_ops_per_s": a.ingest,
        "step_secs": a.secs,
        "request_secs": a.request_secs,
        "elided": a.elide,
        "client": "open loop (sends never wait for answers; latency from the send), tonic over loopback (4 channels), at most 512 outstanding; with elided=true the earlier messages of a conversation or document already seen go as chain hashes only, as the filter sends them (a resend answer is followed by the whole request, counted in the latency); each routed request reported finished request_secs after its Pick (Report RPC, batched every 50 ms), so about rate x request_secs are in flight",
        "staleness": "p99 of kvgate_event_lag_seconds during the step, as the upper bound of its bucket",
        "shared_cores": "client, fleet generator, nats-server and control plane share the machine",
        "commit": commit,
        "machine": machine,
    });
    if let Some(dir) = a.out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&a.out, serde_json::to_string_pretty(&result).expect("json") + "\n").expect("write result");
    println!("{}", serde_json::to_string_pretty(&result).expect("json"));
}

/// The process rows for `workers`.
async fn over_grpc(
    a: &Args,
    workers: usize,
    tk: &kvgate_tokenize::ChatTokenizer,
    tk_dir: &std::path::Path,
    mixes: &Arc<Mixes>,
) -> Vec<Value> {
    let dir = kvgate_testkit::scratch_dir(&format!("bench-scale-{workers}")).expect("scratch dir");
    let nats = kvgate_testkit::NatsServer::start(&dir).expect("nats-server");
    let nats_url = format!("nats://127.0.0.1:{}", nats.port);
    let mut cmd = std::process::Command::new(kvgate_bin());
    cmd.args(["serve", "--model", MODEL, "--block-size", "16", "--mode", "kv", "--replica-id", "scale"])
        .arg("--tokenizer-dir")
        .arg(tk_dir)
        .args(["--nats-url", &nats_url, "--listen-grpc", "127.0.0.1:0", "--listen-admin", "127.0.0.1:0"]);
    let (serve, addrs) = kvgate_testkit::spawn_serve("serve", cmd, &dir).expect("kvgate serve");
    let pid = serve.pid();
    let client = async_nats::ConnectOptions::new().connect(nats_url.as_str()).await.expect("NATS");
    let mut fleet = Fleet::new(Sink::Nats(client.clone()), workers);
    let beats = fleet.beats(2 * a.blocks as u64).spawn();
    let admin = addrs.admin;
    let t = Instant::now();
    // Flow control: the consumer keeps within 20,000 messages.
    let settle = |published: u64| {
        let client = client.clone();
        async move {
            let _ = client.flush().await;
            loop {
                let got = tokio::task::spawn_blocking(move || kv_messages(&metrics(admin))).await.unwrap_or(0.0);
                if got + 20_000.0 >= published as f64 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    fill(&mut fleet, tk, mixes, a.blocks, settle).await;
    let published = fleet.published as f64;
    loop {
        let got = tokio::task::spawn_blocking(move || kv_messages(&metrics(admin))).await.unwrap_or(0.0);
        if got >= published {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, rss) = proc_usage(pid);
    eprintln!(
        "{workers} workers: {} block operations in {:.1} s, control plane RSS {rss:.0} MB",
        fleet.block_ops,
        t.elapsed().as_secs_f64()
    );
    let clients: Vec<RouterClient<tonic::transport::Channel>> = {
        let mut v = Vec::new();
        for _ in 0..4 {
            v.push(RouterClient::connect(format!("http://{}", addrs.grpc)).await.expect("gRPC"));
        }
        v
    };
    let mut rows = Vec::new();
    let ends = load::Ends::spawn(clients[0].clone(), Duration::from_secs_f64(a.request_secs));
    // The conversations and documents were seen before (their earlier
    // turns are cached).
    for i in 0..mixes.conversations.len() as u64 {
        if let Ok(r) = clients[0].clone().pick(mixes.request("doks_new_turn", i)).await {
            mixes.retain(&r.get_ref().retained_chain_hashes);
        }
    }
    for i in 0..mixes.documents.len() as u64 {
        if let Ok(r) = clients[0].clone().pick(mixes.request("doc_question", i)).await {
            mixes.retain(&r.get_ref().retained_chain_hashes);
        }
    }
    let mut next_id = 1_000u64;
    // Ingest alone first (what the Picks' CPU is measured against).
    let steps: Vec<(&'static str, f64)> = std::iter::once(("none", 0.0))
        .chain(a.mixes.iter().flat_map(|m| ladder(m).iter().map(move |r| (*m, *r))))
        .collect();
    let mut saturated: Option<&str> = None;
    for (mix, rate) in steps {
        if saturated == Some(mix) {
            continue;
        }
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let lag0 = lag_buckets(&metrics(admin));
        let (cpu0, _) = proc_usage(pid);
        let ingest = a.ingest;
        let churner = async {
            let t = Instant::now();
            let ops = churn(&mut fleet, ingest, stop_rx).await;
            ops as f64 / t.elapsed().as_secs_f64()
        };
        let load = async {
            let step = if rate > 0.0 {
                Some(load::open_loop(&clients, &ends, mixes.clone(), mix, rate, a.secs, next_id, a.elide).await)
            } else {
                tokio::time::sleep(Duration::from_secs_f64(a.secs)).await;
                None
            };
            let _ = stop_tx.send(true);
            step
        };
        let (ops_per_s, step) = tokio::join!(churner, load);
        let (cpu1, rss) = proc_usage(pid);
        let lag = lag_p99_ms(&lag0, &lag_buckets(&metrics(admin)));
        // The next step starts on a drained control plane (a saturated step
        // leaves a backlog of batches that would count against the next).
        let published = fleet.published as f64;
        let drain = Instant::now();
        while drain.elapsed() < Duration::from_secs(60) {
            let got = tokio::task::spawn_blocking(move || kv_messages(&metrics(admin))).await.unwrap_or(0.0);
            if got >= published {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        next_id += (rate * a.secs) as u64 + 1;
        let Some(step) = step else {
            eprintln!(
                "{workers} workers, ingest only: {ops_per_s:.0} block ops/s, CPU {:.2} s/s",
                (cpu1 - cpu0) / a.secs
            );
            rows.push(json!({
                "workers": workers, "path": "grpc", "mix": "none", "replicas": 1, "picks_per_s": 0,
                "ingest_block_ops_per_s": ops_per_s.round(), "staleness_p99_ms": lag, "rss_mb": rss.round(),
                "cpu_s_per_s": ((cpu1 - cpu0) / a.secs * 100.0).round() / 100.0,
            }));
            continue;
        };
        let pps = step.answered as f64 / step.secs;
        let cpu_per_pick = if step.answered > 0 { (cpu1 - cpu0) * 1e6 / step.answered as f64 } else { f64::NAN };
        eprintln!(
            "{workers} workers, {mix} at {rate}/s: {pps:.0} answered/s, p50 {:.0} p99 {:.0} p999 {:.0} µs, {} failed, ingest {ops_per_s:.0}/s, lag p99 {lag:?} ms, CPU {cpu_per_pick:.0} µs/pick",
            step.latency.quantile(0.5),
            step.latency.quantile(0.99),
            step.latency.quantile(0.999),
            step.failed
        );
        rows.push(row(
            workers,
            "grpc",
            mix,
            &step.latency,
            json!({
                "offered_per_s": rate, "picks_per_s": pps.round(), "failed": step.failed,
                "ingest_block_ops_per_s": ops_per_s.round(), "staleness_p99_ms": lag, "rss_mb": rss.round(),
                "cpu_us_per_pick": cpu_per_pick.round(), "cpu_s_per_s": ((cpu1 - cpu0) / step.secs * 100.0).round() / 100.0,
            }),
        ));
        // Past saturation: the answered rate fell behind, or the tail left a second.
        if pps < 0.9 * rate || step.latency.quantile(0.99) > 1e6 {
            saturated = Some(mix);
        }
    }
    beats.abort();
    drop(serve);
    drop(nats);
    rows
}
