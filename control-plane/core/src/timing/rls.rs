//! Robust recursive least squares with exponential forgetting: the fit
//! under every learned timing.
//!
//! # Algorithm
//!
//! Fits `y ≈ θ · x` for `N` features, one observation at a time, with
//! `P` the coefficients' covariance in units of the noise variance `s²`:
//!
//! ```text
//! e = y − θ·x                          residual before the update
//! v = xᵀ·P·x                           the estimate's own variance at x
//! r = |e| / (s·√(1 + v))               standardized residual
//! w = min(1, c / r)                    Huber weight, c = 2.5
//! k = P·x / (λ/w + v)                  gain
//! θ ← θ + k·e
//! P ← (P − k·xᵀ·P) / λ                 forgetting λ < 1
//! s ← s + (1 − λ_s)·(1.25·min(|e|, c·s·√(1 + v)) − s)
//! ```
//!
//! `θ` starts at the prior and `P` at the prior's variance over the first
//! noise scale, so the first observations move the estimate in proportion
//! to how unsure the prior was; after `n` observations `P` is about
//! `(Σ x·xᵀ)⁻¹` whatever the noise, so the fit converges at the rate of
//! least squares. Forgetting (λ = 0.99: memory of ~100 observations) lets
//! it follow a fleet whose speed changes slowly. A step change (the engine
//! got 1.5× slower) shows as residuals of one sign, one after another,
//! which Huber's weight clips: a running mean of the clipped standardized
//! residuals beyond 1 (over four of its standard deviations for unbiased
//! noise) is taken for a change, and `P` is multiplied by 4 at once
//! (three quarters of what was learned forgotten), so the fit follows in
//! tens of observations instead of hundreds. A residual far outside the scale
//! (a GC pause, a request that queued for a batch slot) is clipped, not
//! believed, and moves the scale by a bounded step (Huber's proposal 2: the
//! clipped mean absolute residual, ×1.25 to read as a standard deviation
//! for normal noise), so 10 % of stalls cannot inflate it. Without new
//! information along some direction forgetting would grow `P` without
//! bound ("wind-up"): every coefficient's variance is capped at its prior's
//! (`P ← D·P·D`, `D_i = min(1, √(P0_ii / P_ii))`; a change inflates it no
//! further), so an idle direction returns to prior-like uncertainty and no
//! further, and the estimate drifts back to the prior
//! along the directions the data leave uncertain (idle, or a difference of
//! collinear coefficients):
//! `θ ← θ + (1 − λ)·P·P0⁻¹·(prior − θ)`, which leaves a well-determined
//! combination where the data put it. Standard errors are `s·√P_ii`.
//!
//! # Cost
//!
//! O(N²) time per observation and a fixed `N² + 3N` floats of memory,
//! whatever the number of observations.

/// Forgetting factor of the parameters: memory of about 1 / (1 − λ)
/// observations.
pub const FORGET: f64 = 0.99;
/// Observations beyond `HUBER_C` residual scales are down-weighted.
const HUBER_C: f64 = 2.5;
/// Forgetting factor of the residual scale.
const SCALE_FORGET: f64 = 0.95;
/// Mean absolute deviation to standard deviation, for normal noise.
const MAD_TO_SD: f64 = 1.25;
/// Forgetting factor of the running mean of standardized residuals.
const BIAS_FORGET: f64 = 0.9;
/// That mean beyond this many standard deviations is a change of the
/// engine, not noise: for unbiased noise it has a standard deviation of
/// √(0.1 / 1.9) ≈ 0.23, so 1.0 is over four of them.
const BIAS_ALARM: f64 = 1.0;
/// On a change, the coefficients' covariance is multiplied by this: three
/// quarters of what was learned is forgotten at once.
const CHANGE_INFLATE: f64 = 4.0;

/// One robust recursive least-squares fit of `N` coefficients.
#[derive(Debug, Clone, PartialEq)]
pub struct Rls<const N: usize> {
    theta: [f64; N],
    p: [[f64; N]; N],
    prior: [f64; N],
    /// The prior's variances (diagonal of the first `p`).
    p0: [f64; N],
    scale: f64,
    /// Running mean of the standardized, clipped residuals.
    bias: f64,
    samples: u64,
    rejected: u64,
    changes: u64,
}

