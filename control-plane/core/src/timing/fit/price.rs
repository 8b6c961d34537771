//! The prices `kv` uses. Prefill: which estimates are known, how the
//! matched engine intervals score them, and how they are weighed. Decode:
//! the step at the operating point times its averaged share per request.

use serde::Serialize;

use super::reading::{
    Along, HALF, QUARTER, TENTH, along, by_misses, by_precision, clearly_positive, compared, known, known_positive,
    shrunk,
};
use super::{EngineFit, EnginePrefill, K, MatchedSums, TEN};

/// How far the indirect prefill estimates may stand from the engine's own
/// straight line before the line stands in for them, while the matched fit
/// is not known (a factor, either way). The line is the engine's compute
/// alone, and through a convex cost it moves with the mix of prompts (on
/// `dynamo-mocker` 28 % high for 150 requests, 2b9ef7f), so within the
/// factor the indirect estimates keep the price. The first token's carries
/// every wait that grows with the prompt: on `vllm-v1` at concurrency 120
/// it, and the rate held from it where no estimate was known, priced
/// prefill at 3.4–10 times the engine's line (itself 8–16 % below the
/// preset) for the first 750–900 requests
/// (`bench/results/doks-vllm-v1-120-prices.json`).
pub(super) const LINE_BOUND: f64 = 2.0;

/// The rates that are known, with their standard errors.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Rates {
    pub(super) prefill: Option<(f64, f64)>,
    pub(super) decode: Option<(f64, f64)>,
    /// The prefill rate's growth per 1,000 tokens of chunk and of cached
    /// context, ms per token; 0 where not known.
    pub(super) growth: (f64, f64),
    /// Which fit the prefill rate comes from ([`EngineFit::prefill_from`]).
    pub(super) prefill_from: PrefillFrom,
    /// The two indirect prefill estimates as known (fit units): the first
    /// token's read along its prompts, the decode steps' rate with its
    /// standard error. Each matched engine interval scores them
    /// ([`EngineFit::score`]).
    pub(super) first: Option<Along>,
    pub(super) steps: Option<(f64, f64)>,
    /// The indirect estimates' price as one, and the matched engine fit's
    /// read along its prompts once known to a half, each in the gateway's
    /// clock: each matched engine interval scores them against each other
    /// ([`EngineFit::score`]), and once both were scored [`EngineFit::blend`]
    /// weighs them.
    pub(super) indirect: Option<Along>,
    pub(super) matched: Option<Along>,
}

/// Where the prefill rate `kv` uses comes from ([`EngineFit::prefill_from`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillFrom {
    /// The matched engine fit, with its growth with the prompt.
    EngineMatched,
    /// The engine's straight line: its intervals are never matched, or
    /// the indirect estimates are not known or stand beyond
    /// [`LINE_BOUND`] of it.
    EnginePrefill,
    /// The two indirect estimates, weighed ([`EngineFit::timing`]).
    #[serde(rename = "first_token+decode")]
    FirstTokenAndDecode,
    /// The first-token fit alone.
    FirstToken,
    /// The decode steps' fit alone.
    Decode,
    /// The matched engine fit and the indirect estimates, weighed by how
    /// well each predicted the engine's matched intervals
    /// ([`EngineFit::blend`]).
    #[serde(rename = "engine_matched+indirect")]
    EngineMatchedAndIndirect,
    /// No fit knows it: the last known rate, a ratio to the decode rate,
    /// or the prior stands in ([`EngineFit::timing_with`]).
    #[default]
    None,
}

/// The prefill estimates as last read ([`EngineFit::readings`]): each
/// (ms a token, standard error) in the gateway's clock, where known. The
/// matched fit's is read at the choice `kv` makes for a warm prompt where
/// there are warm prompts ([`compared`]), else along its computed tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Readings {
    /// The first-token fit's rate, read along its prompts.
    pub first_token: Option<(f64, f64)>,
    /// The decode steps' rate.
    pub decode: Option<(f64, f64)>,
    /// The two, weighed as one.
    pub indirect: Option<(f64, f64)>,
    /// The matched engine fit's, once known to a half.
    pub matched: Option<(f64, f64)>,
    /// The warm prompt it is read at: computed and cached tokens.
    pub warm: Option<(f64, f64)>,
    /// How the estimates were scored on the matched intervals ([`Scored`]).
    pub scores: Scores,
}

