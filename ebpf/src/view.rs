//! The forward hook's view of a packet: its destination as prerouting's NAT rewrites it (a
//! DNAT of a remapped CIDR, or the un-SNAT of a reply), looked up by input interface and
//! destination in the live slot's `VIEW` trie. Only the parsed copy changes; the packet goes
//! on untouched and netfilter performs the NAT itself.

use crate::classify::addr_key;
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
        VIEW1.get(&key)
    };
    let Some(t) = hit else {
        return false;
    };
    // SAFETY: `wire` is per-CPU scratch of the caller's successful lookup, not `p`.
    unsafe { *wire = p.dst };
    // Bits of the destination kept: beyond the rewritten prefix.
    let len = t.prefix_len.min(128) as usize;
    let mut i = 0;
    while i < 16 {
        let bit0 = i * 8;
        let keep: u8 = if bit0 + 8 <= len {
            0
        } else if bit0 >= len {
            0xff
        } else {
            0xffu8 >> (len - bit0)
        };
        p.dst[i] = (t.to[i] & !keep) | (p.dst[i] & keep);
        i += 1;
    }
    true
}