impl<const N: usize> Rls<N> {
    /// A fit that starts at `prior` with standard deviations `prior_sd`
    /// (per coefficient, > 0) and a first residual scale `scale` (> 0).
    pub fn new(prior: [f64; N], prior_sd: [f64; N], scale: f64) -> Self {
        let scale = if scale.is_finite() && scale > 0.0 { scale } else { 1.0 };
        let prior_var = prior_sd.map(|s| if s.is_finite() && s > 0.0 { (s / scale).powi(2) } else { 1.0 });
        let mut p = [[0.0; N]; N];
        for (i, row) in p.iter_mut().enumerate() {
            if let Some(v) = row.get_mut(i) {
                *v = prior_var[i];
            }
        }
        Self { theta: prior, p, prior, p0: prior_var, scale, bias: 0.0, samples: 0, rejected: 0, changes: 0 }
    }

    /// Adds the observation `y` at features `x`. A non-finite input is
    /// ignored (counted as rejected); returns whether it was used.
    pub fn observe(&mut self, x: [f64; N], y: f64) -> bool {
        if !(y.is_finite() && x.iter().all(|v| v.is_finite())) {
            self.rejected += 1;
            return false;
        }
        let e = y - dot(&self.theta, &x);
        let mut px = mat_vec(&self.p, &x);
        let mut v = dot(&x, &px).max(0.0);
        // The residual's expected spread: noise plus the estimate's own
        // uncertainty at x (large while the fit is young).
        let mut spread = self.scale * (1.0 + v).sqrt();
        // A change of the engine: residuals of one sign, one after another.
        // Most of what was learned is forgotten at once, so the fit follows
        // within tens of observations instead of hundreds.
        if spread.is_finite() && spread > 0.0 {
            let z = (e / spread).clamp(-HUBER_C, HUBER_C);
            self.bias = BIAS_FORGET * self.bias + (1.0 - BIAS_FORGET) * z;
            if self.bias.abs() > BIAS_ALARM {
                self.bias = 0.0;
                self.changes += 1;
                let mut inflated = self.p;
                inflated.iter_mut().flatten().for_each(|q| *q *= CHANGE_INFLATE);
                cap_to(&mut inflated, &self.p0);
                self.p = inflated;
                px = mat_vec(&self.p, &x);
                v = dot(&x, &px).max(0.0);
                spread = self.scale * (1.0 + v).sqrt();
            }
        }
        let r = e.abs() / spread;
        let w = if r > HUBER_C { HUBER_C / r } else { 1.0 };
        let denom = FORGET / w + v;
        if !(denom.is_finite() && denom > 0.0 && spread.is_finite()) {
            self.rejected += 1;
            return false;
        }
        let k = px.map(|p| p / denom);
        let mut theta = self.theta;
        let mut p = self.p;
        for i in 0..N {
            theta[i] += k[i] * e;
            for j in 0..N {
                // P is symmetric: xᵀP = (Px)ᵀ, and k·xᵀP = Px·(Px)ᵀ / denom,
                // computed so that entries (i, j) and (j, i) round alike.
                // Written as k_i·(Px)_j they did not, and forgetting grows
                // the asymmetric part by 1/λ per observation (×e¹⁰ every
                // thousand): within a few thousand observations it took
                // over P and the coefficients ran off to 1e306.
                p[i][j] = (p[i][j] - px[i] * px[j] / denom) / FORGET;
            }
        }
        if !(theta.iter().all(|v| v.is_finite()) && p.iter().flatten().all(|v| v.is_finite())) {
            self.rejected += 1;
            return false;
        }
        // Anti-wind-up: no coefficient's uncertainty grows past its prior's.
        cap_to(&mut p, &self.p0);
        // Forgetting toward the prior: a coefficient the data do not pin
        // down (its variance back near the prior's: an idle or collinear
        // direction) drifts back to its prior at the forgetting rate instead
        // of wandering; a well-determined one does not move.
        // Along P·P0⁻¹: only the directions the data leave uncertain move
        // (a combination the data pin down, such as the sum of two
        // collinear coefficients, stays).
        let mut pull = [0.0; N];
        for (i, v) in pull.iter_mut().enumerate() {
            *v = (self.prior[i] - theta[i]) / self.p0[i];
        }
        let step = mat_vec(&p, &pull);
        let mut pulled = theta;
        for i in 0..N {
            pulled[i] += (1.0 - FORGET) * step[i];
        }
        // Round-off on extreme inputs can leave P indefinite: a pull that
        // is not finite, or that moves a coefficient more than twice its
        // distance to the prior, is not applied.
        let sane = (0..N).all(|i| {
            pulled[i].is_finite()
                && (pulled[i] - theta[i]).abs() <= (self.prior[i] - theta[i]).abs().max(f64::MIN_POSITIVE) * 2.0
        });
        if sane {
            theta = pulled;
        }
        self.theta = theta;
        self.p = p;
        // Huber's scale: a clipped residual moves the scale by at most
        // HUBER_C of itself, so a burst of stalls cannot inflate it.
        let clipped = e.abs().min(HUBER_C * spread) * MAD_TO_SD;
        let s = self.scale + (1.0 - SCALE_FORGET) * (clipped - self.scale);
        if s.is_finite() && s > 0.0 {
            self.scale = s;
        }
        self.samples += 1;
        true
    }

