//! A cache prefetch hint for the random reads of the sampler (a no-op off x86-64).

/// Asks the CPU to start loading `data[index]` into cache; out-of-range indices are ignored.
#[inline(always)]
pub fn prefetch<T>(data: &[T], index: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(entry) = data.get(index) {
        // SAFETY: a prefetch is only a hint and cannot fault; the address comes from a live reference.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                (entry as *const T).cast::<i8>(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, index);
}
