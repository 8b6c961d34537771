//! `kvgate-bench`: the whole-system benchmark (issue #8).
//!
//! `kvgate-bench doks` runs the DOKS multi-turn sweep: for every concurrency
//! level and every mode, a fresh stack (see [`stack`]), a warm-up window and
//! a measured window of closed-loop conversations ([`runner`]), one row of
//! results ([`stats`]); then tables ([`report`]) and a JSON file with the
//! commit and machine it ran on.
//!
//! Time: the simulated fleet runs `--speedup` times faster than the wall
//! clock. Windows are given in simulated seconds (the published run's 60 s
//! and 300 s) and every latency and rate is reported in simulated time.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;

use kvgate_bench::stack::{self, FleetSpec, Frontend, Stack};
use kvgate_bench::{report, runner, stats, workload};

#[derive(Parser)]
#[command(name = "kvgate-bench", about = "Whole-system benchmark of kvgate against round robin and peers")]
enum Cli {
    /// The DOKS multi-turn sweep (REFERENCE-RESULTS.md §A) on 3 simulated H200s.
    Doks(DoksArgs),
    /// Workato-style long prefixes (REFERENCE-RESULTS.md §B): 24 documents of
    /// 10K–100K tokens, closed loop at 16 and 32 concurrent requests, 4 workers.
    Workato(ReqArgs),
    /// Shared-prefix groups: 8 system prompts × 16 users, Poisson arrivals at
    /// 4, 8 and 12 requests/s (simulated), the DOKS fleet.
    Groups(ReqArgs),
    /// Cache pressure, the shape of llm-d's precise-versus-approximate run:
    /// tenants with ~6K-token prefixes, three times as many prefix tokens as
    /// the fleet's KV cache holds, 5 users per tenant asking ~1.2K-token
    /// questions, Poisson arrivals; levels are requests/s (simulated).
    CachePressure(ReqArgs),
    /// KV tiers (issue #24): the cache-pressure workload on a fleet whose
    /// workers offload evicted blocks to host memory (twice the device
    /// cache: device + host hold every tenant's prefix), so a prefix found
    /// in host memory is loaded back instead of recomputed; modes kv,
    /// kv_tier_blind, round_robin by default.
    Tiers(ReqArgs),
    /// Overload (issue #24): two tenants on the cache-pressure workload, a
    /// heavy one sending 80 % of the requests and a light one 20 %, at a
    /// total rate past the fleet's capacity (default 15 requests/s, ~1.5x
    /// the ~10 at which its throughput plateaus); modes kv and kv_overload
    /// (overload protection on); per-tenant TTFT, admitted and 429s.
    Overload(ReqArgs),
    /// Agent fan-out: bursts of 8–64 sibling requests on a new 4K–32K-token
    /// prefix within milliseconds, and their follow-ups; levels are bursts
    /// per minute (simulated).
    Fanout(ReqArgs),
    /// Mooncake trace replay (../shared/traces/mooncake/conversation_trace.jsonl):
    /// 512-token block ids as messages, 4 workers; levels are arrival rates
    /// in percent of the recorded one (100 = as recorded, 50 = the recorded
    /// gaps doubled).
    Mooncake(ReqArgs),
    /// Disaggregated prefill/decode (issue #25): long inputs (48 documents
    /// of 8K-100K tokens, 100-400-token questions, 200-800 output tokens,
    /// Poisson) on 4 workers: aggregated `kv` against disaggregated and
    /// conditional fleets (`disaggregated_1p3d`, `disaggregated_2p2d`,
    /// `conditional_1p3d`, ...); levels are requests per minute (simulated).
    /// Writes bench/results/pd.json rows in the format too.
    Pd(ReqArgs),
    /// A second client (issue #23): aiperf sends the shared-prefix groups
    /// workload's requests at the same times as kvgate-bench does, each
    /// client on a fresh stack of the same mode; both summarized alike, and
    /// how far they agree. Needs scripts/setup-aiperf.sh (make bench-aiperf).
    Aiperf(ReqArgs),
    /// Real vLLM (issue #20): kv, round robin and sglang-router's
    /// cache_aware on two real engines; hit rate, prediction accuracy,
    /// load skew and errors to bench/results/vllm.json.
    Vllm(kvgate_bench::vllm_cell::VllmArgs),
    /// Engine-timing calibration (issue #22): the control plane's learned
    /// model against each preset's truth, before and after the fleet slows
    /// down; bench/results/calibration.json and a plot per preset.
    Calibration(kvgate_bench::calibrate::CalibrationArgs),
    /// A calibration run's learning replayed offline from its journal
    /// through this build's estimator: requests to within 10 % per class,
    /// next to the live run's.
    CalibrationReplay(kvgate_bench::calibrate::replay::ReplayArgs),
    /// The live dashboard: every mode's stack under the same DOKS load, a
    /// web page with a concurrency slider and rolling metrics per mode.
    Dashboard(DashArgs),
    /// Rewrites the tables (.md), charts (<stem>/*.svg) and HTML report
    /// (.html) of result files from their JSON.
    Report {
        /// Result files, e.g. bench/results/doks-multiturn.json.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}

#[derive(clap::Args)]
struct DoksArgs {
    /// The short sweep of `make demo`: levels 60,120,180; kv, round_robin and
    /// sglang_cache_aware unless --modes says otherwise; 60 s warm-up and
    /// 120 s measured (simulated).
    #[arg(long)]
    quick: bool,
    /// Concurrency levels (simultaneous conversations).
    #[arg(long, value_delimiter = ',', default_values_t = [60, 80, 100, 120, 140, 160, 180])]
    levels: Vec<usize>,
    /// Simulated time runs this many times faster than the wall clock.
    #[arg(long, default_value_t = 8.0)]
    speedup: f64,
    /// Measured window, simulated seconds.
    #[arg(long, default_value_t = 300.0)]
    measure_s: f64,
    /// Longest wait for requests in flight at the end, simulated seconds.
    #[arg(long, default_value_t = 180.0)]
    drain_s: f64,
    /// Result file (JSON); the tables go beside it as .md. Default:
    /// bench/results/doks-multiturn.json, or with --quick
    /// target/bench-runs/doks-multiturn-quick.json.
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    sweep: SweepArgs,
}

#[derive(clap::Args)]
struct ReqArgs {
    /// A short run: levels as given, kv / round_robin / sglang_cache_aware
    /// unless --modes says otherwise, 30 s warm-up and 60 s measured;
    /// results under target/bench-runs/.
    #[arg(long)]
    quick: bool,
    /// Levels: concurrency (workato), requests/s (groups), percent of the
    /// recorded arrival rate (mooncake).
    #[arg(long, value_delimiter = ',')]
    levels: Vec<usize>,
    /// Simulated time runs this many times faster (default per workload).
    #[arg(long)]
    speedup: Option<f64>,
    /// Measured window, simulated seconds.
    #[arg(long, default_value_t = 240.0)]
    measure_s: f64,
    /// Longest wait for requests in flight at the end, simulated seconds.
    #[arg(long, default_value_t = 300.0)]
    drain_s: f64,
    /// Result file (default: bench/results/<workload>.json, or with --quick
    /// target/bench-runs/<workload>-quick.json).
    #[arg(long)]
    out: Option<PathBuf>,
    /// `pd` only: the documents requests draw from (default 48, which the
    /// fleet's cache mostly holds); 0 = a new document for every request
    /// (every prompt cold: prefill-heavy).
    #[arg(long)]
    documents: Option<usize>,
    /// `pd` only: settings of the control plane's `[models.disaggregation]`
    /// for the conditional modes, `name=value`, repeatable (e.g. `--disagg
    /// stall_weight=0` for the new request's TTFT alone). Default: none,
    /// the control plane's own defaults.
    #[arg(long = "disagg")]
    disagg_settings: Vec<String>,
    #[command(flatten)]
    sweep: SweepArgs,
}

/// The flags every sweep shares (`doks` and the request workloads).
#[derive(clap::Args)]
struct SweepArgs {
    /// Modes: kv, kv_true_constants, kv_no_speculation, kv_tier_blind, kv_lasting_load, kv_overload, kv_end_reports, approx, least_load, round_robin
    /// (kvgate), sglang_cache_aware (peer). Default: round_robin, kv,
    /// approx, least_load, sglang_cache_aware (with --quick: round_robin,
    /// kv, sglang_cache_aware).
    #[arg(long, value_delimiter = ',')]
    modes: Vec<String>,
    /// Output tokens per streamed chunk after the first (vLLM's --stream-interval).
    #[arg(long, default_value_t = 8)]
    stream_interval: usize,
    /// Warm-up window, simulated seconds.
    #[arg(long, default_value_t = 60.0)]
    warmup_s: f64,
    /// The fleet: h200-llama70b-fp8 (the DOKS demo's 3× H200, the preset
    /// the router was first tuned on), dynamo-mocker (Dynamo's published
    /// timing), vllm-v1 (3× H100 serving Llama-3.1-8B, attention that grows
    /// with context) or hetero (2× H100 + 2× A100 40 GB).
    #[arg(long, default_value = "h200-llama70b-fp8")]
    preset: String,
    /// Settings of the control plane's kv policy, `name=value`, repeatable
    /// (e.g. `--kv overlap_weight=2`, `--kv unit=blocks`): see
    /// control-plane/server/README.md. Default: none, the control plane's
    /// own defaults (cost in time units).
    #[arg(long = "kv")]
    kv_settings: Vec<String>,
    /// A level is flagged invalid when host CPU exceeds this share.
    #[arg(long, default_value_t = 0.70)]
    cpu_limit: f64,
    /// Logs and configs of every cell.
    #[arg(long, default_value = "target/bench-runs")]
    run_dir: PathBuf,
    /// Runs of every cell, interleaved (each level: every mode once, then
    /// again); a row is the median of its runs, which it also lists.
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// Poll the control plane's `/admin/timing` every this many wall ms
    /// while each cell runs, into the cell's `timing-polls.json` (the
    /// prices `kv` routed with over the run). 0: off. The polls cost CPU:
    /// read prices from such a run, not latencies.
    #[arg(long, default_value_t = 0)]
    timing_polls_ms: u64,
}

impl SweepArgs {
    /// The modes when none were given: with `quick`, the three that answer
    /// the question.
    fn default_modes(&mut self, quick: bool) {
        if self.modes.is_empty() {
            let m: &[&str] = if quick {
                &["round_robin", "kv", "sglang_cache_aware"]
            } else {
                &["round_robin", "kv", "approx", "least_load", "sglang_cache_aware"]
            };
            self.modes = m.iter().map(|m| (*m).to_owned()).collect();
        }
    }
}

/// One sweep under way: what its cells share (fleet, windows, files,
/// provenance).
struct Sweep {
    fronts: Vec<Frontend>,
    out: PathBuf,
    run_dir: PathBuf,
    windows: runner::Windows,
    fleet: FleetSpec,
    speedup: f64,
    warmup_s: f64,
    measure_s: f64,
    cpu_limit: f64,
    repeats: usize,
    /// `--timing-polls-ms`, when on.
    timing_polls: Option<Duration>,
    commit: String,
    machine: String,
    stamp: u64,
    rt: tokio::runtime::Runtime,
}

impl Sweep {
    /// Checks the flags and lays out the sweep; `out` is relative to the
    /// repository unless absolute.
    fn new(a: &SweepArgs, speedup: f64, measure_s: f64, drain_s: f64, out: PathBuf) -> Result<Self> {
        if !(speedup.is_finite() && speedup > 0.0) || a.stream_interval == 0 || a.repeats == 0 {
            bail!("--speedup must be > 0, --stream-interval and --repeats at least 1");
        }
        let fronts: Vec<Frontend> = a.modes.iter().map(|m| Frontend::parse(m)).collect::<Result<_>>()?;
        let root = kvgate_testkit::repo_root();
        let out = if out.is_absolute() { out } else { root.join(out) };
        report::check_result_path(&out)?;
        let run_dir = if a.run_dir.is_absolute() { a.run_dir.clone() } else { root.join(&a.run_dir) };
        let wall = |sim_s: f64| Duration::from_secs_f64(sim_s / speedup);
        let windows = runner::Windows { warmup: wall(a.warmup_s), measure: wall(measure_s), drain: wall(drain_s) };
        let mut fleet = FleetSpec::preset(&a.preset, speedup, a.stream_interval)?;
        fleet.kv_settings = kv_lines(&a.kv_settings)?;
        let (commit, machine) = kvgate_bench_support::provenance();
        let stamp =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        Ok(Self {
            fronts,
            out,
            run_dir,
            windows,
            fleet,
            speedup,
            warmup_s: a.warmup_s,
            measure_s,
            cpu_limit: a.cpu_limit,
            repeats: a.repeats,
            timing_polls: (a.timing_polls_ms > 0).then(|| Duration::from_millis(a.timing_polls_ms)),
            commit,
            machine,
            stamp,
            rt: tokio::runtime::Builder::new_current_thread().enable_all().build()?,
        })
    }

    /// Runs every cell: level by level, every mode in turn on a fresh stack
    /// (slow drifts of a shared machine fall on every mode alike), the
    /// whole round `repeats` times; a mode's row at a level is the median
    /// of its runs ([`stats::median_row`]). `prepare` builds a level's
    /// workload; `cell` drives it on one stack and summarizes the run as
    /// that mode's row.
    fn cells<L>(
        &self,
        tag: &str,
        levels: &[usize],
        mut prepare: impl FnMut(usize) -> Result<L>,
        mut cell: impl FnMut(&Self, &L, &Stack, &str, usize) -> Result<(runner::CellRun, stats::Row)>,
    ) -> Result<Vec<stats::Row>> {
        let mut rows = Vec::new();
        for &level in levels {
            let load = prepare(level)?;
            let mut runs: Vec<Vec<stats::Row>> = vec![Vec::new(); self.fronts.len()];
            for repeat in 0..self.repeats {
                for (front, runs) in self.fronts.iter().zip(&mut runs) {
                    let mode = front.name();
                    let name =
                        if self.repeats > 1 { format!("{mode}-{level}-{repeat}") } else { format!("{mode}-{level}") };
                    let dir = self.run_dir.join(format!("{tag}-{}", self.stamp)).join(name);
                    let mut stack = Stack::start(&dir, &self.fleet, front)
                        .with_context(|| format!("starting the stack for {mode}"))?;
                    let polls = self.timing_polls.and_then(|i| stack.poll_timing(i));
                    let (run, row) = cell(self, &load, &stack, &mode, level)?;
                    if let Some(p) = polls {
                        p.finish(&dir)?;
                    }
                    stack.check().with_context(|| format!("{mode} at {level}: a process of the stack died"))?;
                    stack.save_diagnostics(&dir);
                    drop(stack);
                    print_row(&row);
                    std::fs::write(dir.join("records.json"), serde_json::to_vec(&run.records)?)?;
                    runs.push(row);
                }
            }
            for runs in runs {
                let row = stats::median_row(runs)?;
                if self.repeats > 1 {
                    print!("   median of {}:", self.repeats);
                    print_row(&row);
                }
                rows.push(row);
            }
        }
        Ok(rows)
    }

    /// What a result says about repeats: nothing for one run per cell.
    fn repeats_note(&self) -> String {
        if self.repeats > 1 {
            format!("; every cell the median of {} interleaved runs", self.repeats)
        } else {
            String::new()
        }
    }

    /// The line every result states first: commit, machine, preset, workers
    /// (then `note`), speedup, stream interval, windows, then `tail`.
    fn context(&self, note: &str, stream_interval: usize, tail: &str) -> String {
        format!(
            "commit {}, {}; preset {}, {} workers{note}; speedup {}x, stream interval {stream_interval}, windows {} s warm-up + {} s measured (simulated){}; {tail}",
            self.commit,
            self.machine,
            self.fleet.preset,
            self.fleet.kinds().len(),
            self.speedup,
            self.warmup_s,
            self.measure_s,
            self.repeats_note()
        )
    }

    /// The result document's keys that every sweep has, with `extra` added.
    fn doc(&self, stream_interval: usize, quick: bool, extra: serde_json::Value) -> serde_json::Value {
        let fleet = &self.fleet;
        let mut doc = serde_json::json!({
            "commit": self.commit,
            "machine": self.machine,
            "speedup": self.speedup,
            "window_s": self.measure_s,
            "warmup_s": self.warmup_s,
            "stream_interval": stream_interval,
            "kv_settings": fleet.kv_settings,
            "settings": {
                "control_plane": "defaults, plus kv_settings; no engine timing passed (learn_timing defaults to true)",
                "kv_settings": fleet.kv_settings,
                "disagg_settings": fleet.disagg_settings,
                "kv_true_constants": fleet.true_constants().unwrap_or_default(),
                "kv_no_speculation": stack::NO_SPECULATION,
                "kv_lasting_load": [stack::LASTING_LOAD],
                "kv_tier_blind": [stack::TIER_BLIND],
                "kv_overload": stack::OVERLOAD,
                "kv_end_reports": "the filter's reports.first_token = false (the end of each request only)",
                "filter_reports": {"interval_ms": stack::report_interval_ms(self.speedup), "first_token": true},
            },
            "cpu_limit": self.cpu_limit,
            "fleet": {
                "preset": fleet.preset,
                "workers": fleet.workers, "timing": fleet.timing, "block_size": fleet.block_size,
                "num_blocks": fleet.num_blocks, "extra_workers": fleet.extra, "max_num_seqs": fleet.max_num_seqs,
                "host_blocks": fleet.host_blocks,
                "max_num_batched_tokens": fleet.max_num_batched_tokens,
            },
            "unix_time": self.stamp,
            "quick": quick,
            "repeats": self.repeats,
        });
        if let (Some(d), serde_json::Value::Object(e)) = (doc.as_object_mut(), extra) {
            d.extend(e);
        }
        doc
    }

    /// Writes the result file, its tables, charts and HTML report, and
    /// prints the tables.
    fn publish(
        &self,
        doc: &serde_json::Value,
        title: &str,
        context: &str,
        level: &str,
        rows: &[stats::Row],
    ) -> Result<()> {
        if let Some(p) = self.out.parent() {
            std::fs::create_dir_all(p)?;
        }
        let mut doc = doc.clone();
        doc["slo_goodput"] = report::slo_goodput_json(rows);
        std::fs::write(&self.out, serde_json::to_string_pretty(&doc)? + "\n")?;
        let md = report::publish(&self.out, title, context, level, rows)?;
        println!("\n{md}");
        println!("{}\n", report::slo_line(rows, level));
        println!(
            "results: {} (and .md, .html, charts in {}/); logs: {}",
            self.out.display(),
            self.out.with_extension("").display(),
            self.run_dir.display()
        );
        Ok(())
    }
}

/// A cell's line in the sweep's log.
fn print_row(row: &stats::Row) {
    println!(
        "   {:>3} {:<19} TTFT p50 {:>7.0} p95 {:>7.0} ms  ITL {:>5.1} ms  E2E {:>5.1} s  {:>5.0} tok/s  hit {:>5.1} % (oracle {:>5.1} %){}  n {}  errors {}  CPU {:.0} %{}",
        row.concurrency,
        row.mode,
        row.ttft_p50_ms,
        row.ttft_p95_ms,
        row.itl_p50_ms,
        row.e2e_p50_s,
        row.output_tok_per_s,
        row.hit_rate * 100.0,
        row.oracle_hit_rate * 100.0,
        row.moved.map_or_else(String::new, |m| format!("  moved {m}")),
        row.requests,
        row.errors,
        row.host_cpu * 100.0,
        if row.valid { "" } else { " (CPU above the limit: invalid)" }
    );
}

#[derive(clap::Args)]
struct DashArgs {
    /// Modes shown side by side (each gets its own fleet and front door).
    #[arg(long, value_delimiter = ',', default_values_t = ["round_robin".to_owned(), "kv".to_owned(), "sglang_cache_aware".to_owned()])]
    modes: Vec<String>,
    /// Port of the page on 127.0.0.1.
    #[arg(long, default_value_t = 8090)]
    port: u16,
    /// Conversations per mode at the start (the slider moves it).
    #[arg(long, default_value_t = 12)]
    concurrency: usize,
    /// The slider's maximum.
    #[arg(long, default_value_t = 180)]
    max_concurrency: usize,
    /// Simulated time runs this many times faster than the wall clock. The
    /// modes share the machine, so this is lower than the sweep's.
    #[arg(long, default_value_t = 4.0)]
    speedup: f64,
    /// Output tokens per streamed chunk after the first.
    #[arg(long, default_value_t = 8)]
    stream_interval: usize,
    /// Rolling window of the metrics, wall seconds.
    #[arg(long, default_value_t = 60.0)]
    window_s: f64,
    /// Stop by itself after this many wall seconds (default: at Ctrl-C).
    #[arg(long)]
    duration_s: Option<f64>,
    /// Settings of the kv policy, `name=value`, as for `doks`.
    #[arg(long = "kv")]
    kv_settings: Vec<String>,
    /// Logs and configs of every stack.
    #[arg(long, default_value = "target/bench-runs")]
    run_dir: PathBuf,
}

/// On SIGINT or SIGTERM, kills the stacks this run started (simulated
/// workers, relays, nats-server, Envoy, control planes, peers) before
/// exiting: a process ended by a signal runs no destructors, and they would
/// outlive it. (The dashboard stops its stacks itself.)
fn stop_stacks_on_signal() {
    std::thread::spawn(|| {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        let code = rt.block_on(async {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok()?;
            tokio::select! {
                r = tokio::signal::ctrl_c() => r.ok().map(|()| 130),
                _ = term.recv() => Some(143),
            }
        });
        if let Some(code) = code {
            eprintln!("signal: stopping the processes this run started");
            kvgate_testkit::kill_started();
            std::process::exit(code);
        }
    });
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if !matches!(cli, Cli::Dashboard(_)) {
        stop_stacks_on_signal();
    }
    match cli {
        Cli::Doks(a) => doks(a),
        Cli::Workato(a) => requests_sweep(Kind::Workato, a),
        Cli::Groups(a) => requests_sweep(Kind::Groups, a),
        Cli::CachePressure(a) => requests_sweep(Kind::CachePressure, a),
        Cli::Tiers(a) => requests_sweep(Kind::Tiers, a),
        Cli::Overload(a) => requests_sweep(Kind::Overload, a),
        Cli::Fanout(a) => requests_sweep(Kind::Fanout, a),
        Cli::Mooncake(a) => requests_sweep(Kind::Mooncake, a),
        Cli::Pd(a) => requests_sweep(Kind::Pd, a),
        Cli::Dashboard(a) => dashboard(a),
        Cli::Aiperf(a) => aiperf(a),
        Cli::Vllm(a) => kvgate_bench::vllm_cell::run(&a),
        Cli::Calibration(a) => kvgate_bench::calibrate::run(&a),
        Cli::CalibrationReplay(a) => kvgate_bench::calibrate::replay::run(&a),
        Cli::Report { files } => {
            for f in files {
                rewrite_report(&f)?;
            }
            Ok(())
        }
    }
}

/// kvgate-bench and aiperf on the same requests (`kvgate_bench::aiperf`):
/// per level and mode, one cell with each client (modes `<m>` and
/// `<m>_aiperf`). Defaults: mode kv, 4 requests/s, speedup 1 (aiperf
/// measures wall time, so its own costs count at their real size).
fn aiperf(mut a: ReqArgs) -> Result<()> {
    use kvgate_bench::runner::Load;
    use kvgate_bench::workload::{Groups, Requests};
    let bin = kvgate_bench::aiperf::aiperf_bin();
    ensure!(bin.exists(), "{} is missing: run scripts/setup-aiperf.sh (make bench-aiperf does)", bin.display());
    if a.levels.is_empty() {
        a.levels = vec![4];
    }
    if a.sweep.modes.is_empty() {
        a.sweep.modes = vec!["kv".to_owned()];
    }
    let speedup = a.speedup.unwrap_or(1.0);
    let out = a.out.clone().unwrap_or_else(|| PathBuf::from("bench/results/aiperf.json"));
    let sweep = Sweep::new(&a.sweep, speedup, a.measure_s, a.drain_s, out)?;
    let horizon = a.sweep.warmup_s + a.measure_s;
    let workload = |level: usize| Ok(Requests::Groups(Groups::new(level as f64, horizon)));
    let block = u64::from(sweep.fleet.block_size);
    let title = "Two clients on the same requests: kvgate-bench and aiperf (shared-prefix groups, Poisson)";
    println!(
        "== {title}: levels {:?} (qps) x {} modes x 2 clients, speedup {speedup}x, windows {} s + {} s",
        a.levels,
        sweep.fronts.len(),
        a.sweep.warmup_s,
        a.measure_s
    );
    let mut rows = sweep.cells("aiperf-ours", &a.levels, workload, |sw, wl, stack, mode, level| {
        let load = Load::Open { speedup };
        let run =
            sw.rt.block_on(runner::run_requests(stack.front, &stack.workers, &stack.pids, wl, load, sw.windows))?;
        let row = stats::summarize(mode, level, &run, speedup, block, stats::Oracle::Prefixes(wl), sw.cpu_limit);
        Ok((run, row))
    })?;
    rows.extend(sweep.cells("aiperf-theirs", &a.levels, workload, |sw, wl, stack, mode, level| {
        let run = sw.rt.block_on(kvgate_bench::aiperf::run(
            stack.front,
            &stack.workers,
            &stack.pids,
            wl,
            speedup,
            sw.windows,
            &stack.dir,
        ))?;
        let name = format!("{mode}_aiperf");
        let row = stats::summarize(&name, level, &run, speedup, block, stats::Oracle::Prefixes(wl), sw.cpu_limit);
        Ok((run, row))
    })?);
    let agreement = kvgate_bench::aiperf::agreement(&rows);
    for g in &agreement {
        println!("agreement (aiperf / kvgate-bench - 1): {g}");
    }
    let context = sweep.context(
        "",
        a.sweep.stream_interval,
        "client kvgate-bench (mode m) and aiperf 0.13.0 (mode m_aiperf), each on a fresh stack; levels: qps",
    );
    let doc = sweep.doc(
        a.sweep.stream_interval,
        a.quick,
        serde_json::json!({"workload": "aiperf", "title": title, "context": context, "level": "qps", "rows": rows,
                           "agreement": agreement}),
    );
    sweep.publish(&doc, title, &context, "qps", &rows)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Workato,
    Groups,
    CachePressure,
    Tiers,
    Overload,
    Fanout,
    Mooncake,
    Pd,
}

/// A sweep of a request-level workload: per level, every mode on a fresh
/// stack, as `doks` does.
fn requests_sweep(kind: Kind, mut a: ReqArgs) -> Result<()> {
    use kvgate_bench::runner::Load;
    use kvgate_bench::workload::{Fanout, Groups, Requests, Trace, Workato};
    let (name, mut title, level_name, default_levels, default_speedup) = match kind {
        Kind::Workato => {
            ("workato-longprefix", "Workato long prefix (24 documents of 10K-100K tokens)", "conc.", vec![16, 32], 4.0)
        }
        Kind::Groups => {
            ("prefix-groups", "Shared-prefix groups (8 system prompts x 16 users, Poisson)", "qps", vec![4, 8, 12], 8.0)
        }
        Kind::CachePressure => (
            "cache-pressure",
            "Cache pressure (tenants' ~6K-token prefixes 3x the fleet's KV cache, ~1.2K-token questions, Poisson)",
            "qps",
            vec![4, 8, 12, 16, 20],
            1.0,
        ),
        Kind::Tiers => (
            "tiers",
            "KV tiers (cache pressure with host-memory offloading: device cache 1/3 of the tenants' prefixes, host memory twice the device cache)",
            "qps",
            vec![10],
            1.0,
        ),
        Kind::Overload => (
            "overload",
            "Overload (two tenants, 80 % / 20 % of the requests, on the cache-pressure workload past the fleet's capacity)",
            "qps",
            vec![15],
            1.0,
        ),
        Kind::Fanout => (
            "fanout",
            "Agent fan-out (bursts of 8-64 siblings on a new 4K-32K-token prefix within ms, follow-ups 20 s later)",
            "bursts/min",
            vec![4, 8, 16],
            1.0,
        ),
        Kind::Mooncake => ("mooncake", "Mooncake conversation trace replay", "rate %", vec![50, 100], 2.0),
        Kind::Pd => (
            "pd-sweep",
            "Disaggregated prefill/decode (48 documents of 8K-100K tokens, 100-400-token questions, 200-800 output tokens, Poisson)",
            "req/min",
            vec![20, 40],
            4.0,
        ),
    };
    if a.levels.is_empty() {
        a.levels = default_levels;
    }
    ensure!(a.documents.is_none() || kind == Kind::Pd, "--documents is a pd option");
    ensure!(a.disagg_settings.is_empty() || kind == Kind::Pd, "--disagg is a pd option");
    let documents = a.documents.unwrap_or(48);
    let fresh_title;
    if kind == Kind::Pd && documents != 48 {
        let docs =
            if documents == 0 { "a new document per request".to_owned() } else { format!("{documents} documents") };
        fresh_title = format!(
            "Disaggregated prefill/decode ({docs} of 8K-100K tokens, 100-400-token questions, 200-800 output tokens, Poisson)"
        );
        title = &fresh_title;
    }
    if kind == Kind::Tiers && a.sweep.modes.is_empty() {
        a.sweep.modes = ["kv", "kv_tier_blind", "round_robin"].iter().map(|m| (*m).to_owned()).collect();
    }
    if kind == Kind::Pd && a.sweep.modes.is_empty() {
        a.sweep.modes = ["kv", "disaggregated_1p3d", "disaggregated_2p2d", "conditional_1p3d", "conditional_2p2d"]
            .iter()
            .map(|m| (*m).to_owned())
            .collect();
    }
    if kind == Kind::Overload && a.sweep.modes.is_empty() {
        a.sweep.modes = ["kv", "kv_overload"].iter().map(|m| (*m).to_owned()).collect();
    }
    a.sweep.default_modes(a.quick);
    if a.quick {
        a.sweep.warmup_s = 30.0;
        a.measure_s = 60.0;
    }
    let speedup = a.speedup.unwrap_or(default_speedup);
    let out = a.out.clone().unwrap_or_else(|| {
        PathBuf::from(if a.quick {
            format!("target/bench-runs/{name}-quick.json")
        } else {
            format!("bench/results/{name}.json")
        })
    });
    let mut sweep = Sweep::new(&a.sweep, speedup, a.measure_s, a.drain_s, out)?;
    sweep.fleet.disagg_settings = kv_lines(&a.disagg_settings)?;
    if matches!(kind, Kind::Workato | Kind::Mooncake | Kind::Pd) {
        // A larger fleet; each worker holds several long documents.
        sweep.fleet.workers = 4;
        sweep.fleet.num_blocks = 20_000;
    }
    if kind == Kind::Tiers {
        sweep.fleet.host_blocks = 2 * sweep.fleet.num_blocks;
    }
    let horizon = a.sweep.warmup_s + a.measure_s;
    let capacity_tokens: u64 =
        sweep.fleet.kinds().iter().map(|(_, blocks)| *blocks as u64 * u64::from(sweep.fleet.block_size)).sum();
    let tenants = Groups::tenants_for(capacity_tokens, 3.0);
    let workload_for = |level: usize| -> Result<(Requests, Load)> {
        Ok(match kind {
            Kind::Workato => (Requests::Workato(Workato::default()), Load::Closed(level)),
            Kind::Groups => (Requests::Groups(Groups::new(level as f64, horizon)), Load::Open { speedup }),
            Kind::Fanout => (Requests::Fanout(Fanout::new(level as f64, horizon)), Load::Open { speedup }),
            Kind::Pd => {
                let mut g = Groups::pd(level as f64 / 60.0, horizon);
                // 2^40 documents: a request meets one seen before with
                // probability below 1e-9.
                g.groups = if documents == 0 { 1 << 40 } else { documents };
                (Requests::Groups(g), Load::Open { speedup })
            }
            Kind::CachePressure | Kind::Tiers => {
                (Requests::Groups(Groups::cache_pressure(level as f64, horizon, tenants)), Load::Open { speedup })
            }
            Kind::Overload => {
                let groups = Requests::Groups(Groups::cache_pressure(level as f64, horizon, tenants));
                (Requests::Tenants(Box::new(groups), 0.2), Load::Open { speedup })
            }
            Kind::Mooncake => {
                let path = kvgate_testkit::shared_dir()?.join("traces/mooncake/conversation_trace.jsonl");
                let compress = level.max(1) as f64 / 100.0;
                (
                    Requests::Trace(Trace::mooncake(&path, horizon * 1000.0 * compress, compress, 2_000)?),
                    Load::Open { speedup },
                )
            }
        })
    };
    println!(
        "== {title}: levels {:?} ({level_name}) x {} modes, speedup {speedup}x, windows {} s + {} s simulated ({:.1} s + {:.1} s wall)",
        a.levels,
        sweep.fronts.len(),
        a.sweep.warmup_s,
        a.measure_s,
        sweep.windows.warmup.as_secs_f64(),
        sweep.windows.measure.as_secs_f64(),
    );
    let mut tenant_rows = Vec::new();
    let rows = sweep.cells(name, &a.levels, workload_for, |sw, (wl, load), stack, mode, level| {
        let run =
            sw.rt.block_on(runner::run_requests(stack.front, &stack.workers, &stack.pids, wl, *load, sw.windows))?;
        let block = u64::from(sw.fleet.block_size);
        let row = stats::summarize(mode, level, &run, speedup, block, stats::Oracle::Prefixes(wl), sw.cpu_limit);
        for t in stats::by_tenant(mode, level, &run, speedup) {
            println!(
                "         {:<19} tenant {:<5} TTFT p50 {:>7.0} p95 {:>7.0} ms  admitted {}  429 {}  other errors {}",
                "", t.tenant, t.ttft_p50_ms, t.ttft_p95_ms, t.admitted, t.rejected_429, t.other_errors
            );
            tenant_rows.push(t);
        }
        Ok((run, row))
    })?;
    let tenants_note = if matches!(kind, Kind::CachePressure | Kind::Tiers | Kind::Overload) {
        let host = sweep.fleet.host_blocks;
        let host = if host > 0 { format!(", host memory {host} blocks per worker") } else { String::new() };
        format!("; {tenants} tenants (their prefixes ~3x the fleet's {capacity_tokens} tokens of KV cache{host})")
    } else {
        String::new()
    };
    let context = sweep.context(&tenants_note, a.sweep.stream_interval, &format!("levels: {level_name}"));
    let doc = sweep.doc(
        a.sweep.stream_interval,
        a.quick,
        serde_json::json!({"workload": name, "title": title, "context": context, "level": level_name, "rows": rows,
                           "tenants": tenant_rows}),
    );
    sweep.publish(&doc, title, &context, level_name, &rows)?;
    if kind == Kind::Pd {
        let gpus = sweep.fleet.kinds().len();
        // The rows: `pd.json` beside the default sweep file; beside
        // any other `--out`, `<its name>-rows.json` (a side run never
        // overwrites the committed rows).
        let stem = sweep.out.file_stem().and_then(|s| s.to_str()).unwrap_or("pd").to_owned();
        let pd_out = sweep.out.with_file_name(match (a.quick, stem.as_str()) {
            (true, _) => "pd-quick-rows.json".to_owned(),
            (false, "pd-sweep") => "pd.json".to_owned(),
            (false, other) => format!("{other}-rows.json"),
        });
        let pd = serde_json::json!({
            "commit": sweep.commit,
            "machine": sweep.machine,
            "settings": context,
            "sweep": sweep.out.file_name().and_then(|f| f.to_str()),
            "rows": pd_rows(&rows, gpus),
        });
        std::fs::write(&pd_out, serde_json::to_string_pretty(&pd)? + "\n")?;
        println!("P/D rows: {}", pd_out.display());
    }
    Ok(())
}

/// The sweep's rows in the `pd` result format (issue #25): the mode's kind
/// (aggregated, disaggregated, conditional), its prefill and decode
/// workers, and throughput per GPU (one simulated GPU per worker).
fn pd_rows(rows: &[stats::Row], gpus: usize) -> Vec<serde_json::Value> {
    rows.iter()
        .map(|r| {
            let (kind, p, d) = match Frontend::parse(&r.mode) {
                Ok(Frontend::Pd { prefill, decode, conditional, .. }) => {
                    (if conditional { "conditional" } else { "disaggregated" }, prefill, decode)
                }
                // Every worker decodes, and any may prefill for another.
                Ok(Frontend::PdBoth { .. }) => ("conditional", 0, gpus),
                _ => ("aggregated", 0, gpus),
            };
            serde_json::json!({
                "mode": kind, "mode_name": r.mode, "prefill_workers": p, "decode_workers": d, "gpus": gpus,
                "level": r.concurrency, "ttft_p50_ms": r.ttft_p50_ms, "ttft_p95_ms": r.ttft_p95_ms,
                "itl_p50_ms": r.itl_p50_ms, "itl_p95_ms": r.itl_p95_ms, "output_tok_per_s": r.output_tok_per_s,
                "output_tok_per_s_per_gpu": r.output_tok_per_s / gpus.max(1) as f64, "errors": r.errors,
                "requests": r.requests, "valid": r.valid,
            })
        })
        .collect()
}

fn kv_lines(settings: &[String]) -> Result<Vec<String>> {
    settings
        .iter()
        .map(|kv| {
            let Some((k, v)) = kv.split_once('=') else { bail!("--kv {kv:?}: expected name=value") };
            let (k, v) = (k.trim(), v.trim());
            // Numbers as numbers, true and false as booleans, anything else as a TOML string; the
            // control plane validates names and values when it reads them.
            if let Ok(x) = v.parse::<f64>() {
                return Ok(format!("{k} = {x:?}"));
            }
            if let Ok(b) = v.parse::<bool>() {
                return Ok(format!("{k} = {b}"));
            }
            Ok(format!("{k} = {v:?}"))
        })
        .collect()
}

fn dashboard(a: DashArgs) -> Result<()> {
    use kvgate_bench::dashboard::{Live, serve};
    if !(a.speedup.is_finite() && a.speedup > 0.0)
        || a.stream_interval == 0
        || !(a.window_s.is_finite() && a.window_s > 0.0)
    {
        bail!("--speedup and --window-s must be > 0 and --stream-interval at least 1");
    }
    let fronts: Vec<Frontend> = a.modes.iter().map(|m| Frontend::parse(m)).collect::<Result<_>>()?;
    let root = kvgate_testkit::repo_root();
    let run_dir = if a.run_dir.is_absolute() { a.run_dir.clone() } else { root.join(&a.run_dir) };
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let mut fleet = FleetSpec::doks(a.speedup, a.stream_interval);
    fleet.kv_settings = kv_lines(&a.kv_settings)?;
    let mut stacks = Vec::new();
    for front in &fronts {
        let name = front.name();
        let dir = run_dir.join(format!("dashboard-{stamp}")).join(&name);
        println!("starting the {name} stack");
        stacks.push((name.clone(), Stack::start(&dir, &fleet, front).with_context(|| format!("starting {name}"))?));
    }
    let live = Live::new(
        stacks.iter().map(|(n, s)| (n.clone(), s.front)).collect(),
        a.concurrency,
        a.max_concurrency,
        a.speedup,
        Duration::from_secs_f64(a.window_s),
        workload::Doks::default(),
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", a.port))
            .await
            .with_context(|| format!("binding 127.0.0.1:{}", a.port))?;
        println!("dashboard: http://{}/  (Ctrl-C stops it and the stacks)", listener.local_addr()?);
        let (tx, rx) = tokio::sync::watch::channel(false);
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let server = tokio::spawn(serve(listener, live.clone(), stopped(rx.clone())));
        let driver = tokio::spawn(live.clone().drive(stopped(rx.clone())));
        let limit = a.duration_s.map(Duration::from_secs_f64).unwrap_or(Duration::MAX / 4);
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => println!("interrupted"),
            _ = term.recv() => println!("terminated"),
            _ = tokio::time::sleep(limit) => println!("--duration-s reached"),
        }
        let _ = tx.send(true);
        let _ = server.await;
        let _ = driver.await;
        anyhow::Ok(())
    })?;
    // Users still in a turn end with the runtime; then the stacks stop.
    rt.shutdown_timeout(Duration::from_secs(2));
    for (name, mut s) in stacks {
        if let Err(e) = s.check() {
            println!("{name}: {e:#}");
        }
    }
    println!("stopped");
    Ok(())
}