    /// The coefficients.
    pub fn theta(&self) -> [f64; N] {
        self.theta
    }

    /// The prior the fit started from.
    pub fn prior(&self) -> [f64; N] {
        self.prior
    }

    /// The prediction at `x`.
    pub fn predict(&self, x: &[f64; N]) -> f64 {
        dot(&self.theta, x)
    }

    /// Standard error of each coefficient (`√P_ii`, in its own units).
    pub fn stderr(&self) -> [f64; N] {
        let mut out = [0.0; N];
        for (i, o) in out.iter_mut().enumerate() {
            *o = self.scale * self.p[i][i].max(0.0).sqrt();
        }
        out
    }

    /// How much of each coefficient's prior variance is left (`P_ii / P0_ii`,
    /// in [0, 1] up to round-off): near 1 the data have not pinned it down,
    /// whatever the noise scale says.
    pub fn prior_share(&self) -> [f64; N] {
        let mut out = [0.0; N];
        for (i, o) in out.iter_mut().enumerate() {
            *o = (self.p[i][i] / self.p0[i]).max(0.0);
        }
        out
    }

    /// How much of the prior's variance of the prediction at `x` is left
    /// (as [`Rls::prior_share`] for one combination of coefficients).
    pub fn prior_share_at(&self, x: &[f64; N]) -> f64 {
        let prior: f64 = (0..N).map(|i| x[i] * x[i] * self.p0[i]).sum();
        if prior > 0.0 { (dot(x, &mat_vec(&self.p, x)) / prior).max(0.0) } else { 0.0 }
    }

    /// Standard error of the prediction at `x` (the estimate's, without
    /// the noise), same units as `y`.
    pub fn predict_stderr(&self, x: &[f64; N]) -> f64 {
        self.scale * dot(x, &mat_vec(&self.p, x)).max(0.0).sqrt()
    }

    /// Robust residual scale (same units as `y`).
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Changes detected (runs of residuals of one sign).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Observations used.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Observations ignored for non-finite inputs.
    pub fn rejected(&self) -> u64 {
        self.rejected
    }
}

