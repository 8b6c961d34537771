//! The prefix table of one tier: sequence hash → [`WorkerSet`], an
//! open-addressing table with linear probing that can be prefetched.
//!
//! Every stored or removed block touches this table at a random place, and
//! it is far larger than the caches: on the Mooncake trace that miss was most
//! of the time of a removal. A general-purpose map does not say where a key
//! will land, so the miss cannot be started early. Here the home slot of a
//! key is a pure function of the key, so [`SeqTable::prefetch`] can ask for
//! it blocks ahead of its use, and the misses of consecutive blocks overlap.
//!
//! Slots are 16 bytes (key and packed set); an empty slot holds
//! [`WorkerSet::EMPTY`], so every key value is allowed. Deletion shifts the
//! following entries back (no tombstones), so probe lengths stay those of a
//! table that never saw the removed keys. The table doubles above 3/4 full.
//! Keys are mixed with a per-process random seed: block hashes come from
//! user text.
//!
//! | operation | time |
//! |---|---|
//! | `get`, `get_mut`, `insert`, `remove` | O(1) expected (about 2.5 probes for a hit, 8.5 for a miss at the 3/4 bound) |
//! | `prefetch` | O(1), no wait |
//! | grow | O(n), amortized O(1) per insert |

use std::hash::BuildHasher;

use foldhash::fast::RandomState;
use kvgate_protocol::SequenceHash;

use crate::probing::{delete_shift, prefetch_read};
use crate::worker_set::WorkerSet;

#[derive(Debug, Clone, Copy)]
struct Slot {
    key: SequenceHash,
    set: WorkerSet,
}

const EMPTY_SLOT: Slot = Slot { key: SequenceHash(0), set: WorkerSet::EMPTY };
const MIN_SLOTS: usize = 16;

/// Sequence hash → workers holding it.
#[derive(Debug)]
pub(crate) struct SeqTable {
    slots: Vec<Slot>,
    /// `64 - log2(slots.len())`: the home slot is the top bits of the hash.
    shift: u32,
    len: usize,
    hasher: RandomState,
}

impl Default for SeqTable {
    fn default() -> Self {
        Self {
            slots: vec![EMPTY_SLOT; MIN_SLOTS],
            shift: 64 - MIN_SLOTS.trailing_zeros(),
            len: 0,
            hasher: RandomState::default(),
        }
    }
}

impl SeqTable {
    /// Entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn home(&self, key: SequenceHash) -> usize {
        (self.hasher.hash_one(key.0) >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The slot of `key`, or the empty slot where it would go.
    #[inline]
    fn probe(&self, key: SequenceHash) -> (usize, bool) {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            match self.slots.get(i) {
                Some(s) if s.set == WorkerSet::EMPTY => return (i, false),
                Some(s) if s.key == key => return (i, true),
                Some(_) => i = (i + 1) & mask,
                // Unreachable: `i` is masked and the table is never full.
                None => return (i, false),
            }
        }
    }

    /// Starts loading the home slot of `key` (for a use some blocks later).
    #[inline]
    pub(crate) fn prefetch(&self, key: SequenceHash) {
        if let Some(s) = self.slots.get(self.home(key)) {
            prefetch_read(s);
        }
    }

    /// The set of `key`.
    #[inline]
    pub(crate) fn get(&self, key: SequenceHash) -> Option<WorkerSet> {
        match self.probe(key) {
            (i, true) => self.slots.get(i).map(|s| s.set),
            _ => None,
        }
    }

    /// The set of `key`, to change in place (it must stay non-empty).
    #[inline]
    pub(crate) fn get_mut(&mut self, key: SequenceHash) -> Option<&mut WorkerSet> {
        match self.probe(key) {
            (i, true) => self.slots.get_mut(i).map(|s| &mut s.set),
            _ => None,
        }
    }

    /// Sets the set of `key` (inserting it when absent).
    pub(crate) fn insert(&mut self, key: SequenceHash, set: WorkerSet) {
        let (i, found) = self.probe(key);
        if let Some(s) = self.slots.get_mut(i) {
            *s = Slot { key, set };
        }
        if !found {
            self.len += 1;
            if self.len * 4 > self.slots.len() * 3 {
                self.grow();
            }
        }
    }

    /// Removes `key`; returns its set.
    pub(crate) fn remove(&mut self, key: SequenceHash) -> Option<WorkerSet> {
        let (hole, found) = self.probe(key);
        if !found {
            return None;
        }
        let removed = self.slots.get(hole).map(|s| s.set);
        let (hasher, shift) = (&self.hasher, self.shift);
        let home = |s: &Slot| (hasher.hash_one(s.key.0) >> shift) as usize;
        delete_shift(&mut self.slots, hole, EMPTY_SLOT, |s| s.set == WorkerSet::EMPTY, home);
        self.len -= 1;
        removed
    }

    fn grow(&mut self) {
        let doubled = vec![EMPTY_SLOT; self.slots.len() * 2];
        let old = std::mem::replace(&mut self.slots, doubled);
        self.shift -= 1;
        for s in old {
            if s.set != WorkerSet::EMPTY {
                let (i, _) = self.probe(s.key);
                if let Some(x) = self.slots.get_mut(i) {
                    *x = s;
                }
            }
        }
    }

    /// Every entry.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (SequenceHash, WorkerSet)> + '_ {
        self.slots.iter().filter(|s| s.set != WorkerSet::EMPTY).map(|s| (s.key, s.set))
    }

    /// Heap bytes.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WorkerIdx;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        /// Against a HashMap, with keys crowded into few values so that
        /// probe runs wrap and backward shifts cross the table's end.
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec((0u8..3, 0u64..600, 0u32..5), 1..3000)) {
            let mut model: HashMap<u64, u32> = HashMap::new();
            let mut t = SeqTable::default();
            for (op, k, w) in ops {
                let key = SequenceHash(k);
                match op {
                    0 => {
                        t.insert(key, WorkerSet::one(WorkerIdx(w)));
                        model.insert(k, w);
                    }
                    1 => prop_assert_eq!(t.remove(key), model.remove(&k).map(|w| WorkerSet::one(WorkerIdx(w)))),
                    _ => prop_assert_eq!(t.get(key), model.get(&k).map(|w| WorkerSet::one(WorkerIdx(*w)))),
                }
                prop_assert_eq!(t.len(), model.len());
            }
            for (k, w) in &model {
                prop_assert_eq!(t.get(SequenceHash(*k)), Some(WorkerSet::one(WorkerIdx(*w))));
            }
            prop_assert_eq!(t.iter().count(), model.len());
            prop_assert!(t.len() * 4 <= t.slots.len() * 3);
        }
    }

    #[test]
    fn zero_is_a_key_like_any_other() {
        let mut t = SeqTable::default();
        assert_eq!(t.get(SequenceHash(0)), None);
        t.insert(SequenceHash(0), WorkerSet::one(WorkerIdx(3)));
        assert_eq!(t.get(SequenceHash(0)), Some(WorkerSet::one(WorkerIdx(3))));
        assert_eq!(t.remove(SequenceHash(0)), Some(WorkerSet::one(WorkerIdx(3))));
        assert_eq!(t.len(), 0);
    }
}
