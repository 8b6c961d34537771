//! Running averages a fit keeps beside its coefficients: the engine's
//! clock, the operating point, the prompts seen, and the estimates' scores.

use super::observation::{Decode, MatchedSums};

/// The engine's clock against the control plane's: the same kind of
/// interval, the time between two output tokens, measured by the gateway
/// (the decode observations, weighted by their tokens) and by the engine
/// (its inter-token histogram). A real engine's ratio is about 1; a
/// simulated one's is the simulator's speed-up, which the control plane is
/// not told. Both sides change alike when the engine does, so the ratio
/// needs only a long memory.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Clock {
    /// Gateway (ms, intervals).
    pub(super) gateway: (f64, f64),
    /// Engine (ms, intervals).
    pub(super) engine: (f64, f64),
}

impl Clock {
    /// Intervals each side needs before the ratio is read.
    const MIN: f64 = 1_000.0;
    /// Above this many intervals a side's sums are halved: the memory is
    /// long and bounded.
    const KEEP: f64 = 1.0e6;

    pub(super) fn add(side: &mut (f64, f64), ms: f64, count: f64) {
        if !(ms.is_finite() && count.is_finite() && ms >= 0.0 && count > 0.0) {
            return;
        }
        side.0 += ms;
        side.1 += count;
        if side.1 > Self::KEEP {
            side.0 /= 2.0;
            side.1 /= 2.0;
        }
    }

    /// Control-plane ms per engine ms, once both sides have enough.
    pub(super) fn ratio(&self) -> Option<f64> {
        if self.gateway.1 < Self::MIN || self.engine.1 < Self::MIN {
            return None;
        }
        let r = (self.gateway.0 / self.gateway.1) / (self.engine.0 / self.engine.1);
        (r.is_finite() && r > 0.0).then_some(r)
    }
}

/// Exponential averages of `N` quantities: plain means while fewer than
/// `1 / alpha` observations are in, then each new one weighs `alpha`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Averages<const N: usize> {
    pub(super) of: [f64; N],
    pub(super) weight: f64,
    pub(super) alpha: f64,
}

impl<const N: usize> Averages<N> {
    pub(super) const fn new(alpha: f64) -> Self {
        Self { of: [0.0; N], weight: 0.0, alpha }
    }

    /// Adds one observation; one with a non-finite value is skipped.
    pub(super) fn observe(&mut self, x: [f64; N]) {
        if !x.iter().all(|v| v.is_finite()) {
            return;
        }
        self.weight += 1.0;
        let a = (1.0 / self.weight).max(self.alpha);
        for (m, v) in self.of.iter_mut().zip(x) {
            *m += a * (v - *m);
        }
    }
}

impl Averages<2> {
    /// The first quantity's variance, where the second is its square.
    pub(super) fn variance(&self) -> f64 {
        let [mean, square] = self.of;
        square - mean * mean
    }
}

/// The decode observations' KV fill and running requests, averaged (about
/// the last hundred count).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Operating(pub(super) Averages<2>);

impl Default for Operating {
    fn default() -> Self {
        Self(Averages::new(0.01))
    }
}

impl Operating {
    pub(super) fn observe(&mut self, o: &Decode) {
        if o.kv_fill.is_finite() && o.running.is_finite() {
            self.0.observe([o.kv_fill.clamp(0.0, 1.0), o.running.max(0.0)]);
        }
    }

    /// KV fill one running request adds, on average.
    pub(super) fn fill_per_request(&self) -> f64 {
        let [fill, running] = self.0.of;
        if running >= 1.0 { fill / running } else { 0.0 }
    }
}

/// The share of a decode step that one more running request adds (the
/// decode fit's marginal over its step at the operating point, both read
/// after each decode observation where the marginal is known), averaged
/// over about the last thousand. The step at the operating point is well
/// determined and follows a change of the engine's speed at once; the
/// marginal is the difference of nearly collinear terms under steady
/// load (a worker's running requests hardly vary), and it wanders: on
/// `vllm-v1` at concurrency 150 the decode price went 0.41 → 0.12 ms a
/// request within one measured window and 0.53 just after (the preset's
/// linear equivalent is 0.34; the fit's fixed part 0.4–22 ms), and `kv`
/// moved conversations as it rose. `kv` prices decode as the step now times this share
/// ([`EngineFit::marginal`](super::EngineFit::marginal)). Kept per ten requests (the
/// decode fit's unit); exported per request
/// ([`EngineFit::decode_share`](super::EngineFit::decode_share)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Share(pub(super) Averages<1>);

