//! Connection tracking: flows keyed by their original direction in two tables, replied flows
//! in `FLOWS` (an LRU hash) and the others in `FLOWS_NEW` (a direct-mapped array: a new flow
//! takes its slot) — a flow moves over with its first reply, so a flood of new flows never
//! evicts an established one; the state of a packet (new,
//! established, related, invalid) and the commit after an accept.

use aya_ebpf::helpers::generated::bpf_ktime_get_ns;
use peerwall_common::{ct, family, flow_words, new_flow_slot, FlowKey, FlowState, NewFlowSlot};

use crate::cache::{forget, outdate};
use crate::flow::{
    flow_key, icmp_is_error, icmp_is_reply, icmp_keyed, reverse, sctp_chunk_opens, tcp_flags_valid,
    tcp_opens,
};
use crate::kernel_ct::{found_state, kernel_tracks, CtLookup, Kernel};
use crate::maps::{
    ended_idle_ns, kernel_ct_on, new_flow_mask, ENDED_UNTIL, FLOWS, FLOWS_NEW, FLOW_IDLE_NS, WORK,
};
use crate::mem::zero;
use crate::parse::{
    parse, Parse, Pkt, Source, ETH_P_IP, ETH_P_IPV6, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_SCTP,
    IPPROTO_TCP, IPPROTO_UDP,
};
use crate::seen::{kernel_swept, note_seen, seen_idle};
use crate::work::{SEEN_IDLE, SEEN_LIVE};

/// A flow's state, wherever it is: the established table first, unless its entry there has
/// expired (a flow started again since is in `FLOWS_NEW`: the `FLOW_SEEN` shortcut inserts it
/// there without clearing what expired). A pointer: an ended flow's packets refresh it.
#[inline(always)]
fn lookup(k: &FlowKey, now: u64) -> Option<*mut FlowState> {
    match FLOWS.get_ptr_mut(k) {
        // SAFETY: pointer from a successful lookup.
        Some(st) if fresh(unsafe { &*st }, now) => Some(st),
        // SAFETY: a slot of a successful lookup; other CPUs may rewrite it meanwhile, which
        // at worst makes this lookup miss or see another new flow's state (not replied,
        // fresh: what any slot holds).
        _ => new_slot(k).map(|s| unsafe { &raw mut (*s).state }),
    }
}

/// `FLOWS_NEW`'s slot holding flow `k`, if it does.
#[inline(always)]
fn new_slot(k: &FlowKey) -> Option<*mut NewFlowSlot> {
    let s = FLOWS_NEW.get_ptr_mut(new_slot_index(k))?;
    // SAFETY: pointer from a successful lookup.
    same_flow(unsafe { &(*s).key }, k).then_some(s)
}

/// The index of flow `k`'s slot in `FLOWS_NEW` (its hash). A global function:
/// the verifier checks the hash once, not at each of conntrack's lookups and inserts; `k` is
/// never null (the verifier requires the test of a global function's pointer argument).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn new_slot_index(k: *const FlowKey) -> u32 {
    // SAFETY: a valid key or null.
    match unsafe { k.as_ref() } {
        Some(k) => new_flow_slot(k, new_flow_mask()),
        None => u32::MAX,
    }
}

/// Whether two flow keys are equal, as ten word compares (a derived `==` compares byte by
/// byte).
#[inline(always)]
fn same_flow(a: &FlowKey, b: &FlowKey) -> bool {
    let (x, y) = (flow_words(a), flow_words(b));
    let mut diff = 0;
    let mut i = 0;
    while i < 10 {
        diff |= x[i] ^ y[i];
        i += 1;
    }
    diff == 0
}

