//! `kv`: cache overlap and load, with queueing modelled, priced in time.
//!
//! # Algorithm
//!
//! Starts from Dynamo's published cost (lowest wins):
//!
//! ```text
//! cost = overlap_weight × prefill_blocks_after_overlap + decode_blocks
//! ```
//!
//! and fixes its known failure. With sticky conversations, correlated
//! bursts push one worker past its batch limit, and TTFT p95 explodes: the
//! DOKS demo measured 3,143 ms against 732 ms for round robin at concurrency
//! 180. For each eligible candidate `w`, with `n` prompt blocks:
//!
//! ```text
//! cached_w   = device_overlap + host_hit_weight × (any_tier_overlap − device_overlap)
//! overlap_w  = max(cached_w, inflight_hit_weight × inflight_overlap)
//! prefill_w  = n − overlap_w                         this request's new work
//! pending_w  = prefill blocks of w's requests still without a first token
//! running_w  = requests on w (max of predicted and measured)
//! queued_w   = requests that would wait if this one were added
//!              (running_w + 1 − max_running, ≥ 0)
//! ```
//!
//! **Time units** (`CostUnit::Time`, the default) price a choice by the
//! request time it adds on that worker, for this request and for the ones
//! already running there, as an engine with chunked prefill spends it: a
//! step decodes one token of every running request plus a budget of prefill
//! tokens, and takes `base + d × running + p × prefill_tokens`. The worker's
//! timing is its class's learned engine ([`Candidate::timing`], from the
//! control plane's online calibration), or the configured priors when it
//! carries none: `p(new, ctx)` ms per prefill token (growing with the chunk
//! and with the cached context, for attention), `d` ms per running request
//! per step. With `B` tokens per block, `O` expected output tokens and
//! `T = ttft_weight`:
//!
//! ```text
//! own_ms     = p(prefill_w·B, overlap_w·B) × prefill_w·B     its own prefill
//! block_ms   = p × B                                          a block of someone else's prefill
//! own first token   T × own_ms                      weighted as first-token time
//! stall of others   own_ms × running_w              every running request waits for that prefill
//! joining           T × block_ms × computing_w      its first token waits for shared blocks still being computed
//! pending           block_ms × pending_w            it waits for the prefill queued before it
//! decode            d·O × (2·running'_w + 1)        it decodes among running'_w, and slows each of them
//! waiting           block_ms × queue_penalty × (f(ρ_w) + queued_w)
//!                   ρ_w = max((running_w + 1) / (max_running + 1), (active_w + added_w) / capacity_w)
//! cost_w = (overlap_weight × own_ms × (T + running_w) + joining + pending_weight × pending
//!           + decode_weight × decode + waiting) / (p_fastest × B)
//! ```
//!
//! The cost's unit is a block at the fastest candidate's prefill rate, the
//! same for every candidate of a decision, so every worker's milliseconds
//! count alike and a slow class's prefill costs more; and the costs, the
//! tie threshold and the temperature do not depend on the scale of the
//! learned times. With the configured timing (or none) this is the cost in
//! prefill-block equivalents of earlier versions.
//!
//! `running'_w` is `running_w`, or with the control plane's `fading_load`
//! (its default) once measured,
//! the running requests the decode lives with on average while the
//! fleet's later decisions even a difference out
//! ([`crate::persistence`], [`Candidate::decode_running`]).
//!
//! `f(ρ) = ρ / (1 − ρ)` is the mean wait of an M/M/1 queue, continued along
//! its tangent above ρ = 0.9, so a worker near its batch limit or its KV
//! capacity costs more before it is full. A worker whose KV blocks would
//! overflow with this request (the engine would preempt and recompute a
//! running request) counts as saturated, like one at its running limit.
//!
//! A cache miss therefore costs more the busier the worker is: recomputing a
//! 7,000-token history on a worker running 60 requests stalls all 60, which
//! outweighs a balance difference of ~30 requests. Block units (Dynamo's
//! formula) charged one block of load like one block of prefill, so at high
//! load a few requests of imbalance sent long conversations away from their
//! cache (hit rate 91 % against 98 % for sglang-router at concurrency 180).
//! Pending prefill is not weighted by `T`: leaving a worker because of it
//! creates a new prefill elsewhere, which delays that worker's requests in
//! turn; weighted by `T`, misses fed on themselves at concurrency 180.
//!
//! **Block units** (`CostUnit::Blocks`, [`KvConfig::dynamo`]) keep Dynamo's
//! form: `overlap_weight × prefill_w + pending_weight × pending_w +
//! decode_weight × active_blocks_w + queue_penalty_blocks × queued_w`.
//!
//! Then, in both units:
//!
//! 1. **Queueing is a constraint before it is a cost.** A worker whose
//!    running limit would be exceeded (`queued_w > 0`) is chosen only when
//!    every eligible worker is saturated. This is the failure mode: a cache
//!    hit saves one prefill, but waiting for a batch slot costs a whole
//!    request's decode.
//! 2. **Pending prefill** makes a burst of sticky requests to one worker raise
//!    its cost at once, before any heartbeat shows the queue.
//! 3. **Blocks in flight count as overlap.** A prefix that a worker is still
//!    prefilling for an earlier request is in no event yet, so the index
//!    alone sends a second request on the same long document to another
//!    worker, which recomputes it, while the first worker's pending prefill
//!    makes it look expensive. The load tracker knows the prompt blocks of
//!    every request in flight per worker; the leading ones this request
//!    shares count as overlap (the engine caches them chunk by chunk), and
//!    the pending prefill they stand for is not charged twice. Those still
//!    being computed (`inflight_computing_blocks`: the sharing request has
//!    no first token yet) are a wait for this request's first token, priced
//!    like its own prefill (`inflight_wait_weight`): joining a prefix that
//!    another request started a moment ago is no faster than computing it
//!    on an idle worker, so a burst of siblings spreads over idle workers
//!    (each computes the prefix once, in parallel) and stays together on
//!    busy ones, where a recompute would stall the running requests.
//! 4. **Measured load is fused with predicted load** (maximum of the two), so
//!    traffic the router did not route, and undercounting between replicas,
//!    still count.
//! 5. **Ties** (costs within `tie_epsilon` blocks) go to the less loaded worker
//!    (fewer requests, then fewer active blocks), then at random. Without
//!    overlap, this is least-load routing, not "first worker".
//! 6. **Optional softmax** (`temperature > 0`) samples among the non-saturated
//!    workers with weights `exp(−(cost − min) / (temperature × n))`.
//!
//! # Complexity
//!
//! O(W + k log k) for W candidates: the best k = 1 + [`RANKED_FALLBACKS`]
//! are selected (O(W)) and sorted; the other runners-up follow unordered
//! (with `temperature > 0`, all are sorted: O(W log W)). No allocation beyond
//! the ranking vector and the runners-up's indices.

