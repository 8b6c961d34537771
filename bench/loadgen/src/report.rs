//! Markdown tables of result rows: one comparison table shaped like
//! REFERENCE-RESULTS.md table A (baseline / candidate with the change in
//! percent), and one table of every mode at every level.

use std::fmt::Write as _;

use std::path::Path;

use crate::stats::{Row, SLO_ITL_MS, SLO_TTFT_MS, levels, modes};
use crate::{html, plot};

fn pct(base: f64, new: f64) -> String {
    if !(base.is_finite() && new.is_finite()) || base == 0.0 {
        return "–".into();
    }
    let p = (new - base) / base * 100.0;
    format!("{}{:.0} %", if p > 0.0 { "+" } else { "−" }, p.abs())
}

fn find<'a>(rows: &'a [Row], mode: &str, c: usize) -> Option<&'a Row> {
    rows.iter().find(|r| r.mode == mode && r.concurrency == c)
}

/// A goodput level as shown: the level, or "none".
fn level_or_none(l: Option<usize>) -> String {
    l.map_or("none".to_owned(), |l| l.to_string())
}

/// Which percentile the SLO is judged at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SloAt {
    P50,
    P95,
}

/// SLO goodput per mode, modes in order of first appearance: the highest
/// level at which the mode met both bounds at `at`, at that level and at
/// every lower level it ran (a level that fails ends the run of levels;
/// `None`: not even the lowest).
pub fn slo_goodput(rows: &[Row], at: SloAt) -> Vec<(String, Option<usize>)> {
    let mut out: Vec<(String, Option<usize>)> = modes(rows).into_iter().map(|m| (m.to_owned(), None)).collect();
    for (mode, best) in &mut out {
        let mut mine: Vec<&Row> = rows.iter().filter(|r| r.mode == *mode).collect();
        mine.sort_by_key(|r| r.concurrency);
        for r in mine {
            let (ttft, itl) = match at {
                SloAt::P50 => (r.ttft_p50_ms, r.itl_p50_ms),
                SloAt::P95 => (r.ttft_p95_ms, r.itl_p95_ms),
            };
            // A cell whose host CPU was above the limit measured the
            // machine, not the router: it cannot certify the SLO.
            if !(ttft <= SLO_TTFT_MS && itl <= SLO_ITL_MS && r.errors == 0 && r.valid) {
                break;
            }
            *best = Some(r.concurrency);
        }
    }
    out
}

/// `{mode: level or null}` at p95, and the same at p50, for result files.
pub fn slo_goodput_json(rows: &[Row]) -> serde_json::Value {
    let map = |at| {
        serde_json::Value::Object(slo_goodput(rows, at).into_iter().map(|(m, l)| (m, serde_json::json!(l))).collect())
    };
    serde_json::json!({"p95": map(SloAt::P95), "p50": map(SloAt::P50)})
}

/// One line for the end of a run: every mode's goodput at p95, and `kv`'s
/// over `round_robin`'s when both met the SLO somewhere.
pub fn slo_line(rows: &[Row], level: &str) -> String {
    let p95 = slo_goodput(rows, SloAt::P95);
    let modes: Vec<String> = p95.iter().map(|(m, l)| format!("{m} {}", level_or_none(*l))).collect();
    let get = |m: &str| p95.iter().find(|(x, _)| x == m).and_then(|(_, l)| *l);
    let ratio = match (get("kv"), get("round_robin")) {
        (Some(k), Some(r)) if r > 0 => format!("; kv / round_robin {:.2}x", k as f64 / r as f64),
        _ => String::new(),
    };
    format!(
        "SLO goodput (highest {level} with TTFT p95 <= {SLO_TTFT_MS:.0} ms and ITL p95 <= {SLO_ITL_MS:.0} ms): {}{ratio}",
        modes.join(", ")
    )
}

/// The headline: each mode's SLO goodput at p95 and p50.
pub fn slo_headline(rows: &[Row], level: &str) -> String {
    let (p95, p50) = (slo_goodput(rows, SloAt::P95), slo_goodput(rows, SloAt::P50));
    let mut s = format!(
        "**SLO goodput** (TTFT ≤ {SLO_TTFT_MS:.0} ms and ITL ≤ {SLO_ITL_MS:.0} ms, no errors; the highest {level} met at it and every lower level):

"
    );
    let _ = writeln!(s, "| mode | at p95 | at p50 |");
    let _ = writeln!(s, "|---|---:|---:|");
    for ((mode, a), (_, b)) in p95.iter().zip(&p50) {
        let _ = writeln!(s, "| {mode} | {} | {} |", level_or_none(*a), level_or_none(*b));
    }
    s
}

