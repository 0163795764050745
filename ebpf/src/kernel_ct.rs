//! The kernel's connection table, read from the program: where the kernel tracks connections
//! (a Liqo gateway always does: its remapping NAT), TCP and UDP packets take their state from
//! the kernel's entry instead of this program's own tables (`conntrack.rs`), so a connection
//! is tracked once, by the kernel, and a new flow costs one lookup instead of the own tables'
//! lookups, insert and move. ICMP and SCTP stay in the own tables (the kfunc looks up TCP and
//! UDP only).
//!
//! tc ingress runs before the kernel's conntrack sees the packet, so the entry found is the
//! state *before* this packet, which is what nftables' filter hooks then report for it:
//! - no entry: the packet would open the connection: `new` (or `invalid`, a TCP segment
//!   other than a SYN: `nf_conntrack_tcp_loose` off, as the agent sets it);
//! - found by its reply tuple: a reply, `established`;
//! - found by its original tuple: `established` once the kernel saw a reply
//!   (`IPS_SEEN_REPLY`), else still `new` (a retransmitted first packet).
//!
//! Connections user space ended (a policy change no longer allows them) are marked in the
//! own table `FLOWS` and deleted from the kernel's by the agent: their packets, either way,
//! find the mark and are `invalid` while either side keeps sending (`conntrack.rs`,
//! `hold_ended`), as in the own-tables mode.
//!
//! Kernel-facing structs: [`SockTuple`] is `struct bpf_sock_tuple` (its ipv4 or ipv6 member,
//! addresses and ports in network byte order), [`CtOpts`] is `struct bpf_ct_opts` (16 bytes,
//! host order, `NF_BPF_CT_OPTS_SZ`).

use aya_ebpf::programs::{TcContext, XdpContext};
use core::ffi::c_void;
use peerwall_common::kfunc::{
    CT_DIR_REPLY, CT_LOOKUP_SKB, CT_LOOKUP_XDP, CT_RELEASE, IPS_EXPECTED, IPS_SEEN_REPLY,
    KERNEL_CT_V4, KERNEL_CT_V6,
};
use peerwall_common::{ct, family};

use crate::ct_args::{CtOpts, SockTuple};
use crate::maps::{kernel_ct_families, nf_conn_status_off};
use crate::parse::Pkt;
use crate::work::Work;

/// `sizeof(struct bpf_ct_opts)` as this kernel's kfunc checks it.
const OPTS_SZ: u32 = 16;

/// The conntrack lookup kfunc of a program type, by its context.
pub(crate) trait CtLookup {
    /// `bpf_{skb,xdp}_ct_lookup`: the connection (acquired: release it) or null.
    fn ct_lookup(&self, tuple: *mut SockTuple, size: u32, opts: *mut CtOpts) -> *mut c_void;
}

type Lookup =
    unsafe extern "C" fn(*mut c_void, *mut SockTuple, u32, *mut CtOpts, u32) -> *mut c_void;

impl CtLookup for TcContext {
    #[inline(always)]
    fn ct_lookup(&self, tuple: *mut SockTuple, size: u32, opts: *mut CtOpts) -> *mut c_void {
        // SAFETY: the loader rewrites this call into `bpf_skb_ct_lookup` (or `r0 = 0`), whose
        // signature this is; the context is the program's own.
        unsafe {
            let f: Lookup = core::mem::transmute(CT_LOOKUP_SKB as usize);
            f(self.skb.skb.cast(), tuple, size, opts, OPTS_SZ)
        }
    }
}

impl CtLookup for XdpContext {
    #[inline(always)]
    fn ct_lookup(&self, tuple: *mut SockTuple, size: u32, opts: *mut CtOpts) -> *mut c_void {
        // SAFETY: as for tc, `bpf_xdp_ct_lookup`.
        unsafe {
            let f: Lookup = core::mem::transmute(CT_LOOKUP_XDP as usize);
            f(self.ctx.cast(), tuple, size, opts, OPTS_SZ)
        }
    }
}

/// What the kernel's table says of a packet's connection.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// No entry, either way.
    Missing,
    /// Found by its original tuple; whether the kernel saw a reply; whether it was expected
    /// (a conntrack helper's related connection).
    Original { replied: bool, expected: bool },
    /// Found by its reply tuple; whether the kernel saw a reply before this one.
    Reply { replied: bool },
}

