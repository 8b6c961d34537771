//! The per-model index: its workers spread over shards, each shard single-owner
//! with its own engine tables and prefix tree (`shard.rs`). One shard is the whole
//! index as it always was; with more, [`Index::apply_batch`] applies a batch's
//! events shard by shard on parallel threads (a worker's events stay in order,
//! on one thread), and a lookup asks every shard and joins their answers.
//! See the crate README for the layout and the complexity of each operation.

use std::collections::HashMap;
use std::sync::Mutex;

use foldhash::fast::RandomState;
use kvgate_protocol::{EngineBlockHash, SequenceHash};

use crate::engine::SpareBuckets;
use crate::event::{KvEvent, Tier};
use crate::runs::HeadsAhead;
use crate::shard::Shard;
use crate::types::take_slot;
pub use crate::types::{Counters, IndexConfig, Overlap, Skip, WorkerIdx};

/// One shard's part of a batch: the shard, and (position in the batch, the
/// worker's index in the shard) of each of its events.
type Job<'s, 'l> = (&'s mut Shard, &'l [(usize, WorkerIdx)]);

/// Empty buckets made ahead for the engine tables a batch's stores may grow,
/// and grown copies of the shards' run heads they may fill
/// ([`Index::spares_for`], under a shared borrow: beside lookups), handed
/// over with [`Index::give_spares`] before the batch is applied.
#[derive(Debug, Default)]
pub struct Spares {
    buckets: Vec<(WorkerIdx, Tier, SpareBuckets)>,
    heads: Vec<(usize, HeadsAhead)>,
}

impl Spares {
    /// Tables given spare buckets.
    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    /// Whether no table needs spare buckets.
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// Shards whose run heads were copied with room to grow.
    pub fn heads(&self) -> usize {
        self.heads.len()
    }
}

/// Where a worker lives: its shard and its index there.
#[derive(Debug, Clone, Copy)]
struct Place {
    shard: usize,
    local: WorkerIdx,
}

/// One model's index: every worker's cached blocks, by sequence hash.
#[derive(Debug)]
pub struct Index {
    config: IndexConfig,
    shards: Vec<Shard>,
    /// By worker: where it lives (`None` while its index is free).
    places: Vec<Option<Place>>,
    /// By shard, by index in the shard: the worker's index in the [`Index`].
    globals: Vec<Vec<WorkerIdx>>,
    /// Live workers per shard (a new worker goes to the emptiest).
    live: Vec<usize>,
    free: Vec<WorkerIdx>,
    by_name: HashMap<String, WorkerIdx, RandomState>,
    /// Workers removed so far (a removed worker's index may be handed to
    /// the next one: an answer read before a removal may name it).
    removals: u64,
    /// Events for workers that are not registered.
    unknown: Counters,
}

