//! What the open-addressing engine table (`engine.rs`) and the prefix tree
//! (`runs.rs`) use: backward-shift deletion and the cache prefetch hint.

/// Empties `slots[hole]` of a linear-probing table, moving back every
/// following occupied slot whose home is not cyclically in `(hole, j]` (its
/// own position `j`), up to the first empty slot. No tombstones: probe runs
/// stay those of a table that never held the removed key. O(run length).
pub(crate) fn delete_shift<T: Copy>(
    slots: &mut [T],
    mut hole: usize,
    empty: T,
    is_empty: impl Fn(&T) -> bool,
    home: impl Fn(&T) -> usize,
) {
    let mask = slots.len().wrapping_sub(1);
    let mut j = hole;
    loop {
        j = (j + 1) & mask;
        let Some(&next) = slots.get(j) else { break };
        if is_empty(&next) || j == hole {
            break;
        }
        let h = home(&next);
        let stays = if hole <= j { hole < h && h <= j } else { hole < h || h <= j };
        if !stays {
            if let Some(x) = slots.get_mut(hole) {
                *x = next;
            }
            hole = j;
        }
    }
    if let Some(x) = slots.get_mut(hole) {
        *x = empty;
    }
}

/// Asks the CPU to bring `p`'s cache line in, without waiting for it.
#[inline(always)]
pub(crate) fn prefetch_read<T>(p: &T) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: a prefetch is a hint: it never faults and has no effect the
    // program can observe, and `p` is a valid reference besides. SSE is part
    // of the x86_64 baseline, so the instruction always exists.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>((p as *const T).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
