//! One shard of the index: a set of workers, their engine tables, and the
//! prefix tree of the blocks they hold (`runs.rs`). A shard is single-owner; the
//! [`crate::Index`] spreads workers over shards and applies a batch of events
//! to its shards in parallel. See the crate README for the data layout and
//! the complexity of each operation.

use std::collections::HashMap;
use std::collections::hash_map::Entry as MapEntry;

use foldhash::fast::RandomState;
use kvgate_protocol::{EngineBlockHash, SequenceHash, local_block_hash, next_sequence_hash};

use crate::engine::{Engine, Entry, NO_SLOT, Probe, SpareBuckets};
use crate::event::{KvEvent, Origin, Stored, Tier};
use crate::runs::{HeadsAhead, Loc, Path, Runs};
use crate::types::{Counters, IndexConfig, Overlap, Skip, WorkerIdx};
use crate::worker_set::{SetRef, member_fp};

type Map<K, V> = HashMap<K, V, RandomState>;

/// How many blocks of an event ahead of the one being applied their
/// engine buckets are prefetched.
const LOOKAHEAD: usize = 4;

#[derive(Debug)]
struct Worker {
    name: String,
    /// Engine hash → entry, per tier.
    engine: [Engine; 2],
    /// Sequence hashes this worker holds under more than one engine hash:
    /// how many extra engine hashes (usually empty).
    aliases: [Map<SequenceHash, u32>; 2],
    /// Device blocks the worker can hold (from heartbeats), if known.
    capacity: Option<usize>,
    clock: u32,
    needs_resync: bool,
    /// Per tier: entries whose original parent entry is gone (or was never
    /// in this tier). Zero means every held block's whole chain is held:
    /// the worker's holdings are prefix-closed, which lets `find_matches`
    /// skip ahead. Never under-counted; may over-count (then only slower).
    holes: [u64; 2],
    /// A child count saturated: holes can no longer be trusted (until a clear).
    holes_unreliable: [bool; 2],
}

impl Worker {
    fn new(name: String) -> Self {
        Self {
            name,
            engine: [Engine::default(), Engine::default()],
            aliases: [Map::default(), Map::default()],
            capacity: None,
            clock: 0,
            needs_resync: false,
            holes: [0; 2],
            holes_unreliable: [false; 2],
        }
    }

    fn prefix_closed(&self, tier: Tier) -> bool {
        self.holes[tier.idx()] == 0 && !self.holes_unreliable[tier.idx()]
    }

    fn tick(&mut self) -> u32 {
        if self.clock == u32::MAX {
            // Renumber birth stamps in age order (once per 4 billion stores);
            // the order, all that accounting and trimming use, is kept.
            let mut all: Vec<(u32, usize, u32)> = Vec::new();
            for (t, map) in self.engine.iter().enumerate() {
                all.extend(map.iter().map(|(slot, e)| (e.born, t, slot)));
            }
            all.sort_unstable();
            for (i, (_, t, slot)) in all.iter().enumerate() {
                if let Some(e) = self.engine.get_mut(*t).and_then(|m| m.get_mut(*slot)) {
                    e.born = i as u32;
                }
            }
            self.clock = self.engine.iter().map(Engine::len).sum::<usize>() as u32;
        }
        self.clock += 1;
        self.clock
    }
}

/// One block of a stored chain, as `apply` hands it to `store_ref`.
#[derive(Debug, Clone, Copy)]
struct NewBlock {
    /// The engine's hash of the block.
    engine: u64,
    seq: SequenceHash,
    /// The engine hash it is stored under (the previous block, or the
    /// event's parent).
    parent: Option<u64>,
    /// Where the parent was just stored (a hint, checked before use).
    parent_slot: Option<u32>,
    /// The parent block's place in the prefix tree (`None`: the chain's first block).
    parent_loc: Option<Loc>,
    /// Blocks of the event from this one on.
    rest: usize,
}

/// Where the next block of a removal batch probably is, from the one
/// removed before it: its parent's slot (a chain evicted leaf first, as
/// vLLM does), else a slot next to it (a chain removed root first: a
/// chain's entries take consecutive slots, in one order or the other as
/// freed slots come back). A guess saves the engine-table probe; it is
/// checked by engine hash before use.
#[derive(Debug, Clone, Copy, Default)]
struct Hint {
    parent: Option<u32>,
    after: Option<u32>,
    before: Option<u32>,
}

