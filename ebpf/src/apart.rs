//! Keeping the operations on two maps apart. Where two branches each look up (or update, or
//! delete from) a different map with the same helper, LLVM sinks the two calls into one after
//! the branches, its map a choice between both. The verifier then cannot tell the call's map,
//! and leaves it to the generic helper, which reaches the map's code through an indirect call
//! (a retpoline where the kernel mitigates Spectre v2), where it calls a known map's own
//! lookup directly (or inlines it: arrays, hashes). [`apart`], after the operation in one of
//! the branches, makes the two branches end differently, so nothing is sunk; it adds no
//! instruction and no stack frame (a function per branch did: the XDP entry's call chain then
//! went past the verifier's 512 bytes). `tests/bpf.rs` checks that no generic map helper is
//! left in the programs the kernel runs.

/// An empty instruction sequence that LLVM keeps where it is written (inline assembly is a
/// side effect to it).
#[inline(always)]
pub(crate) fn apart() {
    // SAFETY: no instruction; touches no register, memory or flag.
    unsafe { core::arch::asm!("", options(nomem, nostack, preserves_flags)) }
}
