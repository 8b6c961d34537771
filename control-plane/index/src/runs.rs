//! The prefix tree of one shard: every distinct block its workers hold, in
//! runs of consecutive blocks, with the workers that hold each block in
//! each tier.
//!
//! A sequence hash names a whole prefix, so the blocks form a tree: a
//! block's parent is the block before it in its prompt. The tree is kept
//! path-compressed. A *run* is a chain of blocks, each the child of the one
//! before it, stored as parallel vectors (hashes, device sets, host sets).
//! A block that continues its parent's run at the run's end is appended to
//! it; one that departs from a run in the middle (or follows a block that
//! already has a continuation) starts a new run, a *branch*, whose first
//! hash is a key of `heads`. Root runs (a chain's first block) are keys of
//! `heads` too. A stored chain therefore walks or extends one run block by
//! block in memory order, and touches the hash map only where it branches.
//!
//! Positions ([`Loc`]: run and offset) never move while a worker holds
//! them: a block nobody holds any more stays in its run (empty sets) while
//! blocks after it or branches from it remain, and is trimmed once it is
//! the run's last block with no branch from it. Trimming is deferred
//! ([`Runs::trim`]) to the end of an event so that the positions an event
//! works with stay valid while it is applied. A run left empty is freed, and
//! its parent run trimmed in turn.
//!
//! | operation | time |
//! |---|---|
//! | [`Runs::place`] | O(1): compare the parent's next block, else one hash-map lookup where the parent run branches, else append or a new run |
//! | [`Runs::add`], [`Runs::remove`] | O(1) for sets of up to two, O(k) for k holders |
//! | [`Runs::trim`] | O(blocks trimmed + runs freed) |
//! | [`Runs::path`] | O(s · log n) for a prompt of n blocks over s runs: galloping within a run (equal hashes at one offset mean equal prefixes) |

use std::collections::HashMap;

use foldhash::fast::RandomState;
use kvgate_protocol::SequenceHash;

use crate::event::Tier;
use crate::paged::Paged;
use crate::probing::prefetch_read;
use crate::types::WorkerIdx;
use crate::worker_set::{ManySets, SetRef, WorkerSet};

/// The position of one block in the tree: its run and its offset there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Loc {
    pub(crate) run: u32,
    pub(crate) off: u32,
}

/// No position (a free engine slot).
pub(crate) const NO_LOC: Loc = Loc { run: u32::MAX, off: u32::MAX };

/// One run: consecutive blocks, each the child of the one before.
#[derive(Debug, Default)]
struct Run {
    hashes: Vec<SequenceHash>,
    /// Device holders per block.
    device: Vec<WorkerSet>,
    /// Host holders per block; shorter than `hashes` (the rest empty) until
    /// a host block is stored in the run.
    host: Vec<WorkerSet>,
    /// Its first block's hash (its key in `heads`).
    head: SequenceHash,
    /// The block this run continues (`None`: a root).
    parent: Option<Loc>,
    /// Offsets in this run that other runs branch from, with how many
    /// branch there, by offset.
    branches: Vec<(u32, u32)>,
}

impl Run {
    fn len(&self) -> usize {
        self.hashes.len()
    }

    fn branches_at(&self, off: u32) -> bool {
        self.branches.binary_search_by_key(&off, |b| b.0).is_ok()
    }

    fn set(&self, tier: Tier, off: usize) -> WorkerSet {
        let v = match tier {
            Tier::Device => &self.device,
            Tier::Host => &self.host,
        };
        v.get(off).copied().unwrap_or(WorkerSet::EMPTY)
    }

    fn dead(&self, off: usize) -> bool {
        self.set(Tier::Device, off) == WorkerSet::EMPTY && self.set(Tier::Host, off) == WorkerSet::EMPTY
    }

    fn push(&mut self, seq: SequenceHash) {
        self.hashes.push(seq);
        self.device.push(WorkerSet::EMPTY);
    }

    fn heap_bytes(&self) -> usize {
        self.hashes.capacity() * std::mem::size_of::<SequenceHash>()
            + (self.device.capacity() + self.host.capacity()) * std::mem::size_of::<WorkerSet>()
            + self.branches.capacity() * std::mem::size_of::<(u32, u32)>()
    }
}

/// One stretch of a prompt found in one run: prompt blocks `start..start +
/// len` are the run's blocks `off..off + len`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Seg {
    start: usize,
    run: u32,
    off: usize,
    len: usize,
}