/// The scores of the prefill estimates on the engine's matched intervals
/// (an admin reading: why the price is weighed as it is).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Scores {
    /// Intervals the first token's and the decode steps' estimates were
    /// scored on (about the last fifty count), and their weights once
    /// scored on enough.
    pub indirect_scored: f64,
    /// Weights of the first token's and the decode steps' estimates.
    pub indirect_weights: Option<(f64, f64)>,
    /// Intervals the indirect estimates (as one) and the matched fit were
    /// scored on.
    pub matched_scored: f64,
    /// Weights of the indirect estimates and the matched fit.
    pub matched_weights: Option<(f64, f64)>,
}

impl EngineFit {
    /// Scores the two indirect prefill estimates on a matched interval
    /// (see [`Scored`]) as each prices the interval's prompts (the first
    /// token's with its growth with the chunk, read along its prompts), as
    /// known before this interval ([`Rates`]: only their own fits'
    /// observations change them). Only where both are known: each is
    /// scored on the same intervals as the other. The first token's is
    /// known first, and scored alone on the start's intervals (the engine's
    /// clock still settling, a burst of cold prompts) its misses were the
    /// wider for them: on `dynamo-mocker` the weighing then went to the
    /// decode steps' rate, 28 % high, the moment it had its ten (67e9b7f).
    pub(super) fn score(&mut self, o: &EnginePrefill, m: &MatchedSums) {
        let Some(q) = self.clock.ratio() else { return };
        let [_, n, n2, nc, _, _] = o.matched_features(m, 0.0);
        let took = o.ms / o.requests * q;
        let miss = |a: Along| took - a.rate * n - a.growth * n2 - a.context * nc;
        let r = self.rates;
        if let (Some(f), Some((rate, _))) = (r.first, r.steps) {
            self.scored.0.observe(miss(f));
            self.scored.1.observe(miss(Along::flat(rate, 0.0)));
        }
        if let (Some(i), Some(m)) = (r.indirect, r.matched) {
            self.scored_engine.0.observe(miss(i));
            self.scored_engine.1.observe(miss(m));
        }
    }

