//! The learned engine of one worker class: two robust fits, one for the
//! time to first token and one for the decode step.
//!
//! | fit | observation | features (scaled to O(1)) | coefficients |
//! |---|---|---|---|
//! | first token | gateway TTFT of a request that did not wait for a batch slot | `1, n, n², n·c, a, R` | overhead, prefill per token, its growth with the chunk, with the cached context, prefill queued ahead per token, per running request |
//! | decode step | mean inter-token time of a stream | `1, R̄, f̄, q̄, q̄c` | step base, per running request, KV fill, prefill tokens sharing the steps, those tokens times the cached context they follow |
//! | engine prefill | the engine's own mean prefill time over the requests that finished between two heartbeats (vLLM's histograms, engine clock), once matched as below or given up; not where they shared their steps with more prefill than their own | `1, N̄` | per request, per computed token |
//! | engine prefill, matched | the same, where the gateway saw exactly those requests end (their sum of computed tokens agrees), crowded or not | `1, N̄, N²̄, N·c̄, S̄, D̄` | per request, per computed token, its growth with the prompt, with the cached context, per token of other requests' prefill that may have shared its steps, per ms of the decode step beside it |
//!
//! `n` new prompt tokens (prompt − cached: as the router predicted when the
//! first token is learned as it comes, as the engine reported when it is
//! learned at the end), `c` cached tokens, `a` the prefill of other
//! requests that the worker finished while this one waited for its first token (its queue for
//! compute; without a first-token report, what was pending when it was
//! routed), `R` requests on the worker when it was routed; `R̄`, `f̄` (KV fill) and `q̄` (prefill tokens per step)
//! are averages over the stream's decode window. Queueing is kept apart
//! from compute twice: the prefill queued ahead has its own coefficient,
//! and a request that found the worker at its running limit is not a
//! first-token observation at all (it waited for a slot, which no
//! coefficient here describes).
//!
//! The two fits estimate the per-token prefill time independently (the
//! first token's `n` terms, the decode step's `q̄` term); [`EngineFit::timing`]
//! averages the two, weighed by how well each predicted the engine's
//! matched intervals once both were scored on ten of them ([`Scored`]),
//! by precision before. The decode step's is compute alone and usually
//! the tighter; the first token's also carries whatever waits grow with
//! the prompt and the traffic mix (a burst of cold prompts at a start, a
//! class short of KV blocks), which its other terms do not separate. On
//! `hetero`'s A100 class the first token's rate was a third to two thirds
//! of the formula's for the whole run while the decode step's was within
//! 5 % (`bench/results/calibration.json`, DECISIONS "Prefill rate from the
//! decode steps too"); on `vllm-v1` the decode step's was the tighter and
//! 16–22 % off for 150 requests while the first token's was within 7 %.
//! A rate that grows with the prompt is read along the prompts a fit saw
//! ([`along`](reading::along)): its mean over their range is known long before the rate
//! and the growth each are.

