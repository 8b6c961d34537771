//! Conversations the control plane retains, per Envoy worker thread.
//!
//! The control plane answers a Pick with `retained_chain_hashes` when it now
//! holds the request's messages (parsed, with their tokens) up to the last
//! one, and up to its first cached boundary (a shared system prompt or
//! document). The next turn of that conversation, or another conversation
//! on the same system prompt, resends those messages plus new ones; the
//! filter finds the last segment whose chain hash is in this table and
//! leaves out the bytes of every segment up to it (`Segment.elided`).
//! A control plane that no longer holds them answers `resend`, and the filter
//! sends the request again in full, so the table is only a hint: a stale or
//! colliding entry costs one extra round trip, never a wrong answer.
//!
//! # Structure
//!
//! A direct-mapped table of chain hashes allocated once per thread: slot =
//! hash mod capacity (chain hashes are xxh3 outputs, uniformly spread); an
//! insert overwrites whatever the slot held. `Cell`s, because the table is
//! shared by the thread's HTTP contexts through an `Rc`.
//!
//! | operation | cost |
//! |---|---|
//! | `contains`, `insert`, `forget` | O(1), no allocation |
//! | memory | 8 bytes × capacity (4,096 by default: 32 KiB per thread) |

use std::cell::Cell;

/// The per-thread table (see the module documentation).
#[derive(Debug)]
pub struct Retained {
    slots: Box<[Cell<u64>]>,
}

impl Retained {
    /// A table of at least `capacity` slots (a power of two); 0 = disabled.
    pub fn new(capacity: usize) -> Self {
        let n = if capacity == 0 { 0 } else { capacity.next_power_of_two() };
        Self { slots: (0..n).map(|_| Cell::new(0)).collect() }
    }

    fn slot(&self, hash: u64) -> Option<&Cell<u64>> {
        let n = self.slots.len();
        if n == 0 || hash == 0 {
            return None;
        }
        self.slots.get((hash as usize) & (n - 1))
    }

    /// Whether the control plane said it retains the conversation up to
    /// this chain hash.
    pub fn contains(&self, hash: u64) -> bool {
        self.slot(hash).is_some_and(|s| s.get() == hash)
    }

    /// Records a `retained_chain_hash` (0 is ignored).
    pub fn insert(&self, hash: u64) {
        if let Some(s) = self.slot(hash) {
            s.set(hash);
        }
    }

    /// Drops a hash the control plane turned out not to hold.
    pub fn forget(&self, hash: u64) {
        if let Some(s) = self.slot(hash)
            && s.get() == hash
        {
            s.set(0);
        }
    }

    /// The last index `i` such that `hashes[i]` is retained.
    pub fn last_retained(&self, hashes: &[u64]) -> Option<usize> {
        hashes.iter().rposition(|h| self.contains(*h))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    proptest! {
        /// Against a naive set: never a false positive; an inserted hash is
        /// found until another hash takes its slot.
        #[test]
        fn behaves_like_a_lossy_set(ops in prop::collection::vec((0u8..3, 0u64..64), 0..200), cap in 0usize..20) {
            let t = Retained::new(cap);
            let mut model: HashSet<u64> = HashSet::new();
            for (op, h) in ops {
                match op {
                    0 => {
                        t.insert(h);
                        if cap > 0 && h != 0 {
                            let n = cap.next_power_of_two() as u64;
                            model.retain(|x| x % n != h % n);
                            model.insert(h);
                        }
                    }
                    1 => { t.forget(h); model.remove(&h); }
                    _ => {}
                }
                for x in 0..64 {
                    prop_assert_eq!(t.contains(x), model.contains(&x), "hash {}", x);
                }
            }
        }
    }

    #[test]
    fn last_retained_is_the_longest_prefix_held() {
        let t = Retained::new(16);
        t.insert(11);
        t.insert(13);
        assert_eq!(t.last_retained(&[11, 12, 13, 14]), Some(2));
        assert_eq!(t.last_retained(&[1, 2]), None);
        assert!(!Retained::new(0).contains(11));
    }
}