use crate::policy::{Candidate, Decision, EngineTiming, Policy, Reason, RequestView, eligible};

/// What the `kv` cost is measured in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CostUnit {
    /// Request time added on the worker (see the module comment); the
    /// default.
    #[default]
    Time,
    /// Dynamo's block counts.
    Blocks,
}

impl std::str::FromStr for CostUnit {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "time" => Ok(Self::Time),
            "blocks" => Ok(Self::Blocks),
            other => Err(format!("unknown cost unit {other:?} (time | blocks)")),
        }
    }
}

/// Weights and thresholds of the `kv` policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvConfig {
    /// What the cost measures: request time (default) or Dynamo's blocks.
    pub unit: CostUnit,
    /// Engine time per prefill token, ms (time units): the unit of the cost
    /// (a block at this rate), and the timing of a candidate that carries
    /// none. The control plane learns each worker class's timing online
    /// and passes it in [`Candidate::timing`](crate::Candidate); this is
    /// then only its prior. Default 0.1 (10 K tokens/s), a neutral round
    /// number of the right order for a dense model of tens of billions of
    /// parameters on one datacenter GPU; it comes from no benchmark and no
    /// simulator preset.
    pub prefill_ms_per_token: f64,
    /// Engine time each running request adds to a decode step, ms (time
    /// units); like `prefill_ms_per_token`, a prior when timing is learned.
    /// Default 0.5, a neutral round number (a step of 64 requests 32 ms
    /// slower than a step of one).
    pub decode_ms_per_seq: f64,
    /// Worth of a millisecond of this request's own prefill (its time to
    /// first token) against a millisecond of decode or stall time (time
    /// units). A user waits on the first token with nothing to read, while
    /// decode time spreads over the reply. 20 was measured on the DOKS
    /// multi-turn benchmark (docs/DECISIONS.md): at concurrency 60, weight 1
    /// moved follow-up turns away from the worker holding the previous
    /// answer for two requests of imbalance (hit rate 97.4 %, TTFT p95
    /// 330 ms); 20 kept them (98.4 %, 289 ms); at 180 both were equal within
    /// noise, because the stall and waiting terms dominate there.
    pub ttft_weight: f64,
    /// Weight of this request's uncached prompt blocks. 1.0 = Dynamo's
    /// default (`overlap_score_weight`). Raise it to prefer cache hits over
    /// balance.
    pub overlap_weight: f64,
    /// Weight of other requests' pending prefill on the worker. 1.0: a
    /// pending prefill block delays this request's first token as much as
    /// one of its own.
    pub pending_weight: f64,
    /// Weight of active (decode) blocks. 1.0 = Dynamo's cost.
    pub decode_weight: f64,
    /// Worth of a block held only in host memory (a KV offloading tier),
    /// relative to a device hit: 0.9, because loading it back costs about a
    /// tenth of recomputing it. A dense 8–70B model keeps 128–320 KiB of KV
    /// per token, which PCIe-class host-to-device bandwidth (~25 GB/s) moves
    /// in 5–13 µs, against 50–200 µs of prefill per token on one datacenter
    /// GPU (public hardware figures, not a benchmark's engine). 0 ignores
    /// host tiers (`kv_tier_blind` in the benchmark).
    pub host_hit_weight: f64,
    /// Worth of a block that a request in flight on the worker shares with
    /// this one (it is being computed there), relative to a cached block.
    /// 1.0: with chunked prefill the engine caches each chunk as soon as it
    /// is computed, so a follower reuses what is done and the rest is done
    /// once; 0 ignores in-flight prompts (Dynamo's behaviour).
    pub inflight_hit_weight: f64,
    /// Share of the in-flight blocks this request shares that are still
    /// being computed, priced as a wait for its first token (time units,
    /// weighted like its own prefill by `ttft_weight`). 1.0: a sibling
    /// that joins a prefix still prefilling gets its first token no sooner
    /// than that prefill ends, so on an idle worker recomputing the prefix
    /// costs it no more time, and only the stall of the busy worker's other
    /// requests decides (bursts spread over idle workers and stay together
    /// on busy ones); 0 prices in-flight blocks like cached ones.
    pub inflight_wait_weight: f64,
    /// Cost of one request ahead in the worker's queue, in blocks. 200: at
    /// the DOKS operating point a batch slot frees about every 0.5 s, and a
    /// 32-token block of prefill takes about 2.5 ms (Llama-3.1-70B FP8 on
    /// H200). In block units it only orders saturated workers among
    /// themselves (rule 1); in time units it is also the scale of the
    /// expected wait before saturation (`f(ρ)` in the module comment).
    pub queue_penalty_blocks: f64,
    /// Costs closer than this (in blocks) are ties, broken by load. 0.5 makes
    /// only equal integer costs ties.
    pub tie_epsilon: f64,
    /// Softmax temperature per prompt block; 0 = always the lowest cost.
    pub temperature: f64,
    /// Runners-up the control plane sends for retries (the policy ranks
    /// them all; the model state keeps this many usable ones).
    pub fallbacks: usize,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            unit: CostUnit::Time,
            prefill_ms_per_token: 0.1,
            decode_ms_per_seq: 0.5,
            ttft_weight: 20.0,
            overlap_weight: 1.0,
            pending_weight: 1.0,
            decode_weight: 1.0,
            host_hit_weight: 0.9,
            inflight_hit_weight: 1.0,
            inflight_wait_weight: 1.0,
            queue_penalty_blocks: 200.0,
            tie_epsilon: 0.5,
            temperature: 0.0,
            fallbacks: 2,
        }
    }
}