/// Where a prompt's leading blocks are in the tree (held or not).
#[derive(Debug, Default)]
pub(crate) struct Path {
    segs: Vec<Seg>,
}

impl Path {
    /// Prompt blocks that have a position.
    pub(crate) fn len(&self) -> usize {
        self.segs.last().map_or(0, |s| s.start + s.len)
    }
}

/// A copy of a shard's `heads` with room to grow ([`Runs::heads_ahead`]).
#[derive(Debug)]
pub(crate) struct HeadsAhead {
    map: HashMap<SequenceHash, u32, RandomState>,
    changes: u64,
}

/// The prefix tree of one shard; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct Runs {
    runs: Paged<Run>,
    free: Vec<u32>,
    /// First hash of every run → the run.
    heads: HashMap<SequenceHash, u32, RandomState>,
    /// Inserts and removals of `heads` so far (a copy made ahead is taken
    /// only while this is as it was).
    heads_changes: u64,
    /// Sets of more than two workers, per tier.
    many: [ManySets; 2],
    /// Blocks with at least one holder, per tier.
    live: [usize; 2],
    /// Runs whose tails may be trimmable, for [`Runs::trim`].
    pending: Vec<u32>,
}

impl Runs {
    /// The position of block `seq` whose parent block is at `parent`
    /// (`None`: the first block of a chain), created when absent. `parent`
    /// must be a position the caller holds. `rest`: blocks of the chain from
    /// this one on, room for which a run that grows is given at once.
    #[inline]
    pub(crate) fn place(&mut self, parent: Option<Loc>, seq: SequenceHash, rest: usize) -> Loc {
        let held =
            parent.and_then(|p| Some((p, self.runs.get(p.run as usize).filter(|r| (p.off as usize) < r.len())?)));
        let Some((p, run)) = held else {
            if let Some(&r) = self.heads.get(&seq) {
                return Loc { run: r, off: 0 };
            }
            return self.new_run(None, seq, rest);
        };
        let next = p.off + 1;
        if run.hashes.get(next as usize) == Some(&seq) {
            return Loc { run: p.run, off: next };
        }
        let (append, branches) = (next as usize == run.len(), run.branches_at(p.off));
        if branches && let Some(&r) = self.heads.get(&seq) {
            return Loc { run: r, off: 0 };
        }
        if append && let Some(run) = self.runs.get_mut(p.run as usize) {
            if run.hashes.len() == run.hashes.capacity() {
                run.hashes.reserve(rest);
                run.device.reserve(rest);
            }
            run.push(seq);
            return Loc { run: p.run, off: next };
        }
        self.new_run(Some(p), seq, rest)
    }

    fn new_run(&mut self, parent: Option<Loc>, seq: SequenceHash, rest: usize) -> Loc {
        let mut run = Run {
            hashes: Vec::with_capacity(rest.max(1)),
            device: Vec::with_capacity(rest.max(1)),
            parent,
            head: seq,
            ..Run::default()
        };
        run.push(seq);
        let id = match self.free.pop() {
            Some(id) => {
                if let Some(slot) = self.runs.get_mut(id as usize) {
                    *slot = run;
                }
                id
            }
            None => self.runs.push(run) as u32,
        };
        self.heads.insert(seq, id);
        self.heads_changes += 1;
        if let Some(p) = parent
            && let Some(pr) = self.runs.get_mut(p.run as usize)
        {
            match pr.branches.binary_search_by_key(&p.off, |b| b.0) {
                Ok(i) => {
                    if let Some(b) = pr.branches.get_mut(i) {
                        b.1 += 1;
                    }
                }
                Err(i) => pr.branches.insert(i, (p.off, 1)),
            }
        }
        Loc { run: id, off: 0 }
    }

    /// The sequence hash at `loc`.
    #[inline]
    pub(crate) fn hash(&self, loc: Loc) -> Option<SequenceHash> {
        self.runs.get(loc.run as usize).and_then(|r| r.hashes.get(loc.off as usize)).copied()
    }

    /// The place of the block `loc` continues (`None`: a root, or no such place).
    pub(crate) fn parent(&self, loc: Loc) -> Option<Loc> {
        let run = self.runs.get(loc.run as usize)?;
        match loc.off.checked_sub(1) {
            Some(off) => Some(Loc { run: loc.run, off }),
            None => run.parent,
        }
    }

