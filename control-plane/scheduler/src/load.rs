//! Router-predicted load per worker, from the lifecycle of the requests the
//! router (and its replicas) routed: added → first token → done.
//!
//! n = prompt blocks, d = nodes on its path in the tree of prefixes
//! ([`crate::prefixes`]), p = requests still prefilling on one worker (few),
//! S = workers with requests in flight through the prompt's first node.
//!
//! | operation | cost |
//! |---|---|
//! | [`LoadTracker::added`] | an addition to the tree, which reads the worker's share on the way (d map lookups, O(n) sequential compares) |
//! | [`LoadTracker::first_token`] | O(p) |
//! | [`LoadTracker::done`] | a removal from the tree, which reads what the worker still shares on the way (d map lookups) |
//! | [`LoadTracker::expire`] | O(in-flight requests) |
//! | [`LoadTracker::load`] | O(1) |
//! | share of one worker | the prompt's path in the tree (d lookups, O(n) compares, O(d · log S)) + O(p · log n) |
//! | [`LoadTracker::inflight_shares`] (every worker at once) | the prompt's path once + the workers along it (O(S) for a system prompt every request holds) + O(p · log n) per sharing worker |
//!
//! Active blocks are deduplicated per worker, as the engine's prefix cache
//! does: ten requests sharing a 4,000-token system prompt count its blocks
//! once. Output blocks are per request
//! (`ceil(expected_output_tokens / block_size)`). A request's distinct
//! blocks are its length less what the worker's other requests already
//! share with it.
//!
//! What a worker's requests share with a prompt is read from one tree of
//! the prompts in flight, whose nodes know which workers' requests pass
//! through them. Registering every block of every prompt in a map instead
//! cost a third of the control plane's CPU for 100K-token prompts at 1,000
//! workers; indexing every 16th block, with a binary search per worker,
//! cost 1.5 ms per Pick at 1,000 workers with 64 requests each
//! (docs/DECISIONS.md).

use std::collections::HashMap;

use foldhash::fast::RandomState;
use kvgate_index::WorkerIdx;
use kvgate_protocol::SequenceHash;

use crate::policy::Load;
use crate::prefixes::Prefixes;

type Map<K, V> = HashMap<K, V, RandomState>;

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
    /// Its requests still prefilling.
    prefilling: Vec<Prefilling>,
}

/// A request still prefilling, with what a share reads of it first: where
/// its own prefill starts in its prompt (the overlap it was routed with)
/// and that block's hash.
#[derive(Debug, Clone, Copy)]
struct Prefilling {
    slot: u32,
    own_from: usize,
    own_first: Option<SequenceHash>,
}

#[derive(Debug)]
struct Inflight {
    id: String,
    worker: WorkerIdx,
    prompt: Box<[SequenceHash]>,
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

/// Where `a` and `b` stop agreeing (chained hashes agree at a position
/// only if they agree before it, so that place is found by bisection:
/// O(log n) reads).
fn agree_until(a: &[SequenceHash], b: &[SequenceHash]) -> usize {
    let same = |i: usize| a.get(i).is_some_and(|x| b.get(i) == Some(x));
    let (mut lo, mut hi) = (0, a.len().min(b.len()));
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if same(mid) { lo = mid + 1 } else { hi = mid }
    }
    lo
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
    /// The prompts in flight, by worker.
    prefixes: Prefixes,
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

    /// Leading blocks of `prompt` that requests in flight on `worker`
    /// share (their prompt hashes, deduplicated).
    pub fn inflight_prefix(&self, worker: WorkerIdx, prompt: &[SequenceHash]) -> u32 {
        self.inflight_share(worker, prompt).blocks
    }

    /// [`LoadTracker::inflight_prefix`], and how many of those shared
    /// blocks a request on `worker` that has no first token yet is still
    /// computing (a follower's first token waits for them).
    pub fn inflight_share(&self, worker: WorkerIdx, prompt: &[SequenceHash]) -> InflightShare {
        self.share(worker, prompt, self.prefixes.shared(worker, prompt))
    }

    /// What the requests in flight on each worker share with `prompt`,
    /// indexed by `WorkerIdx` (workers beyond the vector's end share
    /// nothing). One walk of the prompt's path in the tree of prefixes.
    pub fn inflight_shares(&self, prompt: &[SequenceHash]) -> Vec<InflightShare> {
        let mut blocks = Vec::new();
        self.prefixes.shares(prompt, &mut blocks);
        blocks.iter().enumerate().map(|(w, b)| self.share(WorkerIdx(w as u32), prompt, *b)).collect()
    }

    /// The share of `worker`, whose requests share `blocks` with `prompt`.
    fn share(&self, worker: WorkerIdx, prompt: &[SequenceHash], blocks: usize) -> InflightShare {
        if blocks == 0 {
            return InflightShare::default();
        }
        let computing = self.computing_on(worker, prompt, blocks);
        InflightShare { blocks: u32::try_from(blocks).unwrap_or(u32::MAX), computing }
    }

    fn request(&self, slot: u32) -> Option<&Inflight> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    /// Of `prompt`'s blocks, how many a request still prefilling on
    /// `worker` computes itself (from the overlap it was routed with to
    /// where it stops agreeing with `prompt`). `shared`: what the worker's
    /// requests share with `prompt`, which bounds every span. A request
    /// whose own part starts past that, or that differs from `prompt` where
    /// its own part starts, computes none of it (read from the worker's
    /// list, without reading the request).
    fn computing_on(&self, worker: WorkerIdx, prompt: &[SequenceHash], shared: usize) -> u32 {
        let Some(Some(w)) = self.workers.get(worker.0 as usize) else { return 0 };
        let mut spans = Vec::new();
        for p in &w.prefilling {
            if p.own_from >= shared || p.own_first.is_none() || prompt.get(p.own_from) != p.own_first.as_ref() {
                continue;
            }
            let Some(r) = self.request(p.slot) else { continue };
            let until = agree_until(&r.prompt, prompt).min(shared);
            if p.own_from == 0 && until == shared {
                // All of it: no other span adds anything.
                return u32::try_from(shared).unwrap_or(u32::MAX);
            }
            spans.push((p.own_from, until));
        }
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
        let new_distinct = (prompt.len() - self.prefixes.add(worker, &prompt)) as u64;
        let own_from = own_from.min(prompt.len());
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(None);
                u32::try_from(self.slots.len() - 1).unwrap_or(u32::MAX)
            }
        };
        let w = worker_mut(&mut self.workers, worker);
        w.inflight += 1;
        w.prefill_pending_blocks += new_prefill_blocks;
        w.output_blocks += output_blocks;
        w.counted_prompt_blocks += counted_prompt_blocks;
        w.distinct_prompt_blocks += new_distinct;
        w.prefilling.push(Prefilling { slot, own_from, own_first: prompt.get(own_from).copied() });
        self.requests.insert(request_id.to_owned(), slot);
        if let Some(e) = self.slots.get_mut(slot as usize) {
            *e = Some(Inflight {
                id: request_id.to_owned(),
                worker,
                prompt,
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
            w.prefilling.retain(|p| p.slot != slot);
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
        let gone = (r.prompt.len() - self.prefixes.remove(r.worker, &r.prompt)) as u64;
        let Some(Some(w)) = self.workers.get_mut(r.worker.0 as usize) else { return };
        w.inflight = w.inflight.saturating_sub(1);
        if r.prefilling {
            w.prefill_pending_blocks = w.prefill_pending_blocks.saturating_sub(r.new_prefill_blocks);
            w.prefilling.retain(|p| p.slot != slot);
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
    use super::round_to_u64;

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
