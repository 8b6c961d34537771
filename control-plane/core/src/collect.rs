//! The scrape-time collector: what the model states and tokenizers hold
//! (index size, workers, stream events, report accuracy, tokenizer cache),
//! read under each model's lock once per scrape and written as OpenMetrics
//! families. Every counter struct is listed by a function that destructures
//! it without `..` ([`ModelCounters::by_kind`], the index's
//! `Counters::by_kind`, `TokenStats::counters`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::model::counters::{Family as CounterFamily, ModelCounters};
use crate::served::Model;

type Labels = Vec<(&'static str, String)>;

/// A sample's value.
#[derive(Clone, Copy)]
enum Value {
    Int(i64),
    Float(f64),
}

/// Samples of one family, gathered before encoding.
struct Rows {
    help: &'static str,
    kind: MetricType,
    rows: Vec<(Labels, Value)>,
}

#[derive(Default)]
struct Sheet(BTreeMap<String, Rows>);

impl Sheet {
    fn add(&mut self, name: &str, help: &'static str, kind: MetricType, labels: Labels, v: Value) {
        let rows = self.0.entry(name.to_owned()).or_insert_with(|| Rows { help, kind, rows: Vec::new() });
        rows.rows.push((labels, v));
    }

    fn int(v: u64) -> Value {
        Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }

    fn counter(&mut self, name: &str, help: &'static str, labels: Labels, v: u64) {
        self.add(name, help, MetricType::Counter, labels, Self::int(v));
    }

    fn gauge(&mut self, name: &str, help: &'static str, labels: Labels, v: u64) {
        self.add(name, help, MetricType::Gauge, labels, Self::int(v));
    }

    fn gauge_f64(&mut self, name: &str, help: &'static str, labels: Labels, v: f64) {
        self.add(name, help, MetricType::Gauge, labels, Value::Float(if v.is_finite() { v } else { 0.0 }));
    }

    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        for (name, f) in &self.0 {
            let mut me = encoder.encode_descriptor(name, f.help, None, f.kind)?;
            for (labels, v) in &f.rows {
                let sample = me.encode_family(labels)?;
                match (f.kind, *v) {
                    (MetricType::Counter, Value::Int(v)) => ConstCounter::new(v.unsigned_abs()).encode(sample)?,
                    (_, Value::Int(v)) => ConstGauge::new(v).encode(sample)?,
                    (_, Value::Float(v)) => ConstGauge::new(v).encode(sample)?,
                }
            }
        }
        Ok(())
    }
}

/// Reads every model at scrape time.
#[derive(Debug)]
pub struct ModelCollector {
    models: Vec<Arc<Model>>,
    start: Instant,
}

impl ModelCollector {
    /// A collector of these models; `start` is the app's monotonic origin.
    pub fn new(mut models: Vec<Arc<Model>>, start: Instant) -> Self {
        models.sort_by(|a, b| a.name.cmp(&b.name));
        Self { models, start }
    }
}

impl Collector for ModelCollector {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let now = self.start.elapsed().as_millis() as u64;
        let mut sheet = Sheet::default();
        for m in &self.models {
            model_rows(&mut sheet, m, now);
            tokenizer_rows(&mut sheet, m);
        }
        sheet.encode(encoder)
    }
}

