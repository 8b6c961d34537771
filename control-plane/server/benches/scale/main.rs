//! `make bench-scale`: the control plane at fleet scale, as a process.
//!
//! For each fleet size (`--workers`, default 100 and 1,000), a synthetic
//! fleet of fake relays ([`fleet`]) fills the control plane's index over
//! real NATS (`--blocks` per worker, default 40,000: what an H200 serving
//! Llama-70B FP8 holds in 16-token blocks), then keeps churning it
//! (`--ingest` block operations per second, default 1 M) while an
//! open-loop gRPC client ([`load`]) sends Picks of each request mix at a
//! ladder of rates, up to saturation. The first step starts after `--settle`
//! seconds (default 30) of churn alone, past the wave of engine-table
//! growths a fill of every worker at once leaves (its row: `settle`;
//! `--settle 0` measures in the wave). Per step: Pick latency p50/p99/p999
//! from the scheduled send time, the rate answered, the ingest rate
//! reached, the index's staleness (p99 of `kvgate_event_lag_seconds`, the
//! engine timestamp of a batch to its application), the control plane's
//! RSS and CPU per Pick. The mix `grpc_floor` sends no Pick: health checks
//! at the DOKS ladder's rates over the same connections, the latency of
//! the smallest call on this client, server and machine (what a Pick would
//! take if routing cost nothing). Beside them, the same mixes against a control
//! plane in this process fed the same messages (`path: in_process`,
//! sequential Picks, no ingest running).
//!
//! After one replica's steps, the control plane is restarted in front of
//! the live fleet, as in a deploy (`--restart`, seconds allowed, default
//! 240; 0 skips it): every worker resyncs from a snapshot at once, with
//! the fleet churning on. Its row (`mix: restart`): seconds until every
//! worker's stream is synced, snapshot requests (beyond one per worker:
//! asked again), failures, peak RSS, and a timeline.
//!
//! Then the same fleet and the DOKS new-turn ladder with 2 and 4
//! control-plane replicas (`--replicas`), each request sent to the replica
//! its conversation hashes to: capacity within p99 bounds, and how often
//! two replicas asked the same request choose alike (`agreement`).
//!
//! Everything shares this machine's cores: the client, the fleet's
//! generator, nats-server and the control plane. The generator's churn,
//! heartbeats and NATS connection run on a runtime of their own (one
//! thread), not on the client's, so that neither its work nor its socket
//! writes delay the answers the client times. Results:
//! `bench/results/scale.json`.
//!
//! For an A/B of one step: `--rates 2000` replaces every mix's ladder,
//! `--system-prompts 1` starts every DOKS conversation from one system
//! prompt instead of ten (every request in flight then shares it),
//! `--grpc false` keeps only the in-process rows (e.g. `make bench-scale
//! BENCH_ARGS="--workers 1000 --mixes doks_new_turn --grpc false --out
//! bench/results/tmp.json"`).

mod fleet;
mod load;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet::{Fleet, Sink};
use kvgate_bench_support::Samples;
use kvgate_testkit::prom;
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
    /// Ingest alone before the first step, seconds (not a measured step).
    settle: f64,
    request_secs: f64,
    elide: bool,
    mixes: Vec<&'static str>,
    replicas: Vec<usize>,
    grpc: bool,
    /// The in-process rows too.
    in_process: bool,
    /// System prompts the DOKS conversations start from.
    system_prompts: usize,
    /// Snapshots per second the fleet makes the control plane ask for,
    /// during the steps (a skipped `relay_seq` of a random worker each).
    resyncs: f64,
    /// After the steps of one replica: the control plane restarted in
    /// front of the live fleet, up to this many seconds for every worker
    /// to be resynced (0: not run).
    restart_secs: f64,
    out: PathBuf,
}

const MIXES: [&str; 5] = ["doks_new_turn", load::FLOOR, "doc_question", "cold_8k", "cold_100k"];

fn args() -> Args {
    let mut a = Args {
        workers: vec![100, 1000],
        blocks: 40_000,
        ingest: 1_000_000,
        secs: 5.0,
        settle: 30.0,
        request_secs: 2.0,
        elide: true,
        mixes: MIXES.to_vec(),
        replicas: vec![1, 2, 4],
        grpc: true,
        in_process: true,
        system_prompts: 10,
        resyncs: 0.0,
        restart_secs: 240.0,
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
            // `--settle 0`: the first step right after the fill.
            "--settle" => a.settle = val.parse().ok().filter(|s: &f64| *s >= 0.0).unwrap_or(a.settle),
            "--request-secs" => a.request_secs = val.parse().unwrap_or(a.request_secs),
            "--elide" => a.elide = val != "false",
            "--replicas" => a.replicas = val.split(',').filter_map(|x| x.parse().ok()).filter(|r| *r > 0).collect(),
            // Offered rates for every mix instead of its ladder (an A/B of one step).
            "--rates" => {
                let _ = RATES.set(val.split(',').filter_map(|x| x.parse().ok()).collect());
            }
            // `--grpc false`: the in-process rows only (an A/B of the core).
            "--grpc" => a.grpc = val != "false",
            // `--in-process false`: the gRPC rows only.
            "--in-process" => a.in_process = val != "false",
            // `--system-prompts 1`: every DOKS conversation on one system
            // prompt, as behind one product (default 10).
            "--system-prompts" => a.system_prompts = val.parse().ok().filter(|n| *n > 0).unwrap_or(a.system_prompts),
            // `--resyncs 10`: ten workers a second skip a `relay_seq`, and
            // the control plane resyncs each from a snapshot (default 0).
            "--resyncs" => a.resyncs = val.parse().ok().filter(|r: &f64| *r >= 0.0).unwrap_or(a.resyncs),
            // `--restart 240` (the default): after one replica's steps, the
            // control plane is restarted in front of the live fleet (every
            // worker then resyncs from a snapshot); up to 240 s for all to
            // be synced. `--restart 0` skips it.
            "--restart" => a.restart_secs = val.parse().ok().filter(|r: &f64| *r >= 0.0).unwrap_or(a.restart_secs),
            "--mixes" => a.mixes = MIXES.iter().copied().filter(|m| val.split(',').any(|x| x == *m)).collect(),
            // Relative to the repository (cargo runs benches in the crate's directory).
            "--out" => a.out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(val),
            _ => eprintln!("ignored argument {k}"),
        }
    }
    a
}

