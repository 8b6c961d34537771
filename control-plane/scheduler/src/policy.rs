//! The `Policy` trait and what every policy sees.

use kvgate_index::WorkerIdx;

/// Load of one worker as the scheduler sees it: the router's prediction from
/// the requests it (and its replicas) routed, fused with what the worker last
/// measured (heartbeat).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    /// Requests routed to the worker and not done (all replicas).
    pub inflight: u32,
    /// Prompt blocks still to prefill for requests that have no first token
    /// yet (their uncached part).
    pub prefill_pending_blocks: u64,
    /// KV blocks held by active requests, shared prefixes counted once, plus
    /// their expected output blocks.
    pub active_blocks: u64,
    /// `vllm:num_requests_running` at the last heartbeat.
    pub measured_running: Option<u32>,
    /// `vllm:num_requests_waiting` at the last heartbeat.
    pub measured_waiting: Option<u32>,
    /// Active blocks measured (`kv_cache_usage_perc` × capacity).
    pub measured_active_blocks: Option<u64>,
    /// The worker's running limit (`max_num_seqs`), when known.
    pub max_running: Option<u32>,
    /// The worker's KV capacity in blocks (device tier), when known.
    pub capacity_blocks: Option<u64>,
}

impl Load {
    /// Requests on the worker: the larger of the prediction and the
    /// measurement (running + waiting). The prediction reacts at once; the
    /// measurement catches traffic the router did not see.
    pub fn effective_requests(&self) -> u32 {
        let measured = self.measured_running.unwrap_or(0).saturating_add(self.measured_waiting.unwrap_or(0));
        self.inflight.max(measured)
    }

    /// Active KV blocks: the larger of the prediction and the measurement.
    pub fn effective_active_blocks(&self) -> u64 {
        self.active_blocks.max(self.measured_active_blocks.unwrap_or(0))
    }

    /// Active KV blocks ([`Load::effective_active_blocks`]) over the
    /// capacity, in 0–1; `None` while the capacity is unknown.
    pub fn kv_fill(&self) -> Option<f64> {
        let capacity = self.capacity_blocks.filter(|c| *c > 0)?;
        Some((self.effective_active_blocks() as f64 / capacity as f64).clamp(0.0, 1.0))
    }

    /// Requests that would wait in the worker's queue if one more arrived
    /// (0 while below the running limit or when the limit is unknown).
    pub fn queued_if_added(&self) -> u32 {
        match self.max_running {
            Some(limit) if limit > 0 => (self.effective_requests() + 1).saturating_sub(limit),
            _ => self.measured_waiting.unwrap_or(0),
        }
    }
}

/// One worker that could take the request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// The worker (index in the model's [`kvgate_index::Index`]).
    pub worker: WorkerIdx,
    /// Leading prompt blocks it holds in device memory.
    pub overlap_blocks: u32,
    /// Leading prompt blocks it holds in any tier (≥ `overlap_blocks` when
    /// it offloads to host memory).
    pub overlap_any_tier_blocks: u32,
    /// Leading prompt blocks that requests already routed to it and still in
    /// flight share with this one: blocks it is computing (or holds without
    /// its events having arrived yet). 0 when unknown.
    pub inflight_overlap_blocks: u32,
    /// Of `inflight_overlap_blocks`, those a request there still computes
    /// (it has no first token yet): a follower's first token waits for them.
    /// 0 when unknown.
    pub inflight_computing_blocks: u32,
    /// Its load.
    pub load: Load,
    /// How fast its engine is, as the control plane learned it for the
    /// worker's class; `None` = the policy's configured priors.
    pub timing: Option<EngineTiming>,
    /// The running requests a request's decode there lives with on
    /// average, when the control plane measured how fast load differences
    /// fade ([`crate::LoadPersistence`]); `None` = its running requests now.
    pub decode_running: Option<f64>,
    /// Not to be chosen (unhealthy, draining, heartbeats stale).
    pub excluded: bool,
}

/// Engine time of one worker class, as learned online (or as configured):
/// what a policy needs to price a choice in time. All in milliseconds; every
/// value is finite and ≥ 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineTiming {
    /// Prefill time per new prompt token.
    pub prefill_ms_per_token: f64,
    /// Added per new token per thousand new tokens (prefill that grows
    /// faster than linearly with the chunk: `ms = a·n + b·n²/1000 + …`).
    pub prefill_ms_per_token_per_ktok: f64,
    /// Added per new token per thousand tokens of context already cached
    /// (attention over the cached prefix).
    pub prefill_ms_per_token_per_kctx: f64,
    /// Decode step time each running request adds.
    pub decode_ms_per_seq: f64,
}

impl EngineTiming {
    /// Linear timing: `prefill_ms_per_token` and `decode_ms_per_seq` only.
    pub fn linear(prefill_ms_per_token: f64, decode_ms_per_seq: f64) -> Self {
        Self {
            prefill_ms_per_token,
            prefill_ms_per_token_per_ktok: 0.0,
            prefill_ms_per_token_per_kctx: 0.0,
            decode_ms_per_seq,
        }
    }

