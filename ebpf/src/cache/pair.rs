//! The pair-drop cache (`PAIR_DROPS`, [`peerwall_common::PairDrops`]): drops the chains decided
//! for a new IPv4 connection by its addresses, protocol and input interface, whatever its
//! ports, served to the next packets of the same pair that open a connection while no flow
//! between the two addresses is live ([`serve_pair`], on the known-flow path), and stored by
//! [`remember_pair`] after a classification that qualifies.
//!
//! Why a served drop is the one a classification would give the packet:
//!
//! - **The path.** Stored only where the local-address mirror gave the packet's path, from its
//!   destination alone (`Route::by_mirror`): no chain of the policy tests the output
//!   interface, no event names it, and no FIB lookup (which policy routing could answer by
//!   port) was made. Served only while the mirror gives the destination the same path (one
//!   lookup of `LOCAL`, under the route watcher's lease): an address the gateway takes as its
//!   own reaches the pair's next packet at once, as it reaches a new flow's.
//! - **The chains.** Every chain on the path decided before testing a port (`Scratch::narrow`
//!   0, `classify.rs`): its bitmap emptied at the protocol, an address, an interface or the
//!   state, or the first rule left tests neither port, or the chain tests no port at all. Its
//!   outcome is then the same for every port. The policy epoch (any policy change gives a new
//!   one) and the input interface are checked; like a cached verdict, a drop is served for at
//!   most a second.
//! - **The state.** Stored only for a packet classified `new`, and served only to a packet
//!   that opens a connection (any UDP packet, a TCP SYN with valid flags) whose pair stamp in
//!   `FLOW_SEEN` is idle, on the kernel-table datapath while the agent's sweep vouches: the
//!   conditions under which conntrack answers `new` for it without a lookup
//!   (`conntrack.rs`: `ct_state` and `idle_and_new` with `SEEN_IDLE`).
//! - **What a served drop does.** It counts the packet in the chain policies that decided, as
//!   a cached verdict does; it reports no event (stored and served only with events off); a
//!   dropped packet writes no conntrack state on either datapath.

use aya_ebpf::helpers::generated::{bpf_get_smp_processor_id, bpf_ktime_get_coarse_ns};
use peerwall_common::{ct, flags, pair_set, PairDrop, PairDrops, CACHED_COUNTERS, PAIR_DROP_SETS};

use crate::classify::ACT_DROP;
use crate::counters::count_held;
use crate::flow::{tcp_flags_valid, tcp_opens};
use crate::local::{local_destination_v4, IS_LOCAL, NOT_LOCAL};
use crate::maps::{kernel_ct_on, PAIR_DROPS, SCRATCH, WORK};
use crate::parse::{IPPROTO_TCP, IPPROTO_UDP};
use crate::route::{PATH_FORWARD, PATH_INPUT};
use crate::seen::{kernel_swept, pair_idle_v4};
use crate::ttl::{stamp, ttl_reused};

use super::MISS;

/// Whether a packet of protocol `proto` (TCP flags `tcp_flags`) opens a connection whatever
/// the tables hold: conntrack's `new` for it where no flow of its pair is live.
#[inline(always)]
pub(crate) fn opens(proto: u8, tcp_flags: u8) -> bool {
    proto == IPPROTO_UDP
        || (proto == IPPROTO_TCP && tcp_flags_valid(tcp_flags) && tcp_opens(tcp_flags))
}

/// This CPU's set of the pair of the known-flow path's key words `words`.
#[inline(always)]
fn set_of(words: &[u32; 4]) -> Option<*mut PairDrops> {
    // SAFETY: no arguments.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let proto = words[3].to_ne_bytes()[0];
    let slot = cpu.wrapping_mul(PAIR_DROP_SETS) | pair_set(words[0], words[1], proto);
    PAIR_DROPS.get_ptr_mut(slot)
}

/// Whether way `e` holds the pair of `words` (source, destination, protocol).
#[inline(always)]
fn same_pair(e: &PairDrop, words: &[u32; 4]) -> bool {
    u32::from_ne_bytes(e.src) == words[0]
        && u32::from_ne_bytes(e.dst) == words[1]
        && e.proto == words[3].to_ne_bytes()[0]
}

/// Whether way `e` serves at `now` (jiffies) under `epoch`: written (its protocol is TCP or
/// UDP, never 0), and its lifetime (at most a second's worth of jiffies, far below 2^31) not
/// past, compared wrapping.
#[inline(always)]
fn serving(e: &PairDrop, epoch: u32, now: u32) -> bool {
    e.proto != 0 && e.epoch == epoch && (e.until.wrapping_sub(now) as i32) > 0
}