/// One shard of a model's index: some of its workers, and the prefix tree
/// of the blocks they hold.
#[derive(Debug)]
pub(crate) struct Shard {
    config: IndexConfig,
    runs: Runs,
    workers: Vec<Option<Worker>>,
    free: Vec<WorkerIdx>,
    counters: Counters,
    seq_scratch: Vec<SequenceHash>,
}

impl Shard {
    /// An empty index.
    pub(crate) fn new(config: IndexConfig) -> Self {
        Self {
            config,
            runs: Runs::default(),
            workers: Vec::new(),
            free: Vec::new(),
            counters: Counters::default(),
            seq_scratch: Vec::new(),
        }
    }

    /// The counters.
    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Registers a worker by its id and returns its index in the shard.
    pub(crate) fn add_worker(&mut self, name: &str) -> WorkerIdx {
        let w = crate::types::take_slot(&mut self.workers, &mut self.free);
        if let Some(slot) = self.workers.get_mut(w.0 as usize) {
            *slot = Some(Worker::new(name.to_owned()));
        }
        w
    }

    /// The id of a registered worker.
    pub(crate) fn worker_name(&self, w: WorkerIdx) -> Option<&str> {
        self.slot(w).map(|s| s.name.as_str())
    }

    /// Removes a worker and all its blocks.
    pub(crate) fn remove_worker(&mut self, w: WorkerIdx) -> bool {
        if self.slot(w).is_none() {
            return false;
        }
        self.clear_worker(w);
        self.runs.trim();
        if let Some(slot) = self.workers.get_mut(w.0 as usize) {
            *slot = None;
        }
        self.free.push(w);
        true
    }

    /// Sets the device-block capacity of a worker (from its heartbeats); a
    /// worker holding more is trimmed, oldest stores first.
    pub(crate) fn set_capacity(&mut self, w: WorkerIdx, blocks: Option<usize>) {
        if let Some(mut held) = self.held(w) {
            held.worker.capacity = blocks;
            held.enforce_capacity();
        }
        self.runs.trim();
    }

    /// Whether a worker lost track of a parent since the last
    /// [`Shard::take_resync`] (the caller should ask its relay for a snapshot).
    pub(crate) fn needs_resync(&self, w: WorkerIdx) -> bool {
        self.slot(w).is_some_and(|s| s.needs_resync)
    }

    /// Reads and clears the resync mark of a worker.
    pub(crate) fn take_resync(&mut self, w: WorkerIdx) -> bool {
        self.slot_mut(w).is_some_and(|s| std::mem::take(&mut s.needs_resync))
    }

    /// Distinct engine blocks a worker holds in a tier.
    pub(crate) fn worker_blocks(&self, w: WorkerIdx, tier: Tier) -> usize {
        self.slot(w).and_then(|s| s.engine.get(tier.idx())).map_or(0, Engine::len)
    }

    /// Distinct sequence hashes in a tier (over all workers).
    pub(crate) fn distinct_blocks(&self, tier: Tier) -> usize {
        self.runs.live(tier)
    }

    /// Approximate heap bytes of the index (hash-table slots and worker sets).
    pub(crate) fn approx_heap_bytes(&self) -> usize {
        let mut total = self.runs.heap_bytes();
        for s in self.workers.iter().flatten() {
            total += s.engine.iter().map(Engine::heap_bytes).sum::<usize>();
            total += s.aliases.iter().map(crate::map_heap_bytes).sum::<usize>();
            total += s.name.capacity();
        }
        total
    }

    /// How many buckets the `tier` table of worker `w` grows to within the
    /// next `inserts` inserts, if it may ([`Engine::growth_ahead`]).
    pub(crate) fn growth_ahead(&self, w: WorkerIdx, tier: Tier, inserts: usize) -> Option<usize> {
        self.slot(w)?.engine.get(tier.idx())?.growth_ahead(inserts)
    }

    /// Gives the `tier` table of worker `w` spare buckets for its growth.
    pub(crate) fn give_spare(&mut self, w: WorkerIdx, tier: Tier, spare: SpareBuckets) {
        if let Some(e) = self.slot_mut(w).and_then(|s| s.engine.get_mut(tier.idx())) {
            e.give_spare(spare);
        }
    }

    /// A copy of the tree's heads with room for `runs` more, if they could
    /// fill it ([`Runs::heads_ahead`]).
    pub(crate) fn heads_ahead(&self, runs: usize) -> Option<HeadsAhead> {
        self.runs.heads_ahead(runs)
    }

    /// Takes a copy made by [`Shard::heads_ahead`] (see [`Runs::give_heads`]).
    pub(crate) fn give_heads(&mut self, ahead: HeadsAhead) {
        self.runs.give_heads(ahead);
    }