//!
//! Where the engine reports its prefill times (vLLM's
//! `vllm:request_prefill_time_seconds` and
//! `vllm:request_prefill_kv_computed_tokens`, forwarded by the relay), the
//! third fit measures the rate directly: from the step that scheduled a
//! request to its first token, compute only, per computed token (`N̄` the
//! interval's mean). The histograms give sums only, so the interval's mean
//! square of computed tokens, which a prefill cost that grows with the
//! prompt needs, comes from the gateway's own reports: where the requests
//! it saw end on the worker since the last matched interval add up to the
//! engine's computed tokens, they are the same requests, and a second fit
//! learns with their squares too. A straight line through a convex cost
//! moves with the mix of prompts (on `dynamo-mocker` its slope went from
//! 0.0163 to 0.0179 ms per token as conversations went from their cold
//! starters to follow-ups); the matched fit does not. Both are in the
//! engine's clock, which a simulated fleet runs faster than its simulated
//! time, so they are read through [`Clock`]: the engine's inter-token
//! times against the gateway's for the same kind of interval. Once the
//! matched fit is known to a half (where prompts follow cached ones, read
//! at the choice `kv` makes for them, the price of a cached token, once
//! known there to a quarter: [`compared`](reading::compared)), every matched interval scores it and
//! the indirect estimates (as one) on how well each predicted it, and the
//! prefill price `kv` uses is the two weighed by those scores
//! ([`EngineFit::blend`]); the matched fit alone (its rate and growth) once
//! known to a tenth before they are scored; else, for an engine whose
//! intervals are never matched (its requests come through another
//! gateway), the straight line; the two indirect estimates stand in until
//! then, within a factor of two of the straight line once it is known
//! (beyond, or where they are not known, the line stands in:
//! [`LINE_BOUND`](price::LINE_BOUND)). The engine times each prefill from
//! its first scheduled step, so in a burst of cold prompts each counts
//! the others' chunks: where an interval's requests shared their steps
//! with more prefill than their own ([`SHARED_MAX`]), the straight line
//! does not learn from it, nor are the estimates scored on it, and the
//! matched fit learns from it with the shared prefill (as the gateway saw
//! it) as a term of its own, up to three times its own
//! ([`SHARED_LEARNED_MAX`]). Half of the calibration's
//! intervals are crowded, and most of its first ones.
//!
//! A prefill step also carries the decodes running beside it, which cost
//! more as the KV cache fills; the calibration's cold prompts come early,
//! at a low fill, its follow-ups later at a high one. `D̄` is the learned
//! decode step (the decode fit, read through the clock) at the worker's
//! running requests and KV fill when each request's first token came, 0
//! until the decode fit and the clock are known; its coefficient starts
//! at 1. Without it the matched fit read `dynamo-mocker`'s cheaper early
//! steps as a lower rate and more growth: the 2,100-token cold prompt
//! 10–18 % low (DECISIONS, "The decode step beside a prefill").
//!
//! The decode rate `kv` prices a running request with is what one more
//! request adds to a step at the class's operating point: the per-request
//! coefficient plus the KV-fill coefficient times the fill one request
//! adds (the decode observations' mean fill over their mean running
//! requests). Under steady load the two terms are nearly collinear, so each
//! alone wandered (on `hetero`'s H100 class at concurrency 180 the
//! per-request term went from 0.045 to 0.017 ms in one run), and with the
//! fixed part their sum wandered too (on `vllm-v1` at 150, 0.41 → 0.12 ms
//! within one window). `kv` prices it as the step at the operating point
//! now times the share of that step one more request added, averaged over
//! about the last thousand decode observations ([`Share`](averages::Share)):
//! the step follows a change of the engine's speed at once, the share is
//! what the data pin down poorly.
//!
//! A rate a fit is no longer sure of (it forgot it after a detected change,
//! or the traffic stopped varying the way that pins it down) is held: at
//! its last known ratio to the other rate when that one is known, else at
//! its last known value. Falling back to the configured prior instead put
//! a class back on the prior's clock, 8× off at the benchmark's speed-up.
//! For the same reason a learned rate is never priced beside the other's
//! prior: until decode is first learned, a prefill rate not yet clearly
//! above zero leaves both at the priors ([`EngineFit::timing_with`]).
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | [`EngineFit`]: its fits, learning from each observation, and the timing `kv` reads |
//! | `observation.rs` | [`Observation`] and its kinds: what the fits learn from (a journal's records) |
//! | `averages.rs` | the running averages beside the coefficients: the engine's clock, the operating point, the decode step's share per request, the prompts and warm requests seen, the estimates' scores |
//! | `price.rs` | the prices: prefill (which estimates are known, scoring them on matched intervals, weighing them: [`PrefillFrom`], [`Readings`]) and decode (the step now times its averaged share) |
//! | `reading.rs` | reading a fit: when a coefficient is known, a rate read along the prompts or at the warm choice |
//! | `tests.rs` | unit and property tests |

use kvgate_scheduler::EngineTiming;
use serde::Serialize;

use super::rls::Rls;

mod averages;
mod observation;
mod price;
mod reading;
#[cfg(test)]
mod tests;

use averages::{Clock, Held, Operating, Prompts, Scored, Share, Warm};
pub use observation::{Decode, EnginePrefill, FirstToken, MatchedSums, Observation, SHARED_LEARNED_MAX, SHARED_MAX};
use price::Rates;
pub use price::{PrefillFrom, Readings, Scores};
use reading::{Along, by_misses, finite_nonneg};

