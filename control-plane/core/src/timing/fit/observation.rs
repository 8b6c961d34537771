//! What the fits learn from: one observation of each kind, and what the
//! gateway knows of a matched engine interval.

use serde::{Deserialize, Serialize};

use super::{K, TEN};

/// One observation, as [`EngineFit::apply`](super::EngineFit::apply) learns from it: what a
/// journal of a class's observations holds ([`Calibration::journal_take`](super::super::Calibration::journal_take)),
/// so that a run's learning can be replayed offline, rule against rule, on
/// the same data.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Observation {
    /// [`EngineFit::observe_first_token`](super::EngineFit::observe_first_token).
    FirstToken(FirstToken),
    /// [`EngineFit::observe_decode`](super::EngineFit::observe_decode).
    Decode(Decode),
    /// [`EngineFit::observe_gateway_itl`](super::EngineFit::observe_gateway_itl).
    GatewayItl {
        /// Between the stream's first and last token, ms.
        ms: f64,
        /// Token intervals in it.
        intervals: f64,
    },
    /// [`EngineFit::observe_engine_itl`](super::EngineFit::observe_engine_itl).
    EngineItl(EnginePrefill),
    /// [`EngineFit::observe_engine`](super::EngineFit::observe_engine).
    Engine(EnginePrefill),
    /// [`EngineFit::observe_engine_matched`](super::EngineFit::observe_engine_matched).
    EngineMatched {
        /// The engine's interval.
        engine: EnginePrefill,
        /// What the gateway knows of its requests.
        sums: MatchedSums,
    },
}

/// One first-token observation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FirstToken {
    /// Gateway time to first token, ms.
    pub ttft_ms: f64,
    /// New (uncached) prompt tokens.
    pub new_tokens: f64,
    /// Cached prompt tokens.
    pub cached_tokens: f64,
    /// Prefill tokens of other requests the worker did while this one
    /// waited (see the module header).
    pub ahead_tokens: f64,
    /// Requests on the worker when it was routed.
    pub running: f64,
}

impl FirstToken {
    pub(super) fn features(&self) -> [f64; 6] {
        let n = self.new_tokens / K;
        [1.0, n, n * n, n * self.cached_tokens / K, self.ahead_tokens / K, self.running / TEN]
    }
}

/// One decode observation: a stream's mean inter-token time and what the
/// worker did meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Decode {
    /// Mean time between output tokens, ms.
    pub itl_ms: f64,
    /// Mean requests on the worker.
    pub running: f64,
    /// Mean KV fill, [0, 1].
    pub kv_fill: f64,
    /// Prefill tokens routed to the worker per decode step.
    pub prefill_tokens_per_step: f64,
    /// The same tokens each times the cached tokens it follows, per decode
    /// step: the attention over the context their prefill pays (absent in
    /// journals from before it: 0).
    #[serde(default)]
    pub prefill_context_per_step: f64,
}

impl Decode {
    pub(super) fn features(&self) -> [f64; 5] {
        let f = self.kv_fill.clamp(0.0, 1.0);
        [1.0, self.running / TEN, f, self.prefill_tokens_per_step / K, self.prefill_context_per_step / (K * K)]
    }
}

/// What one worker's engine reported between two heartbeats: the
/// requests that finished meanwhile, with their prefills as the engine
/// timed them (its clock), and its inter-token times.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EnginePrefill {
    /// Requests that finished.
    pub requests: f64,
    /// Their prefill times (scheduled to first token), summed, engine ms.
    pub ms: f64,
    /// Prompt tokens they computed (not cached).
    pub computed_tokens: f64,
    /// Time between output tokens, summed, engine ms.
    pub itl_ms: f64,
    /// Output-token intervals in `itl_ms`.
    pub itl_count: f64,
}

impl EnginePrefill {
    /// What the engine reported between the totals `then` and `now` (each
    /// only grows); `None` when one fell (the engine restarted).
    pub fn between(
        now: &kvgate_protocol::pb::EngineCounters,
        then: &kvgate_protocol::pb::EngineCounters,
    ) -> Option<Self> {
        let grown = |now: f64, then: f64| (now >= then).then_some(now - then);
        Some(Self {
            requests: grown(now.prefill_requests as f64, then.prefill_requests as f64)?,
            ms: grown(now.prefill_seconds, then.prefill_seconds)? * 1000.0,
            computed_tokens: grown(now.prefill_computed_tokens as f64, then.prefill_computed_tokens as f64)?,
            itl_ms: grown(now.itl_seconds, then.itl_seconds)? * 1000.0,
            itl_count: grown(now.itl_count as f64, then.itl_count as f64)?,
        })
    }