    fn slot(&self, w: WorkerIdx) -> Option<&Worker> {
        self.workers.get(w.0 as usize).and_then(Option::as_ref)
    }

    fn slot_mut(&mut self, w: WorkerIdx) -> Option<&mut Worker> {
        self.workers.get_mut(w.0 as usize).and_then(Option::as_mut)
    }

    /// Applies one event of worker `w`. A skipped event changes nothing but
    /// the counters (and, for [`Skip::UnknownParent`], the resync mark).
    pub(crate) fn apply(&mut self, w: WorkerIdx, event: &KvEvent<'_>) -> Result<(), Skip> {
        let r = match self.held(w) {
            None => Err(Skip::UnknownWorker),
            Some(mut held) => match event {
                KvEvent::Stored(s) => held.apply_stored(s),
                KvEvent::Removed { engine_hashes, tier } => {
                    held.apply_removed(engine_hashes, *tier);
                    Ok(())
                }
                KvEvent::Cleared => {
                    held.clear();
                    held.counters.clears += 1;
                    Ok(())
                }
            },
        };
        match r {
            Ok(()) => self.counters.events_applied += 1,
            Err(Skip::Malformed) => self.counters.skipped_malformed += 1,
            Err(Skip::BlockSize { .. }) => self.counters.skipped_block_size += 1,
            Err(Skip::UnknownParent) => self.counters.skipped_unknown_parent += 1,
            Err(Skip::UnknownWorker) => self.counters.skipped_unknown_worker += 1,
        }
        self.runs.trim();
        r
    }

