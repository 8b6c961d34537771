//! Router-predicted load per worker, from the lifecycle of the requests the
//! router (and its replicas) routed: added → first token → done.
//!
//! n = prompt blocks, K = [`CHECKPOINT`], h = requests in flight on one
//! worker that hold the prompt's last shared checkpoint, p = requests still
//! prefilling on one worker (few), W = workers holding a checkpoint.
//!
//! | operation | cost |
//! |---|---|
//! | [`LoadTracker::added`] | O(n / K) table updates (each O(log W) + a push into the worker's run, or past 16 requests an insertion in order: one comparison inside a shared prefix, else O(log h · log K) reads and a shift of slots) + one share |
//! | [`LoadTracker::first_token`] | O(p) |
//! | [`LoadTracker::done`] | O(n / K) table updates (each O(log W) + a removal from the worker's run) + one share |
//! | [`LoadTracker::expire`] | O(in-flight requests) |
//! | [`LoadTracker::load`] | O(1) |
//! | share of one worker | O(log(n / K)) lookups + O(log h · log K) reads (the prompt's place among the requests holding its last shared checkpoint, kept sorted by the blocks that follow it) + O(p · (log(n / K) + K)) |
//! | [`LoadTracker::inflight_shares`] (every worker at once) | the prompt's checkpoints looked up once; each holding worker's last one found by one walk of the workers holding them, from the last back (at most what the binary searches would cost, which take over beyond), then one extension and share per worker holding the prompt's first block |
//!
//! Active blocks are deduplicated per worker, as the engine's prefix cache
//! does: ten requests sharing a 4,000-token system prompt count its blocks
//! once. Output blocks are per request
//! (`ceil(expected_output_tokens / block_size)`).
//!
//! **Checkpoints, not every block.** Block hashes are chained: two prompts
//! with the same hash at position i agree on every block before it. So the
//! blocks a worker's requests in flight hold form a prefix-closed set, and
//! what they share with a prompt is its longest common prefix with one of
//! them. The table indexes only every K-th block of each prompt in flight
//! (hash → the requests on each worker that hold it): a binary search over
//! the prompt's checkpoints finds the last one a worker holds, and the
//! requests holding it extend the match by at most K − 1 blocks. Each
//! worker's requests holding a checkpoint are kept sorted by the blocks
//! that follow it, so the one sharing most with a prompt is a neighbour of
//! the prompt's place there, found by binary search: a system prompt held
//! by every request in flight costs O(log h) reads per worker, not O(h).
//! A request's distinct blocks are its length less what the worker's other
//! requests already share with it. Registering every block instead cost a
//! third of the control plane's CPU for 100K-token prompts at 1,000 workers
//! (docs/DECISIONS.md).

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use foldhash::fast::RandomState;
use kvgate_index::WorkerIdx;
use kvgate_protocol::SequenceHash;
use smallvec::{SmallVec, smallvec};

use crate::policy::Load;

type Map<K, V> = HashMap<K, V, RandomState>;

/// Every K-th block of a prompt in flight is indexed (positions 0, K,
/// 2K, …). Larger: fewer table updates per request, longer block-by-block
/// extensions per share.
pub const CHECKPOINT: usize = 16;

/// One worker's requests in flight that hold a checkpoint hash: their
/// slots (four inline, as most checkpoints past a shared prefix have one
/// holder). Past [`LINEAR_RUN`] of them, sorted by the blocks that follow
/// the checkpoint up to the next one ([`window_cmp`]), so that the one
/// sharing most with a prompt is found by binary search.
#[derive(Debug)]
struct Run {
    worker: WorkerIdx,
    slots: SmallVec<[u32; 4]>,
}

/// The requests in flight holding one checkpoint hash, one run per worker,
/// sorted by worker: a worker's requests are found by binary search, and the
/// workers holding a hash are walked without walking their requests (a
/// shared system prompt is held by every request in flight).
type Holders = Vec<Run>;

/// Runs of at most this many requests are kept in arrival order and walked
/// one by one when a prompt's share is extended: for so few, one read each
/// costs less than a binary search's bisections, and an insertion is a
/// push. A longer run is sorted ([`window_cmp`]) when it passes this size
/// and kept sorted while it is longer.
const LINEAR_RUN: usize = 16;

