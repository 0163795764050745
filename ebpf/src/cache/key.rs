//! The verdict cache's keys: which packets are cached, the key of each family, the set a key
//! falls in and that set's generation.

use peerwall_common::{
    family, fold_key6, verdict_set, verdict_way_free, CpuVerdict4, FlowKey, VerdictKey4,
    CPU_VERDICT_TAG_SETS, CPU_VERDICT_WAYS,
};

use crate::flow::{flow_key, icmp_keyed, tcp_flags_valid};
use crate::maps::{VERDICTS4_TAGS, VERDICT_GENS};
use crate::parse::{Pkt, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP};
use crate::ttl::stamp;

/// Whether a parsed packet's verdict may be cached, and the byte its key adds: the ICMP echo
/// type (0 for TCP and UDP). None when it is never cached.
#[inline(always)]
pub(super) fn cacheable(p: &Pkt) -> Option<u8> {
    match p.proto {
        IPPROTO_TCP if p.has_ports && tcp_flags_valid(p.tcp_flags) => Some(0),
        IPPROTO_UDP if p.has_ports => Some(0),
        IPPROTO_ICMP | IPPROTO_ICMPV6 if icmp_keyed(p) => Some(p.icmp_type),
        _ => None,
    }
}

/// The `VERDICTS4` key of an IPv4 flow key with `extra` (the ICMP echo type, or 0).
#[inline(always)]
pub(super) fn key4(k: &FlowKey, extra: u8) -> VerdictKey4 {
    VerdictKey4 {
        src: [k.src[0], k.src[1], k.src[2], k.src[3]],
        dst: [k.dst[0], k.dst[1], k.dst[2], k.dst[3]],
        sport: k.sport,
        dport: k.dport,
        proto: k.proto,
        icmp_type: extra,
        _pad: [0; 2],
    }
}

/// The `VERDICTS6` key of an IPv6 flow key with `extra` (the ICMP echo type, or 0).
#[inline(always)]
pub(super) fn key6(k: &FlowKey, extra: u8) -> FlowKey {
    let mut c = *k;
    c._pad[0] = extra;
    c
}

/// The verdict-cache set of flow key `k` with `extra` (see [`verdict_set`]).
#[inline(always)]
pub(super) fn set_of(k: &FlowKey, extra: u8) -> u32 {
    if k.family == family::V4 {
        verdict_set(key4(k, extra).words())
    } else {
        verdict_set(fold_key6(&key6(k, extra)))
    }
}

/// The current generation of verdict-cache set `set`.
#[inline(always)]
pub(super) fn gen_of(set: u32) -> u32 {
    match VERDICT_GENS.get_ptr(set) {
        // SAFETY: pointer from a successful lookup; other CPUs write it atomically.
        Some(g) => unsafe { core::ptr::read_volatile(g) },
        None => 0,
    }
}

/// The verdict-cache set of parsed packet `p` (0 when it is never cached). Not inlined: its
/// key copies stay out of the frames of [`super::serve::cached_verdict`], whose callees
/// (events) add to it, and of [`super::store::mark_stored`].
#[inline(never)]
pub(super) fn packet_set(p: &Pkt) -> u32 {
    match cacheable(p) {
        Some(extra) => set_of(&flow_key(p), extra),
        None => 0,
    }
}

/// Whether way `e` holds the key whose words are `words`.
#[inline(always)]
pub(super) fn same_key(e: &CpuVerdict4, words: &[u32; 4]) -> bool {
    // SAFETY: the key is the first 16 bytes of a way, which is 4-aligned (its `CachedVerdict`
    // holds u32s), so it reads as four aligned words.
    let kw = unsafe { &*(core::ptr::addr_of!(e.key) as *const [u32; 4]) };
    kw[0] == words[0] && kw[1] == words[1] && kw[2] == words[2] && kw[3] == words[3]
}

/// The lanes of `VERDICTS4_CPU` entry `slot` (`cpu * CPU_VERDICT_SETS + set`) in its
/// `VERDICTS4_TAGS` entry, in place: its ways' tags and their hints ([`peerwall_common::CpuVerdictTags`]).
#[inline(always)]
pub(super) fn lanes_at(
    slot: u32,
) -> Option<(*mut [u8; CPU_VERDICT_WAYS], *mut [u8; CPU_VERDICT_WAYS])> {
    let line = VERDICTS4_TAGS.get_ptr_mut(slot / CPU_VERDICT_TAG_SETS)?;
    let lane = (slot % CPU_VERDICT_TAG_SETS) as usize & (CPU_VERDICT_TAG_SETS as usize - 1);
    // SAFETY: `lane` < CPU_VERDICT_TAG_SETS (masked again for the verifier), within the entry
    // of a successful lookup.
    Some(unsafe {
        (
            (&raw mut (*line).tags)
                .cast::<[u8; CPU_VERDICT_WAYS]>()
                .add(lane),
            (&raw mut (*line).until)
                .cast::<[u8; CPU_VERDICT_WAYS]>()
                .add(lane),
        )
    })
}

/// Whether neither way of `VERDICTS4_CPU` entry `slot` is free by its hint (empty, or its
/// verdict no longer served: [`verdict_way_free`]) now; false when the hints cannot be read.
/// With no way holding the key (its tag in neither), `store.rs`'s `place_on_this_cpu` would
/// then store nothing.
#[inline(always)]
pub(super) fn no_free_way(slot: u32) -> bool {
    let now = stamp();
    match lanes_at(slot) {
        // SAFETY: a lane of an entry of a successful lookup; only this CPU writes it.
        Some((_, u)) => unsafe {
            !verdict_way_free((*u)[0], now) && !verdict_way_free((*u)[1], now)
        },
        None => false,
    }
}

/// Whether a way of `VERDICTS4_CPU` entry `slot` may hold a key of tag `tag`: no when neither
/// way's tag is `tag` (then neither holds the key: its writer set the tag with it), yes when
/// the tags cannot be read.
#[inline(always)]
pub(super) fn may_hold(slot: u32, tag: u8) -> bool {
    match lanes_at(slot) {
        // SAFETY: a lane of an entry of a successful lookup; only this CPU writes it.
        Some((t, _)) => unsafe { (*t)[0] == tag || (*t)[1] == tag },
        None => true,
    }
}