impl KvConfig {
    /// Dynamo's published cost in block units (overlap weight 1, decode
    /// weight 1), plus this policy's fixes.
    pub fn dynamo() -> Self {
        Self { unit: CostUnit::Blocks, ..Self::default() }
    }

    /// A worker's engine timing: `learned` for its class, else these
    /// settings' priors.
    pub fn timing_of(&self, learned: Option<EngineTiming>) -> EngineTiming {
        learned.unwrap_or(EngineTiming::linear(self.prefill_ms_per_token, self.decode_ms_per_seq))
    }
}

/// The `kv` policy.
#[derive(Debug, Clone, Default)]
pub struct KvPolicy {
    /// Its settings.
    pub config: KvConfig,
}

impl KvPolicy {
    /// A policy with these settings.
    pub fn new(config: KvConfig) -> Self {
        Self { config }
    }

    /// Blocks `request` would add to `c`'s active KV: its prompt not shared
    /// with requests in flight there, plus its expected output.
    fn added_blocks(request: &RequestView<'_>, c: &Candidate) -> f64 {
        let n = request.prompt_blocks;
        let output = f64::from(request.expected_output_tokens.div_ceil(request.block_size.max(1)));
        f64::from(n - c.inflight_overlap_blocks.min(n)) + output
    }

