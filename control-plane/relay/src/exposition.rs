//! The relay's own Prometheus metrics (text exposition format 0.0.4).

use std::fmt::Write;

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

/// Renders every counter and gauge, labelled with the worker and model.
pub fn render(c: &RelayCounters, g: &RelayGauges, worker: &str, model: &str) -> String {
    let mut out = String::with_capacity(4096);
    let esc = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
    let labels = format!("worker=\"{}\",model=\"{}\"", esc(worker), esc(model));
    let mut counter = |name: &str, help: &str, extra: &str, v: u64| {
        let _ = writeln!(out, "# HELP kvgate_relay_{name} {help}\n# TYPE kvgate_relay_{name} counter");
        let _ = writeln!(out, "kvgate_relay_{name}{{{labels}{extra}}} {v}");
    };
    counter("messages_total", "Live ZMQ messages received.", "", c.messages);
    counter("batches_published_total", "Batches published on NATS.", "", c.published);
    counter("blocks_stored_total", "Stored blocks published.", "", c.blocks_stored);
    counter("blocks_removed_total", "Removed blocks published.", "", c.blocks_removed);
    counter("decode_errors_msgpack_total", "Messages that were not valid msgpack.", "", c.decode_errors_msgpack);
    counter("decode_errors_shape_total", "Messages that were msgpack but not a vLLM batch.", "", c.decode_errors_shape);
    counter("decode_errors_frames_total", "Messages without the three expected frames.", "", c.decode_errors_frames);
    counter("gaps_total", "Gaps in the engine sequence.", "", c.gaps);
    counter("restarts_total", "Engine restarts (sequence back to 0).", "", c.restarts);
    counter(
        "duplicates_total",
        "Batches received twice (replayed and live, or the same bytes again), dropped.",
        "",
        c.duplicates,
    );
    counter("engine_downs_total", "Times the engine was confirmed down (mirror cleared).", "", c.engine_downs);
    counter("split_batches_total", "Extra batches from splitting batches over the size limit.", "", c.split_batches);
    counter("health_failures_total", "Failed health probes of the engine.", "", g.health_failures);
    counter("publish_errors_total", "NATS publishes that failed after retries (dropped).", "", g.publish_errors);
    counter("publish_dropped_total", "Messages dropped because the outgoing queue was full.", "", g.publish_dropped);
    counter("replays_total", "Replays requested from the engine.", "", c.replays);
    counter("resyncs_total", "Clear-and-resyncs of the worker.", "", c.resyncs);
    counter("orphan_stores_total", "Stored chains whose parent was unknown (not published).", "", c.orphan_stores);
    counter("unknown_removals_total", "Removals of unknown blocks (not published).", "", c.unknown_removals);
    counter("non_indexable_total", "Stores of sliding-window or mamba groups skipped.", "", c.non_indexable);
    counter("unknown_events_total", "Events of unknown types skipped.", "", c.unknown_events);
    counter(
        "malformed_stores_total",
        "Stores with a token count that is not blocks x block size.",
        "",
        c.malformed_stores,
    );
    counter("scrape_failures_total", "Failed scrapes of the engine's /metrics.", "", g.scrape_failures);
    let mut gauge = |name: &str, help: &str, v: f64| {
        let _ = writeln!(out, "# HELP kvgate_relay_{name} {help}\n# TYPE kvgate_relay_{name} gauge");
        let _ = writeln!(out, "kvgate_relay_{name}{{{labels}}} {v}");
    };
    gauge("mirror_blocks", "Blocks in the mirror of the engine's cache.", g.mirror_blocks as f64);
    gauge("relay_seq", "Sequence number of the last published batch.", g.relay_seq as f64);
    gauge("engine_generation", "Engine restarts seen by this relay.", f64::from(g.engine_generation));
    gauge("lag_seconds", "Engine timestamp to publication, last batch.", g.lag_seconds);
    gauge("nats_connected", "1 when the NATS connection is up.", if g.nats_connected { 1.0 } else { 0.0 });
    gauge(
        "engine_health",
        "The engine's health: 0 unknown, 1 healthy, 2 unhealthy, 3 down.",
        f64::from(g.engine_health),
    );
    gauge("publish_queued", "Messages waiting to be published on NATS.", g.publish_queued as f64);
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
        // Every sample line is "name{labels} value".
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            assert!(l.split_once("} ").is_some_and(|(_, v)| v.parse::<f64>().is_ok()), "{l}");
        }
    }
}
