//! Prometheus text exposition (format 0.0.4) without a metrics library:
//! lock-free histograms and counters for the hot path, everything else read
//! from the model states when `/metrics` is scraped.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// A fixed-bucket histogram with atomic counts.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micro: AtomicU64,
    count: AtomicU64,
}

/// Pick latency buckets (seconds).
pub const LATENCY_BUCKETS: &[f64] =
    &[25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0];

/// Ratio buckets (predicted overlap / prompt).
pub const RATIO_BUCKETS: &[f64] = &[0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0];

impl Histogram {
    /// A histogram with these upper bounds.
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micro: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Records one value.
    pub fn observe(&self, v: f64) {
        if !v.is_finite() {
            return;
        }
        if let Some(i) = self.bounds.iter().position(|b| v <= *b)
            && let Some(c) = self.counts.get(i)
        {
            c.fetch_add(1, Ordering::Relaxed);
        }
        self.sum_micro.fetch_add((v.max(0.0) * 1e6) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Observations.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Writes the `_bucket`, `_sum` and `_count` series.
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cum = 0u64;
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cum}");
        }
        let n = self.count();
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {n}");
        let sum = self.sum_micro.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {n}");
    }
}

/// Escapes a label value.
pub fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Writes `# HELP` and `# TYPE` lines.
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Process-wide counters (not per model).
#[derive(Debug, Default)]
pub struct Global {
    /// NATS messages by kind: kv, hb, inflight, other.
    pub nats_messages: [AtomicU64; 4],
    /// Undecodable or inconsistent NATS messages by kind.
    pub nats_malformed: [AtomicU64; 4],
    /// NATS messages for models this replica does not serve.
    pub nats_unknown_model: AtomicU64,
    /// Pick requests rejected before routing, by cause: unknown_model,
    /// invalid, no_workers.
    pub pick_errors: [AtomicU64; 3],
    /// Tokenization failures (routed by load instead).
    pub tokenize_errors: AtomicU64,
    /// Picks answered `resend`: the filter elided messages this replica
    /// does not hold.
    pub pick_resends: AtomicU64,
    /// Chat messages that arrived elided (bytes left out by the filter).
    pub elided_segments: AtomicU64,
    /// gRPC responses by status code (0..=16).
    pub grpc_status: [AtomicU64; 17],
    /// Snapshot requests sent.
    pub snapshot_requests: AtomicU64,
    /// Snapshot requests that failed or timed out.
    pub snapshot_failures: AtomicU64,
    /// In-flight batches published / publish failures.
    pub inflight_published: AtomicU64,
    /// In-flight publish failures.
    pub inflight_publish_errors: AtomicU64,
}

/// Label values of [`Global::nats_messages`].
pub const NATS_KINDS: [&str; 4] = ["kv", "heartbeat", "inflight", "other"];
/// Label values of [`Global::pick_errors`].
pub const PICK_ERRORS: [&str; 3] = ["unknown_model", "invalid", "no_workers"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let h = Histogram::new(&[1.0, 2.0]);
        h.observe(0.5);
        h.observe(1.5);
        h.observe(9.0);
        h.observe(f64::NAN);
        let mut s = String::new();
        h.render(&mut s, "x", "m=\"a\"");
        assert!(s.contains("x_bucket{m=\"a\",le=\"1\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{m=\"a\",le=\"2\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{m=\"a\",le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count{m=\"a\"} 3\n"), "{s}");
    }
}
