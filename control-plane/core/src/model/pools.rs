//! Scaling signals of each worker pool (role) of a model, for autoscalers
//! that scale prefill and decode pools on their own (the seed's Planner):
//!
//! - **prefill demand**: uncached prompt tokens routed to the pool for
//!   prefill per second (an exponentially weighted rate over ~10 s), against
//!   its capacity, the sum over its live workers of 1000 / the learned
//!   prefill ms per token (the prior until learned);
//! - **decode demand**: requests on the pool (routed or measured, whichever
//!   is larger) against the sum of its running limits, and its mean KV fill;
//! - **queueing**: requests waiting in its engines.
//!
//! A disaggregated request's prefill counts for the prefill pool, an
//! aggregated one's for the worker that prefills it.
//!
//! Cost: O(1) per pick; O(workers) per scrape.

use kvgate_protocol::pb;

use super::ModelState;
use super::workers::role_label;

/// Time constant of the prefill-demand rate, ms.
const RATE_TAU_MS: f64 = 10_000.0;

/// An exponentially weighted rate: events of size `n` at time `t` decay
/// with time constant [`RATE_TAU_MS`]; a steady rate `r` per second settles
/// at `r`.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct DecayingRate {
    mass: f64,
    at_ms: u64,
}

impl DecayingRate {
    fn decayed(&self, now_ms: u64) -> f64 {
        let dt = now_ms.saturating_sub(self.at_ms) as f64;
        self.mass * (-dt / RATE_TAU_MS).exp()
    }

    /// Adds `n` at `now_ms`.
    pub(super) fn add(&mut self, n: f64, now_ms: u64) {
        self.mass = self.decayed(now_ms) + n;
        self.at_ms = self.at_ms.max(now_ms);
    }

    /// Per second at `now_ms`.
    pub(super) fn per_second(&self, now_ms: u64) -> f64 {
        self.decayed(now_ms) / (RATE_TAU_MS / 1000.0)
    }
}

/// Index of a role in [`ModelState`]'s per-role rates.
pub(super) fn role_slot(r: pb::WorkerRole) -> usize {
    match r {
        pb::WorkerRole::Prefill => 0,
        pb::WorkerRole::Decode => 1,
        pb::WorkerRole::Both | pb::WorkerRole::Unspecified => 2,
    }
}

const ROLES: [pb::WorkerRole; 3] = [pb::WorkerRole::Prefill, pb::WorkerRole::Decode, pb::WorkerRole::Both];

/// The scaling signals of one pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSignals {
    /// `prefill`, `decode` or `both`.
    pub role: &'static str,
    /// Live workers.
    pub workers: u32,
    /// Uncached prompt tokens routed to the pool for prefill, per second.
    pub prefill_tokens_per_s: f64,
    /// What the pool prefills per second at its learned timing.
    pub prefill_capacity_tokens_per_s: f64,
    /// Requests on the pool's workers.
    pub requests: u32,
    /// Sum of their running limits (0 when unknown).
    pub max_running: u32,
    /// Mean KV fill of its workers, in [0, 1] (0 when unknown).
    pub kv_usage: f64,
    /// Requests waiting in its engines.
    pub waiting: u32,
}

impl PoolSignals {
    /// Prefill demand over capacity (0 without capacity).
    pub fn prefill_load(&self) -> f64 {
        if self.prefill_capacity_tokens_per_s > 0.0 {
            self.prefill_tokens_per_s / self.prefill_capacity_tokens_per_s
        } else {
            0.0
        }
    }

    /// Requests over running limits (0 when unknown).
    pub fn decode_load(&self) -> f64 {
        if self.max_running > 0 { f64::from(self.requests) / f64::from(self.max_running) } else { 0.0 }
    }
}

impl ModelState {
    /// `tokens` of prefill routed to a worker of `role`.
    pub(super) fn count_prefill(&mut self, role: pb::WorkerRole, tokens: u32, now_ms: u64) {
        self.prefill_rates[role_slot(role)].add(f64::from(tokens), now_ms);
    }

    /// The signals of every role that has a live worker.
    pub fn pool_signals(&self, now_ms: u64) -> Vec<PoolSignals> {
        let prior = self.config.kv.prefill_ms_per_token;
        ROLES
            .iter()
            .filter_map(|role| {
                let live: Vec<_> = self.workers.values().filter(|w| w.role == *role && self.live(w, now_ms)).collect();
                if live.is_empty() {
                    return None;
                }
                let mut s = PoolSignals {
                    role: role_label(*role),
                    workers: live.len() as u32,
                    prefill_tokens_per_s: self.prefill_rates[role_slot(*role)].per_second(now_ms),
                    prefill_capacity_tokens_per_s: 0.0,
                    requests: 0,
                    max_running: 0,
                    kv_usage: 0.0,
                    waiting: 0,
                };
                for w in &live {
                    let ms = self.calibration.timing(w.idx).map_or(prior, |t| t.prefill_ms_per_token);
                    if ms > 0.0 {
                        s.prefill_capacity_tokens_per_s += 1000.0 / ms;
                    }
                    let load = self.tracker.load(w.idx);
                    s.requests += load.effective_requests();
                    s.max_running += load.max_running.unwrap_or(0);
                    s.waiting += load.measured_waiting.unwrap_or(0);
                    s.kv_usage += load.kv_fill().unwrap_or(0.0);
                }
                s.kv_usage /= live.len() as f64;
                Some(s)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_steady_rate_settles_at_its_value_and_fades_when_it_stops() {
        let mut r = DecayingRate::default();
        // 1,000 tokens every 100 ms = 10,000 tokens/s, for a minute.
        for t in (0..60_000).step_by(100) {
            r.add(1000.0, t);
        }
        let at = r.per_second(60_000);
        assert!((at - 10_000.0).abs() / 10_000.0 < 0.06, "{at}");
        // Ten time constants later: nothing.
        assert!(r.per_second(160_000) < 1.0);
    }
}
