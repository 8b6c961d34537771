//! Metrics through `prometheus-client`: one registry per process, typed
//! families with enum labels for what the request paths count, and a
//! scrape-time collector ([`crate::collect`]) for what the model states
//! hold. Adapters register their own families (gRPC status codes, the
//! endpoint picker's outcomes) into the same registry with
//! [`Metrics::register`]; `/metrics` is [`Metrics::render`].
//!
//! Every family is registered when its owner is built, so a counter cannot
//! exist without being exported; the counters kept as plain integers inside
//! the synchronous states are listed by functions that destructure their
//! structs without `..` (a new field does not compile until it is exported).

use std::fmt::Write as _;
use std::sync::atomic::AtomicU64;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry};

/// Pick latency buckets (seconds).
pub const LATENCY_BUCKETS: [f64; 14] =
    [25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0];

/// Staleness buckets (seconds): a batch's engine timestamp to its
/// application in the index.
pub const LAG_BUCKETS: [f64; 14] =
    [1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// Ratio buckets (predicted overlap / prompt).
pub const RATIO_BUCKETS: [f64; 8] = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0];

/// The OpenMetrics text's content type (what `/metrics` answers with).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Declares a label enum with snake_case values.
#[macro_export]
macro_rules! label_enum {
    ($(#[$m:meta])* $vis:vis enum $name:ident { $($(#[$vm:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name { $($(#[$vm])* $variant),+ }
        impl $name {
            /// Every value.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            /// The label value.
            pub fn name(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }
        impl prometheus_client::encoding::EncodeLabelValue for $name {
            fn encode(&self, e: &mut prometheus_client::encoding::LabelValueEncoder<'_>) -> std::fmt::Result {
                std::fmt::Write::write_str(e, self.name())
            }
        }
    };
}

label_enum! {
    /// Kinds of NATS messages.
    pub enum NatsKind {
        /// KV event batches.
        Kv => "kv",
        /// Worker heartbeats.
        Heartbeat => "heartbeat",
        /// Other replicas' in-flight events.
        Inflight => "inflight",
        /// Anything else under the prefix.
        Other => "other",
    }
}

label_enum! {
    /// Why a Pick was refused.
    pub enum PickErrorCause {
        /// The model is not served here.
        UnknownModel => "unknown_model",
        /// Malformed or over a limit.
        Invalid => "invalid",
        /// No live (or allowed) worker.
        NoWorkers => "no_workers",
    }
}

/// `{model}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ModelLabel {
    /// The model.
    pub model: String,
}

/// `{model, mode, reason}` of a decision.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct DecisionLabels {
    /// The model.
    pub model: String,
    /// The mode label (the model's mode, or `by_load`).
    pub mode: &'static str,
    /// The reason label.
    pub reason: &'static str,
}

/// `{kind}` of a NATS message.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct KindLabel {
    /// The kind.
    pub kind: NatsKind,
}

/// `{cause}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CauseLabel {
    /// The cause.
    pub cause: PickErrorCause,
}

type HistogramFamily = Family<ModelLabel, Histogram, fn() -> Histogram>;

fn latency() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

fn lag() -> Histogram {
    Histogram::new(LAG_BUCKETS)
}

fn ratio() -> Histogram {
    Histogram::new(RATIO_BUCKETS)
}

/// The families the request paths update.
#[derive(Debug, Clone)]
pub struct Global {
    /// Pick latency by model.
    pub pick_seconds: HistogramFamily,
    /// Predicted overlap ratio of answered picks, by model.
    pub overlap_ratio: HistogramFamily,
    /// Engine timestamp of a KV event batch to its application in the
    /// index (the index's staleness), by model.
    pub event_lag_seconds: HistogramFamily,
    /// How long one application of KV event batches held the model's lock
    /// (its Picks wait meanwhile), by model.
    pub ingest_hold_seconds: HistogramFamily,
    /// How far behind the event stream is processed, by model.
    pub stream_delay_seconds: Family<ModelLabel, Gauge<f64, AtomicU64>>,
    /// Answered picks by (model, mode, reason).
    pub decisions: Family<DecisionLabels, Counter>,
    /// Refused picks by cause.
    pub pick_errors: Family<CauseLabel, Counter>,
    /// NATS messages received, by kind.
    pub nats_messages: Family<KindLabel, Counter>,
    /// NATS messages rejected as malformed, by kind.
    pub nats_malformed: Family<KindLabel, Counter>,
    /// NATS messages for models not served here.
    pub nats_unknown_model: Counter,
    /// 1 when the NATS connection is up.
    pub nats_connected: Gauge,
    /// Chat messages that arrived elided.
    pub elided_segments: Counter,
    /// Picks answered `resend`.
    pub pick_resends: Counter,
    /// Prompts that could not be tokenized (routed by load).
    pub tokenize_errors: Counter,
    /// Picks routed by load because the event stream was behind.
    pub picks_shed: Counter,
    /// Snapshot requests sent to relays.
    pub snapshot_requests: Counter,
    /// Snapshot requests that failed or timed out.
    pub snapshot_failures: Counter,
    /// Replica-sync batches published.
    pub inflight_published: Counter,
    /// Replica-sync batches that could not be published.
    pub inflight_publish_errors: Counter,
}

