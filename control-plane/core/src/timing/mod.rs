//! Online calibration: how fast each class of worker serving a model
//! prefills and decodes, learned from the requests it serves, so that the
//! `kv` policy prices its choices in this fleet's time, not in a preset's.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | [`Calibration`]: per-request bookkeeping (routed → first token → done), per-worker activity, one fit per class |
//! | [`fit`] | [`EngineFit`]: the first-token, decode-step and engine-prefill fits and what `kv` takes from them (its own module map) |
//! | [`rls`] | robust recursive least squares with forgetting |
//!
//! A worker's class is what its heartbeats say about its hardware: its KV
//! capacity and running limit (a different GPU, tensor-parallel size or
//! quantization changes the capacity). Workers of one class share a fit;
//! workers without heartbeats share the class `unknown`.
//!
//! | operation | cost |
//! |---|---|
//! | [`Calibration::routed`], [`Calibration::touch`] | O(1) |
//! | [`Calibration::first_token`], [`Calibration::done`], [`Calibration::engine_counters`] | O(classes) (one fit update: 6², 4² or 2² multiply-adds; every class's timing refreshed) |
//! | [`Calibration::expire`] | O(requests open) |
//!
//! Memory: one record per request in flight (dropped at its end or its
//! expiry), one activity record per worker (with up to `MAX_ENDED`
//! ended requests' token counts where its engine reports its totals), one
//! fit per class (at most [`MAX_CLASSES`]).

pub mod fit;
pub mod rls;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use kvgate_index::WorkerIdx;
use kvgate_protocol::pb;
use kvgate_scheduler::{EngineTiming, Load};

pub use fit::{
    Decode, EngineFit, EnginePrefill, FirstToken, Learned, MatchedSums, Observation, PrefillFrom, Prior, Readings,
    Reference, Scores,
};

/// Classes beyond this many share the class `other`.
pub const MAX_CLASSES: usize = 32;

/// The class of workers without a heartbeat (static workers).
pub const UNKNOWN_CLASS: &str = "unknown";

/// A worker's class from its measured load.
pub fn class_of(load: &Load) -> String {
    match (load.capacity_blocks, load.max_running) {
        (Some(blocks), Some(seqs)) => format!("blocks={blocks},seqs={seqs}"),
        (Some(blocks), None) => format!("blocks={blocks}"),
        _ => UNKNOWN_CLASS.to_owned(),
    }
}

/// Distinct class names kept for sharing.
const MAX_NAMES: usize = 64;

/// `name` as one shared string per class (up to [`MAX_NAMES`] names).
fn intern(names: &mut Vec<Arc<str>>, name: String) -> Arc<str> {
    if let Some(known) = names.iter().find(|n| ***n == *name) {
        return Arc::clone(known);
    }
    let name: Arc<str> = name.into();
    if names.len() < MAX_NAMES {
        names.push(Arc::clone(&name));
    }
    name
}

/// Time-weighted integrals of a worker's load, in the control plane's
/// clock.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Integrals {
    last_ms: u64,
    running: f64,
    fill: f64,
    running_ms: f64,
    fill_ms: f64,
    fill_sq_ms: f64,
    /// Uncached prompt tokens routed to the worker (predicted), cumulative.
    prefill_tokens: f64,
    /// Each of those times the cached tokens it follows (predicted),
    /// cumulative.
    prefill_pairs: f64,
    /// Uncached prompt tokens of its requests whose first token came
    /// (their prefill is done), cumulative.
    prefilled_tokens: f64,
}

/// A worker: its class (and the capacity and running limit it was named
/// from), and its integrals.
#[derive(Debug, Clone, Default)]
struct Activity {
    /// Shared with its open requests (no allocation per Pick).
    class: Arc<str>,
    hardware: (Option<u64>, Option<u32>),
    sums: Integrals,
    /// Its engine's request-timing totals at the last heartbeat.
    engine: Option<pb::EngineCounters>,
    /// The requests the gateway saw end on it, in the order their reports
    /// came, not yet matched to an engine interval.
    ended: VecDeque<Ended>,
    /// Engine intervals not yet matched, summed, and the heartbeats they
    /// have waited.
    owed: Option<(EnginePrefill, u32)>,
}

/// A request the gateway saw end, as an engine interval is matched to it.
#[derive(Debug, Clone, Copy)]
struct Ended {
    /// Its computed (uncached) prompt tokens.
    computed: f64,
    /// The cached prompt tokens they followed.
    cached: f64,
    /// Other requests' prompt tokens the worker prefilled while it waited
    /// for its first token, and those still to prefill beside it when it
    /// came: what may have shared its steps.
    shared: f64,
    /// Of those done while it waited, at most the prefill pending when it
    /// was routed (the queue ahead of it).
    queued: f64,
    /// The worker's running requests and KV fill when its first token came
    /// (when it was routed, without a first-token report).
    at_first: (f64, f64),
}

/// What became of a worker's engine intervals at a heartbeat.
#[derive(Debug, Clone, Copy)]
enum Resolved {
    /// None finished, or their requests' reports have not all come yet.
    Waiting,
    /// Given up: some of their requests did not come through this gateway
    /// (or reported out of order). What the engine said, summed.
    Unmatched(EnginePrefill),
    /// The requests the gateway saw end: the intervals summed, and what
    /// the gateway knows of those requests ([`MatchedSums`]).
    Matched { engine: EnginePrefill, sums: MatchedSums },
}

/// Requests kept per worker for matching engine intervals.
const MAX_ENDED: usize = 1024;

/// Heartbeats an engine interval waits for the reports of its requests
/// before it is given up (some of them did not come through this
/// gateway).
const MAX_OWED: u32 = 3;

impl Integrals {
    fn advance(&mut self, now_ms: u64) {
        let dt = now_ms.saturating_sub(self.last_ms) as f64;
        self.running_ms += self.running * dt;
        self.fill_ms += self.fill * dt;
        self.fill_sq_ms += self.fill * self.fill * dt;
        self.last_ms = self.last_ms.max(now_ms);
    }
}

/// A request between its routing and its end.
#[derive(Debug, Clone)]
struct Open {
    worker: WorkerIdx,
    class: Arc<str>,
    added_ms: u64,
    predicted_cached: f64,
    /// Predicted uncached prompt tokens.
    new_tokens: f64,
    ahead_tokens: f64,
    running: f64,
    saturated: bool,
    /// The worker's integrals when it was routed (its own prefill counted).
    start: Integrals,
    first: Option<Integrals>,
    /// Its first token was learned from when it came (see
    /// [`Calibration::first_token`]).
    learned_first: bool,
}

