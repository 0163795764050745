//! Verdict cache: the next packets of a flow reuse the verdict its classification gave,
//! instead of routing, conntrack and every chain again. Two levels for IPv4 TCP and UDP, the
//! bulk of a gateway's traffic, which [`known_flow_v4`] serves by reading the few header bytes
//! the key needs straight from the packet, before the full parse:
//!
//! - `VERDICTS4_CPU`: per CPU, two-way set-associative, filled from the second level; a hit
//!   is one inlined array access and a compare.
//! - `VERDICTS4` and `VERDICTS6` (LRU hashes shared by all CPUs, keyed by the packet's own
//!   direction): every cacheable verdict is written there by [`remember`].
//!
//! A cached verdict is served only under the policy epoch it was computed in (`CONFIG.active`:
//! any policy change, a slot switch or an in-place update, gives a new epoch), for the same
//! input interface, under its set's generation (`VERDICT_GENS`: conntrack bumps it when a
//! commit changes the flow's state, [`forget`]; the generation is read before the verdict's
//! conntrack state, so a commit racing with the classification on another CPU also makes it
//! stale), and for at most a second (`ttl.rs`): after that the packet is classified in full
//! again, which also refreshes conntrack and re-reads the route. Only accept and drop are
//! cached, and only for packets whose conntrack state is new or established and cannot be
//! otherwise: TCP with valid flags, UDP, ICMP echo (its type in the key), never fragments or
//! ICMP errors.

use aya_ebpf::helpers::generated::{bpf_get_smp_processor_id, bpf_ktime_get_coarse_ns};
use aya_ebpf::programs::TcContext;
use peerwall_common::{
    ct, family, flags, fold_key6, verdict_set, CachedVerdict, Config, CpuVerdict4, CpuVerdicts4,
    FlowKey, VerdictKey4, CACHED_COUNTERS, CPU_VERDICT_SETS, CPU_VERDICT_WAYS,
};

use crate::classify::{ACT_ACCEPT, ACT_DROP};
use crate::events::note_cached;
use crate::flow::{flow_key, icmp_keyed, tcp_flags_valid};
use crate::maps::{
    has_views, COUNTERS0, COUNTERS1, SCRATCH, VERDICTS4, VERDICTS4_CPU, VERDICTS6, VERDICT_GENS,
    WORK,
};
use crate::parse::{Pkt, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP};
use crate::seen::no_live_flow_v4;
use crate::ttl::{stamp, ttl_reused};

/// [`cached_verdict`]'s answer when the packet must be classified.
pub(crate) const MISS: u32 = u32::MAX;

/// Whether a parsed packet's verdict may be cached, and the byte its key adds: the ICMP echo
/// type (0 for TCP and UDP). None when it is never cached.
#[inline(always)]
fn cacheable(p: &Pkt) -> Option<u8> {
    match p.proto {
        IPPROTO_TCP if p.has_ports && tcp_flags_valid(p.tcp_flags) => Some(0),
        IPPROTO_UDP if p.has_ports => Some(0),
        IPPROTO_ICMP | IPPROTO_ICMPV6 if icmp_keyed(p) => Some(p.icmp_type),
        _ => None,
    }
}