    /// Starts loading the holders of `loc` in `tier` (for a use some blocks
    /// later).
    #[inline]
    pub(crate) fn prefetch(&self, loc: Loc, tier: Tier) {
        if let Some(run) = self.runs.get(loc.run as usize) {
            let v = match tier {
                Tier::Device => &run.device,
                Tier::Host => &run.host,
            };
            if let Some(s) = v.get(loc.off as usize) {
                prefetch_read(s);
            }
        }
    }

    /// The holders of the block at `loc` in `tier`.
    #[inline]
    pub(crate) fn set(&self, loc: Loc, tier: Tier) -> SetRef<'_> {
        let s = self.runs.get(loc.run as usize).map_or(WorkerSet::EMPTY, |r| r.set(tier, loc.off as usize));
        self.view(s, tier)
    }

    /// The members of `s` (none for [`WorkerSet::EMPTY`]).
    fn view(&self, s: WorkerSet, tier: Tier) -> SetRef<'_> {
        let [device, host] = &self.many;
        match tier {
            Tier::Device => device.view(s),
            Tier::Host => host.view(s),
        }
    }

    #[inline]
    fn slot_mut(&mut self, loc: Loc, tier: Tier) -> Option<(&mut WorkerSet, &mut ManySets)> {
        let run = self.runs.get_mut(loc.run as usize)?;
        let off = loc.off as usize;
        if off >= run.hashes.len() {
            return None;
        }
        let v = match tier {
            Tier::Device => &mut run.device,
            Tier::Host => &mut run.host,
        };
        if v.len() <= off {
            v.resize(run.hashes.len(), WorkerSet::EMPTY);
        }
        Some((v.get_mut(off)?, self.many.get_mut(tier.idx())?))
    }

    /// Adds `w` to the holders of `loc` in `tier`; false when it was there.
    #[inline]
    pub(crate) fn add(&mut self, loc: Loc, tier: Tier, w: WorkerIdx) -> bool {
        let Some((set, many)) = self.slot_mut(loc, tier) else { return false };
        if *set == WorkerSet::EMPTY {
            *set = WorkerSet::one(w);
            if let Some(n) = self.live.get_mut(tier.idx()) {
                *n += 1;
            }
            return true;
        }
        many.insert(set, w)
    }

    /// Removes `w` from the holders of `loc` in `tier`. A block left with
    /// no holder is trimmed at the next [`Runs::trim`] if it can be.
    #[inline]
    pub(crate) fn remove(&mut self, loc: Loc, tier: Tier, w: WorkerIdx) {
        let Some((set, many)) = self.slot_mut(loc, tier) else { return };
        if *set == WorkerSet::EMPTY || many.remove(set, w).is_some() {
            return;
        }
        *set = WorkerSet::EMPTY;
        if let Some(n) = self.live.get_mut(tier.idx()) {
            *n = n.saturating_sub(1);
        }
        self.pending.push(loc.run);
    }

    /// Trims the runs that removals left with dead tails: their last blocks
    /// that no one holds and no run branches from; a run left empty is
    /// freed, and its parent trimmed in turn.
    pub(crate) fn trim(&mut self) {
        while let Some(mut id) = self.pending.pop() {
            // A run already freed (listed twice) has nothing to trim.
            while let Some(run) = self.runs.get_mut(id as usize).filter(|r| r.len() > 0) {
                while let Some(last) = run.len().checked_sub(1) {
                    if !run.dead(last) || run.branches_at(last as u32) {
                        break;
                    }
                    run.hashes.pop();
                    run.device.truncate(last);
                    run.host.truncate(last);
                }
                if run.len() > 0 {
                    break;
                }
                let Run { parent, head, .. } = std::mem::take(run);
                self.heads.remove(&head);
                self.heads_changes += 1;
                self.free.push(id);
                let Some(p) = parent else { break };
                let Some(pr) = self.runs.get_mut(p.run as usize) else { break };
                if let Ok(i) = pr.branches.binary_search_by_key(&p.off, |b| b.0) {
                    match pr.branches.get_mut(i) {
                        Some(b) if b.1 > 1 => b.1 -= 1,
                        _ => {
                            pr.branches.remove(i);
                        }
                    }
                }
                id = p.run;
            }
        }
    }

    /// Where the leading blocks of a prompt are (held or not).
    pub(crate) fn path(&self, hashes: &[SequenceHash], out: &mut Path) {
        out.segs.clear();
        let Some(first) = hashes.first() else { return };
        let Some(&root) = self.heads.get(first) else { return };
        let (mut id, mut off, mut start) = (root, 0usize, 0usize);
        loop {
            let Some(run) = self.runs.get(id as usize) else { return };
            let Some(rest) = hashes.get(start..) else { return };
            let Some(blocks) = run.hashes.get(off..) else { return };
            let len = common_prefix(rest, blocks);
            if len == 0 {
                return;
            }
            out.segs.push(Seg { start, run: id, off, len });
            start += len;
            let Some(next) = hashes.get(start) else { return };
            let last = (off + len - 1) as u32;
            if !run.branches_at(last) {
                return;
            }
            match self.heads.get(next) {
                Some(&r) => (id, off) = (r, 0),
                None => return,
            }
        }
    }

    /// The holders in `tier` of prompt block `j` of `path`, `None` past the
    /// path or where no one holds it.
    #[inline]
    pub(crate) fn at(&self, path: &Path, j: usize, tier: Tier) -> Option<SetRef<'_>> {
        let i = path.segs.partition_point(|s| s.start + s.len <= j);
        let seg = path.segs.get(i).filter(|s| s.start <= j)?;
        let run = self.runs.get(seg.run as usize)?;
        let s = run.set(tier, seg.off + (j - seg.start));
        (s != WorkerSet::EMPTY).then(|| self.view(s, tier))
    }

    /// A copy of `heads` with room for `n` more runs, when `n` new runs
    /// could exhaust its room: the insert that does rehashes every head
    /// (into a table twice the size, or in place to clear removals'
    /// tombstones), 74 ms for 459K heads on the 2-core VM, under the index's
    /// write lock. Made under a shared borrow (beside lookups), it is taken
    /// by [`Runs::give_heads`] before the stores are applied.
    pub(crate) fn heads_ahead(&self, n: usize) -> Option<HeadsAhead> {
        let room = self.heads.capacity().saturating_sub(self.heads.len());
        if n < room {
            return None;
        }
        let mut map = HashMap::with_hasher(self.heads.hasher().clone());
        // No more room than memory has: no copy, the insert grows as before.
        map.try_reserve(self.heads.len().saturating_mul(2).max(self.heads.len().saturating_add(n))).ok()?;
        map.extend(self.heads.iter().map(|(k, v)| (*k, *v)));
        Some(HeadsAhead { map, changes: self.heads_changes })
    }

    /// Takes a copy made by [`Runs::heads_ahead`], unless `heads` changed
    /// since (then it is dropped).
    pub(crate) fn give_heads(&mut self, ahead: HeadsAhead) {
        if ahead.changes == self.heads_changes && ahead.map.len() == self.heads.len() {
            self.heads = ahead.map;
        }
    }

    /// Blocks with at least one holder in `tier`.
    pub(crate) fn live(&self, tier: Tier) -> usize {
        self.live.get(tier.idx()).copied().unwrap_or(0)
    }

    /// Heap bytes of the tree (runs, heads, large sets).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.runs.iter().map(Run::heap_bytes).sum::<usize>()
            + self.runs.heap_bytes()
            + crate::map_heap_bytes(&self.heads)
            + self.many.iter().map(ManySets::heap_bytes).sum::<usize>()
    }

    /// Every block with a holder in `tier`: its position, hash and holders
    /// (for invariant checks).
    pub(crate) fn held(&self, tier: Tier) -> impl Iterator<Item = (Loc, SequenceHash, SetRef<'_>)> + '_ {
        self.runs.iter().enumerate().flat_map(move |(i, run)| {
            run.hashes.iter().enumerate().filter_map(move |(off, h)| {
                let s = run.set(tier, off);
                (s != WorkerSet::EMPTY).then(|| (Loc { run: i as u32, off: off as u32 }, *h, self.view(s, tier)))
            })
        })
    }

    /// Checks the tree's own invariants (after [`Runs::trim`]): every hash
    /// in one place, `heads` naming exactly the runs' first blocks, branch
    /// counts exact, no trimmable tail, live counts exact.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut seen: HashMap<SequenceHash, Loc, RandomState> = HashMap::default();
        let mut branches: HashMap<Loc, u32, RandomState> = HashMap::default();
        let mut live = [0usize; 2];
        let freed: std::collections::HashSet<u32> = self.free.iter().copied().collect();
        for (i, run) in self.runs.iter().enumerate() {
            let id = i as u32;
            if freed.contains(&id) {
                if run.len() > 0 {
                    return Err(format!("run {id} is free but holds {} blocks", run.len()));
                }
                continue;
            }
            let Some(head) = run.hashes.first() else { return Err(format!("run {id} is empty but not free")) };
            if self.heads.get(head) != Some(&id) {
                return Err(format!("run {id}'s first block {head} is not its key in heads"));
            }
            for (off, h) in run.hashes.iter().enumerate() {
                let here = Loc { run: id, off: off as u32 };
                if let Some(other) = seen.insert(*h, here) {
                    return Err(format!("{h} is at {other:?} and {here:?}"));
                }
                for t in Tier::ALL {
                    if run.set(t, off) != WorkerSet::EMPTY
                        && let Some(n) = live.get_mut(t.idx())
                    {
                        *n += 1;
                    }
                }
            }
            if let Some(last) = run.len().checked_sub(1)
                && run.dead(last)
                && !run.branches_at(last as u32)
            {
                return Err(format!("run {id} ends in a block no one holds"));
            }
            if let Some(p) = run.parent {
                if self.hash(p).is_none() {
                    return Err(format!("run {id}'s parent {p:?} is not a block"));
                }
                *branches.entry(p).or_insert(0) += 1;
            }
        }
        for (i, run) in self.runs.iter().enumerate() {
            for &(off, n) in &run.branches {
                let at = Loc { run: i as u32, off };
                if branches.get(&at) != Some(&n) {
                    return Err(format!("run {i} counts {n} branches at {off}, has {:?}", branches.get(&at)));
                }
            }
        }
        let listed: usize = self.runs.iter().map(|r| r.branches.iter().map(|b| b.1 as usize).sum::<usize>()).sum();
        if listed != branches.values().map(|n| *n as usize).sum::<usize>() {
            return Err("a branch is not listed at its parent".into());
        }
        if self.heads.len() != self.runs.len() - freed.len() {
            return Err(format!("{} heads for {} runs", self.heads.len(), self.runs.len() - freed.len()));
        }
        if live != self.live {
            return Err(format!("live counts {:?}, counted {live:?}", self.live));
        }
        Ok(())
    }
}