/// What happened to observations, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimingCounters {
    /// First-token observations learned from.
    pub first_tokens: u64,
    /// Decode observations learned from.
    pub decodes: u64,
    /// Requests that found their worker at its running limit: their first
    /// token measured a wait for a slot, not compute.
    pub queued: u64,
    /// Completed requests without what a fit needs (no usage, an error
    /// status, a single output token, not streamed).
    pub unusable: u64,
    /// First tokens learned from the routing's predicted prompt split
    /// whose usage then reported another (by more than a block).
    pub mispredicted: u64,
    /// Heartbeat intervals whose engine-reported prefill times were
    /// learned from.
    pub engine_prefills: u64,
    /// Engine intervals matched to the requests the gateway saw end
    /// (learned with their squares).
    pub engine_matched: u64,
    /// Engine intervals that could not be matched (requests that did not
    /// come through this gateway, reports out of order).
    pub engine_unmatched: u64,
    /// Matched engine intervals whose requests shared their prefill steps
    /// with more prefill than their own ([`fit::SHARED_MAX`]): learned by the
    /// matched fit with the shared prefill as a term (up to
    /// [`fit::SHARED_LEARNED_MAX`] times their own), not by the straight
    /// line.
    pub engine_shared: u64,
}

impl TimingCounters {
    /// Every counter with its `kind` label (destructured without `..`: a
    /// new counter does not compile until it is exported).
    pub fn by_kind(&self) -> [(&'static str, u64); 9] {
        let Self {
            first_tokens,
            decodes,
            queued,
            unusable,
            mispredicted,
            engine_prefills,
            engine_matched,
            engine_unmatched,
            engine_shared,
        } = *self;
        [
            ("first_token", first_tokens),
            ("decode", decodes),
            ("queued", queued),
            ("unusable", unusable),
            ("mispredicted", mispredicted),
            ("engine_prefill", engine_prefills),
            ("engine_matched", engine_matched),
            ("engine_unmatched", engine_unmatched),
            ("engine_shared", engine_shared),
        ]
    }
}

/// One model's calibration.
#[derive(Debug)]
pub struct Calibration {
    prior: Prior,
    learn: bool,
    block_size: f64,
    classes: BTreeMap<String, EngineFit>,
    /// Each class's [`EngineFit::timing`], refreshed when it learns.
    timings: BTreeMap<String, EngineTiming>,
    open: HashMap<String, Open>,
    /// Class names, shared by the workers of a class (at most
    /// [`MAX_NAMES`]; beyond, a worker's name is its own).
    names: Vec<Arc<str>>,
    /// By worker index (a small integer of ours: a fast hash).
    activity: HashMap<WorkerIdx, Activity, foldhash::fast::RandomState>,
    /// Each worker's class (as in its activity), by worker index: what a
    /// Pick reads for every candidate, kept apart from the large activity
    /// records (at 1,000 workers their lookups were a twentieth of a Pick).
    class_of_worker: Vec<Option<Arc<str>>>,
    counters: TimingCounters,
    /// Every observation a fit learned from, by class, once asked for
    /// ([`Calibration::journal_take`]); `None` until then.
    journal: Option<Journal>,
}

/// Observations kept for [`Calibration::journal_take`]: at most
/// [`JOURNAL_MAX`], the oldest dropped (and counted) beyond.
#[derive(Debug, Default)]
struct Journal {
    records: VecDeque<(Arc<str>, Observation)>,
    dropped: u64,
}

/// Observations a journal keeps between two takes (a calibration run
/// takes them twice a second; ~100 bytes each).
pub const JOURNAL_MAX: usize = 200_000;

impl Calibration {
    /// Starts at `prior`. With `learn` false, observations are still fitted
    /// (and exported) but [`Calibration::timing`] returns `None`: the
    /// policy uses its configured constants.
    pub fn new(prior: Prior, learn: bool, block_size: u32) -> Self {
        Self {
            prior,
            learn,
            block_size: f64::from(block_size.max(1)),
            classes: BTreeMap::new(),
            timings: BTreeMap::new(),
            open: HashMap::new(),
            names: Vec::new(),
            activity: HashMap::default(),
            class_of_worker: Vec::new(),
            counters: TimingCounters::default(),
            journal: None,
        }
    }

    /// Whether the policy is given the learned timing.
    pub fn learns(&self) -> bool {
        self.learn
    }

    /// The timing the policy should use for `worker` (its class's); `None`
    /// when not learning.
    pub fn timing(&self, worker: WorkerIdx) -> Option<EngineTiming> {
        if !self.learn {
            return None;
        }
        Some(self.class_timing(self.class_name(worker)))
    }

    /// [`Calibration::timing`] for many workers in a row (a Pick's
    /// candidates): a class's timing is looked up once for a run of
    /// workers of that class, not once per worker.
    pub fn timings(&self) -> impl FnMut(WorkerIdx) -> Option<EngineTiming> + '_ {
        let mut last: Option<(&str, EngineTiming)> = None;
        move |worker| {
            if !self.learn {
                return None;
            }
            let class = self.class_name(worker);
            // Interned names: the same class is the same string.
            if let Some((c, t)) = last
                && std::ptr::eq(c, class)
            {
                return Some(t);
            }
            let t = self.class_timing(class);
            last = Some((class, t));
            Some(t)
        }
    }

    fn class_name(&self, worker: WorkerIdx) -> &str {
        self.class_of_worker.get(worker.0 as usize).and_then(Option::as_deref).unwrap_or(UNKNOWN_CLASS)
    }

    fn class_timing(&self, class: &str) -> EngineTiming {
        self.timings
            .get(self.class_key(class))
            .copied()
            .unwrap_or(EngineTiming::linear(self.prior.prefill_ms_per_token, self.prior.decode_ms_per_seq))
    }

    /// The worker's load changed (or is about to be read): integrates the
    /// old load up to `now_ms` and keeps the new one.
    pub fn touch(&mut self, worker: WorkerIdx, load: &Load, now_ms: u64) {
        let a = self.activity.entry(worker).or_insert_with(|| Activity {
            class: Arc::from(""),
            hardware: (None, None),
            sums: Integrals { last_ms: now_ms, ..Integrals::default() },
            engine: None,
            ended: VecDeque::new(),
            owed: None,
        });
        // Named again only when the hardware it reports changes (no
        // allocation on every Pick).
        let hardware = (load.capacity_blocks, load.max_running);
        if a.class.is_empty() || (hardware.0.is_some() && hardware != a.hardware) {
            a.class = intern(&mut self.names, class_of(load));
            a.hardware = hardware;
            let i = worker.0 as usize;
            if self.class_of_worker.len() <= i {
                self.class_of_worker.resize(i + 1, None);
            }
            if let Some(c) = self.class_of_worker.get_mut(i) {
                *c = Some(a.class.clone());
            }
        }
        let a = &mut a.sums;
        a.advance(now_ms);
        let limit = load.max_running.filter(|m| *m > 0).unwrap_or(u32::MAX);
        a.running = f64::from(load.effective_requests().min(limit));
        a.fill = load.kv_fill().unwrap_or(0.0);
    }

