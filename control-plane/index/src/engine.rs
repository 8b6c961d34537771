//! One worker's engine blocks in one tier: engine hash → entry.
//!
//! Entries live in a slab of fixed pages (1,024 entries each) and never
//! move, so an entry names its parent by slot, and the hash table holds only
//! 8-byte buckets: a slot number and the top 32 bits of the key's hash (the
//! key itself is read from the slab when the tag matches). Per held block
//! that is 32 bytes of entry plus 8 bytes per bucket, against 33 per bucket
//! for a `HashMap<u64, Entry>` with a parent hash in the entry. The table is
//! open addressing with linear probing, with backward-shift deletion where
//! a removal probed for its bucket anyway ([`Engine::remove_at`]). A removal
//! by slot ([`Engine::remove`], which a removal found by its child's parent
//! link uses) leaves its bucket behind, stale: a probe passes over a bucket
//! whose slot no longer holds its key. When live and stale buckets fill the
//! table's load limit it is rebuilt from the slab at a size the entries fill
//! at most 3/8 of. The limit is drawn anew at each rebuild, between 5/8 and
//! 3/4 of the buckets: the workers of a fleet fill and churn alike, and with
//! one fixed limit a thousand tables reached it within seconds of each
//! other, a burst of rebuilds that stalled ingest for seconds
//! (`docs/DECISIONS.md`, "Rebuilds of a fleet's tables spread out").
//! The home bucket is the top bits of the hash, so the tag alone
//! places an entry, and a key's home bucket can be prefetched before its use.
//! Pages instead of one vector keep growth waste under one page (a doubling
//! vector just past a power of two would leave half of it empty). Freed
//! slots are kept on a stack (4 bytes each) and reused first, most recently
//! freed first: a chain removed leaf first is handed back in its original
//! order to the next chain stored, and the slot an insert a few blocks ahead
//! will take can be prefetched.
//!
//! | operation | time |
//! |---|---|
//! | `find`, `insert`, `remove_at` | O(1) expected (a few adjacent buckets, one slab access) |
//! | `remove` by slot | O(1), no probe |
//! | rebuild | O(slots ever used), amortized over ≥ 1/4 of the table's size in inserts |
//! | `prefetch_bucket`, `prefetch_entry` | O(1), no wait |
//! | `get`, `get_mut` by slot | O(1) |
//! | `iter` | O(slots ever used) |

use std::hash::BuildHasher;

use foldhash::fast::RandomState;

use crate::probing::{delete_shift, prefetch_read};
use crate::runs::{Loc, NO_LOC};

/// No slot: an entry stored without a held parent, or an empty bucket.
pub(crate) const NO_SLOT: u32 = u32::MAX;

const PAGE_BITS: u32 = 10;
const PAGE: usize = 1 << PAGE_BITS;

/// One engine block of one worker. 32 bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry {
    /// The engine's hash of the block (the table's key).
    pub(crate) engine: u64,
    /// Where the block is in the shard's prefix tree (its sequence hash is
    /// read there).
    pub(crate) loc: Loc,
    /// Slot of the entry it was stored under, when that was held then
    /// (else [`NO_SLOT`]). The link is only trusted while that slot holds an
    /// entry born earlier than this one.
    pub(crate) parent: u32,
    /// The worker's store clock when the entry was created: its identity for
    /// parent/child accounting, and its age for capacity trimming.
    pub(crate) born: u32,
    /// Entries stored under this one (as their parent) and still held.
    pub(crate) children: u16,
    /// References (physical copies); 0 marks a free slot.
    pub(crate) refs: u8,
    /// Whether it was stored under a parent (held or not).
    pub(crate) has_parent: bool,
}

const FREE: Entry = Entry { engine: 0, loc: NO_LOC, parent: NO_SLOT, born: 0, children: 0, refs: 0, has_parent: false };

/// One bucket of the slot table: the top 32 bits of the key's hash and the
/// entry's slot ([`NO_SLOT`]: empty).
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tag: u32,
    slot: u32,
}

