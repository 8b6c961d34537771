//! The paged KV cache of one simulated engine, with vLLM's prefix-caching
//! semantics (vLLM v1 `BlockPool` / `KVCacheManager`):
//!
//! * The cache has `capacity` physical blocks of `block_size` tokens.
//! * Only full blocks are cached, identified by a hash of the block's
//!   tokens and everything before it (the simulated engine's own hash:
//!   opaque, like vLLM's, and deliberately not kvgate's).
//! * A new request first takes the longest run of cached leading blocks
//!   (capped so that at least one prompt token is computed), and holds a
//!   reference on each.
//! * Other blocks come from the free queue, oldest free first. A free block
//!   that still holds a cached hash is evicted: `BlockRemoved`.
//! * When a block fills (prompt or generated tokens) it is cached:
//!   `BlockStored` with its parent. If the hash is already cached (two
//!   identical requests filling the same block), vLLM keeps both physical
//!   copies and publishes the store again; each copy is removed separately.
//! * A finished request frees its blocks in reverse order (last block
//!   first), so children are evicted before their parents.
//! * With a host tier ([`BlockPool::with_host`], vLLM's CPU offloading
//!   connector / LMCache), an evicted device block is copied to host memory
//!   (`BlockStored` medium `CPU`), least recently used out first
//!   (`BlockRemoved` medium `CPU`). A new request continues its device hit
//!   in host memory: those blocks are loaded back into fresh device blocks
//!   (cached there again: `BlockStored` medium `GPU`), and the engine charges
//!   their load time instead of a recompute.
//!
//! | operation | cost |
//! |---|---|
//! | `admit` | O(prompt blocks) |
//! | `append` (one token) | O(1), O(block_size) when a block fills |
//! | `free` | O(request blocks) |

use std::collections::{HashMap, VecDeque};

use foldhash::fast::RandomState;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of the simulated engine's block hash (not kvgate's 1337).
const ENGINE_SEED: u64 = 0x5151_7c0d_e000_0001;

/// The simulated engine's hash of a full block after `parent`.
pub fn engine_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(8 + tokens.len() * 4);
    bytes.extend_from_slice(&parent.unwrap_or(0).to_le_bytes());
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, ENGINE_SEED)
}

/// A change the engine publishes (vLLM's KV events).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Blocks cached: hashes in chain order, parent of the first, tokens.
    Stored {
        /// Hashes of the blocks.
        hashes: Vec<u64>,
        /// Hash of the parent of the first block.
        parent: Option<u64>,
        /// Their tokens, concatenated.
        tokens: Vec<u32>,
    },
    /// Cached blocks evicted (one hash per physical block).
    Removed {
        /// Hashes of the evicted blocks.
        hashes: Vec<u64>,
    },
    /// Evicted device blocks copied to the host tier (medium `CPU`).
    HostStored {
        /// Hashes of the blocks.
        hashes: Vec<u64>,
        /// Hash of the parent of the first block.
        parent: Option<u64>,
        /// Their tokens, concatenated.
        tokens: Vec<u32>,
    },
    /// Blocks dropped from the host tier (medium `CPU`).
    HostRemoved {
        /// Hashes of the dropped blocks.
        hashes: Vec<u64>,
    },
}

/// A block's parent hash and tokens, kept for the host tier.
type Contents = (Option<u64>, Box<[u32]>);

/// Host memory holding evicted blocks: hash → contents, least recently used
/// out first (recency by a tick; stale queue entries skipped).
#[derive(Debug)]
struct HostTier {
    capacity: usize,
    entries: HashMap<u64, (Contents, u64), RandomState>,
    lru: VecDeque<(u64, u64)>,
    tick: u64,
}

impl HostTier {
    fn touch(&mut self, h: u64) {
        self.tick += 1;
        if let Some((_, t)) = self.entries.get_mut(&h) {
            *t = self.tick;
            self.lru.push_back((self.tick, h));
        }
        if self.lru.len() > 4 * self.capacity + 64 {
            // Drop stale queue entries (one per touch) now and then.
            let entries = &self.entries;
            self.lru.retain(|(t, h)| entries.get(h).is_some_and(|(_, now)| now == t));
        }
    }

    /// Adds `h` (or refreshes it); returns the hashes dropped for room.
    fn insert(&mut self, h: u64, contents: Contents) -> Vec<u64> {
        if self.entries.contains_key(&h) {
            self.touch(h);
            return Vec::new();
        }
        let mut dropped = Vec::new();
        while self.entries.len() >= self.capacity {
            let Some((t, old)) = self.lru.pop_front() else { break };
            if self.entries.get(&old).is_some_and(|(_, now)| *now == t) {
                self.entries.remove(&old);
                dropped.push(old);
            }
        }
        self.tick += 1;
        self.entries.insert(h, (contents, self.tick));
        self.lru.push_back((self.tick, h));
        dropped
    }
}

