//! A cache prefetch hint, for the tables whose misses dominate ingest.

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