/// Whether `cand` beats `base` on one row pair, metric by metric: TTFT p50,
/// TTFT p95, ITL p50, E2E p50 (lower wins) and output tokens/s (higher wins).
pub fn wins(base: &Row, cand: &Row) -> [bool; 5] {
    [
        cand.ttft_p50_ms < base.ttft_p50_ms,
        cand.ttft_p95_ms < base.ttft_p95_ms,
        cand.itl_p50_ms < base.itl_p50_ms,
        cand.e2e_p50_s < base.e2e_p50_s,
        cand.output_tok_per_s > base.output_tok_per_s,
    ]
}

/// Table A: `base` against `cand` at every level both ran.
pub fn comparison(rows: &[Row], base: &str, cand: &str, level: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "**{base} vs {cand}** (simulated time; change is {cand} relative to {base})\n");
    let _ = writeln!(
        s,
        "| {level} | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | E2E p50 s | out tok/s | hit rate | {cand} wins |"
    );
    let _ = writeln!(s, "|---:|---|---|---|---|---|---|---|");
    for c in levels(rows) {
        let (Some(b), Some(k)) = (find(rows, base, c), find(rows, cand, c)) else { continue };
        let w = wins(b, k);
        let names = ["TTFT p50", "TTFT p95", "ITL", "E2E", "tok/s"];
        let won: Vec<&str> = names.iter().zip(w).filter(|(_, x)| *x).map(|(n, _)| *n).collect();
        let verdict = if won.len() == 5 { "all".to_owned() } else { format!("{} of 5: {}", won.len(), won.join(", ")) };
        let flag = if b.valid && k.valid { "" } else { " ⚠ CPU" };
        let _ = writeln!(
            s,
            "| {c}{flag} | {:.0} / {:.0} ({}) | {:.0} / {:.0} ({}) | {:.1} / {:.1} ({}) | {:.1} / {:.1} ({}) | {:.0} / {:.0} ({}) | {:.1} / {:.1} % | {verdict} |",
            b.ttft_p50_ms,
            k.ttft_p50_ms,
            pct(b.ttft_p50_ms, k.ttft_p50_ms),
            b.ttft_p95_ms,
            k.ttft_p95_ms,
            pct(b.ttft_p95_ms, k.ttft_p95_ms),
            b.itl_p50_ms,
            k.itl_p50_ms,
            pct(b.itl_p50_ms, k.itl_p50_ms),
            b.e2e_p50_s,
            k.e2e_p50_s,
            pct(b.e2e_p50_s, k.e2e_p50_s),
            b.output_tok_per_s,
            k.output_tok_per_s,
            pct(b.output_tok_per_s, k.output_tok_per_s),
            b.hit_rate * 100.0,
            k.hit_rate * 100.0,
        );
    }
    s
}

/// Every mode at every level, with the context columns.
pub fn all_modes(rows: &[Row], level: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| {level} | mode | TTFT p50 / p90 / p95 / p99 ms | ITL p50 / p95 ms | E2E p50 / p95 s | out tok/s | req/s | hit (oracle) | mispredicted | moved follow-ups | skew / spread p95 / max waiting | errors | host CPU |"
    );
    let _ = writeln!(s, "|---:|---|---|---|---|---:|---:|---|---:|---:|---|---:|---:|");
    for c in levels(rows) {
        for r in rows.iter().filter(|r| r.concurrency == c) {
            let _ = writeln!(
                s,
                "| {c} | {} | {:.0} / {:.0} / {:.0} / {:.0} | {:.1} / {:.1} | {:.1} / {:.1} | {:.0} | {:.2} | {:.1} % ({:.1} %) | {} | {} | {:.2} / {:.0} / {:.0} | {} | {:.0} %{} |",
                r.mode,
                r.ttft_p50_ms,
                r.ttft_p90_ms,
                r.ttft_p95_ms,
                r.ttft_p99_ms,
                r.itl_p50_ms,
                r.itl_p95_ms,
                r.e2e_p50_s,
                r.e2e_p95_s,
                r.output_tok_per_s,
                r.rps,
                r.hit_rate * 100.0,
                r.oracle_hit_rate * 100.0,
                match (r.mispredicted, r.predicted) {
                    (Some(m), Some(p)) => format!("{m} of {p}"),
                    _ => "–".to_owned(),
                },
                match (r.moved, r.follow_ups) {
                    (Some(m), Some(n)) => format!("{m} of {n}"),
                    _ => "–".to_owned(),
                },
                r.load_skew_mean,
                r.inflight_spread_p95,
                r.max_waiting,
                r.errors,
                r.host_cpu * 100.0,
                if r.valid { "" } else { " ⚠" },
            );
        }
    }
    s
}

