//! `kvgate-bench calibration` (issue #22): does the control plane learn the
//! engine it serves, and follow it when the engine changes speed?
//!
//! For each fleet preset: the `kv` stack with the control plane's defaults
//! (no engine timing passed: it starts from its neutral priors), the
//! calibration workload at a fixed concurrency, and `/admin/timing` polled
//! twice a second (wall). After `--phase-s` simulated seconds every worker
//! is slowed by `--slowdown` (`POST /kvgate/sim/slowdown`), and the run goes
//! on for another phase.
//!
//! The workload is DOKS conversations, but by default each opens with its
//! own document of 500–7,000 words (`--starters`, `--starter-words`): with
//! DOKS's ten shared documents every prompt but the first few is a cached
//! prefix plus 50–80 new tokens, and no estimator can tell how prefill time
//! grows with new tokens from that.
//!
//! Each snapshot's learned model is compared with the preset's truth
//! (`kvgate_sim::timing`) over the operating range the run measured, as
//! predicted times, not coefficients (the preset's formula need not have
//! the estimator's shape):
//!
//! | quantity | learned (× speedup: the control plane sees wall time) | truth |
//! |---|---|---|
//! | decode step | the decode fit at the requests and KV fill the control plane saw on that worker at its poll nearest the moment (`/admin/workers`: what the fit learned from and the `kv` cost reads it at; its fill counts expected output blocks, so it runs above the engine's), no prefill in the step; runs that did not record it read the fit at the engine's (R, fill) | the preset's step of R decodes at that fill, attending over the context the engine's decodes attended over then (the simulator's `kvgate_sim_decode_context_tokens`; where there is none, the fill's share of the KV capacity) |
//! | prefill | the change of the prefill time `kv` prices with (`used`: the two fits' prefill rates averaged by precision, and the growth terms it keeps) from the run's shortest to its longest uncached prompt; the first-token fit's own change is reported beside it (`prefill_fit`) | the preset's, for the steps that prefill them beside R decodes |
//! | time to first token of a request that does not queue | the first-token fit at (new, cached, 0 ahead, R) | the preset's prefill steps + what the run measured outside the formula: the engines' queue time (arrival to the first step, e.g. the step in progress) and the gateway's share (client TTFT − engine TTFT) |
//!
//! The operating range: (R, fill) pairs the class's workers were at (their
//! `/metrics`, sampled every 250 ms) at the 10th, 50th and 90th percentile
//! of R, per phase; (new, cached) pairs of the run's requests at five ranks
//! of their uncached tokens. The error of a snapshot is the largest
//! relative error over those points. The gateway's share is inflated
//! `--speedup` times in simulated time, so the default speedup is low.
//!
//! A class's count is the requests it had served at the first poll from
//! which every later poll of its phase is within 10 % (after the change,
//! counted from the requests at the change), over the polls while the
//! load ran: in the drain after the measured window no request starts and
//! the running count falls to 0, away from the operating points the truth
//! is taken at; the drain's polls are reported apart (`drain`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvgate_scheduler::EngineTiming;
use kvgate_sim::timing::{StepShape, Timing};
use kvgate_testkit::http_request;
use plotters::prelude::*;
use serde_json::{Value, json};

use crate::probe::{WorkerMetrics, scrape};
use crate::runner::{self, Windows};
use crate::stack::{FleetSpec, Frontend, MODEL, PRESETS, Stack, get_json};
use crate::workload::Doks;

pub mod replay;

/// Relative error below which a learned model counts as right.
pub const WITHIN: f64 = 0.10;

/// `kvgate-bench calibration`.
#[derive(clap::Args, Debug, Clone)]
pub struct CalibrationArgs {
    /// Fleets (as `doks --preset`).
    #[arg(long, value_delimiter = ',', default_values_t = PRESETS.map(String::from))]
    presets: Vec<String>,
    /// Conversations in flight.
    #[arg(long, default_value_t = 90)]
    concurrency: usize,
    /// Simulated time runs this many times faster than the wall clock.
    #[arg(long, default_value_t = 2.0)]
    speedup: f64,
    /// Simulated seconds before the slowdown, and after it.
    #[arg(long, default_value_t = 240.0)]
    phase_s: f64,
    /// Every worker's steps take this many times longer after the first
    /// phase.
    #[arg(long, default_value_t = 1.5)]
    slowdown: f64,
    /// Distinct documents the conversations open with (DOKS has 10: every
    /// prompt but the first few is then cached).
    #[arg(long, default_value_t = 1_000_000)]
    starters: usize,
    /// Words per document, lowest and highest (~1.07 tokens a word).
    #[arg(long, value_delimiter = ',', num_args = 2, default_values_t = [500, 7_000])]
    starter_words: Vec<usize>,
    /// Result file; the plots go to <stem>/<preset>.svg.
    #[arg(long, default_value = "bench/results/calibration.json")]
    out: PathBuf,
    /// Logs of every run.
    #[arg(long, default_value = "target/bench-runs")]
    run_dir: PathBuf,
}

/// One worker kind's truth at one slowdown.
#[derive(Debug, Clone, Copy)]
struct Truth {
    timing: Timing,
    budget: usize,
    slowdown: f64,
    /// KV capacity in tokens: where the engine does not report the context
    /// its decoding requests attended over, a KV fill f is taken as f ×
    /// this many tokens of it (the calibration workload shares almost no
    /// prefix between running requests; the blocks of requests still in
    /// prefill and of partly filled blocks make it an overstatement).
    capacity_tokens: f64,
}

impl Truth {
    /// A step of `running` decodes at KV fill `fill`, attending over
    /// `context` tokens (measured) or, without it, over the fill's share
    /// of the capacity.
    fn shape(&self, running: f64, fill: f64, context: Option<f64>) -> StepShape {
        let r = running.round().max(0.0) as usize;
        let context = context.unwrap_or(fill.clamp(0.0, 1.0) * self.capacity_tokens);
        StepShape {
            decode_seqs: r,
            decode_context_tokens: context.max(0.0) as usize,
            kv_fill: fill,
            ..StepShape::default()
        }
    }

    /// The preset's time from the first step that schedules the request to
    /// its first token (no queue, no gateway).
    fn prefill_ms(&self, new: usize, cached: usize, running: f64, fill: f64, context: Option<f64>) -> f64 {
        let budget = self.budget.saturating_sub(running.round().max(0.0) as usize).max(1);
        let (mut done, mut ms) = (0, self.timing.first_token_overhead_ms());
        while done < new.max(1) {
            let k = (new.max(1) - done).min(budget);
            let mut s = self.shape(running, fill, context);
            s.add_chunk(cached + done, k);
            ms += self.timing.step_time(&s) * self.slowdown;
            done += k;
        }
        ms
    }

