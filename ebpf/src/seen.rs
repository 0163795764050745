//! `FLOW_SEEN`: when a flow (either direction) was last written, per hash of the flow
//! ([`peerwall_common::flow_seen_slot`]), and when any flow between its two addresses was
//! ([`peerwall_common::flow_seen_pair_slot_of_words`], the map's last lines). Conntrack writes
//! both stamps with every `last_seen_ns` (`conntrack.rs`); a packet whose pair stamp or flow
//! stamp is idle belongs to no live flow, so conntrack and the known-flow path (`cache.rs`)
//! skip their lookups for it, under [`peerwall_common::flags::FLOW_SEEN`]. The pair stamp is
//! read first: it lies in 16 KiB that stay in the CPU's cache, the flow stamps in 256 KiB
//! that a flood of new flows reads one cold line of per packet.

use peerwall_common::{
    family, flow_seen_idle, flow_seen_pair_slot_of_words, flow_seen_slot_of_words, flow_seen_stamp,
    flow_words, seen_line_of, FlowKey, FLOW_SEEN_LANES, FLOW_SEEN_SLOTS,
};

use crate::maps::{seen_horizon_ns, CT_SWEPT, FLOW_SEEN};

/// Note that flow `k` (either direction) was written at `now`, in its flow stamp and its pair
/// stamp: with every `last_seen_ns`.
/// Not inlined: the hash's words would add to each caller's stack frame. A global function
///: the verifier checks it once, not at each of conntrack's calls; `k` is never
/// null (the verifier requires the test of a global function's pointer argument).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn note_seen(k: *const FlowKey, now: u64) -> u32 {
    // SAFETY: a valid key or null.
    let Some(k) = (unsafe { k.as_ref() }) else {
        return 0;
    };
    let words = flow_words(k);
    let stamp = flow_seen_stamp(now);
    for slot in [
        flow_seen_slot_of_words(&words, FLOW_SEEN_SLOTS - 1),
        flow_seen_pair_slot_of_words(&words),
    ] {
        if let Some(s) = stamp_at(slot) {
            // SAFETY: a lane of an entry of a successful lookup; a racing CPU writes a time as
            // recent.
            unsafe { *s = stamp };
        }
    }
    0
}

/// The stamp of slot `slot`, in place: its entry's lane ([`seen_line_of`]).
#[inline(always)]
fn stamp_at(slot: u32) -> Option<*mut u16> {
    let (line, lane) = seen_line_of(slot);
    let l = FLOW_SEEN.get_ptr_mut(line)?;
    // SAFETY: `lane` < FLOW_SEEN_LANES (masked again for the verifier), within the entry.
    Some(unsafe {
        (&raw mut (*l).stamps)
            .cast::<u16>()
            .add(lane & (FLOW_SEEN_LANES as usize - 1))
    })
}

/// Whether no flow with `k`'s `FLOW_SEEN` entry (either direction) can still be live.
#[inline(always)]
pub(crate) fn seen_idle(k: &FlowKey, now: u64) -> bool {
    no_live_flow(&flow_words(k), now)
}

/// [`seen_idle`] of a key given as its words ([`peerwall_common::flow_words`]): its pair stamp
/// idle (no flow between its addresses is live), or else its own.
#[inline(always)]
fn no_live_flow(words: &[u32; 10], now: u64) -> bool {
    let horizon = seen_horizon_ns();
    pair_idle(words, now, horizon) || own_idle(words, now, horizon)
}

/// Whether the pair stamp of the key whose words are `words` is idle: no flow between its two
/// addresses is live. A lane of 16 KiB that stay in the CPU's cache.
#[inline(always)]
fn pair_idle(words: &[u32; 10], now: u64, horizon: u64) -> bool {
    stamp_idle(flow_seen_pair_slot_of_words(words), now, horizon)
}

/// Whether the flow stamp of the key whose words are `words` is idle. A lane of 256 KiB, of
/// which a flood of new flows reads a cold line per packet.
#[inline(always)]
fn own_idle(words: &[u32; 10], now: u64, horizon: u64) -> bool {
    stamp_idle(
        flow_seen_slot_of_words(words, FLOW_SEEN_SLOTS - 1),
        now,
        horizon,
    )
}

/// Whether the stamp of `slot` is idle at `now`, given the entries' `horizon`
/// ([`seen_horizon_ns`]); not when it cannot be read.
#[inline(always)]
fn stamp_idle(slot: u32, now: u64, horizon: u64) -> bool {
    match stamp_at(slot) {
        // SAFETY: a lane of an entry of a successful lookup.
        Some(s) => flow_seen_idle(unsafe { *s }, now, horizon),
        None => false,
    }
}

/// The words ([`peerwall_common::flow_words`]) of an IPv4 flow given as the known-flow path's
/// key words (source, destination, the ports as in the headers, then the protocol in the low
/// byte).
#[inline(always)]
fn words_v4(k: [u32; 4]) -> [u32; 10] {
    let proto = k[3].to_ne_bytes()[0];
    [
        k[0],
        0,
        0,
        0,
        k[1],
        0,
        0,
        0,
        k[2],
        u32::from_ne_bytes([proto, family::V4, 0, 0]),
    ]
}

/// Whether no flow between the two addresses of an IPv4 flow given as the known-flow path's
/// key words is live (its pair stamp idle: the flow's own is then idle too).
#[inline(always)]
pub(crate) fn pair_idle_v4(k: [u32; 4], now: u64) -> bool {
    pair_idle(&words_v4(k), now, seen_horizon_ns())
}

/// Whether the flow stamp of an IPv4 flow given as the known-flow path's key words is idle.
#[inline(always)]
pub(crate) fn own_idle_v4(k: [u32; 4], now: u64) -> bool {
    own_idle(&words_v4(k), now, seen_horizon_ns())
}

/// Whether the agent's last sweep still vouches, at `now`, that every connection of the
/// kernel's table has its `FLOW_SEEN` entry stamped (`CT_SWEPT`).
#[inline(always)]
pub(crate) fn kernel_swept(now: u64) -> bool {
    CT_SWEPT.get(0).is_some_and(|until| *until > now)
}

/// The emergency switch is on: connections start without any stamp, so the sweep's vouch
/// lapses now (the agent sweeps again once the switch is off). Not inlined: a leaf the
/// switch's path alone calls (inlined, it changed how the compiler laid out the entry's
/// frames past the verifier's bound on a call chain's stack).
#[inline(never)]
pub(crate) fn void_sweep() {
    if let Some(until) = CT_SWEPT.get_ptr_mut(0) {
        // SAFETY: pointer from a successful lookup; written only when set (a flood under the
        // switch reads it).
        unsafe {
            if *until != 0 {
                *until = 0;
            }
        }
    }
}
