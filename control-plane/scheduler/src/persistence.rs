//! How long a load difference between workers lasts.
//!
//! # Why
//!
//! `kv` prices a request's decode on a busy worker as if the worker stayed
//! that busy for the request's whole decode: `d·O × (2·running + 1)`. Under
//! a router that balances, it does not: the next requests that are free to
//! go anywhere (new conversations, prompts no worker holds) go to the less
//! loaded workers, and the difference fades long before a decode of ~800
//! tokens ends. Priced as if it lasted, a difference of a few running
//! requests outweighed a follow-up turn's cache hit and sent it away
//! (`dynamo-mocker` at 60 conversations: hit rate 95 % against 98.9 %).
//!
//! # Algorithm
//!
//! At each decision, at most once per `L/10` (`L` the mean request life,
//! from the gateway's durations, exponentially forgotten), every candidate's
//! running requests minus the candidates' mean, minus that worker's own
//! long-run offset (a slow worker of a mixed fleet keeps more requests for
//! good: that part does not fade, and routing already prices it through
//! its slower timing), is its deviation `e`. The correlation of each
//! worker's deviation with its previous sample, over the time `dt` between
//! them, `ρ = Σ e·e' / Σ e'²` (exponentially forgotten), gives the decay
//! time `τ = −dt / ln ρ`. A difference that decays with `τ` weighs, over a
//! request's life `L`, on average
//!
//! ```text
//! h = τ/L · (1 − e^(−L/τ))
//! ```
//!
//! of its start: 1 when it never fades, `τ/L` when it fades fast. `kv`
//! prices decode at `mean + h × (running − mean)` running requests.
//!
//! # Complexity
//!
//! | operation | time | memory |
//! |---|---|---|
//! | [`LoadPersistence::sample`] | O(candidates) at most once per `L/10`, else O(1) | O(workers) |
//! | [`LoadPersistence::ended`], [`LoadPersistence::factor`] | O(1) | — |

use kvgate_index::WorkerIdx;

/// Weight kept per new sample (the last ~100 samples count).
const KEEP: f64 = 0.99;
/// Weight kept per new sample of a worker's long-run offset (~200
/// samples, 25 request lives).
const KEEP_OFFSET: f64 = 0.995;
/// Weight kept per request life observed (~100).
const KEEP_LIFE: f64 = 0.99;
/// Correlated samples before the factor is trusted (about two request
/// lives of sampling: in a benchmark cell of 20 s at speed-up 8, 50 came
/// so late that most of the window was priced as before).
const MIN_PAIRS: f64 = 20.0;
/// Request lives before sampling starts.
const MIN_LIVES: f64 = 10.0;
/// Samples per request life.
const PER_LIFE: f64 = 10.0;

/// One worker's last sample.
#[derive(Debug, Clone, Copy)]
struct Last {
    worker: WorkerIdx,
    deviation: f64,
    /// Its long-run mean deviation.
    offset: f64,
}

/// How long load differences between a model's workers last (see the
/// module's documentation).
#[derive(Debug, Clone, Default)]
pub struct LoadPersistence {
    /// By worker, sorted.
    last: Vec<Last>,
    last_ms: Option<u64>,
    /// Σ e·e', Σ e'², Σ dt, pairs: exponentially forgotten.
    xy: f64,
    xx: f64,
    dt_ms: f64,
    pairs: f64,
    /// Σ life, Σ 1: exponentially forgotten.
    life_ms: f64,
    lives: f64,
}

impl LoadPersistence {
    /// Nothing learned: [`LoadPersistence::factor`] is `None`.
    pub fn new() -> Self {
        Self::default()
    }

    /// A request ended after `ms` (routing to its last token).
    pub fn ended(&mut self, ms: f64) {
        if ms.is_finite() && ms > 0.0 {
            self.life_ms = self.life_ms * KEEP_LIFE + ms;
            self.lives = self.lives * KEEP_LIFE + 1.0;
        }
    }

    /// The mean request life, once enough were seen.
    pub fn life_ms(&self) -> Option<f64> {
        (self.lives >= MIN_LIVES).then(|| self.life_ms / self.lives)
    }

    /// The candidates' running requests at `now_ms`, `(worker, running)`;
    /// kept when a sample is due.
    pub fn sample(&mut self, now_ms: u64, running: &[(WorkerIdx, f64)]) {
        let Some(life) = self.life_ms() else { return };
        let period = (life / PER_LIFE).max(1.0);
        let dt = self.last_ms.map(|t| now_ms.saturating_sub(t) as f64);
        if dt.is_some_and(|dt| dt < period) || running.len() < 2 {
            return;
        }
        let n = running.len() as f64;
        let mean = running.iter().map(|(_, r)| r).sum::<f64>() / n;
        // A long gap is not one step of decay: start over from here.
        let paired = dt.is_some_and(|dt| dt <= 4.0 * period);
        let mut next = Vec::with_capacity(running.len());
        let (mut xy, mut xx) = (0.0, 0.0);
        for &(worker, r) in running {
            let raw = r - mean;
            if !raw.is_finite() {
                continue;
            }
            let before = self.last.binary_search_by_key(&worker, |l| l.worker).ok().and_then(|i| self.last.get(i));
            let offset = before.map_or(0.0, |b| b.offset) * KEEP_OFFSET + raw * (1.0 - KEEP_OFFSET);
            let deviation = raw - offset;
            if let Some(b) = before.filter(|_| paired) {
                xy += b.deviation * deviation;
                xx += b.deviation * b.deviation;
            }
            next.push(Last { worker, deviation, offset });
        }
        next.sort_by_key(|l| l.worker);
        self.last = next;
        self.last_ms = Some(now_ms);
        if let Some(dt) = dt.filter(|_| paired && xx > 0.0) {
            self.xy = self.xy * KEEP + xy;
            self.xx = self.xx * KEEP + xx;
            self.dt_ms = self.dt_ms * KEEP + dt;
            self.pairs = self.pairs * KEEP + 1.0;
        }
    }

