//! Verdict cache: the next packets of a flow reuse the verdict its classification gave, in one
//! hash lookup, instead of routing, conntrack and every chain again (`VERDICTS4` and
//! `VERDICTS6`, keyed by the packet's own direction). IPv4 TCP and UDP, the bulk of a
//! gateway's traffic, reach their entry through [`known_flow_v4`], which reads the few header
//! bytes the key needs straight from the packet, before the full parse.
//!
//! A cached verdict is served only under the policy epoch it was computed in (`CONFIG.active`:
//! any policy change, a slot switch or an in-place update, gives a new epoch), for the same
//! input interface, and for at most a second ([`ttl`]): after that the packet is classified in
//! full again, which also refreshes conntrack and re-reads the route. Conntrack forgets the
//! entries whose state a commit changes (`conntrack.rs`). Only accept and drop are cached, and
//! only for packets whose conntrack state is new or established and cannot be otherwise:
//! TCP with valid flags, UDP, ICMP echo (its type in the key), never fragments or ICMP errors.

#[allow(unused_imports)]
use super::*;

use aya_ebpf::helpers::generated::bpf_jiffies64;

/// Cached verdicts are timed in jiffies: the verifier inlines `bpf_jiffies64` into one load,
/// where a nanosecond clock is a helper call that every packet of a known flow would pay. A
/// verdict is served for one second's worth of them, which needs the kernel's HZ: [`ttl`]
/// measures it against `bpf_ktime_get_ns` (on the rare path that caches a verdict), and until
/// it has one second of measurement uses [`TTL_UNCALIBRATED`].
///
/// 100 jiffies: at most one second at every HZ Linux builds with (≥ 100).
pub(crate) const TTL_UNCALIBRATED: u32 = 100;

/// The first (nanoseconds, jiffies) sample of [`ttl`]'s measurement of HZ.
#[map]
pub(crate) static CLOCKS: Array<[u64; 2]> = Array::with_max_entries(1, 0);

/// Now, in jiffies (low 32 bits: compared wrapping).
#[inline(always)]
fn stamp() -> u32 {
    // SAFETY: no arguments.
    unsafe { bpf_jiffies64() as u32 }
}

/// How many jiffies make at most one second: HZ measured since the first cached verdict (the
/// truncating division errs short), or [`TTL_UNCALIBRATED`] during the first second.
#[inline(always)]
fn ttl() -> u32 {
    // SAFETY: no arguments.
    let (ns, j) = unsafe { (bpf_ktime_get_ns(), bpf_jiffies64()) };
    let Some(c) = CLOCKS.get_ptr_mut(0) else {
        return TTL_UNCALIBRATED;
    };
    // SAFETY: pointer from a successful lookup; racing CPUs each write a valid sample.
    let (ns0, j0) = unsafe { ((*c)[0], (*c)[1]) };
    if ns0 == 0 {
        // SAFETY: as above.
        unsafe { *c = [ns, j] };
        return TTL_UNCALIBRATED;
    }
    let dns = ns.wrapping_sub(ns0);
    if dns < 1_000_000_000 {
        return TTL_UNCALIBRATED;
    }
    let dj = j.wrapping_sub(j0);
    if dj >= 1 << 40 {
        return TTL_UNCALIBRATED;
    }
    // Jiffies per second, rounded down (in µs, so that the product stays far below 2^64), less
    // one for the tick the stamp may sit late in.
    let hz = dj * 1_000_000 / (dns / 1000);
    (hz.saturating_sub(1) as u32).clamp(TTL_UNCALIBRATED, 10_000)
}

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
/// [`MISS`] (at once when [`known_flow_v4`] already looked the same key up).
#[inline(never)]
pub(crate) fn cached_verdict(iif: u32, epoch: u32, count_accepts: bool, flags: u32) -> u32 {
    let Some(w) = WORK.get_ptr_mut(0) else {
        return MISS;
    };
    // SAFETY: per-CPU slot of a successful lookup.
    let w = unsafe {
        if (*w).looked_up {
            (*w).looked_up = false;
            return MISS;
        }
        &*w
    };
    match lookup(&w.p) {
        Some(v) => serve(v, iif, epoch, count_accepts, flags, w.p.len as u64),
        None => MISS,
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
    // SAFETY: as above; the transmute is between two 16-byte plain-data types.
    let k: VerdictKey4 = unsafe {
        core::mem::transmute::<[u32; 4], VerdictKey4>([
            load_u32(ip + 12),
            load_u32(ip + 16),
            load_u32(ip + 20),
            u32::from_ne_bytes([proto, 0, 0, 0]),
        ])
    };
    // SAFETY: read-only lookup of plain data.
    let a = match unsafe { VERDICTS4.get(&k) } {
        Some(v) => serve(v, iif, epoch, true, flags, len as u64),
        None => MISS,
    };
    if a == MISS {
        if let Some(w) = WORK.get_ptr_mut(0) {
            // SAFETY: per-CPU slot of a successful lookup.
            unsafe { (*w).looked_up = true };
        }
    }
    a
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
    if sc.steps as usize > CACHED_COUNTERS {
        return;
    }
    let Some(extra) = cacheable(&w.p) else {
        return;
    };
    let k = flow_key(&w.p);
    let v = CachedVerdict {
        epoch: r.epoch,
        ifindex: r.iif,
        at: stamp(),
        ttl: ttl() as u16,
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
    };
    if w.p.family == family::V4 {
        let _ = VERDICTS4.insert(&key4(&k, extra), &v, 0);
    } else {
        let _ = VERDICTS6.insert(&key6(&k, extra), &v, 0);
    }
}

/// Forget the cached verdicts of the packets of flow `k` (both echo types for ICMP): a
/// commit changed their conntrack state.
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
    };
    match icmp {
        Some((request, reply)) => {
            remove(request);
            remove(reply);
        }
        None => remove(0),
    }
}
