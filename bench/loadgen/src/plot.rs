//! SVG line charts of one metric against concurrency, one line per mode,
//! drawn by `plotters` (its SVG backend: no font files needed, text is left
//! to the viewer; the output is the same bytes for the same rows, so the
//! charts are committed beside the results). A cell measured with the host
//! CPU above the limit is drawn hollow.

use plotters::prelude::*;

use crate::stats::Row;

/// A metric that can be plotted: its file stem, title, unit and accessor.
pub struct Metric {
    pub key: &'static str,
    pub title: &'static str,
    pub unit: &'static str,
    pub get: fn(&Row) -> f64,
    /// Higher is better (throughput, hit rate) rather than lower.
    pub higher_is_better: bool,
    /// The SLO bound drawn as a dashed line (the DOKS demo's: TTFT ≤ 600 ms,
    /// ITL ≤ 60 ms).
    pub slo: Option<f64>,
}

/// The metrics every report plots.
pub const METRICS: &[Metric] = &[
    Metric {
        key: "ttft_p50_ms",
        title: "TTFT p50",
        unit: "ms",
        get: |r| r.ttft_p50_ms,
        higher_is_better: false,
        slo: Some(crate::stats::SLO_TTFT_MS),
    },
    Metric {
        key: "ttft_p95_ms",
        title: "TTFT p95",
        unit: "ms",
        get: |r| r.ttft_p95_ms,
        higher_is_better: false,
        slo: Some(crate::stats::SLO_TTFT_MS),
    },
    Metric {
        key: "itl_p50_ms",
        title: "ITL p50",
        unit: "ms",
        get: |r| r.itl_p50_ms,
        higher_is_better: false,
        slo: None,
    },
    Metric {
        key: "itl_p95_ms",
        title: "ITL p95",
        unit: "ms",
        get: |r| r.itl_p95_ms,
        higher_is_better: false,
        slo: Some(crate::stats::SLO_ITL_MS),
    },
    Metric { key: "e2e_p50_s", title: "E2E p50", unit: "s", get: |r| r.e2e_p50_s, higher_is_better: false, slo: None },
    Metric {
        key: "output_tok_per_s",
        title: "Output throughput",
        unit: "tokens/s",
        get: |r| r.output_tok_per_s,
        higher_is_better: true,
        slo: None,
    },
    Metric {
        key: "hit_rate",
        title: "Prefix cache hit rate",
        unit: "%",
        get: |r| r.hit_rate * 100.0,
        higher_is_better: true,
        slo: None,
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
        "dynamo" => "#17becf",
        "dynamo_round_robin" => "#bcbd22",
        "kv_true_constants" => "#e377c2",
        "kv_no_speculation" => "#ff9896",
        "kv_lasting_load" => "#ffbb78",
        "kv_tier_blind" => "#c49c94",
        "kv_overload" => "#9467bd",
        "kv_end_reports" => "#98df8a",
        _ => "#7f7f7f",
    }
}

/// The chart's size in pixels.
const SIZE: (u32, u32) = (640, 360);

fn rgb(hex: &str) -> RGBColor {
    let v = u32::from_str_radix(hex.trim_start_matches('#'), 16).unwrap_or(0x7f7f7f);
    RGBColor((v >> 16) as u8, (v >> 8) as u8, v as u8)
}

/// One chart: `metric` against concurrency for every mode in `rows`, modes
/// in their order of first appearance.
pub fn chart(rows: &[Row], metric: &Metric, subtitle: &str, level: &str) -> String {
    let mut out = String::new();
    let drawn = draw(&mut out, rows, metric, subtitle, level);
    match drawn {
        Ok(()) => out,
        Err(e) => format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\"><text x=\"8\" y=\"20\">{}: chart failed ({e})</text></svg>\n",
            SIZE.0, SIZE.1, metric.title
        ),
    }
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