/// Whether a flow is live: seen within [`FLOW_IDLE_NS`], or, once user space ended it, within
/// the loader's [`ended_idle_ns`].
///
/// A `last_seen_ns` *after* `now` is live: another CPU wrote it with a clock it read after
/// this packet read `now` (the kernel's lookup lies between them). As a wrapped difference it
/// read as 2^64 ns old, so an ended flow's mark, refreshed by our side's packets on the other
/// CPU, looked lapsed to the peer's packet, which then passed as a reply of the connection our
/// side started again (and its verdict was cached for up to a second): `tests/protection.rs`,
/// `an_ended_connection_stays_ended_whichever_side_sends_on_both_backends`, failed so in
/// about half its runs on bpf reading the kernel's table.
#[inline(always)]
pub(crate) fn fresh(st: &FlowState, now: u64) -> bool {
    let idle = if st.ended != 0 {
        ended_idle_ns()
    } else {
        FLOW_IDLE_NS
    };
    now.saturating_sub(st.last_seen_ns) < idle
}

/// A packet of an ended flow, either way: `invalid`, and the flow stays ended as long as
/// either side keeps sending (its time and `FLOW_SEEN` entry refreshed, as an accept's commit
/// would: otherwise the mark lapsed a fixed time after the end and the next packet of our
/// side started the flow again, the peer's then passing as its replies).
#[inline(always)]
fn hold_ended(st: *mut FlowState, k: &FlowKey, now: u64) -> u32 {
    // SAFETY: pointer from a successful lookup.
    unsafe { (*st).last_seen_ns = now };
    note_seen(k, now);
    ct::INVALID
}

/// Bit of [`ct_state`]'s result: an accept changes nothing worth writing (the flow's timestamp
/// is less than [`FLOW_REFRESH_NS`] old and its replied flag already right), so the commit's
/// lookup and write are skipped. The state itself is the low byte.
pub(crate) const CT_NO_WRITE: u32 = 1 << 16;

/// Bit of [`ct_state`]'s result: the flow is live in neither table, in neither direction (its
/// `FLOW_SEEN` entry idle, or the lookups found nothing live): [`ct_commit`] of its first
/// accept inserts it without looking again. Expired entries of it may remain; [`lookup`] and
/// [`ct_commit`] pass over them.
pub(crate) const CT_UNKNOWN: u32 = 1 << 17;

/// Bit of [`ct_state`]'s result: the kernel's table holds the flow (`kernel_ct.rs`); the
/// commit of an accept only keeps the verdict caches right.
pub(crate) const CT_KERNEL: u32 = 1 << 18;

/// Bit of [`ct_state`]'s result, with [`CT_KERNEL`]: the packet is the first reply the
/// kernel sees for its connection (the original direction's cached verdict, of a `new`
/// flow, goes stale with it).
pub(crate) const CT_FIRST_REPLY: u32 = 1 << 19;

/// Bit of [`kernel_state`]'s result, with [`CT_KERNEL`]: the kernel's table was not asked; the
/// state (low byte) is [`ct::OPEN_EITHER`], one of new, established and related, unknown
/// which. The caller's classification holds only where no chain's decision depends on which
/// (`classify.rs`, `Scratch::ambiguous`); else it asks the kernel and classifies again.
pub(crate) const CT_OPEN_EITHER: u32 = 1 << 20;

/// Timestamps are refreshed at most this often: idle expiry is off by at most this much.
pub(crate) const FLOW_REFRESH_NS: u64 = 1_000_000_000;

#[inline(always)]
fn unchanged(st: &FlowState, now: u64) -> u32 {
    if now.wrapping_sub(st.last_seen_ns) < FLOW_REFRESH_NS {
        CT_NO_WRITE
    } else {
        0
    }
}