    /// `c`'s KV blocks in use with `request` added, as a share of its
    /// capacity; `None` when the capacity is unknown.
    fn block_fill(request: &RequestView<'_>, c: &Candidate) -> Option<f64> {
        let cap = c.load.capacity_blocks.filter(|b| *b > 0)?;
        Some((c.load.effective_active_blocks() as f64 + Self::added_blocks(request, c)) / cap as f64)
    }

    /// Utilization of `c` with `request` added: the larger of its batch
    /// slots, `(running + 1) / (max_running + 1)`, and its KV blocks,
    /// `(active + added) / capacity`; 0 where neither limit is known.
    pub fn utilization(&self, request: &RequestView<'_>, c: &Candidate) -> f64 {
        let running = f64::from(c.load.effective_requests());
        let slots = c.load.max_running.filter(|l| *l > 0).map_or(0.0, |l| (running + 1.0) / (f64::from(l) + 1.0));
        slots.max(Self::block_fill(request, c).unwrap_or(0.0))
    }

    /// Whether `c` cannot take `request` without queueing it (running limit)
    /// or, in time units, without running out of KV blocks (the engine would
    /// preempt a running request and recompute it).
    pub fn saturated(&self, request: &RequestView<'_>, c: &Candidate) -> bool {
        c.load.queued_if_added() > 0
            || (self.config.unit == CostUnit::Time && Self::block_fill(request, c).is_some_and(|f| f > 1.0))
    }

    /// The cost of `c` for `request` (lower is better), without the
    /// saturation rule, in prefill blocks (time units: prefill-block
    /// equivalents of request time).
    pub fn cost(&self, request: &RequestView<'_>, c: &Candidate) -> f64 {
        self.cost_in(request, c, self.config.prefill_ms_per_token)
    }

    /// The time unit of one decision: a block at the fastest candidate's
    /// prefill rate (the configured rate for candidates without a timing),
    /// so that costs, ties and the softmax temperature do not depend on the
    /// scale of the learned times (a control plane whose clock sees a
    /// simulated fleet at 8× speed learns 8× smaller times).
    fn unit_rate(&self, candidates: &[Candidate]) -> f64 {
        let rate = |c: &Candidate| c.timing.map_or(self.config.prefill_ms_per_token, |t| t.prefill_ms_per_token);
        let fastest =
            eligible(candidates).filter_map(|i| candidates.get(i)).map(rate).filter(|r| *r > 0.0).reduce(f64::min);
        fastest.unwrap_or(self.config.prefill_ms_per_token)
    }