fn draw(out: &mut String, rows: &[Row], metric: &Metric, subtitle: &str, level: &str) -> DrawResult {
    let modes = crate::stats::modes(rows);
    let xs = crate::stats::levels(rows);
    let ymax = rows.iter().map(metric.get).filter(|v| v.is_finite()).fold(0.0f64, f64::max).max(1e-9) * 1.1;
    // The SLO line is drawn when it is inside the data's range or near it.
    let slo = metric.slo.filter(|s| *s < ymax * 2.0);
    let ymax = ymax.max(slo.map_or(0.0, |s| s * 1.1));
    let (x0, x1) = (xs.first().copied().unwrap_or(0) as f64, xs.last().copied().unwrap_or(1) as f64);
    let (x0, x1) = if x1 > x0 { (x0, x1) } else { (x0 - 1.0, x0 + 1.0) };
    let root = SVGBackend::with_string(out, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let better = if metric.higher_is_better { "higher is better" } else { "lower is better" };
    root.draw(&Text::new(
        subtitle.to_owned(),
        (SIZE.0 as i32 - 200, 8),
        ("sans-serif", 12).into_font().color(&RGBColor(85, 85, 85)),
    ))?;
    let mut c = ChartBuilder::on(&root)
        .caption(format!("{} ({}, {better})", metric.title, metric.unit), ("sans-serif", 15))
        .margin(8)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, 0f64..ymax)?;
    c.configure_mesh()
        .x_desc(if level == "conc." { "concurrency" } else { level })
        .x_labels(xs.len().clamp(2, 12))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .light_line_style(RGBColor(238, 238, 238))
        .draw()?;
    if let Some(slo) = slo {
        let grey = RGBColor(120, 120, 120);
        c.draw_series(DashedLineSeries::new([(x0, slo), (x1, slo)], 6, 4, grey.stroke_width(1)))?
            .label(format!("SLO {slo:.0} {}", metric.unit))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey.stroke_width(1)));
    }
    for mode in &modes {
        let colour = rgb(colour(mode));
        let width = if *mode == "kv" { 3 } else { 2 };
        let mut pts: Vec<(f64, f64, bool)> = rows
            .iter()
            .filter(|r| r.mode == *mode)
            .map(|r| (r.concurrency as f64, (metric.get)(r), r.valid))
            .filter(|(_, v, _)| v.is_finite())
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        c.draw_series(LineSeries::new(pts.iter().map(|p| (p.0, p.1)), colour.stroke_width(width)))?
            .label(*mode)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(width)));
        c.draw_series(pts.iter().map(|&(x, v, valid)| {
            let style = if valid { colour.filled() } else { colour.stroke_width(1) };
            Circle::new((x, v), 3, style)
        }))?;
    }
    c.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(RGBColor(204, 204, 204)).draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::tests::row;

    #[test]
    fn a_chart_has_a_line_per_mode_and_a_point_per_cell() {
        let mut rows = vec![row("round_robin", 60), row("kv", 60), row("round_robin", 120), row("kv", 120)];
        rows[3].valid = false;
        rows[3].ttft_p50_ms = 900.0;
        let svg = chart(&rows, &METRICS[0], "commit abc", "conc.");
        assert!(svg.starts_with("<svg") && svg.contains("TTFT p50 (ms, lower is better)"), "{svg}");
        assert!(svg.contains("commit abc") && svg.contains("concurrency"));
        assert_eq!(svg.matches("<circle").count(), 4, "a point per cell");
        assert_eq!(svg.matches("fill=\"none\" stroke=\"#D62728\"").count(), 1, "the invalid cell is hollow: {svg}");
        assert!(
            svg.contains("kv\n</text>") && svg.contains("round_robin\n</text>") || svg.contains(">kv<"),
            "a legend entry per mode: {svg}"
        );
        // Same rows, same bytes.
        assert_eq!(svg, chart(&rows, &METRICS[0], "commit abc", "conc."));
        // One level only: still a chart with its point.
        assert_eq!(chart(&rows[..1], &METRICS[4], "", "conc.").matches("<circle").count(), 1);
    }
}
