//! The relay's own metrics, through `prometheus-client` (OpenMetrics text).

use prometheus_client::registry::Registry;

use crate::core::RelayCounters;

/// Gauges sampled when the metrics are rendered.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RelayGauges {
    /// Blocks in the mirror.
    pub mirror_blocks: usize,
    /// `relay_seq` of the last published batch.
    pub relay_seq: u64,
    /// Engine restarts seen.
    pub engine_generation: u32,
    /// Seconds between the last batch's engine timestamp and its publication.
    pub lag_seconds: f64,
    /// Whether the NATS connection is up.
    pub nats_connected: bool,
    /// Heartbeat scrapes of the engine's /metrics that failed.
    pub scrape_failures: u64,
    /// Health probes of the engine that failed.
    pub health_failures: u64,
    /// Health probes unanswered for the overdue time (the engine was marked
    /// unhealthy until one answered).
    pub health_overdue: u64,
    /// Seconds the last health probe took (answered or not).
    pub health_probe_seconds: f64,
    /// The engine's health (0 unknown, 1 healthy, 2 unhealthy, 3 down).
    pub engine_health: u8,
    /// NATS publishes that failed (after retries) and were dropped.
    pub publish_errors: u64,
    /// Messages dropped because the outgoing queue was full (NATS down for
    /// long): consumers see a gap in `relay_seq` and ask for a snapshot.
    pub publish_dropped: u64,
    /// Messages waiting in the outgoing queue.
    pub publish_queued: usize,
}

/// One rank's (or the whole server's) metrics, as the listener renders them.
#[derive(Debug, Clone)]
pub struct RankMetrics {
    /// The core's counters.
    pub counters: RelayCounters,
    /// The loop's gauges.
    pub gauges: RelayGauges,
    /// The worker id (the `worker` label).
    pub worker: String,
}

/// A sample's kind and value.
#[derive(Debug, Clone, Copy)]
enum Value {
    Counter(u64),
    Gauge(i64),
    Ratio(f64),
}

/// Every metric of one rank: (name, help, value). Both structs are
/// destructured without `..`: a field added to either does not compile
/// until it is exported here.
fn samples(c: &RelayCounters, g: &RelayGauges) -> Vec<(&'static str, &'static str, Value)> {
    let RelayCounters {
        messages,
        published,
        blocks_stored,
        blocks_removed,
        decode_errors_msgpack,
        decode_errors_shape,
        decode_errors_frames,
        gaps,
        restarts,
        duplicates,
        replays,
        resyncs,
        orphan_stores,
        unknown_removals,
        non_indexable,
        unknown_events,
        malformed_stores,
        engine_downs,
        split_batches,
    } = *c;
    let RelayGauges {
        mirror_blocks,
        relay_seq,
        engine_generation,
        lag_seconds,
        nats_connected,
        scrape_failures,
        health_failures,
        health_overdue,
        health_probe_seconds,
        engine_health,
        publish_errors,
        publish_dropped,
        publish_queued,
    } = *g;
    let int = |v: u64| Value::Gauge(i64::try_from(v).unwrap_or(i64::MAX));
    use Value::Counter as C;
    vec![
        ("messages", "Live ZMQ messages received.", C(messages)),
        ("batches_published", "Batches published on NATS.", C(published)),
        ("blocks_stored", "Stored blocks published.", C(blocks_stored)),
        ("blocks_removed", "Removed blocks published.", C(blocks_removed)),
        ("decode_errors_msgpack", "Messages that were not valid msgpack.", C(decode_errors_msgpack)),
        ("decode_errors_shape", "Messages that were msgpack but not a vLLM batch.", C(decode_errors_shape)),
        ("decode_errors_frames", "Messages without the three expected frames.", C(decode_errors_frames)),
        ("gaps", "Gaps in the engine sequence.", C(gaps)),
        ("restarts", "Engine restarts (sequence back to 0).", C(restarts)),
        ("duplicates", "Batches received twice (replayed and live, or the same bytes again), dropped.", C(duplicates)),
        ("engine_downs", "Times the engine was confirmed down (mirror cleared).", C(engine_downs)),
        ("split_batches", "Extra batches from splitting batches over the size limit.", C(split_batches)),
        ("health_failures", "Failed health probes of the engine.", C(health_failures)),
        (
            "health_overdue",
            "Health probes unanswered after --health-overdue-ms (the engine was unhealthy until one answered).",
            C(health_overdue),
        ),
        ("publish_errors", "NATS publishes that failed after retries (dropped).", C(publish_errors)),
        ("publish_dropped", "Messages dropped because the outgoing queue was full.", C(publish_dropped)),
        ("replays", "Replays requested from the engine.", C(replays)),
        ("resyncs", "Clear-and-resyncs of the worker.", C(resyncs)),
        ("orphan_stores", "Stored chains whose parent was unknown (not published).", C(orphan_stores)),
        ("unknown_removals", "Removals of unknown blocks (not published).", C(unknown_removals)),
        ("non_indexable", "Stores of sliding-window or mamba groups skipped.", C(non_indexable)),
        ("unknown_events", "Events of unknown types skipped.", C(unknown_events)),
        ("malformed_stores", "Stores with a token count that is not blocks x block size.", C(malformed_stores)),
        ("scrape_failures", "Failed scrapes of the engine's /metrics.", C(scrape_failures)),
        ("mirror_blocks", "Blocks in the mirror of the engine's cache.", int(mirror_blocks as u64)),
        ("relay_seq", "Sequence number of the last published batch.", int(relay_seq)),
        ("engine_generation", "Engine restarts seen by this relay.", Value::Gauge(i64::from(engine_generation))),
        ("nats_connected", "1 when the NATS connection is up.", Value::Gauge(i64::from(nats_connected))),
        (
            "engine_health",
            "The engine's health: 0 unknown, 1 healthy, 2 unhealthy, 3 down.",
            Value::Gauge(i64::from(engine_health)),
        ),
        ("publish_queued", "Messages waiting to be published on NATS.", int(publish_queued as u64)),
        ("lag_seconds", "Engine timestamp to publication, last batch.", Value::Ratio(lag_seconds)),
        (
            "health_probe_seconds",
            "Time the last health probe took (answered or not).",
            Value::Ratio(health_probe_seconds),
        ),
    ]
}

