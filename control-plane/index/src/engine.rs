//! One worker's engine blocks in one tier: engine hash → entry.
//!
//! Entries live in a slab of fixed pages (1,024 entries each) and never
//! move, so an entry names its parent by slot, and the hash table holds only
//! 4-byte slot numbers (the key is read from the slab when comparing). Per
//! held block that is 32 bytes of entry plus 5 bytes per table bucket,
//! against 33 per bucket for a `HashMap<u64, Entry>` with a parent hash in
//! the entry. Pages instead of one vector keep growth waste under one page
//! (a doubling vector just past a power of two would leave half of it
//! empty). Freed slots form a list threaded through their `parent` field and
//! are reused first, most recently freed first: a chain removed leaf first
//! is handed back in its original order to the next chain stored.
//!
//! | operation | time |
//! |---|---|
//! | `find`, `insert`, `remove` | O(1) expected (one table probe, one slab access) |
//! | `get`, `get_mut` by slot | O(1) |
//! | `iter` | O(slots ever used) |

use std::hash::BuildHasher;

use foldhash::fast::RandomState;
use hashbrown::HashTable;
use kvgate_protocol::SequenceHash;

/// No slot: an entry stored without a held parent, or the end of the free list.
pub(crate) const NO_SLOT: u32 = u32::MAX;

const PAGE_BITS: u32 = 10;
const PAGE: usize = 1 << PAGE_BITS;

/// One engine block of one worker. 32 bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry {
    /// The engine's hash of the block (the table's key).
    pub(crate) engine: u64,
    pub(crate) seq: SequenceHash,
    /// Slot of the entry it was stored under, when that was held then
    /// (else [`NO_SLOT`]). The link is only trusted while that slot holds an
    /// entry born earlier than this one. In a free slot: the next free slot.
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

const FREE: Entry =
    Entry { engine: 0, seq: SequenceHash(0), parent: NO_SLOT, born: 0, children: 0, refs: 0, has_parent: false };

/// Engine hash → entry for one worker and tier.
#[derive(Debug, Default)]
pub(crate) struct Engine {
    table: HashTable<u32>,
    pages: Vec<Box<[Entry]>>,
    /// Slots handed out so far (the slab's high-water mark).
    next: u32,
    /// Head of the free list.
    free: Option<u32>,
    len: usize,
    hasher: RandomState,
}

#[inline]
fn split(slot: u32) -> (usize, usize) {
    ((slot >> PAGE_BITS) as usize, slot as usize & (PAGE - 1))
}

impl Engine {
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
        let hash = self.hasher.hash_one(engine);
        self.table.find(hash, |&s| self.get(s).is_some_and(|e| e.engine == engine)).copied()
    }

    /// Stores `entry` (whose engine hash must not be held yet, and whose
    /// `refs` must be at least 1) and returns its slot.
    pub(crate) fn insert(&mut self, entry: Entry) -> u32 {
        let slot = match self.free {
            Some(s) => {
                let (p, i) = split(s);
                let next = self.pages.get(p).and_then(|page| page.get(i)).map_or(NO_SLOT, |e| e.parent);
                self.free = (next != NO_SLOT).then_some(next);
                s
            }
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
            *e = entry;
        }
        let Self { table, pages, hasher, .. } = self;
        let key = |s: &u32| {
            let (p, i) = split(*s);
            hasher.hash_one(pages.get(p).and_then(|page| page.get(i)).map_or(0, |e| e.engine))
        };
        table.insert_unique(hasher.hash_one(entry.engine), slot, key);
        self.len += 1;
        slot
    }

    /// Deletes the entry in `slot` and returns it.
    pub(crate) fn remove(&mut self, slot: u32) -> Option<Entry> {
        let entry = *self.get(slot)?;
        let hash = self.hasher.hash_one(entry.engine);
        if let Ok(o) = self.table.find_entry(hash, |&s| s == slot) {
            o.remove();
        }
        let (p, i) = split(slot);
        if let Some(e) = self.pages.get_mut(p).and_then(|page| page.get_mut(i)) {
            *e = Entry { parent: self.free.unwrap_or(NO_SLOT), ..FREE };
        }
        self.free = Some(slot);
        self.len -= 1;
        Some(entry)
    }

    /// Held entries with their slots, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &Entry)> + '_ {
        self.pages
            .iter()
            .flat_map(|page| page.iter())
            .take(self.next as usize)
            .enumerate()
            .filter(|(_, e)| e.refs > 0)
            .map(|(s, e)| (s as u32, e))
    }

    /// Heap bytes (table and slab).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.table.allocation_size()
            + self.pages.len() * PAGE * std::mem::size_of::<Entry>()
            + self.pages.capacity() * std::mem::size_of::<Box<[Entry]>>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn entry(engine: u64) -> Entry {
        Entry { engine, seq: SequenceHash(engine.wrapping_mul(3)), refs: 1, ..FREE }
    }

    proptest! {
        /// Against a HashMap: find, len, iter, and slots stay put.
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec((any::<bool>(), 0u64..3000), 1..4000)) {
            let mut model: HashMap<u64, u32> = HashMap::new();
            let mut e = Engine::default();
            for (add, k) in ops {
                if add {
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
}