    /// [`KvPolicy::cost`] with the time unit a block at `unit_rate` ms per
    /// token.
    fn cost_in(&self, request: &RequestView<'_>, c: &Candidate, unit_rate: f64) -> f64 {
        let k = &self.config;
        let n = request.prompt_blocks;
        let device = f64::from(c.overlap_blocks.min(n));
        let any = f64::from(c.overlap_any_tier_blocks.min(n)).max(device);
        let cached = device + k.host_hit_weight * (any - device);
        let inflight = k.inflight_hit_weight * f64::from(c.inflight_overlap_blocks.min(n));
        let overlap = cached.max(inflight);
        let prefill = f64::from(n) - overlap;
        // Pending prefill this request would share is its own overlap, not
        // a delay on top of it.
        let pending = (c.load.prefill_pending_blocks as f64 - (inflight - cached).max(0.0)).max(0.0);
        let queue = k.queue_penalty_blocks * f64::from(c.load.queued_if_added());
        match k.unit {
            CostUnit::Blocks => {
                k.overlap_weight * prefill
                    + k.pending_weight * pending
                    + k.decode_weight * c.load.effective_active_blocks() as f64
                    + queue
            }
            CostUnit::Time => {
                let running = f64::from(c.load.effective_requests());
                let b = f64::from(request.block_size.max(1));
                // The worker's own engine (learned for its class), else the
                // configured priors; the cost's unit is the same for every
                // candidate of a decision, so that a slow worker's every
                // millisecond counts as one.
                let t = k.timing_of(c.timing);
                let unit_ms = unit_rate * b;
                if !(unit_ms.is_finite() && unit_ms > 0.0) {
                    return 0.0;
                }
                let own_ms = t.prefill_ms_per_token_at(prefill * b, overlap * b) * prefill * b;
                let block_ms = t.prefill_ms_per_token.max(0.0) * b;
                let decode_ms = t.decode_ms_per_seq.max(0.0) * f64::from(request.expected_output_tokens);
                // Chance of waiting, before saturation: the mean wait of an
                // M/M/1 queue at this utilization, in slot waits. The
                // utilization is the larger of batch slots and KV blocks.
                let slots = k.queue_penalty_blocks * wait_factor(self.utilization(request, c));
                // Shared blocks still being computed there: its first token
                // waits for them (no stall: that prefill runs anyway).
                let computing = k.inflight_hit_weight * f64::from(c.inflight_computing_blocks.min(n));
                let wait_ms = k.inflight_wait_weight * computing * block_ms;
                let ms = k.overlap_weight * own_ms * (k.ttft_weight + running)
                    + k.ttft_weight * wait_ms
                    + k.pending_weight * pending * block_ms
                    + k.decode_weight * decode_ms * (2.0 * c.decode_running.unwrap_or(running) + 1.0)
                    + (slots + queue) * block_ms;
                ms / unit_ms
            }
        }
    }
}

/// Runners-up `kv` returns in rank order ([`Decision::fallbacks`]); those
/// beyond follow in no particular order. At 1,000 candidates sorting them
/// all was a fifth of a Pick, for fallbacks of which the caller keeps a few.
pub const RANKED_FALLBACKS: usize = 32;

#[derive(Clone, Copy, Debug)]
struct Scored {
    saturated: bool,
    cost: f64,
    /// The order among the unsaturated (and among the saturated): `cost` in
    /// `tie_epsilon` buckets, then requests, then active blocks (as one
    /// number, computed once, not per comparison; see [`order_key`]).
    /// (Two halves: a `u128` would align the entry to 16 bytes.)
    key: (u64, u64),
    tie: u64,
    idx: u32,
}

/// The ranking's key: a cost bucket (`total_cmp` order), then requests,
/// then active blocks. Active blocks count up to 2³² − 1 (beyond, equal:
/// the random tie decides).
fn order_key(bucket: f64, requests: u32, active: u64) -> (u64, u64) {
    // The bits of an f64 as an unsigned number in `total_cmp` order.
    let b = bucket.to_bits();
    let bucket = if b >> 63 == 1 { !b } else { b | (1 << 63) };
    let active = u32::try_from(active).unwrap_or(u32::MAX);
    (bucket, (u64::from(requests) << 32) | u64::from(active))
}