/// The `VERDICTS4` key of an IPv4 flow key with `extra` (the ICMP echo type, or 0).
#[inline(always)]
fn key4(k: &FlowKey, extra: u8) -> VerdictKey4 {
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
fn key6(k: &FlowKey, extra: u8) -> FlowKey {
    let mut c = *k;
    c._pad[0] = extra;
    c
}

/// The verdict-cache set of flow key `k` with `extra` (see [`verdict_set`]).
#[inline(always)]
fn set_of(k: &FlowKey, extra: u8) -> u32 {
    if k.family == family::V4 {
        verdict_set(key4(k, extra).words())
    } else {
        verdict_set(fold_key6(&key6(k, extra)))
    }
}

/// The current generation of verdict-cache set `set`.
#[inline(always)]
fn gen_of(set: u32) -> u32 {
    match VERDICT_GENS.get_ptr(set) {
        // SAFETY: pointer from a successful lookup; other CPUs write it atomically.
        Some(g) => unsafe { core::ptr::read_volatile(g) },
        None => 0,
    }
}

/// The current generation of parsed packet `p`'s set (0 when it is never cached). Not
/// inlined: its key copies stay out of the frame of [`cached_verdict`], whose callees (events)
/// add to it.
#[inline(never)]
fn packet_gen(p: &Pkt) -> u32 {
    match cacheable(p) {
        Some(extra) => gen_of(set_of(&flow_key(p), extra)),
        None => 0,
    }
}

/// Make every verdict cached in set `set` stale, on every CPU.
#[inline(always)]
fn bump(set: u32) {
    if let Some(g) = VERDICT_GENS.get_ptr_mut(set) {
        // One atomic add (`lock xadd` on x86-64: a full barrier, so the removals before it are
        // visible to whoever reads the new generation). The target has no `AtomicU32`.
        // SAFETY: an aligned u32 of map memory; the instruction writes only it.
        unsafe {
            core::arch::asm!(
                "lock *(u32 *)({0} + 0) += {1}",
                in(reg) g,
                in(reg) 1u64,
                options(nostack, preserves_flags)
            );
        }
    }
}

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
        let n = (v.counted as usize).min(CACHED_COUNTERS);
        let mut i = 0;
        while i < CACHED_COUNTERS {
            if i >= n {
                break;
            }
            let c = if epoch & 1 == 0 {
                COUNTERS0.get_ptr_mut(v.counters[i] as u32)
            } else {
                COUNTERS1.get_ptr_mut(v.counters[i] as u32)
            };
            if let Some(c) = c {
                // SAFETY: per-CPU slot of a successful lookup.
                unsafe {
                    (*c).packets += 1;
                    (*c).bytes += len;
                }
            }
            i += 1;
        }
    }
    action
}

