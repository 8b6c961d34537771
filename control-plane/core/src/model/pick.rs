//! One pick: the candidates (live workers, their overlap with the prompt in
//! each tier, in-flight overlap and load), the policy's decision, and its
//! bookkeeping (in flight, prediction for the accuracy metric).
//!
//! Cost: O(prompt blocks) hashing + two index lookups + the policy's ranking
//! of the W live workers (`kv`: O(W), the best 33 sorted).

use kvgate_index::{Index, Overlap, Tier, WorkerIdx};
use kvgate_protocol::pb;
use kvgate_protocol::{BlockSeed, BlockSize, SequenceHash, sequence_hashes};
use kvgate_scheduler::{Candidate, Decision, KvConfig, KvPolicy, Mode, Policy as _, Reason, RequestView};
use parking_lot::RwLock;

use super::ModelState;
use super::disagg::LegCandidate;

/// The request as the model state needs it.
#[derive(Debug, Clone, Copy)]
pub struct PickInput<'a> {
    /// Correlation id (non-empty).
    pub request_id: &'a str,
    /// Prompt token ids.
    pub token_ids: &'a [u32],
    /// LoRA + cache salt.
    pub seed: BlockSeed,
    /// Chained segment hashes (already seeded), for `approx`.
    pub text_prefix: &'a [u64],
    /// `max_tokens`, when given.
    pub max_tokens: Option<u32>,
    /// Routed by load, not by the prompt, and why; `None` scores the prompt
    /// with the model's mode.
    pub by_load: Option<ByLoad>,
    /// The endpoints the data plane allows (an endpoint picker's subset
    /// hint); `None` = every live worker. Workers outside it are excluded
    /// from the pick, so the ranking is made among the allowed ones.
    pub allowed: Option<&'a [String]>,
    /// The request's session key ("" = none); see [`super::sessions`].
    pub session: &'a str,
}

/// Why a request is routed by load instead of by its prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByLoad {
    /// The prompt could not be tokenized: the mode's pick falls back to the
    /// least loaded worker (reason `fallback`, labelled with the mode).
    TokenizeFailed,
    /// There is no prompt to score (an endpoint picker saw no body, or one
    /// kvgate does not route by prefix): labelled mode `by_load`, reason
    /// `load`.
    NoPrompt,
    /// The event stream is processed too far behind (the control plane is
    /// short of CPU): the prompt is not tokenized nor looked up, so that
    /// ingest catches up (reason `fallback`, labelled with the mode).
    Shed,
}

/// Mode label of the decisions routed by load for want of a prompt
/// ([`ByLoad::NoPrompt`]).
pub const BY_LOAD: &str = "by_load";

/// A decision, in wire terms.
#[derive(Debug, Clone, PartialEq)]
pub struct PickOutput {
    /// `ip:port` of the chosen worker.
    pub endpoint: String,
    /// The chosen worker's data-parallel rank at `endpoint`, when its server
    /// runs several.
    pub dp_rank: Option<u32>,
    /// Runners-up' endpoints: distinct, not the chosen one, and (for a
    /// data-parallel rank) only servers that run the same rank.
    pub fallbacks: Vec<String>,
    /// Chosen worker id.
    pub worker_id: String,
    /// Leading prompt blocks it holds.
    pub matched_blocks: u32,
    /// Full prompt blocks.
    pub total_blocks: u32,
    /// Why (wire enum).
    pub reason: pb::PickReason,
    /// The largest overlap of any candidate when it is larger than the
    /// chosen one's: (blocks, worker id); (0, "") otherwise.
    pub passed_over: (u32, String),
    /// Mode label of the decision (the model's mode, or [`BY_LOAD`]).
    pub mode: &'static str,
    /// For replica sync.
    pub inflight: pb::InflightEvent,
    /// The prefill worker when the request is disaggregated (the primary
    /// endpoint is then its decode worker).
    pub prefill: Option<PrefillLeg>,
}