impl Default for Share {
    fn default() -> Self {
        Self(Averages::new(0.001))
    }
}

impl Share {
    /// Adds a share; one not finite or below zero is skipped.
    pub(super) fn observe(&mut self, share: f64) {
        if share.is_finite() && share >= 0.0 {
            self.0.observe([share]);
        }
    }

    /// The average, once one is in.
    pub(super) fn get(&self) -> Option<f64> {
        (self.0.weight >= 1.0).then_some(self.0.of[0])
    }
}

/// Prompts' tokens and their squares, averaged as [`Operating`] (the
/// matched intervals' means per request; the first tokens' new tokens):
/// the spread of the prompts a fit saw, along which its rate is read
/// ([`along`](super::reading::along)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Prompts(pub(super) Averages<2>);

impl Default for Prompts {
    fn default() -> Self {
        Self(Averages::new(0.01))
    }
}

impl Prompts {
    pub(super) fn observe(&mut self, mean: f64, square: f64) {
        if mean >= 0.0 && square >= 0.0 {
            self.0.observe([mean, square]);
        }
    }

    /// A short and a long prompt of the range: one standard deviation
    /// either side of the mean (not below 0), tokens; `None` before a
    /// spread of at least a block is seen.
    pub(super) fn range(&self) -> Option<(f64, f64)> {
        let (mean, sd) = (self.0.of[0], self.0.variance().max(0.0).sqrt());
        let (lo, hi) = ((mean - sd).max(0.0), mean + sd);
        (self.0.weight >= 1.0 && hi - lo >= 16.0).then_some((lo, hi))
    }
}

/// The warm requests' computed and cached tokens, per request, averaged as
/// [`Prompts`] (the matched intervals with one or more): the prompt at
/// which `kv` weighs workers holding more or less of a prefix
/// ([`compared`](super::reading::compared)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Warm(pub(super) Averages<2>);

impl Default for Warm {
    fn default() -> Self {
        Self(Averages::new(0.01))
    }
}

impl Warm {
    pub(super) fn observe(&mut self, m: &MatchedSums) {
        if m.warm >= 1.0 && m.warm_computed >= 0.0 && m.cached >= 0.0 {
            self.0.observe([m.warm_computed / m.warm, m.cached / m.warm]);
        }
    }

    /// A warm request's computed and cached tokens, once the warm requests
    /// seen followed a block (16 tokens) or more on average.
    pub(super) fn point(&self) -> Option<(f64, f64)> {
        let [computed, cached] = self.0.of;
        (self.0.weight >= 1.0 && cached >= 16.0).then_some((computed, cached))
    }
}

/// One estimate's misses on the matched engine intervals (engine time in
/// the gateway's clock, less the estimate's prefill for the interval's
/// prompts) and their squares, averaged (about the last fifty count).
/// Neither indirect estimate has the engine's fixed time per request, so
/// their constant miss is left out: what is scored is how the misses vary,
/// which an estimate whose rate is off makes grow with the spread of the
/// prompts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Scored(pub(super) Averages<2>);

impl Default for Scored {
    fn default() -> Self {
        Self(Averages::new(0.02))
    }
}

impl Scored {
    /// Misses before the variance is used.
    const MIN: f64 = 10.0;

    pub(super) fn observe(&mut self, miss: f64) {
        self.0.observe([miss, miss * miss]);
    }

    /// Variance of the misses, once enough are in and it is positive.
    pub(super) fn variance(&self) -> Option<f64> {
        let v = self.0.variance();
        (self.0.weight >= Self::MIN && v.is_finite() && v > 0.0).then_some(v)
    }
}

/// The last known rates (ms per token, ms per request) and their ratio
/// when both were known at once.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Held {
    pub(super) prefill: Option<f64>,
    pub(super) decode: Option<f64>,
    pub(super) ratio: Option<f64>,
}