    fn step_ms(&self, running: f64, fill: f64, context: Option<f64>) -> f64 {
        self.timing.step_time(&self.shape(running, fill, context)) * self.slowdown
    }
}

/// Where a class ran in one phase, as measured.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct Operating {
    /// (running, KV fill) at the 10th, 50th and 90th percentile of running.
    points: Vec<(f64, f64)>,
    /// Per point, the context tokens the engine's decoding requests
    /// attended over at that moment, where the engine reports it (the
    /// simulator's `kvgate_sim_decode_context_tokens`; runs before it
    /// have none).
    #[serde(default)]
    context: Vec<Option<f64>>,
    /// Per point, the requests and KV fill the control plane saw on the
    /// same worker at its poll nearest that moment (`/admin/workers`):
    /// what its fits learned from and the `kv` cost reads them at. Its
    /// fill counts the expected output blocks of the requests in flight,
    /// so it runs above the engine's. Runs before it have none.
    #[serde(default)]
    seen: Vec<Option<(f64, f64)>>,
    /// Per grid point, the mean TTFT the clients saw (simulated ms) for
    /// the phase's requests near it, when there were any.
    ttft_ms: Vec<Option<f64>>,
}

impl Operating {
    /// The measured decode context at point `i`, if any.
    fn context(&self, i: usize) -> Option<f64> {
        self.context.get(i).copied().flatten()
    }

    /// Each point: running, KV fill, the measured decode context, and the
    /// (requests, fill) the learned step is read at: the control plane's
    /// where it was recorded, else the engine's.
    fn each(&self) -> impl Iterator<Item = (f64, f64, Option<f64>, (f64, f64))> + '_ {
        self.points
            .iter()
            .enumerate()
            .map(|(i, &(r, f))| (r, f, self.context(i), self.seen.get(i).copied().flatten().unwrap_or((r, f))))
    }
}

/// A learned fit's coefficients by name (the admin API's `params`).
fn params(fit: &Value) -> impl Fn(&str) -> f64 + '_ {
    move |name| {
        fit["params"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["name"] == name))
            .and_then(|p| p["value"].as_f64())
            .unwrap_or(0.0)
    }
}

fn learned_ttft_ms(class: &Value, new: f64, cached: f64, running: f64) -> f64 {
    let p = params(&class["first_token"]);
    p("ttft_overhead_ms")
        + p("prefill_ms_per_token") * new
        + p("prefill_ms_per_token_per_ktok") * new * new / 1000.0
        + p("prefill_ms_per_token_per_kctx") * new * cached / 1000.0
        + p("ttft_ms_per_running") * running
}

/// Prefill time of `new` tokens after `cached` as the `kv` policy prices
/// it (the admin API's `used`: the two fits' rates averaged by precision,
/// and the growth terms it keeps), ms.
fn used_prefill_ms(class: &Value, new: f64, cached: f64) -> f64 {
    let u = |name: &str| class["used"][name].as_f64().unwrap_or(0.0);
    let timing = EngineTiming {
        prefill_ms_per_token: u("prefill_ms_per_token"),
        prefill_ms_per_token_per_ktok: u("prefill_ms_per_token_per_ktok"),
        prefill_ms_per_token_per_kctx: u("prefill_ms_per_token_per_kctx"),
        decode_ms_per_seq: u("decode_ms_per_seq"),
    };
    timing.prefill_ms_per_token_at(new, cached) * new
}

/// Prefill time of `new` computed tokens as the matched engine fit has it,
/// engine ms (the simulator's own clock, as the truth's).
fn matched_prefill_ms(class: &Value, new: f64, cached: f64) -> f64 {
    let p = params(&class["engine_matched"]);
    p("engine_prefill_ms_per_token") * new
        + p("engine_prefill_ms_per_token_per_ktok") * new * new / 1000.0
        + p("engine_prefill_ms_per_token_per_kctx") * new * cached / 1000.0
}

fn learned_step_ms(class: &Value, running: f64, fill: f64) -> f64 {
    let p = params(&class["decode"]);
    p("step_base_ms") + p("decode_ms_per_seq") * running + p("step_ms_per_kv_fill") * fill
}

/// Whether `x` is within ±25 % of `p`.
fn near(x: u64, p: u64) -> bool {
    x * 4 >= p * 3 && x * 4 <= p * 5
}

/// The mean of `v`, `None` when it is empty.
fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// (new, cached) pairs of the run's requests: the medians of the requests
/// around five ranks of their uncached tokens (joint points: a long
/// uncached prompt is seldom also long cached).
fn grid(records: &[runner::Record]) -> Vec<(usize, usize)> {
    let mut ok: Vec<(usize, usize)> = records
        .iter()
        .filter(|r| r.error.is_none() && r.prompt_tokens > 0)
        .map(|r| ((r.prompt_tokens - r.cached_tokens.min(r.prompt_tokens)) as usize, r.cached_tokens as usize))
        .collect();
    ok.sort_unstable();
    let median = |mut v: Vec<usize>| {
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    };
    let mut out = Vec::new();
    let n = ok.len();
    for p in [0.1, 0.5, 0.75, 0.9, 0.97] {
        let (lo, hi) = (((p - 0.03) * n as f64) as usize, (((p + 0.03) * n as f64) as usize).min(n));
        let Some(bucket) = ok.get(lo..hi.max(lo + 1).min(n)) else { continue };
        if bucket.is_empty() {
            continue;
        }
        // The cached median of the bucket's requests near its new median.
        let new = median(bucket.iter().map(|b| b.0).collect()).max(1);
        let close = bucket.iter().filter(|b| near(b.0 as u64, new as u64)).map(|b| b.1).collect();
        let point = (new, median(close));
        if !out.contains(&point) {
            out.push(point);
        }
    }
    out
}