/// Most leading prompt block hashes a replica shares per request (64 K
/// tokens at block size 16; 32 KiB on the wire): enough for the prefixes a
/// burst shares, bounded for NATS.
pub const SHARED_PROMPT_BLOCKS: usize = 4096;

/// A worker's last heartbeat.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc` in [0, 1].
    pub kv_usage: f32,
    /// Device blocks.
    pub capacity_blocks: u64,
    /// `max_num_seqs`, 0 when unknown.
    pub max_num_seqs: u32,
}

#[derive(Debug, Default)]
struct WorkerLoad {
    inflight: u32,
    prefill_pending_blocks: u64,
    /// Distinct prompt blocks of its requests in flight.
    distinct_prompt_blocks: u64,
    counted_prompt_blocks: u64,
    output_blocks: u64,
    measured: Option<Measured>,
    /// Slots of its requests still prefilling.
    prefilling: Vec<u32>,
}

#[derive(Debug)]
struct Inflight {
    id: String,
    worker: WorkerIdx,
    prompt: Box<[SequenceHash]>,
    /// Where its own prefill starts in `prompt` (the overlap it was routed with).
    own_from: usize,
    counted_prompt_blocks: u64,
    new_prefill_blocks: u64,
    output_blocks: u64,
    prefilling: bool,
    added_ms: u64,
}

/// What a worker's requests in flight share with a new prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InflightShare {
    /// Leading prompt blocks that requests in flight there share.
    pub blocks: u32,
    /// Of those, blocks a request still prefilling there computes itself.
    pub computing: u32,
}

/// Where `worker`'s run is among a checkpoint's holders (`Err`: where it
/// would go).
fn find_run(holders: &[Run], worker: WorkerIdx) -> Result<usize, usize> {
    holders.binary_search_by_key(&worker.0, |r| r.worker.0)
}

/// The slots of `worker`'s requests among a checkpoint's holders.
fn run(holders: &[Run], worker: WorkerIdx) -> &[u32] {
    find_run(holders, worker).ok().and_then(|i| holders.get(i)).map_or(&[], |r| r.slots.as_slice())
}

/// The last checkpoint position of the first `n` blocks at which `holds`
/// is true, given that it is true at position 0 and, being about chained
/// hashes, true at a position only if true at every earlier one (binary
/// search over the checkpoints).
fn last_checkpoint(n: usize, holds: impl Fn(usize) -> bool) -> usize {
    // Invariant: it holds at checkpoint lo - 1 and not at checkpoint hi.
    let (mut lo, mut hi) = (1, (n.max(1) - 1) / CHECKPOINT + 1);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if holds(mid * CHECKPOINT) { lo = mid + 1 } else { hi = mid }
    }
    (lo - 1) * CHECKPOINT
}

/// A worker [`last_held`] did not place.
const UNPLACED: u32 = u32::MAX;

/// Runs [`last_held`] may walk before it leaves the rest to binary
/// searches: about what those searches would cost for every holder of the
/// first checkpoint (`first` workers, `lists` checkpoints held by someone).
fn walk_budget(first: usize, lists: usize) -> usize {
    let bits = |n: usize| (usize::BITS - n.leading_zeros()) as usize;
    first.saturating_mul(bits(lists)).saturating_mul(2 * bits(first))
}

/// By worker index below `top`: the last checkpoint (its index in
/// `holders`) that the worker's requests hold, for the holders of the first
/// one. Chained hashes: a request holding checkpoint k holds every earlier
/// one, so walking the lists from the last one back, a worker's first
/// appearance is its last checkpoint. The walk ends when every holder of
/// the first is placed, or after `budget` runs; the workers not placed
/// then are [`UNPLACED`] (and others are 0).
fn last_held(holders: &[&[Run]], top: usize, budget: usize) -> Vec<u32> {
    let mut last = vec![UNPLACED; top];
    let Some(first) = holders.first() else { return last };
    let mut left = first.len();
    let mut walked = 0usize;
    for (k, list) in holders.iter().enumerate().rev() {
        if left == 0 || (walked.saturating_add(list.len()) > budget && k > 0) {
            break;
        }
        walked += list.len();
        for Run { worker: w, .. } in *list {
            if let Some(l) = last.get_mut(w.0 as usize)
                && *l == UNPLACED
            {
                *l = k as u32;
                left = left.saturating_sub(1);
            }
        }
    }
    last
}

