//! Router-predicted load per worker, from the lifecycle of the requests the
//! router (and its replicas) routed: added → first token → done.
//!
//! | operation | cost |
//! |---|---|
//! | [`LoadTracker::added`] | O(prompt blocks) |
//! | [`LoadTracker::first_token`] | O(1) |
//! | [`LoadTracker::done`] | O(prompt blocks) |
//! | [`LoadTracker::expire`] | O(in-flight requests) |
//! | [`LoadTracker::load`] | O(1) |
//! | [`LoadTracker::inflight_shares`] (every worker at once) | O(n + Σ over the prompt's blocks of the workers holding each) |
//! | [`LoadTracker::inflight_share`] (one worker) | the same |
//!
//! Active blocks are deduplicated per worker: a multiset of the prompt's
//! sequence hashes, so ten requests sharing a 4,000-token system prompt count
//! its blocks once, as the engine's prefix cache does. Output blocks are
//! per request (`ceil(expected_output_tokens / block_size)`).
//!
//! The multisets are kept inverted, one table for all workers: a block's
//! hash → the workers whose requests in flight hold it, with counts (a short
//! vector). A Pick asks what every worker's requests in flight share with
//! its prompt: one lookup per prompt block and a walk of that block's short
//! vector, instead of one lookup per block per worker (which cost ~300 µs
//! per Pick at 100 workers with 1,000 requests in flight sharing starters;
//! docs/DECISIONS.md).

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use foldhash::fast::RandomState;
use kvgate_index::WorkerIdx;
use kvgate_protocol::SequenceHash;

use crate::policy::Load;

type Map<K, V> = HashMap<K, V, RandomState>;

/// The workers holding one hash in flight, with counts, sorted by worker
/// (a shared prefix in flight on a large fleet has a holder per worker:
/// found by binary search, not a scan).
type Holders = Vec<(WorkerIdx, u32)>;

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
}

#[derive(Debug)]
struct Inflight {
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

/// Where `worker` is (`Ok`) or goes (`Err`) in sorted holders: a scan for
/// a few (as fast, and the common case), a binary search for many.
fn position(holders: &Holders, worker: WorkerIdx) -> Result<usize, usize> {
    if holders.len() <= 16 {
        match holders.iter().position(|(w, _)| w.0 >= worker.0) {
            Some(i) if holders.get(i).is_some_and(|(w, _)| *w == worker) => Ok(i),
            Some(i) => Err(i),
            None => Err(holders.len()),
        }
    } else {
        holders.binary_search_by_key(&worker.0, |(w, _)| w.0)
    }
}

/// Adds one count of `worker` to each hash; returns how many hashes the
/// worker did not hold before.
fn count(table: &mut Map<SequenceHash, Holders>, worker: WorkerIdx, hashes: &[SequenceHash]) -> u64 {
    let mut new = 0;
    for h in hashes {
        let holders = table.entry(*h).or_default();
        match position(holders, worker) {
            Ok(i) => {
                if let Some((_, n)) = holders.get_mut(i) {
                    *n += 1;
                }
            }
            Err(i) => {
                holders.insert(i, (worker, 1));
                new += 1;
            }
        }
    }
    new
}

/// Takes one count of `worker` out of each hash; returns how many hashes
/// the worker no longer holds.
fn uncount(table: &mut Map<SequenceHash, Holders>, worker: WorkerIdx, hashes: &[SequenceHash]) -> u64 {
    let mut gone = 0;
    for h in hashes {
        let Entry::Occupied(mut o) = table.entry(*h) else { continue };
        let holders = o.get_mut();
        let Ok(i) = position(holders, worker) else { continue };
        holders[i].1 -= 1;
        if holders[i].1 == 0 {
            holders.remove(i);
            gone += 1;
            if holders.is_empty() {
                o.remove();
            }
        }
    }
    gone
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
    requests: Map<String, Inflight>,
    /// Prompt blocks of the requests in flight: hash → workers, counts.
    prompt_blocks: Map<SequenceHash, Holders>,
    /// Blocks that requests still prefilling compute themselves (their
    /// prompt after the overlap they were routed with): hash → workers.
    computing: Map<SequenceHash, Holders>,
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
        self.inflight_shares(prompt).get(worker.0 as usize).copied().unwrap_or_default()
    }

