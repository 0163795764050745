//! peerwall datapath: tc (tcx) and XDP classifiers over rule bitmaps in LPM tries.
//!
//! For a packet arriving on an attached interface the program reads its headers, asks the FIB
//! where it goes (forwarded through `oif`, or delivered to the gateway), derives its conntrack
//! state, and runs the filter chains of every hook on that path in order, as nftables would
//! (prerouting, forward, postrouting / prerouting, input). Per chain, each dimension (source and
//! destination prefix, source and destination port, family+protocol, input and output interface,
//! ct state) yields a bitmap of the rules it allows; their AND's lowest bit is the deciding rule,
//! no bit means the chain policy. Cost per chain is a fixed number of lookups: constant in the
//! number of rules and prefixes (the tries' depth is bounded by the key width).
//!
//! Two copies of every policy map exist (slot 0 and 1); `CONFIG.active` picks one, so a new
//! policy is written into the idle copy and switched to with one store.
//!
//! Unparseable IP packets (truncated or inconsistent headers) are dropped: the kernel's own IP
//! input would drop them too. Non-IP traffic (ARP, ...) passes. Non-first fragments carry no
//! ports: port matches (eq or neq) do not hold on them, as in nftables.
//!
//! Before anything else looks at a packet, [`view`] rewrites its parsed destination as
//! prerouting's NAT will (Liqo's remapping of overlapping CIDRs), so routing, conntrack and the
//! chains all see the addresses nftables' forward hook sees; the packet itself is not changed.
//!
//! Packets of a known flow skip all of that: the [`cache`] holds the verdict their flow's first
//! packet got, and an IPv4 TCP or UDP packet finds it by reading 12 header bytes straight into
//! the cache key before anything is parsed (`known_flow_v4`).
//!
//! **Global functions.** Every gateway verifies its programs when it starts, so the verifier's
//! work is the datapath's start-up cost (`cargo xtask bench-peers`). The verifier walks a
//! static function at each call, in the caller's state, and a global one once, on its own,
//! whatever calls it: the datapath's steps (parse, conntrack, the cache, each chain body, the
//! commit, events) are global functions, `#[unsafe(no_mangle)] extern "C"`, which bpf-linker
//! leaves global. A global function returns a scalar; it takes scalars, the context, or a
//! pointer the verifier requires it to test for null (`as_ref`); everything else it reads
//! from `WORK`. That took a tc program from 430,000 walked instructions (over a second to
//! load) to under 50,000 (`tests/bpf.rs`, `verifier_accepts_the_largest_policy`, bounds it).
//!
//! One concern per file: [`maps`], [`parse`], [`view`], [`cache`] (its verdicts' lifetime in
//! [`ttl`], with the packet's coarse clock), [`flow`], [`conntrack`] (the kernel's table in [`kernel_ct`]), [`seen`],
//! [`classify`] (one dimension's lookup in [`dims`]; without the kernel's state,
//! [`open_either`]; [`counters`]), [`route`] (with the local-address mirror, [`local`]),
//! [`reject`], [`l2`] (the tc entry of every device type), [`events`], [`mem`] (zeroing a word
//! at a time); the program entries (tc and XDP) are here; [`bare`] is the benchmark's
//! baseline.
#![no_std]
// BPF inline assembly: the known-flow path's unaligned 32-bit packet loads (`cache.rs`).
#![feature(asm_experimental_arch)]
#![no_main]
// Map keys and values go to the helpers by reference: passing them by value would copy them
// onto the 512-byte BPF stack first.
#![allow(clippy::needless_borrows_for_generic_args)]

mod apart;
mod bare;
mod cache;
mod classify;
mod conntrack;
mod counters;
mod ct_args;
mod dims;
mod events;
mod flow;
mod iface_memo;
mod kernel_ct;
mod l2;
mod lines;
mod local;
mod maps;
mod mem;
mod open_either;
mod outcome;
mod parse;
mod reject;
mod route;
mod seen;
mod ttl;
mod view;
mod work;
use aya_ebpf::bindings::{__sk_buff, xdp_action, TC_ACT_OK, TC_ACT_SHOT};
use aya_ebpf::macros::{classifier, xdp};
use aya_ebpf::programs::{TcContext, XdpContext};
use peerwall_common::{ct, family, flags, PROBE_MAGIC};