    /// Every value with its name (for metrics and the admin API).
    pub fn params(&self) -> [(&'static str, f64); 4] {
        let Self {
            prefill_ms_per_token,
            prefill_ms_per_token_per_ktok,
            prefill_ms_per_token_per_kctx,
            decode_ms_per_seq,
        } = *self;
        [
            ("prefill_ms_per_token", prefill_ms_per_token),
            ("prefill_ms_per_token_per_ktok", prefill_ms_per_token_per_ktok),
            ("prefill_ms_per_token_per_kctx", prefill_ms_per_token_per_kctx),
            ("decode_ms_per_seq", decode_ms_per_seq),
        ]
    }

    /// Mean prefill time per token of `new` tokens after `cached` tokens of
    /// context (never below `prefill_ms_per_token`'s tenth, never
    /// non-finite).
    pub fn prefill_ms_per_token_at(&self, new: f64, cached: f64) -> f64 {
        let per = self.prefill_ms_per_token
            + self.prefill_ms_per_token_per_ktok * new.max(0.0) / 1000.0
            + self.prefill_ms_per_token_per_kctx * cached.max(0.0) / 1000.0;
        let floor = self.prefill_ms_per_token.max(0.0) / 10.0;
        if per.is_finite() { per.max(floor) } else { floor }
    }
}

/// What a policy knows about the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestView<'a> {
    /// Full prompt blocks.
    pub prompt_blocks: u32,
    /// Expected output tokens (max_tokens, or the model's estimate).
    pub expected_output_tokens: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Text-prefix keys for the `approx` policy: the chained segment hashes
    /// of the prompt, already mixed with the request's block seed (tenant).
    pub text_prefix: &'a [u64],
}

/// Why a worker was chosen (maps to `PickReason` on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The chosen worker had the longest cached prefix and it mattered.
    Kv,
    /// Load decided.
    Load,
    /// Learned text prefixes decided.
    Approximate,
    /// Round robin.
    RoundRobin,
    /// Random.
    Random,
}

/// A routing decision: positions in the candidate slice.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The chosen candidate.
    pub chosen: usize,
    /// Every other eligible candidate, best first: the caller keeps as many
    /// as it retries on, after its own filters (a data-parallel rank's
    /// fallbacks must run that rank), so that a filter never leaves it with
    /// fewer than it wants while usable runners-up exist. A policy may rank
    /// only the first few and leave the rest in no order (`kv` ranks
    /// [`crate::kv::RANKED_FALLBACKS`]).
    pub fallbacks: Vec<usize>,
    /// Why.
    pub reason: Reason,
}

/// A routing policy. One per file in this crate; every one must never choose
/// an excluded candidate and must return `None` only when every candidate is
/// excluded (or there are none).
pub trait Policy: Send {
    /// Short name, as in configuration and metrics (`kv`, `approx`, ...).
    fn name(&self) -> &'static str;

    /// Chooses among `candidates`.
    fn pick(
        &mut self,
        request: &RequestView<'_>,
        candidates: &[Candidate],
        rng: &mut fastrand::Rng,
    ) -> Option<Decision>;

    /// Told about the final decision for a request (for policies that learn
    /// from their own routing, like `approx`). `now_ms` is a monotonic clock.
    fn observe(&mut self, _request: &RequestView<'_>, _worker: kvgate_index::WorkerIdx, _now_ms: u64) {}

    /// Told that a worker left, so that learned state about it is dropped.
    fn forget_worker(&mut self, _worker: kvgate_index::WorkerIdx) {}
}

/// Indices of the non-excluded candidates.
pub(crate) fn eligible(candidates: &[Candidate]) -> impl Iterator<Item = usize> + '_ {
    candidates.iter().enumerate().filter(|(_, c)| !c.excluded).map(|(i, _)| i)
}

/// Orders eligible candidates by `key` (lower is better) with random ties,
/// and builds a decision with every runner-up in that order.
pub(crate) fn rank_by<K: PartialOrd + Copy>(
    candidates: &[Candidate],
    rng: &mut fastrand::Rng,
    reason: impl FnOnce(usize) -> Reason,
    mut key: impl FnMut(&Candidate) -> K,
) -> Option<Decision> {
    let mut order: Vec<(K, u64, usize)> =
        eligible(candidates).filter_map(|i| candidates.get(i).map(|c| (key(c), rng.u64(..), i))).collect();
    if order.is_empty() {
        return None;
    }
    order.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal).then(a.1.cmp(&b.1)));
    let mut it = order.into_iter().map(|(_, _, i)| i);
    let chosen = it.next()?;
    Some(Decision { chosen, fallbacks: it.collect(), reason: reason(chosen) })
}