/// Where a disaggregated request's prefill leg goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillLeg {
    /// `ip:port` of the prefill worker.
    pub endpoint: String,
    /// Its worker id.
    pub worker_id: String,
    /// Leading prompt blocks it holds.
    pub matched_blocks: u32,
    /// The leg's in-flight event for the other replicas (`prefill_leg_ms`
    /// set): it is load on the prefill worker there too.
    pub inflight: pb::InflightEvent,
}

/// Why a model has no worker for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NoWorker {
    /// No live worker with an endpoint.
    #[error("no live worker for this model")]
    NoneLive,
    /// Live workers, but none of them in the allowed endpoints.
    #[error("no live worker among the allowed endpoints")]
    NoneAllowed,
}

/// The live workers as the policy sees them, sorted by id (HashMap order
/// is random per process: sorted for reproducible ties).
struct Candidates {
    cands: Vec<Candidate>,
    /// The model's sorted worker ids, and each candidate's position there.
    order: std::sync::Arc<[String]>,
    ranks: Vec<u32>,
    /// Positions of the live `prefill` workers (excluded from the decode
    /// pick), for a prefill leg.
    prefill: Vec<usize>,
    /// Positions of the live `both` workers, with `prefill_on_both` (legs
    /// there); empty without.
    both: Vec<usize>,
    /// Positions of the live `prefill` workers among the allowed endpoints
    /// (whole requests with `overflow_to_prefill`).
    prefill_allowed: Vec<usize>,
    /// Some registered worker, live or not, is a `prefill` worker (a fleet
    /// without any never counts a disaggregation outcome).
    prefill_registered: bool,
}

impl Candidates {
    /// Worker id of candidate `i`.
    fn id(&self, i: usize) -> &str {
        self.ranks.get(i).and_then(|r| self.order.get(*r as usize)).map_or("", String::as_str)
    }
}

/// Wire name of a reason.
pub fn reason_pb(r: Reason) -> pb::PickReason {
    match r {
        Reason::Kv => pb::PickReason::Kv,
        Reason::Load => pb::PickReason::Load,
        Reason::Approximate => pb::PickReason::Approximate,
        Reason::RoundRobin => pb::PickReason::RoundRobin,
        Reason::Random => pb::PickReason::Random,
    }
}

/// Metric label of a wire reason.
pub fn reason_label(r: pb::PickReason) -> &'static str {
    match r {
        pb::PickReason::Kv => "kv",
        pb::PickReason::Load => "load",
        pb::PickReason::Approximate => "approximate",
        pb::PickReason::RoundRobin => "round_robin",
        pb::PickReason::Random => "random",
        pb::PickReason::Fallback => "fallback",
        pb::PickReason::Session => "session",
        pb::PickReason::Unspecified => "unspecified",
    }
}

/// The policy's `decision`, unless the session's worker `pinned` can take
/// the request: then that worker, with the policy's choice first among the
/// fallbacks. A pinned worker that is gone (not a candidate), excluded or
/// saturated (its running limit reached, or its KV blocks would overflow,
/// as `kv` judges it) is passed over. Returns whether the pin changed the
/// policy's choice (the decision's reason is then `session`).
fn keep_session(
    decision: Decision,
    cands: &[Candidate],
    pinned: WorkerIdx,
    view: &RequestView<'_>,
) -> (Decision, bool) {
    let judge = KvPolicy::new(KvConfig::default());
    let Some(p) = cands.iter().position(|c| c.worker == pinned && !c.excluded && !judge.saturated(view, c)) else {
        return (decision, false);
    };
    if p == decision.chosen {
        return (decision, false);
    }
    let n = decision.fallbacks.len();
    let fallbacks = std::iter::once(decision.chosen).chain(decision.fallbacks).filter(|i| *i != p).take(n).collect();
    (Decision { chosen: p, fallbacks, reason: decision.reason }, true)
}

