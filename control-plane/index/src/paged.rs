//! A vector that grows a page at a time and never moves what it holds.
//!
//! A `Vec` doubles: at a million runs, the push that crosses its capacity
//! copies every run into a new allocation twice the size, whose fresh pages
//! the kernel then zeroes, all under the index's write lock (162 ms for
//! 524K → 1M runs at 1,000 workers on the 2-core VM, while every Pick
//! waited). Here growth allocates one page of [`PAGE`] elements; the outer
//! vector of page pointers is what doubles, a few kilobytes.
//!
//! | operation | cost |
//! |---|---|
//! | `get`, `get_mut` | O(1): two loads |
//! | `push` | O(1); a new page of `PAGE` elements every `PAGE` pushes |
//! | `iter` | O(len) |

/// Elements per page.
pub(crate) const PAGE: usize = 4096;

/// Elements in pages of [`PAGE`]; indexes are positions as in a `Vec`.
#[derive(Debug)]
pub(crate) struct Paged<T> {
    pages: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Paged<T> {
    fn default() -> Self {
        Self { pages: Vec::new(), len: 0 }
    }
}

impl<T> Paged<T> {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        self.pages.get(i / PAGE)?.get(i % PAGE)
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.pages.get_mut(i / PAGE)?.get_mut(i % PAGE)
    }

    /// Appends `t`; returns its index.
    pub(crate) fn push(&mut self, t: T) -> usize {
        let i = self.len;
        match self.pages.last_mut() {
            Some(page) if page.len() < PAGE => page.push(t),
            _ => {
                let mut page = Vec::with_capacity(PAGE);
                page.push(t);
                self.pages.push(page);
            }
        }
        self.len += 1;
        i
    }

    /// Every element in index order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.pages.iter().flatten()
    }

    /// Elements room is allocated for.
    pub(crate) fn capacity(&self) -> usize {
        self.pages.len() * PAGE
    }

    /// Heap bytes of the pages and the page table (not of what the
    /// elements own).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.capacity() * std::mem::size_of::<T>() + self.pages.capacity() * std::mem::size_of::<Vec<T>>()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn pages_fill_in_turn_and_nothing_moves() {
        let mut p = Paged::default();
        assert_eq!((p.len(), p.capacity(), p.get(0)), (0, 0, None));
        for i in 0..PAGE + 1 {
            assert_eq!(p.push(i), i);
        }
        assert_eq!((p.len(), p.capacity()), (PAGE + 1, 2 * PAGE));
        let first: *const usize = p.get(0).unwrap();
        for i in PAGE + 1..5 * PAGE {
            p.push(i);
        }
        assert!(std::ptr::eq(first, p.get(0).unwrap()), "the first page moved");
        assert_eq!(p.get(5 * PAGE), None);
        *p.get_mut(PAGE).unwrap() = 7;
        assert_eq!(p.get(PAGE), Some(&7));
    }

    proptest! {
        /// Pushes and writes agree with a `Vec`.
        #[test]
        fn behaves_as_a_vec(ops in proptest::collection::vec((any::<bool>(), 0usize..20_000, any::<u32>()), 0..3_000)) {
            let (mut p, mut v) = (Paged::default(), Vec::new());
            for (push, at, x) in ops {
                if push {
                    prop_assert_eq!(p.push(x), v.len());
                    v.push(x);
                } else {
                    let i = at % (v.len() + 1);
                    match v.get_mut(i) {
                        Some(e) => {
                            *e = x;
                            *p.get_mut(i).unwrap() = x;
                        }
                        None => prop_assert!(p.get_mut(i).is_none()),
                    }
                }
            }
            prop_assert_eq!(p.len(), v.len());
            prop_assert!(p.iter().eq(v.iter()));
            prop_assert_eq!(p.capacity(), p.len().div_ceil(PAGE) * PAGE);
        }
    }
}