/// Conntrack state of the packet (low byte), with [`CT_NO_WRITE`] when accepting it needs no
/// conntrack write. `seen_on`: the `FLOW_SEEN` shortcut is on; `seen`: what the known-flow path
/// found of the packet's entry (`Work::seen`: idle, live, or 0 where it did not read it; an
/// IPv4 TCP or UDP packet, whose key it read).
#[inline(never)]
pub(crate) fn ct_state<S: Source + CtLookup>(
    s: &S,
    l3: usize,
    p: &Pkt,
    seen_on: bool,
    seen: u32,
) -> u32 {
    if p.proto == IPPROTO_TCP && p.has_ports && !tcp_flags_valid(p.tcp_flags) {
        return ct::INVALID;
    }
    // The known-flow path read this TCP or UDP packet's FLOW_SEEN entry and found it idle:
    // new, as below, without even a clock read (the first packet of a flood's every flow).
    if seen_on && seen == SEEN_IDLE {
        return new_or_invalid(p, false, ct::NEW | CT_UNKNOWN);
    }
    // SAFETY: no arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let is_icmp = p.proto == IPPROTO_ICMP || p.proto == IPPROTO_ICMPV6;
    if is_icmp && icmp_is_error(p) {
        // Quoted packet: its flow, seen from the quoting side, is the reverse.
        let q = l3 + p.l4 as usize + 8;
        let Some(ip) = WORK.get_ptr_mut(0) else {
            return ct::INVALID;
        };
        // SAFETY: per-CPU slot of a successful lookup; `inner` is not the packet `p` points at.
        let inner = unsafe { &mut (*ip).inner };
        let fam = if p.family == family::V4 {
            ETH_P_IP
        } else {
            ETH_P_IPV6
        };
        if !matches!(parse(s, q, fam, inner), Parse::Ok) {
            return ct::INVALID;
        }
        // Where the kernel tracks the quoted flow, its table says whether it is known (an
        // ended flow is not: user space deleted it there).
        if kernel_ct_on() && kernel_tracks(inner) {
            let found = crate::kernel_ct::lookup(s, inner, ip, false) != Kernel::Missing;
            return if found { ct::RELATED } else { ct::INVALID };
        }
        let k = flow_key(inner);
        // SAFETY: pointers from successful lookups.
        let live = |st: *mut FlowState| unsafe { fresh(&*st, now) && (*st).ended == 0 };
        let known =
            lookup(&k, now).is_some_and(live) || lookup(&reverse(&k), now).is_some_and(live);
        return if known { ct::RELATED } else { ct::INVALID };
    }
    if is_icmp && !icmp_keyed(p) {
        return if icmp_is_reply(p) {
            ct::INVALID
        } else {
            ct::NEW
        };
    }
    let k = flow_key(p);
    // No flow of this entry is live: new, as if both tables had been looked up and missed.
    // Expired entries of the flow (either direction) may remain in them: lookups and commits
    // pass over those (`lookup`, `ct_commit`), so its commit inserts it without looking. Not
    // read again where the known-flow path just found the entry live.
    if seen_on && seen != SEEN_LIVE && seen_idle(&k, now) {
        return new_or_invalid(p, is_icmp, ct::NEW | CT_UNKNOWN);
    }
    let mut seen = false;
    if let Some(ptr) = lookup(&k, now) {
        seen = true;
        // SAFETY: pointer from a successful lookup.
        let st = unsafe { &*ptr };
        if fresh(st, now) {
            if st.ended != 0 {
                return hold_ended(ptr, &k, now);
            }
            let state = if st.replied != 0 {
                ct::ESTABLISHED
            } else {
                ct::NEW
            };
            return state | unchanged(st, now);
        }
    }
    if let Some(ptr) = lookup(&reverse(&k), now) {
        seen = true;
        // SAFETY: pointer from a successful lookup.
        let st = unsafe { &*ptr };
        if fresh(st, now) {
            if st.ended != 0 {
                return hold_ended(ptr, &k, now);
            }
            // A reply: the commit marks the flow replied, unless it already is.
            let same = if st.replied != 0 {
                unchanged(st, now)
            } else {
                0
            };
            return ct::ESTABLISHED | same;
        }
    }
    new_or_invalid(
        p,
        is_icmp,
        if seen { ct::NEW } else { ct::NEW | CT_UNKNOWN },
    )
}