/// A prompt's block hashes and which workers hold them, read from the
/// index before the model's lock is taken: a Pick waits for the model's
/// ingest only for this lookup ([`super::stream::ingest_stream`]).
#[derive(Debug, Default)]
pub struct Found {
    hashes: Vec<SequenceHash>,
    device: Vec<Overlap>,
    /// In either tier; `None` when the index holds no host blocks (the
    /// device overlap is the answer then).
    any: Option<Vec<Overlap>>,
    /// [`Index::removals`] when read: while it is unchanged, the answer's
    /// worker indices name the same workers.
    removals: u64,
    /// The index was asked (only for `kv`).
    looked_up: bool,
}

impl Found {
    /// Hashes the prompt (not one routed by load) and, for the `kv` mode
    /// (`kv`), looks it up.
    pub fn lookup(index: &RwLock<Index>, input: &PickInput<'_>, block_size: BlockSize, kv: bool) -> Found {
        if input.by_load.is_some() {
            return Found::default();
        }
        let hashes = sequence_hashes(input.token_ids, block_size, input.seed);
        if !kv {
            return Found { hashes, ..Found::default() };
        }
        let index = index.read();
        Found::read(&index, hashes)
    }

    fn read(index: &Index, hashes: Vec<SequenceHash>) -> Found {
        let mut device = Vec::new();
        let mut any = None;
        if !hashes.is_empty() {
            index.find_matches(&hashes, Tier::Device, &mut device);
            // Without host blocks the any-tier overlap is the device one
            // (a second lookup would only repeat it).
            if index.distinct_blocks(Tier::Host) > 0 {
                let mut both = Vec::new();
                index.find_matches_any_tier(&hashes, &mut both);
                any = Some(both);
            }
        }
        Found { hashes, device, any, removals: index.removals(), looked_up: true }
    }
}

impl ModelState {
    /// Chooses a worker for a request and records it as in flight.
    pub fn pick(&mut self, input: &PickInput<'_>, now_ms: u64) -> Result<PickOutput, NoWorker> {
        let found = Found::lookup(&self.index, input, self.config.block_size, self.mode == Mode::Kv);
        self.pick_found(input, found, now_ms)
    }