use crate::cache::{
    cache_on, cached_verdict, direct_cache, known_flow_v4, mark_stored, remember, remember_pair,
    MISS,
};
use crate::classify::{classify, ACT_ACCEPT, ACT_DROP, ACT_REJECT};
use crate::conntrack::{
    ct_commit, ct_state, idle_and_new, kernel_commit, kernel_state, CT_FIRST_REPLY, CT_NO_WRITE,
    CT_OPEN_EITHER, CT_UNKNOWN,
};
use crate::events::note_outcome;
use crate::kernel_ct::kernel_tracks;
use crate::maps::{allow_all, config, has_views, kernel_ct_on, WORK};
use crate::open_either::settle_open_either;
use crate::outcome::{outcome, record};
use crate::parse::{parse, Parse, Pkt, Source, TcDirect, ETH_P_IP, ETH_P_IPV6};
use crate::reject::reject;
use crate::route::{route, PATH_FORWARD};
use crate::view::forward_view;
use crate::work::Route;

// Program entries.

/// tc entry for Ethernet devices (veth, Geneve): the IP header follows 14 bytes.
#[classifier]
pub fn peerwall_tc(ctx: TcContext) -> i32 {
    match try_tc(&ctx, 14) {
        Ok(v) => v,
        Err(()) => TC_ACT_SHOT,
    }
}

/// tc entry for every device type: the IP header follows the link-layer header the kernel
/// measured (`l2.rs`). What the loader attaches where the kernel offers the cast it needs, so
/// that a gateway verifies one tc program, not one per device type.
#[classifier]
pub fn peerwall_tc_any(ctx: TcContext) -> i32 {
    let Some(l2) = crate::l2::mac_len(ctx.skb.skb) else {
        return TC_ACT_SHOT;
    };
    match try_tc(&ctx, (l2 & 0xff) as usize) {
        Ok(v) => v,
        Err(()) => TC_ACT_SHOT,
    }
}

/// tc entry for devices without a link-layer header (WireGuard, TUN): the packet starts with
/// the IP header. The loader picks the entry by device type (where it cannot attach
/// [`peerwall_tc_any`]), so no packet pays a lookup.
#[classifier]
pub fn peerwall_tc_l3(ctx: TcContext) -> i32 {
    match try_tc(&ctx, 0) {
        Ok(v) => v,
        Err(()) => TC_ACT_SHOT,
    }
}