    /// Two consecutive intervals as one.
    pub fn add(&mut self, o: &Self) {
        self.requests += o.requests;
        self.ms += o.ms;
        self.computed_tokens += o.computed_tokens;
        self.itl_ms += o.itl_ms;
        self.itl_count += o.itl_count;
    }

    /// Whether some requests finished in it, with a meaningful count of
    /// computed tokens.
    pub(super) fn has_prefills(&self) -> bool {
        self.requests >= 1.0 && self.computed_tokens >= 0.0
    }

    pub(super) fn features(&self) -> [f64; 2] {
        [1.0, self.computed_tokens / self.requests / K]
    }

    /// With the sums the gateway knows of the interval's requests
    /// ([`MatchedSums`]).
    pub(super) fn matched_features(&self, m: &MatchedSums, step_ms: f64) -> [f64; 6] {
        let r = self.requests;
        [1.0, self.computed_tokens / r / K, m.squared / r / (K * K), m.context / r / (K * K), m.shared / r / K, step_ms]
    }

    /// Whether its requests shared their prefill steps with more prefill
    /// than their own ([`SHARED_MAX`]).
    pub fn crowded(&self, m: &MatchedSums) -> bool {
        m.shared > SHARED_MAX * self.computed_tokens
    }
}

/// What the gateway knows of a matched interval's requests, summed over
/// them: each one's computed tokens squared, its computed times the cached
/// tokens it followed (attention over the context), the other requests'
/// prefill that may have shared its steps (done while it waited for its
/// first token, and still to do beside it then), and the warm requests
/// (those that followed cached tokens) with their computed and cached
/// tokens: the choice `kv` prices is theirs ([`compared`](super::reading::compared)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MatchedSums {
    /// Computed tokens squared.
    pub squared: f64,
    /// Computed times cached tokens.
    pub context: f64,
    /// Other requests' prefill tokens that may have shared their steps.
    pub shared: f64,
    /// The worker's running requests when each request's first token
    /// came, summed: with `fill`, where the decode part of its prefill
    /// steps is read ([`EngineFit::observe_engine_matched`](super::EngineFit::observe_engine_matched)).
    #[serde(default)]
    pub running: f64,
    /// The worker's KV fill then, summed.
    #[serde(default)]
    pub fill: f64,
    /// Of `shared`, at most what was already pending on the worker when
    /// each request was routed: the queue ahead of it (partly the step in
    /// progress), which the engine's prefill clock does not count. Recorded
    /// for the journal's replays; no fit reads it.
    #[serde(default)]
    pub queued: f64,
    /// Requests that followed cached tokens.
    pub warm: f64,
    /// Their computed tokens.
    pub warm_computed: f64,
    /// Their cached tokens (every cached token is a warm request's).
    pub cached: f64,
}

impl MatchedSums {
    /// Adds one request: `computed` tokens after `cached` ones, `shared`
    /// other prefill beside it, `queued` of that pending when it came, and
    /// the worker's running requests and KV fill when its first token came
    /// (`(0, 0)` where not known).
    pub fn add(&mut self, computed: f64, cached: f64, shared: f64, queued: f64, (running, fill): (f64, f64)) {
        self.running += running;
        self.fill += fill;
        self.squared += computed * computed;
        self.context += computed * cached;
        self.shared += shared;
        self.queued += queued.min(shared);
        if cached > 0.0 {
            self.warm += 1.0;
            self.warm_computed += computed;
            self.cached += cached;
        }
    }
}

/// An engine interval whose requests waited, together, for more of other
/// requests' prefill than this many times their own is crowded: the engine
/// times a prefill from the step that first scheduled it to its first
/// token, so prompts that shared their steps (a burst of cold prompts)
/// each count the others' chunks as their own. The matched fit learns
/// from it with the shared prefill as a term of its own; the straight line
/// and the scores of the estimates, which have no such term, do not.
pub const SHARED_MAX: f64 = 1.0;

/// An interval more crowded than this (its requests waited for more than
/// this many times their own prefill) teaches no engine fit: what the
/// gateway counts as shared (all the prefill the worker finished while a
/// request waited, and all it still had to do beside it) then holds mostly
/// prefill that ran in other steps, a queue the engine's prefill time does
/// not include, and the shared term does not describe it. On h200's fleet
/// (whole prompts of up to 7,700 tokens per step, a queue at the start)
/// every crowded interval learned put the matched fit's prefill 2.5× off
/// for 300 requests; at most three times their own, within 10 % from its
/// third interval (DECISIONS "Crowded engine intervals learned with the
/// shared prefill apart").
pub const SHARED_LEARNED_MAX: f64 = 3.0;