    /// A request was routed to `worker`, whose load was `before` (without
    /// it); `new_blocks` and `cached_blocks` are its predicted uncached and
    /// cached prompt (the cached count stands in when the engine does not
    /// report `cached_tokens`).
    pub fn routed(
        &mut self,
        request_id: &str,
        worker: WorkerIdx,
        before: &Load,
        (new_blocks, cached_blocks): (u64, u64),
        now_ms: u64,
    ) {
        self.touch(worker, before, now_ms);
        let Some(a) = self.activity.get_mut(&worker) else { return };
        let new_tokens = new_blocks as f64 * self.block_size;
        a.sums.prefill_tokens += new_tokens;
        a.sums.prefill_pairs += new_tokens * cached_blocks as f64 * self.block_size;
        let (class, start) = (Arc::clone(&a.class), a.sums);
        self.open.insert(
            request_id.to_owned(),
            Open {
                worker,
                class,
                added_ms: now_ms,
                predicted_cached: cached_blocks as f64 * self.block_size,
                new_tokens,
                ahead_tokens: before.prefill_pending_blocks as f64 * self.block_size,
                running: f64::from(before.effective_requests()),
                saturated: before.queued_if_added() > 0,
                start,
                first: None,
                learned_first: false,
            },
        );
    }

    /// A request's first token was reported, `ttfb_us` after it was sent
    /// (0: not measured). With a measurement the first-token fit learns
    /// now, from the routing's predicted split of the prompt (the usage
    /// comes with the end, a whole decode later: after the engine changed,
    /// the requests in flight went on teaching the old speed for about as
    /// many requests as were in flight); else it learns at the end.
    pub fn first_token(&mut self, request_id: &str, ttfb_us: u64, now_ms: u64) {
        let Some(o) = self.open.get_mut(request_id) else { return };
        if o.first.is_some() {
            return;
        }
        let Some(a) = self.activity.get_mut(&o.worker) else { return };
        a.sums.advance(now_ms);
        let f = a.sums;
        o.first = Some(f);
        a.sums.prefilled_tokens += o.new_tokens;
        if ttfb_us == 0 || o.saturated {
            return;
        }
        let ft = FirstToken {
            ttft_ms: ttfb_us as f64 / 1000.0,
            new_tokens: o.new_tokens,
            cached_tokens: o.predicted_cached,
            ahead_tokens: (f.prefilled_tokens - o.start.prefilled_tokens).max(0.0),
            running: o.running,
        };
        o.learned_first = true;
        let class = Arc::clone(&o.class);
        if self.learn(&class, Observation::FirstToken(ft)) {
            self.counters.first_tokens += 1;
        }
        self.refresh_timings();
    }

    /// A heartbeat of `worker` carried its engine's request-timing totals:
    /// what grew since the last one (the requests that finished meanwhile)
    /// is learned from once the requests the gateway saw end there add up
    /// to the same computed tokens: by the matched fit, with what the
    /// gateway knows of them, and by the straight line unless they shared
    /// their prefill steps with more prefill than their own; or by the
    /// straight line alone once their reports are given up (they did not
    /// come through this gateway). Totals that fell (the engine restarted)
    /// start over.
    pub fn engine_counters(&mut self, worker: WorkerIdx, totals: &pb::EngineCounters) {
        let Some(a) = self.activity.get_mut(&worker) else { return };
        let Some(before) = a.engine.replace(*totals) else {
            a.ended.clear();
            return;
        };
        let Some(delta) = EnginePrefill::between(totals, &before) else {
            (a.ended, a.owed) = (VecDeque::new(), None);
            return;
        };
        let resolved = Self::match_ended(a, &delta);
        let class = Arc::clone(&a.class);
        self.learn(&class, Observation::EngineItl(delta));
        let (line, shape, crowded) = match resolved {
            Resolved::Waiting => (false, false, false),
            Resolved::Unmatched(o) => (self.learn(&class, Observation::Engine(o)), false, false),
            Resolved::Matched { engine, sums } => {
                let crowded = engine.crowded(&sums);
                let line = !crowded && self.learn(&class, Observation::Engine(engine));
                (line, self.learn(&class, Observation::EngineMatched { engine, sums }), crowded)
            }
        };
        let c = &mut self.counters;
        c.engine_prefills += u64::from(line);
        c.engine_matched += u64::from(shape);
        c.engine_unmatched += u64::from(matches!(resolved, Resolved::Unmatched(_)));
        c.engine_shared += u64::from(crowded);
        if line || shape {
            self.refresh_timings();
        }
    }

    /// The engine intervals owed so far, `delta` added, against the
    /// requests the gateway saw end on the worker, in order.
    fn match_ended(a: &mut Activity, delta: &EnginePrefill) -> Resolved {
        let (mut owed, waited) = a.owed.take().unwrap_or_default();
        owed.add(delta);
        let k = owed.requests as usize;
        if k == 0 {
            return Resolved::Waiting;
        }
        if a.ended.len() < k {
            if waited + 1 > MAX_OWED {
                a.ended.clear();
                return Resolved::Unmatched(owed);
            }
            a.owed = Some((owed, waited + 1));
            return Resolved::Waiting;
        }
        let (sum, sums) = a.ended.drain(..k).fold((0.0, MatchedSums::default()), |(s, mut m), e| {
            m.add(e.computed, e.cached, e.shared, e.queued, e.at_first);
            (s + e.computed, m)
        });
        if (sum - owed.computed_tokens).abs() > 0.5 {
            // Misaligned (a request of this interval reported late, or one
            // the engine counted that never came through here): start over.
            a.ended.clear();
            return Resolved::Unmatched(owed);
        }
        Resolved::Matched { engine: owed, sums }
    }

