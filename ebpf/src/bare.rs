//! Benchmark baselines, never attached by the agent: what no tc datapath can beat. A program
//! that does nothing, one exact-match hash lookup, and one LPM lookup, each on the IPv4
//! destination of an Ethernet frame; `cargo xtask bench` runs them next to the classifier with
//! BPF_PROG_TEST_RUN and `cargo xtask bench-gateway` attaches the first two with tcx on the
//! benchmark gateway's path, and [`peerwall_facts`], one lookup per fact the gateway's
//! protection policy decides a new packet on.

use aya_ebpf::bindings::{TC_ACT_OK, TC_ACT_SHOT};
use aya_ebpf::macros::{classifier, map};
use aya_ebpf::maps::lpm_trie::Key;
use aya_ebpf::maps::{Array, HashMap, LpmTrie};
use aya_ebpf::programs::TcContext;
use peerwall_common::{family, flow_seen_pair_slot_of_words, FLOW_SEEN_PAIRS, FLOW_SEEN_SLOTS};

use crate::maps::TRIE_MAX;

#[map]
pub(crate) static BARE: LpmTrie<[u8; 4], u32> = LpmTrie::with_max_entries(TRIE_MAX, 0);

#[classifier]
pub fn peerwall_bare(ctx: TcContext) -> i32 {
    let Ok(dst) = ctx.load::<[u8; 4]>(14 + 16) else {
        return TC_ACT_SHOT;
    };
    match BARE.get(Key::new(32, dst)) {
        Some(_) => TC_ACT_OK,
        None => TC_ACT_SHOT,
    }
}

#[map]
pub(crate) static BARE_HASH: HashMap<[u8; 4], u32> = HashMap::with_max_entries(1 << 20, 0);

/// Does nothing: the cost of running any tc program at all.
#[classifier]
pub fn peerwall_empty(_ctx: TcContext) -> i32 {
    TC_ACT_OK
}

/// One hash lookup on the destination: the least a classifier that looks at the packet does.
#[classifier]
pub fn peerwall_hash(ctx: TcContext) -> i32 {
    let Ok(dst) = ctx.load::<[u8; 4]>(14 + 16) else {
        return TC_ACT_SHOT;
    };
    // SAFETY: plain data.
    match unsafe { BARE_HASH.get(&dst) } {
        Some(_) => TC_ACT_OK,
        None => TC_ACT_SHOT,
    }
}

/// [`peerwall_facts`]' connection stamps: one per hash of a pair of addresses, as the pair
/// stamps of `FLOW_SEEN` (`seen.rs`); never written, so every packet is of no live flow.
#[map]
pub(crate) static BARE_SEEN: Array<u32> = Array::with_max_entries(FLOW_SEEN_PAIRS, 0);

/// One lookup per fact the gateway's protection policy (`agent/protection/src/gateway.rs`)
/// decides a new IPv4 packet from the tunnel on, each in the cheapest table the datapath has
/// for it, nothing else: whether a flow between its addresses is live (its pair stamp, an
/// array read at a hash of the addresses: a reply or a known flow passes), whether its source
/// is one of the peer's (`BARE`, a trie of the peer's CIDRs: a spoofed source is dropped),
/// whether its destination is an offloaded pod (`BARE_HASH`). What no tc datapath enforcing
/// that policy can beat on a flood of new flows: it reads no ports, no clock, no interface,
/// no path, writes no state and keeps no verdict cache.
#[classifier]
pub fn peerwall_facts(ctx: TcContext) -> i32 {
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + 14 + 20 > end {
        return TC_ACT_OK;
    }
    // SAFETY: within the packet (tested above): the ethertype, then the IPv4 header's fixed
    // part.
    let (ethertype, proto, src, dst) = unsafe {
        let ip = (data + 14) as *const u8;
        (
            core::ptr::read_unaligned((data + 12) as *const [u8; 2]),
            *ip.add(9),
            core::ptr::read_unaligned(ip.add(12) as *const [u8; 4]),
            core::ptr::read_unaligned(ip.add(16) as *const [u8; 4]),
        )
    };
    if ethertype != [0x08, 0x00] {
        return TC_ACT_OK;
    }
    let words = [
        u32::from_ne_bytes(src),
        0,
        0,
        0,
        u32::from_ne_bytes(dst),
        0,
        0,
        0,
        0,
        u32::from_ne_bytes([proto, family::V4, 0, 0]),
    ];
    let pair = flow_seen_pair_slot_of_words(&words) - FLOW_SEEN_SLOTS;
    if BARE_SEEN.get(pair).is_some_and(|s| *s != 0) {
        return TC_ACT_OK;
    }
    if BARE.get(Key::new(32, src)).is_none() {
        return TC_ACT_SHOT;
    }
    // SAFETY: plain data.
    match unsafe { BARE_HASH.get(&dst) } {
        Some(_) => TC_ACT_OK,
        None => TC_ACT_SHOT,
    }
}