/// Rebuilds the reports of one result file from its JSON.
fn rewrite_report(json: &std::path::Path) -> Result<()> {
    let text = std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
    let mut doc: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", json.display()))?;
    let rows: Vec<stats::Row> = serde_json::from_value(doc["rows"].clone())
        .with_context(|| format!("{}: the rows do not have the result shape", json.display()))?;
    // The SLO goodput is derived from the rows: older files gain it.
    doc["slo_goodput"] = report::slo_goodput_json(&rows);
    std::fs::write(json, serde_json::to_string_pretty(&doc)? + "\n")?;
    let title = doc["title"].as_str().map(str::to_owned).unwrap_or_else(|| match doc["workload"].as_str() {
        Some("doks-multiturn") | None => "DOKS multi-turn sweep".to_owned(),
        Some(w) => w.to_owned(),
    });
    let context = doc["context"].as_str().map(str::to_owned).unwrap_or_else(|| {
        format!(
            "commit {}, {}; speedup {}x, stream interval {}, windows {} s warm-up + {} s measured (simulated)",
            doc["commit"].as_str().unwrap_or("?"),
            doc["machine"].as_str().unwrap_or("?"),
            doc["speedup"].as_f64().unwrap_or(f64::NAN),
            doc["stream_interval"].as_u64().unwrap_or(0),
            doc["warmup_s"].as_f64().unwrap_or(f64::NAN),
            doc["window_s"].as_f64().unwrap_or(f64::NAN)
        )
    });
    let level = doc["level"].as_str().unwrap_or("conc.");
    report::publish(json, &title, &context, level, &rows)?;
    println!("{}: slo_goodput, .md, .html and {} charts rewritten", json.display(), kvgate_bench::plot::METRICS.len());
    Ok(())
}