/// Thousand.
const K: f64 = 1000.0;

/// Running requests per unit of the first-token and decode fits' running
/// terms: their coefficients, the decode marginal and its share are per ten
/// requests.
const TEN: f64 = 10.0;

/// Starting values of a fit, from the model's configuration: priors, not
/// truths.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prior {
    /// Prefill time per new token, ms.
    pub prefill_ms_per_token: f64,
    /// Decode step time per running request, ms.
    pub decode_ms_per_seq: f64,
}

/// A class's two learned rates, for another class to borrow their ratio.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reference {
    /// Learned prefill time per new token, ms.
    pub prefill_ms_per_token: f64,
    /// Learned decode step time per running request, ms.
    pub decode_ms_per_seq: f64,
    /// First-token samples behind it (the best-known class is the one
    /// with the most).
    pub samples: u64,
}

/// A fit's coefficients with their standard errors, for metrics and the
/// admin API.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Learned {
    /// Observations used.
    pub samples: u64,
    /// Observations ignored for non-finite values.
    pub rejected: u64,
    /// Robust residual scale, ms.
    pub residual_ms: f64,
    /// Changes of the engine detected (runs of residuals of one sign), each
    /// followed by forgetting most of what was learned.
    pub changes: u64,
    /// The coefficients, in the units their names say.
    pub params: Vec<Param>,
}

/// One learned coefficient.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Param {
    /// Name, with its unit.
    pub name: &'static str,
    /// Estimate.
    pub value: f64,
    /// Standard error.
    pub stderr: f64,
}

/// Coefficient names of the first-token fit, in feature order (units after
/// scaling back).
pub const FIRST_TOKEN_PARAMS: [&str; 6] = [
    "ttft_overhead_ms",
    "prefill_ms_per_token",
    "prefill_ms_per_token_per_ktok",
    "prefill_ms_per_token_per_kctx",
    "queued_prefill_ms_per_token",
    "ttft_ms_per_running",
];

/// Coefficient names of the decode fit, in feature order.
pub const DECODE_PARAMS: [&str; 5] = [
    "step_base_ms",
    "decode_ms_per_seq",
    "step_ms_per_kv_fill",
    "step_prefill_ms_per_token",
    "step_prefill_ms_per_token_per_kctx",
];

/// Coefficient names of the engine-prefill fit (engine clock).
pub const ENGINE_PREFILL_PARAMS: [&str; 2] = ["engine_prefill_ms_per_request", "engine_prefill_ms_per_token"];

/// Coefficient names of the matched engine-prefill fit (engine clock).
pub const ENGINE_MATCHED_PARAMS: [&str; 6] = [
    "engine_prefill_ms_per_request",
    "engine_prefill_ms_per_token",
    "engine_prefill_ms_per_token_per_ktok",
    "engine_prefill_ms_per_token_per_kctx",
    "engine_prefill_ms_per_shared_token",
    "engine_prefill_per_decode_step",
];

/// Scales from a coefficient on scaled features back to the name's units.
const ENGINE_PREFILL_SCALE: [f64; 2] = [1.0, 1.0 / K];
const ENGINE_MATCHED_SCALE: [f64; 6] = [1.0, 1.0 / K, 1.0 / K, 1.0 / K, 1.0 / K, 1.0];
const FIRST_TOKEN_SCALE: [f64; 6] = [1.0, 1.0 / K, 1.0 / K, 1.0 / K, 1.0 / K, 1.0 / TEN];
const DECODE_SCALE: [f64; 5] = [1.0, 1.0 / TEN, 1.0, 1.0 / K, 1.0 / K];

/// Fewer samples than this and the fit is not trusted over the prior.
pub const MIN_SAMPLES: u64 = 20;

