//! Benchmark baseline: one LPM lookup on the IPv4 destination of an Ethernet frame. Never
//! attached; `cargo xtask bench` runs it next to the classifier with BPF_PROG_TEST_RUN.

#[allow(unused_imports)]
use super::*;

// Benchmark baseline: one LPM lookup on the IPv4 destination of an Ethernet frame. Never
// attached; `cargo xtask bench` runs it next to the classifier with BPF_PROG_TEST_RUN.

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