    /// [`ModelState::pick`] with the prompt looked up already
    /// ([`Found::lookup`], without the model's lock). A worker removed since
    /// the lookup, or a lookup `kv` needs and was not made (the mode
    /// switched), makes it look (again).
    pub fn pick_found(&mut self, input: &PickInput<'_>, found: Found, now_ms: u64) -> Result<PickOutput, NoWorker> {
        let kv = self.mode == Mode::Kv && input.by_load.is_none();
        let current = found.removals == self.removals && found.looked_up;
        let found = if kv && !current { Found::read(&self.index.read(), found.hashes) } else { found };
        let hashes = &found.hashes[..];
        let bs = self.config.block_size;
        // Prefill workers' queues as of now (legs end by their estimate).
        self.end_prefill_legs(now_ms);
        let c = self.candidates(&found, input.allowed, now_ms);
        let expected_output_tokens = input.max_tokens.unwrap_or(self.config.default_output_tokens);
        let view = RequestView {
            prompt_blocks: hashes.len() as u32,
            expected_output_tokens,
            block_size: bs.get(),
            text_prefix: input.text_prefix,
        };
        let decision = if input.by_load.is_some() {
            kvgate_scheduler::LeastLoadPolicy.pick(&view, &c.cands, &mut self.rng)
        } else {
            self.policy.pick(&view, &c.cands, &mut self.rng)
        };
        let decision = decision.ok_or(if c.cands.is_empty() { NoWorker::NoneLive } else { NoWorker::NoneAllowed })?;
        let (decision, pinned) = match self.sessions.get(input.session, now_ms) {
            Some(w) => keep_session(decision, &c.cands, w, &view),
            None => (decision, false),
        };
        let overflow = if input.by_load.is_none() { self.overflow(&decision, &c, &view) } else { None };
        let overflowed = overflow.is_some();
        let decision = overflow.unwrap_or(decision);
        let chosen = c.cands[decision.chosen];
        self.sessions.pin(input.session, chosen.worker, now_ms);
        self.policy.observe(&view, chosen.worker, now_ms);
        let output_blocks = u64::from(expected_output_tokens.div_ceil(bs.get()));
        // Its new prefill excludes what requests in flight there compute.
        let mut shared = chosen.overlap_blocks.max(chosen.inflight_overlap_blocks);
        // Prompt tokens a worker holding `held` leading blocks computes.
        let uncached = |held: u32| (input.token_ids.len() as u32).saturating_sub(held.saturating_mul(bs.get()));
        let prefill = if input.by_load.is_none() && !overflowed {
            self.prefill_choice(&view, &c, decision.chosen, uncached(shared))
        } else {
            None
        };
        let mut leg_out = None;
        if let Some(p) = prefill {
            // The prefill worker computes the prompt for one token; the
            // decode worker receives the blocks and computes none.
            let pc = c.cands[p];
            let leg = super::disagg::leg_id(input.request_id);
            let held = pc.overlap_blocks.max(pc.inflight_overlap_blocks);
            let kv = self.config.kv;
            let done_ms = super::disagg::prefill_done_ms(&pc, uncached(held), held * bs.get(), bs.get(), &kv);
            let leg_ms = done_ms.ceil().max(1.0) as u64;
            if self.tracker.added(&leg, pc.worker, hashes, held, 1, now_ms).is_ok() {
                self.prefill_legs.insert(input.request_id, now_ms + leg_ms, pc.worker);
            }
            leg_out = Some(PrefillLeg {
                endpoint: self.workers.get(c.id(p)).and_then(|w| w.endpoint.clone()).unwrap_or_default(),
                worker_id: c.id(p).to_owned(),
                matched_blocks: pc.overlap_blocks,
                inflight: pb::InflightEvent {
                    request_id: input.request_id.to_owned(),
                    worker_id: c.id(p).to_owned(),
                    phase: pb::InflightPhase::Added as i32,
                    prompt_blocks: hashes.len() as u32,
                    overlap_blocks: held,
                    expected_output_tokens: 1,
                    prefill_leg_ms: u32::try_from(leg_ms).unwrap_or(u32::MAX),
                    ..Default::default()
                },
            });
            let role = self.workers.get(c.id(p)).map_or(pb::WorkerRole::Prefill, |w| w.role);
            self.count_prefill(role, uncached(held), now_ms);
            shared = hashes.len() as u32;
        } else {
            let role = self.workers.get(c.id(decision.chosen)).map_or(pb::WorkerRole::Both, |w| w.role);
            self.count_prefill(role, uncached(shared), now_ms);
        }
        let added = self.tracker.added(input.request_id, chosen.worker, hashes, shared, output_blocks, now_ms);
        // A disaggregated request's first token is not the decode worker's
        // prefill time: the calibration does not learn from it.
        if added.is_ok() && prefill.is_none() {
            let new_blocks = (hashes.len() as u64).saturating_sub(u64::from(shared));
            self.calibration.routed(
                input.request_id,
                chosen.worker,
                &chosen.load,
                (new_blocks, u64::from(shared)),
                now_ms,
            );
            self.calibration.touch(chosen.worker, &self.tracker.load(chosen.worker), now_ms);
        }
        // Only `kv` looks the prompt up in the index: other modes make no
        // prediction for the accuracy metric to judge (nor does a decode
        // worker that receives its blocks from a prefill worker).
        if self.mode == Mode::Kv && input.by_load.is_none() && prefill.is_none() {
            self.predicted.insert(input.request_id.to_owned(), (chosen.overlap_blocks * bs.get(), now_ms));
        }
        let mut out = self.output(input, &c, &decision, hashes, expected_output_tokens);
        out.prefill = leg_out;
        if pinned {
            out.reason = pb::PickReason::Session;
        }
        Ok(out)
    }