impl Global {
    fn new() -> Self {
        Self {
            pick_seconds: Family::new_with_constructor(latency),
            overlap_ratio: Family::new_with_constructor(ratio),
            event_lag_seconds: Family::new_with_constructor(lag),
            ingest_hold_seconds: Family::new_with_constructor(latency),
            stream_delay_seconds: Family::default(),
            decisions: Family::default(),
            pick_errors: Family::default(),
            nats_messages: Family::default(),
            nats_malformed: Family::default(),
            nats_unknown_model: Counter::default(),
            nats_connected: Gauge::default(),
            elided_segments: Counter::default(),
            pick_resends: Counter::default(),
            tokenize_errors: Counter::default(),
            picks_shed: Counter::default(),
            snapshot_requests: Counter::default(),
            snapshot_failures: Counter::default(),
            inflight_published: Counter::default(),
            inflight_publish_errors: Counter::default(),
        }
    }

    /// Every family with its name and help; destructured without `..`.
    fn register(&self, r: &mut Registry) {
        let Self {
            pick_seconds,
            overlap_ratio,
            event_lag_seconds,
            ingest_hold_seconds,
            stream_delay_seconds,
            decisions,
            pick_errors,
            nats_messages,
            nats_malformed,
            nats_unknown_model,
            nats_connected,
            elided_segments,
            pick_resends,
            tokenize_errors,
            picks_shed,
            snapshot_requests,
            snapshot_failures,
            inflight_published,
            inflight_publish_errors,
        } = self.clone();
        r.register("kvgate_pick_duration_seconds", "Pick latency, receipt to answer.", pick_seconds);
        r.register(
            "kvgate_pick_overlap_ratio",
            "Predicted cached prompt blocks / prompt blocks of the chosen worker.",
            overlap_ratio,
        );
        r.register(
            "kvgate_event_lag_seconds",
            "Engine timestamp of a KV event batch to its application in the index (clocks of the engine's and this host).",
            event_lag_seconds,
        );
        r.register(
            "kvgate_ingest_lock_hold_seconds",
            "How long one application of KV event batches held the model's index for writing (Picks wait meanwhile to look their prompt up).",
            ingest_hold_seconds,
        );
        r.register(
            "kvgate_event_stream_delay_seconds",
            "How much later than it could have been the event stream is processed: the least heartbeat delay (processing - send, each relay's clock offset learned) of the last second.",
            stream_delay_seconds,
        );
        r.register("kvgate_pick_decisions", "Answered picks by mode and reason.", decisions);
        r.register("kvgate_pick_errors", "Picks refused, by cause.", pick_errors);
        r.register("kvgate_nats_messages", "NATS messages received, by kind.", nats_messages);
        r.register("kvgate_nats_malformed", "NATS messages rejected as malformed, by kind.", nats_malformed);
        r.register("kvgate_nats_unknown_model", "NATS messages for models not served here.", nats_unknown_model);
        r.register("kvgate_nats_connected", "1 when the NATS connection is up.", nats_connected);
        r.register(
            "kvgate_pick_elided_messages",
            "Chat messages whose bytes the filter left out because this replica retains them.",
            elided_segments,
        );
        r.register(
            "kvgate_pick_resends",
            "Picks answered resend: the filter elided messages this replica does not hold.",
            pick_resends,
        );
        r.register("kvgate_tokenize_errors", "Prompts that could not be tokenized (routed by load).", tokenize_errors);
        r.register(
            "kvgate_picks_shed",
            "Picks routed by load, unscored, because the event stream was processed ingest_shed_after_ms or more behind.",
            picks_shed,
        );
        r.register("kvgate_snapshot_requests", "Snapshot requests sent to relays.", snapshot_requests);
        r.register("kvgate_snapshot_failures", "Snapshot requests that failed or timed out.", snapshot_failures);
        r.register("kvgate_inflight_published", "Replica-sync batches published.", inflight_published);
        r.register(
            "kvgate_inflight_publish_errors",
            "Replica-sync batches that could not be published.",
            inflight_publish_errors,
        );
    }

    /// Counts a refused pick.
    pub fn pick_error(&self, cause: PickErrorCause) {
        self.pick_errors.get_or_create(&CauseLabel { cause }).inc();
    }

    /// Counts a NATS message (malformed or not).
    pub fn nats(&self, kind: NatsKind, malformed: bool) {
        let f = if malformed { &self.nats_malformed } else { &self.nats_messages };
        f.get_or_create(&KindLabel { kind }).inc();
    }
}

/// The process's registry and the families of the request paths.
#[derive(Debug)]
pub struct Metrics {
    registry: Mutex<Registry>,
    /// The request paths' families.
    pub global: Global,
}

impl Default for Metrics {
    fn default() -> Self {
        let global = Global::new();
        let mut registry = Registry::default();
        global.register(&mut registry);
        for kind in NatsKind::ALL {
            drop(global.nats_messages.get_or_create(&KindLabel { kind: *kind }));
            drop(global.nats_malformed.get_or_create(&KindLabel { kind: *kind }));
        }
        for cause in PickErrorCause::ALL {
            drop(global.pick_errors.get_or_create(&CauseLabel { cause: *cause }));
        }
        Self { registry: Mutex::new(registry), global }
    }
}

impl Metrics {
    /// Registers an adapter's metric (a family, counter or gauge).
    pub fn register(&self, name: &str, help: &str, metric: impl Metric) {
        self.registry.lock().register(name, help, metric);
    }

    /// Registers a scrape-time collector.
    pub fn register_collector(&self, c: Box<dyn prometheus_client::collector::Collector>) {
        self.registry.lock().register_collector(c);
    }

    /// The OpenMetrics text of everything registered.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 << 10);
        if prometheus_client::encoding::text::encode(&mut out, &self.registry.lock()).is_err() {
            out.clear();
            let _ = writeln!(out, "# metrics could not be encoded");
        }
        out
    }
}
