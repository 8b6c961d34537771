//! Disaggregated prefill and decode: whether a request's prefill goes to a
//! `prefill` worker, and to which one.
//!
//! Algorithm. The decode side is chosen first, by the model's policy among
//! the `decode` and `both` workers (a `prefill` worker never receives a
//! whole request). Its local prefill is the prompt tokens it neither holds
//! nor computes for a request in flight. The request is disaggregated when
//! 1. some `prefill` worker is live, not saturated (its running limit, its
//!    KV blocks) and, with `only_if_sooner` (the default), would finish this
//!    prefill no later than the decode worker itself: its queued prefill
//!    plus this prompt's uncached part there, against the decode worker's
//!    queued prefill plus its own uncached part, each at that worker's
//!    learned timing, plus the stall a local prefill puts on the decodes
//!    running there (each waits out the prefill's compute, chunk by chunk:
//!    `stall_weight` × requests in flight there × the compute). A backed-up
//!    prefill pool then leaves requests local instead of queueing them
//!    behind it, and a decode worker busy decoding sends its long prefills
//!    away even when that costs the new request some TTFT; and
//! 2. the local prefill reaches the threshold: `min_uncached_tokens` when
//!    configured, else the tokens whose prefill on the decode worker, at its
//!    learned engine timing (the priors until it learned), would take
//!    `max_local_prefill_ms` or longer — long enough to stall every decode
//!    running there.
//!
//! With `prefill_on_both`, the other live `both` workers are candidates for
//! the leg too; each costs its queued prefill, this prefill and the stall
//! of the decodes running there, so a leg goes to the worker where the
//! prompt stalls the fewest decodes, and stays local when that is here.
//!
//! With `overflow_to_prefill`, a request whose chosen decode worker is
//! saturated goes whole to the `prefill` worker the policy ranks first
//! among those that are not (and is not disaggregated).
//!
//! Then the model's policy ranks the prefill workers for the same prompt with
//! one output token: in `kv` mode their overlap with the prompt and their
//! prefill queues decide. The prefill leg is tracked as a request of its own
//! (`<request id>` + [`PREFILL_LEG`]) that ends at the request's first token;
//! the decode worker is charged no prefill for it (it receives the blocks).
//!
//! Cost: O(P log P) for P leg candidates on top of the decode pick.

use std::collections::{BTreeSet, HashMap};

use kvgate_index::WorkerIdx;
use kvgate_scheduler::{Candidate, EngineTiming, KvConfig, KvPolicy, RequestView};

use super::ModelState;

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
    /// A prefill worker takes a leg only when it would finish the prefill
    /// no later than the decode worker would locally (default true).
    pub only_if_sooner: bool,
    /// With `only_if_sooner`: the weight of the decodes running on the
    /// decode worker, each stalled by a local prefill's compute, against
    /// the new request's own TTFT (1 = every millisecond of every request
    /// counts the same; 0 = the new request's TTFT alone). Default 4, a
    /// preference for inter-token latency, measured in docs/DECISIONS.md
    /// ("A prefill's stall on the running decodes").
    pub stall_weight: f64,
    /// `both` workers take prefill legs too (default false): on a fleet
    /// whose every worker runs a KV connector in both directions (vLLM's
    /// `kv_role = "kv_both"`), a request's prefill may go to another worker
    /// of the same pool, which then pays the stall of its own running
    /// decodes. The split between prefill and decode then follows the load
    /// request by request instead of a fixed P:D.
    pub prefill_on_both: bool,
    /// When the decode side's choice is saturated (its running limit, or
    /// its KV blocks would overflow), a `prefill` worker that is not takes
    /// the whole request (default false: roles hold strictly). For pools
    /// whose prefill workers can decode too (vLLM with `kv_role =
    /// "kv_both"`): a decode pool too small for the load borrows the
    /// prefill pool's KV cache and batch slots until it is scaled.
    pub overflow_to_prefill: bool,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            min_uncached_tokens: None,
            max_local_prefill_ms: 100.0,
            only_if_sooner: true,
            stall_weight: 4.0,
            prefill_on_both: false,
            overflow_to_prefill: false,
        }
    }
}

/// Milliseconds until `c` has prefilled `uncached` tokens of a prompt after
/// `cached` ones, behind the prefill already queued there (its learned
/// timing, the priors until learned).
pub fn prefill_done_ms(c: &Candidate, uncached: u32, cached: u32, block_size: u32, kv: &KvConfig) -> f64 {
    let t = kv.timing_of(c.timing);
    let queued = c.load.prefill_pending_blocks as f64 * f64::from(block_size);
    let n = queued + f64::from(uncached);
    n * t.prefill_ms_per_token_at(n, f64::from(cached))
}

/// Milliseconds a worker `c` would cost a request's first token and the
/// decodes running there if it prefilled the `uncached` tokens after
/// `cached` ones: its queue and this prefill ([`prefill_done_ms`]), plus
/// `stall_weight` × its decoding requests (those in flight there but its
/// `legs` prefill legs, at most its running limit) × this prefill's
/// compute, the time each running decode waits for the chunks that carry
/// it.
pub fn local_cost_ms(
    c: &Candidate,
    legs: u32,
    (uncached, cached): (u32, u32),
    block_size: u32,
    kv: &KvConfig,
    stall_weight: f64,
) -> f64 {
    let done = prefill_done_ms(c, uncached, cached, block_size, kv);
    let t = kv.timing_of(c.timing);
    let n = f64::from(uncached);
    let compute = n * t.prefill_ms_per_token_at(n, f64::from(cached));
    let decoding = c.load.inflight.saturating_sub(legs);
    let running = c.load.max_running.map_or(decoding, |m| decoding.min(m));
    let stall = stall_weight * f64::from(running) * compute;
    if stall.is_finite() { done + stall } else { done }
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
        let t = kv.timing_of(timing);
        let (n, c) = (f64::from(uncached), f64::from(cached));
        n * t.prefill_ms_per_token_at(n, c) >= self.max_local_prefill_ms
    }
}