/// The markdown of a result file: a heading, its context line, the
/// comparisons of `kv` against round robin and against the peer (when both
/// ran) and the table of every mode.
pub fn markdown(title: &str, context: &str, level: &str, rows: &[Row]) -> String {
    let mut md = format!("# {title}\n\n{context}\n\n");
    md += &slo_headline(rows, level);
    md.push('\n');
    let has = |m: &str| rows.iter().any(|r| r.mode == m);
    for base in ["round_robin", "approx", "sglang_cache_aware", "dynamo"] {
        if has(base) && has("kv") {
            md += &comparison(rows, base, "kv", level);
            md.push('\n');
        }
    }
    md += &all_modes(rows, level);
    if rows.iter().any(|r| r.worker_ttft_mean_ms > 0.0) {
        md.push('\n');
        md += &ttft_split(rows, level);
    }
    md
}

/// Where mean TTFT goes, per mode and level: the workers' own TTFT (from
/// arrival at the worker: queueing, prefill, the engine's first-token
/// overhead) and the rest, the frontend's share (gateway or router in
/// front, first chunk back), in simulated time like every latency here.
pub fn ttft_split(rows: &[Row], level: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "Mean TTFT, split (ms, simulated time):\n");
    let _ = writeln!(s, "| {level} | mode | at the client | at the worker | frontend share |");
    let _ = writeln!(s, "|---:|---|---:|---:|---:|");
    for c in levels(rows) {
        for r in rows.iter().filter(|r| r.concurrency == c && r.worker_ttft_mean_ms > 0.0) {
            let _ = writeln!(
                s,
                "| {c} | {} | {:.0} | {:.0} | {:.0} |",
                r.mode,
                r.ttft_mean_ms,
                r.worker_ttft_mean_ms,
                r.ttft_mean_ms - r.worker_ttft_mean_ms
            );
        }
    }
    s
}

/// Checks that `out` can be a result file: it names a `.json` file, since
/// the tables, the page and a folder of charts go beside it under the same
/// stem (without the extension the folder's name is the file's, and a
/// sweep failed after its last run).
pub fn check_result_path(out: &Path) -> anyhow::Result<()> {
    if out.extension().is_none_or(|e| e != "json") {
        anyhow::bail!(
            "--out {}: a result file must end in .json (its .md, .html and charts go beside it)",
            out.display()
        );
    }
    Ok(())
}