/// `--rates`, when given.
static RATES: std::sync::OnceLock<Vec<f64>> = std::sync::OnceLock::new();

/// Offered rates (Picks/s) per mix, low to past saturation on 2 cores
/// (or `--rates`).
fn ladder(mix: &str) -> &'static [f64] {
    if let Some(r) = RATES.get().filter(|r| !r.is_empty()) {
        return r;
    }
    match mix {
        "doks_new_turn" | load::FLOOR => &[250.0, 500.0, 1000.0, 2000.0, 4000.0],
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

/// The machine's CPU time so far, from /proc/stat: (busy, total) jiffies.
fn machine_cpu() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<f64> =
        stat.lines().next().unwrap_or_default().split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest is in user).
    let total: f64 = f.iter().take(8).sum();
    let idle = f.get(3).copied().unwrap_or(0.0) + f.get(4).copied().unwrap_or(0.0);
    (total - idle, total)
}

/// The share of the machine's cores busy between two readings.
fn busy_share(a: (f64, f64), b: (f64, f64)) -> f64 {
    let total = b.1 - a.1;
    if total > 0.0 { ((b.0 - a.0) / total * 100.0).round() / 100.0 } else { f64::NAN }
}

/// The control plane's Prometheus text.
fn metrics(admin: std::net::SocketAddr) -> String {
    kvgate_testkit::http_request(admin, "GET", "/metrics", &[], b"")
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .unwrap_or_default()
}

/// A histogram's buckets in a Prometheus text: (upper bound, cumulative
/// count), summed over its label sets.
fn buckets(text: &str, histogram: &str) -> Vec<(f64, f64)> {
    let name = format!("{histogram}_bucket");
    let mut out: Vec<(f64, f64)> = Vec::new();
    for s in prom::samples(text).filter(|s| s.name == name) {
        let Some(le) = s.label("le") else { continue };
        let le = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::NAN) };
        match out.iter_mut().find(|(l, _)| *l == le) {
            Some((_, n)) => *n += s.value,
            None => out.push((le, s.value)),
        }
    }
    out
}

/// The histograms a step reads: the index's staleness, the server's own
/// Pick duration (receipt to answer, inside the process) and how long
/// ingest held the model's lock at a time.
fn step_buckets(text: &str) -> [Vec<(f64, f64)>; 3] {
    [
        buckets(text, "kvgate_event_lag_seconds"),
        buckets(text, "kvgate_pick_duration_seconds"),
        buckets(text, "kvgate_ingest_lock_hold_seconds"),
    ]
}

/// The quantile `q` of a histogram between two readings, as the upper
/// bound of its bucket, ms (None without observations in between).
fn bucket_quantile_ms(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let delta: Vec<(f64, f64)> =
        after.iter().map(|(le, n)| (*le, n - before.iter().find(|(l, _)| l == le).map_or(0.0, |(_, m)| *m))).collect();
    let total = delta.iter().map(|(_, n)| *n).fold(0.0, f64::max);
    if total <= 0.0 {
        return None;
    }
    let mut sorted = delta;
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    sorted.iter().find(|(_, n)| *n >= q * total).map(|(le, _)| le * 1000.0)
}

/// Picks the control plane routed by load because its event stream was
/// behind (`ingest_shed_after_ms`).
fn picks_shed(text: &str) -> f64 {
    prom::sum(text, "kvgate_picks_shed_total")
}

/// Snapshots the control plane applied (whole; a newer one may overtake
/// one under way).
fn snapshots_applied(text: &str) -> f64 {
    prom::sum_where(text, "kvgate_model_events_total", "kind", "snapshot_applied")
}