    /// The prefill and decode rates that are known, with their standard
    /// errors: enough samples, the data took at least 90 % of the prior's
    /// variance away (a coefficient the traffic never varies keeps it,
    /// however small the noise), and the standard error is below half the
    /// size (sizes below a tenth of the prior count as a tenth of the
    /// prior, so that a rate that is truly about zero can be learned). The
    /// prefill rate must be positive; the decode rate is at least 0.
    pub(super) fn rates_now(&self) -> Rates {
        let p_prior = self.prior.prefill_ms_per_token * K;
        // The prefill rate, measured twice: from first tokens (whole
        // prompts, but every wait before the first token is in the same
        // number) and from the decode steps that prefill shared (compute
        // alone, but each step's cost at its whole batch). Where both are
        // known they are averaged by precision: whichever the traffic pins
        // down better weighs more (the steps' during a burst of cold
        // prompts, the first token's while the steps' fit is still moving
        // after the engine changed).
        let first = along(&self.first, self.first_prompts.range(), p_prior, HALF);
        let from_first = first.map(|f| (f.mean, f.se));
        let from_steps = known_positive(&self.decode, 3, p_prior);
        // The engine's own measurement, in this clock: the matched fit's
        // rate and growth, else the straight line's rate, but only for an
        // engine whose intervals are never matched (its requests do not
        // come through this gateway). A line through a convex cost moves
        // with the mix of prompts, and it is known long before the matched
        // fit's three terms are: on `dynamo-mocker` it priced prefill 28 %
        // high for the 150 requests between the two (2b9ef7f); the
        // indirect estimates stand in meanwhile.
        let q = self.clock.ratio();
        let context = match (self.matched.theta()[3], self.matched.stderr()[3]) {
            (c, ce) if c > 3.0 * ce && c.is_finite() => c,
            _ => 0.0,
        };
        // Where prompts follow cached ones, read at the choice `kv` makes
        // for them ([`compared`]) once known there to a quarter; else, or
        // until then, along the computed tokens (known to a half) with the
        // context term where clearly above zero. At the choice the context
        // term counts the ~5,000 tokens between two workers' prefixes, and
        // known only to a half it was that term's noise: on `dynamo-mocker`
        // (no context cost) the price went 13 % → 110 % off and back as it
        // crossed the line, and in four calibration runs the preset needed
        // 216–493 requests against 216–292 with the quarter (DECISIONS,
        // replayed on the same journals).
        let half = compared(&self.matched, self.warm.point(), p_prior, QUARTER)
            .or_else(|| along(&self.matched, self.prompts.range(), p_prior, HALF).map(|m| Along { context, ..m }));
        // Alone, the matched fit takes over once its mean rate is known to
        // a tenth (read along the prompts it was first known to a half: on
        // `hetero`'s H100 class it then priced prefill 28 % high for 60
        // requests, 3e6750a).
        let tenth = half.filter(|m| m.se < TENTH * m.mean.abs().max(0.1 * p_prior));
        let (matched, matched_alone) = (q.zip(half).map(|(q, m)| m.scaled(q)), q.zip(tenth).map(|(q, m)| m.scaled(q)));
        let engine_line = q.zip(known_positive(&self.engine, 1, p_prior)).map(|(q, (v, se))| (v * q, se * q));
        // The indirect estimates' mean rates over the prompts, as one.
        let (indirect_mean, indirect_from) = match (from_first, from_steps) {
            (Some(a), Some(b)) => (Some(self.weigh(a, b)), PrefillFrom::FirstTokenAndDecode),
            (Some(a), None) => (Some(a), PrefillFrom::FirstToken),
            (None, Some(b)) => (Some(b), PrefillFrom::Decode),
            (None, None) => (None, PrefillFrom::None),
        };
        // The growth terms are the first-token fit's shape, used only while
        // its mean rate agrees with the indirect one (within two standard
        // errors of the difference): its rate can carry waits that grow
        // with the prompt, and its growth then belongs to that bias. The
        // growth with the chunk is read with its rate along the prompts
        // ([`along`]) and kept beside the mean used by moving the rate by
        // their difference, shrunk by how well it is known ([`shrunk`]:
        // none below two standard errors): on `h200-llama70b-fp8`, whose
        // prefill is linear in the prompt, a growth of 0.0015 ± 0.0020 ms
        // a token per 1,000 tokens (the engine queue's wait growing with
        // the prompt) priced the uncached range 9–27 % off for 50
        // requests; a cut at three standard errors instead dropped
        // `dynamo-mocker`'s real growth whenever it crossed the line
        // (10.5 % off at once, b6c4a81).
        let agrees = match (first, indirect_mean) {
            (Some(f), Some((p, pe))) => (f.mean - p).abs() <= 2.0 * (f.se * f.se + pe * pe).sqrt(),
            _ => false,
        };
        let kept = shrunk(&self.first, 2);
        let indirect = indirect_mean.map(|(p, se)| match first {
            // The growth kept times `kept`, the rate moved so that the mean
            // over the prompts stays `p`.
            Some(f) if agrees && kept > 0.0 && p - kept * (f.mean - f.rate) > 0.0 => {
                Along { mean: p, se, rate: p - kept * (f.mean - f.rate), growth: kept * f.growth, context: 0.0 }
            }
            _ => Along::flat(p, se),
        });
        // The price used: the matched fit and the indirect estimates
        // weighed once both were scored, else the matched fit alone once
        // known to a tenth, else the straight line where no interval is
        // matched, else the indirect estimates, but the straight line where
        // they stand beyond [`LINE_BOUND`] of it or are not known. The
        // engine's own rate comes with its own growth (none for the
        // straight line).
        let line = engine_line.filter(|&(v, _)| {
            self.matched.samples() == 0 || indirect.is_none_or(|i| !(v / LINE_BOUND..=v * LINE_BOUND).contains(&i.mean))
        });
        let (price, prefill_from) =
            match (matched.zip(indirect).and_then(|(m, i)| self.blend(m, i)), matched_alone, line) {
                (Some(b), _, _) => (Some(b), PrefillFrom::EngineMatchedAndIndirect),
                (None, Some(m), _) => (Some(m), PrefillFrom::EngineMatched),
                (None, None, Some((v, se))) => (Some(Along::flat(v, se)), PrefillFrom::EnginePrefill),
                (None, None, None) => (indirect, indirect_from),
            };
        let indirect_only =
            matches!(prefill_from, PrefillFrom::FirstTokenAndDecode | PrefillFrom::FirstToken | PrefillFrom::Decode);
        let prefill = price.map(|p| (p.rate / K, p.se / K));
        let chunk_growth = price.map_or(0.0, |p| p.growth);
        // The growth with the context: the engine's own where its times
        // price prefill (its matched fit's term, clearly above zero; on
        // `dynamo-mocker` a price without it was half the marginal cost of
        // a DOKS turn after 5,000 cached tokens, 53a9200); the first
        // token's beside the indirect estimates alone, and when clearly
        // above zero (three standard errors): on a workload whose prompts
        // fall in two groups (long and cold, short after a long cached
        // prefix) it is nearly collinear with the others and wanders.
        let context_growth = if indirect_only {
            clearly_positive(&self.first, 3, p_prior).filter(|_| agrees).map_or(0.0, |g| g / K)
        } else {
            price.map_or(0.0, |p| p.context / K)
        };
        // What one more running request adds to a step, as `kv` prices it:
        // the step at the operating point now times the share of it one
        // more request added on average ([`Share`](super::averages::Share)), where the decode
        // fit's marginal is known ([`EngineFit::marginal`]).
        let decode = self.marginal().map(|(dv, dve)| {
            let d = self.share.get().zip(self.step_now()).map_or(dv.max(0.0), |(share, step)| share * step);
            (d / TEN, dve / TEN)
        });
        Rates {
            prefill,
            decode,
            growth: (chunk_growth / K, context_growth),
            prefill_from,
            first,
            steps: from_steps,
            indirect,
            matched,
        }
    }