/// Errors of one snapshot against its truth.
#[derive(Debug, Clone, Default)]
struct Errors {
    /// Against the TTFT the clients measured (not in [`Errors::within`]:
    /// it includes waits for the step in progress and for prefill budget
    /// that no formula of the preset states); `None` where there is no
    /// measurement per class.
    ttft: Option<f64>,
    step: f64,
    /// The prefill time `kv` prices with; `None` when the run's prompts do
    /// not span enough uncached tokens.
    prefill: Option<f64>,
    /// The first-token fit's own prefill terms (reported, not in
    /// [`Errors::within`]).
    prefill_fit: Option<f64>,
    /// The matched engine fit's own curve, in the engine's clock (reported,
    /// not in [`Errors::within`]); `None` before it has samples.
    prefill_matched: Option<f64>,
    /// Which fit the prefill rate `kv` used came from (the admin API's
    /// `prefill_from`).
    prefill_from: Option<String>,
    /// Engine intervals the matched fit has learned from.
    matched_samples: u64,
    /// Each of the fit's readings (`readings` in `/admin/timing`: the first
    /// token's, the decode steps', the two as one, the matched fit's), as a
    /// flat price: the same comparison as `prefill` (reported, not in
    /// [`Errors::within`]), to tell which estimate a miss came from.
    readings: serde_json::Map<String, Value>,
}

impl Errors {
    fn within(&self) -> bool {
        self.step <= WITHIN && self.prefill.is_none_or(|p| p <= WITHIN)
    }

    fn json(&self) -> Value {
        json!({"ttft": self.ttft, "step": self.step, "prefill": self.prefill, "prefill_fit": self.prefill_fit,
            "prefill_matched": self.prefill_matched, "prefill_from": self.prefill_from,
            "matched_samples": self.matched_samples, "readings": self.readings})
    }
}

/// Uncached tokens the shortest and longest grid points must differ by for
/// the prefill comparison.
const PREFILL_SPAN: usize = 500;

fn errors(class: &Value, truth: &Truth, grid: &[(usize, usize)], op: &Operating, speedup: f64) -> Errors {
    let rel = |got: f64, want: f64| if want > 0.0 { (got - want).abs() / want } else { f64::INFINITY };
    let mut e = Errors {
        prefill_from: class["prefill_from"].as_str().map(str::to_owned),
        matched_samples: class["engine_matched"]["samples"].as_u64().unwrap_or(0),
        ..Errors::default()
    };
    for (r, f, x, (sr, sf)) in op.each() {
        e.step = e.step.max(rel(learned_step_ms(class, sr, sf) * speedup, truth.step_ms(r, f, x)));
    }
    let mid = op.points.len() / 2;
    let Some(&(r, f)) = op.points.get(mid) else { return e };
    let ctx = op.context(mid);
    for (&(n, c), seen) in grid.iter().zip(&op.ttft_ms) {
        if let Some(want) = seen {
            let x = rel(learned_ttft_ms(class, n as f64, c as f64, r) * speedup, *want);
            e.ttft = Some(e.ttft.unwrap_or(0.0).max(x));
        }
    }
    // Prefill: how much longer a longer uncached prompt takes, from the
    // shortest grid point to each one at least PREFILL_SPAN longer.
    if let Some(scores) = class["readings"].get("scores") {
        e.readings.insert("scores".into(), scores.clone());
    }
    let Some(&(nl, cl)) = grid.iter().min_by_key(|p| p.0) else { return e };
    for &(n, c) in grid.iter().filter(|p| p.0 >= nl + PREFILL_SPAN) {
        let want = truth.prefill_ms(n, c, r, f, ctx) - truth.prefill_ms(nl, cl, r, f, ctx);
        let (n, c, nl, cl) = (n as f64, c as f64, nl as f64, cl as f64);
        let used = (used_prefill_ms(class, n, c) - used_prefill_ms(class, nl, cl)) * speedup;
        e.prefill = Some(e.prefill.unwrap_or(0.0).max(rel(used, want)));
        let fit = (learned_ttft_ms(class, n, c, r) - learned_ttft_ms(class, nl, cl, r)) * speedup;
        e.prefill_fit = Some(e.prefill_fit.unwrap_or(0.0).max(rel(fit, want)));
        if class["engine_matched"]["samples"].as_u64().is_some_and(|s| s > 0) {
            let m = matched_prefill_ms(class, n, c) - matched_prefill_ms(class, nl, cl);
            e.prefill_matched = Some(e.prefill_matched.unwrap_or(0.0).max(rel(m, want)));
        }
        for (name, reading) in
            class["readings"].as_object().into_iter().flatten().filter(|(k, _)| *k != "warm" && *k != "scores")
        {
            let Some(rate) = reading.get(0).and_then(Value::as_f64) else { continue };
            let x = rel(rate * (n - nl) * speedup, want);
            let was = e.readings.get(name).and_then(Value::as_f64).unwrap_or(0.0);
            e.readings.insert(name.clone(), json!(was.max(x)));
        }
    }
    e
}

/// The KV capacity a class name (`blocks=N,seqs=M`) states.
fn class_blocks(class: &str) -> Option<usize> {
    class.split(',').find_map(|kv| kv.strip_prefix("blocks=")).and_then(|b| b.parse().ok())
}

/// One poll of `/admin/timing`.
#[derive(Debug, Clone)]
struct Snapshot {
    /// Whether the slowdown had been applied.
    slowed: bool,
    /// Whether the measured window had ended (no new turns start; the
    /// requests in flight finish).
    draining: bool,
    /// The model's entry.
    timing: Value,
}

/// Runs every preset and writes the result file and plots.
pub fn run(a: &CalibrationArgs) -> Result<()> {
    if !(a.speedup.is_finite() && a.speedup > 0.0 && a.slowdown.is_finite() && a.slowdown > 0.0) {
        bail!("--speedup and --slowdown must be > 0");
    }
    let root = kvgate_testkit::repo_root();
    let out = if a.out.is_absolute() { a.out.clone() } else { root.join(&a.out) };
    let run_dir = if a.run_dir.is_absolute() { a.run_dir.clone() } else { root.join(&a.run_dir) };
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (commit, machine) = kvgate_bench_support::provenance();
    let mut presets = Vec::new();
    for name in &a.presets {
        let dir = run_dir.join(format!("calibration-{stamp}")).join(name);
        println!("== calibration on {name}: {} conversations, speedup {}x", a.concurrency, a.speedup);
        let (doc, svg) = one(a, name, &dir)?;
        println!("   {}", summary_line(&doc));
        let charts = out.with_extension("");
        std::fs::create_dir_all(&charts)?;
        std::fs::write(charts.join(format!("{name}.svg")), svg)?;
        presets.push(doc);
    }
    let doc = json!({
        "commit": commit,
        "machine": machine,
        "settings": {
            "control_plane": "defaults (learn_timing = true, priors prefill_ms_per_token 0.1, decode_ms_per_seq 0.5); no engine timing passed",
            "concurrency": a.concurrency,
            "speedup": a.speedup,
            "phase_s": a.phase_s,
            "slowdown": a.slowdown,
            "within": WITHIN,
            "workload": format!("DOKS conversations, {} distinct documents of {}-{} words", a.starters, a.starter_words.first().copied().unwrap_or(0), a.starter_words.last().copied().unwrap_or(0)),
            "compared": "x speedup, largest relative error over the measured operating range: decode step (fit at the requests and KV fill the control plane saw on the worker at the same moment, /admin/workers) against the preset's step at the engine's; prefill (the change of the prefill time kv prices with, from the shortest to each longer uncached prompt) against the preset's; within = both <= 10 %; prefill_fit: the same for the first-token fit's own terms, reported, not in within. TTFT (fit at new, cached, R) against the clients' measured mean, reported, not in within",
        },
        "presets": presets,
    });
    if let Some(p) = out.parent() {
        std::fs::create_dir_all(p)?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&doc)? + "\n")?;
    println!("results: {} (plots in {}/)", out.display(), out.with_extension("").display());
    Ok(())
}