    /// `class`'s fit learns from `o` (kept in the journal when there is
    /// one); returns whether it was used ([`EngineFit::apply`]).
    fn learn(&mut self, class: &Arc<str>, o: Observation) -> bool {
        if let Some(j) = self.journal.as_mut() {
            if j.records.len() >= JOURNAL_MAX {
                j.records.pop_front();
                j.dropped += 1;
            }
            j.records.push_back((Arc::clone(class), o));
        }
        self.fit_mut(class).is_some_and(|f| f.apply(&o))
    }

    /// The observations learned from since the last take, each with its
    /// worker class, and how many were dropped for want of room
    /// ([`JOURNAL_MAX`]). The first take starts the journal (and returns
    /// nothing): a control plane nobody asks keeps none.
    pub fn journal_take(&mut self) -> (Vec<(Arc<str>, Observation)>, u64) {
        match self.journal.as_mut() {
            Some(j) => (j.records.drain(..).collect(), std::mem::take(&mut j.dropped)),
            None => {
                self.journal = Some(Journal::default());
                (Vec::new(), 0)
            }
        }
    }

    /// The class's fit, new at the prior when it has none (its name is
    /// copied only then).
    fn fit_mut(&mut self, class: &str) -> Option<&mut EngineFit> {
        let key = self.class_key(class);
        if !self.classes.contains_key(key) {
            self.classes.insert(key.to_owned(), EngineFit::new(self.prior));
        }
        self.classes.get_mut(key)
    }

    /// A request ended: learns from it when it can.
    pub fn done(&mut self, r: &pb::CompletionReport, now_ms: u64) {
        let Some(o) = self.open.remove(&r.request_id) else { return };
        // vLLM reports cached tokens only with --enable-prompt-tokens-details;
        // without, the router's own prediction stands in.
        let predicted = o.predicted_cached.min(f64::from(u32::MAX)) as u32;
        let usage = r.prompt_tokens.map(|p| (p, r.cached_tokens.unwrap_or(predicted)));
        let ok = (200..300).contains(&r.status_code) && r.ttfb_us > 0 && r.total_us >= r.ttfb_us;
        let Some((prompt, cached)) = usage.filter(|_| ok) else {
            self.counters.unusable += 1;
            return;
        };
        // The prefill queued ahead: what the worker finished of other
        // requests' prompts while this one waited for its first token (in
        // first-come order, the prompts ahead of it and those that shared
        // its steps), when its first token was reported; else what was
        // pending when it was routed, which counts prompts already done but
        // not yet reported and misses those that came after it.
        let ahead_tokens = match o.first {
            Some(f) => (f.prefilled_tokens - o.start.prefilled_tokens).max(0.0),
            None => o.ahead_tokens,
        };
        // The prefill its engine-timed prefill may have shared steps with:
        // what was done while it waited, and what was still in flight
        // beside it when its first token came.
        let shared_tokens =
            ahead_tokens + o.first.map_or(0.0, |f| (f.prefill_tokens - f.prefilled_tokens - o.new_tokens).max(0.0));
        let new_tokens = f64::from(prompt.saturating_sub(cached));
        let now = self.activity.get_mut(&o.worker).map(|a| {
            if o.first.is_none() {
                // Its prefill ended before its end report, unreported.
                a.sums.prefilled_tokens += o.new_tokens;
            }
            // Kept for matching only where the engine reports its totals.
            if a.engine.is_some() {
                if a.ended.len() == MAX_ENDED {
                    a.ended.pop_front();
                }
                a.ended.push_back(Ended {
                    computed: new_tokens,
                    cached: f64::from(cached.min(prompt)),
                    shared: shared_tokens,
                    queued: ahead_tokens.min(o.ahead_tokens),
                    at_first: o.first.map_or((o.start.running, o.start.fill), |f| (f.running, f.fill)),
                });
            }
            a.sums.advance(now_ms);
            a.sums
        });
        let first = (!o.saturated && !o.learned_first).then(|| FirstToken {
            ttft_ms: r.ttfb_us as f64 / 1000.0,
            new_tokens,
            cached_tokens: f64::from(cached.min(prompt)),
            ahead_tokens,
            running: o.running,
        });
        if o.saturated {
            self.counters.queued += 1;
        } else if o.learned_first && (new_tokens - o.new_tokens).abs() > self.block_size {
            // Learned at the first token from the prediction; the usage
            // says whether that was the split the engine ran.
            self.counters.mispredicted += 1;
        }
        // The decode window: from a first-token report when there was one
        // before the end, else from the routing (without one, e.g. with the
        // filter's `reports.first_token` off; decode is most of a stream's
        // life).
        let steps = r.output_tokens.unwrap_or(0).saturating_sub(1);
        let decode_ms = (r.total_us - r.ttfb_us) as f64 / 1000.0;
        let from = match o.first {
            Some(f) if now.is_some_and(|n| f.last_ms < n.last_ms) => f,
            _ => o.start,
        };
        let decode = now.filter(|now| r.stream && steps > 0 && now.last_ms > from.last_ms).map(|now| {
            let window = (now.last_ms - from.last_ms) as f64;
            Decode {
                itl_ms: decode_ms / f64::from(steps),
                running: (now.running_ms - from.running_ms) / window,
                kv_fill: (now.fill_ms - from.fill_ms) / window,
                prefill_tokens_per_step: (now.prefill_tokens - from.prefill_tokens) / f64::from(steps),
                prefill_context_per_step: (now.prefill_pairs - from.prefill_pairs) / f64::from(steps),
            }
        });
        let first_used = first.is_some_and(|ft| self.learn(&o.class, Observation::FirstToken(ft)));
        let decode_used = decode.is_some_and(|d| {
            self.learn(&o.class, Observation::GatewayItl { ms: decode_ms, intervals: f64::from(steps) });
            self.learn(&o.class, Observation::Decode(d))
        });
        self.counters.first_tokens += u64::from(first_used);
        self.counters.decodes += u64::from(decode_used);
        self.counters.unusable += u64::from(decode.is_none());
        self.refresh_timings();
    }

    /// Every class's timing, each with the best-known class (both rates
    /// learned, the most first-token samples) to borrow a ratio from.
    fn refresh_timings(&mut self) {
        let reference = self.classes.values().filter_map(EngineFit::reference).max_by_key(|r| r.samples);
        for (class, fit) in &self.classes {
            let t = fit.timing_with(reference);
            match self.timings.get_mut(class) {
                Some(old) => *old = t,
                None => {
                    self.timings.insert(class.clone(), t);
                }
            }
        }
    }

    /// Forgets a request without learning from it.
    pub fn forget(&mut self, request_id: &str) {
        self.open.remove(request_id);
    }