    /// What one more running request adds to a decode step (fit units:
    /// ms per ten requests) with its standard error, where known: its own
    /// share of the per-request term and of the KV-fill term, at the fill
    /// per request the worker has been running at.
    pub(super) fn marginal(&self) -> Option<(f64, f64)> {
        let marginal = [0.0, 1.0, TEN * self.operating.fill_per_request(), 0.0, 0.0];
        let (dv, dve) = (self.decode.predict(&marginal), self.decode.predict_stderr(&marginal));
        let d_prior = self.prior.decode_ms_per_seq * TEN;
        known(dv, dve, self.decode.prior_share_at(&marginal), self.decode.samples(), d_prior).then_some((dv, dve))
    }

    /// The decode step at the operating point (the decode observations'
    /// mean running requests and KV fill, no prefill in the step), where
    /// above zero.
    fn step_now(&self) -> Option<f64> {
        let [fill, running] = self.operating.0.of;
        let step = self.decode.predict(&[1.0, running / TEN, fill, 0.0, 0.0]);
        (step.is_finite() && step > 0.0 && self.operating.0.weight >= 1.0).then_some(step)
    }

    /// [`EngineFit::marginal`]'s value and the step now
    /// ([`EngineFit::step_now`]), where both are known: their ratio is the
    /// share [`Share`](super::averages::Share) averages.
    pub(super) fn marginal_and_step(&self) -> Option<(f64, f64)> {
        self.marginal().map(|(dv, _)| dv).zip(self.step_now())
    }

    /// The matched fit's price and the indirect estimates', as one: weighed
    /// by how well each predicted the engine's matched intervals (the
    /// inverse variance of its misses, [`Scored`]) once both were scored on
    /// enough of them; `None` before. The matched fit's standard error says
    /// how sure it is of its terms, not of the prompts it has not yet seen
    /// much of: taken alone where it was first known to a tenth, it priced
    /// prefill 9–13 % off on `dynamo-mocker` and `hetero`'s H100 class for
    /// the next 40–70 requests (eaf3d13); weighed in from a half, it
    /// brought `dynamo-mocker` within 10 % after 231 requests instead of
    /// 402.
    pub(super) fn blend(&self, m: Along, i: Along) -> Option<Along> {
        let (wi, wm) = by_misses(&self.scored_engine)?;
        Some(Along {
            mean: wm * m.mean + wi * i.mean,
            se: (wm * wm * m.se * m.se + wi * wi * i.se * i.se).sqrt(),
            rate: wm * m.rate + wi * i.rate,
            growth: wm * m.growth + wi * i.growth,
            context: wm * m.context + wi * i.context,
        })
    }

    /// The first token's and the decode steps' prefill rates, (value,
    /// standard error) each, as one: weighed by how well each predicted
    /// the engine's matched intervals (the inverse variance of its misses,
    /// [`Scored`]) once both were scored on enough of them, else by their
    /// precision. Their standard errors say how sure each fit is of its own
    /// model, not whether the model is the engine's: on `vllm-v1` the
    /// decode steps' rate was the more precise and 15–20 % off for 150
    /// requests while the first token's was within 7 % (dff640f).
    pub(super) fn weigh(&self, a: (f64, f64), b: (f64, f64)) -> (f64, f64) {
        let Some((wa, wb)) = by_misses(&self.scored) else {
            return by_precision(a, b);
        };
        (wa * a.0 + wb * b.0, (wa * wa * a.1 * a.1 + wb * wb * b.1 * b.1).sqrt())
    }
}