    /// With `overflow_to_prefill`: when `decision` chose a saturated worker
    /// (running limit, KV blocks), the policy's pick among the live allowed
    /// `prefill` workers that are not, for the whole request; its runners-up
    /// first among the fallbacks, then the decode side's.
    fn overflow(&mut self, decision: &Decision, c: &Candidates, view: &RequestView<'_>) -> Option<Decision> {
        let cfg = self.config.disaggregation;
        if !cfg.enabled || !cfg.overflow_to_prefill || c.prefill_allowed.is_empty() {
            return None;
        }
        let judge = KvPolicy::new(self.config.kv);
        if !judge.saturated(view, c.cands.get(decision.chosen)?) {
            return None;
        }
        let mut only = c.cands.clone();
        for (i, cand) in only.iter_mut().enumerate() {
            cand.excluded = !c.prefill_allowed.contains(&i) || judge.saturated(view, cand);
        }
        let d = self.policy.pick(view, &only, &mut self.rng)?;
        if only.get(d.chosen).is_none_or(|x| x.excluded) {
            return None;
        }
        self.counters.overflowed += 1;
        // The answer keeps as many as it sends.
        let mut fallbacks: Vec<usize> = Vec::new();
        let rest = std::iter::once(decision.chosen).chain(decision.fallbacks.iter().copied());
        for i in d.fallbacks.iter().copied().filter(|i| only.get(*i).is_some_and(|x| !x.excluded)).chain(rest) {
            if i != d.chosen && !fallbacks.contains(&i) {
                fallbacks.push(i);
            }
        }
        Some(Decision { chosen: d.chosen, fallbacks, reason: d.reason })
    }