/// The learned timing of one worker class.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineFit {
    prior: Prior,
    first: Rls<6>,
    decode: Rls<5>,
    /// The engine's own prefill times (engine clock).
    engine: Rls<2>,
    /// The same where the gateway matched the requests (with their squares,
    /// context and shared prefill).
    matched: Rls<6>,
    clock: Clock,
    /// Recent decode observations' mean KV fill and running requests
    /// (exponential averages): the operating point at which one more
    /// request's step cost is read from the decode fit.
    operating: Operating,
    /// The share of the step one more running request adds, averaged
    /// ([`Share`]): how `kv` prices decode.
    share: Share,
    /// The matched intervals' computed tokens per request: the range of
    /// prompts along which the matched fit's rate is read.
    prompts: Prompts,
    /// The matched intervals' warm requests: the choice along which the
    /// matched fit is read where prompts follow cached ones ([`compared`](reading::compared)).
    warm: Warm,
    /// The first-token observations' new tokens, the same way.
    first_prompts: Prompts,
    /// How well each indirect prefill estimate predicted the matched
    /// engine intervals: the first token's, the decode steps'.
    scored: (Scored, Scored),
    /// The same, for the indirect estimates as one and the matched fit
    /// (on the intervals where both are known).
    scored_engine: (Scored, Scored),
    /// The rates as last known, held while a fit is not sure of them.
    held: Held,
    /// [`EngineFit::rates_now`] after the last observation (they change
    /// only with one): the timings of every class are refreshed after each
    /// observation, and each reads them.
    rates: Rates,
}

impl EngineFit {
    /// A fit at the prior, wide enough that a few hundred observations
    /// decide (a tenth to ten times the prior is within two standard
    /// deviations).
    pub fn new(prior: Prior) -> Self {
        let p = prior.prefill_ms_per_token * K;
        let d = prior.decode_ms_per_seq * TEN;
        let first = Rls::new([50.0, p, 0.0, 0.0, p, d], [500.0, 5.0 * p, 2.0 * p, 2.0 * p, 5.0 * p, 5.0 * d], 50.0);
        let decode = Rls::new([10.0, d, 0.0, p, 0.0], [50.0, 5.0 * d, 50.0, 5.0 * p, 2.0 * p], 5.0);
        let engine = Rls::new([20.0, p], [500.0, 5.0 * p], 50.0);
        let matched = Rls::new([20.0, p, 0.0, 0.0, p, 1.0], [500.0, 5.0 * p, 2.0 * p, 2.0 * p, 5.0 * p, 0.5], 50.0);
        let mut fit = Self {
            prior,
            first,
            decode,
            engine,
            matched,
            clock: Clock::default(),
            operating: Operating::default(),
            share: Share::default(),
            prompts: Prompts::default(),
            warm: Warm::default(),
            first_prompts: Prompts::default(),
            scored: (Scored::default(), Scored::default()),
            scored_engine: (Scored::default(), Scored::default()),
            held: Held::default(),
            rates: Rates::default(),
        };
        fit.rates = fit.rates_now();
        fit
    }

    /// Learns from `o` as the method its variant names does; returns
    /// whether it was used (the clock's observations are not fitted:
    /// `false`).
    pub fn apply(&mut self, o: &Observation) -> bool {
        match o {
            Observation::FirstToken(f) => self.observe_first_token(f),
            Observation::Decode(d) => self.observe_decode(d),
            Observation::GatewayItl { ms, intervals } => {
                self.observe_gateway_itl(*ms, *intervals);
                false
            }
            Observation::EngineItl(e) => {
                self.observe_engine_itl(e);
                false
            }
            Observation::Engine(e) => self.observe_engine(e),
            Observation::EngineMatched { engine, sums } => self.observe_engine_matched(engine, sums),
        }
    }

    /// The admin view of this fit (`/admin/timing`'s class): each fit's
    /// coefficients, the clock, what `kv` uses, where its prefill rate
    /// comes from and the readings.
    pub fn admin_json(&self) -> serde_json::Value {
        let used: serde_json::Map<String, serde_json::Value> =
            self.timing().params().iter().map(|(k, v)| ((*k).to_owned(), (*v).into())).collect();
        serde_json::json!({
            "first_token": self.first_token(),
            "decode": self.decode(),
            "engine_prefill": self.engine_prefill(),
            "engine_matched": self.engine_matched(),
            "clock_ratio": self.clock_ratio(),
            "decode_share": self.decode_share(),
            "used": used,
            "prefill_from": self.prefill_from(),
            "readings": self.readings(),
        })
    }