#[inline(always)]
fn try_tc(ctx: &TcContext, l2: usize) -> Result<i32, ()> {
    let cfg = config();
    if allow_all(&cfg) {
        // Connections start unstamped meanwhile: the agent's sweep vouches for none of them.
        crate::seen::void_sweep();
        return Ok(TC_ACT_OK);
    }
    // SAFETY: the skb pointer is the program's context.
    let (ifindex, proto) = unsafe { ((*ctx.skb.skb).ifindex, (*ctx.skb.skb).protocol) };
    let ethertype = u16::from_be(proto as u16);
    if ethertype != ETH_P_IP && ethertype != ETH_P_IPV6 {
        return Ok(TC_ACT_OK);
    }
    // Probe packets carry their input interface in the control block (cache tests only).
    let probe_cache = cfg.flags & flags::PROBE_CACHE != 0;
    if ethertype == ETH_P_IP && direct_cache(&cfg) {
        let iif = if probe_cache { ctx.cb()[3] } else { ifindex };
        let a = known_flow_v4(ctx.skb.skb, l2 as u32, iif, cfg.active, cfg.flags);
        if a == ACT_ACCEPT as u32 {
            return Ok(TC_ACT_OK);
        }
        if a == ACT_DROP as u32 {
            return Ok(TC_ACT_SHOT);
        }
    }
    let Some(w) = WORK.get_ptr_mut(0) else {
        return Err(());
    };
    // SAFETY: per-CPU slot of a successful lookup; the packet is parsed in place.
    let p = unsafe { &mut (*w).p };
    // No clock read for this packet yet (`ttl::coarse_ns`), but the one `known_flow_v4` made
    // where it noted the packet.
    // SAFETY: as above.
    unsafe {
        if !(*w).looked_up {
            (*w).coarse = 0;
        }
    }
    match parse_tc(ctx.skb.skb, l2 as u32, ethertype as u32) {
        PARSE_OK => {}
        bad => {
            // `known_flow_v4`'s note is for this packet only.
            // SAFETY: as above.
            unsafe {
                (*w).looked_up = false;
                (*w).seen = 0;
            }
            return if bad == PARSE_NOT_IP {
                Ok(TC_ACT_OK)
            } else {
                Err(())
            };
        }
    }
    let probe = cfg.flags & flags::PROBE != 0 && ctx.cb()[0] == PROBE_MAGIC;
    let viewed = has_views(&cfg)
        // SAFETY: as above; `wire_dst` is not the packet `p` points at.
        && forward_view(p, if probe { ctx.cb()[3] } else { ifindex }, cfg.active & 1, unsafe {
            &raw mut (*w).wire_dst
        });
    // SAFETY: as above.
    unsafe { (*w).viewed = viewed };
    let diag = cfg.flags & flags::DIAG_ALL;
    let cache = cache_on(&cfg);
    // `known_flow_v4` already looked the same key up: `cached_verdict` would only clear its
    // note, so it is not called (each call returns through the kernel's return thunk).
    // SAFETY: as above.
    let looked = unsafe { core::mem::take(&mut (*w).looked_up) };
    // Written with `looked_up`, for this packet only.
    // SAFETY: as above.
    let no_room = looked && unsafe { (*w).no_room };
    if cache && !looked {
        let iif = if probe { ctx.cb()[3] } else { ifindex };
        let a = cached_verdict(iif, cfg.active, 1, cfg.flags);
        if a == ACT_ACCEPT as u32 {
            return Ok(TC_ACT_OK);
        }
        if a == ACT_DROP as u32 {
            return Ok(TC_ACT_SHOT);
        }
    }
    // What `known_flow_v4` found of the packet's FLOW_SEEN entry (read once, for this packet).
    // SAFETY: as above.
    let seen = unsafe { core::mem::take(&mut (*w).seen) };
    let tracked = tracked_state(ctx, l2, p, cfg.flags, seen);
    // Classified without the kernel's state: counted once it is known to hold (below).
    let open_either = tracked & CT_OPEN_EITHER != 0;
    let count = diag & flags::DIAG_NO_COUNTERS == 0 || probe;
    let mut r = packet_route(ctx, &cfg, p, ifindex, probe, tracked);
    r.cache = cache;
    r.no_room = no_room;
    // Under `OPEN_EITHER`, counted by `settle_open_either` once the outcome is known to hold.
    r.count = count && !open_either;
    // SAFETY: as above.
    unsafe { (*w).r = r };
    if diag & flags::DIAG_NO_CHAINS != 0 {
        return Ok(TC_ACT_OK);
    }
    classify_work();
    if open_either {
        settle_open_either(ctx.skb.skb, cfg.flags, count as u32);
    }
    Ok(finish_tc(ctx.skb.skb, probe as u32, cfg.flags))
}

/// The route of the tc packet `p` (arrived on `ifindex`) with its conntrack state and bits
/// (`tracked`): the path and interfaces from the control block of a probe, else from the
/// local-address mirror or the FIB (`route.rs`). Neither counted nor cached: the caller says.
#[inline(always)]
fn packet_route(
    ctx: &TcContext,
    cfg: &peerwall_common::Config,
    p: &Pkt,
    ifindex: u32,
    probe: bool,
    tracked: u32,
) -> Route {
    let diag = cfg.flags & flags::DIAG_ALL;
    let (path, iif, oif, by_mirror) = if probe {
        let cb = ctx.cb();
        (cb[1], cb[3], cb[2], false)
    } else if diag & flags::DIAG_NO_FIB != 0 {
        (PATH_FORWARD, ifindex, 0, false)
    } else {
        let (path, oif, by_mirror) = route(ctx, cfg, p, ifindex);
        (path, ifindex, oif, by_mirror)
    };
    Route {
        epoch: cfg.active,
        path,
        iif,
        oif,
        state: tracked & 0xff,
        count: false,
        commit: tracked & CT_NO_WRITE == 0 && diag & flags::DIAG_NO_CT_COMMIT == 0,
        cache: false,
        unknown: tracked & CT_UNKNOWN != 0,
        first_reply: tracked & CT_FIRST_REPLY != 0,
        all_lookups: !probe && diag & flags::DIAG_ALL_ADDR_LOOKUPS != 0,
        no_lines: !probe && diag & flags::DIAG_NO_HOST_LINES != 0,
        open_either: tracked & CT_OPEN_EITHER != 0,
        no_room: false,
        by_mirror,
    }
}