const EMPTY_BUCKET: Bucket = Bucket { tag: 0, slot: NO_SLOT };
const MIN_BUCKETS: usize = 16;

/// Where a probe for one engine hash ended: the bucket holding it (`slot`
/// is then its entry), or the empty bucket where it would go. Valid until
/// the table next changes; it saves a second probe when a lookup is followed
/// by an insert or a removal of the same hash.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Probe {
    bucket: usize,
    tag: u32,
    /// The slot of the entry found.
    pub(crate) slot: Option<u32>,
}

/// Engine hash → entry for one worker and tier.
#[derive(Debug)]
pub(crate) struct Engine {
    buckets: Vec<Bucket>,
    /// log2 of the bucket count (at most 32).
    bits: u32,
    pages: Vec<Box<[Entry]>>,
    /// Slots handed out so far (the slab's high-water mark).
    next: u32,
    /// Freed slots, the most recently freed last (a stack, so that the slot
    /// an insert a few blocks ahead will take is known and can be
    /// prefetched).
    free: Vec<u32>,
    len: usize,
    /// Occupied buckets: `len` plus the stale ones that entries removed by
    /// slot left behind ([`Engine::remove`]).
    used: usize,
    /// `used` above this rebuilds the table ([`Engine::draw_limit`]).
    limit: usize,
    hasher: RandomState,
    /// Empty buckets made ahead for the next growth, outside the index's
    /// write lock ([`Engine::growth_ahead`]); empty when none.
    spare: Vec<Bucket>,
}

#[inline]
fn split(slot: u32) -> (usize, usize) {
    ((slot >> PAGE_BITS) as usize, slot as usize & (PAGE - 1))
}

/// The bucket tag of `engine`: the top 32 bits of its hash.
#[inline]
fn tag_of(hasher: &RandomState, engine: u64) -> u32 {
    (hasher.hash_one(engine) >> 32) as u32
}

/// The home bucket of `tag` in a table of `1 << bits` buckets.
#[inline]
fn home_of(tag: u32, bits: u32) -> usize {
    (tag >> (32 - bits)) as usize
}

/// The held entries of a slab whose first `next` slots were handed out,
/// with their slots, in slot order.
fn held(pages: &[Box<[Entry]>], next: u32) -> impl Iterator<Item = (u32, &Entry)> + '_ {
    pages
        .iter()
        .flat_map(|page| page.iter())
        .take(next as usize)
        .enumerate()
        .filter(|(_, e)| e.refs > 0)
        .map(|(s, e)| (s as u32, e))
}

/// log2 of the buckets a rebuild gives `len` entries: the fewest (at least
/// [`MIN_BUCKETS`]) of which they fill at most 3/8.
fn bits_for(len: usize) -> u32 {
    let mut bits = MIN_BUCKETS.trailing_zeros();
    while len.saturating_mul(8) > (3usize << bits) && bits < 32 {
        bits += 1;
    }
    bits
}

/// Empty buckets made ahead for one table's growth, outside the index's
/// write lock: allocating them touches every page, and the faults on fresh
/// pages are most of a growth's time (on a VM that returns freed pages to
/// its host, ~2.7 ms per MiB: `docs/DECISIONS.md`), which a rebuild under
/// the lock then does not wait for.
#[derive(Debug)]
pub(crate) struct SpareBuckets(Vec<Bucket>);

impl SpareBuckets {
    /// `buckets` empty buckets (a power of two).
    pub(crate) fn new(buckets: usize) -> Self {
        Self(vec![EMPTY_BUCKET; buckets.next_power_of_two()])
    }
}

/// The load limit of a table of `buckets` buckets: between 5/8 and 3/4 of
/// them, by `draw` (any number: its top 10 bits place the limit).
fn load_limit(buckets: usize, draw: u64) -> usize {
    buckets * 5 / 8 + (buckets / 8) * (draw >> 54) as usize / 1024
}