fn doks(mut a: DoksArgs) -> Result<()> {
    a.sweep.default_modes(a.quick);
    if a.quick {
        a.levels = vec![60, 120, 180];
        a.measure_s = 120.0;
    }
    // The DOKS preset keeps its historical name; other fleets get theirs.
    let suffix = if a.sweep.preset == "h200-llama70b-fp8" { String::new() } else { format!("-{}", a.sweep.preset) };
    let out = a.out.clone().unwrap_or_else(|| {
        PathBuf::from(if a.quick {
            format!("target/bench-runs/doks-multiturn{suffix}-quick.json")
        } else {
            format!("bench/results/doks-multiturn{suffix}.json")
        })
    });
    let sweep = Sweep::new(&a.sweep, a.speedup, a.measure_s, a.drain_s, out)?;
    let workload = workload::Doks::default();
    let starter_shared = workload.starter_shared_tokens(&stack::tokenizer_dir())?;
    let cells = a.levels.len() * sweep.fronts.len() * sweep.repeats;
    let per_cell = sweep.windows.warmup + sweep.windows.measure;
    println!(
        "== DOKS multi-turn: {} levels x {} modes, speedup {}x, windows {} s + {} s simulated ({:.1} s + {:.1} s wall); about {:.0} min",
        a.levels.len(),
        sweep.fronts.len(),
        a.speedup,
        a.sweep.warmup_s,
        a.measure_s,
        sweep.windows.warmup.as_secs_f64(),
        sweep.windows.measure.as_secs_f64(),
        (cells as f64 * (per_cell.as_secs_f64() + 12.0)) / 60.0
    );
    let rows = sweep.cells(
        "doks",
        &a.levels,
        |_| Ok(()),
        |sw, (), stack, mode, c| {
            let run = sw.rt.block_on(runner::run_doks(
                stack.front,
                &stack.workers,
                &stack.pids,
                &workload,
                c,
                sw.windows,
                1_000_000,
            ))?;
            let block = u64::from(sw.fleet.block_size);
            let row =
                stats::summarize(mode, c, &run, sw.speedup, block, stats::Oracle::Doks(&starter_shared), sw.cpu_limit);
            Ok((run, row))
        },
    )?;
    let context = format!(
        "commit {}, {}; fleet preset {} ({} workers); control plane defaults{}; speedup {}x, stream interval {}, windows {} s warm-up + {} s measured (simulated){}",
        sweep.commit,
        sweep.machine,
        sweep.fleet.preset,
        sweep.fleet.kinds().len(),
        if sweep.fleet.kv_settings.is_empty() { String::new() } else { format!(" + {:?}", sweep.fleet.kv_settings) },
        a.speedup,
        a.sweep.stream_interval,
        a.sweep.warmup_s,
        a.measure_s,
        sweep.repeats_note()
    );
    let doc = sweep.doc(
        a.sweep.stream_interval,
        a.quick,
        serde_json::json!({
            "workload": "doks-multiturn",
            "title": "DOKS multi-turn sweep",
            "context": context,
            "rows": rows,
            "wall_window_s": sweep.windows.measure.as_secs_f64(),
            "workload_shape": {
                "starters": workload.starters, "starter_tokens": starter_shared,
                "turns": [workload.turns.0, workload.turns.1],
                "output_tokens": [workload.output_tokens.0, workload.output_tokens.1],
            },
        }),
    );
    sweep.publish(&doc, "DOKS multi-turn sweep", &context, "conc.", &rows)
}