fn dot<const N: usize>(a: &[f64; N], b: &[f64; N]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Scales `p` to `D·p·D` with `D_i = min(1, √(cap_i / p_ii))`: every
/// variance at most its cap, correlations kept, and still positive
/// semi-definite (a congruence). Capping the trace instead let an idle
/// direction near its prior hold the whole budget, and a detected change
/// could then not inflate the directions the data had pinned down.
fn cap_to<const N: usize>(p: &mut [[f64; N]; N], cap: &[f64; N]) {
    let mut d = [1.0; N];
    for (i, di) in d.iter_mut().enumerate() {
        let v = p[i][i];
        if v > cap[i] && v.is_finite() && v > 0.0 {
            *di = (cap[i] / v).sqrt();
        }
    }
    if d.iter().all(|di| *di == 1.0) {
        return;
    }
    for (i, row) in p.iter_mut().enumerate() {
        for (j, q) in row.iter_mut().enumerate() {
            *q *= d[i] * d[j];
        }
    }
}

fn mat_vec<const N: usize>(m: &[[f64; N]; N], x: &[f64; N]) -> [f64; N] {
    let mut out = [0.0; N];
    for (o, row) in out.iter_mut().zip(m) {
        *o = dot(row, x);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn noisy(rng: &mut fastrand::Rng, sd: f64) -> f64 {
        // Sum of uniforms: close enough to normal for a test.
        (0..12).map(|_| rng.f64()).sum::<f64>().mul_add(sd, -6.0 * sd)
    }

    #[test]
    fn recovers_known_coefficients_from_noisy_observations() {
        let truth = [13.0, 0.65, 8.0];
        let mut f = Rls::new([5.0, 0.2, 1.0], [20.0, 2.0, 20.0], 5.0);
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..400 {
            let x = [1.0, rng.f64() * 64.0, rng.f64() * 4.0];
            let y = dot(&truth, &x) + noisy(&mut rng, 1.0);
            assert!(f.observe(x, y));
        }
        let t = f.theta();
        for (got, want) in t.iter().zip(truth) {
            assert!((got - want).abs() < 0.05 * want + 0.3, "{t:?} vs {truth:?}");
        }
        assert!(f.stderr()[1] < 0.1, "{:?}", f.stderr());
    }

    #[test]
    fn outliers_are_clipped_not_believed() {
        let truth = [200.0, 0.08];
        let mut f = Rls::new([100.0, 0.1], [200.0, 0.5], 20.0);
        let mut rng = fastrand::Rng::with_seed(3);
        for i in 0..600 {
            let n = rng.f64() * 8000.0;
            let mut y = truth[0] + truth[1] * n + noisy(&mut rng, 5.0);
            if i % 10 == 0 {
                y += 5000.0; // a stall
            }
            f.observe([1.0, n], y);
        }
        let t = f.theta();
        assert!((t[1] - 0.08).abs() < 0.008, "{t:?}");
        assert!((t[0] - 200.0).abs() < 60.0, "{t:?}");
    }

    #[test]
    fn follows_a_change_within_a_few_hundred_observations() {
        let mut f = Rls::new([0.0, 0.0], [10.0, 10.0], 1.0);
        let mut rng = fastrand::Rng::with_seed(11);
        let mut feed = |f: &mut Rls<2>, slope: f64, n: usize| {
            for _ in 0..n {
                let x = [1.0, rng.f64() * 10.0];
                f.observe(x, 2.0 + slope * x[1] + noisy(&mut rng, 0.1));
            }
        };
        feed(&mut f, 1.0, 500);
        assert!((f.theta()[1] - 1.0).abs() < 0.02);
        // The fleet got 1.5× slower.
        feed(&mut f, 1.5, 300);
        assert!((f.theta()[1] - 1.5).abs() < 0.05, "{:?}", f.theta());
    }

    /// Tens of thousands of observations (a class's requests over an hour
    /// in production) leave the fit where the data put it: the covariance
    /// stays symmetric (it did not, and the coefficients ran off to 1e306
    /// within 5,000).
    #[test]
    fn a_long_run_stays_where_the_data_put_it() {
        let mut f = Rls::new([50.0, 100.0, 5.0], [500.0, 500.0, 25.0], 50.0);
        let mut rng = fastrand::Rng::with_seed(17);
        for _ in 0..50_000 {
            let x = [1.0, rng.f64() * 8.0, rng.f64() * 4.0];
            f.observe(x, 100.0 + 40.0 * x[1] + 6.5 * x[2] + noisy(&mut rng, 10.0));
        }
        let t = f.theta();
        assert!((t[0] - 100.0).abs() < 5.0 && (t[1] - 40.0).abs() < 1.0 && (t[2] - 6.5).abs() < 1.5, "{t:?}");
        assert!((0..3).all(|i| (0..3).all(|j| f.p[i][j] == f.p[j][i])), "{:?}", f.p);
    }

    /// A 1.5× slower engine is a run of residuals of one sign: detected
    /// (once or a few times), and followed within a hundred observations,
    /// not three hundred. Noise with stalls (a tenth of observations far
    /// above the line) is not a change.
    #[test]
    fn a_change_is_detected_and_followed_noise_is_not_a_change() {
        let mut f = Rls::new([50.0, 100.0, 5.0], [500.0, 500.0, 25.0], 50.0);
        let mut rng = fastrand::Rng::with_seed(17);
        let mut feed = |f: &mut Rls<3>, speed: f64, n: usize| {
            for i in 0..n {
                let x = [1.0, rng.f64() * 8.0, rng.f64() * 4.0];
                let stall = if i % 10 == 3 { 2_000.0 } else { 0.0 };
                let y = speed * (100.0 + 40.0 * x[1] + 6.5 * x[2]) + noisy(&mut rng, 10.0) + stall;
                f.observe(x, y);
            }
        };
        feed(&mut f, 1.0, 5_000);
        assert_eq!(f.changes(), 0, "{:?}", f.theta());
        assert!((f.theta()[1] - 40.0).abs() < 2.0, "{:?}", f.theta());
        feed(&mut f, 1.5, 100);
        let changes = f.changes();
        assert!((1..=3).contains(&changes), "{changes}: {:?}", f.theta());
        assert!((f.theta()[1] - 60.0).abs() < 3.0, "{:?}", f.theta());
        feed(&mut f, 1.5, 5_000);
        assert_eq!(f.changes(), changes);
    }

    #[test]
    fn an_idle_direction_does_not_wind_up() {
        let mut f = Rls::new([1.0, 1.0], [1.0, 1.0], 1.0);
        // Only the first feature ever varies.
        for _ in 0..100_000 {
            f.observe([1.0, 0.0], 1.0);
        }
        let trace = f.p[0][0] + f.p[1][1];
        assert!(trace <= f.p0.iter().sum::<f64>() + 1e-9, "{:?}", f.p);
        assert!(f.theta().iter().all(|v| v.is_finite()));
    }

    /// Two features that always move together cannot be told apart: their
    /// coefficients stay near the prior's split instead of running off in
    /// opposite directions, and the sum is still learned.
    #[test]
    fn collinear_features_stay_near_the_prior() {
        let mut f = Rls::new([0.0, 0.0, 0.0], [10.0, 10.0, 10.0], 1.0);
        let mut rng = fastrand::Rng::with_seed(5);
        for _ in 0..5_000 {
            let r = rng.f64() * 6.0;
            let x = [1.0, r, 0.5 * r + 0.001 * noisy(&mut rng, 1.0)];
            f.observe(x, 3.0 + 2.0 * r + noisy(&mut rng, 0.1));
        }
        let t = f.theta();
        assert!((t[1] + 0.5 * t[2] - 2.0).abs() < 0.05, "{t:?}");
        assert!(t[1].abs() < 5.0 && t[2].abs() < 10.0, "{t:?}");
    }

    #[test]
    fn non_finite_input_is_rejected() {
        let mut f = Rls::new([1.0], [1.0], 1.0);
        assert!(!f.observe([f64::NAN], 1.0));
        assert!(!f.observe([1.0], f64::INFINITY));
        assert_eq!((f.samples(), f.rejected(), f.theta()), (0, 2, [1.0]));
    }

    proptest! {
        #[test]
        fn estimates_stay_finite_whatever_the_input(
            obs in proptest::collection::vec((-1e9f64..1e9, -1e6f64..1e6, -1e12f64..1e12), 1..200),
        ) {
            let mut f = Rls::new([1.0, 1.0, 1.0], [10.0, 10.0, 10.0], 1.0);
            for (a, b, y) in obs {
                f.observe([1.0, a, b], y);
                prop_assert!(f.theta().iter().all(|v| v.is_finite()));
                prop_assert!(f.stderr().iter().all(|v| v.is_finite() && *v >= 0.0));
                prop_assert!(f.scale().is_finite() && f.scale() > 0.0);
            }
        }
    }
}
