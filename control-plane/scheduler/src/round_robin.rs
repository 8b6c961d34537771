//! `round_robin`: every eligible worker in turn, blind to cache and load.
//! The baseline the published results compare against.
//!
//! # Algorithm
//!
//! A counter advances on every pick; the chosen candidate is the first
//! eligible one at or after `counter mod W`.
//!
//! # Complexity
//!
//! O(W) worst case (skipping excluded workers).

use crate::policy::{Candidate, Decision, Policy, Reason, RequestView};

/// The `round_robin` policy.
#[derive(Debug, Clone, Default)]
pub struct RoundRobinPolicy {
    next: usize,
}

impl Policy for RoundRobinPolicy {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn pick(
        &mut self,
        _request: &RequestView<'_>,
        candidates: &[Candidate],
        _rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        let start = self.next % n;
        let mut order = (0..n).map(|k| (start + k) % n).filter(|i| candidates.get(*i).is_some_and(|c| !c.excluded));
        let chosen = order.next()?;
        self.next = chosen + 1;
        let fallbacks = order.collect();
        Some(Decision { chosen, fallbacks, reason: Reason::RoundRobin })
    }
}