impl Default for Engine {
    fn default() -> Self {
        let mut e = Self {
            buckets: vec![EMPTY_BUCKET; MIN_BUCKETS],
            bits: MIN_BUCKETS.trailing_zeros(),
            pages: Vec::new(),
            next: 0,
            free: Vec::new(),
            len: 0,
            used: 0,
            limit: 0,
            hasher: RandomState::default(),
            spare: Vec::new(),
        };
        e.draw_limit();
        e
    }
}

impl Engine {
    #[inline]
    fn tag(&self, engine: u64) -> u32 {
        tag_of(&self.hasher, engine)
    }

    #[inline]
    fn home(&self, tag: u32) -> usize {
        home_of(tag, self.bits)
    }

    #[inline]
    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    /// Looks `engine` up: the bucket holding it, or the empty bucket where
    /// it would go.
    #[inline]
    pub(crate) fn probe(&self, engine: u64) -> Probe {
        let tag = self.tag(engine);
        let mask = self.mask();
        let mut i = self.home(tag);
        loop {
            match self.buckets.get(i) {
                Some(b) if b.slot == NO_SLOT => return Probe { bucket: i, tag, slot: None },
                Some(b) if b.tag == tag && self.get(b.slot).is_some_and(|e| e.engine == engine) => {
                    return Probe { bucket: i, tag, slot: Some(b.slot) };
                }
                Some(_) => i = (i + 1) & mask,
                // Unreachable: `i` is masked and the table is never full.
                None => return Probe { bucket: i, tag, slot: None },
            }
        }
    }

    /// Starts loading the home bucket of `engine` (for a use some blocks
    /// later).
    #[inline]
    pub(crate) fn prefetch_bucket(&self, engine: u64) {
        if let Some(b) = self.buckets.get(self.home(self.tag(engine))) {
            prefetch_read(b);
        }
    }

    /// Starts loading the slot the `k`-th insert from now will take (a
    /// freed one; new slots are taken in memory order).
    #[inline]
    pub(crate) fn prefetch_free(&self, k: usize) {
        let Some(&slot) = self.free.len().checked_sub(k + 1).and_then(|i| self.free.get(i)) else { return };
        let (p, i) = split(slot);
        if let Some(e) = self.pages.get(p).and_then(|page| page.get(i)) {
            prefetch_read(e);
        }
    }

    /// Starts loading the entry that probably holds `engine` (the first tag
    /// match; checked when it is used), and returns its slot.
    #[inline]
    pub(crate) fn prefetch_entry(&self, engine: u64) -> Option<u32> {
        let tag = self.tag(engine);
        let mask = self.mask();
        let mut i = self.home(tag);
        loop {
            let b = self.buckets.get(i)?;
            if b.slot == NO_SLOT {
                return None;
            }
            if b.tag == tag {
                let (p, k) = split(b.slot);
                if let Some(e) = self.pages.get(p).and_then(|page| page.get(k)) {
                    prefetch_read(e);
                }
                return Some(b.slot);
            }
            i = (i + 1) & mask;
        }
    }

    /// Rebuilds the buckets from the held entries, dropping stale ones, at
    /// a size where the entries fill at most 3/8 of it (doubling when they
    /// have grown, the same size when stale buckets filled it). At the same
    /// size the table is cleared in place: a new one would be fresh pages
    /// the kernel zeroes on first touch. A growth takes the spare buckets
    /// when they are its size (made ahead, their pages touched then).
    #[cold]
    #[inline(never)]
    fn rebuild(&mut self) {
        let bits = bits_for(self.len);
        // A spare lives until the next rebuild at most: one of another size
        // than this one needs is dropped, not kept in memory.
        let spare = std::mem::take(&mut self.spare);
        if bits == self.bits {
            self.buckets.fill(EMPTY_BUCKET);
        } else if spare.len() == 1 << bits {
            self.buckets = spare;
            self.bits = bits;
        } else {
            self.buckets = vec![EMPTY_BUCKET; 1 << bits];
            self.bits = bits;
        }
        let mask = self.mask();
        let Self { buckets, pages, next, hasher, .. } = self;
        for (slot, e) in held(pages, *next) {
            let tag = tag_of(hasher, e.engine);
            let mut i = home_of(tag, bits);
            while buckets.get(i).is_some_and(|x| x.slot != NO_SLOT) {
                i = (i + 1) & mask;
            }
            if let Some(x) = buckets.get_mut(i) {
                *x = Bucket { tag, slot };
            }
        }
        self.used = self.len;
        self.draw_limit();
    }