    /// Learns from a first token.
    pub fn observe_first_token(&mut self, o: &FirstToken) -> bool {
        let used = o.new_tokens >= 0.0 && self.first.observe(o.features(), o.ttft_ms);
        if used {
            self.first_prompts.observe(o.new_tokens, o.new_tokens * o.new_tokens);
        }
        self.updated_if(used)
    }

    /// Learns from a stream's decode.
    pub fn observe_decode(&mut self, o: &Decode) -> bool {
        let used = o.itl_ms > 0.0 && self.decode.observe(o.features(), o.itl_ms);
        if used {
            self.operating.observe(o);
            if let Some((marginal, step)) = self.marginal_and_step() {
                self.share.observe(marginal.max(0.0) / step);
            }
        }
        self.updated_if(used)
    }

    /// After an observation: when it was `used`, the rates are updated
    /// ([`EngineFit::update_rates`]). Returns `used`.
    fn updated_if(&mut self, used: bool) -> bool {
        if used {
            self.update_rates();
        }
        used
    }

    /// A stream's decode as the gateway timed it: `ms` between its first
    /// and last token over `intervals` tokens (the gateway's side of
    /// [`Clock`]).
    pub fn observe_gateway_itl(&mut self, ms: f64, intervals: f64) {
        Clock::add(&mut self.clock.gateway, ms, intervals);
    }

    /// The engine's inter-token times between two heartbeats (its side of
    /// [`Clock`]).
    pub fn observe_engine_itl(&mut self, o: &EnginePrefill) {
        Clock::add(&mut self.clock.engine, o.itl_ms, o.itl_count);
    }

    /// Learns from the prefill times of the requests that finished in an
    /// engine interval (a straight line in their mean computed tokens).
    /// Returns whether the observation was used.
    pub fn observe_engine(&mut self, o: &EnginePrefill) -> bool {
        let used = o.has_prefills() && self.engine.observe(o.features(), o.ms / o.requests);
        self.updated_if(used)
    }

    /// Learns from an engine interval whose requests the gateway saw end,
    /// with what the gateway knows of them ([`MatchedSums`]); a crowded one
    /// ([`EnginePrefill::crowded`]) teaches the matched fit only, and one
    /// beyond [`SHARED_LEARNED_MAX`] nothing.
    pub fn observe_engine_matched(&mut self, o: &EnginePrefill, m: &MatchedSums) -> bool {
        let step = self.decode_step_engine_ms(m.running / o.requests, m.fill / o.requests);
        let used = o.has_prefills()
            && m.squared >= 0.0
            && m.context >= 0.0
            && m.shared >= 0.0
            && m.shared <= SHARED_LEARNED_MAX * o.computed_tokens
            && self.matched.observe(o.matched_features(m, step), o.ms / o.requests);
        if used {
            self.prompts.observe(o.computed_tokens / o.requests, m.squared / o.requests);
            self.warm.observe(m);
            if !o.crowded(m) {
                self.score(o, m);
            }
        }
        self.updated_if(used)
    }

    /// Recomputes the rates known now ([`EngineFit::rates_now`], read by
    /// every Pick's timing) and holds each, to stand in while a fit is not
    /// sure of them (after a change it detected, most of what it learned
    /// is forgotten on purpose; the rate it had is still a better guess
    /// than the configured prior, which may be on another clock).
    fn update_rates(&mut self) {
        self.rates = self.rates_now();
        let r = self.rates;
        if let Some((p, _)) = r.prefill {
            self.held.prefill = Some(p);
        }
        if let Some((d, _)) = r.decode {
            self.held.decode = Some(d);
        }
        if let (Some((p, _)), Some((d, dse))) = (r.prefill, r.decode)
            && d > 0.0
            && d > 3.0 * dse
        {
            self.held.ratio = Some(p / d);
        }
    }

    /// Predicted gateway TTFT for `o`'s inputs (its `ttft_ms` ignored), ms,
    /// never negative.
    pub fn predict_ttft_ms(&self, o: &FirstToken) -> f64 {
        finite_nonneg(self.first.predict(&o.features()))
    }

