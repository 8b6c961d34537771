//! The set of workers that hold one block, in 8 bytes, with an O(1)
//! equality test.
//!
//! Most blocks are held by one or two workers, so those are packed inline
//! into one `u64` ([`WorkerSet`]). Larger sets live in a side table
//! ([`ManySets`]) as a sorted vector (up to [`INLINE`] members in the slot
//! itself, more on the heap) plus a *fingerprint*: the wrapping sum of
//! a 64-bit mix of each member. Two sets with the same length and fingerprint
//! are taken to be equal (a false match needs a 64-bit collision of sums of
//! independent mixes). This is what makes walking a long prefix that many
//! workers share O(1) per block in [`crate::Index::find_matches`].
//!
//! Packing: bits 62–63 hold the kind. One: the member in bits 0–31. Two: the
//! smaller member in bits 0–31, the larger in bits 32–61 (a pair whose larger
//! member needs more than 30 bits is kept as a large set). Many: the side
//! table's slot in bits 0–31.

use smallvec::SmallVec;

use crate::paged::Paged;
use crate::types::WorkerIdx;

/// Members of a large set kept in its slot (32 bytes with the
/// fingerprint): reading or changing a set of three or four workers
/// touches no heap memory and allocates nothing.
pub(crate) const INLINE: usize = 4;

type Members = SmallVec<[WorkerIdx; INLINE]>;

/// A 64-bit mix of a worker index (splitmix64 finalizer), summed into fingerprints.
#[inline]
pub(crate) fn member_fp(w: WorkerIdx) -> u64 {
    let mut z = u64::from(w.0).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A set of more than two workers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Many {
    fp: u64,
    members: Members,
}

static EMPTY: Many = Many { fp: 0, members: SmallVec::new_const() };

const KIND_SHIFT: u32 = 62;
const ONE: u64 = 0;
const TWO: u64 = 1;
const MANY: u64 = 2;
const LOW: u64 = 0xFFFF_FFFF;
const HIGH_MAX: u32 = (1 << 30) - 1;

/// Workers holding a block (never empty while stored in the index), packed
/// into 8 bytes; read through [`ManySets::view`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WorkerSet(u64);

impl WorkerSet {
    /// Marks an empty slot of a table (no set has all bits set: kind 3 is
    /// unused).
    pub(crate) const EMPTY: WorkerSet = WorkerSet(u64::MAX);

    /// The set of one worker.
    pub(crate) fn one(w: WorkerIdx) -> Self {
        Self(u64::from(w.0))
    }

    fn kind(self) -> u64 {
        self.0 >> KIND_SHIFT
    }

    fn low(self) -> u32 {
        (self.0 & LOW) as u32
    }

    fn high(self) -> u32 {
        ((self.0 >> 32) as u32) & HIGH_MAX
    }

    /// The pair `a < b` inline, when `b` fits in 30 bits.
    fn two(a: WorkerIdx, b: WorkerIdx) -> Option<Self> {
        (b.0 <= HIGH_MAX).then(|| Self((TWO << KIND_SHIFT) | (u64::from(b.0) << 32) | u64::from(a.0)))
    }

    fn many(slot: u32) -> Self {
        Self((MANY << KIND_SHIFT) | u64::from(slot))
    }
}

/// A read view of one set.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SetRef<'a> {
    One(WorkerIdx),
    Two(WorkerIdx, WorkerIdx),
    Many(&'a Many),
}

impl SetRef<'_> {
    pub(crate) fn len(self) -> usize {
        match self {
            Self::One(_) => 1,
            Self::Two(..) => 2,
            Self::Many(m) => m.members.len(),
        }
    }

    pub(crate) fn fingerprint(self) -> u64 {
        match self {
            Self::One(a) => member_fp(a),
            Self::Two(a, b) => member_fp(a).wrapping_add(member_fp(b)),
            Self::Many(m) => m.fp,
        }
    }

    pub(crate) fn contains(self, w: WorkerIdx) -> bool {
        match self {
            Self::One(a) => a == w,
            Self::Two(a, b) => a == w || b == w,
            Self::Many(m) => m.members.binary_search(&w).is_ok(),
        }
    }

    /// Calls `f` for every member, in ascending order.
    pub(crate) fn for_each(self, mut f: impl FnMut(WorkerIdx)) {
        match self {
            Self::One(a) => f(a),
            Self::Two(a, b) => {
                f(a);
                f(b);
            }
            Self::Many(m) => m.members.iter().copied().for_each(f),
        }
    }
}

/// The sets of more than two members of one table, by slot; freed slots are
/// reused, with the heap room their members had.
#[derive(Debug, Default)]
pub(crate) struct ManySets {
    slots: Paged<Many>,
    free: Vec<u32>,
}