fn kv_messages(text: &str) -> f64 {
    prom::sum_where(text, "kvgate_nats_messages_total", "kind", "kv")
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

/// Churn at `ops_per_s` until `stop`, paced every millisecond (a fleet of
/// relays publishes independently: a smooth stream, not 10 ms bursts),
/// with `gaps_per_s` skipped `relay_seq`s of random workers; returns the
/// block operations sent.
async fn churn(fleet: &mut Fleet, ops_per_s: u64, gaps_per_s: f64, stop: tokio::sync::watch::Receiver<bool>) -> u64 {
    let start = Instant::now();
    let (mut sent, mut gaps) = (0u64, 0u64);
    let mut rng = fastrand::Rng::with_seed(17);
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    while !*stop.borrow() {
        tick.tick().await;
        while gaps < (start.elapsed().as_secs_f64() * gaps_per_s) as u64 {
            fleet.make_gap(rng.usize(..fleet.workers()));
            gaps += 1;
        }
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

/// [`churn`] on the fleet's runtime (one thread of its own, which also
/// runs the fleet's NATS connection and heartbeats): the generator stands
/// for relays on other machines, so neither its work nor its socket writes
/// may queue on the client's runtime and delay the answers the client
/// times. Returns the fleet and the block operations sent.
async fn churn_apart(
    on: &tokio::runtime::Handle,
    mut fleet: Fleet,
    ops_per_s: u64,
    gaps_per_s: f64,
    stop: tokio::sync::watch::Receiver<bool>,
) -> (Fleet, u64) {
    on.spawn(async move {
        let ops = churn(&mut fleet, ops_per_s, gaps_per_s, stop).await;
        (fleet, ops)
    })
    .await
    .expect("the fleet's churn ended")
}

/// `--restart`: a control plane started in front of the live fleet (the
/// one before it stopped), as after a deploy. It knows no worker; each
/// worker's first heartbeat names a relay ahead of it, so every worker is
/// resynced from a snapshot at once, with the fleet churning on. Polls
/// its metrics until every worker's stream is synced (or
/// `a.restart_secs`): the time that took, the snapshot requests sent
/// (beyond one per worker: asked again), failed and applied, the
/// snapshots the fleet served, the largest RSS, and whether the NATS
/// connection dropped.
#[allow(clippy::too_many_arguments)]
async fn restart(
    a: &Args,
    fleet_rt: &tokio::runtime::Handle,
    fleet: Fleet,
    workers: usize,
    start: impl FnOnce() -> (kvgate_testkit::Proc, kvgate_testkit::ServeAddrs),
    served: &std::sync::atomic::AtomicU64,
    mixes: &Arc<Mixes>,
    first_id: u64,
) -> (Fleet, Value) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let churner = churn_apart(fleet_rt, fleet, a.ingest, 0.0, stop_rx);
    // DOKS new turns at this rate through the first RESTART_PICK_SECS.
    const RESTART_PICK_RATE: f64 = 500.0;
    const RESTART_PICK_SECS: f64 = 15.0;
    let watch = async {
        let served0 = served.load(std::sync::atomic::Ordering::Relaxed);
        let t = Instant::now();
        let (serve, addrs) = start();
        let pid = serve.pid();
        // A new process holds no conversation's chain hashes.
        mixes.forget_retained();
        let group = vec![load::Replica::connect(addrs.grpc, a.request_secs).await];
        let mixes = mixes.clone();
        let elide = a.elide;
        let picks = tokio::spawn(async move {
            load::open_loop(&group, mixes, "doks_new_turn", RESTART_PICK_RATE, RESTART_PICK_SECS, first_id, elide).await
        });
        let (mut peak_rss, mut disconnected, mut last) = (0.0f64, false, String::new());
        let mut timeline = Vec::new();
        let mut all_synced = None;
        let mut next_point = 0.0;
        while t.elapsed().as_secs_f64() < a.restart_secs {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let text = tokio::task::spawn_blocking(move || metrics(addrs.admin)).await.unwrap_or_default();
            let rss = proc_usage(pid).1;
            peak_rss = peak_rss.max(rss);
            let secs = t.elapsed().as_secs_f64();
            let synced = prom::sum_where(&text, "kvgate_worker_streams", "state", "synced");
            // Connected once, then not: the connection dropped.
            if prom::sum(&text, "kvgate_nats_connected") < 1.0 && !last.is_empty() {
                disconnected = true;
            }
            if secs >= next_point {
                timeline.push(json!({
                    "s": (secs * 10.0).round() / 10.0, "synced": synced,
                    "snapshotting": prom::sum_where(&text, "kvgate_worker_streams", "state", "snapshotting"),
                    "requests": prom::sum(&text, "kvgate_snapshot_requests_total"),
                    "rss_mb": rss.round(),
                }));
                next_point = secs.floor() + 1.0;
            }
            if !text.is_empty() {
                last = text;
            }
            if synced >= workers as f64 {
                all_synced = Some(secs);
                break;
            }
        }
        let requests = prom::sum(&last, "kvgate_snapshot_requests_total");
        let failures = prom::sum(&last, "kvgate_snapshot_failures_total");
        let applied = snapshots_applied(&last);
        let synced = prom::sum_where(&last, "kvgate_worker_streams", "state", "synced");
        let abandoned = prom::sum_where(&last, "kvgate_model_events_total", "kind", "snapshot_abandoned");
        let served = served.load(std::sync::atomic::Ordering::Relaxed) - served0;
        eprintln!(
            "{workers} workers, control plane restarted: all synced after {all_synced:?} s ({synced} synced at the end), {requests} snapshot requests ({failures} failed), {applied} applied, {abandoned} abandoned, {served} served, peak RSS {peak_rss:.0} MB, NATS dropped: {disconnected}"
        );
        // The fleet churns on until the Picks are done.
        let picks = picks.await.ok();
        let _ = stop_tx.send(true);
        drop(serve);
        let q = |p: &load::Step, x: f64| p.latency.quantile(x).round();
        if let Some(p) = &picks {
            eprintln!(
                "  DOKS new turns at {RESTART_PICK_RATE}/s through its first {RESTART_PICK_SECS} s: {} answered, {} failed, {} resent whole, p50 {} p99 {} p999 {} µs",
                p.answered,
                p.failed,
                p.resent,
                q(p, 0.5),
                q(p, 0.99),
                q(p, 0.999)
            );
        }
        let picks = picks.map(|p| {
            json!({
                "mix": "doks_new_turn", "offered_per_s": RESTART_PICK_RATE, "secs": RESTART_PICK_SECS,
                "answered": p.answered, "failed": p.failed, "resent": p.resent,
                "pick_p50_us": q(&p, 0.5), "pick_p99_us": q(&p, 0.99), "pick_p999_us": q(&p, 0.999),
            })
        });
        json!({
            "picks_from_start": picks,
            "workers": workers, "path": "grpc", "mix": "restart", "replicas": 1,
            "secs_to_all_synced": all_synced.map(|s| (s * 10.0).round() / 10.0), "limit_secs": a.restart_secs,
            "synced_at_end": synced, "snapshot_requests": requests, "snapshot_failures": failures,
            "snapshots_applied": applied, "snapshots_abandoned": abandoned, "snapshots_served": served,
            "peak_rss_mb": peak_rss.round(), "nats_dropped": disconnected,
            "ingest_offered_block_ops_per_s": a.ingest, "timeline": timeline,
        })
    };
    let ((fleet, _), row) = tokio::join!(churner, watch);
    (fleet, row)
}

fn row(workers: usize, replicas: usize, path: &str, mix: &str, lat: &Samples, extra: Value) -> Value {
    let mut r = json!({
        "workers": workers, "path": path, "mix": mix, "replicas": replicas,
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
    mixes.forget_retained();
    // The conversations and documents were seen before (their earlier
    // turns are cached).
    for (mix, n) in
        [("doks_new_turn", mixes.conversations.len() as u64), ("doc_question", mixes.documents.len() as u64)]
    {
        for i in 0..n {
            let req = mixes.request(mix, i);
            if let Ok(r) = app.pick(&req) {
                mixes.retain(&r.retained_chain_hashes);
                // Finished at once, as every Pick below.
                let done = kvgate_protocol::pb::CompletionReport {
                    request_id: req.request_id.clone(),
                    model: MODEL.into(),
                    total_us: 1,
                    ..Default::default()
                };
                let _ = app
                    .report(&kvgate_protocol::pb::CompletionReportBatch { reports: vec![done], ..Default::default() });
            }
        }
    }
    // The transport's floor has no in-process counterpart.
    for mix in a.mixes.iter().filter(|m| **m != load::FLOOR) {
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
            let r = app.pick(&req).or_else(|_| {
                mixes.forget(&Mixes::elided(&req));
                app.pick(&mixes.build(mix, 10_000_000 + i, false))
            });
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
            1,
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
    // The fake fleet's own runtime: its NATS connection, heartbeats and churn.
    let fleet_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("fleet")
        .enable_all()
        .build()
        .expect("fleet runtime");
    let mixes = Arc::new(Mixes::new(&tk, a.system_prompts));
    let mut rows = Vec::new();
    let mut agreements = Vec::new();
    for &workers in &a.workers {
        if a.in_process {
            rows.extend(in_process(&rt, &a, workers, &tk_dir, &mixes));
        }
        if !a.grpc {
            continue;
        }
        let (r, agree) = rt.block_on(over_grpc(&a, fleet_rt.handle(), workers, 1, &a.mixes, &tk, &tk_dir, &mixes));
        rows.extend(r);
        agreements.extend(agree);
    }
    // Replicas: the smallest fleet, the DOKS new-turn mix.
    if let Some(&workers) = a.workers.iter().min().filter(|_| a.grpc) {
        for &n in a.replicas.iter().filter(|n| **n > 1) {
            let (r, agree) =
                rt.block_on(over_grpc(&a, fleet_rt.handle(), workers, n, &["doks_new_turn"], &tk, &tk_dir, &mixes));
            rows.extend(r);
            agreements.extend(agree);
        }
    }
    let capacity = replica_capacity(&rows);
    let (commit, machine) = kvgate_bench_support::provenance();
    let result = json!({
        "rows": rows,
        "blocks_per_worker": a.blocks,
        "ingest_offered_block_ops_per_s": a.ingest,
        "step_secs": a.secs,
        "settle_secs": a.settle,
        "settle": "after the fill, the fleet churns for settle_secs with no Picks before the first step (its row: mix settle). The fill stores every worker's blocks at once, and the churn's first stale buckets then grow every worker's engine table once, within ~20 s at 1,000 workers: a wave of table growths that a fleet whose workers fill over hours spreads out. The steps measure the steady state after it; the settle row shows the wave's holds of the index and staleness",
        "request_secs": a.request_secs,
        "elided": a.elide,
        "doks_system_prompts": a.system_prompts,
        "resyncs_per_s": a.resyncs,
        "restart": "rows with mix restart: after one replica's steps, the control plane process is stopped and a new one started on the same NATS in front of the live fleet (churning at ingest_offered_block_ops_per_s, heartbeats every second); it knows no worker, so every worker's first heartbeat calls for a snapshot, which the fake fleet serves one at a time. secs_to_all_synced: from the new process's start until kvgate_worker_streams{state=synced} counts every worker (null: not within limit_secs); snapshot_requests / snapshot_failures / snapshots_applied / snapshots_abandoned from its metrics, snapshots_served by the fleet; peak_rss_mb over 250 ms polls; timeline: one point a second; picks_from_start: DOKS new turns at 500/s from the new process's start through 15 s (before a worker's first heartbeat there is none to route to: those fail; the client sends every request whole, the new process holding no chain hashes)",
        "resyncs": "with resyncs_per_s > 0, during every step the fleet skips one relay_seq of that many random workers a second; the control plane asks each for a snapshot, which its fake relay serves (what the worker holds as of its last batch, in chunks of 4,096 blocks): snapshots_served / snapshots_applied per step",
        "client": "open loop (sends never wait for answers; latency from the send), tonic over loopback (4 channels), at most 512 outstanding; with elided=true the earlier messages of a conversation or document already seen go as chain hashes only, as the filter sends them (a resend answer is followed by the whole request, counted in the latency and in `resent`, and its elided hashes are forgotten, as the filter does; each control plane started begins with an empty table); each routed request reported with its first token 200 ms after its Pick (or at its end if sooner) and finished request_secs after it (Report RPC, batched every 50 ms; the first-token report from 837a5a9 on, before which every request in flight stayed prefilling), so about rate x request_secs are in flight",
        "replica_capacity": capacity,
        "agreement": agreements,
        "replicas_setup": "n control planes (--replica-id scale-0..n-1) on one nats-server, each ingesting every event and sharing in-flight load over NATS; the client sends each request to the replica its conversation hashes to (as the gateway's ring hash on the conversation), each replica's answers reported to it; replica_capacity = the highest offered DOKS new-turn rate of the ladder answered in full (>= 95 %, nothing refused) with p99 within the bound; agreement = identical DOKS Picks to replicas 0 and 1 (to replica 0 twice with one replica), with the fleet churning: concurrent (both at once) and sequential (150 ms apart, the first reported finished: converged views); same_worker = share of pairs choosing the same worker (ties are broken at random), same_matched_blocks = share whose workers held as many of the prompt's blocks",
        "staleness": "p99 of kvgate_event_lag_seconds during the step, as the upper bound of its bucket",
        "grpc_floor": "rows with mix grpc_floor send no Pick: grpc.health.v1.Health/Check at the DOKS ladder's rates, open loop over the same four connections, with the fleet churning as in every step; their pick_*_us are those calls' latencies: the transport's and the machine's share of a Pick's, with no routing in it",
        "server_pick": "server_pick_p99_ms: p99 of kvgate_pick_duration_seconds during the step (the process's own time from receipt of a Pick to its answer, lock waits included; not the transport, the runtime's queue or the client), as the upper bound of its bucket (buckets 0.5, 1, 2, 5 ms ...); ingest_hold_p99_ms / ingest_hold_p999_ms: the same of kvgate_ingest_lock_hold_seconds (one application of KV batches under the index's write lock, which a Pick's lookup waits for)",
        "cpu": "the control plane processes' CPU time (user + system, all replicas) during the step: cpu_s_per_s per second; cpu_us_per_pick per answered Pick, ingest included; pick_cpu_us_per_pick = (cpu_s_per_s - the ingest-only step's cpu_s_per_s) / answered Picks per second, what the Picks add (NaN without an ingest-only step)",
        "shared_cores": "client, fleet generator, nats-server and control plane share the machine (the generator's churn, heartbeats and NATS connection on a runtime of their own, one thread, not on the client's runtime); machine_busy = share of all its cores busy during the step (/proc/stat)",
        "commit": commit,
        "machine": machine,
    });
    if let Some(dir) = a.out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&a.out, serde_json::to_string_pretty(&result).expect("json") + "\n").expect("write result");
    println!("{}", serde_json::to_string_pretty(&result).expect("json"));
}

/// For each replica count, the highest rate of the DOKS ladder answered in
/// full within each p99 bound.
fn replica_capacity(rows: &[Value]) -> Vec<Value> {
    let mut out = Vec::new();
    let mut counts: Vec<(u64, u64)> = rows
        .iter()
        .filter(|r| r["path"] == "grpc" && r["mix"] == "doks_new_turn")
        .filter_map(|r| Some((r["workers"].as_u64()?, r["replicas"].as_u64()?)))
        .collect();
    counts.sort_unstable();
    counts.dedup();
    for (workers, replicas) in counts {
        for bound_ms in [2.0, 5.0, 10.0] {
            let best = rows
                .iter()
                .filter(|r| r["path"] == "grpc" && r["mix"] == "doks_new_turn")
                .filter(|r| r["workers"].as_u64() == Some(workers) && r["replicas"].as_u64() == Some(replicas))
                .filter(|r| {
                    let offered = r["offered_per_s"].as_f64().unwrap_or(f64::INFINITY);
                    r["picks_per_s"].as_f64().unwrap_or(0.0) >= 0.95 * offered
                        && r["failed"].as_u64() == Some(0)
                        && r["pick_p99_us"].as_f64().unwrap_or(f64::INFINITY) <= bound_ms * 1000.0
                })
                .filter_map(|r| r["offered_per_s"].as_f64())
                .fold(0.0, f64::max);
            out.push(json!({"workers": workers, "replicas": replicas, "p99_bound_ms": bound_ms, "picks_per_s": best}));
        }
    }
    out
}

/// The process rows for `workers`.
#[allow(clippy::too_many_arguments)]
async fn over_grpc(
    a: &Args,
    fleet_rt: &tokio::runtime::Handle,
    workers: usize,
    replicas: usize,
    run_mixes: &[&'static str],
    tk: &kvgate_tokenize::ChatTokenizer,
    tk_dir: &std::path::Path,
    mixes: &Arc<Mixes>,
) -> (Vec<Value>, Vec<Value>) {
    let dir = kvgate_testkit::scratch_dir(&format!("bench-scale-{workers}-{replicas}")).expect("scratch dir");
    let nats = kvgate_testkit::NatsServer::start(&dir).expect("nats-server");
    let nats_url = format!("nats://127.0.0.1:{}", nats.port);
    let serve_cmd = |r: usize| {
        let mut cmd = std::process::Command::new(kvgate_bin());
        cmd.args([
            "serve",
            "--model",
            MODEL,
            "--block-size",
            "16",
            "--mode",
            "kv",
            "--replica-id",
            &format!("scale-{r}"),
        ])
        .arg("--tokenizer-dir")
        .arg(tk_dir)
        .args(["--nats-url", &nats_url, "--listen-grpc", "127.0.0.1:0", "--listen-admin", "127.0.0.1:0"]);
        cmd
    };
    let mut serves = Vec::new();
    for r in 0..replicas {
        serves.push(kvgate_testkit::spawn_serve(&format!("serve-{r}"), serve_cmd(r), &dir).expect("kvgate serve"));
    }
    let pids: Vec<u32> = serves.iter().map(|(p, _)| p.pid()).collect();
    let admins: Arc<Vec<std::net::SocketAddr>> = Arc::new(serves.iter().map(|(_, a)| a.admin).collect());
    // What every replica has consumed (each ingests every event).
    let consumed = move |admins: Arc<Vec<std::net::SocketAddr>>| async move {
        tokio::task::spawn_blocking(move || {
            admins.iter().map(|a| kv_messages(&metrics(*a))).fold(f64::INFINITY, f64::min)
        })
        .await
        .unwrap_or(0.0)
    };
    // CPU seconds summed over the replicas, and the largest RSS.
    let usage =
        |pids: &[u32]| pids.iter().map(|p| proc_usage(*p)).fold((0.0, 0.0f64), |(c, r), (c1, r1)| (c + c1, r.max(r1)));
    // Connected from the fleet's runtime, so that its connection task runs there.
    let url = nats_url.clone();
    let client = fleet_rt
        .spawn(async move { async_nats::ConnectOptions::new().connect(url.as_str()).await })
        .await
        .expect("the fleet's runtime")
        .expect("NATS");
    let mut fleet = Fleet::new(Sink::Nats(client.clone()), workers);
    let beats = fleet.beats(2 * a.blocks as u64).spawn(fleet_rt);
    let served = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let snapshots = fleet.serve_snapshots(fleet_rt, served.clone());
    let t = Instant::now();
    // Flow control: the consumer keeps within 20,000 messages.
    let settle = |published: u64| {
        let client = client.clone();
        let admins = admins.clone();
        async move {
            let _ = client.flush().await;
            let (mut last, mut since) = (-1.0, Instant::now());
            loop {
                let got = consumed(admins.clone()).await;
                // (Bounded as the final wait below.)
                if got + 20_000.0 >= published as f64 || since.elapsed() > Duration::from_secs(30) {
                    break;
                }
                if got > last {
                    (last, since) = (got, Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    fill(&mut fleet, tk, mixes, a.blocks, settle).await;
    // Every message consumed; a message lost on the way (NATS core drops
    // for a slow consumer) must not hang the benchmark: 30 s without
    // progress ends the wait, and the loss is counted.
    let published = fleet.published as f64;
    let (mut last, mut since) = (-1.0, Instant::now());
    let got = loop {
        let got = consumed(admins.clone()).await;
        if got >= published {
            break got;
        }
        if got > last {
            (last, since) = (got, Instant::now());
        } else if since.elapsed() > Duration::from_secs(30) {
            eprintln!("fill: {got} of {published} messages consumed, no progress for 30 s; going on");
            break got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let fill_lost = (published - got).max(0.0);
    let (_, rss) = usage(&pids);
    eprintln!(
        "{workers} workers, {replicas} replica(s): {} block operations in {:.1} s, control plane RSS {rss:.0} MB",
        fleet.block_ops,
        t.elapsed().as_secs_f64()
    );
    let mut group = Vec::new();
    for (_, addrs) in &serves {
        group.push(load::Replica::connect(addrs.grpc, a.request_secs).await);
    }
    let mut rows = Vec::new();
    mixes.forget_retained();
    // The conversations and documents were seen before (their earlier
    // turns are cached), each by the replica it hashes to; each of these
    // Picks is reported finished at once (none stays in flight through
    // the steps).
    let warm = [("doks_new_turn", mixes.conversations.len() as u64), ("doc_question", mixes.documents.len() as u64)];
    for (mix, n) in warm {
        for i in 0..n {
            let home = &group[(mixes.affinity(mix, i) % replicas as u64) as usize];
            let req = mixes.request(mix, i);
            let id = req.request_id.clone();
            if let Ok(r) = home.channels[0].clone().pick(req).await {
                let r = r.into_inner();
                mixes.retain(&r.retained_chain_hashes);
                home.ends.ended_now(id, r.worker_id, r.endpoint);
            }
        }
    }
    let mut next_id = 1_000u64;
    // Ingest alone first: the settling after the fill (see `settle` in
    // the result), then a step of it (what the Picks' CPU is measured
    // against).
    let settle = (a.settle > 0.0).then_some(("settle", 0.0));
    let steps: Vec<(&'static str, f64)> = settle
        .into_iter()
        .chain(std::iter::once(("none", 0.0)))
        .chain(run_mixes.iter().flat_map(|m| ladder(m).iter().map(move |r| (*m, *r))))
        .collect();
    let mut saturated: Option<&str> = None;
    // The processes' CPU in the ingest-only step (the first), CPU-s/s: a
    // step's CPU beyond it is what its Picks cost.
    let mut ingest_only_cpu: Option<f64> = None;
    for (mix, rate) in steps {
        if saturated == Some(mix) {
            continue;
        }
        let secs = if mix == "settle" { a.settle } else { a.secs };
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let text0: Vec<String> = admins.iter().map(|a| metrics(*a)).collect();
        let hist0: Vec<_> = text0.iter().map(|t| step_buckets(t)).collect();
        let shed0: f64 = text0.iter().map(|t| picks_shed(t)).sum();
        let (applied0, served0): (f64, u64) =
            (text0.iter().map(|t| snapshots_applied(t)).sum(), served.load(std::sync::atomic::Ordering::Relaxed));
        let (cpu0, _) = usage(&pids);
        let machine0 = machine_cpu();
        let ingest = a.ingest;
        let churner = async {
            let t = Instant::now();
            let (f, ops) = churn_apart(fleet_rt, fleet, ingest, a.resyncs, stop_rx).await;
            (f, ops as f64 / t.elapsed().as_secs_f64())
        };
        let load = async {
            let step = if rate > 0.0 {
                Some(load::open_loop(&group, mixes.clone(), mix, rate, secs, next_id, a.elide).await)
            } else {
                tokio::time::sleep(Duration::from_secs_f64(secs)).await;
                None
            };
            let _ = stop_tx.send(true);
            step
        };
        let ((f, ops_per_s), step) = tokio::join!(churner, load);
        fleet = f;
        let (cpu1, rss) = usage(&pids);
        let machine_busy = busy_share(machine0, machine_cpu());
        // The stalest replica's, and the slowest replica's server-side Pick
        // p99 (what the process itself took; the rest of the client's
        // latency is transport, scheduling and the client).
        let text1: Vec<String> = admins.iter().map(|a| metrics(*a)).collect();
        let hist1: Vec<_> = text1.iter().map(|t| step_buckets(t)).collect();
        let shed = text1.iter().map(|t| picks_shed(t)).sum::<f64>() - shed0;
        let snapshots_served = served.load(std::sync::atomic::Ordering::Relaxed) - served0;
        let snapshots_applied = text1.iter().map(|t| snapshots_applied(t)).sum::<f64>() - applied0;
        let worst = |h: usize, q: f64| {
            hist0.iter().zip(&hist1).filter_map(|(b, a)| bucket_quantile_ms(&b[h], &a[h], q)).reduce(f64::max)
        };
        let (lag, server_p99_ms) = (worst(0, 0.99), worst(1, 0.99));
        let (hold_p99_ms, hold_p999_ms) = (worst(2, 0.99), worst(2, 0.999));
        // The next step starts on a drained control plane (a saturated step
        // leaves a backlog of batches that would count against the next).
        let published = fleet.published as f64;
        let drain = Instant::now();
        while drain.elapsed() < Duration::from_secs(60) {
            let got = consumed(admins.clone()).await;
            if got >= published {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        next_id += (rate * secs) as u64 + 1;
        let Some(step) = step else {
            let cpu = (cpu1 - cpu0) / secs;
            if mix == "none" {
                ingest_only_cpu = Some(cpu);
            }
            eprintln!(
                "{workers} workers, ingest only ({mix}, {secs} s): {ops_per_s:.0} block ops/s, CPU {cpu:.2} s/s, lag p99 {lag:?} ms, ingest hold p99 {hold_p99_ms:?} p999 {hold_p999_ms:?} ms"
            );
            rows.push(json!({
                "workers": workers, "path": "grpc", "mix": mix, "replicas": replicas, "picks_per_s": 0, "fill_lost_messages": fill_lost,
                "secs": secs, "ingest_block_ops_per_s": ops_per_s.round(), "staleness_p99_ms": lag, "rss_mb": rss.round(),
                "cpu_s_per_s": (cpu * 100.0).round() / 100.0, "machine_busy": machine_busy,
                "ingest_hold_p99_ms": hold_p99_ms, "ingest_hold_p999_ms": hold_p999_ms,
                "snapshots_served": snapshots_served, "snapshots_applied": snapshots_applied,
            }));
            continue;
        };
        let pps = step.answered as f64 / step.secs;
        let cpu_per_pick = if step.answered > 0 { (cpu1 - cpu0) * 1e6 / step.answered as f64 } else { f64::NAN };
        // Without the ingest that runs beside the Picks.
        let pick_cpu = match ingest_only_cpu {
            Some(base) if pps > 0.0 => ((cpu1 - cpu0) / step.secs - base) * 1e6 / pps,
            _ => f64::NAN,
        };
        eprintln!(
            "{workers} workers, {replicas} replica(s), {mix} at {rate}/s: {pps:.0} answered/s, p50 {:.0} p99 {:.0} p999 {:.0} µs, {} failed, {} resent whole, {shed} shed (by load), {snapshots_applied} snapshots applied of {snapshots_served} served, ingest {ops_per_s:.0}/s, lag p99 {lag:?} ms, server-side Pick p99 {server_p99_ms:?} ms, ingest hold p99 {hold_p99_ms:?} p999 {hold_p999_ms:?} ms, machine busy {machine_busy}, CPU {cpu_per_pick:.0} µs/pick ({pick_cpu:.0} beyond ingest)",
            step.latency.quantile(0.5),
            step.latency.quantile(0.99),
            step.latency.quantile(0.999),
            step.failed,
            step.resent
        );
        rows.push(row(
            workers,
            replicas,
            "grpc",
            mix,
            &step.latency,
            json!({
                "offered_per_s": rate, "picks_per_s": pps.round(), "failed": step.failed, "resent": step.resent, "shed": shed,
                "ingest_block_ops_per_s": ops_per_s.round(), "staleness_p99_ms": lag, "rss_mb": rss.round(),
                "cpu_us_per_pick": cpu_per_pick.round(), "pick_cpu_us_per_pick": pick_cpu.round(),
                "cpu_s_per_s": ((cpu1 - cpu0) / step.secs * 100.0).round() / 100.0,
                "server_pick_p99_ms": server_p99_ms,
                "ingest_hold_p99_ms": hold_p99_ms, "ingest_hold_p999_ms": hold_p999_ms, "machine_busy": machine_busy,
                "resyncs_per_s": a.resyncs, "snapshots_served": snapshots_served, "snapshots_applied": snapshots_applied,
            }),
        ));
        // Past saturation: the answered rate fell behind, or the tail left a second.
        if pps < 0.9 * rate || step.latency.quantile(0.99) > 1e6 {
            saturated = Some(mix);
        }
    }
    // Decision agreement, with the fleet churning and no other load.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let churner = churn_apart(fleet_rt, fleet, a.ingest, 0.0, stop_rx);
    let probe = async {
        let pair = (0, 1 % replicas);
        let c = load::agreement(&group, pair, true, mixes, 100, next_id).await;
        let s = load::agreement(&group, pair, false, mixes, 100, next_id + 100).await;
        let _ = stop_tx.send(true);
        (c, s)
    };
    let ((mut fleet, _), (conc, seq)) = tokio::join!(churner, probe);
    let share = |x: u64, n: u64| if n > 0 { (x as f64 / n as f64 * 1000.0).round() / 1000.0 } else { f64::NAN };
    let mut agree = Vec::new();
    for (schedule, g) in [("concurrent", conc), ("sequential", seq)] {
        eprintln!("{workers} workers, {replicas} replica(s), {schedule} pairs: {g:?}");
        agree.push(json!({
            "workers": workers, "replicas": replicas, "schedule": schedule, "pairs": g.pairs,
            "same_worker": share(g.same_worker, g.pairs), "same_matched_blocks": share(g.same_matched, g.pairs),
        }));
    }
    if a.restart_secs > 0.0 && replicas == 1 {
        drop(group);
        serves.clear();
        let (f, row) = restart(
            a,
            fleet_rt,
            fleet,
            workers,
            || kvgate_testkit::spawn_serve("serve-restarted", serve_cmd(0), &dir).expect("kvgate serve"),
            &served,
            mixes,
            next_id + 200,
        )
        .await;
        fleet = f;
        rows.push(row);
    }
    drop(fleet);
    beats.abort();
    if let Some(s) = snapshots {
        s.abort();
    }
    drop(serves);
    drop(nats);
    (rows, agree)
}