    /// The learned decode step at `running` requests and KV fill `fill`,
    /// in the engine's clock (the matched fit's); 0 while the decode fit or
    /// the clock is not known.
    pub(super) fn decode_step_engine_ms(&self, running: f64, fill: f64) -> f64 {
        if running <= 0.0 || self.decode.samples() < MIN_SAMPLES {
            return 0.0;
        }
        let Some(q) = self.clock.ratio().filter(|q| *q > 0.0) else { return 0.0 };
        let d =
            Decode { itl_ms: 0.0, running, kv_fill: fill, prefill_tokens_per_step: 0.0, prefill_context_per_step: 0.0 };
        self.predict_step_ms(&d) / q
    }

    /// Predicted decode step time for `o`'s inputs, ms, never negative.
    pub fn predict_step_ms(&self, o: &Decode) -> f64 {
        finite_nonneg(self.decode.predict(&o.features()))
    }

    /// Engine compute time to prefill `new` tokens after `cached` tokens,
    /// ms, without overhead or queueing (the first-token fit's `n` terms).
    pub fn predict_prefill_ms(&self, new: f64, cached: f64) -> f64 {
        let t = self.first.theta();
        let n = new.max(0.0) / K;
        finite_nonneg(t[1] * n + t[2] * n * n + t[3] * n * cached.max(0.0) / K)
    }

    /// Both rates, when both are learned and the decode rate is clearly
    /// above zero: what a class of the same model whose prefill (or decode)
    /// the traffic never pinned down can borrow its ratio from.
    pub fn reference(&self) -> Option<Reference> {
        let r = self.rates;
        match (r.prefill, r.decode) {
            (Some(p), Some(d)) if d.0 > 3.0 * d.1 => {
                Some(Reference { prefill_ms_per_token: p.0, decode_ms_per_seq: d.0, samples: self.first.samples() })
            }
            _ => None,
        }
    }

    /// What the `kv` policy uses, alone: [`EngineFit::timing_with`] without
    /// another class to borrow from.
    pub fn timing(&self) -> EngineTiming {
        self.timing_with(None)
    }

    /// What the `kv` policy uses: the known rates ([`EngineFit::rates_now`]);
    /// when only one is known and clearly above zero, the other keeps a
    /// ratio to it so that the two are on the same clock: this class's
    /// last ratio with both known, else the ratio of `reference` (another
    /// class of the same model with both rates learned) when there is one,
    /// else the priors' ratio; one not clearly above zero sets no clock:
    /// it is priced beside the other's last known value, and a prefill
    /// rate is not used at all while decode was never learned (both
    /// priors; a decode rate about zero is priced beside the prefill
    /// prior). With neither known, the last known values (a prefill rate
    /// alone with the ratio), else the priors. The growth terms (with
    /// the chunk, with the cached context) are the price's
    /// ([`EngineFit::rates_now`]): the matched fit's where the engine's times
    /// price prefill; beside the indirect estimates alone the first-token
    /// fit's, while its mean rate agrees with theirs, the growth with the
    /// chunk shrunk by how well it is known ([`shrunk`](reading::shrunk)) and the one with the
    /// context only when clearly above zero; otherwise 0.
    pub fn timing_with(&self, reference: Option<Reference>) -> EngineTiming {
        let r = self.rates;
        // A workload whose prompts are all cached never pins the prefill
        // rate down, and a prior in another time scale than the learned
        // decode rate would misprice load against cache. A sibling class's
        // measured ratio is this model's; the priors' is a guess.
        let ratio = self.held.ratio.unwrap_or_else(|| {
            reference
                .filter(|r| r.prefill_ms_per_token > 0.0 && r.decode_ms_per_seq > 0.0)
                .map_or(self.prior.prefill_ms_per_token / self.prior.decode_ms_per_seq, |r| {
                    r.prefill_ms_per_token / r.decode_ms_per_seq
                })
        });
        // A prior of 0 (or a non-finite one) gives no ratio.
        let ratio = (ratio.is_finite() && ratio > 0.0).then_some(ratio);
        // Only a rate clearly above zero (three standard errors) sets the
        // clock: one that is truly about zero (`dynamo-mocker`'s decode cost
        // per request) says nothing about time's scale.
        let clear = |(v, se): (f64, f64)| v > 0.0 && v > 3.0 * se;
        // One clock (the doc above): a young prefill rate beside the decode
        // prior weighed decode 49-67 prefill tokens instead of ~5 for half
        // a second on `dynamo-mocker`, and the follow-ups routed then left
        // their cache (DECISIONS, "One clock in the opening"). A rate no
        // longer known is held at its last known value, not the prior.
        let priors = (self.prior.prefill_ms_per_token, self.prior.decode_ms_per_seq);
        let prior_p = self.held.prefill.unwrap_or(priors.0);
        let (prefill, decode) = match (r.prefill, r.decode) {
            (Some(p), Some(d)) => (p.0, d.0),
            (Some(p), None) => {
                ratio.filter(|_| clear(p)).map(|q| p.0 / q).or(self.held.decode).map_or(priors, |d| (p.0, d))
            }
            (None, Some(d)) => (ratio.filter(|_| clear(d)).map_or(prior_p, |q| d.0 * q), d.0),
            (None, None) => match (self.held.prefill, self.held.decode, ratio) {
                (Some(p), Some(d), _) => (p, d),
                (Some(p), None, Some(q)) => (p, p / q),
                (p, d, _) => (p.unwrap_or(priors.0), d.unwrap_or(priors.1)),
            },
        };
        let (per_ktok, per_kctx) = r.growth;
        EngineTiming {
            prefill_ms_per_token: prefill,
            prefill_ms_per_token_per_ktok: per_ktok,
            prefill_ms_per_token_per_kctx: per_kctx,
            decode_ms_per_seq: decode,
        }
    }

