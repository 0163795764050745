//! Routing: whether a packet is forwarded (and through which interface) or delivered to the
//! gateway itself, so the right hooks run. A FIB lookup answers both; when no chain of the live
//! slot tests the output interface and no event reports it, the agent's mirror of the local
//! routing table answers the first alone, in one trie lookup, wherever it vouches for the
//! mirror ([`crate::local`]).

use core::mem::size_of;

use aya_ebpf::helpers::generated::bpf_fib_lookup;
use aya_ebpf::EbpfContext;
use peerwall_common::{family, flags, Config};

use crate::local::{local_destination, IS_LOCAL, NOT_LOCAL};
use crate::mem::zero;
use crate::parse::Pkt;

/// Kernel layout of `struct bpf_fib_lookup` (64 bytes), unions flattened.
#[repr(C)]
pub(crate) struct FibParams {
    pub(crate) family: u8,
    pub(crate) l4_protocol: u8,
    pub(crate) sport: u16,
    pub(crate) dport: u16,
    pub(crate) tot_len: u16,
    pub(crate) ifindex: u32,
    pub(crate) flowinfo: u32,
    pub(crate) src: [u8; 16],
    pub(crate) dst: [u8; 16],
    pub(crate) vlan_proto: u16,
    pub(crate) vlan_tci: u16,
    pub(crate) smac: [u8; 6],
    pub(crate) dmac: [u8; 6],
}

pub(crate) const AF_INET: u8 = 2;
pub(crate) const AF_INET6: u8 = 10;
pub(crate) const FIB_SKIP_NEIGH: u32 = 4;
pub(crate) const FIB_SUCCESS: i64 = 0;
pub(crate) const FIB_NOT_FWDED: i64 = 4;
pub(crate) const FIB_NO_NEIGH: i64 = 7;

/// The packet is delivered to the gateway itself: prerouting, input.
pub(crate) const PATH_INPUT: u32 = 0;
/// The packet is forwarded: prerouting, forward, postrouting.
pub(crate) const PATH_FORWARD: u32 = 1;

/// Where the kernel will send the packet: (path, oif, whether the mirror answered); oif 0
/// when the mirror answered (no chain tests it, no event names it), from the destination
/// alone, where a FIB lookup may answer by anything policy routing matches (ports too).
#[inline(always)]
pub(crate) fn route<C: EbpfContext>(ctx: &C, cfg: &Config, p: &Pkt, iif: u32) -> (u32, u32, bool) {
    if cfg.flags & (flags::oif_tested(cfg.active & 1) | flags::EVENTS | flags::DIAG_NO_MIRROR) == 0
    {
        match local_destination(p) {
            IS_LOCAL => return (PATH_INPUT, 0, true),
            NOT_LOCAL => return (PATH_FORWARD, 0, true),
            _ => {}
        }
    }
    let (path, oif) = fib_route(ctx, p, iif);
    (path, oif, false)
}

/// [`route`] by the kernel's FIB.
#[inline(never)]
fn fib_route<C: EbpfContext>(ctx: &C, p: &Pkt, iif: u32) -> (u32, u32) {
    // Zeroed a word at a time, then the fields the lookup reads (as one struct literal, its
    // MAC addresses would be zeroed by a byte-wise `memset`: `mem.rs`).
    let mut f = core::mem::MaybeUninit::<FibParams>::uninit();
    // SAFETY: a stack slot of the right size and alignment; all-zero is a valid `FibParams`.
    let mut f = unsafe {
        zero(f.as_mut_ptr());
        f.assume_init()
    };
    f.family = if p.family == family::V4 {
        AF_INET
    } else {
        AF_INET6
    };
    f.l4_protocol = p.proto;
    f.sport = p.sport.to_be();
    f.dport = p.dport.to_be();
    f.ifindex = iif;
    f.src = p.src;
    f.dst = p.dst;
    // SAFETY: `f` has the kernel's layout and size; the context pointer is the program's own.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.as_ptr(),
            (&mut f as *mut FibParams).cast(),
            size_of::<FibParams>() as i32,
            FIB_SKIP_NEIGH,
        )
    };
    match rc {
        FIB_SUCCESS | FIB_NO_NEIGH => (PATH_FORWARD, f.ifindex),
        FIB_NOT_FWDED => (PATH_INPUT, 0),
        // Unroutable: the kernel drops it after prerouting; only prerouting chains matter,
        // which the input path runs first (its input chains then cannot change the outcome
        // the kernel imposes).
        _ => (PATH_INPUT, 0),
    }
}
