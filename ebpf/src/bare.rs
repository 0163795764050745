//! Benchmark baselines, never attached by the agent: what no tc datapath can beat. A program
//! that does nothing, one exact-match hash lookup, and one LPM lookup, each on the IPv4
//! destination of an Ethernet frame; `cargo xtask bench` runs them next to the classifier with
//! BPF_PROG_TEST_RUN and `cargo xtask bench-gateway` attaches the first two with tcx on the
//! benchmark gateway's path.

use aya_ebpf::bindings::{TC_ACT_OK, TC_ACT_SHOT};
use aya_ebpf::macros::{classifier, map};
use aya_ebpf::maps::lpm_trie::Key;
use aya_ebpf::maps::{HashMap, LpmTrie};
use aya_ebpf::programs::TcContext;

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
