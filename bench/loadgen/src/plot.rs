//! SVG line charts of one metric against concurrency, one line per mode.
//!
//! Hand-written SVG (no plotting crate): text is left to the viewer's fonts,
//! so nothing here needs font files, and the output is stable byte for byte
//! for the same rows (the charts are committed beside the results).
//! A cell measured with the host CPU above the limit is drawn hollow.

use std::fmt::Write as _;

use crate::stats::Row;

/// A metric that can be plotted: its file stem, title, unit and accessor.
pub struct Metric {
    pub key: &'static str,
    pub title: &'static str,
    pub unit: &'static str,
    pub get: fn(&Row) -> f64,
    /// Higher is better (throughput, hit rate) rather than lower.
    pub higher_is_better: bool,
}

/// The metrics every report plots.
pub const METRICS: &[Metric] = &[
    Metric { key: "ttft_p50_ms", title: "TTFT p50", unit: "ms", get: |r| r.ttft_p50_ms, higher_is_better: false },
    Metric { key: "ttft_p95_ms", title: "TTFT p95", unit: "ms", get: |r| r.ttft_p95_ms, higher_is_better: false },
    Metric { key: "itl_p50_ms", title: "ITL p50", unit: "ms", get: |r| r.itl_p50_ms, higher_is_better: false },
    Metric { key: "e2e_p50_s", title: "E2E p50", unit: "s", get: |r| r.e2e_p50_s, higher_is_better: false },
    Metric {
        key: "output_tok_per_s",
        title: "Output throughput",
        unit: "tokens/s",
        get: |r| r.output_tok_per_s,
        higher_is_better: true,
    },
    Metric {
        key: "hit_rate",
        title: "Prefix cache hit rate",
        unit: "%",
        get: |r| r.hit_rate * 100.0,
        higher_is_better: true,
    },
];

/// A stable colour per mode (the same in every chart and on the dashboard).
pub fn colour(mode: &str) -> &'static str {
    match mode {
        "kv" => "#d62728",
        "round_robin" => "#1f77b4",
        "approx" => "#ff7f0e",
        "least_load" => "#2ca02c",
        "sglang_cache_aware" => "#9467bd",
        "random" => "#8c564b",
        _ => "#7f7f7f",
    }
}