/// Whether the kernel's table holds `p`'s connection: TCP or UDP with ports, of a family the
/// loader found the kernel tracking (`KERNEL_CT`).
#[inline(always)]
pub(crate) fn kernel_tracks(p: &Pkt) -> bool {
    let bit = if p.family == family::V4 {
        KERNEL_CT_V4
    } else {
        KERNEL_CT_V6
    };
    kernel_ct_families() & bit != 0
        && p.has_ports
        && (p.proto == crate::parse::IPPROTO_TCP || p.proto == crate::parse::IPPROTO_UDP)
}

/// Look `p`'s connection up in the kernel's table (`p`: a TCP or UDP packet with ports);
/// `wire`: `p` is the packet itself (not one an ICMP error quotes), whose destination on the
/// wire `w` holds if `view.rs` rewrote it.
#[inline(never)]
pub(crate) fn lookup<C: CtLookup>(ctx: &C, p: &Pkt, w: *mut Work, wire: bool) -> Kernel {
    // SAFETY: per-CPU scratch of a successful lookup; `p` is not in these fields.
    let (t, o) = unsafe { (&raw mut (*w).ct_tuple, &raw mut (*w).ct_opts) };
    // The addresses as words (`Pkt` and `Work` are 4-aligned, their addresses at 4-aligned
    // offsets); the destination as on the wire: the kernel's entry holds the connection's
    // tuples before its NAT, where `view.rs` gave the parsed packet the one after.
    // SAFETY: reads of 16 bytes each, in bounds and aligned (see above).
    let (src, dst) = unsafe {
        let dst = if wire && (*w).viewed {
            &raw const (*w).wire_dst
        } else {
            &raw const p.dst
        };
        (
            core::ptr::read((&raw const p.src).cast::<[u32; 4]>()),
            core::ptr::read(dst.cast::<[u32; 4]>()),
        )
    };
    let s = p.sport.to_be_bytes();
    let d = p.dport.to_be_bytes();
    let ports = u32::from_ne_bytes([s[0], s[1], d[0], d[1]]);
    // SAFETY: writes to the scratch fields above.
    let size = unsafe {
        if p.family == family::V4 {
            (*t).words[0] = src[0];
            (*t).words[1] = dst[0];
            (*t).words[2] = ports;
            12
        } else {
            (*t).words[0] = src[0];
            (*t).words[1] = src[1];
            (*t).words[2] = src[2];
            (*t).words[3] = src[3];
            (*t).words[4] = dst[0];
            (*t).words[5] = dst[1];
            (*t).words[6] = dst[2];
            (*t).words[7] = dst[3];
            (*t).words[8] = ports;
            36
        }
    };
    // SAFETY: as above.
    unsafe {
        *o = CtOpts {
            netns_id: -1,
            error: 0,
            l4proto: p.proto,
            dir: 0,
            ct_zone_id: 0,
            ct_zone_dir: 0,
            reserved: [0; 3],
        };
    }
    let c = ctx.ct_lookup(t, size, o);
    if c.is_null() {
        return Kernel::Missing;
    }
    // SAFETY: `c` is a live `struct nf_conn` the lookup acquired; `status` is an unsigned long
    // at the offset this kernel's BTF gave the loader.
    let status = unsafe {
        core::ptr::read_volatile(
            c.cast::<u8>()
                .add(nf_conn_status_off() as usize)
                .cast::<u64>(),
        )
    };
    // SAFETY: as above.
    let dir = unsafe { (*o).dir };
    // SAFETY: the loader rewrites this call into `bpf_ct_release`; `c` is released once.
    unsafe {
        let release: unsafe extern "C" fn(*mut c_void) = core::mem::transmute(CT_RELEASE as usize);
        release(c);
    }
    let replied = status & IPS_SEEN_REPLY != 0;
    if dir == CT_DIR_REPLY {
        Kernel::Reply { replied }
    } else {
        Kernel::Original {
            replied,
            expected: status & IPS_EXPECTED != 0,
        }
    }
}

/// The conntrack state of a packet the kernel's table found (`Missing` is `conntrack.rs`'s:
/// it checks ended marks and whether the packet may open a connection).
#[inline(always)]
pub(crate) fn found_state(k: Kernel) -> u32 {
    match k {
        Kernel::Reply { .. } | Kernel::Original { replied: true, .. } => ct::ESTABLISHED,
        Kernel::Original { expected: true, .. } => ct::RELATED,
        _ => ct::NEW,
    }
}
