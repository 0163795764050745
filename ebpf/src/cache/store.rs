//! Storing verdicts: every cacheable verdict into the shared level ([`remember`]), and into
//! this CPU's level, with its tag, when one is served ([`promote`]).

use aya_ebpf::helpers::generated::bpf_get_smp_processor_id;
use peerwall_common::{
    ct, family, verdict_set, verdict_tag, verdict_until_hint, verdict_way_free, CachedVerdict,
    CpuVerdict4, CpuVerdicts4, VerdictKey4, CACHED_COUNTERS, CPU_VERDICT_SETS, CPU_VERDICT_WAYS,
};

use super::fresh::extend;
use super::key::{cacheable, key4, key6, lanes_at, packet_set, same_key};
use crate::classify::{ACT_ACCEPT, ACT_DROP};
use crate::flow::flow_key;
use crate::maps::{SCRATCH, VERDICTS4, VERDICTS4_CPU, VERDICTS6, WORK};
use crate::parse::IPPROTO_TCP;
use crate::ttl::{stamp, ttl_reused};

/// Copy the verdict `v` that `VERDICTS4` just served for key `k` into this CPU's set `s`
/// (`VERDICTS4_CPU[slot]`), with its tag and hint ([`write_way`]): into
/// the way holding the same key, or else a way that no longer serves (empty, expired, of an
/// older generation `gen` or policy `epoch`). A set whose two ways still serve other flows is
/// left alone: with three flows taking turns in two ways, replacing the older way would make
/// every packet of all three miss; keeping them, two of the three hit until their verdicts
/// expire (at most a second), and the third goes on being served from `VERDICTS4`.
#[inline(always)]
pub(super) fn promote(
    s: &mut CpuVerdicts4,
    slot: u32,
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
    write_way(s, slot, i, words, k, v);
}

/// Write key `k` (its words `words`) and verdict `v` into way `i` of this CPU's set `s`
/// (`VERDICTS4_CPU[slot]`), with the way's tag and hint ([`lanes_at`]).
#[inline(always)]
fn write_way(
    s: &mut CpuVerdicts4,
    slot: u32,
    i: usize,
    words: &[u32; 4],
    k: &VerdictKey4,
    v: &CachedVerdict,
) {
    let i = i & 1;
    // Key and verdict only: the way's padding is zero in map memory and never written (as a
    // whole struct, the way would be built on the stack with a byte-wise `memset` of it).
    s.ways[i].key = *k;
    s.ways[i].v = *v;
    if let Some((t, u)) = lanes_at(slot) {
        // SAFETY: lanes of an entry of a successful lookup; only this CPU writes them.
        unsafe {
            (*t)[i] = verdict_tag(*words);
            (*u)[i] = verdict_until_hint(v.at.wrapping_add(v.ttl as u32));
        }
    }
}

/// Cache the drop `v` of a flow conntrack never saw, or a verdict that held whatever the
/// packet's state (`Route::open_either`) (key `k`, its words `words`), in this CPU's set `s`
/// (`VERDICTS4_CPU[slot]`), deciding by the set's tags and hints alone, which stay in the
/// CPU's cache: into the way whose tag is the key's and that holds the key (a
/// flow dropped again), else a way whose hint says its verdict no longer serves, else
/// nowhere. A way is read only where its tag is the key's: under a flood of new flows,
/// reading both ways to find a free one (as [`promote`] does) was two cold lines per packet,
/// a fifth of a denied flood's time in the program. A way whose verdict ended early (a new
/// generation or policy) looks busy until its hint passes: the drop is then not cached,
/// which costs the flow's next packet a classification, never a wrong verdict.
#[inline(always)]
fn place_on_this_cpu(
    s: &mut CpuVerdicts4,
    slot: u32,
    words: &[u32; 4],
    k: &VerdictKey4,
    v: &CachedVerdict,
) {
    let Some((t, u)) = lanes_at(slot) else {
        return;
    };
    let tag = verdict_tag(*words);
    let now = stamp();
    // SAFETY: lanes of an entry of a successful lookup; only this CPU writes them.
    let (t, u) = unsafe { (*t, *u) };
    let mut i = 0;
    let mut found = CPU_VERDICT_WAYS;
    while i < CPU_VERDICT_WAYS {
        if t[i] == tag && same_key(&s.ways[i], words) {
            found = i;
            break;
        }
        i += 1;
    }
    if found == CPU_VERDICT_WAYS {
        found = if verdict_way_free(u[0], now) {
            0
        } else if verdict_way_free(u[1], now) {
            1
        } else {
            return;
        };
    }
    write_way(s, slot, found, words, k, v);
}