/// Blocks two chains of sequence hashes share from their start. Equal
/// hashes at one offset mean equal prefixes up to it, so the boundary is
/// found by galloping and bisection: O(log n) comparisons.
fn common_prefix(a: &[SequenceHash], b: &[SequenceHash]) -> usize {
    let n = a.len().min(b.len());
    let same = |k: usize| a.get(k - 1) == b.get(k - 1);
    if n == 0 || !same(1) {
        return 0;
    }
    let (mut good, mut step) = (1usize, 1usize);
    while good + step <= n && same(good + step) {
        good += step;
        step *= 2;
    }
    let mut bad = (good + step).min(n + 1);
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if same(mid) {
            good = mid;
        } else {
            bad = mid;
        }
    }
    good
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u64) -> SequenceHash {
        SequenceHash(i)
    }

    /// Places a chain of hashes from `parent`, adds `w` to each; returns the places.
    fn chain(r: &mut Runs, mut parent: Option<Loc>, hashes: &[u64], w: u32) -> Vec<Loc> {
        let mut out = Vec::new();
        for x in hashes {
            let loc = r.place(parent, h(*x), 1);
            r.add(loc, Tier::Device, WorkerIdx(w));
            out.push(loc);
            parent = Some(loc);
        }
        out
    }

    /// Roots `from..to`, one block each, held by worker 0.
    fn roots(r: &mut Runs, from: u64, to: u64) {
        for x in from..to {
            chain(r, None, &[x], 0);
        }
    }

    #[test]
    fn heads_copied_ahead_leave_the_stores_no_room_to_run_out_of() {
        let mut r = Runs::default();
        roots(&mut r, 0, 1_000);
        let room = r.heads.capacity() - r.heads.len();
        assert!(r.heads_ahead(room - 1).is_none(), "room enough");
        let ahead = r.heads_ahead(room + 100).unwrap();
        r.give_heads(ahead);
        let cap = r.heads.capacity();
        assert!(cap >= 2_000, "{cap}");
        // The stores it was made for grow nothing.
        roots(&mut r, 1_000, 1_000 + room as u64 + 100);
        assert_eq!(r.heads.capacity(), cap);
        r.check().unwrap();
        let mut p = Path::default();
        r.path(&[h(3)], &mut p);
        assert_eq!(p.len(), 1);
        assert!(r.heads_ahead(usize::MAX).is_none(), "more than memory holds");
        // A copy of heads that changed since is not taken.
        let ahead = r.heads_ahead(r.heads.capacity()).unwrap();
        roots(&mut r, 1_000_000, 1_000_001);
        r.give_heads(ahead);
        assert_eq!(r.heads.capacity(), cap);
        r.check().unwrap();
    }

    #[test]
    fn a_chain_is_one_run_and_a_departure_branches() {
        let mut r = Runs::default();
        let a = chain(&mut r, None, &[1, 2, 3, 4], 0);
        assert!(a.iter().all(|l| l.run == a[0].run));
        // The same chain again, by another worker: the same places.
        assert_eq!(chain(&mut r, None, &[1, 2, 3, 4], 1), a);
        // Departing after block 2: a branch, found again by its hash.
        let b = chain(&mut r, Some(a[1]), &[30, 40], 0);
        assert_ne!(b[0].run, a[0].run);
        assert_eq!(b[1].run, b[0].run);
        assert_eq!(r.place(Some(a[1]), h(30), 1), b[0]);
        r.check().unwrap();
        let mut p = Path::default();
        r.path(&[h(1), h(2), h(30), h(40), h(50)], &mut p);
        assert_eq!(p.len(), 4);
        assert!(r.at(&p, 3, Tier::Device).is_some_and(|s| s.contains(WorkerIdx(0)) && !s.contains(WorkerIdx(1))));
        assert!(r.at(&p, 4, Tier::Device).is_none());
        r.path(&[h(1), h(2), h(3), h(9)], &mut p);
        assert_eq!(p.len(), 3);
        assert_eq!(r.live(Tier::Device), 6);
    }

    #[test]
    fn dead_tails_are_trimmed_and_empty_runs_freed_up_the_tree() {
        let mut r = Runs::default();
        let a = chain(&mut r, None, &[1, 2, 3], 0);
        // 20 departs after block 2 (3 follows it): a branch.
        let b = chain(&mut r, Some(a[1]), &[20], 1);
        assert_ne!(b[0].run, a[0].run);
        // 3 dies: the run's dead tail goes.
        r.remove(a[2], Tier::Device, WorkerIdx(0));
        r.trim();
        r.check().unwrap();
        assert_eq!(r.hash(a[2]), None);
        // 2 dies but 20 branches from it: kept.
        r.remove(a[1], Tier::Device, WorkerIdx(0));
        r.trim();
        r.check().unwrap();
        assert_eq!(r.hash(a[1]), Some(h(2)));
        // 20 goes: its run is freed, then 2 is trimmed from the parent run.
        r.remove(b[0], Tier::Device, WorkerIdx(1));
        r.trim();
        r.check().unwrap();
        assert_eq!(r.hash(a[1]), None);
        assert_eq!(r.hash(a[0]), Some(h(1)));
        // 3 again after 1 -> 2: appended where the old 2 and 3 were.
        let c = chain(&mut r, Some(a[0]), &[2, 3], 0);
        assert_eq!(c, vec![a[1], a[2]]);
        for l in [a[2], a[1], a[0]] {
            r.remove(l, Tier::Device, WorkerIdx(0));
        }
        r.trim();
        r.check().unwrap();
        assert_eq!(r.live(Tier::Device), 0);
        assert!(r.heads.is_empty());
    }

    #[test]
    fn common_prefix_finds_the_boundary() {
        let a: Vec<SequenceHash> = (0..100).map(h).collect();
        for k in 0..=100 {
            let mut b = a.clone();
            if let Some(x) = b.get_mut(k) {
                *x = h(1000);
                for y in b.iter_mut().skip(k + 1) {
                    *y = h(2000 + y.0);
                }
            }
            assert_eq!(common_prefix(&a, &b), k.min(100));
        }
        assert_eq!(common_prefix(&a, &a[..7]), 7);
    }
}