/// Writes everything a result file `json` (already written) gets beside it:
/// `<stem>.md`, one SVG chart per metric in `<stem>/`, and `<stem>.html`
/// with the tables and the charts. `level` names what the rows vary
/// (`conc.`, `qps`...). Returns the markdown.
pub fn publish(json: &Path, title: &str, context: &str, level: &str, rows: &[Row]) -> anyhow::Result<String> {
    check_result_path(json)?;
    let md = markdown(title, context, level, rows);
    std::fs::write(json.with_extension("md"), &md)?;
    let dir = json.with_extension("");
    std::fs::create_dir_all(&dir)?;
    let mut charts = Vec::new();
    for m in plot::METRICS {
        let svg = plot::chart(rows, m, title, level);
        std::fs::write(dir.join(format!("{}.svg", m.key)), &svg)?;
        charts.push(svg);
    }
    std::fs::write(json.with_extension("html"), html::page(title, &md, &charts))?;
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(mode: &str, c: usize, ttft: f64, tok: f64) -> Row {
        let mut r = crate::stats::tests::row(mode, c);
        r.ttft_p50_ms = ttft;
        r.ttft_p95_ms = ttft * 2.0;
        r.ttft_p99_ms = ttft * 3.0;
        r.output_tok_per_s = tok;
        r
    }

    #[test]
    fn the_comparison_says_what_won() {
        let rows = vec![row("round_robin", 60, 300.0, 2000.0), row("kv", 60, 240.0, 2200.0)];
        let t = comparison(&rows, "round_robin", "kv", "conc.");
        assert!(t.contains("| 60 | 300 / 240 (−20 %) | 600 / 480 (−20 %) |"), "{t}");
        assert!(t.contains("2000 / 2200 (+10 %)"), "{t}");
        // ITL and E2E are equal: not a win.
        assert!(t.contains("3 of 5: TTFT p50, TTFT p95, tok/s |"), "{t}");
        assert_eq!(all_modes(&rows, "conc.").lines().count(), 4);
        assert!(all_modes(&rows, "conc.").contains("| 300 / 500 / 600 / 900 |"));
        // Mean 350 ms at the client, 330 at the worker: 20 ms in front.
        assert!(ttft_split(&rows, "conc.").contains("| 60 | kv | 350 | 330 | 20 |"));
    }

    #[test]
    fn slo_goodput_is_the_highest_level_met_without_a_gap() {
        let mut rows = Vec::new();
        for (c, ttft) in [(60, 200.0), (90, 250.0), (120, 400.0), (150, 200.0)] {
            rows.push(row("kv", c, ttft, 1.0)); // p95 = 2 × p50
            rows.push(row("round_robin", c, ttft * 2.0, 1.0));
        }
        rows.push(row("dynamo", 60, 700.0, 1.0));
        let p95 = slo_goodput(&rows, SloAt::P95);
        // kv: p95 400, 500, 800 (fails at 120; 150 passes but comes after).
        assert_eq!(p95[0], ("kv".to_owned(), Some(90)));
        assert_eq!(p95[1], ("round_robin".to_owned(), None));
        assert_eq!(p95[2], ("dynamo".to_owned(), None));
        let p50 = slo_goodput(&rows, SloAt::P50);
        assert_eq!(p50[0].1, Some(150));
        assert_eq!(p50[1].1, Some(90), "800 ms at 120");
        // ITL above the bound fails too.
        rows.iter_mut().for_each(|r| r.itl_p95_ms = 61.0);
        assert_eq!(slo_goodput(&rows, SloAt::P95)[0].1, None);
        let j = slo_goodput_json(&rows);
        assert_eq!(j["p50"]["kv"], 150);
        assert!(j["p95"]["kv"].is_null());
        assert!(slo_headline(&rows, "conc.").contains("| kv | none | 150 |"));
        // A cell measured with the host CPU above the limit ends it too.
        let mut invalid = rows.clone();
        invalid.iter_mut().filter(|r| r.mode == "kv" && r.concurrency == 90).for_each(|r| r.valid = false);
        assert_eq!(slo_goodput(&invalid, SloAt::P50)[0].1, Some(60));
        rows.iter_mut().for_each(|r| r.itl_p95_ms = 40.0);
        rows.retain(|r| r.mode != "round_robin" || r.concurrency == 60);
        rows.iter_mut().filter(|r| r.mode == "round_robin").for_each(|r| r.ttft_p95_ms = 500.0);
        let line = slo_line(&rows, "conc.");
        assert!(line.contains("kv 90, round_robin 60, dynamo none; kv / round_robin 1.50x"), "{line}");
    }

    #[test]
    fn a_result_path_must_name_a_json_file() {
        assert!(check_result_path(Path::new("/tmp/x/doks.json")).is_ok());
        for bad in ["/tmp/x/doks-multiturn-vllm-v1", "/tmp/x/doks.md"] {
            let e = check_result_path(Path::new(bad)).map_err(|e| e.to_string());
            assert!(e.as_ref().is_err_and(|e| e.contains(".json")), "{bad}: {e:?}");
        }
    }

    #[test]
    fn publish_writes_tables_charts_and_the_page() {
        let dir = std::env::temp_dir().join(format!("kvgate-bench-publish-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = dir.join("sweep.json");
        let rows = vec![row("round_robin", 60, 300.0, 2000.0), row("kv", 60, 240.0, 2200.0)];
        let md = publish(&json, "Sweep", "commit x", "conc.", &rows).unwrap();
        assert!(md.starts_with("# Sweep\n\ncommit x\n"));
        assert!(md.contains("**round_robin vs kv**") && !md.contains("sglang"));
        assert_eq!(std::fs::read_to_string(json.with_extension("md")).unwrap(), md);
        for m in plot::METRICS {
            let svg = std::fs::read_to_string(dir.join("sweep").join(format!("{}.svg", m.key))).unwrap();
            assert!(svg.starts_with("<svg") && svg.contains(m.title));
        }
        let page = std::fs::read_to_string(json.with_extension("html")).unwrap();
        assert_eq!(page.matches("<svg").count(), plot::METRICS.len());
        assert!(page.contains("<td>3 of 5: TTFT p50, TTFT p95, tok/s</td>"), "{page}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