/// Where `a` and `b`, which agree before `from`, stop agreeing, at most
/// `to` (or where the shorter ends). Chained hashes agree at a position
/// only if they agree before it, so that place is found by bisection:
/// O(log(to − from)) reads.
fn agree_until(a: &[SequenceHash], b: &[SequenceHash], from: usize, to: usize) -> usize {
    let same = |i: usize| a.get(i).is_some_and(|x| b.get(i) == Some(x));
    let (mut lo, mut hi) = (from, a.len().min(b.len()).min(to).max(from));
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if same(mid) { lo = mid + 1 } else { hi = mid }
    }
    lo
}

/// `a` and `b`, which agree before `from`, compared on their blocks from
/// `from` up to `to` (each cut at its own end; a sequence that ends first
/// is the smaller): the order, and where they stop agreeing
/// ([`agree_until`]). Sorted by this order, the sequences that share most
/// with another one are its neighbours (for a ≤ b ≤ c, what a and c share
/// is the lesser of what a and b share and what b and c share).
fn window_cmp(a: &[SequenceHash], b: &[SequenceHash], from: usize, to: usize) -> (std::cmp::Ordering, usize) {
    let (ea, eb) = (a.len().min(to), b.len().min(to));
    let lo = agree_until(a, b, from, to);
    let order = match (a.get(lo), b.get(lo)) {
        (Some(x), Some(y)) if lo < ea.min(eb) => x.0.cmp(&y.0),
        _ => ea.cmp(&eb),
    };
    (order, lo)
}

/// Adds `slot`, a request with `prompt`, to a run of the checkpoint at
/// position `at` (`requests`: the tracker's slots): pushed while the run is
/// short; past [`LINEAR_RUN`], in order of the blocks after the checkpoint
/// (the run sorted once when it gets there).
fn place_in_run(
    slots: &mut SmallVec<[u32; 4]>,
    slot: u32,
    prompt: &[SequenceHash],
    at: usize,
    requests: &[Option<Inflight>],
) {
    let window = |s: &u32| requests.get(*s as usize).and_then(Option::as_ref).map(|o| &o.prompt[..]);
    let cmp = |x: &[SequenceHash], y: &[SequenceHash]| window_cmp(x, y, at + 1, at + CHECKPOINT).0;
    if slots.len() < LINEAR_RUN {
        slots.push(slot);
        return;
    }
    if slots.len() == LINEAR_RUN {
        slots.sort_by(|a, b| match (window(a), window(b)) {
            (Some(x), Some(y)) => cmp(x, y),
            _ => std::cmp::Ordering::Equal,
        });
    }
    // Not before the last one (every request inside a shared prefix, whose
    // blocks to the next checkpoint are all alike): one comparison.
    if slots.last().and_then(window).is_none_or(|o| cmp(o, prompt).is_le()) {
        slots.push(slot);
    } else {
        let place = slots.partition_point(|s| window(s).is_some_and(|o| cmp(o, prompt).is_le()));
        slots.insert(place, slot);
    }
}

/// Length of the union of half-open intervals.
fn union_len(mut spans: Vec<(usize, usize)>) -> usize {
    spans.retain(|(a, b)| a < b);
    spans.sort_unstable();
    let (mut total, mut end) = (0, 0);
    for (a, b) in spans {
        let a = a.max(end);
        if b > a {
            total += b - a;
            end = b;
        }
    }
    total
}

/// `x.round() as u64` (halves away from zero; negative and NaN give 0,
/// beyond `u64::MAX` saturates), without the libm call that the baseline
/// x86-64 target makes of `round`: read for every candidate of a Pick.
fn round_to_u64(x: f64) -> u64 {
    let t = x as u64;
    if x - t as f64 >= 0.5 { t.saturating_add(1) } else { t }
}

/// `worker`'s entry in a by-index table, made when it has none.
fn worker_mut(workers: &mut Vec<Option<WorkerLoad>>, worker: WorkerIdx) -> &mut WorkerLoad {
    let i = worker.0 as usize;
    if workers.len() <= i {
        workers.resize_with(i + 1, || None);
    }
    workers[i].get_or_insert_with(WorkerLoad::default)
}

