//! Serving cached verdicts: the fast path of known IPv4 flows ([`known_flow_v4`], before the
//! full parse) and the full path's lookup ([`cached_verdict`]).

use crate::work::{SEEN_IDLE, SEEN_LIVE};
use aya_ebpf::bindings::__sk_buff;
use aya_ebpf::helpers::generated::{bpf_get_smp_processor_id, bpf_ktime_get_coarse_ns};
use aya_ebpf::programs::TcContext;
use peerwall_common::{
    family, flags, verdict_set, verdict_tag, CachedVerdict, Config, VerdictKey4, CPU_VERDICT_SETS,
    CPU_VERDICT_WAYS,
};

use super::fresh::may_serve;
use super::key::{cacheable, gen_of, key4, key6, may_hold, no_free_way, packet_set, same_key};
use super::pair::{opens, serve_pair};
use super::store::promote;
use crate::classify::ACT_ACCEPT;
use crate::counters::count_held;
use crate::events::note_cached;
use crate::flow::{flow_key, tcp_flags_valid};
use crate::maps::{has_views, VERDICTS4, VERDICTS4_CPU, VERDICTS6, WORK};
use crate::parse::{Pkt, IPPROTO_TCP, IPPROTO_UDP};
use crate::seen::{own_idle_v4, pair_idle_v4};
use crate::ttl::stamp;

/// [`cached_verdict`]'s answer when the packet must be classified.
pub(crate) const MISS: u32 = u32::MAX;

/// Serve `v` to a packet of `len` bytes arriving on `iif` under `epoch`: its action, after
/// counting the packet in the rules that decided it and reporting its event (accepts only when
/// `count_accepts`: XDP leaves them to tc); or [`MISS`] when `v` no longer holds.
#[inline(always)]
fn serve(
    v: &CachedVerdict,
    iif: u32,
    epoch: u32,
    count_accepts: bool,
    flags: u32,
    len: u64,
) -> u32 {
    if v.epoch != epoch || v.ifindex != iif {
        return MISS;
    }
    if stamp().wrapping_sub(v.at) >= v.ttl as u32 {
        return MISS;
    }
    let action = v.action as u32;
    if flags & peerwall_common::flags::EVENTS != 0 {
        note_cached(v, epoch, count_accepts);
    }
    if action != ACT_ACCEPT as u32 || count_accepts {
        count_held(epoch, &v.counters, v.counted, len);
    }
    action
}

/// The verdict cached for `WORK`'s packet arriving on `iif` under `epoch` (see [`serve`]), or
/// [`MISS`] (at once when [`known_flow_v4`] already looked the same key up). Notes the
/// packet's generation in `WORK` either way, for [`remember`]: the caller classifies after
/// this, so it is read before the packet's conntrack state.
///
/// A global function: the verifier checks it once, not once per
/// program entry and caller state; `count_accepts` is 0 or 1.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn cached_verdict(iif: u32, epoch: u32, count_accepts: u32, flags: u32) -> u32 {
    let count_accepts = count_accepts != 0;
    let Some(w) = WORK.get_ptr_mut(0) else {
        return MISS;
    };
    // SAFETY: per-CPU slot of a successful lookup.
    let looked_up = unsafe {
        let l = (*w).looked_up;
        (*w).looked_up = false;
        l
    };
    if looked_up {
        // `known_flow_v4` noted the generation of the same key.
        return MISS;
    }
    // SAFETY: as above.
    let set = unsafe { packet_set(&(*w).p) };
    // SAFETY: as above.
    unsafe {
        (*w).gen = if cacheable(&(*w).p).is_some() {
            gen_of(set)
        } else {
            0
        }
    };
    // SAFETY: as above.
    let w = unsafe { &*w };
    if !may_serve(set, stamp()) {
        // No verdict of its set in the shared level can still be served.
        return MISS;
    }
    match lookup(&w.p) {
        Some(v) if v.gen == w.gen => serve(v, iif, epoch, count_accepts, flags, w.p.len as u64),
        _ => MISS,
    }
}

/// The cached verdict of a parsed packet, if any.
#[inline(always)]
fn lookup(p: &Pkt) -> Option<&'static CachedVerdict> {
    let extra = cacheable(p)?;
    let k = flow_key(p);
    // SAFETY: read-only lookups of plain data.
    unsafe {
        if p.family == family::V4 {
            VERDICTS4.get(&key4(&k, extra))
        } else {
            let v = VERDICTS6.get(&key6(&k, extra));
            crate::apart::apart();
            v
        }
    }
}

/// Whether the verdict cache serves packets at all: not with a benchmark-only flag on, and not
/// in probe mode unless [`flags::PROBE_CACHE`] asks for it (the cache's own tests).
#[inline(always)]
pub(crate) fn cache_on(cfg: &Config) -> bool {
    cfg.flags & flags::DIAG_ALL == 0
        && (cfg.flags & flags::PROBE == 0 || cfg.flags & flags::PROBE_CACHE != 0)
}