/// A candidate for a prefill leg: a `prefill` worker, or (with
/// [`DisaggConfig::prefill_on_both`]) a `both` worker. The leg's compute
/// stalls the requests decoding there: all its requests in flight but its
/// `legs` (a `prefill` worker decodes only what `overflow_to_prefill` gave
/// it).
#[derive(Debug, Clone, Copy)]
pub(super) struct LegCandidate {
    pub cand: Candidate,
    pub legs: u32,
    pub both: bool,
}

/// The candidates for a leg of a `prompt_tokens`-token prompt: excluded
/// when saturated for a one-token request (running limit, KV blocks) or,
/// with `local_ms` (the decode worker's own cost, [`local_cost_ms`]), when
/// their [`local_cost_ms`] (their queue, this prefill and the stall of the
/// decodes running there) is higher, for a `both` worker when not lower.
pub(super) fn open_for_a_leg(
    view: &RequestView<'_>,
    legs: &[LegCandidate],
    kv: KvConfig,
    prompt_tokens: u32,
    local_ms: Option<f64>,
    stall_weight: f64,
) -> Vec<Candidate> {
    let judge = KvPolicy::new(kv);
    let bs = view.block_size;
    let mut out: Vec<Candidate> = legs.iter().map(|l| l.cand).collect();
    for (c, l) in out.iter_mut().zip(legs) {
        let held = c.overlap_blocks.max(c.inflight_overlap_blocks).saturating_mul(bs).min(prompt_tokens);
        let new = prompt_tokens - held;
        // A `both` worker must cost less than staying (a tie is not worth
        // the transfer); a `prefill` worker no more.
        let later = local_ms.is_some_and(|local| {
            let there = local_cost_ms(c, l.legs, (new, held), bs, &kv, stall_weight);
            if l.both { there >= local } else { there > local }
        });
        c.excluded = later || judge.saturated(view, c);
    }
    out
}

/// Prefill legs in flight, by request id (with their worker), by the time
/// their prefill should be done (the prefill worker's queue and this
/// prefill at the learned timing) and counted per worker. A leg ends then,
/// or at its request's first report if sooner: reports are batched for up
/// to a report interval, and a non-streamed request is reported only once
/// it ended, long after its prefill leg.
#[derive(Debug, Default)]
pub(super) struct Legs {
    by_id: HashMap<String, (u64, WorkerIdx)>,
    by_time: BTreeSet<(u64, String)>,
    per_worker: HashMap<WorkerIdx, u32>,
}

impl Legs {
    pub(super) fn insert(&mut self, request_id: &str, done_by_ms: u64, worker: WorkerIdx) {
        self.remove(request_id);
        self.by_id.insert(request_id.to_owned(), (done_by_ms, worker));
        self.by_time.insert((done_by_ms, request_id.to_owned()));
        *self.per_worker.entry(worker).or_default() += 1;
    }

    /// Forgets a leg; whether it was in flight.
    pub(super) fn remove(&mut self, request_id: &str) -> bool {
        let Some((t, w)) = self.by_id.remove(request_id) else { return false };
        self.by_time.remove(&(t, request_id.to_owned()));
        self.forget(w);
        true
    }

    /// Legs in flight on `worker`.
    pub(super) fn on(&self, worker: WorkerIdx) -> u32 {
        self.per_worker.get(&worker).copied().unwrap_or(0)
    }

    fn forget(&mut self, worker: WorkerIdx) {
        if let Some(n) = self.per_worker.get_mut(&worker) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_worker.remove(&worker);
            }
        }
    }

    /// The legs due by `now_ms`, forgotten. O(1) when none is.
    fn due(&mut self, now_ms: u64) -> Vec<String> {
        let mut out = Vec::new();
        while let Some((t, _)) = self.by_time.first() {
            if *t > now_ms {
                break;
            }
            if let Some((_, id)) = self.by_time.pop_first() {
                if let Some((_, w)) = self.by_id.remove(&id) {
                    self.forget(w);
                }
                out.push(id);
            }
        }
        out
    }
}

/// The tracker's id of a request's prefill leg.
pub(super) fn leg_id(request_id: &str) -> String {
    format!("{request_id}{PREFILL_LEG}")
}

impl ModelState {
    /// Ends the prefill legs due by `now_ms` (every Pick and every tick).
    pub(super) fn end_prefill_legs(&mut self, now_ms: u64) {
        for id in self.prefill_legs.due(now_ms) {
            let _ = self.tracker.done(&leg_id(&id));
        }
    }

    /// Ends a request's prefill leg, if one is in flight (its first token
    /// came, or it is done).
    pub(super) fn end_leg(&mut self, request_id: &str) {
        if self.prefill_legs.remove(request_id) {
            let _ = self.tracker.done(&leg_id(request_id));
        }
    }
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