    /// The prefill worker for this request when disaggregating it pays
    /// (see [`super::disagg`]): its position among the candidates.
    /// `uncached` is the decode worker's (candidate `chosen`) own prefill in
    /// tokens.
    fn prefill_choice(
        &mut self,
        view: &RequestView<'_>,
        c: &Candidates,
        chosen: usize,
        uncached: u32,
    ) -> Option<usize> {
        let cfg = self.config.disaggregation;
        let on_both = cfg.prefill_on_both && c.both.iter().any(|b| *b != chosen);
        if !cfg.enabled || !(c.prefill_registered || on_both) {
            return None;
        }
        let decode = &c.cands[chosen];
        let held = decode.overlap_blocks.max(decode.inflight_overlap_blocks).saturating_mul(view.block_size);
        if !cfg.worth_it(uncached, held, decode.timing, &self.config.kv) {
            self.counters.below_threshold += 1;
            return None;
        }
        let one_token = RequestView { expected_output_tokens: 1, ..*view };
        let others = c.both.iter().filter(|b| on_both && **b != chosen);
        let at: Vec<usize> = c.prefill.iter().chain(others).copied().collect();
        // `at` lists the prefill workers first, then the `both` ones.
        let legs: Vec<LegCandidate> = at
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let cand = c.cands[*p];
                LegCandidate { cand, legs: self.prefill_legs.on(cand.worker), both: i >= c.prefill.len() }
            })
            .collect();
        let kv = self.config.kv;
        let here = self.prefill_legs.on(decode.worker);
        let local_ms = cfg.only_if_sooner.then(|| {
            super::disagg::local_cost_ms(decode, here, (uncached, held), view.block_size, &kv, cfg.stall_weight)
        });
        let judged = super::disagg::open_for_a_leg(&one_token, &legs, kv, uncached + held, local_ms, cfg.stall_weight);
        match self.policy.pick(&one_token, &judged, &mut self.rng) {
            Some(d) if !judged[d.chosen].excluded => {
                self.counters.disaggregated += 1;
                Some(at[d.chosen])
            }
            _ => {
                self.counters.no_prefill_capacity += 1;
                None
            }
        }
    }

    /// The live workers with their overlaps and loads; those outside
    /// `allowed` are excluded, and so are `prefill` workers (they take only
    /// prefill legs).
    fn candidates(&mut self, found: &Found, allowed: Option<&[String]>, now_ms: u64) -> Candidates {
        let hashes = &found.hashes[..];
        // Overlaps by worker index (indexes are dense: a vector, not a map).
        let mut device: Vec<u32> = Vec::new();
        let mut any: Vec<u32> = Vec::new();
        let by_worker = |to: &mut Vec<u32>, found: &[Overlap]| {
            for o in found {
                let i = o.worker.0 as usize;
                if to.len() <= i {
                    to.resize(i + 1, 0);
                }
                to[i] = o.blocks;
            }
        };
        if self.mode == Mode::Kv {
            by_worker(&mut device, &found.device);
            by_worker(&mut any, found.any.as_deref().unwrap_or_default());
        }
        // What each worker's requests in flight share with the prompt, in
        // one walk of it.
        let shares = if self.mode == Mode::Kv { self.tracker.inflight_shares(hashes) } else { Vec::new() };
        if self.order_stale {
            self.sort_workers();
        }
        // The workers in id order (the map is kept sorted): each live one
        // is listed where it stands, with no sort and no reordering per Pick.
        let (mut cands, mut ranks, mut prefill, mut both, mut prefill_allowed) =
            (Vec::with_capacity(self.workers.len()), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let fading = self.config.fading_load && self.mode == Mode::Kv;
        let mut decoding: Vec<(WorkerIdx, f64)> = Vec::new();
        let mut prefill_registered = false;
        let mut timing = self.calibration.timings();
        // A worker's rank is its position in the sorted map (and in `order`).
        for (rank, w) in self.workers.values().enumerate() {
            let prefill_only = w.role == pb::WorkerRole::Prefill;
            prefill_registered |= prefill_only;
            if !self.live(w, now_ms) {
                continue;
            }
            let d = device.get(w.idx.0 as usize).copied().unwrap_or(0);
            let h = any.get(w.idx.0 as usize).copied().unwrap_or(0);
            let inflight = shares.get(w.idx.0 as usize).copied().unwrap_or_default();
            let outside = allowed.is_some_and(|a| !w.endpoint.as_ref().is_some_and(|e| a.contains(e)));
            let excluded = prefill_only || outside;
            let cand = Candidate {
                worker: w.idx,
                overlap_blocks: d,
                overlap_any_tier_blocks: d.max(h),
                inflight_overlap_blocks: inflight.blocks,
                inflight_computing_blocks: inflight.computing,
                load: self.tracker.load(w.idx),
                timing: timing(w.idx),
                decode_running: None,
                excluded,
            };
            let role = w.role;
            match role {
                pb::WorkerRole::Prefill => {
                    if !outside {
                        prefill_allowed.push(cands.len());
                    }
                    prefill.push(cands.len());
                }
                // Only when they may take legs: no list per Pick otherwise.
                pb::WorkerRole::Both if self.config.disaggregation.prefill_on_both => both.push(cands.len()),
                _ => {}
            }
            if fading && role != pb::WorkerRole::Prefill {
                decoding.push((cand.worker, f64::from(cand.load.effective_requests())));
            }
            cands.push(cand);
            ranks.push(rank as u32);
        }
        drop(timing);
        if fading {
            self.fade_load(&mut cands, &decoding, now_ms);
        }
        Candidates { cands, order: self.order.clone(), ranks, prefill, both, prefill_allowed, prefill_registered }
    }

    /// With `fading_load`: samples the running requests of the workers
    /// that decode (not prefill-only) and gives each candidate the running
    /// requests its decode lives with on average
    /// ([`kvgate_scheduler::persistence`]).
    fn fade_load(&mut self, cands: &mut [Candidate], decoding: &[(WorkerIdx, f64)], now_ms: u64) {
        if decoding.len() < 2 {
            return;
        }
        self.persistence.sample(now_ms, decoding);
        let mean = decoding.iter().map(|(_, r)| r).sum::<f64>() / decoding.len() as f64;
        let Some(lives_with) = self.persistence.decode_running(mean) else { return };
        for c in cands {
            c.decode_running = Some(lives_with(c.worker, f64::from(c.load.effective_requests())));
        }
    }

    /// Sorts the registered workers by id, and their ids into `order`.
    fn sort_workers(&mut self) {
        self.workers.sort_unstable_keys();
        self.order = self.workers.keys().cloned().collect();
        self.order_stale = false;
    }

    /// The runners-up's endpoints Envoy may retry on: distinct and not the
    /// primary's (a server that refuses a connection refuses it for all its
    /// ranks). The request keeps the primary's rank header on a retry, so
    /// for a rank `r` only servers that run rank `r` qualify (a server
    /// without data parallelism runs rank 0 only; vLLM refuses a rank it
    /// does not run with a 400). The first `max` that qualify, taken from the
    /// policy's whole ranking (endpoints are looked up only as far as
    /// needed).
    fn fallbacks(
        &self,
        ranked: impl Iterator<Item = String>,
        primary: &str,
        rank: Option<u32>,
        max: usize,
    ) -> Vec<String> {
        let runs_rank = |e: &str, r: u32| {
            self.workers.values().any(|w| w.endpoint.as_deref() == Some(e) && w.dp_rank.unwrap_or(0) == r)
        };
        let mut out: Vec<String> = Vec::new();
        for e in ranked {
            if out.len() >= max {
                break;
            }
            if e.is_empty() || e == primary || out.contains(&e) {
                continue;
            }
            if rank.is_some_and(|r| !runs_rank(&e, r)) {
                continue;
            }
            out.push(e);
        }
        out
    }

    /// The decision in wire terms, counted by (mode, reason).
    fn output(
        &self,
        input: &PickInput<'_>,
        c: &Candidates,
        decision: &Decision,
        hashes: &[SequenceHash],
        expected_output_tokens: u32,
    ) -> PickOutput {
        let total_blocks = hashes.len() as u32;
        // The other replicas credit the worker with these blocks at once
        // (nothing to build without replicas).
        let shared =
            if self.share_with_replicas { hashes.len().min(kvgate_scheduler::SHARED_PROMPT_BLOCKS) } else { 0 };
        let endpoint_of = |i: usize| self.workers.get(c.id(i)).and_then(|w| w.endpoint.clone()).unwrap_or_default();
        let endpoint = endpoint_of(decision.chosen);
        let dp_rank = self.workers.get(c.id(decision.chosen)).and_then(|w| w.dp_rank);
        let ranked = decision.fallbacks.iter().map(|i| endpoint_of(*i));
        let fallbacks = self.fallbacks(ranked, &endpoint, dp_rank, self.config.kv.fallbacks);
        let chosen = c.cands[decision.chosen];
        let worker_id = c.id(decision.chosen).to_owned();
        let (mode, reason) = match input.by_load {
            None => (self.mode.name(), reason_pb(decision.reason)),
            Some(ByLoad::TokenizeFailed | ByLoad::Shed) => (self.mode.name(), pb::PickReason::Fallback),
            Some(ByLoad::NoPrompt) => (BY_LOAD, pb::PickReason::Load),
        };
        let best = c
            .cands
            .iter()
            .enumerate()
            .filter(|(i, _)| c.prefill.binary_search(i).is_err())
            .max_by_key(|(i, c)| (c.overlap_blocks, std::cmp::Reverse(*i)));
        let passed_over = match best {
            Some((i, b)) if b.overlap_blocks > chosen.overlap_blocks => (b.overlap_blocks, c.id(i).to_owned()),
            _ => (0, String::new()),
        };
        PickOutput {
            endpoint,
            dp_rank,
            fallbacks,
            worker_id: worker_id.clone(),
            matched_blocks: chosen.overlap_blocks,
            total_blocks,
            reason,
            passed_over,
            mode,
            inflight: pb::InflightEvent {
                request_id: input.request_id.to_owned(),
                worker_id,
                phase: pb::InflightPhase::Added as i32,
                prompt_blocks: total_blocks,
                overlap_blocks: chosen.overlap_blocks,
                expected_output_tokens,
                ts_unix_nanos: 0,
                session_id: input.session.to_owned(),
                block_hashes: hashes.iter().take(shared).map(|h| h.0).collect(),
                prefill_leg_ms: 0,
            },
            prefill: None,
        }
    }
}