fn model_rows(s: &mut Sheet, m: &Model, now: u64) {
    let l = |extra: &[(&'static str, &str)]| -> Labels {
        std::iter::once(("model", m.name.clone())).chain(extra.iter().map(|(k, v)| (*k, (*v).to_owned()))).collect()
    };
    let st = m.state.lock();
    let c = st.index().counters();
    s.counter("kvgate_events_applied", "KV events applied to the index.", l(&[]), c.events_applied);
    for (cause, n) in st.skips() {
        s.counter("kvgate_events_skipped", "KV events skipped, by cause.", l(&[("cause", cause)]), n);
    }
    for (kind, n) in c.by_kind() {
        s.counter("kvgate_index_events", "Index changes and anomalies, by kind.", l(&[("kind", kind)]), n);
    }
    counter_rows(s, st.counters(), &l);
    timing_rows(s, st.calibration(), &l);
    fading_rows(s, st.persistence(), &l);
    for (tier, t) in [("device", kvgate_index::Tier::Device), ("host", kvgate_index::Tier::Host)] {
        let n = st.index().distinct_blocks(t) as u64;
        s.gauge("kvgate_index_blocks", "Distinct blocks in the index, by tier.", l(&[("tier", tier)]), n);
    }
    if let Some((held, c)) = st.admission() {
        s.gauge("kvgate_admission_queued", "Requests held while every worker is saturated.", l(&[]), held as u64);
        let help = "Requests of the admission queue by outcome (held, released, expired = 429 at the deadline, refused = 429 queue full).";
        for (outcome, n) in [("held", c.held), ("released", c.released), ("expired", c.expired), ("refused", c.refused)]
        {
            s.counter("kvgate_admission", help, l(&[("outcome", outcome)]), n);
        }
    }
    for (state, n) in st.stream_states() {
        let help = "Workers by the state of their KV event stream: synced, snapshotting (a snapshot asked for or being applied), unknown (the next message decides), static (configured, no relay).";
        s.gauge("kvgate_worker_streams", help, l(&[("state", state)]), n);
    }
    let (pinned, refused) = st.sessions();
    s.gauge("kvgate_sessions", "Sessions pinned to a worker (session affinity).", l(&[]), pinned as u64);
    s.counter("kvgate_sessions_refused", "Sessions not pinned because the table was full.", l(&[]), refused);
    let heap = st.index().approx_heap_bytes() as u64;
    s.gauge("kvgate_index_heap_bytes", "Approximate heap bytes of the index.", l(&[]), heap);
    for mode in kvgate_scheduler::Mode::ALL {
        let on = u64::from(mode == st.mode());
        s.gauge("kvgate_mode", "1 for the current routing mode of the model.", l(&[("mode", mode.name())]), on);
    }
    for p in st.pool_signals(now) {
        let pl = l(&[("role", p.role)]);
        s.gauge("kvgate_pool_workers", "Live workers of the pool (role).", pl.clone(), p.workers.into());
        let help = "Uncached prompt tokens routed to the pool for prefill per second (10 s exponential average).";
        s.gauge_f64("kvgate_pool_prefill_demand_tokens_per_second", help, pl.clone(), p.prefill_tokens_per_s);
        let help = "Prompt tokens the pool prefills per second at its learned engine timing.";
        s.gauge_f64(
            "kvgate_pool_prefill_capacity_tokens_per_second",
            help,
            pl.clone(),
            p.prefill_capacity_tokens_per_s,
        );
        let help = "Prefill demand over capacity: scale the pool out above ~0.8.";
        s.gauge_f64("kvgate_pool_prefill_load", help, pl.clone(), p.prefill_load());
        let help = "Requests on the pool over its running limits (max_num_seqs): scale out above ~0.8.";
        s.gauge_f64("kvgate_pool_decode_load", help, pl.clone(), p.decode_load());
        s.gauge_f64("kvgate_pool_kv_usage", "Mean KV cache fill of the pool's workers.", pl.clone(), p.kv_usage);
        s.gauge("kvgate_pool_waiting", "Requests waiting in the pool's engines.", pl, p.waiting.into());
    }
    for w in st.worker_views(now) {
        let wl = |extra: &[(&'static str, &str)]| {
            let mut v = l(&[("worker", &w.id)]);
            v.extend(extra.iter().map(|(k, x)| (*k, (*x).to_owned())));
            v
        };
        s.gauge("kvgate_worker_up", "1 when the worker is routable.", wl(&[]), u64::from(w.live));
        let health = wl(&[("health", w.engine_health)]);
        s.gauge("kvgate_worker_engine_health", "The engine's health as its relay probes it.", health, 1);
        let inflight = u64::from(w.inflight);
        s.gauge("kvgate_worker_inflight", "Requests in flight on the worker (all replicas).", wl(&[]), inflight);
        let help = "Prompt blocks of the worker's requests in flight before their first token.";
        s.gauge("kvgate_worker_prefilling_blocks", help, wl(&[]), w.prefilling_blocks);
        s.gauge("kvgate_worker_blocks", "Device blocks indexed for the worker.", wl(&[]), w.device_blocks as u64);
        if let Some(f) = w.kv_fill {
            let help = "KV fill the cost sees: active blocks (predicted or measured, the larger) over the capacity.";
            s.gauge_f64("kvgate_worker_kv_fill", help, wl(&[]), f);
        }
        if let Some(r) = w.running {
            s.gauge("kvgate_worker_running", "vllm:num_requests_running at the last heartbeat.", wl(&[]), r.into());
        }
        if let Some(r) = w.waiting {
            s.gauge("kvgate_worker_waiting", "vllm:num_requests_waiting at the last heartbeat.", wl(&[]), r.into());
        }
    }
}

/// Labels of a model's sample: `model` then these.
type LabelsOf<'a> = &'a dyn Fn(&[(&'static str, &str)]) -> Labels;

fn counter_rows(s: &mut Sheet, mc: &ModelCounters, l: LabelsOf<'_>) {
    for (family, label, v) in mc.by_kind() {
        let (name, help, key) = match family {
            CounterFamily::Batches => ("kvgate_batches", "KV event batches by outcome.", "outcome"),
            CounterFamily::EventsSkipped => ("kvgate_events_skipped", "KV events skipped, by cause.", "cause"),
            CounterFamily::ModelEvents => ("kvgate_model_events", "Stream events of the model, by kind.", "kind"),
            CounterFamily::Reports => (
                "kvgate_reports",
                "Completion reports: all, with cached_tokens, and within one block of the prediction.",
                "kind",
            ),
            CounterFamily::CachedTokens => (
                "kvgate_report_cached_tokens",
                "Cached prompt tokens: predicted at pick vs reported by the engine (usage.prompt_tokens_details.cached_tokens).",
                "source",
            ),
            CounterFamily::Disaggregation => (
                "kvgate_disaggregation",
                "Requests of a fleet with prefill workers: disaggregated, or aggregated below the threshold or for want of prefill capacity.",
                "outcome",
            ),
        };
        s.counter(name, help, l(&[(key, label)]), v);
    }
}

/// The learned engine timing: each fit's coefficients with their standard
/// errors and sample counts, and the values `kv` uses, per worker class.
fn timing_rows(s: &mut Sheet, c: &crate::timing::Calibration, l: LabelsOf<'_>) {
    for (kind, n) in c.counters().by_kind() {
        let help = "Requests by what the engine-timing fits took from them (first tokens learned, decodes learned, queued, unusable, mispredicted splits).";
        s.counter("kvgate_engine_timing_observations", help, l(&[("kind", kind)]), n);
    }
    for (class, fit) in c.classes() {
        let fits = [
            ("first_token", fit.first_token()),
            ("decode", fit.decode()),
            ("engine_prefill", fit.engine_prefill()),
            ("engine_matched", fit.engine_matched()),
        ];
        for (name, learned) in fits {
            let samples = l(&[("class", class), ("fit", name)]);
            let help = "Observations each fit ignored for non-finite values.";
            s.counter("kvgate_engine_timing_rejected", help, samples.clone(), learned.rejected);
            let help = "Changes of the engine each fit detected (runs of residuals of one sign); each forgets most of what it learned.";
            s.counter("kvgate_engine_timing_changes", help, samples.clone(), learned.changes);
            s.counter("kvgate_engine_timing_samples", "Observations each fit learned from.", samples, learned.samples);
            for p in learned.params {
                let labels = l(&[("class", class), ("fit", name), ("param", p.name)]);
                let help = "Learned engine timing coefficient (unit in its name).";
                s.gauge_f64("kvgate_engine_timing", help, labels.clone(), p.value);
                s.gauge_f64(
                    "kvgate_engine_timing_stderr",
                    "Standard error of the learned coefficient.",
                    labels,
                    p.stderr,
                );
            }
        }
        if let Some(ratio) = fit.clock_ratio() {
            let help = "Control-plane milliseconds per engine millisecond, from the two sides' inter-token times (about 1 for a real engine; a simulator's speed-up).";
            s.gauge_f64("kvgate_engine_timing_clock_ratio", help, l(&[("class", class)]), ratio);
        }
        if let Some(share) = fit.decode_share() {
            let help = "Share of the decode step at the operating point that one more running request adds, averaged over about the last thousand decodes; kv prices decode as the step now times it.";
            s.gauge_f64("kvgate_engine_timing_decode_share", help, l(&[("class", class)]), share);
        }
        for (param, v) in fit.timing().params() {
            let help = "Engine timing the kv policy uses for the class (learned, or the prior until trusted).";
            s.gauge_f64("kvgate_engine_timing_used", help, l(&[("class", class), ("param", param)]), v);
        }
    }
}

/// How fast load differences fade (`fading_load`), once measured.
fn fading_rows(s: &mut Sheet, p: &kvgate_scheduler::LoadPersistence, l: LabelsOf<'_>) {
    let rows = [
        (
            "kvgate_load_fade_life_ms",
            "Mean request life (routing to last token), ms, as the fading-load measure uses it.",
            p.life_ms(),
        ),
        (
            "kvgate_load_fade_decay_ms",
            "Decay time of a worker's difference in running requests from the fleet's mean, ms.",
            p.decay_ms(),
        ),
        (
            "kvgate_load_fade_factor",
            "Share of a load difference a request's decode lives with on average (1: all of it).",
            p.factor(),
        ),
    ];
    for (name, help, v) in rows {
        if let Some(v) = v {
            s.gauge_f64(name, help, l(&[]), v);
        }
    }
}

fn tokenizer_rows(s: &mut Sheet, m: &Model) {
    let Some(tk) = &m.tokenizer else { return };
    let l = || vec![("model", m.name.clone())];
    for (i, outcome) in ["full_hit", "partial_hit", "miss", "whole", "given"].iter().enumerate() {
        let n = tk.stats.outcomes[i].load(std::sync::atomic::Ordering::Relaxed);
        let mut labels = l();
        labels.push(("outcome", (*outcome).to_owned()));
        s.counter("kvgate_tokenize_requests", "Tokenizations by cache outcome.", labels, n);
    }
    for (name, help, v) in tk.stats.counters() {
        s.counter(&format!("kvgate_tokenize_{name}"), help, l(), v);
    }
    let held = tk.cache_size().0 as u64;
    s.gauge("kvgate_tokenize_cache_tokens", "Token ids held by the segment cache.", l(), held);
    s.gauge("kvgate_tokenize_segmented", "1 when the segment cache is in use.", l(), u64::from(tk.segmented()));
}
