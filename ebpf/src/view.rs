//! The forward hook's view of a packet: its destination as prerouting's NAT rewrites it (a
//! DNAT of a remapped CIDR, or the un-SNAT of a reply), looked up by input interface and
//! destination in the live slot's `VIEW` trie. Only the parsed copy changes; the packet goes
//! on untouched and netfilter performs the NAT itself.

use crate::dims::addr_key;
use crate::maps::{VIEW0, VIEW1};
use crate::parse::Pkt;

/// Rewrite `p.dst` if a `VIEW` entry of `slot` covers it on interface `iif`; the destination
/// on the wire then goes to `wire` (the kernel's conntrack knows a connection by it,
/// `kernel_ct.rs`). Whether it rewrote.
#[inline(never)]
pub(crate) fn forward_view(p: &mut Pkt, iif: u32, slot: u32, wire: *mut [u8; 16]) -> bool {
    // The address-dimension key with the input ifindex in the chain field.
    let key = addr_key(iif, p, &p.dst);
    let hit = if slot == 0 {
        VIEW0.get(&key)
    } else {
        let hit = VIEW1.get(&key);
        crate::apart::apart();
        hit
    };
    let Some(t) = hit else {
        return false;
    };
    // SAFETY: `wire` is per-CPU scratch of the caller's successful lookup, not `p`.
    unsafe { *wire = p.dst };
    // The rewritten prefix's bits come from `to`, the rest from the destination: a mask of
    // `len` leading ones per 64-bit half, in network order. Two halves, not 16 bytes each
    // with its own test of `len`: the verifier walked every split of `len` those tests made
    // (24,000 instructions of one program's load), these make four.
    let len = t.prefix_len.min(128);
    let hi_len = len.min(64);
    let (m_hi, m_lo) = (leading_ones(hi_len), leading_ones(len - hi_len));
    let (to_hi, to_lo) = halves(&t.to);
    let (d_hi, d_lo) = halves(&p.dst);
    let hi = ((to_hi & m_hi) | (d_hi & !m_hi)).to_be_bytes();
    let lo = ((to_lo & m_lo) | (d_lo & !m_lo)).to_be_bytes();
    let mut i = 0;
    while i < 8 {
        p.dst[i] = hi[i];
        p.dst[i + 8] = lo[i];
        i += 1;
    }
    true
}

/// A 64-bit mask of `n` (at most 64) leading ones.
#[inline(always)]
fn leading_ones(n: u32) -> u64 {
    if n == 0 {
        0
    } else {
        u64::MAX << (64 - n.min(64))
    }
}

/// An address's two 64-bit halves, read in network order.
#[inline(always)]
fn halves(a: &[u8; 16]) -> (u64, u64) {
    let h = |o: usize| {
        u64::from_be_bytes([
            a[o],
            a[o + 1],
            a[o + 2],
            a[o + 3],
            a[o + 4],
            a[o + 5],
            a[o + 6],
            a[o + 7],
        ])
    };
    (h(0), h(8))
}
