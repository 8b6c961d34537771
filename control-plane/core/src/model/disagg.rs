//! Disaggregated prefill and decode: whether a request's prefill goes to a
//! `prefill` worker, and to which one.
//!
//! Algorithm. The decode side is chosen first, by the model's policy among
//! the `decode` and `both` workers (a `prefill` worker never receives a
//! whole request). Its local prefill is the prompt tokens it neither holds
//! nor computes for a request in flight. The request is disaggregated when
//! 1. some `prefill` worker is live and not saturated (its running limit,
//!    its KV blocks), and
//! 2. the local prefill reaches the threshold: `min_uncached_tokens` when
//!    configured, else the tokens whose prefill on the decode worker, at its
//!    learned engine timing (the priors until it learned), would take
//!    `max_local_prefill_ms` or longer — long enough to stall every decode
//!    running there.
//!
//! Then the model's policy ranks the prefill workers for the same prompt with
//! one output token: in `kv` mode their overlap with the prompt and their
//! prefill queues decide. The prefill leg is tracked as a request of its own
//! (`<request id>` + [`PREFILL_LEG`]) that ends at the request's first token;
//! the decode worker is charged no prefill for it (it receives the blocks).
//!
//! Cost: O(P log P) for P prefill workers on top of the decode pick.

use kvgate_scheduler::{Candidate, EngineTiming, KvConfig, KvPolicy, RequestView};

/// Suffix of a prefill leg's id in the load tracker.
pub const PREFILL_LEG: &str = "#prefill";

/// `[models.disaggregation]`, validated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DisaggConfig {
    /// Disaggregate when prefill workers exist (default true; they get no
    /// request otherwise).
    pub enabled: bool,
    /// A local prefill of at least this many tokens goes to a prefill
    /// worker; `None` = derived from the learned timing and
    /// `max_local_prefill_ms`.
    pub min_uncached_tokens: Option<u32>,
    /// Without `min_uncached_tokens`: a local prefill that would take this
    /// long or longer goes to a prefill worker.
    pub max_local_prefill_ms: f64,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        Self { enabled: true, min_uncached_tokens: None, max_local_prefill_ms: 100.0 }
    }
}

impl DisaggConfig {
    /// Whether `uncached` new prompt tokens after `cached` ones are worth a
    /// prefill worker on a decode worker with `timing` (`None` = the
    /// configured priors of `kv`).
    pub fn worth_it(&self, uncached: u32, cached: u32, timing: Option<EngineTiming>, kv: &KvConfig) -> bool {
        if uncached == 0 {
            return false;
        }
        if let Some(min) = self.min_uncached_tokens {
            return uncached >= min;
        }
        let t = timing.unwrap_or(EngineTiming::linear(kv.prefill_ms_per_token, kv.decode_ms_per_seq));
        let (n, c) = (f64::from(uncached), f64::from(cached));
        n * t.prefill_ms_per_token_at(n, c) >= self.max_local_prefill_ms
    }
}

/// The prefill workers as candidates for a leg: excluded when saturated for
/// a one-token request (running limit, KV blocks), the rest open.
pub(super) fn open_for_a_leg(view: &RequestView<'_>, mut prefill: Vec<Candidate>, kv: KvConfig) -> Vec<Candidate> {
    let judge = KvPolicy::new(kv);
    for c in &mut prefill {
        c.excluded = judge.saturated(view, c);
    }
    prefill
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_is_the_configured_tokens_or_the_learned_time() {
        let kv = KvConfig { prefill_ms_per_token: 0.1, ..KvConfig::default() };
        let fixed = DisaggConfig { min_uncached_tokens: Some(2048), ..DisaggConfig::default() };
        assert!(!fixed.worth_it(2047, 0, None, &kv));
        assert!(fixed.worth_it(2048, 0, None, &kv));
        let derived = DisaggConfig::default();
        // 100 ms at the prior 0.1 ms/token = 1,000 tokens.
        assert!(!derived.worth_it(999, 0, None, &kv));
        assert!(derived.worth_it(1000, 0, None, &kv));
        // A worker learned twice as fast: twice the tokens.
        let fast = EngineTiming::linear(0.05, 0.5);
        assert!(!derived.worth_it(1999, 0, Some(fast), &kv));
        assert!(derived.worth_it(2000, 0, Some(fast), &kv));
        // Nothing to prefill: never.
        assert!(!DisaggConfig { min_uncached_tokens: Some(0), ..fixed }.worth_it(0, 5000, None, &kv));
    }
}