/// Whether [`known_flow_v4`] may answer: the cache is on and there are no NAT views (the cache
/// is keyed after the view, which only the full path applies).
#[inline(always)]
pub(crate) fn direct_cache(cfg: &Config) -> bool {
    cache_on(cfg) && !has_views(cfg)
}

/// The 32-bit word at `p` in packet memory, at any alignment, in one load instruction (where
/// `read_unaligned` makes LLVM emit four byte loads). The verifier allows unaligned packet
/// loads on architectures with efficient unaligned access (x86-64, arm64).
///
/// # Safety
/// `p .. p + 4` must lie within the packet's linear data, checked against `data_end` in a way
/// the verifier follows.
#[inline(always)]
unsafe fn load_u32(p: usize) -> u32 {
    let v: u64;
    // SAFETY: the caller's bounds check; the instruction only reads.
    unsafe {
        core::arch::asm!(
            "{0} = *(u32 *)({1} + 0)",
            lateout(reg) v,
            in(reg) p,
            options(readonly, nostack, preserves_flags)
        );
    }
    v as u32
}

/// The known-flow path: the verdict cached for an IPv4 TCP or UDP packet whose IP header
/// starts at `l3`, read straight from the linear packet into a [`VerdictKey4`] (no [`parse`],
/// no `WORK`), served as [`cached_verdict`] would ([`MISS`] with `WORK.looked_up` set when
/// there is nothing to serve: the full path then skips its own lookup of the same key). [`MISS`]
/// for everything else, which then takes the full path: IP options, fragments, ICMP, TCP flags conntrack refuses, headers
/// beyond the linear data, no entry. The caller asks only when [`direct_cache`] holds, so both
/// paths key the same packet alike.
///
/// tc only: XDP packets take [`cached_verdict`] after the parse (XDP's packet pointers, 32-bit
/// context fields widened to pointers, do not pass the verifier across this call), and XDP is
/// not on a gateway's fast path anyway (README, "XDP").
///
/// Not inlined: its stack stays out of the entry's frame, which the full path's calls add to.
///
/// A global function, checked by the verifier once on its own: `l3`
/// is then any value below 256 to it, which the bounds check below covers.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn known_flow_v4(
    skb: *mut __sk_buff,
    l3: u32,
    iif: u32,
    epoch: u32,
    flags: u32,
) -> u32 {
    let ctx = TcContext::new(skb);
    let (data, end) = (ctx.data(), ctx.data_end());
    let ip = data + (l3 & 0xff) as usize;
    // The IP header and the first 14 bytes of TCP (to its flags) or 8 of UDP.
    if ip + 28 > end {
        return MISS;
    }
    // SAFETY (all loads below): `ip .. ip + 28` lies within the linear data (checked above).
    let (w0, w1, w2) = unsafe { (load_u32(ip), load_u32(ip + 4), load_u32(ip + 8)) };
    let [vihl, _, len_hi, len_lo] = w0.to_ne_bytes();
    let [_, _, frag_hi, frag_lo] = w1.to_ne_bytes();
    let proto = w2.to_ne_bytes()[1];
    // Version 4 without options; neither a fragment nor a first fragment with more to come.
    if vihl != 0x45 || (frag_hi & 0x3f) != 0 || frag_lo != 0 {
        return MISS;
    }
    let len = u16::from_be_bytes([len_hi, len_lo]);
    if len < 20 {
        // Inconsistent: the full path drops it.
        return MISS;
    }
    let tcp_flags = if proto == IPPROTO_TCP {
        if ip + 34 > end {
            return MISS;
        }
        // SAFETY: `ip + 33` lies within the linear data (checked above).
        let tcp_flags = unsafe { *((ip + 33) as *const u8) };
        if !tcp_flags_valid(tcp_flags) {
            return MISS;
        }
        tcp_flags
    } else if proto == IPPROTO_UDP {
        0
    } else {
        return MISS;
    };
    // The key is the packet's own bytes: addresses and ports as they follow each other in the
    // headers, then the protocol, the ICMP type (0) and padding (0).
    // SAFETY: as above.
    let words = unsafe {
        [
            load_u32(ip + 12),
            load_u32(ip + 16),
            load_u32(ip + 20),
            u32::from_ne_bytes([proto, 0, 0, 0]),
        ]
    };
    let set = verdict_set(words);
    let gen = gen_of(set);
    // SAFETY: no arguments.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let slot = cpu.wrapping_mul(CPU_VERDICT_SETS) | set;
    let near = VERDICTS4_CPU.get_ptr_mut(slot);
    // The set's ways are read only where a tag says one may hold the key: a flow never seen
    // (every packet of a flood of new flows) then costs the tags' line, which stays cached,
    // not the two lines of the ways, which do not.
    let hold = may_hold(slot, verdict_tag(words));
    // Where no way can hold the key, whether either could take it: a flood of new flows
    // finds neither free, and `finish_tc` then skips `remember` (`Route::no_room`).
    let no_room = !hold && no_free_way(slot);
    if let Some(s) = near.filter(|_| hold) {
        let mut i = 0;
        while i < CPU_VERDICT_WAYS {
            // SAFETY: this CPU's own set (no other CPU writes it), of a successful lookup.
            let e = unsafe { &(*s).ways[i] };
            if same_key(e, &words) {
                if e.v.gen == gen {
                    let a = serve(&e.v, iif, epoch, true, flags, len as u64);
                    if a != MISS {
                        return a;
                    }
                }
                break;
            }
            i += 1;
        }
    }
    // A packet that opens a connection of a pair whose drop this CPU holds (`pair.rs`).
    if opens(proto, tcp_flags) {
        let a = serve_pair(&words, iif, epoch, flags, len as u64);
        if a != MISS {
            return a;
        }
    }
    let Some((seen, now)) = shared_may_serve(words, set, gen, flags, no_room) else {
        return MISS;
    };
    // SAFETY: the transmute is between two 16-byte plain-data types.
    let k: VerdictKey4 = unsafe { core::mem::transmute::<[u32; 4], VerdictKey4>(words) };
    // SAFETY: read-only lookup of plain data.
    let a = match unsafe { VERDICTS4.get(&k) } {
        Some(v) if v.gen == gen => {
            let a = serve(v, iif, epoch, true, flags, len as u64);
            if a != MISS {
                if let Some(s) = near {
                    // SAFETY: this CPU's own set, of a successful lookup.
                    promote(unsafe { &mut *s }, slot, &words, &k, v, gen, epoch);
                }
            }
            a
        }
        _ => MISS,
    };
    if a == MISS {
        looked_up(gen, seen, now, no_room);
    }
    a
}

