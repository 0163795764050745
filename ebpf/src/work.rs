//! The per-packet working state the parts of the datapath hand each other, kept in the
//! per-CPU `WORK` map (`maps.rs`): the parsed packet, its route, what the verdict cache and
//! conntrack found, the kernel conntrack lookup's arguments. Kernel-only: user space never
//! reads it.

use crate::parse::Pkt;

/// Everything known about the packet under classification (`WORK`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Work {
    pub(crate) p: Pkt,
    /// The packet quoted by an ICMP error.
    pub(crate) inner: Pkt,
    pub(crate) r: Route,
    /// Set by `known_flow_v4` when it looked this packet's key up and found nothing to serve,
    /// so that the full path does not look it up again; cleared when read.
    pub(crate) looked_up: bool,
    /// Set with `looked_up` to what `known_flow_v4` found of the packet's `FLOW_SEEN` entry:
    /// [`SEEN_IDLE`] (conntrack then knows the flow is new without reading it again),
    /// [`SEEN_LIVE`] (conntrack does not read it again to find it idle), or 0 (the flow's own
    /// stamp not read: the pair stamp was live and the shared level had nothing to serve).
    /// Cleared when read (or when the packet does not parse).
    pub(crate) seen: u32,
    /// Set with `looked_up`: this CPU's verdict-cache set of the packet's key has no way that
    /// holds it or could take it ([`Route::no_room`]).
    pub(crate) no_room: bool,
    /// The coarse clock as read for this packet (`ttl.rs`, [`crate::ttl::coarse_ns`]), 0 until
    /// it is: the known-flow path, the local-address mirror's lease, and on the kernel-table
    /// datapath conntrack's vouch check, its `FLOW_SEEN` reads and its commit's stamps share
    /// one read.
    pub(crate) coarse: u64,
    /// The packet's `VERDICT_GENS` generation, read before its conntrack state is: what
    /// `remember` stamps its verdict with.
    pub(crate) gen: u32,
    /// The kernel conntrack lookup's tuple and options (`kernel_ct.rs`): kfunc arguments
    /// must be memory the verifier can size, and the stack has no room to spare.
    pub(crate) ct_tuple: crate::ct_args::SockTuple,
    pub(crate) ct_opts: crate::ct_args::CtOpts,
    /// The packet's destination on the wire, when `view.rs` rewrote the parsed one
    /// (`viewed`): the kernel's conntrack knows the connection by it.
    pub(crate) wire_dst: [u8; 16],
    pub(crate) viewed: bool,
    /// The query the chain bodies evaluate (`classify.rs`): they are global functions, which
    /// read it here rather than take it as an argument.
    pub(crate) q: Query,
    /// The last lookups of the interface dimensions by a one-word chain body, kept from
    /// packet to packet (`iface_memo.rs`).
    pub(crate) iif_memo: IfMemo,
    pub(crate) oif_memo: IfMemo,
    /// The last `ttl.rs` measurement of a cached verdict's lifetime on this CPU (0 before the
    /// first) and when it was made (jiffies), kept from packet to packet (`ttl_reused`).
    pub(crate) ttl_now: [u32; 2],
}

/// [`Work::seen`]: the known-flow path found the packet's `FLOW_SEEN` entry idle.
pub(crate) const SEEN_IDLE: u32 = 1;
/// [`Work::seen`]: the known-flow path found the packet's `FLOW_SEEN` entry live (by the coarse
/// clock, a tick behind: it may have gone idle since, which only costs the shortcut).
pub(crate) const SEEN_LIVE: u32 = 2;

/// Path of a packet, the interfaces the chains see, and how to evaluate it.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Route {
    /// Policy epoch (`Config::active`); bit 0 is the slot.
    pub(crate) epoch: u32,
    pub(crate) path: u32,
    pub(crate) iif: u32,
    pub(crate) oif: u32,
    pub(crate) state: u32,
    pub(crate) count: bool,
    /// Write conntrack after an accept (off only under the benchmark's diagnostic flags).
    pub(crate) commit: bool,
    /// Cache the verdict (`cache.rs`): off in probe mode and under diagnostic flags.
    pub(crate) cache: bool,
    /// Conntrack knows the flow in neither table nor direction ([`crate::conntrack::CT_UNKNOWN`]):
    /// its commit inserts without looking again, and an accept is not cached (the flow's next
    /// packet, known by then, is): a flood of new flows costs no verdict-cache insert.
    pub(crate) unknown: bool,
    /// The kernel's table saw no reply of the flow before this packet, a reply
    /// ([`crate::conntrack::CT_FIRST_REPLY`]): its commit makes the other direction's cached
    /// verdict stale.
    pub(crate) first_reply: bool,
    /// Every address map looked up, whatever the chains' descriptions skip (the benchmark's
    /// `DIAG_ALL_ADDR_LOOKUPS`).
    pub(crate) all_lookups: bool,
    /// No one-line host table looked up (the benchmark's `DIAG_NO_HOST_LINES`).
    pub(crate) no_lines: bool,
    /// `state` is [`peerwall_common::ct::OPEN_EITHER`]: the kernel's table was not asked
    /// ([`crate::conntrack::CT_OPEN_EITHER`]), and the classification held for every state
    /// the packet can have: its verdict is cached on this CPU alone, and its commit makes the
    /// other direction's cached verdicts stale (it may be a first reply).
    pub(crate) open_either: bool,
    /// The known-flow path found this CPU's set of the packet's wire key full: neither way
    /// holds the key (its tag in neither) nor is free by its hint. A verdict only this CPU's
    /// level would take (`unknown` or `open_either`, IPv4, the packet not rewritten by a view:
    /// the same key) then has nowhere to go, and `finish_tc` does not call `remember`. A way
    /// that frees in between stays empty: the flow's next packet is classified again.
    pub(crate) no_room: bool,
    /// The local-address mirror gave the path (`route.rs`), from the destination alone: a
    /// drop decided whatever the ports may then hold for the pair (`cache/pair.rs`).
    pub(crate) by_mirror: bool,
}

/// Inputs of one chain evaluation besides the packet, which the chain bodies read from `WORK`
/// (`Work::p`) too.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Query {
    /// Count packets in the rule counters (tc always; XDP only for what it drops).
    pub(crate) count: bool,
    /// The policy epoch of the packet ([`Route::epoch`]).
    pub(crate) epoch: u32,
    pub(crate) chain: u32,
    pub(crate) iif: u32,
    pub(crate) oif: u32,
    pub(crate) state: u32,
    /// [`Route::all_lookups`].
    pub(crate) all_lookups: bool,
    /// [`Route::no_lines`].
    pub(crate) no_lines: bool,
}

/// This CPU's last lookup of one interface dimension by a one-word chain body
/// (`iface_memo.rs`): the epoch, chain and interface it was made for and what it found. `WORK`
/// starts zeroed: not valid.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct IfMemo {
    /// 1 once written.
    pub(crate) valid: u32,
    /// The policy epoch the packet was classified under (`Query::epoch`).
    pub(crate) epoch: u32,
    pub(crate) chain: u32,
    pub(crate) ifindex: u32,
    /// 1 when the lookup found a bitmap (the interface's own or the wildcard's); without one
    /// no rule holds.
    pub(crate) found: u32,
    pub(crate) _pad: u32,
    /// The bitmap's first word, all a one-word body reads.
    pub(crate) word: u64,
}
