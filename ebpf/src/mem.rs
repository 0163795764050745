//! Zeroing plain data a word at a time. LLVM lowers zeroing a struct (or its padding) to a
//! call of the linked `memset`, which stores one byte per iteration: 52 iterations for a
//! parsed packet, 64 for a conntrack slot, on every packet that takes the full path. [`zero`]
//! stores 8 or 4 bytes at a time, unrolled (volatile stores, which LLVM does not merge back
//! into a `memset` call).

use core::mem::{align_of, size_of};
use core::ptr::write_volatile;

/// Zero `*p` with word stores: 8-byte words when `T` allows them, else 4-byte ones.
///
/// # Safety
/// `p` must be valid for writes of a `T` and aligned for it; all-zero bytes must be a valid
/// `T`.
#[inline(always)]
pub(crate) unsafe fn zero<T>(p: *mut T) {
    const {
        assert!(size_of::<T>().is_multiple_of(4) && align_of::<T>() >= 4);
    }
    if align_of::<T>() >= 8 && size_of::<T>().is_multiple_of(8) {
        let w = p as *mut u64;
        let mut i = 0;
        while i < size_of::<T>() / 8 {
            // SAFETY: within `*p` (the caller's), 8-aligned.
            unsafe { write_volatile(w.add(i), 0) };
            i += 1;
        }
    } else {
        let w = p as *mut u32;
        let mut i = 0;
        while i < size_of::<T>() / 4 {
            // SAFETY: within `*p` (the caller's), 4-aligned.
            unsafe { write_volatile(w.add(i), 0) };
            i += 1;
        }
    }
}
