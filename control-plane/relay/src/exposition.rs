//! The relay's own metrics, through `prometheus-client` (OpenMetrics text).

use std::borrow::Cow;

use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
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

/// Renders every counter and gauge, labelled with the worker and model,
/// through `prometheus-client` (OpenMetrics text). Both structs are
/// destructured without `..`: a field added to either does not compile
/// until it is exported here.
pub fn render(c: &RelayCounters, g: &RelayGauges, worker: &str, model: &str) -> String {
    let labels = [("worker", worker.to_owned()), ("model", model.to_owned())]
        .into_iter()
        .map(|(k, v)| (Cow::Borrowed(k), Cow::Owned(v)));
    let mut r = Registry::with_prefix_and_labels("kvgate_relay", labels);
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
        engine_health,
        publish_errors,
        publish_dropped,
        publish_queued,
    } = *g;
    let mut counter = |name: &str, help: &str, v: u64| r.register(name, help, ConstCounter::new(v));
    counter("messages", "Live ZMQ messages received.", messages);
    counter("batches_published", "Batches published on NATS.", published);
    counter("blocks_stored", "Stored blocks published.", blocks_stored);
    counter("blocks_removed", "Removed blocks published.", blocks_removed);
    counter("decode_errors_msgpack", "Messages that were not valid msgpack.", decode_errors_msgpack);
    counter("decode_errors_shape", "Messages that were msgpack but not a vLLM batch.", decode_errors_shape);
    counter("decode_errors_frames", "Messages without the three expected frames.", decode_errors_frames);
    counter("gaps", "Gaps in the engine sequence.", gaps);
    counter("restarts", "Engine restarts (sequence back to 0).", restarts);
    counter("duplicates", "Batches received twice (replayed and live, or the same bytes again), dropped.", duplicates);
    counter("engine_downs", "Times the engine was confirmed down (mirror cleared).", engine_downs);
    counter("split_batches", "Extra batches from splitting batches over the size limit.", split_batches);
    counter("health_failures", "Failed health probes of the engine.", health_failures);
    counter("publish_errors", "NATS publishes that failed after retries (dropped).", publish_errors);
    counter("publish_dropped", "Messages dropped because the outgoing queue was full.", publish_dropped);
    counter("replays", "Replays requested from the engine.", replays);
    counter("resyncs", "Clear-and-resyncs of the worker.", resyncs);
    counter("orphan_stores", "Stored chains whose parent was unknown (not published).", orphan_stores);
    counter("unknown_removals", "Removals of unknown blocks (not published).", unknown_removals);
    counter("non_indexable", "Stores of sliding-window or mamba groups skipped.", non_indexable);
    counter("unknown_events", "Events of unknown types skipped.", unknown_events);
    counter("malformed_stores", "Stores with a token count that is not blocks x block size.", malformed_stores);
    counter("scrape_failures", "Failed scrapes of the engine's /metrics.", scrape_failures);
    let mut gauge = |name: &str, help: &str, v: i64| r.register(name, help, ConstGauge::new(v));
    let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    gauge("mirror_blocks", "Blocks in the mirror of the engine's cache.", int(mirror_blocks as u64));
    gauge("relay_seq", "Sequence number of the last published batch.", int(relay_seq));
    gauge("engine_generation", "Engine restarts seen by this relay.", i64::from(engine_generation));
    gauge("nats_connected", "1 when the NATS connection is up.", i64::from(nats_connected));
    gauge("engine_health", "The engine's health: 0 unknown, 1 healthy, 2 unhealthy, 3 down.", i64::from(engine_health));
    gauge("publish_queued", "Messages waiting to be published on NATS.", int(publish_queued as u64));
    r.register("lag_seconds", "Engine timestamp to publication, last batch.", ConstGauge::new(lag_seconds));
    let mut out = String::with_capacity(8192);
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
        let text = render(&c, &g, "10.0.0.7:8000", "meta-llama/\"x\"");
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
}
