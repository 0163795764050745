//! The pair-drop cache: per CPU, the drops the chains decided for a new IPv4 connection by
//! its addresses, protocol and input interface alone, whatever its ports. eBPF twin:
//! `ebpf/src/cache/pair.rs`.
//!
//! A flood of new flows towards an address no rule accepts changes its ports with every
//! packet, so the per-flow verdict cache never serves it: each packet was classified in full.
//! When every chain on the packet's path decided it before its ports were tested (the bitmap
//! emptied at the addresses, the interface or the state: the chain's policy decides then,
//! whatever the ports), the drop holds for every packet of the same two addresses, protocol
//! and input interface that opens a connection (a UDP packet, a TCP SYN) while no flow
//! between the two addresses is live (its `FLOW_SEEN` pair stamp idle: such a packet is
//! `new`, `ebpf/src/conntrack.rs`) and the local-address mirror gives its destination the
//! same path. Such a packet is then dropped from this table before it is parsed.

use crate::cache::CACHED_COUNTERS;

/// log2 of [`PAIR_DROP_SETS`].
pub const PAIR_DROP_SET_BITS: u32 = 11;

/// Sets of the pair-drop cache per CPU (`PAIR_DROPS`, a region of this many per possible
/// CPU): 2048 two-way sets, 128 KiB a CPU. A flood towards 1024 denied destinations from one
/// source (`cargo xtask bench-gateway`) puts half a pair in a set on average.
pub const PAIR_DROP_SETS: u32 = 1 << PAIR_DROP_SET_BITS;

/// Ways of a [`PairDrops`] set.
pub const PAIR_DROP_WAYS: usize = 2;

/// One cached pair drop: an IPv4 source and destination and the protocol, and what the drop
/// counts and under which policy, interface, path and time it holds. 32 bytes, no padding
/// but `_pad`; an all-zero way (protocol 0) is never served.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairDrop {
    /// Source address, BE (as in the packet).
    pub src: [u8; 4],
    /// Destination address, BE.
    pub dst: [u8; 4],
    /// [`crate::Config::active`] the drop was decided under.
    pub epoch: u32,
    /// Input ifindex of the packet it was decided for.
    pub ifindex: u32,
    /// `bpf_jiffies64` (low 32 bits) until which it is served: when it was decided plus one
    /// second's worth at most, as a cached verdict's lifetime (compared wrapping).
    pub until: u32,
    /// `COUNTERS` indices of the chain decisions on the path, as
    /// [`crate::CachedVerdict::counters`].
    pub counters: [u16; CACHED_COUNTERS],
    /// IP protocol (TCP or UDP).
    pub proto: u8,
    /// How many of `counters` are used.
    pub counted: u8,
    /// The path the local-address mirror gave the packet: 0 delivered to the gateway, 1
    /// forwarded (the datapath's `PATH_INPUT`, `PATH_FORWARD`).
    pub path: u8,
    /// Zero.
    pub _pad: u8,
}

/// `PAIR_DROPS[cpu * PAIR_DROP_SETS + pair_set(src, dst, proto)]`: one two-way set of this
/// CPU's pair drops, 64 bytes (one cache line where the map's values start page-aligned,
/// `BPF_F_MMAPABLE`). Only that CPU's packets read and write it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairDrops {
    /// The ways.
    pub ways: [PairDrop; PAIR_DROP_WAYS],
}

/// The set of the pair-drop cache an IPv4 pair falls in: source and destination as the
/// native-endian words the datapath reads from the packet, and the protocol. A multiplicative
/// hash, as [`crate::verdict_set`]; not keyed: a sender can crowd a set with pairs of its own,
/// which costs its packets the full classification, never a wrong verdict.
#[inline(always)]
pub fn pair_set(src: u32, dst: u32, proto: u8) -> u32 {
    let x = src ^ dst.rotate_left(16) ^ u32::from(proto);
    x.wrapping_mul(0x9e37_79b1) >> (32 - PAIR_DROP_SET_BITS)
}
