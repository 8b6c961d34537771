//! `least_load`: the least loaded worker, ignoring the cache.
//!
//! # Algorithm
//!
//! Rank eligible workers by (saturated, effective requests, pending prefill
//! blocks, active blocks), then at random. "Effective" fuses predicted and
//! measured load (`Load::effective_requests`).
//!
//! # Complexity
//!
//! O(W log W) for W candidates.

use crate::policy::{Candidate, Decision, Policy, Reason, RequestView, rank_by};

/// The `least_load` policy.
#[derive(Debug, Clone, Default)]
pub struct LeastLoadPolicy;

impl Policy for LeastLoadPolicy {
    fn name(&self) -> &'static str {
        "least_load"
    }

    fn pick(
        &mut self,
        _request: &RequestView<'_>,
        candidates: &[Candidate],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        rank_by(
            candidates,
            rng,
            |_| Reason::Load,
            |c| {
                (
                    c.load.queued_if_added() > 0,
                    c.load.effective_requests(),
                    c.load.prefill_pending_blocks,
                    c.load.effective_active_blocks(),
                )
            },
        )
    }
}
