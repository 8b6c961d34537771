//! `approx`: text-prefix affinity learned from the router's own decisions,
//! with no KV events and no tokenizer.
//!
//! # Algorithm
//!
//! Each request carries its chained segment hashes (one per chat message,
//! mixed with its tenant seed). After a decision, every prefix key of the
//! request is recorded as "on worker w, last used now". To pick, walk the keys
//! from the longest prefix down and take the first that maps to an eligible,
//! unsaturated worker. A cost rule as in `kv` applies: the learned worker wins
//! unless it is saturated. With no learned prefix, fall back to least load.
//! Entries expire after `ttl_ms` (the engine has likely evicted them), and the
//! table holds at most `max_entries` keys (oldest dropped first, in batches).
//!
//! # Complexity
//!
//! Pick: O(S + W log W) for S segments and W candidates. Observe: O(S).
//! Trimming: O(E log E) amortized over E/8 inserts.

use std::collections::HashMap;

use foldhash::fast::RandomState;
use kvgate_index::WorkerIdx;

use crate::least_load::LeastLoadPolicy;
use crate::policy::{Candidate, Decision, Policy, Reason, RequestView, eligible};

/// Settings of the `approx` policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApproxConfig {
    /// How long a learned prefix is trusted: 120 s, about how long vLLM keeps
    /// an unused prefix under steady load before evicting it.
    pub ttl_ms: u64,
    /// Most prefix keys kept: 1,000,000 (about 24 MB).
    pub max_entries: usize,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self { ttl_ms: 120_000, max_entries: 1_000_000 }
    }
}

#[derive(Debug, Clone, Copy)]
struct Learned {
    worker: WorkerIdx,
    at_ms: u64,
}

/// The `approx` policy.
#[derive(Debug, Default)]
pub struct ApproxPolicy {
    config: ApproxConfig,
    table: HashMap<u64, Learned, RandomState>,
    now_ms: u64,
    fallback: LeastLoadPolicy,
}

impl ApproxPolicy {
    /// A policy with these settings.
    pub fn new(config: ApproxConfig) -> Self {
        Self { config, ..Self::default() }
    }

    /// Learned keys (for metrics and tests).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether nothing is learned.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    fn trim(&mut self) {
        let ttl = self.config.ttl_ms;
        let now = self.now_ms;
        self.table.retain(|_, l| now.saturating_sub(l.at_ms) <= ttl);
        let max = self.config.max_entries.max(1);
        if self.table.len() > max {
            let mut ages: Vec<(u64, u64)> = self.table.iter().map(|(k, l)| (l.at_ms, *k)).collect();
            let drop = self.table.len() - (max - max / 8);
            let nth = drop.min(ages.len() - 1);
            ages.select_nth_unstable(nth);
            for (_, k) in ages.iter().take(drop) {
                self.table.remove(k);
            }
        }
    }
}

impl Policy for ApproxPolicy {
    fn name(&self) -> &'static str {
        "approx"
    }

    fn pick(
        &mut self,
        request: &RequestView<'_>,
        candidates: &[Candidate],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let ttl = self.config.ttl_ms;
        for key in request.text_prefix.iter().rev() {
            let Some(l) = self.table.get(key) else { continue };
            if self.now_ms.saturating_sub(l.at_ms) > ttl {
                continue;
            }
            let found = eligible(candidates)
                .find(|i| candidates.get(*i).is_some_and(|c| c.worker == l.worker && c.load.queued_if_added() == 0));
            if let Some(chosen) = found {
                let mut rest = self.fallback.pick(request, candidates, rng)?;
                rest.fallbacks.insert(0, rest.chosen);
                rest.fallbacks.retain(|i| *i != chosen);
                return Some(Decision { chosen, fallbacks: rest.fallbacks, reason: Reason::Approximate });
            }
        }
        self.fallback.pick(request, candidates, rng)
    }

    fn observe(&mut self, request: &RequestView<'_>, worker: WorkerIdx, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        for key in request.text_prefix {
            self.table.insert(*key, Learned { worker, at_ms: self.now_ms });
        }
        if self.table.len() > self.config.max_entries.max(1) {
            self.trim();
        }
    }

    fn forget_worker(&mut self, worker: WorkerIdx) {
        self.table.retain(|_, l| l.worker != worker);
    }
}