type Labels = Vec<(String, String)>;

/// Registers one family: a sample per rank, each set by `set` from its value.
fn family<'a, M>(
    r: &mut Registry,
    name: &str,
    help: &str,
    values: impl Iterator<Item = (&'a Labels, Value)>,
    set: impl Fn(&M, Value),
) where
    M: prometheus_client::metrics::TypedMetric
        + prometheus_client::encoding::EncodeMetric
        + Default
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let f = prometheus_client::metrics::family::Family::<Labels, M>::default();
    for (l, v) in values {
        set(&f.get_or_create(l), v);
    }
    r.register(name, help, f);
}

/// Renders every counter and gauge of every rank, labelled with the worker
/// and model, through `prometheus-client` (OpenMetrics text): one family
/// per metric, one sample per rank.
pub fn render(ranks: &[RankMetrics], model: &str) -> String {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use std::sync::atomic::AtomicU64;
    let mut r = Registry::with_prefix("kvgate_relay");
    let per_rank: Vec<(Labels, Vec<_>)> = ranks
        .iter()
        .map(|m| {
            let labels = vec![("worker".to_owned(), m.worker.clone()), ("model".to_owned(), model.to_owned())];
            (labels, samples(&m.counters, &m.gauges))
        })
        .collect();
    let names = samples(&RelayCounters::default(), &RelayGauges::default());
    for (i, (name, help, kind)) in names.into_iter().enumerate() {
        let values = per_rank.iter().map(|(l, s)| (l, s[i].2));
        match kind {
            Value::Counter(_) => family(&mut r, name, help, values, |c: &Counter, v| {
                if let Value::Counter(v) = v {
                    c.inc_by(v);
                }
            }),
            Value::Gauge(_) => family(&mut r, name, help, values, |g: &Gauge, v| {
                if let Value::Gauge(v) = v {
                    g.set(v);
                }
            }),
            Value::Ratio(_) => family(&mut r, name, help, values, |g: &Gauge<f64, AtomicU64>, v| {
                if let Value::Ratio(v) = v {
                    g.set(v);
                }
            }),
        }
    }
    let mut out = String::with_capacity(8192 * ranks.len().max(1));
    if prometheus_client::encoding::text::encode(&mut out, &r).is_err() {
        out = "# metrics could not be encoded\n".into();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_gauges() {
        let c = RelayCounters { messages: 5, gaps: 1, decode_errors_shape: 2, ..Default::default() };
        let g = RelayGauges { mirror_blocks: 7, nats_connected: true, ..Default::default() };
        let one = RankMetrics { counters: c, gauges: g, worker: "10.0.0.7:8000".into() };
        let text = render(std::slice::from_ref(&one), "meta-llama/\"x\"");
        assert!(
            text.contains("kvgate_relay_messages_total{worker=\"10.0.0.7:8000\",model=\"meta-llama/\\\"x\\\"\"} 5")
        );
        assert!(text.contains("kvgate_relay_gaps_total{") && text.contains("} 1\n"));
        assert!(text.contains("# TYPE kvgate_relay_mirror_blocks gauge"));
        assert!(
            text.contains("kvgate_relay_nats_connected{worker=\"10.0.0.7:8000\",model=\"meta-llama/\\\"x\\\"\"} 1")
        );
        assert!(text.ends_with("# EOF\n"));
        // Every sample line is "name{labels} value".
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            assert!(l.split_once("} ").is_some_and(|(_, v)| v.parse::<f64>().is_ok()), "{l}");
        }
    }

    #[test]
    fn ranks_share_one_family_per_metric() {
        let rank = |w: &str, m| RankMetrics {
            counters: RelayCounters { messages: m, ..Default::default() },
            gauges: RelayGauges::default(),
            worker: w.into(),
        };
        let text = render(&[rank("s:1/dp0", 3), rank("s:1/dp1", 4)], "m");
        assert_eq!(text.matches("# TYPE kvgate_relay_messages counter").count(), 1);
        assert!(text.contains("kvgate_relay_messages_total{worker=\"s:1/dp0\",model=\"m\"} 3"));
        assert!(text.contains("kvgate_relay_messages_total{worker=\"s:1/dp1\",model=\"m\"} 4"));
    }
}
