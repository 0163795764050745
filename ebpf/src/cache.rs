//! Verdict cache: the next packets of a flow reuse the verdict its classification gave, in one
//! hash lookup, instead of routing, conntrack and every chain again (`VERDICTS`, keyed by the
//! packet's own direction).
//!
//! A cached verdict is served only under the policy epoch it was computed in (`CONFIG.active`:
//! any policy change, a slot switch or an in-place update, gives a new epoch), for the same
//! input interface, and for at most [`VERDICT_TTL_NS`]: after that the packet is classified in
//! full again, which also refreshes conntrack and re-reads the route. Conntrack forgets the
//! entries whose state a commit changes (`conntrack.rs`). Only accept and drop are cached, and
//! only for packets whose conntrack state is new or established and cannot be otherwise:
//! TCP with valid flags, UDP, ICMP echo (its type in the key), never fragments or ICMP errors.

#[allow(unused_imports)]
use super::*;

use aya_ebpf::helpers::generated::bpf_ktime_get_coarse_ns;

/// How long a cached verdict is served.
pub(crate) const VERDICT_TTL_NS: u64 = 1_000_000_000;

/// [`cached_verdict`]'s answer when the packet must be classified.
pub(crate) const MISS: u32 = u32::MAX;

/// The cache key of a packet, or None when its verdict is never cached.
#[inline(always)]
pub(crate) fn cache_key(p: &Pkt) -> Option<FlowKey> {
    let mut k = flow_key(p);
    match p.proto {
        IPPROTO_TCP => {
            if !p.has_ports || !tcp_flags_valid(p.tcp_flags) {
                return None;
            }
        }
        IPPROTO_UDP => {
            if !p.has_ports {
                return None;
            }
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            if !icmp_keyed(p) {
                return None;
            }
            k._pad[0] = p.icmp_type;
        }
        _ => return None,
    }
    Some(k)
}

/// The verdict cached for `WORK`'s packet arriving on `iif` under `epoch`, after counting it in
/// the rules that decided it and reporting its event (accepts only when `count_accepts`: XDP
/// leaves them to tc); or [`MISS`].
#[inline(never)]
pub(crate) fn cached_verdict(iif: u32, epoch: u32, count_accepts: bool, flags: u32) -> u32 {
    let Some(w) = WORK.get(0) else {
        return MISS;
    };
    let Some(k) = cache_key(&w.p) else {
        return MISS;
    };
    // SAFETY: read-only lookup of plain data.
    let Some(v) = (unsafe { VERDICTS.get(&k) }) else {
        return MISS;
    };
    if v.epoch != epoch || v.ifindex != iif {
        return MISS;
    }
    // SAFETY: no arguments.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    if now.wrapping_sub(v.at_ns) >= VERDICT_TTL_NS {
        return MISS;
    }
    let action = v.action as u32;
    if flags & peerwall_common::flags::EVENTS != 0 {
        note_cached(v, epoch, count_accepts);
    }
    if action != ACT_ACCEPT as u32 || count_accepts {
        let n = (v.counted as usize).min(CACHED_COUNTERS);
        let len = w.p.len as u64;
        let mut i = 0;
        while i < CACHED_COUNTERS {
            if i >= n {
                break;
            }
            let c = if epoch & 1 == 0 {
                COUNTERS0.get_ptr_mut(v.counters[i])
            } else {
                COUNTERS1.get_ptr_mut(v.counters[i])
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
    let Some(k) = cache_key(&w.p) else {
        return;
    };
    let v = CachedVerdict {
        epoch: r.epoch,
        ifindex: r.iif,
        // SAFETY: no arguments.
        at_ns: unsafe { bpf_ktime_get_coarse_ns() },
        counters: sc.trail,
        action,
        state: r.state as u8,
        counted: sc.steps as u8,
        audit: sc.audit as u8,
        audit_step: sc.audit_step as u8,
        _pad: [0; 3],
        oif: r.oif,
        _pad2: [0; 4],
    };
    let _ = VERDICTS.insert(&k, &v, 0);
}

/// Forget the cached verdicts of the packets keyed `k` (both echo types for ICMP): a commit
/// changed their conntrack state.
#[inline(never)]
pub(crate) fn forget(k: &FlowKey) {
    if k.proto == IPPROTO_ICMP || k.proto == IPPROTO_ICMPV6 {
        let (request, reply) = if k.proto == IPPROTO_ICMP {
            (8, 0)
        } else {
            (128, 129)
        };
        let mut c = *k;
        c._pad[0] = request;
        let _ = VERDICTS.remove(&c);
        c._pad[0] = reply;
        let _ = VERDICTS.remove(&c);
    } else {
        let _ = VERDICTS.remove(k);
    }
}
