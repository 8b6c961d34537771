//! Reading a fit: when a coefficient counts as known, and a prefill rate
//! read along the prompts a fit saw or at the choice `kv` makes.

use super::super::rls::Rls;
use super::averages::Scored;
use super::{K, MIN_SAMPLES};

/// The standard error, as a share of an estimate's size, below which it is
/// known ([`known`]); the matched fit is read at the warm choice only from
/// [`QUARTER`], and takes over alone only at [`TENTH`].
pub(super) const HALF: f64 = 0.5;
pub(super) const QUARTER: f64 = 0.25;
pub(super) const TENTH: f64 = 0.1;

/// Whether an estimate is known: enough samples, finite, the prior's share
/// in it below a tenth, and its standard error below half its size (sizes
/// below a tenth of the prior, in the fit's units, count as a tenth).
pub(super) fn known(v: f64, se: f64, share: f64, samples: u64, prior: f64) -> bool {
    known_within(v, se, share, samples, prior, HALF)
}

/// [`known`], to `within` of the estimate's size instead of a half.
pub(super) fn known_within(v: f64, se: f64, share: f64, samples: u64, prior: f64, within: f64) -> bool {
    samples >= MIN_SAMPLES && v.is_finite() && share < 0.1 && se < within * v.abs().max(0.1 * prior)
}

/// Coefficient `i` of `fit` with its standard error, when known and above
/// zero.
pub(super) fn known_positive<const N: usize>(fit: &Rls<N>, i: usize, prior: f64) -> Option<(f64, f64)> {
    let (v, se) = (*fit.theta().get(i)?, *fit.stderr().get(i)?);
    let share = *fit.prior_share().get(i)?;
    (v > 0.0 && known(v, se, share, fit.samples(), prior)).then_some((v, se))
}

/// Coefficient `i` of `fit` when known and clearly above zero (three
/// standard errors).
pub(super) fn clearly_positive<const N: usize>(fit: &Rls<N>, i: usize, prior: f64) -> Option<f64> {
    known_positive(fit, i, prior).filter(|(v, se)| *v > 3.0 * se).map(|(v, _)| v)
}

/// How much of coefficient `i` of `fit` to keep, by how well it is known:
/// `1 − (2·se / v)²` for a value `v` above zero, none below two standard
/// errors (and none for a value at or below zero, or not finite). A
/// shrinkage rather than a cut, so that a term near the line does not come
/// and go at once.
pub(super) fn shrunk<const N: usize>(fit: &Rls<N>, i: usize) -> f64 {
    let (Some(&v), Some(&se)) = (fit.theta().get(i), fit.stderr().get(i)) else { return 0.0 };
    if !(v > 0.0 && v.is_finite() && se.is_finite()) {
        return 0.0;
    }
    (1.0 - (2.0 * se / v).powi(2)).clamp(0.0, 1.0)
}

/// A prefill rate that grows with the chunk (coefficients 1 and 2 of a
/// fit whose features are `n` and `n²` in thousands of tokens), read along
/// the prompts it saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Along {
    /// Mean rate from a short to a long prompt of the range, and its
    /// standard error.
    pub(super) mean: f64,
    pub(super) se: f64,
    /// The rate and its growth to price with: the fit's own where both
    /// are positive, else the mean with no growth.
    pub(super) rate: f64,
    pub(super) growth: f64,
    /// Its growth with the cached context the chunk follows (the matched
    /// fit's term where clearly above zero, three standard errors); else 0.
    pub(super) context: f64,
}

/// `fit`'s prefill rate read along `range` (tokens, [`Prompts::range`](super::averages::Prompts::range)),
/// when known to `within` of its size (as [`known_within`], for that
/// combination of its terms; with no range, the rate alone). On one
/// workload's prompts the rate and its growth are nearly collinear: the
/// mean rate over the range is known well before each term is (on
/// `vllm-v1` and `dynamo-mocker` the matched fit's terms were each known
/// only after 420–510 requests, 52f7e45; the first token's growth was
/// dropped for being within three standard errors of zero, and the rate
/// priced alone was 16–22 % off, dff640f).
pub(super) fn along<const N: usize>(fit: &Rls<N>, range: Option<(f64, f64)>, prior: f64, within: f64) -> Option<Along> {
    let mut d = [0.0; N];
    let width = match range {
        Some((lo, hi)) => {
            let (lo, hi) = (lo / K, hi / K);
            *d.get_mut(1)? = hi - lo;
            *d.get_mut(2)? = hi * hi - lo * lo;
            hi - lo
        }
        None => {
            *d.get_mut(1)? = 1.0;
            1.0
        }
    };
    let (v, se) = (fit.predict(&d) / width, fit.predict_stderr(&d) / width);
    if !(v > 0.0 && known_within(v, se, fit.prior_share_at(&d), fit.samples(), prior, within)) {
        return None;
    }
    let t = fit.theta();
    let (rate, growth) = (*t.get(1)?, *t.get(2)?);
    Some(if range.is_some() && rate > 0.0 && growth >= 0.0 {
        Along { mean: v, se, rate, growth, context: 0.0 }
    } else {
        Along::flat(v, se)
    })
}