/// Cache `action`, which `classify` just gave `WORK`'s packet, when the packet and the path
/// allow it. Returns until when (jiffies) the verdict it put into the shared level is served,
/// for [`mark_stored`], or 0 when it put none there. A global function: the verifier checks it
/// once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn remember(action: u32) -> u32 {
    let action = action as u8;
    if action != ACT_ACCEPT && action != ACT_DROP {
        return 0;
    }
    let (Some(w), Some(sc)) = (WORK.get(0), SCRATCH.get(0)) else {
        return 0;
    };
    let r = &w.r;
    if !r.cache || (r.state != ct::NEW && r.state != ct::ESTABLISHED && !r.open_either) {
        return 0;
    }
    // A verdict that held for every state the packet can have, without the kernel's table
    // (`conntrack.rs`, `CT_OPEN_EITHER`): a flood of new flows and a known flow look the
    // same, so into this CPU's first level only, as a drop of an unknown flow below, and only
    // where it reports nothing (an audit's event says the packet's state). Never a TCP SYN's:
    // the connection's next segments are no SYNs, and they take the kernel's state.
    if r.open_either && (w.p.family != family::V4 || sc.audit != 0 || w.p.proto == IPPROTO_TCP) {
        return 0;
    }
    // The first accepted packet of a flow conntrack never saw: its commit creates the flow,
    // and the flow's next packet, known then, is cached. A flood of new flows, each one
    // packet, then inserts nothing into the verdict caches.
    if r.unknown && action == ACT_ACCEPT {
        return 0;
    }
    if sc.steps as usize > CACHED_COUNTERS {
        return 0;
    }
    let Some(extra) = cacheable(&w.p) else {
        return 0;
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
        if r.unknown || r.open_either {
            // A drop for a flow conntrack never saw (denied flows never become known): into
            // this CPU's first level only, where a free way takes it and a flood finds none,
            // never the shared LRU a flood would churn on every packet.
            // SAFETY: the transmute is between two 16-byte plain-data types.
            let words: [u32; 4] = unsafe { core::mem::transmute::<VerdictKey4, [u32; 4]>(key) };
            // SAFETY: no arguments.
            let cpu = unsafe { bpf_get_smp_processor_id() };
            let set = verdict_set(words);
            let slot = cpu.wrapping_mul(CPU_VERDICT_SETS) | set;
            if let Some(s) = VERDICTS4_CPU.get_ptr_mut(slot) {
                // SAFETY: this CPU's own set, of a successful lookup.
                place_on_this_cpu(unsafe { &mut *s }, slot, &words, &key, &v);
            }
            return 0;
        }
        let _ = VERDICTS4.insert(&key, &v, 0);
    } else {
        let _ = VERDICTS6.insert(&key6(&k, extra), &v, 0);
        crate::apart::apart();
    }
    at.wrapping_add(ttl as u32)
}

/// After [`remember`] put `WORK`'s packet's verdict into the shared level, served until
/// `until` (its return, when not 0): the set's mark moves on ([`extend`]). Apart from
/// [`remember`], whose frame the key copies would add to on the entries' call chains (the
/// verifier bounds their frames together). A reader between the insert and the mark skips
/// the lookup and classifies, which is safe. A global function: the verifier checks it once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn mark_stored(until: u32) -> u32 {
    if until != 0 {
        if let Some(w) = WORK.get(0) {
            extend(packet_set(&w.p), until);
        }
    }
    0
}