    /// The decay time of a load difference, ms, once measured.
    pub fn decay_ms(&self) -> Option<f64> {
        if self.pairs < MIN_PAIRS || self.xx <= 0.0 {
            return None;
        }
        let rho = (self.xy / self.xx).clamp(1e-3, 1.0 - 1e-9);
        Some(-(self.dt_ms / self.pairs) / rho.ln())
    }

    /// `h`: the share of a load difference a request lives with, on
    /// average over its life (1: all of it); `None` until measured.
    pub fn factor(&self) -> Option<f64> {
        let x = self.life_ms()? / self.decay_ms()?;
        let h = if x < 1e-6 { 1.0 } else { (1.0 - (-x).exp()) / x };
        h.is_finite().then_some(h.clamp(0.0, 1.0))
    }

    /// Once measured, what gives the running requests a decode on a worker
    /// (`worker`, `running` now; `mean` the candidates') lives with on
    /// average: its lasting offset in full, the rest of its difference from
    /// the mean by [`LoadPersistence::factor`] (computed once per decision,
    /// not per candidate).
    pub fn decode_running(&self, mean: f64) -> Option<impl Fn(WorkerIdx, f64) -> f64 + '_> {
        let h = self.factor()?;
        Some(move |worker: WorkerIdx, running: f64| {
            let at = self.last.binary_search_by_key(&worker, |l| l.worker).ok().and_then(|i| self.last.get(i));
            let offset = at.map_or(0.0, |l| l.offset);
            let r = mean + offset + h * (running - mean - offset);
            if r.is_finite() { r.max(0.0) } else { running }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fed(mut p: LoadPersistence, decay_ms: f64, life_ms: f64, seed: u64) -> LoadPersistence {
        let mut rng = fastrand::Rng::with_seed(seed);
        for _ in 0..100 {
            p.ended(life_ms);
        }
        // Four workers whose deviations follow an AR(1) process with the
        // given decay time, sampled every millisecond of simulated time.
        let mut dev = [0.0f64; 4];
        let step = 1.0;
        let keep = (-step / decay_ms).exp();
        let noise = (1.0 - keep * keep).sqrt();
        for t in 0..200_000u64 {
            for d in &mut dev {
                *d = *d * keep + noise * 5.0 * (rng.f64() - 0.5) * 3.46;
            }
            let run: Vec<_> = dev.iter().enumerate().map(|(i, d)| (WorkerIdx(i as u32), 20.0 + d)).collect();
            p.sample(t, &run);
        }
        p
    }

    #[test]
    fn recovers_the_decay_time_of_load_differences() {
        for (decay, life) in [(500.0, 4_000.0), (2_000.0, 4_000.0), (20_000.0, 4_000.0)] {
            let p = fed(LoadPersistence::new(), decay, life, 7);
            let got = p.decay_ms().unwrap();
            assert!((got / decay - 1.0).abs() < 0.25, "decay {decay}: {got}");
            let x: f64 = life / decay;
            let h = p.factor().unwrap();
            assert!((h / ((1.0 - (-x).exp()) / x) - 1.0).abs() < 0.15, "decay {decay}: h {h}");
        }
    }

    #[test]
    fn a_worker_that_always_holds_more_is_not_a_lasting_difference() {
        // Worker 0 always runs 10 more (a slower class): its offset is
        // learned and only the fading part counts.
        let mut p = LoadPersistence::new();
        for _ in 0..100 {
            p.ended(4_000.0);
        }
        let mut rng = fastrand::Rng::with_seed(3);
        for t in 0..300_000u64 {
            let run: Vec<_> =
                (0..4u32).map(|i| (WorkerIdx(i), 20.0 + if i == 0 { 10.0 } else { 0.0 } + 4.0 * rng.f64())).collect();
            p.sample(t, &run);
        }
        // Independent noise: no correlation from one sample to the next.
        assert!(p.factor().unwrap() < 0.2, "{:?}", p.factor());
    }

    #[test]
    fn nothing_is_claimed_before_it_is_measured() {
        let mut p = LoadPersistence::new();
        assert_eq!(p.factor(), None);
        p.sample(0, &[(WorkerIdx(0), 1.0), (WorkerIdx(1), 3.0)]);
        assert_eq!(p.factor(), None);
        for _ in 0..100 {
            p.ended(f64::NAN);
            p.ended(-1.0);
        }
        assert_eq!(p.life_ms(), None);
    }
}