    /// Which fit the prefill rate `kv` uses comes from.
    pub fn prefill_from(&self) -> PrefillFrom {
        self.rates.prefill_from
    }

    /// The prefill estimates as last read, for the admin API.
    pub fn readings(&self) -> Readings {
        let r = self.rates;
        let mean = |a: Option<Along>| a.map(|a| (a.mean / K, a.se / K));
        Readings {
            first_token: mean(r.first),
            decode: r.steps.map(|(v, se)| (v / K, se / K)),
            indirect: mean(r.indirect),
            matched: mean(r.matched),
            warm: self.warm.point(),
            scores: Scores {
                indirect_scored: self.scored.0.0.weight,
                indirect_weights: by_misses(&self.scored),
                matched_scored: self.scored_engine.0.0.weight,
                matched_weights: by_misses(&self.scored_engine),
            },
        }
    }

    /// The first-token fit, in the names' units.
    pub fn first_token(&self) -> Learned {
        learned(&self.first, &FIRST_TOKEN_PARAMS, &FIRST_TOKEN_SCALE)
    }

    /// The decode fit, in the names' units.
    pub fn decode(&self) -> Learned {
        learned(&self.decode, &DECODE_PARAMS, &DECODE_SCALE)
    }

    /// The engine-prefill fit, in the names' units (the engine's clock).
    pub fn engine_prefill(&self) -> Learned {
        learned(&self.engine, &ENGINE_PREFILL_PARAMS, &ENGINE_PREFILL_SCALE)
    }

    /// The matched engine-prefill fit, in the names' units (the engine's
    /// clock).
    pub fn engine_matched(&self) -> Learned {
        learned(&self.matched, &ENGINE_MATCHED_PARAMS, &ENGINE_MATCHED_SCALE)
    }

    /// Control-plane ms per engine ms, once measured (see [`Clock`]).
    pub fn clock_ratio(&self) -> Option<f64> {
        self.clock.ratio()
    }

    /// The share of the decode step at the operating point that one more
    /// running request adds, averaged ([`Share`]; it is kept per ten
    /// requests, the decode fit's unit): `kv` prices decode as the step now
    /// times it. `None` before the decode fit's marginal is known.
    pub fn decode_share(&self) -> Option<f64> {
        self.share.get().map(|s| s / TEN)
    }
}

fn learned<const N: usize>(f: &Rls<N>, names: &[&'static str; N], scale: &[f64; N]) -> Learned {
    let (t, se) = (f.theta(), f.stderr());
    Learned {
        samples: f.samples(),
        rejected: f.rejected(),
        residual_ms: f.scale(),
        changes: f.changes(),
        params: (0..N).map(|i| Param { name: names[i], value: t[i] * scale[i], stderr: se[i] * scale[i] }).collect(),
    }
}