impl Policy for KvPolicy {
    fn name(&self) -> &'static str {
        "kv"
    }

    fn pick(
        &mut self,
        request: &RequestView<'_>,
        candidates: &[Candidate],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision> {
        let n = request.prompt_blocks;
        let unit = self.unit_rate(candidates);
        let eps = self.config.tie_epsilon.max(0.0);
        let mut scored: Vec<Scored> = eligible(candidates)
            .filter_map(|i| {
                let c = candidates.get(i)?;
                let cost = self.cost_in(request, c, unit);
                // Bucketing by eps keeps the order transitive.
                let bucket = if eps > 0.0 { floor(cost / eps) } else { cost };
                Some(Scored {
                    saturated: self.saturated(request, c),
                    cost,
                    key: order_key(bucket, c.load.effective_requests(), c.load.effective_active_blocks()),
                    tie: rng.u64(..),
                    idx: u32::try_from(i).ok()?,
                })
            })
            .collect();
        if scored.is_empty() {
            return None;
        }
        if self.config.temperature > 0.0 {
            // The softmax draws from every non-saturated worker: all ranked.
            let all = scored.len();
            rank(&mut scored, all);
            softmax_promote(&mut scored, self.config.temperature * f64::from(n.max(1)), rng);
        } else {
            rank(&mut scored, 1 + RANKED_FALLBACKS);
        }
        let chosen = scored.first()?.idx as usize;
        let fallbacks = scored.iter().skip(1).map(|s| s.idx as usize).collect();
        // Overlap the cost counted: device, in flight, and host memory
        // unless the host tier is ignored.
        let host = self.config.host_hit_weight > 0.0;
        let seen = |c: &Candidate| {
            c.overlap_blocks.max(c.inflight_overlap_blocks).max(if host { c.overlap_any_tier_blocks } else { 0 })
        };
        let best_overlap = eligible(candidates).filter_map(|i| candidates.get(i)).map(seen).max();
        let chosen_overlap = candidates.get(chosen).map_or(0, seen);
        let reason = if chosen_overlap > 0 && Some(chosen_overlap) == best_overlap { Reason::Kv } else { Reason::Load };
        Some(Decision { chosen, fallbacks, reason })
    }
}

/// Puts the best `head` entries first, in order: saturated last; then
/// cost, where costs within eps of each other are ordered by load. The
/// random tie makes every key distinct, so an unstable sort orders as a
/// stable one would, and a selection picks the same `head` as a full sort.
fn rank(scored: &mut [Scored], head: usize) {
    let order = |a: &Scored, b: &Scored| a.saturated.cmp(&b.saturated).then(a.key.cmp(&b.key)).then(a.tie.cmp(&b.tie));
    if head > 0 && head < scored.len() {
        scored.select_nth_unstable_by(head - 1, order);
        if let Some(best) = scored.get_mut(..head) {
            best.sort_unstable_by(order);
        }
    } else {
        scored.sort_unstable_by(order);
    }
}

/// `x.floor()`, without the libm call that the baseline x86-64 target
/// makes of it (no SSE4.1 rounding instruction): once per candidate per
/// Pick, it was a fortieth of a Pick at 1,000 workers. Floats of magnitude
/// 2⁵² or more (and NaN, ±∞) are whole already.
fn floor(x: f64) -> f64 {
    if x.abs() < 4_503_599_627_370_496.0 {
        let t = x as i64 as f64;
        if t > x {
            t - 1.0
        } else if t == 0.0 {
            // 0 <= x < 1, or -0.0 (whose sign floor keeps).
            x * 0.0
        } else {
            t
        }
    } else {
        x
    }
}

/// Mean wait of an M/M/1 queue at utilization `rho`, in service times:
/// `rho / (1 − rho)` up to 0.9, then continued along its tangent (slope 100)
/// so that over-committed workers still rank by how far over they are.
fn wait_factor(rho: f64) -> f64 {
    let rho = rho.max(0.0);
    if rho <= 0.9 { rho / (1.0 - rho) } else { 9.0 + 100.0 * (rho - 0.9) }
}

