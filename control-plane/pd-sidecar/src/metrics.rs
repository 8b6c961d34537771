//! The sidecar's metrics (`prometheus-client`), at `/kvgate/pd/metrics`:
//! requests by outcome (`disaggregated`, `aggregated` for those that named
//! no prefill worker, `fallback` by cause) and the prefill leg's duration.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use kvgate_protocol::pd::Fallback;

/// What happened to one generation request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Both legs ran.
    Disaggregated,
    /// No prefill worker named: straight to the local engine.
    Aggregated,
    /// A prefill worker was named, and the request was served aggregated.
    Fallback(Fallback),
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
    cause: &'static str,
}

/// The sidecar's registry and its metrics.
pub struct Metrics {
    registry: Registry,
    requests: Family<OutcomeLabels, Counter>,
    /// Seconds from the prefill leg's send to its whole answer.
    pub prefill_seconds: Histogram,
}

impl Metrics {
    /// Registered, with every outcome at 0.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kvgate_pd");
        let requests = Family::<OutcomeLabels, Counter>::default();
        registry.register("requests", "Generation requests by outcome (fallback: by cause).", requests.clone());
        let buckets = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
        let prefill_seconds = Histogram::new(buckets);
        registry.register(
            "prefill_leg_seconds",
            "Prefill legs that answered, send to answer.",
            prefill_seconds.clone(),
        );
        for o in [Outcome::Disaggregated, Outcome::Aggregated].into_iter().chain(Fallback::ALL.map(Outcome::Fallback)) {
            let _ = requests.get_or_create(&labels(o));
        }
        Self { registry, requests, prefill_seconds }
    }

    /// Counts one request.
    pub fn outcome(&self, o: Outcome) {
        self.requests.get_or_create(&labels(o)).inc();
    }

    /// The OpenMetrics text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn labels(o: Outcome) -> OutcomeLabels {
    match o {
        Outcome::Disaggregated => OutcomeLabels { outcome: "disaggregated", cause: "" },
        Outcome::Aggregated => OutcomeLabels { outcome: "aggregated", cause: "" },
        Outcome::Fallback(f) => OutcomeLabels { outcome: "fallback", cause: f.label() },
    }
}