/// The state of a TCP or UDP packet from the kernel's table (`kernel_ct.rs`), after the ended
/// marks user space set.
/// The program entries call it instead of [`ct_state`] where [`kernel_tracks`] the packet
/// (one call frame less: the verifier bounds the frames of a call chain together).
///
/// Under the `FLOW_SEEN` shortcut (`seen_on`), a packet whose entry is idle is new without
/// asking the kernel (`seen`: the known-flow path already found it idle, [`SEEN_IDLE`]), while the
/// agent's sweep vouches for the kernel's table (`CT_SWEPT`): every accept of this datapath
/// stamps its flow's entry ([`kernel_commit`]), and the sweep stamped the entry of every
/// connection the kernel's table held (`agent/backend/bpf/src/sweep.rs`), so an idle entry
/// covers no connection either table holds. A denied flood then costs no lookup in the
/// kernel's table (a cold miss in a large hash table, per packet, before the sweep).
///
/// Every step of the packet and its commit takes the coarse clock (`ttl::coarse_ns`, read at
/// most once per packet: the known-flow path's reading where it made one, and the second call
/// for a packet classified under `OPEN_EITHER` takes the first's), never the precise one: its
/// read was the clock source's (`read_tsc`), 4 to 6% of a flood's time in the program in a VM
/// (`cargo xtask profile`). The vouch and the entries are checked against the same reading,
/// which is sound whatever the reading: an entry the sweep stamped at `t` is idle only after
/// `t + FLOW_IDLE_NS` plus two units, which is past when its vouch ends, so no reading finds
/// both. A stamp the commit writes from the coarse clock is at most a tick older than the
/// precise one: its entry goes idle a tick earlier, against the two units' (two seconds')
/// margin of [`peerwall_common::flow_seen_idle`] and the sweep's re-stamping every two
/// minutes. Only the ended marks, written with the precise clock, are read with it
/// ([`ended_mark`]).
///
/// Unless the known-flow path found the entry idle, a packet that can open a connection (a
/// TCP SYN, any UDP packet) is in one of three states in the kernel's table: new (no entry,
/// or one without a reply), established, or related (an expected connection); `invalid` only
/// by a mark of this datapath, checked here. With `open_either`, such a packet is not looked
/// up but given [`ct::OPEN_EITHER`] ([`CT_OPEN_EITHER`]): the lookup is a cold miss in the
/// kernel's large hash for a flood of new flows (two thirds of such a packet's time in the
/// program, `cargo xtask bench-gateway`), and the chains most often decide such a packet by a
/// rule that does not test the state (a NetworkPolicy's allow), which then holds for all
/// three.
///
/// Inlined into its callers (the tc entry's global `kernel_state_tc`, which the second pass of
/// `open_either.rs` calls too, and the XDP entry): the verifier walks a static function at
/// each call anyway, and a call less per packet saves a return through the kernel's return
/// thunk.
#[inline(always)]
pub(crate) fn kernel_state<C: CtLookup>(
    ctx: &C,
    p: &Pkt,
    seen_on: bool,
    seen: u32,
    open_either: bool,
) -> u32 {
    let Some(w) = WORK.get_ptr_mut(0) else {
        return ct::INVALID;
    };
    if p.proto == IPPROTO_TCP && !tcp_flags_valid(p.tcp_flags) {
        return ct::INVALID;
    }
    let unknown = ct::NEW | CT_UNKNOWN | CT_KERNEL;
    if seen_on && seen == SEEN_IDLE && kernel_swept(crate::ttl::coarse_ns()) {
        return new_or_invalid(p, false, unknown);
    }
    // Once per packet, shared with the known-flow path and the second call after a
    // classification under `OPEN_EITHER` (`open_either.rs`).
    let now = crate::ttl::coarse_ns();
    // Before the flow's stamps are read: a packet that opens a connection either way is
    // classified for new, established and related at once, which holds for a flow no table
    // knows (new) as for one the stamps would call live. Read first, the stamp was a cold
    // line per packet of a flood of new flows (a sixth of an allowed flood's time in the
    // program, `cargo xtask profile`), and answered nothing the classification needs.
    if open_either && opens_either_way(p) {
        if ended_mark(p, seen_on, now) {
            return ct::INVALID;
        }
        return ct::OPEN_EITHER | CT_KERNEL | CT_OPEN_EITHER;
    }
    // Not where the known-flow path just found the entry live ([`SEEN_LIVE`]): its stamps
    // would be read again to find what a tick's difference in the clocks can hardly change.
    if seen_on && seen == 0 && unknown_to_both(p, now) {
        return new_or_invalid(p, false, unknown);
    }
    let found = crate::kernel_ct::lookup(ctx, p, w, true);
    if ended_mark(p, seen_on, now) {
        return ct::INVALID;
    }
    match found {
        Kernel::Missing => new_or_invalid(p, false, unknown),
        Kernel::Reply { replied: false } => ct::ESTABLISHED | CT_KERNEL | CT_FIRST_REPLY,
        f => found_state(f) | CT_KERNEL,
    }
}

