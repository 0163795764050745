//! The local-address mirror (`LOCAL`, `ROUTES`): whether a packet's destination is the
//! gateway's own, from the agent's copy of the namespace's local routing table, under the
//! agent's lease ([`peerwall_common::RouteMirror`]). [`crate::route`] takes its answer for a
//! packet's path instead of a FIB lookup where the lease holds.

use aya_ebpf::maps::lpm_trie::Key;
use peerwall_common::{family, routes, AddrKeyData, ADDR_KEY_FIXED_BITS};

use crate::maps::{LOCAL, ROUTES};
use crate::parse::Pkt;

/// [`local_destination`]: delivered to the gateway.
pub(crate) const IS_LOCAL: u32 = 1;
/// [`local_destination`]: forwarded.
pub(crate) const NOT_LOCAL: u32 = 0;
/// [`local_destination`]: the mirror does not decide this packet (the FIB does).
pub(crate) const UNDECIDED: u32 = u32::MAX;

/// Whether the packet's destination is the gateway's own, when the mirror holds for its
/// family, else [`UNDECIDED`]. A call of its own: its key stays off the callers' stacks (the
/// tc entry's frame, inlined, pushed the combined stack of the chains' call chain past 512
/// bytes).
#[inline(never)]
pub(crate) fn local_destination(p: &Pkt) -> u32 {
    // Link-local, multicast and loopback IPv6 addresses, source or destination, are never
    // forwarded: the FIB says so before any table (`rt6_need_strict`), and so does it here.
    if p.family == family::V6 && (strict6(&p.dst) || strict6(&p.src)) {
        return UNDECIDED;
    }
    // The coarse clock (the last tick's time, no clock-source read, once per packet): the
    // lease is seconds long, a tick late is nothing to it.
    mirrored(p.family, &p.dst, crate::ttl::coarse_ns())
}

/// [`local_destination`] of an IPv4 destination `dst` (BE, as in the packet) at `now` (the
/// coarse clock, read for this packet): the pair-drop cache's check that the path a drop was
/// decided on is still the destination's (`cache/pair.rs`), inlined there.
#[inline(always)]
pub(crate) fn local_destination_v4(dst: u32, now: u64) -> u32 {
    let [a, b, c, d] = dst.to_ne_bytes();
    let mut addr = [0u8; 16];
    addr[0] = a;
    addr[1] = b;
    addr[2] = c;
    addr[3] = d;
    mirrored(family::V4, &addr, now)
}

/// The mirror's answer for destination `addr` of `family` at `now`: [`IS_LOCAL`] or
/// [`NOT_LOCAL`] while the lease holds for the family, else [`UNDECIDED`].
#[inline(always)]
fn mirrored(fam: u8, addr: &[u8; 16], now: u64) -> u32 {
    let (bit, bits) = if fam == family::V4 {
        (routes::V4, 32)
    } else {
        (routes::V6, 128)
    };
    let Some(lease) = ROUTES.get(0) else {
        return UNDECIDED;
    };
    if lease.families & bit == 0 || now >= lease.until_ns {
        return UNDECIDED;
    }
    let key = Key::new(
        ADDR_KEY_FIXED_BITS + bits,
        AddrKeyData {
            chain: [0; 4],
            family: (fam as u32).to_be_bytes(),
            addr: *addr,
        },
    );
    if LOCAL.get(&key).is_some() {
        IS_LOCAL
    } else {
        NOT_LOCAL
    }
}

/// IPv6 multicast (ff00::/8), link-local (fe80::/10) or loopback (::1).
#[inline(always)]
fn strict6(a: &[u8; 16]) -> bool {
    a[0] == 0xff
        || (a[0] == 0xfe && a[1] & 0xc0 == 0x80)
        || (a[..15].iter().all(|b| *b == 0) && a[15] == 1)
}
