//! `random`: a uniformly random eligible worker.
//!
//! # Complexity
//!
//! O(W).

use crate::policy::{Candidate, Decision, Policy, Reason, RequestView, eligible};

/// The `random` policy.
#[derive(Debug, Clone, Default)]
pub struct RandomPolicy;

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }

    fn pick(
        &mut self,
        _request: &RequestView<'_>,
        candidates: &[Candidate],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let mut pool: Vec<usize> = eligible(candidates).collect();
        if pool.is_empty() {
            return None;
        }
        rng.shuffle(&mut pool);
        let chosen = *pool.first()?;
        Some(Decision { chosen, fallbacks: pool.into_iter().skip(1).collect(), reason: Reason::Random })
    }
}