impl ManySets {
    /// The members of `s`.
    #[inline]
    pub(crate) fn view(&self, s: WorkerSet) -> SetRef<'_> {
        match s.kind() {
            ONE => SetRef::One(WorkerIdx(s.low())),
            TWO => SetRef::Two(WorkerIdx(s.low()), WorkerIdx(s.high())),
            _ => SetRef::Many(self.slots.get(s.low() as usize).unwrap_or(&EMPTY)),
        }
    }

    /// A slot holding `members` (sorted): a freed one, whose room is
    /// reused, else a new one.
    fn store(&mut self, members: &[WorkerIdx]) -> WorkerSet {
        let fp = members.iter().fold(0u64, |s, m| s.wrapping_add(member_fp(*m)));
        if let Some(slot) = self.free.pop()
            && let Some(x) = self.slots.get_mut(slot as usize)
        {
            x.fp = fp;
            x.members.clear();
            x.members.extend_from_slice(members);
            return WorkerSet::many(slot);
        }
        WorkerSet::many(self.slots.push(Many { fp, members: SmallVec::from_slice(members) }) as u32)
    }

    /// Frees the slot of `s` (a large set), keeping its room for the next
    /// set stored.
    fn free(&mut self, s: WorkerSet) {
        if let Some(m) = self.slots.get_mut(s.low() as usize) {
            m.members.clear();
            m.fp = 0;
            self.free.push(s.low());
        }
    }

    /// Adds `w` to `s`; returns false when it was already there.
    pub(crate) fn insert(&mut self, s: &mut WorkerSet, w: WorkerIdx) -> bool {
        match self.view(*s) {
            SetRef::One(a) => {
                if a == w {
                    return false;
                }
                let (a, b) = if a < w { (a, w) } else { (w, a) };
                *s = match WorkerSet::two(a, b) {
                    Some(two) => two,
                    None => self.store(&[a, b]),
                };
                true
            }
            SetRef::Two(a, b) => {
                if a == w || b == w {
                    return false;
                }
                let mut members = [a, b, w];
                members.sort_unstable();
                *s = self.store(&members);
                true
            }
            SetRef::Many(_) => {
                let Some(m) = self.slots.get_mut(s.low() as usize) else { return false };
                match m.members.binary_search(&w) {
                    Ok(_) => false,
                    Err(pos) => {
                        m.members.insert(pos, w);
                        m.fp = m.fp.wrapping_add(member_fp(w));
                        true
                    }
                }
            }
        }
    }

    /// Removes `w` from `s`; returns `None` when the set becomes empty (its
    /// side slot, if any, is then freed), else whether `w` was a member.
    pub(crate) fn remove(&mut self, s: &mut WorkerSet, w: WorkerIdx) -> Option<bool> {
        match self.view(*s) {
            SetRef::One(a) => (a != w).then_some(false),
            SetRef::Two(a, b) => {
                if a == w {
                    *s = WorkerSet::one(b);
                    Some(true)
                } else if b == w {
                    *s = WorkerSet::one(a);
                    Some(true)
                } else {
                    Some(false)
                }
            }
            SetRef::Many(_) => {
                let m = self.slots.get_mut(s.low() as usize)?;
                let Ok(pos) = m.members.binary_search(&w) else { return Some(false) };
                m.members.remove(pos);
                m.fp = m.fp.wrapping_sub(member_fp(w));
                match m.members[..] {
                    [] => {
                        self.free(*s);
                        return None;
                    }
                    [a] => {
                        self.free(*s);
                        *s = WorkerSet::one(a);
                    }
                    [a, b] => {
                        if let Some(two) = WorkerSet::two(a, b) {
                            self.free(*s);
                            *s = two;
                        }
                    }
                    _ => {}
                }
                Some(true)
            }
        }
    }

    /// Heap bytes owned by the large sets (for memory accounting), free
    /// slots' room included.
    pub(crate) fn heap_bytes(&self) -> usize {
        let spilled = |m: &Many| if m.members.spilled() { m.members.capacity() } else { 0 };
        self.slots.heap_bytes()
            + self.free.capacity() * std::mem::size_of::<u32>()
            + self.slots.iter().map(|m| spilled(m) * std::mem::size_of::<WorkerIdx>()).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        /// Against a BTreeSet: membership, length, fingerprint = sum of
        /// members, order; workers beyond 30 bits included; large-set slots
        /// are freed when a set shrinks or empties.
        #[test]
        fn behaves_like_a_set(ops in proptest::collection::vec((any::<bool>(), 0u32..8), 1..60)) {
            let ids = |w: u32| WorkerIdx(if w >= 6 { u32::MAX - w } else { w });
            let mut sets = ManySets::default();
            let mut model = BTreeSet::new();
            let mut set: Option<WorkerSet> = None;
            for (add, w) in ops {
                let w = ids(w);
                if add {
                    let fresh = model.insert(w);
                    match &mut set {
                        None => set = Some(WorkerSet::one(w)),
                        Some(s) => prop_assert_eq!(sets.insert(s, w), fresh),
                    }
                } else if let Some(s) = &mut set {
                    let was = model.remove(&w);
                    match sets.remove(s, w) {
                        None => { prop_assert!(was && model.is_empty()); set = None; }
                        Some(r) => prop_assert_eq!(r, was),
                    }
                }
                if let Some(s) = set {
                    let v = sets.view(s);
                    prop_assert_eq!(v.len(), model.len());
                    let fp = model.iter().fold(0u64, |a, m| a.wrapping_add(member_fp(*m)));
                    prop_assert_eq!(v.fingerprint(), fp);
                    let mut seen = Vec::new();
                    v.for_each(|m| seen.push(m));
                    prop_assert_eq!(seen, model.iter().copied().collect::<Vec<_>>());
                    for x in 0..8 { prop_assert_eq!(v.contains(ids(x)), model.contains(&ids(x))); }
                    let large = usize::from(matches!(v, SetRef::Many(_)));
                    prop_assert_eq!(sets.slots.len() - sets.free.len(), large);
                } else {
                    prop_assert!(model.is_empty());
                    prop_assert_eq!(sets.slots.len(), sets.free.len());
                }
            }
        }
    }

    #[test]
    fn a_set_is_eight_bytes_and_a_large_one_thirty_two() {
        assert_eq!(std::mem::size_of::<WorkerSet>(), 8);
        assert_eq!(std::mem::size_of::<Many>(), 32);
    }
}