/// [`kernel_state`]'s first answer, where it is `new` (`Some`), without its call: a packet
/// that opens a connection (any UDP packet, a TCP SYN with valid flags) of a flow the
/// known-flow path found idle (`seen`, [`SEEN_IDLE`]) while the agent's sweep vouches. The tc
/// entry asks this first: under a flood of new flows it is every packet, and the call it
/// saves returns through the kernel's return thunk. `None`: ask [`kernel_state`].
#[inline(always)]
pub(crate) fn idle_and_new(p: &Pkt, seen_on: bool, seen: u32) -> Option<u32> {
    let opens = p.proto == IPPROTO_UDP
        || (p.proto == IPPROTO_TCP
            && p.has_ports
            && tcp_flags_valid(p.tcp_flags)
            && tcp_opens(p.tcp_flags));
    if seen_on && seen == SEEN_IDLE && opens && kernel_swept(crate::ttl::coarse_ns()) {
        Some(ct::NEW | CT_UNKNOWN | CT_KERNEL)
    } else {
        None
    }
}

/// Whether `p` (TCP or UDP, valid flags) is new wherever the kernel's table has no entry for
/// it: a UDP packet, a TCP SYN (`new_or_invalid` gives it `new`); its state is then one of
/// new, established and related, whatever the table holds.
#[inline(always)]
fn opens_either_way(p: &Pkt) -> bool {
    p.proto == IPPROTO_UDP || (p.proto == IPPROTO_TCP && tcp_opens(p.tcp_flags))
}

/// Whether neither this datapath nor the kernel's table can hold `p`'s connection: the sweep
/// vouches for the kernel's table and the flow's `FLOW_SEEN` entry is idle. Not inlined: the
/// flow key's words stay off the frame that calls the kernel's lookup (the verifier bounds a
/// call chain's frames together).
#[inline(never)]
fn unknown_to_both(p: &Pkt, now: u64) -> bool {
    kernel_swept(now) && seen_idle(&flow_key(p), now)
}

