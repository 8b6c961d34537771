//! `kvgate-bench calibration` (issue #22): does the control plane learn the
//! engine it serves, and follow it when the engine changes speed?
//!
//! For each fleet preset: the `kv` stack with the control plane's defaults
//! (no engine timing passed: it starts from its neutral priors), DOKS
//! conversations at a fixed concurrency, and `/admin/timing` polled twice
//! a second (wall). After `--phase-s` simulated seconds every worker is
//! slowed by `--slowdown` (`POST /kvgate/sim/slowdown`), and the run goes
//! on for another phase.
//!
//! Each snapshot's learned model is compared with the preset's truth
//! (`kvgate_sim::timing`) over the workload's operating range, as predicted
//! times, not coefficients (the preset's formula need not have the
//! estimator's shape):
//!
//! | quantity | learned (× speedup: the control plane sees wall time) | truth |
//! |---|---|---|
//! | time to first token of a request that does not queue | the first-token fit at (new, cached, 0 ahead, R running) | frontend overhead + the steps that prefill it beside R decodes |
//! | decode step time | the decode fit at (R, KV fill, no prefill) | the step of R decodes at the workload's context |
//!
//! The (new, cached) points are the 10th, 50th and 90th percentiles of the
//! run's own requests; R is the concurrency per worker and half of it. The
//! error of a snapshot is the largest relative error over those points.
//! The learned TTFT includes what the gateway adds (Envoy, the Pick, the
//! simulator's tokenizing), which is part of what a user waits for and of
//! what the router should expect; at `--speedup` s it is inflated s times
//! in simulated time, so the default speedup is low.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvgate_sim::timing::{StepShape, Timing};
use kvgate_testkit::http_request;
use plotters::prelude::*;
use serde_json::{Value, json};

use crate::probe::{WorkerMetrics, scrape};
use crate::runner::{self, Windows};
use crate::stack::{DOKS_OPERATING_POINT, FleetSpec, Frontend, MODEL, PRESETS, Stack};
use crate::workload::Doks;

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
    blocks: usize,
    block_size: usize,
    budget: usize,
    slowdown: f64,
}

impl Truth {
    /// Decode context per request (the workload's).
    fn ctx() -> usize {
        DOKS_OPERATING_POINT.2 as usize
    }

    fn ttft_ms(&self, new: usize, cached: usize, running: usize) -> f64 {
        let budget = self.budget.saturating_sub(running).max(1);
        let (mut done, mut ms) = (0, self.timing.first_token_overhead_ms());
        while done < new.max(1) {
            let k = (new.max(1) - done).min(budget);
            let mut s = StepShape {
                decode_seqs: running,
                decode_context_tokens: running * Self::ctx(),
                kv_fill: self.fill(running),
                ..StepShape::default()
            };
            s.add_chunk(cached + done, k);
            ms += self.timing.step_time(&s) * self.slowdown;
            done += k;
        }
        ms
    }

    fn fill(&self, running: usize) -> f64 {
        (running * Self::ctx()) as f64 / (self.blocks * self.block_size).max(1) as f64
    }