    /// Forgets requests routed more than `ttl_ms` ago (their end was lost).
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) {
        self.open.retain(|_, o| now_ms.saturating_sub(o.added_ms) <= ttl_ms);
    }

    /// Forgets a worker (its fit stays with its class).
    pub fn remove_worker(&mut self, worker: WorkerIdx) {
        self.activity.remove(&worker);
        if let Some(c) = self.class_of_worker.get_mut(worker.0 as usize) {
            *c = None;
        }
        self.open.retain(|_, o| o.worker != worker);
    }

    /// Every class's fit.
    pub fn classes(&self) -> impl Iterator<Item = (&str, &EngineFit)> {
        self.classes.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The counters.
    pub fn counters(&self) -> TimingCounters {
        self.counters
    }

    /// Requests being followed.
    pub fn open_requests(&self) -> usize {
        self.open.len()
    }

    /// `class`, or `other` once [`MAX_CLASSES`] exist and it is not one.
    fn class_key<'a>(&self, class: &'a str) -> &'a str {
        if self.classes.contains_key(class) || self.classes.len() < MAX_CLASSES { class } else { "other" }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRIOR: Prior = Prior { prefill_ms_per_token: 0.1, decode_ms_per_seq: 0.5 };

    fn load(inflight: u32, pending_blocks: u64) -> Load {
        Load {
            inflight,
            prefill_pending_blocks: pending_blocks,
            capacity_blocks: Some(1000),
            max_running: Some(64),
            ..Load::default()
        }
    }

    fn report(id: &str, ttft_ms: u64, total_ms: u64, prompt: u32, cached: u32, output: u32) -> pb::CompletionReport {
        pb::CompletionReport {
            request_id: id.to_owned(),
            status_code: 200,
            ttfb_us: ttft_ms * 1000,
            total_us: total_ms * 1000,
            prompt_tokens: Some(prompt),
            cached_tokens: Some(cached),
            output_tokens: Some(output),
            stream: true,
            ..Default::default()
        }
    }

    /// Requests through routed → first token → done against an engine
    /// whose prefill costs 0.2 ms per token and whose decode step costs
    /// 10 ms + 1.5 ms per running request: the class learns both, and the
    /// timing the policy gets is the learned one.
    #[test]
    fn a_class_learns_its_engine_from_request_lifecycles() {
        let mut cal = Calibration::new(PRIOR, true, 16);
        let w = WorkerIdx(3);
        let mut rng = fastrand::Rng::with_seed(5);
        let mut now = 1_000u64;
        assert_eq!(cal.timing(w), Some(EngineTiming::linear(0.1, 0.5)));
        for i in 0..400 {
            let running = rng.u32(0..40);
            let (prompt, cached) = (rng.u32(1000..9000), rng.u32(0..1000));
            let new = prompt - cached;
            let id = format!("r{i}");
            let before = load(running, 0);
            cal.routed(&id, w, &before, (u64::from(new / 16), 0), now);
            // The request itself runs too while it decodes.
            cal.touch(w, &load(running + 1, 0), now);
            let ttft = 20 + (0.2 * f64::from(new)) as u64 + rng.u64(0..10);
            // The end is always reported; a first-token report may come
            // too (streams, with the filter's `reports.first_token`).
            if i % 2 == 0 {
                cal.first_token(&id, ttft * 1000, now + ttft);
            }
            let steps = 50u32;
            let itl = 10.0 + 1.5 * f64::from(running + 1);
            let total = ttft + (itl * f64::from(steps)) as u64;
            cal.done(&report(&id, ttft, total, prompt, cached, steps + 1), now + total);
            cal.touch(w, &load(running, 0), now + total);
            now += total + 5;
        }
        let c = cal.counters();
        assert_eq!((c.first_tokens, c.decodes, c.queued, c.unusable), (400, 400, 0, 0));
        assert_eq!(cal.open_requests(), 0);
        let t = cal.timing(w).unwrap_or(EngineTiming::linear(0.0, 0.0));
        assert!((t.prefill_ms_per_token - 0.2).abs() < 0.02, "{t:?}");
        assert!((t.decode_ms_per_seq - 1.5).abs() < 0.15, "{t:?}");
        let classes: Vec<&str> = cal.classes().map(|(k, _)| k).collect();
        assert_eq!(classes, ["blocks=1000,seqs=64"]);
    }

    /// The journal holds every observation the fits learned from, in
    /// order, from the first take on: replayed through JSON (as
    /// `kvgate-bench calibration-replay` reads it) into a fresh fit, it
    /// gives the live fit exactly, every kind of observation included.
    /// Without a take there is no journal; beyond its room the oldest
    /// records go, counted.
    #[test]
    fn a_journal_replayed_gives_the_live_fit() {
        let w = WorkerIdx(0);
        // One request learned from before the journal starts.
        let started = || {
            let mut cal = Calibration::new(PRIOR, true, 16);
            cal.touch(w, &load(0, 0), 0);
            cal.routed("before", w, &load(0, 0), (10, 0), 0);
            cal.done(&report("before", 40, 400, 200, 0, 20), 400);
            cal
        };
        let mut cal = started();
        let mut rng = fastrand::Rng::with_seed(9);
        assert!(cal.journal.is_none(), "no journal before it is asked for");
        assert_eq!(cal.journal_take(), (Vec::new(), 0));
        let (mut requests, mut seconds, mut tokens, mut now) = (0u64, 0.0, 0u64, 1_000u64);
        for i in 0..300 {
            let (prompt, cached) = (rng.u32(200..6000), if i % 3 == 0 { 0 } else { rng.u32(0..150) });
            let (new, running) = (prompt - cached, rng.u32(0..30));
            let id = format!("r{i}");
            cal.routed(&id, w, &load(running, 0), (u64::from(new / 16), u64::from(cached / 16)), now);
            let ttft = 20 + (0.1 * f64::from(new)) as u64 + rng.u64(0..10);
            if i % 2 == 0 {
                cal.first_token(&id, ttft * 1000, now + ttft);
            }
            let total = ttft + 30 * (10 + u64::from(running));
            cal.done(&report(&id, ttft, total, prompt, cached, 31), now + total);
            now += total;
            // The engine counts it, matched at the next heartbeat (and
            // every seventh never came through here: given up).
            requests += 1;
            seconds += 0.0001 * f64::from(new) + 0.01;
            tokens += u64::from(new) + u64::from(i % 7 == 0);
            let totals = pb::EngineCounters {
                prefill_seconds: seconds,
                prefill_requests: requests,
                prefill_computed_tokens: tokens,
                itl_seconds: requests as f64 * 0.3,
                itl_count: requests * 30,
            };
            cal.engine_counters(w, &totals);
        }
        let (records, dropped) = cal.journal_take();
        assert_eq!(dropped, 0);
        let kinds: std::collections::BTreeSet<String> = records
            .iter()
            .filter_map(|(_, o)| serde_json::to_value(o).ok()?["kind"].as_str().map(str::to_owned))
            .collect();
        let all = ["decode", "engine", "engine_itl", "engine_matched", "first_token", "gateway_itl"];
        assert_eq!(kinds.iter().map(String::as_str).collect::<Vec<_>>(), all);
        // The fit as it was at the first take, then the journal through JSON.
        let Some((class, fit)) = started().classes.pop_first() else { panic!("no class") };
        let mut replayed = fit;
        for (c, o) in &records {
            assert_eq!(&**c, class);
            let back: Observation = serde_json::from_str(&serde_json::to_string(o).unwrap_or_default())
                .unwrap_or(Observation::GatewayItl { ms: 0.0, intervals: 0.0 });
            assert_eq!(&back, o);
            replayed.apply(&back);
        }
        let live = cal.classes().next().map(|(_, f)| f.admin_json());
        assert_eq!(Some(replayed.admin_json()), live);
        // Room for JOURNAL_MAX: the oldest go first.
        for _ in 0..JOURNAL_MAX + 5 {
            cal.learn(&class.as_str().into(), Observation::GatewayItl { ms: 1.0, intervals: 1.0 });
        }
        let (records, dropped) = cal.journal_take();
        assert_eq!((records.len(), dropped), (JOURNAL_MAX, 5));
    }

    /// Heartbeats carry the engine's running totals: each interval's growth
    /// is one observation, learned as a straight line once its requests'
    /// reports are given up (none came through this gateway); totals that
    /// fall (the engine restarted) are skipped, and the next interval
    /// counts from the new totals.
    #[test]
    fn engine_totals_are_learned_by_their_growth_between_heartbeats() {
        let mut cal = Calibration::new(PRIOR, true, 16);
        let w = WorkerIdx(0);
        let totals = |requests: u64, seconds: f64, tokens: u64| pb::EngineCounters {
            prefill_seconds: seconds,
            prefill_requests: requests,
            prefill_computed_tokens: tokens,
            itl_seconds: requests as f64,
            itl_count: requests * 10,
        };
        let given_up = |cal: &mut Calibration, t: &pb::EngineCounters| {
            for _ in 0..=MAX_OWED {
                cal.engine_counters(w, t);
            }
        };
        // Unknown worker (no heartbeat with its load yet): nothing kept.
        cal.engine_counters(w, &totals(1, 0.1, 100));
        cal.touch(w, &load(0, 0), 0);
        cal.engine_counters(w, &totals(10, 1.0, 1000));
        assert_eq!(cal.counters().engine_prefills, 0, "a first total is a baseline");
        given_up(&mut cal, &totals(15, 1.5, 1500));
        let c = cal.counters();
        assert_eq!((c.engine_prefills, c.engine_unmatched), (1, 1), "learned once given up, not before");
        given_up(&mut cal, &totals(15, 1.5, 1500));
        assert_eq!(cal.counters().engine_prefills, 1, "an interval without finished requests teaches no prefill");
        cal.engine_counters(w, &totals(2, 0.2, 200));
        assert_eq!(cal.counters().engine_prefills, 1, "a restart is skipped");
        given_up(&mut cal, &totals(4, 0.4, 400));
        assert_eq!(cal.counters().engine_prefills, 2);
        let fit = cal.classes().next().map(|(_, f)| f.engine_prefill());
        assert_eq!(fit.map(|f| f.samples), Some(2));
    }

    /// The requests the gateway saw end on a worker are matched to the
    /// engine's intervals by count and computed tokens: an interval whose
    /// requests all reported is learned with their squares; one reported
    /// late waits for them; one with a request the gateway never saw is
    /// given up after a few heartbeats.
    #[test]
    fn engine_intervals_are_matched_to_the_requests_the_gateway_saw_end() {
        let mut cal = Calibration::new(PRIOR, true, 16);
        let w = WorkerIdx(0);
        let (mut requests, mut tokens) = (0u64, 0u64);
        let mut heartbeat = |cal: &mut Calibration, finished: &[u32]| {
            requests += finished.len() as u64;
            tokens += finished.iter().map(|n| u64::from(*n)).sum::<u64>();
            let totals = pb::EngineCounters {
                prefill_seconds: requests as f64 * 0.1,
                prefill_requests: requests,
                prefill_computed_tokens: tokens,
                itl_seconds: 0.0,
                itl_count: 0,
            };
            cal.engine_counters(w, &totals);
        };
        let mut n = 0;
        let mut end = |cal: &mut Calibration, prompt: u32, cached: u32| {
            n += 1;
            let id = format!("r{n}");
            cal.routed(&id, w, &load(0, 0), (u64::from((prompt - cached) / 16), 0), 0);
            cal.done(&report(&id, 50, 500, prompt, cached, 10), 1);
        };
        cal.touch(w, &load(0, 0), 0);
        heartbeat(&mut cal, &[]);
        // Two requests end and are reported, then the engine counts them.
        end(&mut cal, 1000, 200);
        end(&mut cal, 3000, 0);
        heartbeat(&mut cal, &[800, 3000]);
        assert_eq!((cal.counters().engine_matched, cal.counters().engine_unmatched), (1, 0));
        // The engine counts one the gateway reports only after the
        // heartbeat: matched at the next one.
        heartbeat(&mut cal, &[500]);
        end(&mut cal, 500, 0);
        heartbeat(&mut cal, &[]);
        assert_eq!((cal.counters().engine_matched, cal.counters().engine_unmatched), (2, 0));
        // One that never came through here: given up after MAX_OWED more.
        heartbeat(&mut cal, &[700]);
        for _ in 0..MAX_OWED {
            heartbeat(&mut cal, &[]);
        }
        assert_eq!((cal.counters().engine_matched, cal.counters().engine_unmatched), (2, 1));
        // A report whose tokens disagree with the engine's: not matched.
        end(&mut cal, 900, 0);
        heartbeat(&mut cal, &[901]);
        assert_eq!((cal.counters().engine_matched, cal.counters().engine_unmatched), (2, 2));
        end(&mut cal, 400, 0);
        heartbeat(&mut cal, &[400]);
        assert_eq!((cal.counters().engine_matched, cal.counters().engine_unmatched), (3, 2));
        let fit = cal.classes().next().map(|(_, f)| f.engine_matched().samples);
        assert_eq!(fit, Some(3));
    }

    /// The engine times a prefill from the step that first scheduled it:
    /// prompts that shared their steps (a burst of cold prompts) each count
    /// the others' chunks as their own. An interval whose requests waited
    /// for more of other requests' prefill than their own teaches the
    /// matched fit (the shared prefill is a term of its own there) but not
    /// the straight line, and beyond three times their own neither; one of
    /// a prompt that ran alone teaches both.
    #[test]
    fn prefills_that_shared_their_steps_teach_only_the_matched_fit() {
        let mut cal = Calibration::new(PRIOR, true, 16);
        let w = WorkerIdx(0);
        let totals = |requests: u64, tokens: u64| pb::EngineCounters {
            prefill_seconds: requests as f64 * 0.5,
            prefill_requests: requests,
            prefill_computed_tokens: tokens,
            itl_seconds: 0.0,
            itl_count: 0,
        };
        cal.touch(w, &load(0, 0), 0);
        cal.engine_counters(w, &totals(0, 0));
        // `k` 1,600-token prompts routed together, each one's first token
        // after those ahead of it: every one shares with the k − 1 others
        // (done while it waited, or still to do beside it).
        let mut done = 0;
        let mut burst = |cal: &mut Calibration, k: u64, at: u64| {
            let ids: Vec<String> = (0..k).map(|i| format!("burst{at}-{i}")).collect();
            // Each routed with those before it pending.
            for (i, id) in (0..).zip(&ids) {
                cal.routed(id, w, &load(i, 100 * u64::from(i)), (100, 0), at);
            }
            for (i, id) in (1..).zip(&ids) {
                cal.first_token(id, i * 100_000, at + i * 100);
            }
            for id in &ids {
                cal.done(&report(id, 100, 2000, 1600, 0, 10), at + 1000);
            }
            done += k;
            cal.engine_counters(w, &totals(done, done * 1600));
            let c = cal.counters();
            (c.engine_prefills, c.engine_matched, c.engine_shared)
        };
        cal.journal_take();
        // Five: four times their own shared, too crowded to learn from.
        assert_eq!(burst(&mut cal, 5, 0), (0, 0, 1));
        // Three: twice their own, learned by the matched fit only.
        assert_eq!(burst(&mut cal, 3, 2000), (0, 1, 2));
        // Of what they shared, the prompts pending when each was routed
        // and done before its first token are its queue: request i (from
        // 0) shared 2 × 1,600 tokens, i × 1,600 of them done before it.
        let matched: Vec<MatchedSums> = cal
            .journal_take()
            .0
            .into_iter()
            .filter_map(|(_, o)| match o {
                Observation::EngineMatched { sums, .. } => Some(sums),
                _ => None,
            })
            .collect();
        let last = matched.last().map(|m| (m.shared, m.queued));
        assert_eq!(last, Some((3.0 * 2.0 * 1600.0, (0.0 + 1.0 + 2.0) * 1600.0)));
        // One prompt alone.
        assert_eq!(burst(&mut cal, 1, 4000), (1, 2, 2));
    }

    /// Two classes of one model: the fast one sees cold prompts of every
    /// length, the slow one (both rates 2× slower) only cached prompts with
    /// a few new tokens, so its prefill rate is never pinned down. It
    /// borrows the fast class's measured prefill-to-decode ratio (0.3:
    /// 0.6 ms per token at 2 ms per request), not the priors' (0.2: 0.4).
    #[test]
    fn a_class_without_prefill_data_borrows_a_sibling_classs_ratio() {
        let mut cal = Calibration::new(PRIOR, true, 16);
        let (fast, slow) = (WorkerIdx(0), WorkerIdx(1));
        let hw = |blocks: u64, inflight: u32| Load { capacity_blocks: Some(blocks), ..load(inflight, 0) };
        let mut rng = fastrand::Rng::with_seed(9);
        let mut now = 1_000u64;
        for i in 0..600 {
            let (w, blocks, prefill, decode) = if i % 2 == 0 { (fast, 1000, 0.3, 1.0) } else { (slow, 500, 0.6, 2.0) };
            let running = rng.u32(1..40);
            let (prompt, cached) = if w == fast { (rng.u32(100..8000), 0) } else { (5_050 + rng.u32(0..20), 5_000) };
            let id = format!("r{i}");
            cal.routed(&id, w, &hw(blocks, running), (u64::from((prompt - cached) / 16), 0), now);
            cal.touch(w, &hw(blocks, running + 1), now);
            let ttft = 20 + (prefill * f64::from(prompt - cached)) as u64 + rng.u64(0..5);
            let steps = 50u32;
            let itl = 5.0 + decode * f64::from(running + 1);
            let total = ttft + (itl * f64::from(steps)) as u64;
            cal.done(&report(&id, ttft, total, prompt, cached, steps + 1), now + total);
            cal.touch(w, &hw(blocks, running), now + total);
            now += total + 5;
        }
        let (f, s) = (
            cal.timing(fast).unwrap_or(EngineTiming::linear(0.0, 0.0)),
            cal.timing(slow).unwrap_or(EngineTiming::linear(0.0, 0.0)),
        );
        assert!((f.prefill_ms_per_token - 0.3).abs() < 0.03 && (f.decode_ms_per_seq - 1.0).abs() < 0.1, "{f:?}");
        assert!((s.decode_ms_per_seq - 2.0).abs() < 0.2, "{s:?}");
        assert!((s.prefill_ms_per_token - 0.6).abs() < 0.08, "borrowed ratio: {s:?}");
        // Alone, the slow class would keep the priors' ratio (0.2).
        let alone = cal.classes().find(|(k, _)| *k == "blocks=500,seqs=64").map(|(_, f)| f.timing());
        assert!(alone.is_some_and(|t| (t.prefill_ms_per_token - 0.2 * t.decode_ms_per_seq).abs() < 1e-9), "{alone:?}");
    }

    /// The prefill queued ahead is what the worker did while a request
    /// waited, not what was pending when it was routed: a long prompt is
    /// prefilled in chunks, and short prompts that come after it share its
    /// steps and finish first (more of them the longer it is), while it
    /// delays none of them. Engine: 0.2 ms per prefilled token, the
    /// worker's own and the others' done meanwhile. Priced by what was
    /// pending at routing, the long prompts' waits for the short ones read
    /// as a higher rate per token and the short ones' "queue" as free.
    #[test]
    fn the_prefill_queued_ahead_is_what_the_worker_did_meanwhile() {
        let mut cal = Calibration::new(PRIOR, true, 16);
        let w = WorkerIdx(0);
        let mut rng = fastrand::Rng::with_seed(21);
        let mut now = 1_000u64;
        for round in 0..200 {
            let long = 16 * rng.u64(60..500);
            let shorts = long / 800;
            let long_id = format!("l{round}");
            cal.routed(&long_id, w, &load(1, 0), (long / 16, 0), now);
            cal.touch(w, &load(2, long / 16), now);
            for i in 0..shorts {
                let id = format!("s{round}-{i}");
                cal.routed(&id, w, &load(2 + i as u32, (long + 96 * i) / 16), (6, 0), now + 1);
                let ttft = 20 + (0.2 * 96.0 * (i + 1) as f64) as u64 + rng.u64(0..3);
                cal.first_token(&id, ttft * 1000, now + 1 + ttft);
                cal.done(&report(&id, ttft, ttft + 100, 96, 0, 11), now + 1 + ttft + 100);
            }
            let ttft = 20 + (0.2 * (long + 96 * shorts) as f64) as u64 + rng.u64(0..3);
            cal.first_token(&long_id, ttft * 1000, now + ttft);
            cal.done(&report(&long_id, ttft, ttft + 100, long as u32, 0, 11), now + ttft + 100);
            cal.touch(w, &load(1, 0), now + ttft + 100);
            now += ttft + 200;
        }
        let t = cal.timing(w).unwrap_or(EngineTiming::linear(0.0, 0.0));
        assert!((t.prefill_ms_per_token - 0.2).abs() < 0.01, "{t:?}");
        let fit = cal.classes().next().map(|(_, f)| f.first_token());
        let queued = fit.as_ref().and_then(|l| l.params.iter().find(|p| p.name == "queued_prefill_ms_per_token"));
        assert!(queued.is_some_and(|p| (p.value - 0.2).abs() < 0.02), "{fit:?}");
    }

    /// A first token is learned when it is reported, from the routing's
    /// predicted split: the fit knows it a whole decode before the end
    /// report comes. The end report then only says whether the prediction
    /// held (here the engine had evicted the predicted prefix).
    #[test]
    fn a_first_token_is_learned_when_it_comes_and_checked_at_the_end() {
        let mut cal = Calibration::new(PRIOR, true, 16);
        let w = WorkerIdx(0);
        cal.routed("a", w, &load(1, 0), (10, 100), 0);
        cal.first_token("a", 40_000, 40);
        assert_eq!(cal.counters().first_tokens, 1, "learned at the first token");
        cal.done(&report("a", 40, 900, 1760, 1600, 50), 900);
        cal.routed("b", w, &load(1, 0), (10, 100), 1000);
        cal.first_token("b", 40_000, 1040);
        cal.done(&report("b", 40, 1900, 1760, 0, 50), 1900);
        // Without a measured time to first token, it is learned at the end.
        cal.routed("c", w, &load(1, 0), (10, 100), 2000);
        cal.first_token("c", 0, 2040);
        assert_eq!(cal.counters().first_tokens, 2);
        cal.done(&report("c", 40, 2900, 1760, 1600, 50), 2900);
        let c = cal.counters();
        assert_eq!((c.first_tokens, c.decodes, c.mispredicted), (3, 3, 1), "b's prefix was not there");
    }

    #[test]
    fn saturated_failed_and_foreign_requests_teach_nothing_about_compute() {
        let mut cal = Calibration::new(PRIOR, true, 16);
        let w = WorkerIdx(0);
        // At its running limit: the first token measured a wait.
        cal.routed("full", w, &load(64, 0), (10, 0), 0);
        cal.first_token("full", 500_000, 500);
        cal.done(&report("full", 500, 900, 200, 0, 1), 900);
        // An error status.
        cal.routed("err", w, &load(1, 0), (10, 0), 1000);
        cal.done(&pb::CompletionReport { status_code: 503, ..report("err", 5, 6, 200, 0, 1) }, 1006);
        // Served by a fallback worker, then reported.
        cal.routed("moved", w, &load(1, 0), (10, 0), 2000);
        cal.forget("moved");
        cal.done(&report("moved", 5, 6, 200, 0, 1), 2006);
        // Never ends.
        cal.routed("lost", w, &load(1, 0), (10, 0), 3000);
        cal.expire(3000 + 601_000, 600_000);
        let c = cal.counters();
        assert_eq!((c.first_tokens, c.decodes, c.queued, c.unusable), (0, 0, 1, 2));
        assert_eq!(cal.open_requests(), 0);
    }

    #[test]
    fn without_cached_tokens_in_the_usage_the_prediction_stands_in() {
        let mut cal = Calibration::new(PRIOR, true, 16);
        cal.routed("a", WorkerIdx(0), &load(0, 0), (10, 100), 0);
        cal.done(&pb::CompletionReport { cached_tokens: None, ..report("a", 100, 200, 1760, 0, 1) }, 200);
        cal.routed("b", WorkerIdx(0), &load(0, 0), (10, 100), 300);
        cal.done(
            &pb::CompletionReport { prompt_tokens: None, cached_tokens: None, ..report("b", 100, 200, 0, 0, 1) },
            500,
        );
        let c = cal.counters();
        assert_eq!((c.first_tokens, c.unusable), (1, 2), "b has no usage at all; a has one output token");
    }

    #[test]
    fn without_learning_the_policy_keeps_its_constants() {
        let mut cal = Calibration::new(PRIOR, false, 16);
        cal.routed("a", WorkerIdx(0), &load(0, 0), (10, 0), 0);
        cal.first_token("a", 100_000, 100);
        cal.done(&report("a", 100, 200, 200, 0, 10), 200);
        assert_eq!(cal.timing(WorkerIdx(0)), None);
        assert_eq!(cal.counters().first_tokens, 1, "still fitted and exported");
    }

    #[test]
    fn classes_beyond_the_cap_share_one_fit() {
        let mut cal = Calibration::new(PRIOR, true, 16);
        for i in 0..(MAX_CLASSES as u32 + 5) {
            let w = WorkerIdx(i);
            let l = Load { capacity_blocks: Some(u64::from(i) + 1), ..Load::default() };
            let id = format!("r{i}");
            cal.routed(&id, w, &l, (1, 0), 0);
            cal.done(&report(&id, 10, 20, 100, 0, 1), 20);
        }
        assert_eq!(cal.classes().count(), MAX_CLASSES + 1);
        assert!(cal.classes().any(|(k, _)| k == "other"));
    }
}