/// A "nice" step (1, 2 or 5 × 10^k) giving about `n` ticks over `span`.
fn nice_step(span: f64, n: f64) -> f64 {
    if !(span.is_finite() && span > 0.0) {
        return 1.0;
    }
    let raw = span / n;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let m = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn fmt_tick(v: f64, step: f64) -> String {
    if step >= 1.0 { format!("{v:.0}") } else { format!("{v:.1}") }
}

const W: f64 = 640.0;
const H: f64 = 360.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 36.0;
const BOTTOM: f64 = 44.0;

/// One chart: `metric` against concurrency for every mode in `rows`, modes
/// in their order of first appearance.
pub fn chart(rows: &[Row], metric: &Metric, subtitle: &str, level: &str) -> String {
    let mut modes: Vec<&str> = Vec::new();
    for r in rows {
        if !modes.contains(&r.mode.as_str()) {
            modes.push(&r.mode);
        }
    }
    let mut xs: Vec<usize> = rows.iter().map(|r| r.concurrency).collect();
    xs.sort_unstable();
    xs.dedup();
    let vals: Vec<f64> = rows.iter().map(metric.get).filter(|v| v.is_finite()).collect();
    let ymax_data = vals.iter().copied().fold(0.0f64, f64::max);
    let step = nice_step(ymax_data.max(1e-9), 5.0);
    let ymax = (ymax_data / step).ceil().max(1.0) * step;
    let (x0, x1) = (xs.first().copied().unwrap_or(0) as f64, xs.last().copied().unwrap_or(1) as f64);
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let px = |x: f64| if x1 > x0 { LEFT + (x - x0) / (x1 - x0) * pw } else { LEFT + pw / 2.0 };
    let py = |y: f64| TOP + ph - (y / ymax) * ph;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let better = if metric.higher_is_better { "higher is better" } else { "lower is better" };
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="20" font-size="15" font-weight="bold">{} ({}, {better})</text>"#,
        esc(metric.title),
        esc(metric.unit)
    );
    if !subtitle.is_empty() {
        let _ = writeln!(s, r##"<text x="{}" y="20" text-anchor="end" fill="#555">{}</text>"##, W - 8.0, esc(subtitle));
    }
    // Grid and y ticks.
    let mut y = 0.0;
    while y <= ymax + step * 0.01 {
        let yy = py(y);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            yy + 4.0,
            fmt_tick(y, step)
        );
        y += step;
    }
    // X ticks at every level.
    for &x in &xs {
        let xx = px(x as f64);
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.1}" y1="{:.1}" x2="{xx:.1}" y2="{:.1}" stroke="#999"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{x}</text>"##,
            TOP + ph,
            TOP + ph + 5.0,
            TOP + ph + 18.0
        );
    }
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#333"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{:.1}" stroke="#333"/>"##,
        TOP + ph,
        LEFT + pw,
        TOP + ph,
        TOP + ph
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + pw / 2.0,
        H - 8.0,
        esc(if level == "conc." { "concurrency" } else { level })
    );
    // One line per mode, then the legend.
    for (i, mode) in modes.iter().enumerate() {
        let c = colour(mode);
        let mut pts: Vec<(usize, f64, bool)> = rows
            .iter()
            .filter(|r| r.mode == *mode)
            .map(|r| (r.concurrency, (metric.get)(r), r.valid))
            .filter(|(_, v, _)| v.is_finite())
            .collect();
        pts.sort_by_key(|p| p.0);
        let path: Vec<String> = pts.iter().map(|(x, v, _)| format!("{:.1},{:.1}", px(*x as f64), py(*v))).collect();
        let width = if *mode == "kv" { 2.5 } else { 1.5 };
        let _ = writeln!(
            s,
            r#"<polyline data-mode="{}" points="{}" fill="none" stroke="{c}" stroke-width="{width}"/>"#,
            esc(mode),
            path.join(" ")
        );
        for (x, v, valid) in &pts {
            let fill = if *valid { c } else { "white" };
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{fill}" stroke="{c}"><title>{} at {x}: {v:.2} {}</title></circle>"#,
                px(*x as f64),
                py(*v),
                esc(mode),
                esc(metric.unit)
            );
        }
        let ly = TOP + 10.0 + i as f64 * 20.0;
        let lx = W - RIGHT + 16.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="{width}"/><text x="{}" y="{}">{}</text>"#,
            lx + 22.0,
            lx + 28.0,
            ly + 4.0,
            esc(mode)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::tests::row;

    #[test]
    fn ticks_are_nice() {
        assert_eq!(nice_step(1000.0, 5.0), 200.0);
        assert_eq!(nice_step(0.9, 5.0), 0.2);
        assert_eq!(nice_step(0.0, 5.0), 1.0);
    }

    #[test]
    fn a_chart_has_a_line_per_mode_and_a_point_per_cell() {
        let mut rows = vec![row("round_robin", 60), row("kv", 60), row("round_robin", 120), row("kv", 120)];
        rows[3].valid = false;
        rows[3].ttft_p50_ms = 900.0;
        let svg = chart(&rows, &METRICS[0], "commit abc", "conc.");
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 4);
        assert_eq!(svg.matches(r##"fill="white" stroke="#d62728""##).count(), 1, "the invalid cell is hollow");
        assert!(svg.contains("kv at 120: 900.00 ms"));
        // The y axis reaches past the largest value; ticks are 0..=1000.
        assert!(svg.contains(">1000</text>") && !svg.contains(">1200</text>"), "{svg}");
        // Same rows, same bytes.
        assert_eq!(svg, chart(&rows, &METRICS[0], "commit abc", "conc."));
        // One level only: still a chart, the point in the middle.
        assert_eq!(chart(&rows[..1], &METRICS[4], "", "conc.").matches("<circle").count(), 1);
    }
}