/// The known-flow path's pair drop for an IPv4 packet whose key words are `words` (its
/// length `len`), arriving on `iif` under `epoch` with the configuration's `flags`, that
/// opens a connection ([`opens`]: the caller checks): `ACT_DROP`, the packet counted, where
/// this CPU holds a serving drop of its pair and no flow between its addresses is live;
/// the mirror gives its destination the path the drop was decided on; else [`MISS`]. The set
/// is read first: a packet of a pair never dropped costs no clock read.
///
/// Not inlined into the known-flow path: its frame there (the mirror's trie key) took the
/// entry's call chain through the known-flow path to an event's report past the verifier's
/// 512 bytes (528).
#[inline(never)]
pub(crate) fn serve_pair(words: &[u32; 4], iif: u32, epoch: u32, flags: u32, len: u64) -> u32 {
    if flags & (flags::EVENTS | flags::FLOW_SEEN) != flags::FLOW_SEEN {
        return MISS;
    }
    let Some(s) = set_of(words) else {
        return MISS;
    };
    // The way holding the pair, found first: the serving below is then one body for the
    // verifier, not one per way.
    // SAFETY (both): this CPU's own set (no other CPU writes it), of a successful lookup.
    let e = if same_pair(unsafe { &(*s).ways[0] }, words) {
        unsafe { &(*s).ways[0] }
    } else if same_pair(unsafe { &(*s).ways[1] }, words) {
        unsafe { &(*s).ways[1] }
    } else {
        return MISS;
    };
    if e.ifindex != iif || !serving(e, epoch, stamp()) {
        return MISS;
    }
    // SAFETY: no arguments.
    let clock = unsafe { bpf_ktime_get_coarse_ns() };
    if !pair_idle_v4(*words, clock) || (kernel_ct_on() && !kernel_swept(clock)) {
        return MISS;
    }
    let path = match local_destination_v4(words[1], clock) {
        IS_LOCAL => PATH_INPUT,
        NOT_LOCAL => PATH_FORWARD,
        _ => return MISS,
    };
    if path != e.path as u32 {
        return MISS;
    }
    count_held(epoch, &e.counters, e.counted, len);
    ACT_DROP as u32
}

/// Store the drop `classify` just gave `WORK`'s packet as its pair's, where it qualifies
/// (module docs): an IPv4 packet opening a connection, classified `new` on a path the mirror
/// gave, every chain deciding before its ports, no would-drop on the path, at most
/// [`CACHED_COUNTERS`] chains; `flags`: the configuration's (events off, `FLOW_SEEN` on). Into
/// the way holding the pair, else one that no longer serves, else the one that serves the
/// shorter while. Returns 1 when stored. A global function: the verifier checks it once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn remember_pair(flags: u32) -> u32 {
    if flags & (flags::EVENTS | flags::FLOW_SEEN) != flags::FLOW_SEEN {
        return 0;
    }
    let (Some(w), Some(sc)) = (WORK.get(0), SCRATCH.get(0)) else {
        return 0;
    };
    let (r, p) = (&w.r, &w.p);
    // With NAT views the known-flow path, which serves pair drops, is not taken.
    if !r.cache
        || flags & flags::views(r.epoch & 1) != 0
        || !r.by_mirror
        || r.state != ct::NEW
        || w.viewed
        || p.family != peerwall_common::family::V4
        || !p.has_ports
        || !opens(p.proto, p.tcp_flags)
        || sc.action != ACT_DROP as u32
        || sc.narrow != 0
        || sc.audit != 0
        || sc.steps == 0
        || sc.steps as usize > CACHED_COUNTERS
    {
        return 0;
    }
    let words = [
        u32::from_ne_bytes([p.src[0], p.src[1], p.src[2], p.src[3]]),
        u32::from_ne_bytes([p.dst[0], p.dst[1], p.dst[2], p.dst[3]]),
        0,
        u32::from_ne_bytes([p.proto, 0, 0, 0]),
    ];
    let Some(s) = set_of(&words) else {
        return 0;
    };
    // SAFETY: this CPU's own set, of a successful lookup.
    let s = unsafe { &mut *s };
    let now = stamp();
    let i = if same_pair(&s.ways[0], &words) {
        0
    } else if same_pair(&s.ways[1], &words) {
        1
    } else if !serving(&s.ways[0], r.epoch, now) {
        0
    } else if !serving(&s.ways[1], r.epoch, now) {
        1
    } else if (s.ways[0].until.wrapping_sub(s.ways[1].until) as i32) <= 0 {
        // Both serve: the older one goes. A flood's sources move on (the gateway benchmark's
        // every tenth of a second), and the pairs of the last one would hold every way for
        // their second while the new ones went unserved.
        0
    } else {
        1
    };
    let e = &mut s.ways[i & 1];
    e.src = [p.src[0], p.src[1], p.src[2], p.src[3]];
    e.dst = [p.dst[0], p.dst[1], p.dst[2], p.dst[3]];
    e.epoch = r.epoch;
    e.ifindex = r.iif;
    e.until = now.wrapping_add(ttl_reused(now) as u32);
    e.counters = [
        sc.trail[0] as u16,
        sc.trail[1] as u16,
        sc.trail[2] as u16,
        sc.trail[3] as u16,
    ];
    e.proto = p.proto;
    e.counted = sc.steps as u8;
    e.path = r.path as u8;
    1
}