#[derive(Debug, Clone, Default)]
struct Block {
    hash: Option<u64>,
    refs: u32,
}

/// Why a request could not be admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmitError {
    /// Not enough free blocks right now (the request waits).
    NoSpace,
}

/// A request's blocks.
#[derive(Debug, Clone, Default)]
pub struct Seq {
    blocks: Vec<usize>,
    tokens: Vec<u32>,
    /// Hash of the last full block, chained.
    last_hash: Option<u64>,
    /// Prompt tokens that were cache hits.
    pub hit_tokens: usize,
    /// Prompt tokens after those loaded back from the host tier.
    pub loaded_tokens: usize,
}

impl Seq {
    /// Tokens so far (prompt + generated).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it has no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Blocks held.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Physical block ids held, in order (the first `hit_tokens / block_size`
    /// were cache hits).
    pub fn block_ids(&self) -> &[usize] {
        &self.blocks
    }
}

/// The block pool.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    /// Free blocks, least recently freed first, with the generation they
    /// were freed in (an entry whose block was taken back since is stale).
    free: VecDeque<(usize, u32)>,
    /// Whether a block is free, and its free generation.
    in_free: Vec<bool>,
    generation: Vec<u32>,
    free_count: usize,
    /// Cached hash → physical blocks holding it.
    cached: HashMap<u64, Vec<usize>, RandomState>,
    events: Vec<CacheEvent>,
    /// Host tier, when the engine offloads.
    host: Option<HostTier>,
    /// Each cached block's parent and tokens (kept only with a host tier).
    contents: Vec<Option<Contents>>,
    /// Prefix-cache queries and hits, in tokens (vLLM's counters).
    pub queries_tokens: u64,
    /// See `queries_tokens`.
    pub hits_tokens: u64,
    /// Prompt tokens loaded back from the host tier.
    pub host_hits_tokens: u64,
}