impl Index {
    /// An empty index with `config.shards` shards (at least one).
    pub fn new(config: IndexConfig) -> Self {
        let n = usize::from(config.shards.max(1));
        Self {
            config,
            shards: (0..n).map(|_| Shard::new(config)).collect(),
            places: Vec::new(),
            globals: vec![Vec::new(); n],
            live: vec![0; n],
            free: Vec::new(),
            by_name: HashMap::default(),
            removals: 0,
            unknown: Counters::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> IndexConfig {
        self.config
    }

    /// The counters, summed over shards.
    pub fn counters(&self) -> Counters {
        let mut c = self.unknown;
        for s in &self.shards {
            c.add(s.counters());
        }
        c
    }

    fn place(&self, w: WorkerIdx) -> Option<Place> {
        self.places.get(w.0 as usize).copied().flatten()
    }

    /// Registers a worker by its id (idempotent) and returns its index. A new
    /// worker joins the shard with the fewest workers.
    pub fn add_worker(&mut self, name: &str) -> WorkerIdx {
        if let Some(w) = self.by_name.get(name) {
            return *w;
        }
        let shard = (0..self.live.len()).min_by_key(|s| self.live.get(*s).copied().unwrap_or(usize::MAX)).unwrap_or(0);
        let Some(s) = self.shards.get_mut(shard) else { return WorkerIdx(u32::MAX) };
        let local = s.add_worker(name);
        let w = take_slot(&mut self.places, &mut self.free);
        if let Some(p) = self.places.get_mut(w.0 as usize) {
            *p = Some(Place { shard, local });
        }
        if let Some(g) = self.globals.get_mut(shard) {
            let i = local.0 as usize;
            if g.len() <= i {
                g.resize(i + 1, WorkerIdx(u32::MAX));
            }
            if let Some(slot) = g.get_mut(i) {
                *slot = w;
            }
        }
        if let Some(n) = self.live.get_mut(shard) {
            *n += 1;
        }
        self.by_name.insert(name.to_owned(), w);
        w
    }

    /// The index of a registered worker.
    pub fn worker(&self, name: &str) -> Option<WorkerIdx> {
        self.by_name.get(name).copied()
    }

    /// The id of a registered worker.
    pub fn worker_name(&self, w: WorkerIdx) -> Option<&str> {
        let p = self.place(w)?;
        self.shards.get(p.shard)?.worker_name(p.local)
    }

    /// Registered workers.
    pub fn workers(&self) -> impl Iterator<Item = (WorkerIdx, &str)> + '_ {
        (0..self.places.len() as u32).filter_map(|i| Some((WorkerIdx(i), self.worker_name(WorkerIdx(i))?)))
    }

    /// Workers removed since the index was made: answers read at two
    /// times name the same workers by the same indices when this is the
    /// same at both.
    pub fn removals(&self) -> u64 {
        self.removals
    }

    /// Number of registered workers.
    pub fn worker_count(&self) -> usize {
        self.by_name.len()
    }

    /// Removes a worker and all its blocks.
    pub fn remove_worker(&mut self, w: WorkerIdx) -> bool {
        let Some(p) = self.place(w) else { return false };
        self.removals += 1;
        let name = self.worker_name(w).map(str::to_owned);
        if let Some(s) = self.shards.get_mut(p.shard) {
            s.remove_worker(p.local);
        }
        if let Some(slot) = self.places.get_mut(w.0 as usize) {
            *slot = None;
        }
        if let Some(n) = self.live.get_mut(p.shard) {
            *n = n.saturating_sub(1);
        }
        if let Some(name) = name {
            self.by_name.remove(&name);
        }
        self.free.push(w);
        true
    }

    /// Drops up to `max` of worker `w`'s blocks (engine entries, device
    /// tier first) and returns how many it still holds (`None`: no such
    /// worker): a [`KvEvent::Cleared`] in parts, so that a caller can let
    /// lookups in between. The blocks kept meanwhile are matched exactly.
    /// Counted as a clear when nothing is left.
    pub fn clear_part(&mut self, w: WorkerIdx, max: usize) -> Option<usize> {
        let p = self.place(w)?;
        self.shards.get_mut(p.shard)?.clear_part(p.local, max)
    }

    /// Sets the device-block capacity of a worker (from its heartbeats); a
    /// worker holding more is trimmed, oldest stores first.
    pub fn set_capacity(&mut self, w: WorkerIdx, blocks: Option<usize>) {
        if let Some(p) = self.place(w)
            && let Some(s) = self.shards.get_mut(p.shard)
        {
            s.set_capacity(p.local, blocks);
        }
    }

    /// Whether a worker lost track of a parent since the last
    /// [`Index::take_resync`] (the caller should ask its relay for a snapshot).
    pub fn needs_resync(&self, w: WorkerIdx) -> bool {
        self.place(w).and_then(|p| Some(self.shards.get(p.shard)?.needs_resync(p.local))).unwrap_or(false)
    }

    /// Reads and clears the resync mark of a worker.
    pub fn take_resync(&mut self, w: WorkerIdx) -> bool {
        let Some(p) = self.place(w) else { return false };
        self.shards.get_mut(p.shard).is_some_and(|s| s.take_resync(p.local))
    }

    /// Distinct engine blocks a worker holds in a tier.
    pub fn worker_blocks(&self, w: WorkerIdx, tier: Tier) -> usize {
        self.place(w).and_then(|p| Some(self.shards.get(p.shard)?.worker_blocks(p.local, tier))).unwrap_or(0)
    }

    /// Distinct sequence hashes in a tier, per shard, summed: a block held
    /// in two shards counts twice (exact with one shard; zero exactly when
    /// no worker holds a block in the tier).
    pub fn distinct_blocks(&self, tier: Tier) -> usize {
        self.shards.iter().map(|s| s.distinct_blocks(tier)).sum()
    }

    /// Approximate heap bytes of the index (hash-table slots and worker sets).
    pub fn approx_heap_bytes(&self) -> usize {
        self.shards.iter().map(Shard::approx_heap_bytes).sum::<usize>()
            + self.places.capacity() * std::mem::size_of::<Option<Place>>()
            + self.globals.iter().map(|g| g.capacity() * 4).sum::<usize>()
    }

    /// Applies one event of worker `w`. A skipped event changes nothing but
    /// the counters (and, for [`Skip::UnknownParent`], the resync mark).
    pub fn apply(&mut self, w: WorkerIdx, event: &KvEvent<'_>) -> Result<(), Skip> {
        match self.place(w) {
            Some(p) => match self.shards.get_mut(p.shard) {
                Some(s) => s.apply(p.local, event),
                None => Err(Skip::UnknownWorker),
            },
            None => {
                self.unknown.skipped_unknown_worker += 1;
                Err(Skip::UnknownWorker)
            }
        }
    }

    /// Applies a batch of events, each as [`Index::apply`] would, and
    /// returns their results in order. The events of each shard are applied
    /// in the batch's order; shards with events run on parallel threads
    /// (scoped to this call: one thread is started per shard beyond the
    /// first, so batches should be large enough to pay for that, about
    /// 20 µs each). The outcome is the same as applying the events one by
    /// one: shards share nothing, and a worker's events are all in one.
    pub fn apply_batch(&mut self, events: &[(WorkerIdx, KvEvent<'_>)]) -> Vec<Result<(), Skip>> {
        let mut results = vec![Ok(()); events.len()];
        let mut work: Vec<Vec<(usize, WorkerIdx)>> = vec![Vec::new(); self.shards.len()];
        for (i, (w, _)) in events.iter().enumerate() {
            match self.place(*w) {
                Some(p) => {
                    if let Some(list) = work.get_mut(p.shard) {
                        list.push((i, p.local));
                    }
                }
                None => {
                    self.unknown.skipped_unknown_worker += 1;
                    if let Some(r) = results.get_mut(i) {
                        *r = Err(Skip::UnknownWorker);
                    }
                }
            }
        }
        let run = |shard: &mut Shard, list: &[(usize, WorkerIdx)]| -> Vec<(usize, Result<(), Skip>)> {
            list.iter().filter_map(|(i, local)| Some((*i, shard.apply(*local, &events.get(*i)?.1)))).collect()
        };
        let mut jobs: Vec<Job<'_, '_>> =
            self.shards.iter_mut().zip(&work).filter(|(_, l)| !l.is_empty()).map(|(s, l)| (s, l.as_slice())).collect();
        let done: Vec<Vec<(usize, Result<(), Skip>)>> = match jobs.pop() {
            None => Vec::new(),
            Some((last, list)) if jobs.is_empty() => vec![run(last, list)],
            Some((last, last_list)) => {
                // Each job waits in a slot its thread takes it from, so that
                // a thread that cannot be started leaves its job to this one.
                let slots: Vec<Mutex<Option<Job<'_, '_>>>> = jobs.into_iter().map(|j| Mutex::new(Some(j))).collect();
                std::thread::scope(|scope| {
                    let mut handles = Vec::new();
                    for slot in &slots {
                        let job = move || take(slot).map(|(shard, list)| run(shard, list)).unwrap_or_default();
                        if let Ok(h) = std::thread::Builder::new().spawn_scoped(scope, job) {
                            handles.push(h);
                        }
                    }
                    let mut done = vec![run(last, last_list)];
                    // Jobs whose thread did not start.
                    done.extend(slots.iter().filter_map(|slot| take(slot).map(|(shard, list)| run(shard, list))));
                    // A shard's thread does not panic (the crate has no
                    // panicking paths); if one did, its events' results stay `Ok`.
                    done.extend(handles.into_iter().filter_map(|h| h.join().ok()));
                    done
                })
            }
        };
        for (i, r) in done.into_iter().flatten() {
            if let Some(slot) = results.get_mut(i) {
                *slot = r;
            }
        }
        results
    }

    /// Empty buckets for each engine table that `stores` (worker, tier,
    /// blocks to store) may grow when applied. A table grows at a rebuild,
    /// and growing writes a new bucket array: fresh pages, whose faults
    /// are most of its time (on a VM, a growth to 1 MiB of buckets took
    /// ~5 ms, a rebuild in place ~0.6 ms: `docs/DECISIONS.md`). Made here,
    /// under a shared borrow (a read lock lookups share), a growth under the
    /// write lock takes them ready. Allocates only for tables whose
    /// occupied buckets may pass their limit within the stores, and whose
    /// growth is one doubling (`Engine::growth_ahead`). Likewise a shard's
    /// map of run heads, copied with room to grow when the stores could
    /// fill it (`Runs::heads_ahead`).
    pub fn spares_for(&self, stores: &[(WorkerIdx, Tier, usize)]) -> Spares {
        let mut sums: Vec<(WorkerIdx, Tier, usize)> = stores.to_vec();
        sums.sort_unstable_by_key(|(w, t, _)| (*w, *t));
        sums.dedup_by(|later, kept| {
            let same = (later.0, later.1) == (kept.0, kept.1);
            if same {
                kept.2 = kept.2.saturating_add(later.2);
            }
            same
        });
        let mut out = Vec::new();
        let mut per_shard = vec![0usize; self.shards.len()];
        for (w, tier, n) in sums {
            let Some(p) = self.place(w) else { continue };
            if let Some(s) = per_shard.get_mut(p.shard) {
                *s = s.saturating_add(n);
            }
            if let Some(buckets) = self.shards.get(p.shard).and_then(|s| s.growth_ahead(p.local, tier, n)) {
                out.push((w, tier, SpareBuckets::new(buckets)));
            }
        }
        // Each stored block may start a run at most.
        let heads = (self.shards.iter().zip(per_shard).enumerate())
            .filter_map(|(i, (s, n))| Some((i, s.heads_ahead(n)?)))
            .collect();
        Spares { buckets: out, heads }
    }

    /// Hands spare buckets ([`Index::spares_for`]) to their tables; those
    /// of a worker gone since are dropped.
    pub fn give_spares(&mut self, spares: Spares) {
        for (i, ahead) in spares.heads {
            if let Some(s) = self.shards.get_mut(i) {
                s.give_heads(ahead);
            }
        }
        for (w, tier, spare) in spares.buckets {
            let Some(p) = self.place(w) else { continue };
            if let Some(s) = self.shards.get_mut(p.shard) {
                s.give_spare(p.local, tier, spare);
            }
        }
    }

    /// Rewrites the workers of `out[start..]`, found in `shard`, as the
    /// index's own.
    fn globalize(&self, shard: usize, out: &mut [Overlap]) {
        let Some(g) = self.globals.get(shard) else { return };
        for o in out {
            if let Some(w) = g.get(o.worker.0 as usize) {
                o.worker = *w;
            }
        }
    }

    /// For every worker holding at least the first block of `hashes` in
    /// any tier, the number of leading blocks it holds in one tier or the
    /// other (a device prefix continued in host memory, as an offloading
    /// engine leaves it: it evicts a request's last blocks first), in `out`
    /// (cleared first). Block by block in each shard: O(n · W) for n blocks
    /// and W matching workers; with no host blocks at all it is
    /// [`Index::find_matches`] on the device tier.
    pub fn find_matches_any_tier(&self, hashes: &[SequenceHash], out: &mut Vec<Overlap>) {
        out.clear();
        for (i, s) in self.shards.iter().enumerate() {
            let start = out.len();
            s.find_matches_any_tier(hashes, out);
            if let Some(found) = out.get_mut(start..) {
                self.globalize(i, found);
            }
        }
    }

    /// For every worker holding at least the first block of `hashes` in
    /// `tier`, the number of leading blocks it holds, in `out` (cleared
    /// first).
    ///
    /// In each shard: when every matching worker's holdings are
    /// prefix-closed (no holes), the workers holding block `j` can only
    /// shrink as `j` grows, so the walk gallops: exponential then binary
    /// search for the last block whose worker set still equals the matching
    /// set (same size and fingerprint), then an exact membership check at
    /// the next block. That is O(d · log n) lookups for d points where the
    /// set shrinks, instead of O(n). Otherwise it walks block by block
    /// (exact in every case).
    pub fn find_matches(&self, hashes: &[SequenceHash], tier: Tier, out: &mut Vec<Overlap>) {
        out.clear();
        for (i, s) in self.shards.iter().enumerate() {
            let start = out.len();
            s.find_matches(hashes, tier, out);
            if let Some(found) = out.get_mut(start..) {
                self.globalize(i, found);
            }
        }
    }

    /// Checks the internal invariants (for tests and fuzzing): in every
    /// shard, every engine entry's sequence hash lists its worker, every
    /// listed worker holds the hash, and alias counts match; every worker is
    /// where the index says. Returns a description of the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (i, s) in self.shards.iter().enumerate() {
            s.check_invariants().map_err(|e| format!("shard {i}: {e}"))?;
        }
        for (i, p) in self.places.iter().enumerate() {
            let Some(p) = p else { continue };
            let back = self.globals.get(p.shard).and_then(|g| g.get(p.local.0 as usize));
            if back != Some(&WorkerIdx(i as u32)) {
                return Err(format!("worker {i}: shard {} index {} maps back to {back:?}", p.shard, p.local.0));
            }
            let name = self.worker_name(WorkerIdx(i as u32));
            if name.and_then(|n| self.by_name.get(n)) != Some(&WorkerIdx(i as u32)) {
                return Err(format!("worker {i}: name {name:?} not registered to it"));
            }
        }
        if self.by_name.len() != self.places.iter().flatten().count() {
            return Err(format!("{} names for {} workers", self.by_name.len(), self.places.iter().flatten().count()));
        }
        Ok(())
    }

    /// The sequence hash a worker holds under an engine hash (for tests).
    pub fn engine_entry(&self, w: WorkerIdx, tier: Tier, engine: EngineBlockHash) -> Option<(SequenceHash, u16)> {
        let p = self.place(w)?;
        self.shards.get(p.shard)?.engine_entry(p.local, tier, engine)
    }
}

/// Takes what waits in a slot (nothing if it was taken, or its lock poisoned).
fn take<T>(slot: &Mutex<Option<T>>) -> Option<T> {
    slot.lock().ok().and_then(|mut j| j.take())
}