    /// Worker `w` with the shard's prefix tree and counters, borrowed
    /// apart: what applying one of its events touches.
    fn held(&mut self, w: WorkerIdx) -> Option<Held<'_>> {
        let Self { config, runs, workers, counters, seq_scratch, .. } = self;
        let worker = workers.get_mut(w.0 as usize).and_then(Option::as_mut)?;
        Some(Held { w, worker, runs, counters, config, seqs: seq_scratch })
    }

    /// Drops up to `max` of worker `w`'s engine entries (device tier
    /// first); returns how many it still holds (`None`: no such worker).
    pub(crate) fn clear_part(&mut self, w: WorkerIdx, max: usize) -> Option<usize> {
        let left = self.held(w).map(|mut held| held.clear_part(max));
        self.runs.trim();
        if left == Some(0) {
            self.counters.clears += 1;
        }
        left
    }

    fn clear_worker(&mut self, w: WorkerIdx) {
        if let Some(mut held) = self.held(w) {
            held.clear();
        }
    }

    /// For every worker holding at least the first block of `hashes` in
    /// any tier, the number of leading blocks it holds in one tier or the
    /// other (a device prefix continued in host memory, as an offloading
    /// engine leaves it: it evicts a request's last blocks first), appended
    /// to `out`. Block by block: O(n · W) for n blocks and W
    /// matching workers; with no host blocks at all it is
    /// [`Shard::find_matches`] on the device tier.
    pub(crate) fn find_matches_any_tier(&self, hashes: &[SequenceHash], out: &mut Vec<Overlap>) {
        if self.runs.live(Tier::Host) == 0 {
            return self.find_matches(hashes, Tier::Device, out);
        }
        let mut path = Path::default();
        self.runs.path(hashes, &mut path);
        let holders = |j: usize| [self.runs.at(&path, j, Tier::Device), self.runs.at(&path, j, Tier::Host)];
        let mut active: Vec<WorkerIdx> = Vec::new();
        for set in holders(0).into_iter().flatten() {
            set.for_each(|w| {
                if !active.contains(&w) {
                    active.push(w);
                }
            });
        }
        for i in 1..hashes.len() {
            if active.is_empty() {
                return;
            }
            let [d, o] = holders(i);
            active.retain(|w| {
                let keep = d.is_some_and(|s| s.contains(*w)) || o.is_some_and(|s| s.contains(*w));
                if !keep {
                    out.push(Overlap { worker: *w, blocks: i as u32 });
                }
                keep
            });
        }
        let n = hashes.len() as u32;
        out.extend(active.into_iter().map(|worker| Overlap { worker, blocks: n }));
    }

    /// For every worker holding at least the first block of `hashes` in
    /// `tier`, the number of leading blocks it holds, appended to `out`.
    ///
    /// The prompt's blocks are first found in the prefix tree (a few runs,
    /// [`Runs::path`]). When every matching worker's holdings are
    /// prefix-closed (no holes), the workers holding block `j` can only
    /// shrink as `j` grows, so the walk gallops: exponential then binary
    /// search for the last block whose worker set still equals the matching
    /// set (same size and fingerprint), then an exact membership check at the
    /// next block. That is O(d · log n) set reads for d points where the set
    /// shrinks, instead of O(n). Otherwise it walks block by block (exact in
    /// every case).
    pub(crate) fn find_matches(&self, hashes: &[SequenceHash], tier: Tier, out: &mut Vec<Overlap>) {
        let mut path = Path::default();
        self.runs.path(hashes, &mut path);
        let at = |j: usize| self.runs.at(&path, j, tier);
        let Some(first) = at(0) else { return };
        let mut active: Vec<WorkerIdx> = Vec::with_capacity(first.len());
        first.for_each(|w| active.push(w));
        let mut fp = first.fingerprint();
        let n = path.len();
        let closed = active.iter().all(|w| self.slot(*w).is_some_and(|s| s.prefix_closed(tier)));
        if !closed {
            walk(&at, n, 1, active, fp, out);
            return;
        }
        let same = |j: usize, len: usize, fp: u64| at(j).is_some_and(|s| s.len() == len && s.fingerprint() == fp);
        let mut good = 0usize; // every active worker holds blocks 0..=good
        loop {
            let mut step = 1usize;
            while good + step < n && same(good + step, active.len(), fp) {
                good += step;
                step *= 2;
            }
            let mut bad = (good + step).min(n);
            while bad - good > 1 {
                let mid = good + (bad - good) / 2;
                if same(mid, active.len(), fp) {
                    good = mid;
                } else {
                    bad = mid;
                }
            }
            let next = good + 1;
            let Some(set) = at(next) else {
                let depth = next.min(n) as u32;
                out.extend(active.into_iter().map(|worker| Overlap { worker, blocks: depth }));
                return;
            };
            let dropped = drop_missing(&mut active, set, next, out);
            if active.is_empty() {
                return;
            }
            fp = fingerprint(&active);
            if dropped == 0 || set.len() != active.len() || set.fingerprint() != fp {
                // The set at `next` has members outside the matching set
                // (workers with holes): finish block by block.
                walk(&at, n, next + 1, active, fp, out);
                return;
            }
            good = next;
        }
    }

    /// Checks the internal invariants (for tests and fuzzing): every engine
    /// entry's sequence hash lists its worker, every listed worker holds the
    /// hash, and alias counts match. Returns a description of the first
    /// violation.
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        self.runs.check()?;
        for tier in Tier::ALL {
            // From workers to the table.
            for (i, slot) in self.workers.iter().enumerate() {
                let Some(worker) = slot else { continue };
                let w = WorkerIdx(i as u32);
                let map = &worker.engine[tier.idx()];
                let mut per_seq: Map<SequenceHash, u32> = Map::default();
                let mut held = 0usize;
                for (slot, e) in map.iter() {
                    if e.refs == 0 || u16::from(e.refs) > self.config.max_refs.max(1) {
                        return Err(format!("worker {i}: refs {} out of range", e.refs));
                    }
                    if map.find(e.engine) != Some(slot) {
                        return Err(format!("worker {i}: engine hash {} not found at its slot {slot}", e.engine));
                    }
                    let Some(seq) = self.runs.hash(e.loc) else {
                        return Err(format!("worker {i}: engine hash {} at {:?}, not a block", e.engine, e.loc));
                    };
                    if !self.runs.set(e.loc, tier).contains(w) {
                        return Err(format!("worker {i} holds {seq} but the tree does not list it"));
                    }
                    *per_seq.entry(seq).or_insert(0) += 1;
                    held += 1;
                }
                if held != map.len() {
                    return Err(format!("worker {i}: {held} entries held but len {}", map.len()));
                }
                for (seq, n) in &per_seq {
                    let aliases = worker.aliases[tier.idx()].get(seq).copied().unwrap_or(0);
                    if aliases != n - 1 {
                        return Err(format!("worker {i}: {seq} has {n} engine hashes but {aliases} aliases"));
                    }
                }
                if worker.aliases[tier.idx()].keys().any(|s| !per_seq.contains_key(s)) {
                    return Err(format!("worker {i}: alias for a hash it does not hold"));
                }
                // Parent/child accounting: child counts exact, holes never
                // below the real number of orphaned entries. A link counts
                // while its slot holds an older entry (the original parent).
                let mut orphans = 0u64;
                let mut children: Map<u32, u32> = Map::default();
                for (_, e) in map.iter() {
                    if !e.has_parent {
                        continue;
                    }
                    match map.get(e.parent) {
                        Some(p) if p.born < e.born => *children.entry(e.parent).or_insert(0) += 1,
                        _ => orphans += 1,
                    }
                }
                if !worker.holes_unreliable[tier.idx()] {
                    // No holes counted: every held block's parent in the
                    // tree is held in this tier too (what lets
                    // `find_matches` gallop).
                    if worker.holes[tier.idx()] == 0 {
                        let locs: std::collections::HashSet<Loc> = map.iter().map(|(_, e)| e.loc).collect();
                        if let Some(e) = map
                            .iter()
                            .map(|(_, e)| e)
                            .find(|e| self.runs.parent(e.loc).is_some_and(|p| !locs.contains(&p)))
                        {
                            return Err(format!(
                                "worker {i}: no holes counted, but the parent of {} is not held",
                                e.engine
                            ));
                        }
                    }
                    for (slot, e) in map.iter() {
                        let want = children.get(&slot).copied().unwrap_or(0);
                        if u32::from(e.children) != want {
                            return Err(format!(
                                "worker {i}: entry {} counts {} children, has {want}",
                                e.engine, e.children
                            ));
                        }
                    }
                    if worker.holes[tier.idx()] < orphans {
                        return Err(format!("worker {i}: {orphans} orphans but holes = {}", worker.holes[tier.idx()]));
                    }
                }
            }
            // From the tree to workers.
            for (loc, seq, set) in self.runs.held(tier) {
                let mut err = None;
                set.for_each(|w| {
                    let holds = self.slot(w).is_some_and(|s| s.engine[tier.idx()].iter().any(|(_, e)| e.loc == loc));
                    if !holds {
                        err = Some(format!("table lists worker {} for {seq}, which it does not hold", w.0));
                    }
                });
                if let Some(e) = err {
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// The sequence hash a worker holds under an engine hash (for tests).
    pub(crate) fn engine_entry(
        &self,
        w: WorkerIdx,
        tier: Tier,
        engine: EngineBlockHash,
    ) -> Option<(SequenceHash, u16)> {
        let map = self.slot(w)?.engine.get(tier.idx())?;
        map.get(map.find(engine.0)?).and_then(|e| Some((self.runs.hash(e.loc)?, u16::from(e.refs))))
    }
}

/// One worker of a shard, with the shard's prefix tree and counters
/// borrowed beside it: taken once per event ([`Shard::held`]), so that the
/// work on each block does not look the worker up again.
struct Held<'a> {
    w: WorkerIdx,
    worker: &'a mut Worker,
    runs: &'a mut Runs,
    counters: &'a mut Counters,
    config: &'a IndexConfig,
    /// The shard's scratch vector for an event's sequence hashes.
    seqs: &'a mut Vec<SequenceHash>,
}

impl Held<'_> {
    fn apply_stored(&mut self, s: &Stored<'_>) -> Result<(), Skip> {
        let bs = self.config.block_size;
        if s.block_size != bs.get() {
            return Err(Skip::BlockSize { got: s.block_size, want: bs.get() });
        }
        if s.engine_hashes.is_empty() || s.token_ids.len() != s.engine_hashes.len() * bs.as_usize() {
            return Err(Skip::Malformed);
        }
        let (mut prev, mut prev_loc) = match s.parent {
            None => (None, None),
            Some(p) => {
                let held = self.worker.engine.iter().find_map(|m| m.find(p).and_then(|s| m.get(s))).map(|e| e.loc);
                match held.and_then(|loc| Some((self.runs.hash(loc)?, loc))) {
                    Some((seq, loc)) => (Some(seq), Some(loc)),
                    None => {
                        self.worker.needs_resync = true;
                        return Err(Skip::UnknownParent);
                    }
                }
            }
        };
        let mut seqs = std::mem::take(self.seqs);
        seqs.clear();
        for block in s.token_ids.chunks_exact(bs.as_usize()) {
            let seq = next_sequence_hash(prev, local_block_hash(block, s.seed));
            seqs.push(seq);
            prev = Some(seq);
        }
        let max_refs = self.config.max_refs.clamp(1, u16::from(u8::MAX)) as u8;
        let mut parent = s.parent;
        let mut parent_slot = None;
        for (i, (h, seq)) in s.engine_hashes.iter().zip(&seqs).enumerate() {
            self.prefetch_store(s.tier, s.engine_hashes, i);
            let rest = seqs.len() - i;
            let block = NewBlock { engine: *h, seq: *seq, parent, parent_slot, parent_loc: prev_loc, rest };
            let (slot, loc) = self.store_ref(s.tier, block, s.origin, max_refs);
            (parent_slot, prev_loc) = (Some(slot), Some(loc));
            parent = Some(*h);
        }
        *self.seqs = seqs;
        if s.tier == Tier::Device {
            self.enforce_capacity();
        }
        Ok(())
    }

    /// Trims the worker's device blocks to its capacity, oldest first, down
    /// to 15/16 of it so that trimming is amortized.
    fn enforce_capacity(&mut self) {
        let Some(cap) = self.worker.capacity else { return };
        let map = &self.worker.engine[Tier::Device.idx()];
        if map.len() <= cap {
            return;
        }
        let target = cap - cap / 16;
        let mut ages: Vec<(u32, u32)> = map.iter().map(|(slot, e)| (e.born, slot)).collect();
        let excess = ages.len() - target;
        if excess < ages.len() {
            ages.select_nth_unstable(excess);
        }
        ages.truncate(excess);
        for (_, slot) in ages {
            if self.remove_entry(Tier::Device, slot, None) {
                self.counters.capacity_evictions += 1;
            }
        }
    }

    fn apply_removed(&mut self, engine_hashes: &[u64], tier: Tier) {
        let mut hint = Hint::default();
        for (i, h) in engine_hashes.iter().enumerate() {
            let found = self.hinted(tier, *h, hint);
            if found.is_none() {
                self.prefetch_removal(tier, engine_hashes, i);
            }
            hint = self.remove_ref(tier, *h, found);
        }
    }

    /// Software pipeline of a removal batch, run before removing block
    /// `i` when no [`Hint`] found it (at the start of an event, and where
    /// a removal batch leaves a chain or follows no stored order): the bucket of block `i + 3L` is prefetched, the entry of block
    /// `i + 2L` (its bucket is in by now), and the prefix-tree block of
    /// block `i + L` (its entry is in by now), L = [`LOOKAHEAD`]. By the time
    /// a block is removed, the three dependent misses of its removal have
    /// been started one after the other, overlapping with other blocks' work.
    #[inline]
    fn prefetch_removal(&self, tier: Tier, hashes: &[u64], i: usize) {
        let map = &self.worker.engine[tier.idx()];
        for j in ahead(i, 3 * LOOKAHEAD, hashes.len()) {
            map.prefetch_bucket(hashes[j]);
        }
        for j in ahead(i, 2 * LOOKAHEAD, hashes.len()) {
            map.prefetch_entry(hashes[j]);
        }
        for j in ahead(i, LOOKAHEAD, hashes.len()) {
            if let Some(e) = map.prefetch_entry(hashes[j]).and_then(|slot| map.get(slot)) {
                self.runs.prefetch(e.loc, tier);
            }
        }
    }

    /// Prefetch for a stored chain, run before storing block `i`: the
    /// engine bucket of block `i + L` and the free slot its entry will
    /// probably take (the prefix tree is walked in memory order).
    #[inline]
    fn prefetch_store(&self, tier: Tier, hashes: &[u64], i: usize) {
        let map = &self.worker.engine[tier.idx()];
        for j in ahead(i, LOOKAHEAD, hashes.len()) {
            map.prefetch_bucket(hashes[j]);
            map.prefetch_free(j - i);
        }
    }

    /// Adds a reference to `block`; returns its entry's slot and its place.
    #[inline]
    fn store_ref(&mut self, tier: Tier, block: NewBlock, origin: Origin, max_refs: u8) -> (u32, Loc) {
        let NewBlock { engine, seq, .. } = block;
        let map = &mut self.worker.engine[tier.idx()];
        let probe = map.probe(engine);
        let mut vacant = Some(probe);
        if let Some(slot) = probe.slot
            && let Some(e) = map.get_mut(slot)
        {
            if self.runs.hash(e.loc) == Some(seq) {
                match origin {
                    Origin::Reused => self.counters.reused_reports += 1,
                    _ if e.refs >= max_refs => self.counters.refs_capped += 1,
                    _ => {
                        e.refs += 1;
                        self.counters.blocks_stored += 1;
                    }
                }
                return (slot, e.loc);
            }
            // Same engine hash, other content: replace the old entry.
            self.counters.hash_conflicts += 1;
            self.remove_entry(tier, slot, Some(probe));
            vacant = None;
        }
        let placed = self.insert_entry(tier, block, vacant);
        if origin == Origin::Reused {
            self.counters.reused_reports += 1;
        } else {
            self.counters.blocks_stored += 1;
        }
        placed
    }

    /// Creates the worker's entry and its membership, with parent
    /// accounting; returns its slot and place. `vacant`: the probe that
    /// found its engine hash absent, when the table has not changed since
    /// (saves a second probe).
    #[inline]
    fn insert_entry(&mut self, tier: Tier, block: NewBlock, vacant: Option<Probe>) -> (u32, Loc) {
        let NewBlock { engine, seq, parent, parent_slot, parent_loc, rest } = block;
        let loc = self.runs.place(parent_loc, seq, rest);
        let t = tier.idx();
        let born = self.worker.tick();
        let map = &mut self.worker.engine[t];
        // The parent's slot: the hint when it still holds the parent's
        // engine hash, else a lookup. It is the parent only if it holds the
        // block this one continues: the event's parent may have been found
        // in the other tier, where this tier's entry under the same engine
        // hash can be another block (then this one is a hole).
        let is_parent = |e: &Entry, p: u64| e.engine == p && Some(e.loc) == parent_loc;
        let pslot = parent.and_then(|p| {
            parent_slot
                .filter(|s| map.get(*s).is_some_and(|e| is_parent(e, p)))
                .or_else(|| map.find(p).filter(|s| map.get(*s).is_some_and(|e| is_parent(e, p))))
        });
        match pslot.and_then(|s| map.get_mut(s)) {
            Some(pe) => match pe.children.checked_add(1) {
                Some(c) => pe.children = c,
                None => self.worker.holes_unreliable[t] = true,
            },
            None if parent.is_some() => self.worker.holes[t] += 1,
            None => {}
        }
        let entry = Entry {
            engine,
            loc,
            parent: pslot.unwrap_or(NO_SLOT),
            born,
            children: 0,
            refs: 1,
            has_parent: parent.is_some(),
        };
        let slot = match vacant {
            Some(at) => map.insert_at(at, entry),
            None => map.insert(entry),
        };
        self.add_membership(tier, loc, seq);
        (slot, loc)
    }

    /// Deletes the worker's entry (all references) and its membership, with
    /// parent/child accounting: its held children become holes; it stops
    /// being its parent's child, or a hole.
    ///
    /// `found`: the probe that found it, when the table has not changed
    /// since (saves a second probe).
    #[inline]
    fn remove_entry(&mut self, tier: Tier, slot: u32, found: Option<Probe>) -> bool {
        let t = tier.idx();
        let map = &mut self.worker.engine[t];
        let removed = match found {
            Some(at) if at.slot == Some(slot) => map.remove_at(at),
            _ => map.remove(slot),
        };
        let Some(e) = removed else { return false };
        let holes = &mut self.worker.holes[t];
        *holes += u64::from(e.children);
        if e.has_parent {
            match map.get_mut(e.parent) {
                // Its original parent (older than it): it was counted there.
                Some(pe) if pe.born < e.born => pe.children = pe.children.saturating_sub(1),
                // Parent gone, reborn later, or never in this tier: it was a hole.
                _ => *holes = holes.saturating_sub(1),
            }
        }
        self.drop_membership(tier, e.loc);
        true
    }

    /// The slot of `engine` if one of `hint`'s guesses holds it (checked by
    /// engine hash).
    #[inline]
    fn hinted(&self, tier: Tier, engine: u64, hint: Hint) -> Option<u32> {
        let map = &self.worker.engine[tier.idx()];
        [hint.parent, hint.after, hint.before]
            .into_iter()
            .flatten()
            .find(|s| map.get(*s).is_some_and(|e| e.engine == engine))
    }

    /// Drops one reference to `engine`; `found`: its slot, when a hint
    /// found it (else it is probed for). Returns the guesses for the next
    /// removal of the batch.
    #[inline]
    fn remove_ref(&mut self, tier: Tier, engine: u64, found: Option<u32>) -> Hint {
        let map = &mut self.worker.engine[tier.idx()];
        let (slot, probe) = match found {
            Some(slot) => (slot, None),
            None => {
                let probe = map.probe(engine);
                let Some(slot) = probe.slot else {
                    self.counters.unknown_removals += 1;
                    return Hint::default();
                };
                (slot, Some(probe))
            }
        };
        let Some(e) = map.get_mut(slot) else { return Hint::default() };
        self.counters.blocks_removed += 1;
        let hint = Hint {
            parent: (e.has_parent && e.parent != NO_SLOT).then_some(e.parent),
            after: slot.checked_add(1),
            before: slot.checked_sub(1),
        };
        if e.refs > 1 {
            e.refs -= 1;
            return hint;
        }
        self.remove_entry(tier, slot, probe);
        hint
    }

    /// Records that the worker holds `seq` (at `loc`) under one more engine hash.
    #[inline]
    fn add_membership(&mut self, tier: Tier, loc: Loc, seq: SequenceHash) {
        if !self.runs.add(loc, tier, self.w) {
            *self.worker.aliases[tier.idx()].entry(seq).or_insert(0) += 1;
        }
    }

    /// Records that the worker holds the block at `loc` under one engine hash fewer.
    #[inline]
    fn drop_membership(&mut self, tier: Tier, loc: Loc) {
        let aliases = &mut self.worker.aliases[tier.idx()];
        if !aliases.is_empty()
            && let Some(seq) = self.runs.hash(loc)
            && let MapEntry::Occupied(mut a) = aliases.entry(seq)
        {
            *a.get_mut() -= 1;
            if *a.get() == 0 {
                a.remove();
            }
            return;
        }
        self.runs.remove(loc, tier, self.w);
    }

    /// Drops up to `max` of the worker's entries, device tier first, each
    /// as a removal would (holes counted, so that the blocks it keeps meanwhile
    /// are matched exactly); returns how many it still holds. Last slots
    /// first: a chain takes slots in the order it was stored, so its
    /// later blocks go first and what is left still matches prompts as a
    /// prefix (mostly: freed slots are taken again in any order).
    fn clear_part(&mut self, max: usize) -> usize {
        let mut budget = max;
        for tier in Tier::ALL {
            let map = &self.worker.engine[tier.idx()];
            let some: Vec<(u32, u64)> = map.iter_rev().take(budget).map(|(slot, e)| (slot, e.engine)).collect();
            budget -= some.len();
            for (slot, engine) in some {
                let probe = self.worker.engine[tier.idx()].probe(engine);
                self.remove_entry(tier, slot, Some(probe));
            }
        }
        let left = self.worker.engine.iter().map(Engine::len).sum();
        if left == 0 {
            self.clear();
        }
        left
    }

    /// Drops all of the worker's blocks in every tier.
    fn clear(&mut self) {
        let maps: Vec<Engine> = self.worker.engine.iter_mut().map(std::mem::take).collect();
        for a in &mut self.worker.aliases {
            a.clear();
        }
        self.worker.holes = [0; 2];
        self.worker.holes_unreliable = [false; 2];
        for (tier, map) in Tier::ALL.iter().zip(maps) {
            for (_, e) in map.iter() {
                self.runs.remove(e.loc, *tier, self.w);
            }
        }
    }
}