/// Whether user space ended the flow of `p` (either direction) and the mark is live: then the
/// packet holds it (`hold_ended`). Only `FLOWS` holds marks where the kernel tracks the flow. Two
/// checks spare its lookups: past `ENDED_UNTIL` no mark is live at all (nothing was ended
/// lately: the case of every packet between policy changes), and the flow's `FLOW_SEEN`
/// entry, when idle, says it has none (marking a flow ended stamps it; no sweep is needed
/// for that: the marks are this datapath's own). The flow key is built only past the first.
///
/// `coarse`: the packet's coarse clock, which is never ahead of the precise one that
/// `ENDED_UNTIL` is written with: the first check passes wherever the precise clock would pass
/// it. Past it (only while a flow user space ended may be held: rare), the marks are read and
/// refreshed with the precise clock, read here, as every other writer of a mark's time does:
/// a mark lapses `ended_idle_ns` after its flow's last packet, not up to a tick sooner.
#[inline(never)]
fn ended_mark(p: &Pkt, seen_on: bool, coarse: u64) -> bool {
    if !ENDED_UNTIL.get(0).is_some_and(|until| *until > coarse) {
        return false;
    }
    // SAFETY: no arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let k = &flow_key(p);
    if seen_on && seen_idle(k, now) {
        return false;
    }
    let held = |st: *mut FlowState| {
        // SAFETY: pointer from a successful lookup.
        let live = unsafe { (*st).ended != 0 && fresh(&*st, now) };
        if live {
            hold_ended(st, k, now);
            marks_live_past(now.wrapping_add(ended_idle_ns()));
        }
        live
    };
    if FLOWS.get_ptr_mut(k).is_some_and(held) {
        return true;
    }
    FLOWS.get_ptr_mut(&reverse(k)).is_some_and(held)
}

/// A mark a packet just held lives until `until` at least: `ENDED_UNTIL` moves on to it (a
/// write only when it grows, as each packet of an ended flow refreshes its mark).
#[inline(never)]
fn marks_live_past(until: u64) {
    if let Some(u) = ENDED_UNTIL.get_ptr_mut(0) {
        // SAFETY: pointer from a successful lookup; another CPU's racing write is of a time
        // as late, give or take the moment between their clock reads (its packet held a
        // mark too, and the next packet of either moves it on again).
        unsafe {
            if *u < until {
                *u = until;
            }
        }
    }
}

/// The commit of an accepted packet the kernel's table tracks: its `FLOW_SEEN` entry (the
/// known-flow path looks a live flow's verdict up), the cached verdicts of the other
/// direction stale once our side opened the flow, the original direction's once the first
/// reply came (where the state was not looked up, [`CT_OPEN_EITHER`], the packet may be
/// either: the other direction's verdicts go stale). Called instead of [`ct_commit`], for
/// `WORK`'s packet: no argument lives in the caller's frame across the call (the verifier
/// bounds a call chain's frames together). A global function: the verifier checks it once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kernel_commit() -> u32 {
    let Some(w) = WORK.get(0) else {
        return 0;
    };
    // The coarse clock, as `kernel_state` read it for this packet (its doc: why not the
    // precise one).
    let now = crate::ttl::coarse_ns();
    let k = flow_key(&w.p);
    note_seen(&k, now);
    if (w.r.state == ct::NEW && w.r.unknown) || w.r.open_either {
        outdate(&reverse(&k));
    } else if w.r.first_reply {
        forget(&reverse(&k));
    }
    0
}

/// A packet of no live flow: `new` (the state with its bits), unless it cannot start one: a
/// TCP segment other than a SYN is never picked up mid-stream (an ended flow's segment, once
/// its mark lapsed, would otherwise start it again in our direction, and the peer's segments
/// would pass as its replies). A call of its own: inlined, it pushed the XDP entry's call
/// chain past the verifier's 512 bytes of frames ("combined stack size of 3 calls is 528").
#[inline(never)]
fn new_or_invalid(p: &Pkt, is_icmp: bool, new: u32) -> u32 {
    if p.proto == IPPROTO_TCP && p.has_ports && !tcp_opens(p.tcp_flags) {
        return ct::INVALID;
    }
    if is_icmp && icmp_is_reply(p) {
        return ct::INVALID;
    }
    if p.proto == IPPROTO_SCTP && p.has_ports && !sctp_chunk_opens(p.sctp_chunk) {
        return ct::INVALID;
    }
    new
}

