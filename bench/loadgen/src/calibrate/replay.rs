//! `kvgate-bench calibration-replay`: a calibration run's learning again,
//! offline, from the observations the control plane's fits learned from.
//!
//! A calibration run keeps, beside its snapshots, the control plane's
//! timing journal (`POST /admin/timing/journal`: every observation each
//! class's fit learned from, in order) with a mark at each poll, and what
//! its snapshots were compared with (`replay.json`: the grid of prompts,
//! the operating points, the preset). The replay feeds the journal to
//! fresh fits ([`EngineFit::apply`]) built from this binary's rules and
//! compares them at each mark as the live run compared its snapshots. The
//! same journal through two builds compares two estimator rules on the
//! same data, without the 100–140 requests by which one rule's count moves
//! between live runs. What it cannot show is how a rule's prices would
//! have changed the routing, and with it the observations: a rule that
//! wins here is confirmed by a live run.
//!
//! | file in a run directory | what |
//! |---|---|
//! | `journal.jsonl` | `{"class", "obs"}` per observation, `{"poll", "slowed", "draining"}` per poll (journals before `draining` count every poll as loaded) |
//! | `replay.json` | [`Context`] |

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use kvgate_core::timing::{EngineFit, Observation, Prior};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{CalibrationArgs, Counts, Errors, Operating, Poll, Series, counts, errors, truth_of};
use crate::stack::FleetSpec;

/// The journal's file name in a run directory.
pub const JOURNAL: &str = "journal.jsonl";
/// The context's file name in a run directory.
pub const CONTEXT: &str = "replay.json";
/// Workers of the main kind in a calibration fleet.
pub const WORKERS: usize = 8;

/// What a run's snapshots were compared with, and what the live run found.
#[derive(Debug, Serialize, Deserialize)]
pub struct Context {
    preset: String,
    speedup: f64,
    slowdown: f64,
    grid: Vec<(usize, usize)>,
    /// Per class and phase (slowed or not): where the class ran.
    ops: Vec<(String, bool, Operating)>,
    /// The control plane's priors: prefill ms a token, decode ms a request.
    prior: (f64, f64),
    /// Per class: the live run's requests to within 10 %, before and after
    /// the slowdown.
    live: BTreeMap<String, (Option<u64>, Option<u64>)>,
}

impl Context {
    /// From a finished run: its grid, operating points, the priors of its
    /// last snapshot and its result document.
    pub(super) fn new(
        preset: &str,
        a: &CalibrationArgs,
        grid: &[(usize, usize)],
        ops: &BTreeMap<(String, bool), Operating>,
        prior: &Value,
        doc: &Value,
    ) -> Self {
        let live = doc["classes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                let n = |k: &str| c[k].as_u64();
                (
                    c["class"].as_str().unwrap_or_default().to_owned(),
                    (n("requests_to_within_10pct"), n("requests_after_change_to_within_10pct")),
                )
            })
            .collect();
        Self {
            preset: preset.to_owned(),
            speedup: a.speedup,
            slowdown: a.slowdown,
            grid: grid.to_vec(),
            ops: ops.iter().map(|((c, s), o)| (c.clone(), *s, o.clone())).collect(),
            prior: (
                prior["prefill_ms_per_token"].as_f64().unwrap_or(0.0),
                prior["decode_ms_per_seq"].as_f64().unwrap_or(0.0),
            ),
            live,
        }
    }

    fn op(&self, class: &str, slowed: bool) -> Option<&Operating> {
        self.ops.iter().find(|(c, s, _)| c == class && *s == slowed).map(|(_, _, o)| o)
    }
}

/// Writes `c` into the run directory.
pub(super) fn save_context(dir: &Path, c: &Context) -> Result<()> {
    Ok(std::fs::write(dir.join(CONTEXT), serde_json::to_vec(c)?)?)
}

/// `kvgate-bench calibration-replay`.
#[derive(clap::Args, Debug, Clone)]
pub struct ReplayArgs {
    /// Run directories: a preset's (with `journal.jsonl`), or a
    /// calibration run's (its presets' below it).
    #[arg(required = true)]
    dirs: Vec<PathBuf>,
    /// Also write each replay's series of errors here (JSON).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replay each journal this many more times with every observed number
    /// moved by up to a billionth (seeds 1..=N), and print the spread of
    /// the counts: how much of a count is the rule and how much the
    /// accident of one run's data.
    #[arg(long, default_value_t = 0)]
    jitter: u64,
    /// The largest relative move of a time under `--jitter`.
    #[arg(long, default_value_t = 1e-9)]
    jitter_eps: f64,
}

/// Replays every run directory given and prints, per class, the requests
/// to within 10 % replayed next to the live run's.
pub fn run(a: &ReplayArgs) -> Result<()> {
    let mut dirs = Vec::new();
    for d in &a.dirs {
        if d.join(JOURNAL).exists() {
            dirs.push(d.clone());
        } else {
            let mut below: Vec<PathBuf> = std::fs::read_dir(d)
                .with_context(|| format!("{}", d.display()))?
                .filter_map(|e| Some(e.ok()?.path()))
                .filter(|p| p.join(JOURNAL).exists())
                .collect();
            below.sort();
            dirs.extend(below);
        }
    }
    let mut docs = Vec::new();
    for d in &dirs {
        if a.jitter > 0 {
            print_spread(d, a.jitter, a.jitter_eps)?;
            continue;
        }
        let (c, series) = replay(d, 0, 0.0)?;
        for (class, pts) in &series {
            let (b, f) = counts(pts);
            let (lb, lf) = c.live.get(class).copied().unwrap_or_default();
            println!(
                "{:<20} {:<24} replayed {:>5} / {:>5}   live {:>5} / {:>5}   {}",
                c.preset,
                class,
                show(b),
                show(f),
                show(lb),
                show(lf),
                d.display()
            );
            docs.push(json!({
                "dir": d, "preset": c.preset, "class": class,
                "requests_to_within_10pct": b, "requests_after_change_to_within_10pct": f,
                "live": [lb, lf],
                "series": pts.iter().map(Poll::json).collect::<Vec<_>>(),
            }));
        }
    }
    if let Some(out) = &a.out {
        std::fs::write(out, serde_json::to_vec(&docs)?)?;
    }
    Ok(())
}