    fn step_ms(&self, running: usize) -> f64 {
        let s = StepShape {
            decode_seqs: running,
            decode_context_tokens: running * Self::ctx(),
            kv_fill: self.fill(running),
            ..StepShape::default()
        };
        self.timing.step_time(&s) * self.slowdown
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

fn learned_step_ms(class: &Value, running: f64, fill: f64) -> f64 {
    let p = params(&class["decode"]);
    p("step_base_ms")
        + p("decode_ms_per_seq") * running
        + p("step_ms_per_kv_fill") * fill
        + p("step_ms_per_kv_fill_sq") * fill * fill
}

/// The operating range: (new, cached) percentiles of the run's requests.
fn grid(records: &[runner::Record]) -> Vec<(usize, usize)> {
    let ok: Vec<&runner::Record> = records.iter().filter(|r| r.error.is_none() && r.prompt_tokens > 0).collect();
    let q = |mut v: Vec<usize>, p: f64| {
        v.sort_unstable();
        v.get(((v.len().saturating_sub(1)) as f64 * p).round() as usize).copied().unwrap_or(0)
    };
    let news: Vec<usize> =
        ok.iter().map(|r| (r.prompt_tokens - r.cached_tokens.min(r.prompt_tokens)) as usize).collect();
    let cached: Vec<usize> = ok.iter().map(|r| r.cached_tokens as usize).collect();
    let mut out = Vec::new();
    for pn in [0.1, 0.5, 0.9] {
        for pc in [0.1, 0.5, 0.9] {
            let point = (q(news.clone(), pn).max(1), q(cached.clone(), pc));
            if !out.contains(&point) {
                out.push(point);
            }
        }
    }
    out
}

/// Errors of one class's snapshot against its truth: (TTFT, decode step).
fn errors(class: &Value, truth: &Truth, grid: &[(usize, usize)], running: usize, speedup: f64) -> (f64, f64) {
    let rel = |got: f64, want: f64| if want > 0.0 { (got - want).abs() / want } else { f64::INFINITY };
    let rs = [running.div_ceil(2).max(1), running.max(1)];
    let mut ttft: f64 = 0.0;
    for &(n, c) in grid {
        for &r in &rs {
            let got = learned_ttft_ms(class, n as f64, c as f64, r as f64) * speedup;
            ttft = ttft.max(rel(got, truth.ttft_ms(n, c, r)));
        }
    }
    let mut step: f64 = 0.0;
    for &r in &rs {
        let got = learned_step_ms(class, r as f64, truth.fill(r)) * speedup;
        step = step.max(rel(got, truth.step_ms(r)));
    }
    (ttft, step)
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
    /// The model's entry.
    timing: Value,
}

fn get_json(addr: SocketAddr, path: &str) -> Result<Value> {
    let r = http_request(addr, "GET", path, &[], b"")?;
    if r.status != 200 {
        bail!("GET {path}: {}", r.status);
    }
    Ok(serde_json::from_slice(&r.body)?)
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
            "compared": "learned TTFT of an unqueued request and decode step time, x speedup, against the preset's, at the run's (new, cached) percentiles and R = concurrency per worker and half of it; largest relative error",
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
                "{}: within 10 % after {} requests, again after the slowdown after {}; final errors TTFT {:.1} %, step {:.1} %",
                c["class"].as_str().unwrap_or("?"),
                c["requests_to_within_10pct"],
                c["requests_after_change_to_within_10pct"],
                c["final_error"]["ttft"].as_f64().unwrap_or(f64::NAN) * 100.0,
                c["final_error"]["step"].as_f64().unwrap_or(f64::NAN) * 100.0,
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// One preset: the run, its snapshots, and what they show.
fn one(a: &CalibrationArgs, name: &str, dir: &Path) -> Result<(Value, String)> {
    let fleet = FleetSpec::preset(name, a.speedup, 8)?;
    let mut stack = Stack::start(dir, &fleet, &Frontend::Kvgate("kv".into()))?;
    let admin = stack.cp_admin.context("the kv stack has a control plane")?;
    let wall = |sim_s: f64| Duration::from_secs_f64(sim_s / a.speedup);
    let windows = Windows { warmup: wall(20.0), measure: wall(2.0 * a.phase_s), drain: wall(120.0) };
    let (front, workers, pids, conc) = (stack.front, stack.workers.clone(), stack.pids.clone(), a.concurrency);
    let load = std::thread::spawn(move || -> Result<runner::CellRun> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(runner::run_doks(front, &workers, &pids, &Doks::default(), conc, windows, 1_000_000))
    });
    let scrape_all =
        |ws: &[SocketAddr]| -> Vec<WorkerMetrics> { ws.iter().map(|w| scrape(*w).unwrap_or_default()).collect() };
    let at_start = scrape_all(&stack.workers);
    let mut metrics_at_change = Vec::new();
    let t0 = Instant::now();
    let change_at = windows.warmup + wall(a.phase_s);
    let mut snaps = Vec::new();
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
        if let Ok(v) = get_json(admin, "/admin/timing") {
            snaps.push(Snapshot { slowed, timing: v[MODEL].clone() });
        }
    }
    let run = load.join().map_err(|_| anyhow::anyhow!("the load thread panicked"))??;
    let at_end = scrape_all(&stack.workers);
    stack.check()?;
    std::fs::write(dir.join("records.json"), serde_json::to_vec(&run.records)?)?;
    let g = grid(&run.records);
    let kinds = fleet.kinds();
    let running = a.concurrency.div_ceil(kinds.len().max(1));
    let truth_of = |class: &str, slowdown: f64| -> Result<Truth> {
        let blocks = class_blocks(class);
        let (timing, blocks) =
            kinds.iter().find(|(_, b)| Some(*b) == blocks).cloned().unwrap_or_else(|| kinds[0].clone());
        let timing = Timing::preset(&timing).with_context(|| format!("timing {timing}"))?;
        Ok(Truth {
            timing,
            blocks,
            block_size: fleet.block_size as usize,
            budget: fleet.max_num_batched_tokens,
            slowdown,
        })
    };
    // Per class: (samples, ttft error, step error, slowed) per snapshot.
    let mut series: std::collections::BTreeMap<String, Vec<(u64, f64, f64, bool)>> = Default::default();
    for s in &snaps {
        let Some(classes) = s.timing["classes"].as_object() else { continue };
        for (class, v) in classes {
            let truth = truth_of(class, if s.slowed { a.slowdown } else { 1.0 })?;
            let (te, se) = errors(v, &truth, &g, running, a.speedup);
            let n = v["first_token"]["samples"].as_u64().unwrap_or(0);
            series.entry(class.clone()).or_default().push((n, te, se, s.slowed));
        }
    }
    let last = snaps.last().map(|s| s.timing.clone()).unwrap_or_default();
    let at_change = snaps.iter().rev().find(|s| !s.slowed).map(|s| s.timing.clone()).unwrap_or_default();
    let mut classes: Vec<Value> = Vec::new();
    for (class, pts) in &series {
        let ok = |p: &(u64, f64, f64, bool)| p.1 <= WITHIN && p.2 <= WITHIN;
        let before: Vec<_> = pts.iter().filter(|p| !p.3).collect();
        let after: Vec<_> = pts.iter().filter(|p| p.3).collect();
        // The first snapshot from which every later one (in its phase) is within.
        let settled = |v: &[&(u64, f64, f64, bool)]| -> Option<u64> {
            let i = v.iter().rposition(|p| !ok(p)).map_or(0, |i| i + 1);
            v.get(i).map(|p| p.0)
        };
        let change_samples = before.last().map_or(0, |p| p.0);
        let truth0 = truth_of(class, 1.0)?;
        let last_pt = pts.last().copied().unwrap_or_default();
        let truth_ttft: Vec<Value> = g
            .iter()
            .map(|&(n, c)| json!({"new": n, "cached": c, "running": running, "ms": truth0.ttft_ms(n, c, running)}))
            .collect();
        let truth_step: Vec<Value> = [running.div_ceil(2), running]
            .iter()
            .map(|&r| json!({"running": r, "fill": truth0.fill(r), "ms": truth0.step_ms(r)}))
            .collect();
        classes.push(json!({
            "class": class,
            "timing": format!("{:?}", truth0.timing),
            "requests_to_within_10pct": settled(&before),
            "requests_after_change_to_within_10pct": settled(&after).map(|n| n.saturating_sub(change_samples)),
            "samples_at_change": change_samples,
            "error_at_change": before.last().map(|p| json!({"ttft": p.1, "step": p.2})),
            "final_error": {"ttft": last_pt.1, "step": last_pt.2},
            "learned": at_change["classes"][class].clone(),
            "learned_after_change": last["classes"][class].clone(),
            "truth": {"ttft_ms": truth_ttft, "step_ms": truth_step},
        }));
    }
    // What the engines did (their own histograms, simulated time) and what
    // the clients saw, per phase: the estimator against the fleet as it
    // behaved, apart from the preset's formula and the harness.
    // Per class: the workers of its kind.
    let members = |class: &str| -> Vec<usize> {
        let blocks = class_blocks(class);
        let all: Vec<usize> = (0..kinds.len()).collect();
        let mine: Vec<usize> = all.iter().copied().filter(|&w| Some(kinds[w].1) == blocks).collect();
        if mine.is_empty() { all } else { mine }
    };
    let change_s = (windows.warmup + wall(a.phase_s)).as_secs_f64();
    let phase = |from: &[WorkerMetrics], to: &[WorkerMetrics], slowed: bool, ws: &[usize]| -> Value {
        let (mut ttft, mut nt, mut itl, mut ni) = (0.0, 0.0, 0.0, 0.0);
        for &w in ws {
            let (Some(f), Some(t)) = (from.get(w), to.get(w)) else { continue };
            ttft += t.ttft_sum_s - f.ttft_sum_s;
            nt += t.ttft_count - f.ttft_count;
            itl += t.itl_sum_s - f.itl_sum_s;
            ni += t.itl_count - f.itl_count;
        }
        let running: Vec<f64> = run
            .samples
            .iter()
            .filter(|s| (s.t >= change_s) == slowed)
            .map(|s| ws.iter().filter_map(|&w| s.inflight.get(w)).sum::<f64>() / ws.len().max(1) as f64)
            .collect();
        json!({
            "engine_ttft_ms": ttft / nt.max(1.0) * 1000.0,
            "engine_itl_ms": itl / ni.max(1.0) * 1000.0,
            "mean_running_per_worker": running.iter().sum::<f64>() / running.len().max(1) as f64,
        })
    };
    // What the clients saw, and the gateway's share of it (client TTFT −
    // the engines' own, fleet-wide), per phase.
    let client = |slowed: bool| -> f64 {
        let v: Vec<f64> = run
            .records
            .iter()
            .filter(|r| r.error.is_none() && (r.start >= change_s) == slowed)
            .filter_map(|r| r.ttft)
            .collect();
        v.iter().sum::<f64>() / v.len().max(1) as f64 * 1000.0 * a.speedup
    };
    let measured = if metrics_at_change.is_empty() {
        Value::Null
    } else {
        let all: Vec<usize> = (0..kinds.len()).collect();
        let fleet = |from: &[WorkerMetrics], to: &[WorkerMetrics], slowed: bool| {
            let mut v = phase(from, to, slowed, &all);
            let c = client(slowed);
            v["client_ttft_ms"] = json!(c);
            v["gateway_share_ms"] = json!(c - v["engine_ttft_ms"].as_f64().unwrap_or(0.0));
            v
        };
        json!({
            "before": fleet(&at_start, &metrics_at_change, false),
            "after": fleet(&metrics_at_change, &at_end, true),
        })
    };
    // The learned decode step at the class's engines' mean running count,
    // against their mean inter-token time, per phase: the estimator against
    // the fleet as it behaved, apart from the preset's formula.
    if !metrics_at_change.is_empty() {
        for c in &mut classes {
            let class = c["class"].as_str().unwrap_or_default().to_owned();
            let ws = members(&class);
            let truth = truth_of(&class, 1.0)?;
            let mut vs = serde_json::Map::new();
            for (key, learned, from, to, slowed) in [
                ("before", "learned", &at_start, &metrics_at_change, false),
                ("after", "learned_after_change", &metrics_at_change, &at_end, true),
            ] {
                let m = phase(from, to, slowed, &ws);
                let (r, itl) =
                    (m["mean_running_per_worker"].as_f64().unwrap_or(0.0), m["engine_itl_ms"].as_f64().unwrap_or(0.0));
                let got = learned_step_ms(&c[learned], r, truth.fill(r.round() as usize)) * a.speedup;
                vs.insert(
                    key.into(),
                    json!({"engine": m, "learned_step_ms": got, "error": (got - itl).abs() / itl.max(1e-9)}),
                );
            }
            c["step_vs_engine"] = Value::Object(vs);
        }
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
        "running": running,
        "classes": classes,
        "measured": measured,
        "series": series.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
    });
    let svg = chart(name, &series, a.slowdown);
    Ok((doc, svg))
}