/// Whether the shared level is to be looked up for the IPv4 flow whose key words are `words`
/// (its verdict-cache set `set`, of generation `gen`): then what the known-flow path found of
/// its `FLOW_SEEN` entry ([`SEEN_LIVE`], or 0 with the shortcut off) and the coarse clock it
/// read for that (0 if none); else none, the packet noted as looked up ([`looked_up`]).
///
/// A flow conntrack cannot know (its FLOW_SEEN entry idle) has no verdict cached in the
/// shared table either (those are of tracked flows, and live a second): a new flow skips
/// that lookup, a cold miss under a flood. Skipping it is never wrong, only slower. The
/// entry is read in two steps, each only where the one before it left the question open:
/// the pair stamp (16 KiB that stay in the CPU's cache: idle, no flow between the two
/// addresses is live), then whether the shared level may serve the set at all (its mark,
/// 8 KiB, cached too: a flood of one-packet flows puts no verdict there), and only then
/// the flow's own stamp, a line of 256 KiB that a flood of new flows reads cold. Without
/// it, conntrack reads that stamp where it needs it: not for a packet that opens a
/// connection either way under a policy that decides it whatever its state
/// (`kernel_state`). The coarse clock (no clock-source read) is up to a tick behind the one
/// stamps are written with, which can only make an entry look younger (`flow_seen_idle`):
/// never idle early.
#[inline(always)]
fn shared_may_serve(
    words: [u32; 4],
    set: u32,
    gen: u32,
    flags: u32,
    no_room: bool,
) -> Option<(u32, u64)> {
    let seen_on = flags & peerwall_common::flags::FLOW_SEEN != 0;
    let now = if seen_on {
        // SAFETY: no arguments.
        unsafe { bpf_ktime_get_coarse_ns() }
    } else {
        0
    };
    if seen_on && pair_idle_v4(words, now) {
        looked_up(gen, SEEN_IDLE, now, no_room);
        return None;
    }
    if !may_serve(set, stamp()) {
        looked_up(gen, 0, now, no_room);
        return None;
    }
    if !seen_on {
        return Some((0, now));
    }
    if own_idle_v4(words, now) {
        looked_up(gen, SEEN_IDLE, now, no_room);
        return None;
    }
    Some((SEEN_LIVE, now))
}

/// Note in `WORK` that [`known_flow_v4`] looked the packet up and found nothing to serve: the
/// generation `gen` it read for the packet's set (before the packet's conntrack state, as
/// [`remember`] needs it), what it found of its `FLOW_SEEN` entry (`seen`: `Work::seen`,
/// conntrack then need not read the entry again), the coarse clock it read for that
/// (`now`, 0 if none: the packet's, `crate::ttl::coarse_ns`), and whether this CPU's set of
/// the key has no way that could take it (`no_room`: `Work::no_room`).
#[inline(always)]
fn looked_up(gen: u32, seen: u32, now: u64, no_room: bool) {
    if let Some(w) = WORK.get_ptr_mut(0) {
        // SAFETY: per-CPU slot of a successful lookup.
        unsafe {
            (*w).looked_up = true;
            (*w).no_room = no_room;
            (*w).gen = gen;
            (*w).seen = seen;
            (*w).coarse = now;
        }
    }
}