/// The packet's conntrack state with its bits: from the kernel's table where it tracks the
/// packet's flow, else from the datapath's own (none under the benchmark's `DIAG_NO_CT`).
#[inline(always)]
fn tracked_state(ctx: &TcContext, l2: usize, p: &Pkt, flags: u32, seen: u32) -> u32 {
    let seen_on = flags & flags::FLOW_SEEN != 0;
    if flags & flags::DIAG_NO_CT != 0 {
        ct::NEW | CT_NO_WRITE
    } else if kernel_ct_on() && kernel_tracks(p) {
        if let Some(new) = idle_and_new(p, seen_on, seen) {
            return new;
        }
        // Without the kernel's table where the chains can decide without it, unless events
        // are on (an event says the packet's state).
        let open_either = flags & flags::EVENTS == 0;
        kernel_state_tc(ctx.skb.skb, seen_on as u32, seen, open_either as u32)
    } else {
        ct_state_tc(ctx.skb.skb, l2 as u32, seen_on as u32, seen)
    }
}

// Global functions (module docs): the program entries' steps, reading the packet from `WORK`.

const PARSE_OK: u32 = 0;
const PARSE_NOT_IP: u32 = 1;
const PARSE_BAD: u32 = 2;

/// [`parse`] of a tc packet into `WORK`: `PARSE_OK`, `PARSE_NOT_IP` or `PARSE_BAD`.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn parse_tc(skb: *mut __sk_buff, l2: u32, ethertype: u32) -> u32 {
    let ctx = &TcContext::new(skb);
    let Some(w) = WORK.get_ptr_mut(0) else {
        return PARSE_BAD;
    };
    // SAFETY: per-CPU slot of a successful lookup; the packet is parsed in place.
    let p = unsafe { &mut (*w).p };
    match parse(&TcDirect { ctx }, (l2 & 0xff) as usize, ethertype as u16, p) {
        Parse::Ok => PARSE_OK,
        Parse::NotIp => PARSE_NOT_IP,
        Parse::Bad => PARSE_BAD,
    }
}

/// [`kernel_state`] of the tc packet in `WORK`.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kernel_state_tc(
    skb: *mut __sk_buff,
    seen_on: u32,
    seen: u32,
    open_either: u32,
) -> u32 {
    let ctx = &TcContext::new(skb);
    match WORK.get(0) {
        Some(w) => kernel_state(ctx, &w.p, seen_on != 0, seen, open_either != 0),
        None => ct::INVALID,
    }
}

/// [`ct_state`] of the tc packet in `WORK`, its IP header at `l2`.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn ct_state_tc(skb: *mut __sk_buff, l2: u32, seen_on: u32, seen: u32) -> u32 {
    let ctx = &TcContext::new(skb);
    match WORK.get(0) {
        Some(w) => ct_state(ctx, (l2 & 0xff) as usize, &w.p, seen_on != 0, seen),
        None => ct::INVALID,
    }
}

/// Classify the packet in `WORK`.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn classify_work() -> u32 {
    match WORK.get(0) {
        Some(w) => classify(&w.r),
        None => 0,
    }
}

/// Act on the outcome of `WORK`'s packet: conntrack, probe record, tc verdict. A global
/// function: the verifier checks it and its callees once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn finish_tc(skb: *mut __sk_buff, probe: u32, flags: u32) -> i32 {
    let out = outcome();
    if probe != 0 {
        record(&out);
    }
    if flags & peerwall_common::flags::EVENTS != 0 {
        note_outcome(flags);
    }
    // A drop its pair's next packets take from the pair-drop cache (`cache/pair.rs`) needs
    // no entry of its own. Where only this CPU's level of the cache would take the verdict
    // and its set has no room (`Route::no_room`), `remember` would store nothing: not called.
    // Its configuration check first, inline: with events on (the shipped DaemonSet's
    // `--events`), a denied packet makes no call that could store nothing.
    use peerwall_common::flags::{EVENTS, FLOW_SEEN};
    let pairs = flags & (EVENTS | FLOW_SEEN) == FLOW_SEEN;
    let paired = out.action == ACT_DROP && pairs && remember_pair(flags) != 0;
    let full = paired
        || WORK.get(0).is_some_and(|w| {
            w.r.no_room && !w.viewed && (w.r.unknown || w.r.open_either) && w.p.family == family::V4
        });
    let until = if full { 0 } else { remember(out.action as u32) };
    if until != 0 {
        mark_stored(until);
    }
    match out.action {
        ACT_ACCEPT => {
            if let Some(w) = WORK.get(0) {
                if w.r.commit {
                    if kernel_ct_on() && kernel_tracks(&w.p) {
                        kernel_commit();
                    } else {
                        ct_commit(w.r.state, w.r.unknown as u32);
                    }
                }
            }
            TC_ACT_OK
        }
        ACT_REJECT => reject(skb),
        _ => TC_ACT_SHOT,
    }
}