type Series = std::collections::BTreeMap<String, Vec<(u64, f64, f64, bool)>>;

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
    let xmax = series.values().flatten().map(|p| p.0).max().unwrap_or(1).max(1) as f64;
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
    let palette = [RGBColor(214, 39, 40), RGBColor(31, 119, 180), RGBColor(44, 160, 44), RGBColor(255, 127, 14)];
    for (i, (class, pts)) in series.iter().enumerate() {
        for (j, what) in ["TTFT", "step"].iter().enumerate() {
            let colour = palette[(2 * i + j) % palette.len()];
            let get = |p: &(u64, f64, f64, bool)| if j == 0 { p.1 } else { p.2 };
            let line: Vec<(f64, f64)> = pts.iter().map(|p| (p.0 as f64, (get(p) * 100.0).min(50.0))).collect();
            c.draw_series(LineSeries::new(line, colour.stroke_width(2)))?
                .label(format!("{class} {what}"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
            if let Some(p) = pts.iter().find(|p| p.3) {
                let x = p.0 as f64;
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
        json!({"first_token": {"params": ps(first)}, "decode": {"params": ps(decode)}})
    }

    /// A learned model equal to the linear preset's formula has no error;
    /// the same model after the fleet slowed 1.5× is a third off.
    #[test]
    fn a_learned_model_equal_to_the_truth_has_no_error() {
        let truth =
            Truth { timing: Timing::H200_LLAMA70B_FP8, blocks: 11_500, block_size: 32, budget: 16_384, slowdown: 1.0 };
        // TTFT = 200 + 13 + 0.65·R + 0.08·n (one step); step = 13 + 0.65·R.
        let c = class(
            &[("ttft_overhead_ms", 213.0), ("prefill_ms_per_token", 0.08), ("ttft_ms_per_running", 0.65)],
            &[("step_base_ms", 13.0), ("decode_ms_per_seq", 0.65)],
        );
        let grid = [(100, 0), (900, 5_000), (4_000, 0)];
        let (t, s) = errors(&c, &truth, &grid, 30, 1.0);
        assert!(t < 1e-9 && s < 1e-9, "{t} {s}");
        // In wall time at speedup 2 the control plane learns half.
        let half = class(
            &[("ttft_overhead_ms", 106.5), ("prefill_ms_per_token", 0.04), ("ttft_ms_per_running", 0.325)],
            &[("step_base_ms", 6.5), ("decode_ms_per_seq", 0.325)],
        );
        let (t, s) = errors(&half, &truth, &grid, 30, 2.0);
        assert!(t < 1e-9 && s < 1e-9, "{t} {s}");
        let slowed = Truth { slowdown: 1.5, ..truth };
        let (t, s) = errors(&c, &slowed, &grid, 30, 1.0);
        assert!((s - 1.0 / 3.0).abs() < 1e-9 && t > 0.1, "{t} {s}");
    }

    #[test]
    fn a_long_prompt_takes_several_steps() {
        let truth =
            Truth { timing: Timing::H200_LLAMA70B_FP8, blocks: 1, block_size: 32, budget: 1_000, slowdown: 1.0 };
        // 2,500 tokens with budget 1,000: three steps, 3 × 13 ms + 0.08 × 2,500.
        assert!((truth.ttft_ms(2_500, 0, 0) - (200.0 + 39.0 + 200.0)).abs() < 1e-9);
    }
}