/// The blocks to prefetch before working on block `i`, `k` blocks ahead in
/// a batch of `n`: block `i + k`, or at the start every block up to it.
#[inline]
fn ahead(i: usize, k: usize, n: usize) -> std::ops::Range<usize> {
    if i == 0 { 0..(k + 1).min(n) } else { (i + k).min(n)..(i + k + 1).min(n) }
}

/// The block-by-block walk of `find_matches` from block `start` of the `n`
/// the prefix tree has, with `active` the workers holding every block
/// before it; `at(j)` is the holders of block `j`.
fn walk<'a>(
    at: &impl Fn(usize) -> Option<SetRef<'a>>,
    n: usize,
    start: usize,
    mut active: Vec<WorkerIdx>,
    mut fp: u64,
    out: &mut Vec<Overlap>,
) {
    let mut depth = n;
    for i in start..n {
        let Some(set) = at(i) else {
            depth = i;
            break;
        };
        if set.len() == active.len() && set.fingerprint() == fp {
            continue;
        }
        if drop_missing(&mut active, set, i, out) > 0 {
            if active.is_empty() {
                return;
            }
            fp = fingerprint(&active);
        }
    }
    let depth = depth.max(start.min(n)) as u32;
    out.extend(active.into_iter().map(|worker| Overlap { worker, blocks: depth }));
}

/// Removes from `active` the workers `set` lacks, recording that they match
/// `depth` blocks; returns how many were removed.
fn drop_missing(active: &mut Vec<WorkerIdx>, set: SetRef<'_>, depth: usize, out: &mut Vec<Overlap>) -> usize {
    let before = active.len();
    active.retain(|w| {
        let keep = set.contains(*w);
        if !keep {
            out.push(Overlap { worker: *w, blocks: depth as u32 });
        }
        keep
    });
    before - active.len()
}

/// The fingerprint of a set of workers (as `WorkerSet::fingerprint`).
fn fingerprint(workers: &[WorkerIdx]) -> u64 {
    workers.iter().fold(0u64, |s, w| s.wrapping_add(member_fp(*w)))
}