#[xdp]
pub fn peerwall_xdp(ctx: XdpContext) -> u32 {
    match try_xdp(&ctx) {
        Ok(v) => v,
        Err(()) => xdp_action::XDP_DROP,
    }
}

/// Early drop: evaluates like tc but never changes conntrack or counts accepted packets; tc
/// makes the full decision for everything XDP passes.
fn try_xdp(ctx: &XdpContext) -> Result<u32, ()> {
    let cfg = config();
    if allow_all(&cfg) {
        return Ok(xdp_action::XDP_PASS);
    }
    let ifindex = ctx.ingress_ifindex() as u32;
    // The loader attaches XDP to Ethernet devices only.
    let l2 = 14usize;
    let ethertype = match ctx.read::<[u8; 2]>(12) {
        Some(t) => u16::from_be_bytes(t),
        None => return Ok(xdp_action::XDP_PASS),
    };
    let Some(w) = WORK.get_ptr_mut(0) else {
        return Err(());
    };
    // SAFETY: per-CPU slot of a successful lookup; the packet is parsed in place.
    let p = unsafe { &mut (*w).p };
    // No clock read for this packet yet (`ttl::coarse_ns`).
    // SAFETY: as above.
    unsafe { (*w).coarse = 0 };
    match parse(ctx, l2 & 0xff, ethertype, p) {
        Parse::NotIp => return Ok(xdp_action::XDP_PASS),
        Parse::Bad => return Err(()),
        Parse::Ok => {}
    }
    // SAFETY: as above; `wire_dst` is not the packet `p` points at.
    let viewed = has_views(&cfg)
        && forward_view(p, ifindex, cfg.active & 1, unsafe {
            &raw mut (*w).wire_dst
        });
    // SAFETY: as above.
    unsafe { (*w).viewed = viewed };
    let cache = cache_on(&cfg);
    if cache {
        let a = cached_verdict(ifindex, cfg.active, 0, cfg.flags);
        if a == ACT_DROP as u32 {
            return Ok(xdp_action::XDP_DROP);
        }
        if a != MISS {
            return Ok(xdp_action::XDP_PASS);
        }
    }
    let (path, oif, _) = route(ctx, &cfg, p, ifindex);
    let seen_on = cfg.flags & flags::FLOW_SEEN != 0;
    let tracked = if kernel_ct_on() && kernel_tracks(p) {
        kernel_state(ctx, p, seen_on, 0, false)
    } else {
        ct_state(ctx, l2 & 0xff, p, seen_on, 0)
    };
    let r = Route {
        epoch: cfg.active,
        path,
        iif: ifindex,
        oif,
        state: tracked & 0xff,
        count: false,
        commit: false,
        cache,
        unknown: tracked & CT_UNKNOWN != 0,
        first_reply: false,
        all_lookups: false,
        no_lines: false,
        open_either: false,
        no_room: false,
        by_mirror: false,
    };
    // SAFETY: as above.
    unsafe { (*w).r = r };
    Ok(finish_xdp(cfg.flags))
}

/// Classify `WORK`'s packet; drop it here only when the verdict is drop.
#[inline(never)]
fn finish_xdp(flags: u32) -> u32 {
    classify_work();
    let out = outcome();
    if out.action != ACT_DROP {
        return xdp_action::XDP_PASS;
    }
    if flags & peerwall_common::flags::EVENTS != 0 {
        note_outcome(flags);
    }
    // Count what XDP drops (tc never sees it): the same evaluation, counting.
    if let Some(w) = WORK.get_ptr_mut(0) {
        // SAFETY: per-CPU slot of a successful lookup.
        unsafe { (*w).r.count = true };
    }
    classify_work();
    let until = remember(ACT_DROP as u32);
    if until != 0 {
        mark_stored(until);
    }
    xdp_action::XDP_DROP
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