fn summary_line(doc: &Value) -> String {
    let classes = doc["classes"].as_array().cloned().unwrap_or_default();
    classes
        .iter()
        .map(|c| {
            format!(
                "{}: step and prefill within 10 % after {} requests, again after the slowdown after {}; at the end of the load step {:.1} %, prefill {:.1} %, TTFT against the clients' {:.1} %; in the drain step up to {:.1} %",
                c["class"].as_str().unwrap_or("?"),
                c["requests_to_within_10pct"],
                c["requests_after_change_to_within_10pct"],
                c["error_at_end_of_load"]["step"].as_f64().unwrap_or(f64::NAN) * 100.0,
                c["error_at_end_of_load"]["prefill"].as_f64().unwrap_or(f64::NAN) * 100.0,
                c["error_at_end_of_load"]["ttft"].as_f64().unwrap_or(f64::NAN) * 100.0,
                c["drain"]["largest_step_error"].as_f64().unwrap_or(f64::NAN) * 100.0,
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// One preset: the run, its snapshots, and what they show.
fn one(a: &CalibrationArgs, name: &str, dir: &Path) -> Result<(Value, String)> {
    let fleet = FleetSpec::preset(name, a.speedup, replay::WORKERS)?;
    let mut stack = Stack::start(dir, &fleet, &Frontend::Kvgate("kv".into()))?;
    let admin = stack.cp_admin.context("the kv stack has a control plane")?;
    // Every observation the fits learn from, for `calibration-replay`
    // (the first take starts the journal).
    take_journal(admin)?;
    let mut journal = String::new();
    let wall = |sim_s: f64| Duration::from_secs_f64(sim_s / a.speedup);
    let windows = Windows { warmup: wall(20.0), measure: wall(2.0 * a.phase_s), drain: wall(120.0) };
    let (front, workers, pids, conc) = (stack.front, stack.workers.clone(), stack.pids.clone(), a.concurrency);
    let (lo, hi) = (a.starter_words.first().copied().unwrap_or(500), a.starter_words.last().copied().unwrap_or(7_000));
    let workload = Doks { starters: a.starters.max(1), starter_words: (lo.min(hi), hi.max(lo)), ..Doks::default() };
    let load = std::thread::spawn(move || -> Result<runner::CellRun> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(runner::run_doks(front, &workers, &pids, &workload, conc, windows, 1_000_000))
    });
    let scrape_all =
        |ws: &[SocketAddr]| -> Vec<WorkerMetrics> { ws.iter().map(|w| scrape(*w).unwrap_or_default()).collect() };
    let at_start = scrape_all(&stack.workers);
    let mut metrics_at_change = Vec::new();
    let t0 = Instant::now();
    let change_at = windows.warmup + wall(a.phase_s);
    let mut snaps = Vec::new();
    // The control plane's view of each worker at each poll.
    let mut seen: Vec<Seen> = Vec::new();
    let mut slowed = false;
    while !load.is_finished() {
        std::thread::sleep(Duration::from_millis(500));
        if !slowed && t0.elapsed() >= change_at {
            metrics_at_change = scrape_all(&stack.workers);
            for w in &stack.workers {
                let r = http_request(*w, "POST", &format!("/kvgate/sim/slowdown?factor={}", a.slowdown), &[], b"")?;
                if r.status != 200 {
                    bail!("slowdown on {w}: {}", r.status);
                }
            }
            slowed = true;
        }
        let draining = t0.elapsed() >= windows.warmup + windows.measure;
        // The journal up to here, then the snapshot (which may have learned
        // a little more): a replay reads its fits at each poll's mark.
        for r in take_journal(admin)? {
            journal.push_str(&r.to_string());
            journal.push('\n');
        }
        journal.push_str(&json!({"poll": snaps.len(), "slowed": slowed, "draining": draining}).to_string());
        journal.push('\n');
        if let Ok(v) = get_json(admin, "/admin/timing") {
            snaps.push(Snapshot { slowed, draining, timing: v[MODEL].clone() });
        }
        if let Ok(v) = get_json(admin, "/admin/workers") {
            seen.push(Seen::of(t0.elapsed().as_secs_f64(), &v[MODEL], &stack.workers));
        }
    }
    let run = load.join().map_err(|_| anyhow::anyhow!("the load thread panicked"))??;
    let at_end = scrape_all(&stack.workers);
    stack.check()?;
    if metrics_at_change.is_empty() {
        bail!("the run ended before the slowdown");
    }
    std::fs::write(dir.join("records.json"), serde_json::to_vec(&run.records)?)?;
    // Every poll of the learned timing, for a look at how it moved.
    let polls: Vec<Value> =
        snaps.iter().map(|s| json!({"slowed": s.slowed, "draining": s.draining, "timing": s.timing})).collect();
    std::fs::write(dir.join("timing-polls.json"), serde_json::to_vec(&polls)?)?;
    std::fs::write(dir.join(replay::JOURNAL), &journal)?;
    let g = grid(&run.records);
    let kinds = fleet.kinds();
    let truth_of = |class: &str, slowdown: f64| truth_of(&fleet, class, slowdown);
    // Per class: the workers of its kind.
    let members = |class: &str| -> Vec<usize> {
        let blocks = class_blocks(class);
        let all: Vec<usize> = (0..kinds.len()).collect();
        let mine: Vec<usize> = all.iter().copied().filter(|&w| Some(kinds[w].1) == blocks).collect();
        if mine.is_empty() { all } else { mine }
    };
    let change_s = (windows.warmup + wall(a.phase_s)).as_secs_f64();
    // A phase's load samples and its completed requests.
    let samples_in = |slowed: bool| run.samples.iter().filter(move |s| (s.t >= change_s) == slowed);
    let records_in =
        |slowed: bool| run.records.iter().filter(move |r| r.error.is_none() && (r.start >= change_s) == slowed);
    // What the engines did (their own histograms, simulated time) per phase.
    let phase = |from: &[WorkerMetrics], to: &[WorkerMetrics], slowed: bool, ws: &[usize]| -> Value {
        let d = |f: fn(&WorkerMetrics) -> f64| -> f64 {
            ws.iter().filter_map(|&w| Some(f(to.get(w)?) - f(from.get(w)?))).sum()
        };
        let mean_ms = |sum: f64, n: f64| sum / n.max(1.0) * 1000.0;
        let running: Vec<f64> = samples_in(slowed)
            .map(|s| ws.iter().filter_map(|&w| s.inflight.get(w)).sum::<f64>() / ws.len().max(1) as f64)
            .collect();
        json!({
            "engine_ttft_ms": mean_ms(d(|m| m.ttft_sum_s), d(|m| m.ttft_count)),
            "engine_queue_ms": mean_ms(d(|m| m.queue_sum_s), d(|m| m.queue_count)),
            "engine_itl_ms": mean_ms(d(|m| m.itl_sum_s), d(|m| m.itl_count)),
            "mean_running_per_worker": mean(&running).unwrap_or(0.0),
        })
    };
    // What the clients saw, and the gateway's share of it (client TTFT −
    // the engines' own, fleet-wide), per phase.
    let client = |slowed: bool| -> f64 {
        let v: Vec<f64> = records_in(slowed).filter_map(|r| r.ttft).collect();
        mean(&v).unwrap_or(0.0) * 1000.0 * a.speedup
    };
    let all: Vec<usize> = (0..kinds.len()).collect();
    let fleet_phase = |from: &[WorkerMetrics], to: &[WorkerMetrics], slowed: bool| {
        let mut v = phase(from, to, slowed, &all);
        let c = client(slowed);
        v["client_ttft_ms"] = json!(c);
        v["gateway_share_ms"] = json!(c - v["engine_ttft_ms"].as_f64().unwrap_or(0.0));
        v
    };
    let measured = [fleet_phase(&at_start, &metrics_at_change, false), fleet_phase(&metrics_at_change, &at_end, true)];
    // Per class and phase: where its workers ran (running + waiting, KV
    // fill), and the TTFT the clients saw near each grid point.
    let operating = |class: &str, slowed: bool| -> Operating {
        let ws = members(class);
        // ((running, fill), decode context, what the control plane saw).
        type Pair = ((f64, f64), Option<f64>, Option<(f64, f64)>);
        let mut pairs: Vec<Pair> = samples_in(slowed)
            .flat_map(|s| {
                ws.iter().filter_map(|&w| {
                    let ctx = s.decode_context.get(w).copied().flatten();
                    Some(((*s.inflight.get(w)?, *s.kv_usage.get(w)?), ctx, Seen::nearest(&seen, s.t, w)))
                })
            })
            .collect();
        pairs.sort_by(|x, y| x.0.0.total_cmp(&y.0.0));
        let (mut points, mut context, mut saw) = (Vec::new(), Vec::new(), Vec::new());
        for p in [0.1, 0.5, 0.9] {
            if let Some(&(x, ctx, cp)) = pairs.get(((pairs.len().saturating_sub(1)) as f64 * p).round() as usize)
                && x.0 >= 1.0
                && !points.contains(&x)
            {
                points.push(x);
                context.push(ctx);
                saw.push(cp);
            }
        }
        // The phase's requests near each grid point (±25 % of its new and
        // cached tokens). The client does not know which worker served a
        // request: in a fleet of several classes there is no per-class
        // measurement.
        let one_class = ws.len() == kinds.len();
        let ttft_ms = g
            .iter()
            .map(|&(n, c)| {
                if !one_class {
                    return None;
                }
                let v: Vec<f64> = records_in(slowed)
                    .filter(|r| near(r.prompt_tokens - r.cached_tokens.min(r.prompt_tokens), n as u64))
                    .filter(|r| if c == 0 { r.cached_tokens < 64 } else { near(r.cached_tokens, c as u64) })
                    .filter_map(|r| r.ttft)
                    .collect();
                mean(&v).map(|m| m * 1000.0 * a.speedup)
            })
            .collect();
        Operating { points, context, seen: saw, ttft_ms }
    };
    let mut ops: std::collections::BTreeMap<(String, bool), Operating> = Default::default();
    // Per class: a poll's samples, errors and phase per snapshot.
    let mut series: Series = Default::default();
    for s in &snaps {
        let Some(classes) = s.timing["classes"].as_object() else { continue };
        for (class, v) in classes {
            let truth = truth_of(class, if s.slowed { a.slowdown } else { 1.0 })?;
            let op = ops.entry((class.clone(), s.slowed)).or_insert_with(|| operating(class, s.slowed));
            let e = errors(v, &truth, &g, op, a.speedup);
            let n = v["first_token"]["samples"].as_u64().unwrap_or(0);
            series.entry(class.clone()).or_default().push(Poll {
                n,
                errors: e,
                slowed: s.slowed,
                draining: s.draining,
            });
        }
    }
    let last = snaps.last().map(|s| s.timing.clone()).unwrap_or_default();
    let at_change = snaps.iter().rev().find(|s| !s.slowed).map(|s| s.timing.clone()).unwrap_or_default();
    let mut classes: Vec<Value> = Vec::new();
    for (class, pts) in &series {
        let (to_within, after_change) = counts(pts);
        let drain: Vec<&Poll> = pts.iter().filter(|p| p.draining).collect();
        let mut truth = serde_json::Map::new();
        for (key, slowed, slowdown) in [("before", false, 1.0), ("after", true, a.slowdown)] {
            let t = truth_of(class, slowdown)?;
            let op = ops.get(&(class.clone(), slowed)).cloned().unwrap_or_else(|| operating(class, slowed));
            let ttft: Vec<Value> = op
                .each()
                .flat_map(|(r, f, x, _)| {
                    g.iter().map(move |&(n, c)| {
                        json!({"new": n, "cached": c, "running": r, "fill": f, "decode_context": x, "ms": t.prefill_ms(n, c, r, f, x)})
                    })
                })
                .collect();
            let step: Vec<Value> = op
                .each()
                .map(|(r, f, x, seen)| {
                    json!({"running": r, "fill": f, "decode_context": x, "ms": t.step_ms(r, f, x),
                        "ms_at_fill_share": t.step_ms(r, f, None), "control_plane_saw": seen})
                })
                .collect();
            truth.insert(
                key.into(),
                json!({"prefill": ttft, "step": step, "client_ttft_ms": g.iter().zip(&op.ttft_ms).map(|(p, t)| json!({"new": p.0, "cached": p.1, "ms": t})).collect::<Vec<_>>()}),
            );
        }
        let before = pts.iter().rev().find(|p| !p.slowed);
        classes.push(json!({
            "class": class,
            "timing": format!("{:?}", truth_of(class, 1.0)?.timing),
            "requests_to_within_10pct": to_within,
            "requests_after_change_to_within_10pct": after_change,
            "samples_at_change": before.map_or(0, |p| p.n),
            "error_at_change": before.map(|p| p.errors.json()),
            "error_at_end_of_load": pts.iter().rev().find(|p| !p.draining).map(|p| p.errors.json()),
            "drain": {
                "polls": drain.len(),
                "largest_step_error": drain.iter().map(|p| p.errors.step).reduce(f64::max),
                "largest_prefill_error": drain.iter().filter_map(|p| p.errors.prefill).reduce(f64::max),
            },
            "final_error": pts.last().map(|p| p.errors.json()),
            "learned": at_change["classes"][class].clone(),
            "learned_after_change": last["classes"][class].clone(),
            "truth": truth,
        }));
    }
    // The learned decode step at the class's engines' mean running count,
    // against their mean inter-token time, per phase: the estimator against
    // the fleet as it behaved, apart from the preset's formula.
    for c in &mut classes {
        let class = c["class"].as_str().unwrap_or_default().to_owned();
        let ws = members(&class);
        let mut vs = serde_json::Map::new();
        for (key, learned, from, to, slowed) in [
            ("before", "learned", &at_start, &metrics_at_change, false),
            ("after", "learned_after_change", &metrics_at_change, &at_end, true),
        ] {
            let m = phase(from, to, slowed, &ws);
            let (r, itl) =
                (m["mean_running_per_worker"].as_f64().unwrap_or(0.0), m["engine_itl_ms"].as_f64().unwrap_or(0.0));
            let fill = ops
                .get(&(class.clone(), slowed))
                .and_then(|o| o.each().nth(o.points.len() / 2))
                .map_or(0.0, |(_, _, _, seen)| seen.1);
            let got = learned_step_ms(&c[learned], r, fill) * a.speedup;
            vs.insert(
                key.into(),
                json!({"engine": m, "learned_step_ms": got, "error": (got - itl).abs() / itl.max(1e-9)}),
            );
        }
        c["step_vs_engine"] = Value::Object(vs);
    }
    let worst = |key: &str| -> Value {
        let v: Vec<Option<u64>> = classes.iter().map(|c| c[key].as_u64()).collect();
        if v.iter().any(Option::is_none) || v.is_empty() { Value::Null } else { v.into_iter().flatten().max().into() }
    };
    let doc = json!({
        "preset": name,
        "workers": kinds,
        "requests_to_within_10pct": worst("requests_to_within_10pct"),
        "requests_after_change_to_within_10pct": worst("requests_after_change_to_within_10pct"),
        "requests": run.records.len(),
        "observations": last["observations"].clone(),
        "grid": g,
        "measured": {"before": measured[0], "after": measured[1]},
        "classes": classes,
        "series": series
            .iter()
            .map(|(k, v)| (k.clone(), json!(v.iter().map(Poll::json).collect::<Vec<_>>())))
            .collect::<serde_json::Map<_, _>>(),
    });
    replay::save_context(dir, &replay::Context::new(name, a, &g, &ops, &last["prior"], &doc))?;
    let svg = chart(name, &series, a.slowdown);
    Ok((doc, svg))
}

/// The requests and KV fill the control plane saw on each worker at one
/// poll (`/admin/workers`), by the worker's place in the fleet.
struct Seen {
    /// Seconds since the load started (the load samples' clock, to within
    /// the load thread's start).
    t: f64,
    workers: Vec<Option<(f64, f64)>>,
}

impl Seen {
    /// One model's worker views, matched to the fleet by endpoint (or by
    /// the stack's worker ids, `w0`, `w1`…).
    fn of(t: f64, views: &Value, fleet: &[SocketAddr]) -> Self {
        let views = views.as_array().map(Vec::as_slice).unwrap_or_default();
        let one = |(i, addr): (usize, &SocketAddr)| {
            let (endpoint, id) = (addr.to_string(), format!("w{i}"));
            let v = views.iter().find(|v| v["endpoint"] == endpoint.as_str() || v["id"] == id.as_str())?;
            Some((v["requests"].as_f64()?, v["kv_fill"].as_f64()?))
        };
        Self { t, workers: fleet.iter().enumerate().map(one).collect() }
    }

    /// Worker `w` at the poll nearest `t`, within a second.
    fn nearest(polls: &[Seen], t: f64, w: usize) -> Option<(f64, f64)> {
        let p = polls
            .iter()
            .filter(|p| (p.t - t).abs() <= 1.0)
            .min_by(|a, b| (a.t - t).abs().total_cmp(&(b.t - t).abs()))?;
        p.workers.get(w).copied().flatten()
    }
}

/// Requests to within 10 %, before and after the slowdown.
type Counts = (Option<u64>, Option<u64>);

/// A class's learned model at one poll, against the truth.
#[derive(Debug, Clone)]
struct Poll {
    /// The class's first-token samples: requests it has served.
    n: u64,
    errors: Errors,
    slowed: bool,
    /// After the measured window: no new turns, the fleet empties.
    draining: bool,
}

impl Poll {
    fn json(&self) -> Value {
        json!([self.n, self.errors.json(), self.slowed, self.draining])
    }
}

/// Requests to within 10 % for good, before and after the slowdown (the
/// latter counted from the change), over the polls while the load ran:
/// the drain's polls are not in the count (reported apart, `drain`).
/// The truth is taken at the measured window's operating points; in the
/// drain the fleet leaves them, and the fits follow it there.
fn counts(pts: &[Poll]) -> Counts {
    let before: Vec<&Poll> = pts.iter().filter(|p| !p.slowed && !p.draining).collect();
    let after: Vec<&Poll> = pts.iter().filter(|p| p.slowed && !p.draining).collect();
    let change = before.last().map_or(0, |p| p.n);
    (settled(&before), settled(&after).map(|n| n.saturating_sub(change)))
}

/// The first poll from which every later one is within.
fn settled(v: &[&Poll]) -> Option<u64> {
    let i = v.iter().rposition(|p| !p.errors.within()).map_or(0, |i| i + 1);
    v.get(i).map(|p| p.n)
}

/// The truth of a class (named by its KV blocks) of `fleet` at `slowdown`.
fn truth_of(fleet: &FleetSpec, class: &str, slowdown: f64) -> Result<Truth> {
    let kinds = fleet.kinds();
    let first = kinds.first().cloned().context("a fleet of no workers")?;
    let blocks = class_blocks(class);
    let (timing, _) = kinds.iter().find(|(_, b)| Some(*b) == blocks).cloned().unwrap_or_else(|| first.clone());
    let timing = Timing::preset(&timing).with_context(|| format!("timing {timing}"))?;
    let blocks = blocks.unwrap_or(first.1);
    Ok(Truth {
        timing,
        budget: fleet.max_num_batched_tokens,
        slowdown,
        capacity_tokens: (blocks * fleet.block_size as usize) as f64,
    })
}

/// Takes the control plane's timing journal: its records for the model.
fn take_journal(admin: SocketAddr) -> Result<Vec<Value>> {
    let r = http_request(admin, "POST", "/admin/timing/journal", &[], b"")?;
    if r.status != 200 {
        bail!("POST /admin/timing/journal: {}", r.status);
    }
    let v: Value = serde_json::from_slice(&r.body)?;
    if v[MODEL]["dropped"].as_u64().unwrap_or(0) > 0 {
        bail!("the timing journal dropped {} records", v[MODEL]["dropped"]);
    }
    Ok(v[MODEL]["records"].as_array().cloned().unwrap_or_default())
}

type Series = std::collections::BTreeMap<String, Vec<Poll>>;

/// Error (%) against the class's first-token samples, TTFT and step per
/// class; the slowdown where the marker changes from dots to crosses.
fn chart(name: &str, series: &Series, slowdown: f64) -> String {
    let mut out = String::new();
    if let Err(e) = draw(&mut out, name, series, slowdown) {
        return format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"640\" height=\"360\"><text x=\"8\" y=\"20\">{name}: chart failed ({e})</text></svg>\n"
        );
    }
    out
}

fn draw(out: &mut String, name: &str, series: &Series, slowdown: f64) -> Result<(), Box<dyn std::error::Error>> {
    let xmax = series.values().flatten().map(|p| p.n).max().unwrap_or(1).max(1) as f64;
    let root = SVGBackend::with_string(out, (640, 360)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut c = ChartBuilder::on(&root)
        .caption(
            format!("{name}: learned vs true engine time (all steps ×{slowdown} after the change)"),
            ("sans-serif", 14),
        )
        .margin(8)
        .x_label_area_size(36)
        .y_label_area_size(48)
        .build_cartesian_2d(0f64..xmax, 0f64..50f64)?;
    c.configure_mesh()
        .x_desc("first-token observations of the class")
        .y_desc("largest relative error, % (capped at 50)")
        .light_line_style(RGBColor(238, 238, 238))
        .draw()?;
    c.draw_series(LineSeries::new([(0.0, WITHIN * 100.0), (xmax, WITHIN * 100.0)], BLACK.mix(0.4)))?.label("10 %");
    let palette = [
        RGBColor(214, 39, 40),
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(255, 127, 14),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
    ];
    for (i, (class, pts)) in series.iter().enumerate() {
        for (j, what) in ["TTFT", "step", "prefill"].iter().enumerate() {
            let colour = palette[(3 * i + j) % palette.len()];
            let get = |p: &Poll| match j {
                0 => p.errors.ttft,
                1 => Some(p.errors.step),
                _ => p.errors.prefill,
            };
            let line: Vec<(f64, f64)> =
                pts.iter().filter_map(|p| Some((p.n as f64, (get(p)? * 100.0).min(50.0)))).collect();
            if line.is_empty() {
                continue;
            }
            c.draw_series(LineSeries::new(line, colour.stroke_width(2)))?
                .label(format!("{class} {what}"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
            if let Some(p) = pts.iter().find(|p| p.slowed) {
                let x = p.n as f64;
                c.draw_series(std::iter::once(PathElement::new(vec![(x, 0.0), (x, 50.0)], colour.mix(0.5))))?;
            }
        }
    }
    c.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(RGBColor(204, 204, 204)).draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(first: &[(&str, f64)], decode: &[(&str, f64)]) -> Value {
        let ps = |v: &[(&str, f64)]| v.iter().map(|(n, x)| json!({"name": n, "value": x})).collect::<Vec<_>>();
        // The policy uses the first-token fit's prefill terms.
        let used: serde_json::Map<String, Value> = first
            .iter()
            .filter(|(n, _)| n.starts_with("prefill_ms_per_token"))
            .map(|(n, x)| ((*n).to_owned(), json!(x)))
            .collect();
        json!({"first_token": {"params": ps(first)}, "decode": {"params": ps(decode)}, "used": used})
    }

    const H200: Truth =
        Truth { timing: Timing::H200_LLAMA70B_FP8, budget: 16_384, slowdown: 1.0, capacity_tokens: 368_000.0 };

    /// A learned model equal to the linear preset's formula (and to what
    /// the clients saw: 10 ms more) has no error; the same model after the
    /// fleet slowed 1.5× is a third off in step and prefill.
    #[test]
    fn a_learned_model_equal_to_the_truth_has_no_error() {
        let grid = [(100, 0), (900, 5_000), (4_000, 0)];
        let seen = grid.iter().map(|&(n, c)| Some(10.0 + H200.prefill_ms(n, c, 30.0, 0.4, None))).collect();
        let op = Operating { points: vec![(15.0, 0.2), (30.0, 0.4)], ttft_ms: seen, context: vec![], seen: vec![] };
        // TTFT = 10 + 200 + 13 + 0.65·R + 0.08·n (one step);
        // step = 13 + 0.65·R.
        let c = class(
            &[("ttft_overhead_ms", 223.0), ("prefill_ms_per_token", 0.08), ("ttft_ms_per_running", 0.65)],
            &[("step_base_ms", 13.0), ("decode_ms_per_seq", 0.65)],
        );
        let e = errors(&c, &H200, &grid, &op, 1.0);
        assert!(e.ttft.is_some_and(|t| t < 1e-9) && e.step < 1e-9 && e.prefill.is_some_and(|p| p < 1e-9), "{e:?}");
        assert!(e.within());
        // In wall time at speedup 2 the control plane learns half.
        let half = class(
            &[("ttft_overhead_ms", 111.5), ("prefill_ms_per_token", 0.04), ("ttft_ms_per_running", 0.325)],
            &[("step_base_ms", 6.5), ("decode_ms_per_seq", 0.325)],
        );
        let e = errors(&half, &H200, &grid, &op, 2.0);
        assert!(e.ttft.is_some_and(|t| t < 1e-9) && e.step < 1e-9 && e.prefill.is_some_and(|p| p < 1e-9), "{e:?}");
        let slowed = Truth { slowdown: 1.5, ..H200 };
        let e = errors(&c, &slowed, &grid, &op, 1.0);
        assert!((e.step - 1.0 / 3.0).abs() < 1e-9 && e.ttft.is_some_and(|t| t < 1e-9), "{e:?}");
        assert!(e.prefill.is_some_and(|p| (p - 1.0 / 3.0).abs() < 1e-9) && !e.within(), "{e:?}");
        // Prompts that all have about as many new tokens say nothing about
        // prefill.
        let op = Operating { ttft_ms: vec![None, None], ..op };
        let e = errors(&c, &H200, &[(50, 5_000), (80, 6_000)], &op, 1.0);
        assert_eq!((e.prefill, e.prefill_fit, e.ttft), (None, None, None));
    }

    /// The learned step is read at the load the control plane saw, where
    /// it was recorded: a fit with a fill term, right at the control
    /// plane's fill, is off at the engine's lower one.
    #[test]
    fn the_step_is_read_at_the_load_the_control_plane_saw() {
        // Truth: 13 + 0.65·R. Learned: 10 + 0.65·R + 10·fill, right at
        // fill 0.3.
        let c = class(&[], &[("step_base_ms", 10.0), ("decode_ms_per_seq", 0.65), ("step_ms_per_kv_fill", 10.0)]);
        let engine = Operating { points: vec![(15.0, 0.2), (30.0, 0.2)], ..Operating::default() };
        let e = errors(&c, &H200, &[], &engine, 1.0);
        assert!((e.step - 1.0 / (13.0 + 0.65 * 15.0)).abs() < 1e-9, "{e:?}");
        let seen = Operating { seen: vec![Some((15.0, 0.3)), Some((30.0, 0.3))], ..engine.clone() };
        assert!(errors(&c, &H200, &[], &seen, 1.0).step < 1e-9);
        // A point the control plane has no view of falls back to the engine's.
        let partly = Operating { seen: vec![Some((15.0, 0.3)), None], ..engine };
        let e = errors(&c, &H200, &[], &partly, 1.0);
        assert!((e.step - 1.0 / (13.0 + 0.65 * 30.0)).abs() < 1e-9, "{e:?}");
    }

    /// A poll's views are matched to the fleet by endpoint or id, and a
    /// sample takes the poll nearest it, none further than a second.
    #[test]
    fn a_sample_takes_the_nearest_poll_of_its_worker() {
        let fleet: Vec<SocketAddr> = vec!["127.0.0.1:9000".parse().unwrap(), "127.0.0.1:9001".parse().unwrap()];
        let views = |a: f64, b: f64| {
            json!([
                {"id": "x", "endpoint": "127.0.0.1:9000", "requests": a, "kv_fill": 0.5},
                {"id": "w1", "endpoint": null, "requests": b, "kv_fill": null},
            ])
        };
        let polls = [Seen::of(1.0, &views(3.0, 4.0), &fleet), Seen::of(2.0, &views(5.0, 6.0), &fleet)];
        assert_eq!(Seen::nearest(&polls, 1.4, 0), Some((3.0, 0.5)));
        assert_eq!(Seen::nearest(&polls, 1.6, 0), Some((5.0, 0.5)));
        assert_eq!(Seen::nearest(&polls, 1.6, 1), None, "no fill known");
        assert_eq!(Seen::nearest(&polls, 3.5, 0), None, "too far");
    }

    #[test]
    fn a_long_prompt_takes_several_steps() {
        let truth = Truth { budget: 1_000, ..H200 };
        // 2,500 tokens with budget 1,000: three steps, 3 × 13 ms + 0.08 × 2,500.
        assert!((truth.prefill_ms(2_500, 0, 0.0, 0.0, None) - (200.0 + 39.0 + 200.0)).abs() < 1e-9);
    }

    fn record(new: u64, cached: u64, out: u64) -> runner::Record {
        runner::Record {
            conv: 0,
            starter: 0,
            turn: 0,
            start: 0.0,
            ttft: Some(0.1),
            e2e: 1.0,
            prompt_tokens: new + cached,
            completion_tokens: out,
            cached_tokens: cached,
            error: None,
            route: None,
            tenant: None,
        }
    }

    /// The grid's points are requests' joint (new, cached), not a cross of
    /// two percentiles: a cold document is not also cached.
    #[test]
    fn the_operating_range_is_what_requests_had() {
        let mut rs: Vec<runner::Record> = (0..75).map(|i| record(60 + i % 20, 5_000 + i * 10, 800)).collect();
        rs.extend((0..25).map(|i| record(3_000 + i * 100, 0, 800)));
        let g = grid(&rs);
        assert!(g.iter().all(|&(n, c)| (n < 100 && c >= 5_000) || (n >= 3_000 && c == 0)), "{g:?}");
        assert!(g.iter().any(|p| p.0 >= 3_000) && g.iter().any(|p| p.0 < 100), "{g:?}");
    }

    /// Requests to within 10 % for good count the polls while the load ran,
    /// in each phase: a miss in the drain (at the last count of requests)
    /// is not in them, a miss while the load ran is.
    #[test]
    fn the_counts_are_of_the_polls_while_the_load_ran() {
        let poll =
            |n, step, slowed, draining| Poll { n, errors: Errors { step, ..Errors::default() }, slowed, draining };
        let mut pts = vec![
            poll(100, 0.3, false, false),
            poll(200, 0.05, false, false),
            poll(300, 0.04, false, false),
            poll(350, 0.2, true, false),
            poll(500, 0.06, true, false),
            poll(600, 0.05, true, false),
            poll(600, 0.12, true, true),
        ];
        assert_eq!(counts(&pts), (Some(200), Some(200)));
        // The same miss while the load ran: not within for good after the change.
        pts[6].draining = false;
        assert_eq!(counts(&pts), (Some(200), None));
    }
}