/// The verdict cached for `WORK`'s packet arriving on `iif` under `epoch` (see [`serve`]), or
/// [`MISS`] (at once when [`known_flow_v4`] already looked the same key up). Notes the
/// packet's generation in `WORK` either way, for [`remember`]: the caller classifies after
/// this, so it is read before the packet's conntrack state.
#[inline(never)]
pub(crate) fn cached_verdict(iif: u32, epoch: u32, count_accepts: bool, flags: u32) -> u32 {
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
    unsafe { (*w).gen = packet_gen(&(*w).p) };
    // SAFETY: as above.
    let w = unsafe { &*w };
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
            VERDICTS6.get(&key6(&k, extra))
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
#[inline(never)]
pub(crate) fn known_flow_v4(ctx: &TcContext, l3: usize, iif: u32, epoch: u32, flags: u32) -> u32 {
    let (data, end) = (ctx.data(), ctx.data_end());
    let ip = data + (l3 & 0xff);
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
    if proto == IPPROTO_TCP {
        if ip + 34 > end {
            return MISS;
        }
        // SAFETY: `ip + 33` lies within the linear data (checked above).
        let tcp_flags = unsafe { *((ip + 33) as *const u8) };
        if !tcp_flags_valid(tcp_flags) {
            return MISS;
        }
    } else if proto != IPPROTO_UDP {
        return MISS;
    }
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
    let near = VERDICTS4_CPU.get_ptr_mut(cpu.wrapping_mul(CPU_VERDICT_SETS) | set);
    if let Some(s) = near {
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
    // A flow conntrack cannot know (its FLOW_SEEN entry idle) has no verdict cached in the
    // shared table either (those are of tracked flows, and live a second): a new flow skips
    // that lookup, a cold miss under a flood. Skipping it is never wrong, only slower. The
    // coarse clock (no clock-source read) is up to a tick behind the one stamps are written
    // with, which can only make an entry look younger (`flow_seen_idle`): never idle early.
    // SAFETY: no arguments.
    if flags & peerwall_common::flags::FLOW_SEEN != 0
        && no_live_flow_v4(words, unsafe { bpf_ktime_get_coarse_ns() })
    {
        looked_up(gen, true);
        return MISS;
    }
    // SAFETY: the transmute is between two 16-byte plain-data types.
    let k: VerdictKey4 = unsafe { core::mem::transmute::<[u32; 4], VerdictKey4>(words) };
    // SAFETY: read-only lookup of plain data.
    let a = match unsafe { VERDICTS4.get(&k) } {
        Some(v) if v.gen == gen => {
            let a = serve(v, iif, epoch, true, flags, len as u64);
            if a != MISS {
                if let Some(s) = near {
                    // SAFETY: this CPU's own set, of a successful lookup.
                    promote(unsafe { &mut *s }, &words, &k, v, gen, epoch);
                }
            }
            a
        }
        _ => MISS,
    };
    if a == MISS {
        looked_up(gen, false);
    }
    a
}

/// Note in `WORK` that [`known_flow_v4`] looked the packet up and found nothing to serve: the
/// generation `gen` it read for the packet's set (before the packet's conntrack state, as
/// [`remember`] needs it), and whether its `FLOW_SEEN` entry was idle (`idle`: conntrack then
/// knows the flow is new without reading the entry again).
#[inline(always)]
fn looked_up(gen: u32, idle: bool) {
    if let Some(w) = WORK.get_ptr_mut(0) {
        // SAFETY: per-CPU slot of a successful lookup.
        unsafe {
            (*w).looked_up = true;
            (*w).gen = gen;
            (*w).seen_idle = idle;
        }
    }
}

/// Whether way `e` holds the key whose words are `words`.
#[inline(always)]
fn same_key(e: &CpuVerdict4, words: &[u32; 4]) -> bool {
    // SAFETY: the key is the first 16 bytes of a way, which is 4-aligned (its `CachedVerdict`
    // holds u32s), so it reads as four aligned words.
    let kw = unsafe { &*(core::ptr::addr_of!(e.key) as *const [u32; 4]) };
    kw[0] == words[0] && kw[1] == words[1] && kw[2] == words[2] && kw[3] == words[3]
}

/// Copy the verdict `v` that `VERDICTS4` just served for key `k` into this CPU's set `s`: into
/// the way holding the same key, or else a way that no longer serves (empty, expired, of an
/// older generation `gen` or policy `epoch`). A set whose two ways still serve other flows is
/// left alone: with three flows taking turns in two ways, replacing the older way would make
/// every packet of all three miss; keeping them, two of the three hit until their verdicts
/// expire (at most a second), and the third goes on being served from `VERDICTS4`.
#[inline(always)]
fn promote(
    s: &mut CpuVerdicts4,
    words: &[u32; 4],
    k: &VerdictKey4,
    v: &CachedVerdict,
    gen: u32,
    epoch: u32,
) {
    let now = stamp();
    let serving = |e: &CpuVerdict4| {
        e.v.gen == gen && e.v.epoch == epoch && now.wrapping_sub(e.v.at) < e.v.ttl as u32
    };
    let i = if same_key(&s.ways[0], words) {
        0
    } else if same_key(&s.ways[1], words) {
        1
    } else if !serving(&s.ways[0]) {
        0
    } else if !serving(&s.ways[1]) {
        1
    } else {
        return;
    };
    // Key and verdict only: the way's padding is zero in map memory and never written (as a
    // whole struct, the way would be built on the stack with a byte-wise `memset` of it).
    s.ways[i].key = *k;
    s.ways[i].v = *v;
}

/// Cache `action`, which `classify` just gave `WORK`'s packet, when the packet and the path
/// allow it.
#[inline(never)]
pub(crate) fn remember(action: u8) {
    if action != ACT_ACCEPT && action != ACT_DROP {
        return;
    }
    let (Some(w), Some(sc)) = (WORK.get(0), SCRATCH.get(0)) else {
        return;
    };
    let r = &w.r;
    if !r.cache || (r.state != ct::NEW && r.state != ct::ESTABLISHED) {
        return;
    }
    // The first accepted packet of a flow conntrack never saw: its commit creates the flow,
    // and the flow's next packet, known then, is cached. A flood of new flows, each one
    // packet, then inserts nothing into the verdict caches.
    if r.unknown && action == ACT_ACCEPT {
        return;
    }
    if sc.steps as usize > CACHED_COUNTERS {
        return;
    }
    let Some(extra) = cacheable(&w.p) else {
        return;
    };
    let k = flow_key(&w.p);
    let at = stamp();
    let ttl = ttl_reused(at);
    let v = CachedVerdict {
        epoch: r.epoch,
        ifindex: r.iif,
        at,
        ttl,
        action,
        counted: sc.steps as u8,
        state: r.state as u8,
        audit: sc.audit as u8,
        counters: [
            sc.trail[0] as u16,
            sc.trail[1] as u16,
            sc.trail[2] as u16,
            sc.trail[3] as u16,
        ],
        oif: r.oif,
        audit_step: sc.audit_step as u8,
        _pad: 0,
        gen: w.gen,
    };
    if w.p.family == family::V4 {
        let key = key4(&k, extra);
        if r.unknown {
            // A drop for a flow conntrack never saw (denied flows never become known): into
            // this CPU's first level only, where a free way takes it and a flood finds none,
            // never the shared LRU a flood would churn on every packet.
            // SAFETY: the transmute is between two 16-byte plain-data types.
            let words: [u32; 4] = unsafe { core::mem::transmute::<VerdictKey4, [u32; 4]>(key) };
            // SAFETY: no arguments.
            let cpu = unsafe { bpf_get_smp_processor_id() };
            let set = verdict_set(words);
            if let Some(s) = VERDICTS4_CPU.get_ptr_mut(cpu.wrapping_mul(CPU_VERDICT_SETS) | set) {
                // SAFETY: this CPU's own set, of a successful lookup.
                promote(unsafe { &mut *s }, &words, &key, &v, w.gen, r.epoch);
            }
            return;
        }
        let _ = VERDICTS4.insert(&key, &v, 0);
    } else {
        let _ = VERDICTS6.insert(&key6(&k, extra), &v, 0);
    }
}

/// Make the cached verdicts of flow `k`'s packets stale without removing them (see
/// [`forget`]): a new generation of their sets is all it takes, since no verdict is served
/// under another. For a flow conntrack did not know (its first accept), whose packets rarely
/// have a verdict cached at all: the removal is a locked hash-bucket walk, which a flood of
/// new flows would otherwise pay on every packet.
#[inline(never)]
pub(crate) fn outdate(k: &FlowKey) {
    match k.proto {
        IPPROTO_ICMP => {
            bump(set_of(k, 8));
            bump(set_of(k, 0));
        }
        IPPROTO_ICMPV6 => {
            bump(set_of(k, 128));
            bump(set_of(k, 129));
        }
        _ => bump(set_of(k, 0)),
    }
}

/// Forget the cached verdicts of the packets of flow `k` (both echo types for ICMP): a
/// commit changed their conntrack state. Their `VERDICTS4`/`VERDICTS6` entries go first, then
/// their sets' generations move on, which makes the copies on every CPU stale, and any verdict
/// whose classification read the old state: one that reads the new generation finds the
/// entries already gone.
#[inline(never)]
pub(crate) fn forget(k: &FlowKey) {
    let icmp = match k.proto {
        IPPROTO_ICMP => Some((8, 0)),
        IPPROTO_ICMPV6 => Some((128, 129)),
        _ => None,
    };
    let v4 = k.family == family::V4;
    let remove = |extra: u8| {
        if v4 {
            let _ = VERDICTS4.remove(&key4(k, extra));
        } else {
            let _ = VERDICTS6.remove(&key6(k, extra));
        }
        bump(set_of(k, extra));
    };
    match icmp {
        Some((request, reply)) => {
            remove(request);
            remove(reply);
        }
        None => remove(0),
    }
}
