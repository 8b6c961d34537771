//! The set of workers that hold one block, with an O(1) equality test.
//!
//! Most blocks are held by one or two workers, so those are stored inline
//! (no allocation). Larger sets are a sorted vector plus a *fingerprint*: the
//! wrapping sum of a 64-bit mix of each member. Two sets with the same length
//! and fingerprint are taken to be equal (a false match needs a 64-bit
//! collision of sums of independent mixes). This is what makes walking a long
//! prefix that many workers share O(1) per block in
//! [`crate::Index::find_matches`].

use crate::WorkerIdx;

/// A 64-bit mix of a worker index (splitmix64 finalizer), summed into fingerprints.
#[inline]
pub(crate) fn member_fp(w: WorkerIdx) -> u64 {
    let mut z = u64::from(w.0).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Many {
    fp: u64,
    members: Vec<WorkerIdx>,
}

/// Workers holding a block (never empty while stored in the index).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WorkerSet {
    One(WorkerIdx),
    Two(WorkerIdx, WorkerIdx),
    Many(Box<Many>),
}

impl WorkerSet {
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::One(_) => 1,
            Self::Two(..) => 2,
            Self::Many(m) => m.members.len(),
        }
    }

    pub(crate) fn fingerprint(&self) -> u64 {
        match self {
            Self::One(a) => member_fp(*a),
            Self::Two(a, b) => member_fp(*a).wrapping_add(member_fp(*b)),
            Self::Many(m) => m.fp,
        }
    }

    pub(crate) fn contains(&self, w: WorkerIdx) -> bool {
        match self {
            Self::One(a) => *a == w,
            Self::Two(a, b) => *a == w || *b == w,
            Self::Many(m) => m.members.binary_search(&w).is_ok(),
        }
    }

    /// Adds `w`; returns false when it was already there.
    pub(crate) fn insert(&mut self, w: WorkerIdx) -> bool {
        match self {
            Self::One(a) => {
                if *a == w {
                    return false;
                }
                *self = if *a < w { Self::Two(*a, w) } else { Self::Two(w, *a) };
                true
            }
            Self::Two(a, b) => {
                if *a == w || *b == w {
                    return false;
                }
                let mut members = vec![*a, *b, w];
                members.sort_unstable();
                let fp = members.iter().fold(0u64, |s, m| s.wrapping_add(member_fp(*m)));
                *self = Self::Many(Box::new(Many { fp, members }));
                true
            }
            Self::Many(m) => match m.members.binary_search(&w) {
                Ok(_) => false,
                Err(pos) => {
                    m.members.insert(pos, w);
                    m.fp = m.fp.wrapping_add(member_fp(w));
                    true
                }
            },
        }
    }

    /// Removes `w`; returns `None` when the set becomes empty, else whether
    /// `w` was a member.
    pub(crate) fn remove(&mut self, w: WorkerIdx) -> Option<bool> {
        match self {
            Self::One(a) => {
                if *a == w {
                    None
                } else {
                    Some(false)
                }
            }
            Self::Two(a, b) => {
                if *a == w {
                    *self = Self::One(*b);
                    Some(true)
                } else if *b == w {
                    *self = Self::One(*a);
                    Some(true)
                } else {
                    Some(false)
                }
            }
            Self::Many(m) => match m.members.binary_search(&w) {
                Ok(pos) => {
                    m.members.remove(pos);
                    m.fp = m.fp.wrapping_sub(member_fp(w));
                    if let [a, b] = m.members[..] {
                        *self = Self::Two(a, b);
                    }
                    Some(true)
                }
                Err(_) => Some(false),
            },
        }
    }

    /// Calls `f` for every member, in ascending order.
    pub(crate) fn for_each(&self, mut f: impl FnMut(WorkerIdx)) {
        match self {
            Self::One(a) => f(*a),
            Self::Two(a, b) => {
                f(*a);
                f(*b);
            }
            Self::Many(m) => m.members.iter().copied().for_each(f),
        }
    }

    /// Heap bytes owned by the set (for memory accounting).
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Self::Many(m) => std::mem::size_of::<Many>() + m.members.capacity() * std::mem::size_of::<WorkerIdx>(),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        /// Against a BTreeSet: membership, length, fingerprint = sum of members.
        #[test]
        fn behaves_like_a_set(ops in proptest::collection::vec((any::<bool>(), 0u32..8), 1..60)) {
            let mut model = BTreeSet::new();
            let mut set: Option<WorkerSet> = None;
            for (add, w) in ops {
                let w = WorkerIdx(w);
                if add {
                    let fresh = model.insert(w);
                    match &mut set {
                        None => set = Some(WorkerSet::One(w)),
                        Some(s) => prop_assert_eq!(s.insert(w), fresh),
                    }
                } else if let Some(s) = &mut set {
                    let was = model.remove(&w);
                    match s.remove(w) {
                        None => { prop_assert!(was && model.is_empty()); set = None; }
                        Some(r) => prop_assert_eq!(r, was),
                    }
                }
                if let Some(s) = &set {
                    prop_assert_eq!(s.len(), model.len());
                    let fp = model.iter().fold(0u64, |a, m| a.wrapping_add(member_fp(*m)));
                    prop_assert_eq!(s.fingerprint(), fp);
                    let mut seen = Vec::new();
                    s.for_each(|m| seen.push(m));
                    prop_assert_eq!(seen, model.iter().copied().collect::<Vec<_>>());
                    for x in 0..8 { prop_assert_eq!(s.contains(WorkerIdx(x)), model.contains(&WorkerIdx(x))); }
                } else {
                    prop_assert!(model.is_empty());
                }
            }
        }
    }
}
