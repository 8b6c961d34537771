//! The counters of one model's state, beyond the index's own. Plain
//! integers updated under the model's lock and exported at scrape time by
//! [`crate::collect`]; [`ModelCounters::by_kind`] destructures the struct
//! without `..`, so a counter added here does not compile until it has a
//! metric.

/// Counters of one model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelCounters {
    /// Batches applied.
    pub batches_applied: u64,
    /// Batches already applied (same or older `relay_seq`).
    pub batches_duplicate: u64,
    /// Batches held while a snapshot was under way.
    pub batches_buffered: u64,
    /// Batches dropped because the held batches overflowed (a snapshot is
    /// redone).
    pub batches_dropped: u64,
    /// Held batches dropped because the snapshot about to be asked for
    /// covers them (received before its request was sent).
    pub batches_covered: u64,
    /// Events that carried no event (protobuf `oneof` empty).
    pub events_empty: u64,
    /// Gaps in a worker's `relay_seq` that needed a snapshot.
    pub gaps: u64,
    /// Relay epochs that changed (relay restarts).
    pub epoch_changes: u64,
    /// Snapshots applied.
    pub snapshots_applied: u64,
    /// Snapshots that failed or timed out.
    pub snapshots_failed: u64,
    /// Snapshots left part-applied because a newer one, a failure or the
    /// worker's removal overtook them.
    pub snapshots_abandoned: u64,
    /// Heartbeats accepted.
    pub heartbeats: u64,
    /// Heartbeats whose load was out of range (NaN usage...).
    pub heartbeats_invalid: u64,
    /// Heartbeats announcing another block size than the model's.
    pub heartbeats_block_size_mismatch: u64,
    /// Workers removed because their heartbeats stopped.
    pub workers_expired: u64,
    /// In-flight events from other replicas applied.
    pub replica_events: u64,
    /// Replica events that did not fit the lifecycle (duplicate, unknown).
    pub replica_events_ignored: u64,
    /// Requests forgotten because their end was never reported.
    pub inflight_expired: u64,
    /// Completion reports accepted.
    pub reports: u64,
    /// Reports for requests this replica does not know (other replica, expired).
    pub reports_unknown: u64,
    /// Sum of predicted cached tokens over reports that had `cached_tokens`.
    pub predicted_cached_tokens: u64,
    /// Sum of reported `cached_tokens`.
    pub reported_cached_tokens: u64,
    /// Reports with `cached_tokens` within one block of the prediction.
    pub reports_accurate: u64,
    /// Reports with `cached_tokens`.
    pub reports_with_cached: u64,
    /// Reports saying the chosen worker could not be reached.
    pub connection_failures: u64,
    /// Times a worker became a suspect of failed connections.
    pub suspects: u64,
    /// Changes of a worker's engine health seen in heartbeats.
    pub health_changes: u64,
    /// Heartbeats and batches refused: the claimed endpoint is not in
    /// `allowed_endpoints`, or the worker never announced an allowed one.
    pub refused_endpoints: u64,
    /// Requests whose prefill went to a prefill worker.
    pub disaggregated: u64,
    /// Requests that stayed aggregated although prefill workers exist: the
    /// local prefill was below the threshold.
    pub below_threshold: u64,
    /// Requests that stayed aggregated because every prefill worker was
    /// saturated (or none was live).
    pub no_prefill_capacity: u64,
    /// Requests served whole by a prefill worker because the decode side
    /// was saturated (`overflow_to_prefill`).
    pub overflowed: u64,
}

/// Which metric family a counter belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `kvgate_batches_total{outcome}`.
    Batches,
    /// `kvgate_events_skipped_total{cause}`.
    EventsSkipped,
    /// `kvgate_model_events_total{kind}`.
    ModelEvents,
    /// `kvgate_reports_total{kind}`.
    Reports,
    /// `kvgate_report_cached_tokens_total{source}`.
    CachedTokens,
    /// `kvgate_disaggregation_total{outcome}`.
    Disaggregation,
}

impl ModelCounters {
    /// Every counter as (family, label value, value).
    pub fn by_kind(&self) -> [(Family, &'static str, u64); 32] {
        use Family::*;
        let Self {
            batches_applied,
            batches_duplicate,
            batches_buffered,
            batches_dropped,
            batches_covered,
            events_empty,
            gaps,
            epoch_changes,
            snapshots_applied,
            snapshots_failed,
            snapshots_abandoned,
            heartbeats,
            heartbeats_invalid,
            heartbeats_block_size_mismatch,
            workers_expired,
            replica_events,
            replica_events_ignored,
            inflight_expired,
            reports,
            reports_unknown,
            predicted_cached_tokens,
            reported_cached_tokens,
            reports_accurate,
            reports_with_cached,
            connection_failures,
            suspects,
            health_changes,
            refused_endpoints,
            disaggregated,
            below_threshold,
            no_prefill_capacity,
            overflowed,
        } = *self;
        [
            (Batches, "applied", batches_applied),
            (Batches, "duplicate", batches_duplicate),
            (Batches, "buffered", batches_buffered),
            (Batches, "dropped", batches_dropped),
            (Batches, "covered", batches_covered),
            (EventsSkipped, "empty", events_empty),
            (ModelEvents, "gap", gaps),
            (ModelEvents, "epoch_change", epoch_changes),
            (ModelEvents, "snapshot_applied", snapshots_applied),
            (ModelEvents, "snapshot_failed", snapshots_failed),
            (ModelEvents, "snapshot_abandoned", snapshots_abandoned),
            (ModelEvents, "heartbeat", heartbeats),
            (ModelEvents, "heartbeat_invalid", heartbeats_invalid),
            (ModelEvents, "heartbeat_block_size_mismatch", heartbeats_block_size_mismatch),
            (ModelEvents, "worker_expired", workers_expired),
            (ModelEvents, "replica_event", replica_events),
            (ModelEvents, "replica_event_ignored", replica_events_ignored),
            (ModelEvents, "inflight_expired", inflight_expired),
            (ModelEvents, "report_unknown", reports_unknown),
            (ModelEvents, "connection_failure", connection_failures),
            (ModelEvents, "suspect", suspects),
            (ModelEvents, "health_change", health_changes),
            (ModelEvents, "refused_endpoint", refused_endpoints),
            (Reports, "all", reports),
            (Reports, "with_cached", reports_with_cached),
            (Reports, "accurate", reports_accurate),
            (CachedTokens, "predicted", predicted_cached_tokens),
            (CachedTokens, "reported", reported_cached_tokens),
            (Disaggregation, "disaggregated", disaggregated),
            (Disaggregation, "below_threshold", below_threshold),
            (Disaggregation, "no_prefill_capacity", no_prefill_capacity),
            (Disaggregation, "overflow", overflowed),
        ]
    }
}