/// Replays `dir` unjittered and with seeds 1..=`n` (times moved by up to
/// `eps` of themselves), and prints per class
/// the counts' minimum, median and maximum (a count never within is
/// shown as `-` and sorts last).
fn print_spread(dir: &Path, n: u64, eps: f64) -> Result<()> {
    let mut spread: BTreeMap<String, Vec<Counts>> = BTreeMap::new();
    let mut preset = String::new();
    for seed in 0..=n {
        let (c, series) = replay(dir, seed, eps)?;
        preset = c.preset.clone();
        for (class, pts) in &series {
            spread.entry(class.clone()).or_default().push(counts(pts));
        }
    }
    for (class, v) in spread {
        let range = |mut x: Vec<Option<u64>>| {
            x.sort_by_key(|c| c.unwrap_or(u64::MAX));
            let over = x.iter().filter(|c| c.is_none_or(|c| c > 300)).count();
            format!(
                "{}/{}/{} (over 300: {over} of {})",
                show(x[0]),
                show(x[x.len() / 2]),
                show(x[x.len() - 1]),
                x.len()
            )
        };
        let (b, f): (Vec<_>, Vec<_>) = v.into_iter().unzip();
        println!("{preset:<20} {class:<24} min/median/max {}   after {}   {}", range(b), range(f), dir.display());
    }
    Ok(())
}

/// Moves every time in `v` (a number under a key naming milliseconds;
/// token and request counts stay) by up to `eps` of itself, drawn from
/// `state` (splitmix64).
fn jitter(v: &mut Value, state: &mut u64, eps: f64) {
    let Value::Object(o) = v else { return };
    for (k, x) in o.iter_mut() {
        if x.is_object() {
            jitter(x, state, eps);
            continue;
        }
        let (true, Some(f)) = (k == "ms" || k.ends_with("_ms"), x.as_f64()) else { continue };
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let u = (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
        *x = json!(f * (1.0 + eps * u));
    }
}

fn show(n: Option<u64>) -> String {
    n.map_or("-".into(), |n| n.to_string())
}

/// One run directory's journal through fresh fits: its context and, per
/// class, its [`Poll`] at each poll's mark.
/// With `seed` above 0 every observed time is moved by up to `eps` of
/// itself ([`jitter`]).
fn replay(dir: &Path, seed: u64, eps: f64) -> Result<(Context, Series)> {
    let c: Context = serde_json::from_slice(&std::fs::read(dir.join(CONTEXT)).context(CONTEXT)?)?;
    let fleet = FleetSpec::preset(&c.preset, c.speedup, WORKERS)?;
    let prior = Prior { prefill_ms_per_token: c.prior.0, decode_ms_per_seq: c.prior.1 };
    let text = std::fs::read_to_string(dir.join(JOURNAL)).context(JOURNAL)?;
    let mut fits: BTreeMap<String, EngineFit> = BTreeMap::new();
    let mut series: Series = Series::default();
    for (i, line) in text.lines().enumerate() {
        let v: Value = serde_json::from_str(line).with_context(|| format!("{JOURNAL}:{}", i + 1))?;
        if let Some(obs) = v.get("obs") {
            let mut obs = obs.clone();
            if seed > 0 {
                let mut state = seed.wrapping_mul(1_000_003).wrapping_add(i as u64);
                jitter(&mut obs, &mut state, eps);
            }
            let o: Observation = serde_json::from_value(obs).with_context(|| format!("{JOURNAL}:{}", i + 1))?;
            let class = v["class"].as_str().unwrap_or_default().to_owned();
            fits.entry(class).or_insert_with(|| EngineFit::new(prior)).apply(&o);
            continue;
        }
        let slowed = v["slowed"].as_bool().unwrap_or(false);
        let draining = v["draining"].as_bool().unwrap_or(false);
        for (class, fit) in &fits {
            let Some(op) = c.op(class, slowed) else { continue };
            let truth = truth_of(&fleet, class, if slowed { c.slowdown } else { 1.0 })?;
            let j = fit.admin_json();
            let mut e: Errors = errors(&j, &truth, &c.grid, op, c.speedup);
            // What the fit read, beside its errors (the series is written
            // with `--out`).
            let steps: Vec<_> = op
                .each()
                .map(|(r, f, x, (sr, sf))| {
                    json!([r, f, x, super::learned_step_ms(&j, sr, sf) * c.speedup, truth.step_ms(r, f, x), sr, sf])
                })
                .collect();
            e.readings.insert(
                "learned".into(),
                json!({"used": j["used"], "matched": j["engine_matched"]["params"], "decode": j["decode"]["params"], "steps": steps}),
            );
            let n = j["first_token"]["samples"].as_u64().unwrap_or(0);
            series.entry(class.clone()).or_default().push(Poll { n, errors: e, slowed, draining });
        }
    }
    Ok((c, series))
}