    /// What the requests in flight on each worker share with `prompt`,
    /// indexed by `WorkerIdx` (workers beyond the vector's end share
    /// nothing; the vector grows to the largest holder of the first block,
    /// as only those can share anything).
    ///
    /// Block hashes are chained, so a worker that holds block `k` of the
    /// prompt in flight holds every block before it: each holder of the
    /// first block finds its share by binary search over the prompt
    /// (O(holders × log blocks) lookups, not a walk of every holder of
    /// every block). Then one walk of the shared blocks over the holders
    /// still computing them (requests before their first token, few).
    pub fn inflight_shares(&self, prompt: &[SequenceHash]) -> Vec<InflightShare> {
        let mut out: Vec<InflightShare> = Vec::new();
        let Some(first) = prompt.first().and_then(|h| self.prompt_blocks.get(h)) else { return out };
        let top = first.iter().map(|(w, _)| w.0 as usize + 1).max().unwrap_or(0);
        out.resize(top, InflightShare::default());
        let holds = |k: usize, w: WorkerIdx| {
            prompt.get(k).and_then(|h| self.prompt_blocks.get(h)).is_some_and(|hs| position(hs, w).is_ok())
        };
        let mut longest = 0;
        for (w, _) in first {
            // Invariant: it holds block lo - 1 and not block hi.
            let (mut lo, mut hi) = (1, prompt.len());
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                if holds(mid, *w) { lo = mid + 1 } else { hi = mid }
            }
            if let Some(s) = out.get_mut(w.0 as usize) {
                s.blocks = u32::try_from(lo).unwrap_or(u32::MAX);
            }
            longest = longest.max(lo);
        }
        if !self.computing.is_empty() {
            for (i, h) in prompt.iter().take(longest).enumerate() {
                for (w, _) in self.computing.get(h).map_or(&[][..], Vec::as_slice) {
                    if let Some(s) = out.get_mut(w.0 as usize)
                        && (i as u64) < u64::from(s.blocks)
                    {
                        s.computing += 1;
                    }
                }
            }
        }
        out
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
        let Entry::Vacant(slot) = self.requests.entry(request_id.to_owned()) else {
            return Err(LifecycleError::Duplicate);
        };
        let w = worker_mut(&mut self.workers, worker);
        w.inflight += 1;
        w.prefill_pending_blocks += new_prefill_blocks;
        w.output_blocks += output_blocks;
        w.counted_prompt_blocks += counted_prompt_blocks;
        w.distinct_prompt_blocks += count(&mut self.prompt_blocks, worker, &prompt);
        count(&mut self.computing, worker, prompt.get(own_from..).unwrap_or_default());
        slot.insert(Inflight {
            worker,
            prompt,
            own_from,
            counted_prompt_blocks,
            new_prefill_blocks,
            output_blocks,
            prefilling: true,
            added_ms: now_ms,
        });
        Ok(())
    }

    /// The request's first token arrived: its prefill is done.
    pub fn first_token(&mut self, request_id: &str) -> Result<(), LifecycleError> {
        let r = self.requests.get_mut(request_id).ok_or(LifecycleError::Unknown)?;
        if std::mem::take(&mut r.prefilling)
            && let Some(Some(w)) = self.workers.get_mut(r.worker.0 as usize)
        {
            w.prefill_pending_blocks = w.prefill_pending_blocks.saturating_sub(r.new_prefill_blocks);
            uncount(&mut self.computing, r.worker, r.prompt.get(r.own_from..).unwrap_or_default());
        }
        Ok(())
    }

    /// The request finished (or failed): its load is released.
    pub fn done(&mut self, request_id: &str) -> Result<(), LifecycleError> {
        let r = self.requests.remove(request_id).ok_or(LifecycleError::Unknown)?;
        self.release(r);
        Ok(())
    }

    fn release(&mut self, r: Inflight) {
        let Some(Some(w)) = self.workers.get_mut(r.worker.0 as usize) else { return };
        w.inflight = w.inflight.saturating_sub(1);
        if r.prefilling {
            w.prefill_pending_blocks = w.prefill_pending_blocks.saturating_sub(r.new_prefill_blocks);
            uncount(&mut self.computing, r.worker, r.prompt.get(r.own_from..).unwrap_or_default());
        }
        w.output_blocks = w.output_blocks.saturating_sub(r.output_blocks);
        w.counted_prompt_blocks = w.counted_prompt_blocks.saturating_sub(r.counted_prompt_blocks);
        let gone = uncount(&mut self.prompt_blocks, r.worker, &r.prompt);
        w.distinct_prompt_blocks = w.distinct_prompt_blocks.saturating_sub(gone);
    }

    /// Drops requests added more than `ttl_ms` ago whose end was never seen
    /// (a lost report must not leave phantom load forever). Returns how many.
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) -> usize {
        let old: Vec<String> = self
            .requests
            .iter()
            .filter(|(_, r)| now_ms.saturating_sub(r.added_ms) > ttl_ms)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &old {
            if let Some(r) = self.requests.remove(k) {
                self.release(r);
            }
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
        let ids: Vec<String> =
            self.requests.iter().filter(|(_, r)| r.worker == worker).map(|(k, _)| k.clone()).collect();
        for id in ids {
            if let Some(r) = self.requests.remove(&id) {
                self.release(r);
            }
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
            measured_active_blocks: m.map(|m| (f64::from(m.kv_usage) * m.capacity_blocks as f64).round() as u64),
            max_running: m.and_then(|m| (m.max_num_seqs > 0).then_some(m.max_num_seqs)),
            capacity_blocks: m.and_then(|m| (m.capacity_blocks > 0).then_some(m.capacity_blocks)),
        }
    }
}