    /// How many buckets the table grows to if it is rebuilt within the
    /// next `inserts` inserts, when that is one doubling and it has no
    /// spare that large: a table grows only at a rebuild, which comes when
    /// its occupied buckets pass the limit. A larger jump (a bulk load into
    /// a small table, or stores that turn out to be duplicates or
    /// malformed) gets no spare: its growth allocates as before, and no
    /// spare larger than twice the table is ever held.
    pub(crate) fn growth_ahead(&self, inserts: usize) -> Option<usize> {
        let after = self.len.saturating_add(inserts);
        let buckets = 1usize << bits_for(after);
        let may_rebuild = self.used.saturating_add(inserts) > self.limit && self.bits < 32;
        let doubling = buckets == self.buckets.len() * 2;
        (may_rebuild && doubling && self.spare.len() != buckets).then_some(buckets)
    }

    /// Gives the table spare empty buckets for its next growth
    /// ([`Engine::growth_ahead`]); they replace any it had.
    pub(crate) fn give_spare(&mut self, spare: SpareBuckets) {
        self.spare = spare.0;
    }

    /// Draws the load limit for the buckets as they are now
    /// ([`load_limit`]): the table's hasher (random per table) of its state.
    fn draw_limit(&mut self) {
        let draw = self.hasher.hash_one((u64::from(self.next) << 32) | self.len as u64);
        self.limit = load_limit(self.buckets.len(), draw);
    }

    /// Held entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The entry in `slot`, if it is held.
    #[inline]
    pub(crate) fn get(&self, slot: u32) -> Option<&Entry> {
        let (p, i) = split(slot);
        self.pages.get(p).and_then(|page| page.get(i)).filter(|e| e.refs > 0)
    }

    /// The entry in `slot`, if it is held.
    #[inline]
    pub(crate) fn get_mut(&mut self, slot: u32) -> Option<&mut Entry> {
        let (p, i) = split(slot);
        self.pages.get_mut(p).and_then(|page| page.get_mut(i)).filter(|e| e.refs > 0)
    }

    /// The slot holding engine hash `engine`.
    #[inline]
    pub(crate) fn find(&self, engine: u64) -> Option<u32> {
        self.probe(engine).slot
    }

    /// Stores `entry` (whose engine hash must not be held yet, and whose
    /// `refs` must be at least 1) and returns its slot.
    pub(crate) fn insert(&mut self, entry: Entry) -> u32 {
        let at = self.probe(entry.engine);
        self.insert_at(at, entry)
    }