/// In-flight requests and the load they put on each worker.
#[derive(Debug, Default)]
pub struct LoadTracker {
    /// By worker index (dense: the index hands indices out and reuses
    /// them), so that reading a worker's load is one array access.
    workers: Vec<Option<WorkerLoad>>,
    /// Request id → slot.
    requests: Map<String, u32>,
    slots: Vec<Option<Inflight>>,
    free: Vec<u32>,
    /// Every [`CHECKPOINT`]-th prompt block of the requests in flight →
    /// the requests holding it, by worker.
    checkpoints: Map<SequenceHash, Holders>,
}

/// Why a lifecycle step was ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LifecycleError {
    /// The request id is already in flight.
    #[error("request already in flight")]
    Duplicate,
    /// The request id is not in flight (done, expired, or never added).
    #[error("request not in flight")]
    Unknown,
}

impl LoadTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// A request was routed to `worker`: `prompt` are its sequence hashes,
    /// `overlap_blocks` the leading ones the worker held.
    pub fn added(
        &mut self,
        request_id: &str,
        worker: WorkerIdx,
        prompt: &[SequenceHash],
        overlap_blocks: u32,
        output_blocks: u64,
        now_ms: u64,
    ) -> Result<(), LifecycleError> {
        let new_prefill_blocks = (prompt.len() as u64).saturating_sub(u64::from(overlap_blocks));
        let own_from = (overlap_blocks as usize).min(prompt.len());
        self.insert(request_id, worker, prompt.into(), own_from, 0, new_prefill_blocks, output_blocks, now_ms)
    }

    /// Leading blocks of `prompt` that requests in flight on `worker` share
    /// (their prompt hashes, deduplicated).
    pub fn inflight_prefix(&self, worker: WorkerIdx, prompt: &[SequenceHash]) -> u32 {
        self.inflight_share(worker, prompt).blocks
    }

    /// [`LoadTracker::inflight_prefix`], and how many of those shared
    /// blocks a request on `worker` that has no first token yet is still
    /// computing (a follower's first token waits for them).
    pub fn inflight_share(&self, worker: WorkerIdx, prompt: &[SequenceHash]) -> InflightShare {
        let checkpoints = prompt.len().div_ceil(CHECKPOINT);
        self.share_along(worker, prompt, |k| self.holders_at(prompt, k), checkpoints)
    }

    /// What the requests in flight on each worker share with `prompt`,
    /// indexed by `WorkerIdx` (workers beyond the vector's end share
    /// nothing; the vector grows to the largest holder of the first block,
    /// as only those can share anything). The prompt's checkpoints are
    /// looked up once for all the workers.
    pub fn inflight_shares(&self, prompt: &[SequenceHash]) -> Vec<InflightShare> {
        let mut out: Vec<InflightShare> = Vec::new();
        let holders = self.prompt_holders(prompt);
        let Some(first) = holders.first() else { return out };
        let top = first.last().map_or(0, |r| r.worker.0 as usize + 1);
        out.resize(top, InflightShare::default());
        let last = last_held(&holders, top, walk_budget(first.len(), holders.len()));
        for Run { worker: w, .. } in *first {
            let at = |k: usize| holders.get(k).copied().unwrap_or_default();
            let blocks = match last.get(w.0 as usize) {
                Some(k) if *k != UNPLACED => self.extend_from(*w, prompt, *k as usize * CHECKPOINT, at(*k as usize)),
                // Beyond the walk's budget: the binary search.
                _ => self.shared_along(*w, prompt, at, holders.len()),
            };
            if let Some(s) = out.get_mut(w.0 as usize) {
                let computing = if blocks > 0 { self.computing_on(*w, prompt, blocks, first) } else { 0 };
                *s = InflightShare { blocks: u32::try_from(blocks).unwrap_or(u32::MAX), computing };
            }
        }
        out
    }

    /// The requests holding each of `prompt`'s checkpoints (position
    /// `k · CHECKPOINT` at index k), up to the first one no request holds:
    /// none holds a later one (chained hashes).
    fn prompt_holders<'a>(&'a self, prompt: &[SequenceHash]) -> Vec<&'a [Run]> {
        prompt
            .iter()
            .step_by(CHECKPOINT)
            .map_while(|h| self.checkpoints.get(h).map(Vec::as_slice).filter(|hs| !hs.is_empty()))
            .collect()
    }

    /// [`LoadTracker::inflight_share`], with `at(k)` the requests holding
    /// the prompt's checkpoint k, for k below `checkpoints`.
    fn share_along<'a>(
        &'a self,
        worker: WorkerIdx,
        prompt: &[SequenceHash],
        at: impl Fn(usize) -> &'a [Run],
        checkpoints: usize,
    ) -> InflightShare {
        let blocks = self.shared_along(worker, prompt, &at, checkpoints);
        let computing = if blocks > 0 { self.computing_on(worker, prompt, blocks, at(0)) } else { 0 };
        InflightShare { blocks: u32::try_from(blocks).unwrap_or(u32::MAX), computing }
    }

    /// The requests holding the prompt's checkpoint k (all workers).
    fn holders_at(&self, prompt: &[SequenceHash], k: usize) -> &[Run] {
        prompt.get(k * CHECKPOINT).and_then(|h| self.checkpoints.get(h)).map_or(&[][..], Vec::as_slice)
    }

    fn request(&self, slot: u32) -> Option<&Inflight> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    /// The longest prefix of `prompt` that a request in flight on `worker`
    /// holds (see the module documentation).
    fn shared_on(&self, worker: WorkerIdx, prompt: &[SequenceHash]) -> usize {
        let checkpoints = prompt.len().div_ceil(CHECKPOINT);
        self.shared_along(worker, prompt, |k| self.holders_at(prompt, k), checkpoints)
    }

    /// [`LoadTracker::shared_on`], with `at(k)` the requests holding the
    /// prompt's checkpoint k, for k below `checkpoints` (none holds a later
    /// one).
    fn shared_along<'a>(
        &'a self,
        worker: WorkerIdx,
        prompt: &[SequenceHash],
        at: impl Fn(usize) -> &'a [Run],
        checkpoints: usize,
    ) -> usize {
        let on = |pos: usize| run(at(pos / CHECKPOINT), worker);
        if on(0).is_empty() {
            return 0;
        }
        let last = last_checkpoint(checkpoints * CHECKPOINT, |pos| !on(pos).is_empty());
        self.extend_from(worker, prompt, last, at(last / CHECKPOINT))
    }

    /// The longest prefix of `prompt` that `worker`'s requests holding its
    /// checkpoint at position `at` share, given that none holds the next
    /// checkpoint: `held` are that checkpoint's holders (all workers). The
    /// run is sorted by the blocks after the checkpoint: the prompt's place
    /// in it is found by binary search, and its neighbours there share the
    /// most with it. O(log h · log K) reads, h the worker's requests holding
    /// the checkpoint.
    fn extend_from(&self, worker: WorkerIdx, prompt: &[SequenceHash], at: usize, held: &[Run]) -> usize {
        let slots = run(held, worker);
        let to = at + CHECKPOINT;
        if slots.len() <= LINEAR_RUN {
            // Few: one read each (a bisection only for one that extends the match).
            let mut best = at + 1;
            for r in slots.iter().filter_map(|s| self.request(*s)) {
                if r.prompt.get(best).is_some_and(|x| prompt.get(best) == Some(x)) {
                    best = agree_until(&r.prompt, prompt, best + 1, to);
                }
            }
            return best;
        }
        // Binary search for the prompt's place; the last entry found below
        // it and the last found above it are its two neighbours there, and
        // what they share was read on the way.
        let (mut lo, mut hi, mut best) = (0, slots.len(), at + 1);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let Some(r) = slots.get(mid).and_then(|s| self.request(*s)) else { break };
            let (order, shared) = window_cmp(&r.prompt, prompt, at + 1, to);
            best = best.max(shared);
            if order == std::cmp::Ordering::Less { lo = mid + 1 } else { hi = mid }
        }
        best
    }

    /// Of `prompt`'s blocks, how many a request still prefilling on
    /// `worker` computes itself (from the overlap it was routed with to
    /// where it stops agreeing with `prompt`). `shared`: what the worker's
    /// requests share with `prompt`, which bounds every span. A request
    /// whose own part starts past that, or that differs from `prompt` where
    /// its own part starts, computes none of it (one comparison each). Only
    /// requests holding the prompt's first block can share anything: the
    /// worker's prefilling requests or its holders of that block are walked,
    /// whichever list is shorter.
    fn computing_on(&self, worker: WorkerIdx, prompt: &[SequenceHash], shared: usize, first: &[Run]) -> u32 {
        let Some(Some(w)) = self.workers.get(worker.0 as usize) else { return 0 };
        let first = run(first, worker);
        let span = |slot: u32| {
            let r = self.request(slot)?;
            let agrees = r.prompt.get(r.own_from).is_some_and(|h| prompt.get(r.own_from) == Some(h));
            (r.prefilling && r.own_from < shared && agrees)
                .then(|| (r.own_from, agree_until(&r.prompt, prompt, 0, usize::MAX)))
        };
        let spans = if first.len() < w.prefilling.len() {
            first.iter().filter_map(|s| span(*s)).collect()
        } else {
            w.prefilling.iter().filter_map(|s| span(*s)).collect()
        };
        u32::try_from(union_len(spans)).unwrap_or(u32::MAX)
    }

    /// A request routed by another control-plane replica: `prompt_blocks`
    /// in all, of which the leading `prompt` are known by hash (the replica
    /// shares up to [`SHARED_PROMPT_BLOCKS`] of them; none from an older
    /// replica). The hashed blocks are deduplicated and count as in-flight
    /// overlap here as they do on the replica that routed it; the rest are
    /// counted.
    #[allow(clippy::too_many_arguments)]
    pub fn added_shared(
        &mut self,
        request_id: &str,
        worker: WorkerIdx,
        prompt: &[SequenceHash],
        prompt_blocks: u32,
        overlap_blocks: u32,
        output_blocks: u64,
        now_ms: u64,
    ) -> Result<(), LifecycleError> {
        let prompt = prompt.get(..prompt.len().min(prompt_blocks as usize)).unwrap_or_default();
        let new_prefill_blocks = u64::from(prompt_blocks.saturating_sub(overlap_blocks));
        let counted = u64::from(prompt_blocks).saturating_sub(prompt.len() as u64);
        let own_from = (overlap_blocks as usize).min(prompt.len());
        self.insert(request_id, worker, prompt.into(), own_from, counted, new_prefill_blocks, output_blocks, now_ms)
    }

    /// Starts tracking a request: its prompt blocks either by hash
    /// (deduplicated across requests) or as a bare count.
    #[allow(clippy::too_many_arguments)]
    fn insert(
        &mut self,
        request_id: &str,
        worker: WorkerIdx,
        prompt: Box<[SequenceHash]>,
        own_from: usize,
        counted_prompt_blocks: u64,
        new_prefill_blocks: u64,
        output_blocks: u64,
        now_ms: u64,
    ) -> Result<(), LifecycleError> {
        if self.requests.contains_key(request_id) {
            return Err(LifecycleError::Duplicate);
        }
        let new_distinct = (prompt.len() - self.shared_on(worker, &prompt)) as u64;
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(None);
                u32::try_from(self.slots.len() - 1).unwrap_or(u32::MAX)
            }
        };
        let requests = &self.slots;
        for (k, h) in prompt.iter().step_by(CHECKPOINT).enumerate() {
            let holders = self.checkpoints.entry(*h).or_default();
            match find_run(holders, worker) {
                Ok(i) => {
                    if let Some(r) = holders.get_mut(i) {
                        place_in_run(&mut r.slots, slot, &prompt, k * CHECKPOINT, requests);
                    }
                }
                Err(i) => holders.insert(i, Run { worker, slots: smallvec![slot] }),
            }
        }
        let w = worker_mut(&mut self.workers, worker);
        w.inflight += 1;
        w.prefill_pending_blocks += new_prefill_blocks;
        w.output_blocks += output_blocks;
        w.counted_prompt_blocks += counted_prompt_blocks;
        w.distinct_prompt_blocks += new_distinct;
        w.prefilling.push(slot);
        self.requests.insert(request_id.to_owned(), slot);
        if let Some(e) = self.slots.get_mut(slot as usize) {
            *e = Some(Inflight {
                id: request_id.to_owned(),
                worker,
                prompt,
                own_from,
                counted_prompt_blocks,
                new_prefill_blocks,
                output_blocks,
                prefilling: true,
                added_ms: now_ms,
            });
        }
        Ok(())
    }

    /// The request's first token arrived: its prefill is done.
    pub fn first_token(&mut self, request_id: &str) -> Result<(), LifecycleError> {
        let slot = *self.requests.get(request_id).ok_or(LifecycleError::Unknown)?;
        let Some(r) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else {
            return Err(LifecycleError::Unknown);
        };
        if std::mem::take(&mut r.prefilling)
            && let Some(Some(w)) = self.workers.get_mut(r.worker.0 as usize)
        {
            w.prefill_pending_blocks = w.prefill_pending_blocks.saturating_sub(r.new_prefill_blocks);
            w.prefilling.retain(|s| *s != slot);
        }
        Ok(())
    }

    /// The request finished (or failed): its load is released.
    pub fn done(&mut self, request_id: &str) -> Result<(), LifecycleError> {
        let slot = self.requests.remove(request_id).ok_or(LifecycleError::Unknown)?;
        self.release(slot);
        Ok(())
    }

    /// Frees a slot whose id is already out of `requests`.
    fn release(&mut self, slot: u32) {
        let Some(r) = self.slots.get_mut(slot as usize).and_then(Option::take) else { return };
        self.free.push(slot);
        for h in r.prompt.iter().step_by(CHECKPOINT) {
            let Entry::Occupied(mut o) = self.checkpoints.entry(*h) else { continue };
            let holders = o.get_mut();
            if let Ok(i) = find_run(holders, r.worker) {
                let emptied = holders.get_mut(i).is_some_and(|run| {
                    if let Some(j) = run.slots.iter().position(|s| *s == slot) {
                        run.slots.remove(j);
                    }
                    run.slots.is_empty()
                });
                if emptied {
                    holders.remove(i);
                }
            }
            if holders.is_empty() {
                o.remove();
            }
        }
        let gone = (r.prompt.len() - self.shared_on(r.worker, &r.prompt)) as u64;
        let Some(Some(w)) = self.workers.get_mut(r.worker.0 as usize) else { return };
        w.inflight = w.inflight.saturating_sub(1);
        if r.prefilling {
            w.prefill_pending_blocks = w.prefill_pending_blocks.saturating_sub(r.new_prefill_blocks);
            w.prefilling.retain(|s| *s != slot);
        }
        w.output_blocks = w.output_blocks.saturating_sub(r.output_blocks);
        w.counted_prompt_blocks = w.counted_prompt_blocks.saturating_sub(r.counted_prompt_blocks);
        w.distinct_prompt_blocks = w.distinct_prompt_blocks.saturating_sub(gone);
    }

    /// Drops requests added more than `ttl_ms` ago whose end was never seen
    /// (a lost report must not leave phantom load forever). Returns how many.
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) -> usize {
        let old: Vec<(String, u32)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().map(|r| (i, r)))
            .filter(|(_, r)| now_ms.saturating_sub(r.added_ms) > ttl_ms)
            .map(|(i, r)| (r.id.clone(), i as u32))
            .collect();
        for (id, slot) in &old {
            self.requests.remove(id);
            self.release(*slot);
        }
        old.len()
    }

    /// Records a worker's heartbeat. Non-finite or out-of-range usage is
    /// rejected (returns false) and the previous measurement is kept.
    pub fn measured(&mut self, worker: WorkerIdx, m: Measured) -> bool {
        if !(m.kv_usage.is_finite() && (0.0..=1.0).contains(&m.kv_usage)) {
            return false;
        }
        worker_mut(&mut self.workers, worker).measured = Some(m);
        true
    }

    /// Forgets a worker and every request routed to it.
    pub fn remove_worker(&mut self, worker: WorkerIdx) {
        let gone: Vec<(String, u32)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().filter(|r| r.worker == worker).map(|r| (r.id.clone(), i as u32)))
            .collect();
        for (id, slot) in gone {
            self.requests.remove(&id);
            self.release(slot);
        }
        if let Some(w) = self.workers.get_mut(worker.0 as usize) {
            *w = None;
        }
    }

    /// Requests in flight (all workers).
    pub fn inflight(&self) -> usize {
        self.requests.len()
    }

    /// The load of a worker, predicted and measured.
    pub fn load(&self, worker: WorkerIdx) -> Load {
        let Some(Some(w)) = self.workers.get(worker.0 as usize) else { return Load::default() };
        let m = w.measured;
        Load {
            inflight: w.inflight,
            prefill_pending_blocks: w.prefill_pending_blocks,
            active_blocks: w.distinct_prompt_blocks + w.counted_prompt_blocks + w.output_blocks,
            measured_running: m.map(|m| m.running),
            measured_waiting: m.map(|m| m.waiting),
            measured_active_blocks: m.map(|m| round_to_u64(f64::from(m.kv_usage) * m.capacity_blocks as f64)),
            max_running: m.and_then(|m| (m.max_num_seqs > 0).then_some(m.max_num_seqs)),
            capacity_blocks: m.and_then(|m| (m.capacity_blocks > 0).then_some(m.capacity_blocks)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Run, SequenceHash, UNPLACED, WorkerIdx, last_held, round_to_u64, window_cmp};
    use smallvec::smallvec;

    /// The order and the place of disagreement match a plain comparison of
    /// the windows, for sequences that fork from one another (chained
    /// hashes: equal at a position only if equal before it) at every place
    /// and end at every length.
    #[test]
    fn window_cmp_is_the_windows_plain_order() {
        // Sequence (f, v, n): a shared trunk up to `f`, then branch `v`, `n` long.
        let seq = |f: u64, v: u64, n: u64| -> Vec<SequenceHash> {
            (0..n).map(|i| SequenceHash(if i < f { i * 7 + 1 } else { (v + 1) << 40 | (f << 20) | i })).collect()
        };
        let mut all = Vec::new();
        for f in [0, 3, 5, 8, 12] {
            for v in 0..3 {
                for n in [2, 4, 5, 6, 9, 13, 20] {
                    all.push(seq(f, v, n));
                }
            }
        }
        let (from, to) = (3usize, 3 + 16);
        let cut = |x: &[SequenceHash]| -> Vec<u64> {
            x.get(from..x.len().min(to)).unwrap_or_default().iter().map(|h| h.0).collect()
        };
        for a in all.iter().filter(|a| a.len() >= from) {
            for b in all.iter().filter(|b| b.len() >= from && b[..from] == a[..from]) {
                let (order, lcp) = window_cmp(a, b, from, to);
                let (ca, cb) = (cut(a), cut(b));
                let plain = ca.iter().zip(&cb).take_while(|(x, y)| x == y).count();
                assert_eq!(lcp, from + plain, "{a:?} {b:?}");
                // Lexicographic by hash value, a prefix first.
                assert_eq!(order, ca.cmp(&cb), "{a:?} {b:?}");
            }
        }
    }

    /// Every budget places a worker at its last checkpoint or leaves it to
    /// the binary search; a budget as large as the lists places them all.
    #[test]
    fn last_held_places_each_worker_at_its_last_checkpoint_or_not_at_all() {
        // Worker w holds checkpoints 0..=depth[w] (two requests on w 3).
        let depth = [0usize, 4, 2, 4, 1, 0, 3];
        let lists: Vec<Vec<Run>> = (0..5)
            .map(|k| {
                let mut l: Vec<Run> = Vec::new();
                for (w, _) in depth.iter().enumerate().filter(|(_, d)| **d >= k) {
                    let mut slots = smallvec![2 * w as u32];
                    if w == 3 {
                        slots.push(7);
                    }
                    l.push(Run { worker: WorkerIdx(w as u32), slots });
                }
                l
            })
            .collect();
        let holders: Vec<&[Run]> = lists.iter().map(Vec::as_slice).collect();
        let total: usize = lists.iter().map(Vec::len).sum();
        for budget in 0..=total {
            let last = last_held(&holders, depth.len() + 2, budget);
            for (w, d) in depth.iter().enumerate() {
                let l = last[w];
                assert!(l == UNPLACED || l as usize == *d, "budget {budget}, worker {w}: {l}");
                if budget == total {
                    assert_eq!(l as usize, *d, "worker {w}");
                }
            }
            assert_eq!(last[depth.len()..], [UNPLACED, UNPLACED]);
        }
    }

    #[test]
    fn round_to_u64_is_round_as_u64() {
        let edges = [0.0, -0.0, 0.49999999999999994, 0.5, 1.5, 2.5, -0.5, -0.7, 1e15 + 0.5, 9.007e15, 1.9e19, 1e30];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let randoms = (0..10_000).map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64 * 50_000.0
        });
        for x in edges.into_iter().chain(randoms).chain([f64::NAN, f64::INFINITY, f64::NEG_INFINITY]) {
            assert_eq!(round_to_u64(x), x.round() as u64, "{x}");
        }
    }
}