/// The matched fit (features `1, N, N², N·c, S` in thousands of tokens)
/// read at the choice `kv` makes for a warm prompt of `n` computed tokens
/// after `c` cached ones (`warm`, [`Warm::point`](super::averages::Warm::point)): a worker holding more
/// or less of its prefix, where a token moves between the cached and the
/// computed part. What the fit must know, to `within` of its size (as
/// [`known_within`]), is the price of that token: the prefill's change
/// per token moved, `b + 2n·g + (c − n)·h` (rate, growth with the chunk,
/// growth with the context); `None` before, or without warm prompts. On
/// DOKS turns (900 new after 5,000 cached) the fit's rate of a prompt
/// without context is an extrapolation the prompts never pin down
/// (`vllm-v1`: 0.0019 ± 0.0133 ms a token, engine clock), so read along the
/// computed tokens alone it was not known to a half, while its cost at the
/// turns' context was within 5 % of the preset's (6ba510e).
///
/// Priced with the fit's own terms where its growths are not negative
/// (a context term below zero counts as zero, if that moves the price of
/// the cached token by less than its standard error) and its rate of a
/// prompt without context is at least half that price or itself known to
/// a half; else flat at the price of the cached token: `kv` also prices a
/// block of queued prefill at the rate, and a rate that is an unknown
/// extrapolation a tenth of the cached token's would make a queue nearly
/// free. A rate the cold prompts pin down is the engine's, however far
/// below the cached token's: on `dynamo-mocker` a context term of 7 ms a
/// token per 1,000 tokens of context (warm turns' fixed costs read as
/// context) put the cached token at 3.7 times the cold rate, and priced
/// flat there the cold prompts were 180 % off and the run took 688
/// requests to within 10 % instead of 292 (replayed on its journal).
pub(super) fn compared(fit: &Rls<6>, warm: Option<(f64, f64)>, prior: f64, within: f64) -> Option<Along> {
    let (n, c) = warm?;
    let (n, c) = (n.max(0.0) / K, c / K);
    let d = [0.0, 1.0, 2.0 * n, c - n, 0.0, 0.0];
    let (v, se) = (fit.predict(&d), fit.predict_stderr(&d));
    if !(v > 0.0 && known_within(v, se, fit.prior_share_at(&d), fit.samples(), prior, within)) {
        return None;
    }
    let t = fit.theta();
    let (rate, growth, context) = (t[1], t[2], t[3].max(0.0));
    let own = rate + 2.0 * n * growth + (c - n) * context;
    let rate_known = known_positive(fit, 1, prior).is_some();
    // A context term below zero but within two of its standard errors is
    // zero as far as the data can tell, however surely the rest of the
    // price is known: compared with the price's standard error instead,
    // it sent `dynamo-mocker`'s price flat the moment that error shrank
    // (a context term of −0.00057 ± 0.00039 ms a token per 1,000 tokens,
    // the rest of the fit within 3 % of the formula), and the cold
    // prompts were priced 22–34 % off for 60 requests.
    let terms = Terms { rate, growth, context: t[3], context_se: fit.stderr()[3] };
    Some(if (rate >= v / 2.0 || rate_known) && terms.price_by_terms(own, v, se) {
        Along { mean: v, se, rate, growth, context }
    } else {
        Along::flat(v, se)
    })
}

/// The matched fit's prefill terms as [`compared`] reads them (fit units).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Terms {
    pub(super) rate: f64,
    pub(super) growth: f64,
    pub(super) context: f64,
    pub(super) context_se: f64,
}

impl Terms {
    /// Whether a price whose cached token costs `v ± se` (fit's own terms:
    /// `own`, the context counted from 0) is priced with the terms rather
    /// than flat: the growth not negative, and the context term not
    /// clearly below zero (two standard errors) or, if it is, moving the
    /// price by less than its standard error.
    pub(super) fn price_by_terms(&self, own: f64, v: f64, se: f64) -> bool {
        let context_nil = self.context >= -2.0 * self.context_se;
        self.growth >= 0.0 && (context_nil || (own - v).abs() <= se)
    }
}

impl Along {
    /// A rate with no growth.
    pub(super) fn flat(mean: f64, se: f64) -> Self {
        Self { mean, se, rate: mean, growth: 0.0, context: 0.0 }
    }

    /// The same price in a clock `q` times as slow.
    pub(super) fn scaled(self, q: f64) -> Self {
        Self {
            mean: self.mean * q,
            se: self.se * q,
            rate: self.rate * q,
            growth: self.growth * q,
            context: self.context * q,
        }
    }
}

/// The weights of two estimates scored on the same intervals: each the
/// other's share of the two variances of their misses (inverse-variance
/// weights); `None` before both were scored on enough.
pub(super) fn by_misses((a, b): &(Scored, Scored)) -> Option<(f64, f64)> {
    let (va, vb) = (a.variance()?, b.variance()?);
    Some((vb / (va + vb), va / (va + vb)))
}

/// Two estimates of one quantity, (value, standard error), averaged by
/// precision; the first when a standard error is not positive.
pub(super) fn by_precision(a: (f64, f64), b: (f64, f64)) -> (f64, f64) {
    let (wa, wb) = (1.0 / (a.1 * a.1), 1.0 / (b.1 * b.1));
    if !(wa.is_finite() && wb.is_finite() && wa > 0.0 && wb > 0.0) {
        return a;
    }
    ((wa * a.0 + wb * b.0) / (wa + wb), (wa + wb).sqrt().recip())
}

pub(super) fn finite_nonneg(v: f64) -> f64 {
    if v.is_finite() { v.max(0.0) } else { 0.0 }
}