    /// Stores `entry` where `at`, a probe of its engine hash that found
    /// nothing, taken since the table last changed, says it goes.
    #[inline]
    pub(crate) fn insert_at(&mut self, at: Probe, entry: Entry) -> u32 {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let s = self.next;
                if (s as usize).is_multiple_of(PAGE) {
                    self.pages.push(vec![FREE; PAGE].into_boxed_slice());
                }
                self.next += 1;
                s
            }
        };
        let (p, i) = split(slot);
        if let Some(e) = self.pages.get_mut(p).and_then(|page| page.get_mut(i)) {
            // Field by field: a whole-struct copy loads the entry back from
            // the stack in 16-byte pieces, which the CPU cannot forward
            // from the narrower stores that built it; the load then waits
            // for every older store to reach the cache.
            let Entry { engine, loc, parent, born, children, refs, has_parent } = entry;
            e.engine = engine;
            e.loc = loc;
            e.parent = parent;
            e.born = born;
            e.children = children;
            e.refs = refs;
            e.has_parent = has_parent;
        }
        if let Some(x) = self.buckets.get_mut(at.bucket) {
            *x = Bucket { tag: at.tag, slot };
        }
        self.len += 1;
        self.used += 1;
        if self.used > self.limit && self.bits < 32 {
            self.rebuild();
        }
        slot
    }

    /// Deletes the entry in `slot` and returns it, without looking for its
    /// bucket: the bucket stays, stale (a probe passes over a bucket whose
    /// slot no longer holds its key), until the next rebuild. Removals that
    /// find their entry by a parent link save the probe this way.
    pub(crate) fn remove(&mut self, slot: u32) -> Option<Entry> {
        let entry = *self.get(slot)?;
        let (p, i) = split(slot);
        if let Some(e) = self.pages.get_mut(p).and_then(|page| page.get_mut(i)) {
            *e = FREE;
        }
        self.free.push(slot);
        self.len -= 1;
        Some(entry)
    }

    /// Deletes the entry `at` found (a probe taken since the table last
    /// changed) and returns it.
    pub(crate) fn remove_at(&mut self, at: Probe) -> Option<Entry> {
        let slot = at.slot?;
        let entry = self.remove(slot)?;
        self.delete_bucket(at.bucket);
        self.used -= 1;
        Some(entry)
    }

    /// Empties bucket `hole`, moving back every following bucket whose home
    /// is not strictly after it (cyclically), until an empty bucket.
    fn delete_bucket(&mut self, hole: usize) {
        let bits = self.bits;
        let home = |b: &Bucket| (b.tag >> (32 - bits)) as usize;
        delete_shift(&mut self.buckets, hole, EMPTY_BUCKET, |b| b.slot == NO_SLOT, home);
    }

    /// Held entries with their slots, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &Entry)> + '_ {
        held(&self.pages, self.next)
    }

    /// Held entries with their slots, last slot first.
    pub(crate) fn iter_rev(&self) -> impl Iterator<Item = (u32, &Entry)> + '_ {
        (0..self.next).rev().filter_map(move |s| self.get(s).map(|e| (s, e)))
    }

    /// Heap bytes (table and slab).
    pub(crate) fn heap_bytes(&self) -> usize {
        (self.buckets.capacity() + self.spare.capacity()) * std::mem::size_of::<Bucket>()
            + self.pages.len() * PAGE * std::mem::size_of::<Entry>()
            + self.pages.capacity() * std::mem::size_of::<Box<[Entry]>>()
            + self.free.capacity() * std::mem::size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn entry(engine: u64) -> Entry {
        Entry { engine, loc: Loc { run: 0, off: engine as u32 }, refs: 1, ..FREE }
    }

    proptest! {
        /// Against a HashMap: find, len, iter, and slots stay put, with
        /// spare buckets made now and then for the growth ahead.
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec((0u8..8, 0u64..3000), 1..4000)) {
            let mut model: HashMap<u64, u32> = HashMap::new();
            let mut e = Engine::default();
            for (op, k) in ops {
                if op == 7 {
                    if let Some(buckets) = e.growth_ahead(k as usize % 64) {
                        prop_assert_eq!(buckets, e.buckets.len() * 2);
                        e.give_spare(SpareBuckets::new(buckets));
                    }
                } else if op < 4 {
                    if let std::collections::hash_map::Entry::Vacant(v) = model.entry(k) {
                        v.insert(e.insert(entry(k)));
                    }
                } else if let Some(slot) = model.remove(&k) {
                    prop_assert_eq!(e.remove(slot).map(|x| x.engine), Some(k));
                    prop_assert!(e.get(slot).is_none());
                }
                prop_assert_eq!(e.len(), model.len());
            }
            for (k, slot) in &model {
                prop_assert_eq!(e.find(*k), Some(*slot));
                prop_assert_eq!(e.get(*slot).map(|x| x.engine), Some(*k));
            }
            let mut seen: Vec<(u32, u64)> = e.iter().map(|(s, x)| (s, x.engine)).collect();
            let mut want: Vec<(u32, u64)> = model.iter().map(|(k, s)| (*s, *k)).collect();
            seen.sort_unstable();
            want.sort_unstable();
            prop_assert_eq!(seen, want);
            // Slots are reused: never more than the peak held.
            prop_assert!(e.next as usize <= 3000);
        }
    }

    #[test]
    fn a_chain_freed_leaf_first_comes_back_in_order() {
        let mut e = Engine::default();
        let slots: Vec<u32> = (0..5).map(|k| e.insert(entry(k))).collect();
        for s in slots.iter().rev() {
            e.remove(*s);
        }
        let again: Vec<u32> = (10..15).map(|k| e.insert(entry(k))).collect();
        assert_eq!(again, slots);
        assert_eq!(e.find(12), Some(slots[2]));
        assert_eq!(e.find(2), None);
    }

    /// A table about to grow says so, and its growth takes the buckets
    /// made for it; a table just rebuilt needs none.
    #[test]
    fn a_growth_takes_the_spare_made_for_it() {
        let mut e = Engine::default();
        let mut k = 0;
        while e.growth_ahead(8).is_none() {
            e.insert(entry(k));
            k += 1;
        }
        let before = e.buckets.len();
        let buckets = e.growth_ahead(8).unwrap_or(0);
        assert_eq!(buckets, before * 2);
        assert_eq!(e.growth_ahead(100_000), None, "more than one doubling");
        let spare = SpareBuckets::new(buckets);
        let at = spare.0.as_ptr();
        e.give_spare(spare);
        assert_eq!(e.growth_ahead(8), None, "it has a spare that large");
        while e.buckets.len() == before {
            e.insert(entry(k));
            k += 1;
        }
        assert_eq!(e.buckets.as_ptr(), at);
        assert_eq!(e.buckets.len(), buckets);
        assert!(e.spare.is_empty());
        assert!((0..k).all(|x| e.find(x).is_some()));
        assert_eq!(e.growth_ahead(8), None, "just rebuilt");
    }

    #[test]
    fn load_limits_lie_between_five_eighths_and_three_quarters() {
        for buckets in [16usize, 1 << 10, 1 << 17] {
            assert_eq!(load_limit(buckets, 0), buckets * 5 / 8);
            assert_eq!(load_limit(buckets, u64::MAX), buckets * 5 / 8 + (buckets / 8) * 1023 / 1024);
            assert!(load_limit(buckets, u64::MAX) <= buckets * 3 / 4);
        }
    }

    /// Tables filled and churned alike rebuild at different points: the
    /// point a fleet's tables were rebuilt at all at once (a burst of
    /// rebuilds) is spread out.
    #[test]
    fn tables_filled_alike_rebuild_apart() {
        let mut churns = Vec::new();
        for _ in 0..32 {
            let mut e = Engine::default();
            for k in 0..20_000 {
                e.insert(entry(k));
            }
            assert_eq!(e.buckets.len(), 1 << 15);
            assert!(e.used <= e.limit && e.limit <= e.buckets.len() * 3 / 4, "{} {}", e.used, e.limit);
            // Churn by slot (stale buckets) until the next rebuild.
            let mut k = 20_000;
            let mut churned = 0usize;
            while e.used > e.len || churned == 0 {
                let slot = e.find(k - 20_000).unwrap_or(0);
                e.remove(slot);
                e.insert(entry(k));
                (k, churned) = (k + 1, churned + 1);
            }
            assert_eq!(e.len(), 20_000);
            churns.push(churned);
        }
        let (lo, hi) = (churns.iter().min().copied().unwrap_or(0), churns.iter().max().copied().unwrap_or(0));
        // Limits spread over 1/8 of 32,768 buckets (4,096 operations): 32
        // tables do not all rebuild within 1,000 operations of each other
        // (with one fixed limit they all rebuild at the same one).
        assert!(hi - lo > 1_000, "{churns:?}");
    }
}