/// Samples one non-saturated entry with softmax weights over cost and moves
/// it to the front.
fn softmax_promote(scored: &mut [Scored], temperature: f64, rng: &mut fastrand::Rng) {
    let pool = scored.iter().take_while(|s| !s.saturated).count().max(1).min(scored.len());
    let Some(min) = scored.iter().take(pool).map(|s| s.cost).reduce(f64::min) else { return };
    let weights: Vec<f64> = scored.iter().take(pool).map(|s| (-(s.cost - min) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    if !(total.is_finite() && total > 0.0) {
        return;
    }
    let mut x = rng.f64() * total;
    let mut pick = 0;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            pick = i;
            break;
        }
        x -= w;
        pick = i;
    }
    scored.swap(0, pick);
}

#[cfg(test)]
mod tests {
    use super::{Scored, floor, order_key, rank};
    use proptest::prelude::*;

    fn any_scored() -> impl Strategy<Value = Vec<Scored>> {
        // Few distinct values, so that saturation, buckets and loads tie often.
        prop::collection::vec((any::<bool>(), 0..4u64, 0..4u64, any::<u64>()), 0..120).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (saturated, bucket, load, tie))| Scored {
                    saturated,
                    cost: bucket as f64,
                    key: (bucket, load),
                    tie,
                    idx: i as u32,
                })
                .collect()
        })
    }

    fn any_bucket() -> impl Strategy<Value = f64> {
        prop_oneof![
            any::<f64>(),
            Just(0.0),
            Just(-0.0),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            (-1e6..1e6f64).prop_map(f64::floor),
        ]
    }

    proptest! {
        /// Ranking the best `head` gives the first `head` of a full sort,
        /// and keeps every entry.
        #[test]
        fn a_partial_ranking_starts_as_the_full_one(mut v in any_scored(), head in 0..40usize) {
            let mut full = v.clone();
            let all = full.len();
            rank(&mut full, all);
            rank(&mut v, head);
            let idx = |s: &[Scored]| s.iter().map(|x| x.idx).collect::<Vec<_>>();
            let n = head.min(v.len());
            prop_assert_eq!(idx(&v[..n]), idx(&full[..n]));
            let (mut a, mut b) = (idx(&v), idx(&full));
            a.sort_unstable();
            b.sort_unstable();
            prop_assert_eq!(a, b);
        }

        /// `floor` is `f64::floor`, bit for bit (the sign of zero too).
        #[test]
        fn floor_is_the_standard_floor(x in prop_oneof![any::<f64>(), -1e17..1e17f64, -4.0..4.0f64]) {
            prop_assert_eq!(floor(x).to_bits(), x.floor().to_bits(), "{}", x);
        }

        /// The packed key orders as the comparison it replaces: the bucket
        /// by `total_cmp`, then requests, then active blocks.
        #[test]
        fn the_ranking_key_orders_as_bucket_then_requests_then_active(
            a in (any_bucket(), any::<u32>(), 0..=u64::from(u32::MAX)),
            b in (any_bucket(), any::<u32>(), 0..=u64::from(u32::MAX)),
        ) {
            let want = a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2));
            prop_assert_eq!(order_key(a.0, a.1, a.2).cmp(&order_key(b.0, b.1, b.2)), want);
        }
    }

    #[test]
    fn active_blocks_beyond_u32_rank_equal() {
        assert_eq!(order_key(1.0, 3, u64::MAX), order_key(1.0, 3, u64::from(u32::MAX)));
        assert!(order_key(1.0, 3, 7) < order_key(1.0, 3, 8));
        assert!(order_key(-2.0, 9, 9) < order_key(-1.0, 0, 0));
    }

    #[test]
    fn floor_at_the_edges() {
        for x in [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 2.5, -2.5, 4_503_599_627_370_495.5, -4_503_599_627_370_495.5] {
            assert_eq!(floor(x).to_bits(), x.floor().to_bits(), "{x}");
        }
        for x in [f64::INFINITY, f64::NEG_INFINITY, f64::MAX, f64::MIN, 1e300] {
            assert_eq!(floor(x), x.floor());
        }
        assert!(floor(f64::NAN).is_nan());
    }
}