impl BlockPool {
    /// A pool of `capacity` blocks of `block_size` tokens (both ≥ 1).
    pub fn new(capacity: usize, block_size: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            block_size: block_size.max(1),
            blocks: vec![Block::default(); capacity],
            free: (0..capacity).map(|b| (b, 0)).collect(),
            in_free: vec![true; capacity],
            generation: vec![0; capacity],
            free_count: capacity,
            cached: HashMap::default(),
            events: Vec::new(),
            host: None,
            contents: Vec::new(),
            queries_tokens: 0,
            hits_tokens: 0,
            host_hits_tokens: 0,
        }
    }

    /// The pool with a host tier of `host_blocks` blocks (0 = none).
    pub fn with_host(mut self, host_blocks: usize) -> Self {
        if host_blocks > 0 {
            self.host =
                Some(HostTier { capacity: host_blocks, entries: HashMap::default(), lru: VecDeque::new(), tick: 0 });
            self.contents = vec![None; self.blocks.len()];
        }
        self
    }

    /// Blocks held in the host tier.
    pub fn host_blocks(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.entries.len())
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Physical blocks.
    pub fn capacity(&self) -> usize {
        self.blocks.len()
    }

    /// Free blocks (including cached ones that may be evicted).
    pub fn free_blocks(&self) -> usize {
        self.free_count
    }

    /// Fraction of blocks in use by requests (vLLM's `kv_cache_usage_perc`).
    pub fn usage(&self) -> f64 {
        1.0 - self.free_count as f64 / self.blocks.len() as f64
    }

    /// Whether `hash` is cached (in any physical copy).
    pub fn is_cached(&self, hash: u64) -> bool {
        self.cached.contains_key(&hash)
    }

    /// Cached physical blocks, by hash (for tests and metrics).
    pub fn cached_copies(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.cached.iter().map(|(h, v)| (*h, v.len()))
    }

    /// Free cached blocks (block id, hash), in eviction order (for tests).
    pub fn eviction_order(&self) -> Vec<(usize, u64)> {
        self.free
            .iter()
            .filter(|(b, g)| self.in_free[*b] && self.generation[*b] == *g)
            .filter_map(|(b, _)| self.blocks[*b].hash.map(|h| (*b, h)))
            .collect()
    }

    /// Takes the events produced since the last call.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    fn pop_free(&mut self) -> Option<usize> {
        while let Some((b, g)) = self.free.pop_front() {
            if self.in_free[b] && self.generation[b] == g {
                self.in_free[b] = false;
                self.free_count -= 1;
                if let Some(h) = self.blocks[b].hash.take() {
                    self.uncache(h, b);
                    self.push_removed(h);
                    self.offload(b, h);
                }
                return Some(b);
            }
        }
        None
    }

    fn uncache(&mut self, h: u64, b: usize) {
        if let Some(v) = self.cached.get_mut(&h) {
            v.retain(|x| *x != b);
            if v.is_empty() {
                self.cached.remove(&h);
            }
        }
    }

    fn push_removed(&mut self, h: u64) {
        if let Some(CacheEvent::Removed { hashes }) = self.events.last_mut() {
            hashes.push(h);
        } else {
            self.events.push(CacheEvent::Removed { hashes: vec![h] });
        }
    }

    /// Copies evicted block `b` (hash `h`) to the host tier, if there is
    /// one and no other device copy remains.
    fn offload(&mut self, b: usize, h: u64) {
        let Some(contents) = self.contents.get_mut(b).and_then(Option::take) else { return };
        let Some(host) = self.host.as_mut() else { return };
        if self.cached.contains_key(&h) {
            return;
        }
        let fresh = !host.entries.contains_key(&h);
        let dropped = host.insert(h, contents.clone());
        if !dropped.is_empty() {
            self.events.push(CacheEvent::HostRemoved { hashes: dropped });
        }
        if fresh {
            let (parent, tokens) = contents;
            match self.events.last_mut() {
                // The chain continues the last offloaded run: one event.
                Some(CacheEvent::HostStored { hashes, tokens: t, .. }) if hashes.last().copied() == parent => {
                    hashes.push(h);
                    t.extend_from_slice(&tokens);
                }
                _ => self.events.push(CacheEvent::HostStored { hashes: vec![h], parent, tokens: tokens.into() }),
            }
        }
    }

    /// The blocks of `prompt` after the device hit (`from` blocks, last
    /// hash `parent`) held in the host tier, their hashes in order,
    /// keeping at least one prompt token to compute.
    fn host_continuation(&self, prompt: &[u32], from: usize, mut parent: Option<u64>) -> Vec<u64> {
        let Some(host) = &self.host else { return Vec::new() };
        let bs = self.block_size;
        let mut found = Vec::new();
        for chunk in prompt.chunks_exact(bs).take(prompt.len().saturating_sub(1) / bs).skip(from) {
            let h = engine_hash(parent, chunk);
            if !host.entries.contains_key(&h) {
                break;
            }
            found.push(h);
            parent = Some(h);
        }
        found
    }

    fn take_ref(&mut self, b: usize) {
        if self.in_free[b] {
            self.in_free[b] = false;
            self.free_count -= 1;
        }
        self.blocks[b].refs += 1;
    }

    /// Admits a request for chunked prefill: takes its cached prefix (with a
    /// reference on each hit block) and checks that the rest of the prompt
    /// fits in the free blocks now; blocks for the rest are allocated as the
    /// prefill chunks are computed ([`BlockPool::extend`]).
    pub fn admit_prefix(&mut self, prompt: &[u32]) -> Result<Seq, AdmitError> {
        let bs = self.block_size;
        let hits = self.longest_hit(prompt);
        let loaded = self.host_continuation(prompt, hits.len(), hits.last().map(|(_, h)| *h));
        let need = prompt.len().div_ceil(bs).saturating_sub(hits.len()) + 1;
        let hit_free = hits.iter().filter(|(b, _)| self.in_free[*b]).count();
        if self.free_count - hit_free < need {
            return Err(AdmitError::NoSpace);
        }
        self.queries_tokens += prompt.len() as u64;
        self.hits_tokens += (hits.len() * bs) as u64;
        for (b, _) in &hits {
            self.take_ref(*b);
        }
        let mut seq = Seq {
            hit_tokens: hits.len() * bs,
            loaded_tokens: 0,
            last_hash: hits.last().map(|(_, h)| *h),
            tokens: prompt[..hits.len() * bs].to_vec(),
            blocks: hits.into_iter().map(|(b, _)| b).collect(),
        };
        if !loaded.is_empty() {
            // Loaded back into fresh device blocks, cached there again.
            let from = seq.tokens.len();
            let tokens = prompt[from..from + loaded.len() * bs].to_vec();
            // Cannot run out of blocks: `need` counted them.
            let _ = self.extend(&mut seq, &tokens);
            seq.loaded_tokens = seq.tokens.len() - from;
            self.host_hits_tokens += seq.loaded_tokens as u64;
            if let Some(host) = self.host.as_mut() {
                for h in loaded.iter().take(seq.loaded_tokens / bs) {
                    host.touch(*h);
                }
            }
        }
        Ok(seq)
    }

    /// Tokens of the longest run of cached leading blocks of `prompt` (at
    /// least one prompt token left to compute), without taking them.
    pub fn cached_prefix_tokens(&self, prompt: &[u32]) -> usize {
        self.longest_hit(prompt).len() * self.block_size
    }

    /// The longest run of cached leading blocks of `prompt` (block, hash),
    /// keeping at least one prompt token to compute.
    fn longest_hit(&self, prompt: &[u32]) -> Vec<(usize, u64)> {
        let bs = self.block_size;
        let mut hits = Vec::new();
        let mut parent = None;
        for chunk in prompt.chunks_exact(bs).take(prompt.len().saturating_sub(1) / bs) {
            let h = engine_hash(parent, chunk);
            let Some(&b) = self.cached.get(&h).and_then(|v| v.first()) else { break };
            hits.push((b, h));
            parent = Some(h);
        }
        hits
    }

    /// Admits a request with `prompt` tokens, reserving blocks for the prompt
    /// plus `reserve_tokens` more. Returns the sequence, with its cache hits.
    pub fn admit(&mut self, prompt: &[u32], reserve_tokens: usize) -> Result<Seq, AdmitError> {
        let bs = self.block_size;
        let found = self.longest_hit(prompt);
        let parent = found.last().map(|(_, h)| *h);
        let hits: Vec<usize> = found.into_iter().map(|(b, _)| b).collect();
        let need = (prompt.len() + reserve_tokens).div_ceil(bs).saturating_sub(hits.len());
        let hit_free = hits.iter().filter(|b| self.in_free[**b]).count();
        if self.free_count - hit_free < need {
            return Err(AdmitError::NoSpace);
        }
        self.queries_tokens += prompt.len() as u64;
        self.hits_tokens += (hits.len() * bs) as u64;
        for b in &hits {
            self.take_ref(*b);
        }
        let mut seq = Seq {
            hit_tokens: hits.len() * bs,
            loaded_tokens: 0,
            last_hash: parent,
            tokens: prompt[..hits.len() * bs].to_vec(),
            blocks: hits,
        };
        for _ in 0..need {
            let b = self.pop_free().ok_or(AdmitError::NoSpace)?;
            self.blocks[b].refs = 1;
            seq.blocks.push(b);
        }
        // The prompt tokens after the hit are "computed" by the caller's
        // prefill; they are appended (and their blocks cached) here at once.
        let rest = prompt[seq.tokens.len()..].to_vec();
        self.extend(&mut seq, &rest);
        Ok(seq)
    }

    /// Appends computed tokens (prefill chunk or generated), caching every
    /// block they fill. Grows the request by a block when needed; returns
    /// false if no block was free (the caller preempts or waits).
    pub fn extend(&mut self, seq: &mut Seq, tokens: &[u32]) -> bool {
        let bs = self.block_size;
        let mut stored_hashes = Vec::new();
        let mut stored_tokens = Vec::new();
        let stored_parent = seq.last_hash;
        for t in tokens {
            if seq.tokens.len() == seq.blocks.len() * bs {
                match self.pop_free() {
                    Some(b) => {
                        self.blocks[b].refs = 1;
                        seq.blocks.push(b);
                    }
                    None => {
                        self.flush_stored(stored_parent, &mut stored_hashes, &mut stored_tokens);
                        return false;
                    }
                }
            }
            seq.tokens.push(*t);
            if seq.tokens.len().is_multiple_of(bs) {
                let i = seq.tokens.len() / bs - 1;
                let chunk = &seq.tokens[i * bs..];
                let h = engine_hash(seq.last_hash, chunk);
                let b = seq.blocks[i];
                self.blocks[b].hash = Some(h);
                self.cached.entry(h).or_default().push(b);
                if let Some(c) = self.contents.get_mut(b) {
                    *c = Some((seq.last_hash, chunk.into()));
                }
                stored_hashes.push(h);
                stored_tokens.extend_from_slice(chunk);
                seq.last_hash = Some(h);
            }
        }
        self.flush_stored(stored_parent, &mut stored_hashes, &mut stored_tokens);
        true
    }

    fn flush_stored(&mut self, parent: Option<u64>, hashes: &mut Vec<u64>, tokens: &mut Vec<u32>) {
        if !hashes.is_empty() {
            self.events.push(CacheEvent::Stored {
                hashes: std::mem::take(hashes),
                parent,
                tokens: std::mem::take(tokens),
            });
        }
    }

    /// Releases a finished (or preempted) request: blocks in reverse order,
    /// so that its last blocks are evicted first.
    pub fn free(&mut self, seq: Seq) {
        for b in seq.blocks.into_iter().rev() {
            let blk = &mut self.blocks[b];
            blk.refs = blk.refs.saturating_sub(1);
            if blk.refs == 0 {
                // vLLM appends every freed block at the tail of its queue.
                self.generation[b] = self.generation[b].wrapping_add(1);
                self.free.push_back((b, self.generation[b]));
                self.in_free[b] = true;
                self.free_count += 1;
            }
        }
    }
}
