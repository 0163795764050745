//! Verdicts by destination: a drop that the policy gave a flow conntrack does not know, for
//! its destination alone, serves every other such flow to that destination.
//!
//! A flood of new flows towards a destination no rule accepts (the traffic an attacker
//! chooses: sources and ports changing with every packet) finds no verdict under its own key,
//! and its classification (the path, every chain) is most of what the datapath spends on it.
//! But where every chain on the path decided without reading the output interface, the source
//! or a port (`classify.rs`, `Scratch::wide`: those dimensions come last, so a chain whose
//! rules the destination's own lookup already excluded never reads them), the verdict is a
//! function of what this entry's key and checks hold:
//!
//! - the input interface (`CachedVerdict::ifindex`), the policy (`epoch`), the protocol and
//!   ICMP type, the destination (after the NAT view, as the chains read it), the conntrack
//!   state: the key ([`dest_words`]);
//! - the packet's path, forwarded or delivered: from the local-address mirror, as a function of
//!   the destination under one lease of it (`CachedVerdict::gen` holds the lease's
//!   [`crate::local::mirror_token`]; a mirror change withdraws the lease, and a FIB-decided path
//!   caches nothing), or, in probe mode, the probe's own path and output interface
//!   ([`probe_token`]).
//!
//! Only drops are cached so (a drop commits nothing to conntrack), only for packets conntrack
//! does not know (new and unknown, or invalid), and they live as long as other cached
//! verdicts (at most a second, `ttl.rs`). Each packet served is counted in the same rules and
//! reported as its classification would have been ([`super::serve`]).
//!
//! Entries live in the per-CPU first level of the IPv4 verdict cache (`VERDICTS4_CPU`) beside
//! the flows' own: their key's padding byte [`DEST_KEY`] is never set in a flow's key, and a
//! way that serves a flow is never taken for one ([`super::store::promote`]).

use peerwall_common::{
    ct, family, verdict_set, CachedVerdict, Config, CPU_VERDICT_SETS, CPU_VERDICT_WAYS,
};

use aya_ebpf::helpers::generated::{bpf_get_smp_processor_id, bpf_ktime_get_coarse_ns};

use super::key::{cacheable, gen_of, same_key};
use super::serve::{serve, MISS};
use super::store::promote;
use crate::local::mirror_token;
use crate::maps::{ROUTES, VERDICTS4_CPU, WORK};
use crate::parse::Pkt;
use crate::route::mirror_on;
use crate::work::Route;

/// The key byte that marks a destination's entry (a flow's key has 0 there).
pub(crate) const DEST_KEY: u8 = 0x80;

/// The words of the destination key of `p` in conntrack state `state`, with `extra` (the ICMP
/// echo type, or 0): no source, no ports.
#[inline(always)]
fn dest_words(p: &Pkt, extra: u8, state: u32) -> [u32; 4] {
    [
        0,
        u32::from_ne_bytes([p.dst[0], p.dst[1], p.dst[2], p.dst[3]]),
        0,
        u32::from_ne_bytes([p.proto, extra, DEST_KEY, state as u8]),
    ]
}

/// Whether a packet of state `state` (its [`crate::conntrack::CT_UNKNOWN`] bit `unknown`) is one
/// conntrack does not know, for which a destination's verdict may be cached and served.
#[inline(always)]
pub(crate) fn unknown_flow(state: u32, unknown: bool) -> bool {
    (unknown && state == ct::NEW) || state == ct::INVALID
}

/// The token of a probe packet's path and output interface (probe mode, the cache's tests).
#[inline(always)]
pub(crate) fn probe_token(path: u32, oif: u32) -> u32 {
    0x8000_0000 | ((path & 1) << 30) | (oif & 0x3fff_ffff)
}

/// The token that names how the path of a packet arriving now would be found: the mirror's
/// lease while [`crate::route::route`] asks the mirror and it holds for IPv4; 0 (none)
/// otherwise.
#[inline(always)]
fn current_token(mirror_on: bool) -> u32 {
    if !mirror_on {
        return 0;
    }
    let Some(lease) = ROUTES.get(0) else {
        return 0;
    };
    // SAFETY: no arguments.
    if lease.families & peerwall_common::routes::V4 == 0
        || unsafe { bpf_ktime_get_coarse_ns() } >= lease.until_ns
    {
        return 0;
    }
    mirror_token(lease)
}

/// The drop cached for the destination of `WORK`'s packet (IPv4, parsed and viewed), in
/// conntrack state `state`, arriving on `iif` under `epoch`: [`MISS`], or the action served
/// (counted and reported). `probe`: the probe's token ([`probe_token`]), or 0 for a packet
/// whose path the mirror finds where [`crate::route::route`] asks it.
///
/// A global function: the verifier checks it once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn dest_verdict(iif: u32, epoch: u32, state: u32, probe: u32, flags: u32) -> u32 {
    let token = if probe != 0 {
        probe
    } else {
        current_token(mirror_on(&Config {
            active: epoch,
            flags,
        }))
    };
    if token == 0 {
        return MISS;
    }
    let Some(w) = WORK.get(0) else {
        return MISS;
    };
    let p = &w.p;
    if p.family != family::V4 {
        return MISS;
    }
    let Some(extra) = cacheable(p) else {
        return MISS;
    };
    let words = dest_words(p, extra, state);
    // SAFETY: no arguments.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let Some(s) = VERDICTS4_CPU.get(cpu.wrapping_mul(CPU_VERDICT_SETS) | verdict_set(words)) else {
        return MISS;
    };
    let mut i = 0;
    while i < CPU_VERDICT_WAYS {
        let e = &s.ways[i];
        if same_key(e, &words) {
            if e.v.gen == token {
                return serve(&e.v, iif, epoch, true, flags, p.len as u64);
            }
            return MISS;
        }
        i += 1;
    }
    MISS
}

/// Cache drop `v`, which classification gave `WORK`'s packet on route `r`, for the packet's
/// destination, when it is one: an IPv4 packet conntrack does not know, whose path a token
/// names and whose chains all decided by its destination (`wide`: one of them did not).
/// Whether it was cached (the caller then caches nothing under the flow's own key).
#[inline(always)]
pub(super) fn remember_dest(p: &Pkt, r: &Route, wide: bool, v: &CachedVerdict) -> bool {
    if wide || r.token == 0 || p.family != family::V4 || !unknown_flow(r.state, r.unknown) {
        return false;
    }
    let Some(extra) = cacheable(p) else {
        return false;
    };
    let words = dest_words(p, extra, r.state);
    let set = verdict_set(words);
    // SAFETY: no arguments.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let Some(s) = VERDICTS4_CPU.get_ptr_mut(cpu.wrapping_mul(CPU_VERDICT_SETS) | set) else {
        return false;
    };
    let mut d = *v;
    d.gen = r.token;
    // SAFETY: the transmute is between two 16-byte plain-data types.
    let key = unsafe { core::mem::transmute::<[u32; 4], peerwall_common::VerdictKey4>(words) };
    // SAFETY: this CPU's own set, of a successful lookup.
    promote(unsafe { &mut *s }, &words, &key, &d, gen_of(set), r.epoch);
    true
}