/// After an accept: create the flow (new, in `FLOWS_NEW`), refresh it, or note its first
/// reply (established: the flow moves to `FLOWS`). `unknown`: [`ct_state`] found the flow
/// live nowhere ([`CT_UNKNOWN`]), so there is nothing to look up again. For `WORK`'s packet;
/// a global function: the verifier checks it once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn ct_commit(state: u32, unknown: u32) -> u32 {
    let unknown = unknown != 0;
    let Some(w) = WORK.get(0) else {
        return 0;
    };
    let p = &w.p;
    // SAFETY: no arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let is_icmp = p.proto == IPPROTO_ICMP || p.proto == IPPROTO_ICMPV6;
    if state == ct::INVALID || state == ct::RELATED || (is_icmp && !icmp_keyed(p)) {
        return 0;
    }
    let k = flow_key(p);
    if unknown && state == ct::NEW {
        insert_new(&k, now);
        return 0;
    }
    // The packet's own direction, established or not.
    if let Some(st) = FLOWS.get_ptr_mut(&k) {
        // SAFETY: pointer from a successful lookup.
        if fresh(unsafe { &*st }, now) {
            // SAFETY: as above.
            unsafe { (*st).last_seen_ns = now };
            note_seen(&k, now);
            return 0;
        }
        // An expired flow starts over, not replied yet.
        let _ = FLOWS.remove(&k);
    }
    if let Some(s) = new_slot(&k) {
        // SAFETY: pointer from a successful lookup.
        if fresh(unsafe { &(*s).state }, now) {
            // SAFETY: as above.
            unsafe { (*s).state.last_seen_ns = now };
            note_seen(&k, now);
            return 0;
        }
        // Expired: a new packet takes the slot again below; a reply goes on to the flow it
        // answers (refreshing this one would leave that flow unreplied).
    }
    let r = reverse(&k);
    if let Some(st) = FLOWS.get_ptr_mut(&r) {
        // SAFETY: pointer from a successful lookup.
        if fresh(unsafe { &*st }, now) {
            // SAFETY: as above.
            unsafe { (*st).last_seen_ns = now };
            note_seen(&k, now);
            return 0;
        }
        // An expired flow of the other direction: this packet starts a new one.
        let _ = FLOWS.remove(&r);
    }
    if let Some(s) = new_slot(&r) {
        // SAFETY: pointer from a successful lookup; the slot is emptied (the flow moves):
        // `NewFlowSlot::EMPTY`, all zero, a word at a time (`mem.rs`).
        let st = unsafe {
            let st = (*s).state;
            zero(s);
            st
        };
        if fresh(&st, now) {
            // The first reply: the flow is established and moves to the table a flood of
            // new flows cannot evict from.
            let _ = FLOWS.insert(
                &r,
                &FlowState {
                    last_seen_ns: now,
                    replied: 1,
                    ..st
                },
                0,
            );
            note_seen(&k, now);
            // The original direction is established from now on.
            forget(&r);
            return 0;
        }
    }
    if state == ct::NEW {
        insert_new(&k, now);
    }
    0
}

/// A new flow, not replied yet: into `FLOWS_NEW`; packets of the other direction are replies
/// from now on, so their cached verdicts are made stale, after the insert: a classification
/// that reads the new generation then also finds the flow (the other order let a reply
/// classified in between cache its old state under the new generation).
/// The flow takes its slot of `FLOWS_NEW` whatever was there (`NewFlowSlot`: a flood forgets
/// unanswered flows, as an LRU would).
#[inline(always)]
fn insert_new(k: &FlowKey, now: u64) {
    // The entry first: a packet of the other direction that reads it after the flow is in
    // its slot then looks the flow up.
    note_seen(k, now);
    if let Some(s) = FLOWS_NEW.get_ptr_mut(new_slot_index(k)) {
        // SAFETY: pointer from a successful lookup; a racing write of another CPU to the same
        // slot can leave a mix of two keys, which matches no flow (a miss, as an eviction).
        // Zeroed a word at a time, then the key and the time (`mem.rs`: a whole new slot
        // written as a struct costs a byte-wise `memset` of its 64 bytes).
        unsafe {
            zero(s);
            (*s).key = *k;
            (*s).state.last_seen_ns = now;
        }
    }
    outdate(&reverse(k));
}
