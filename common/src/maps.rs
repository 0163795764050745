//! The maps' shape: their names (pins and eBPF statics), sizes, hook and family indexes,
//! the global configuration and its flags, per-interface data, counters. eBPF twin:
//! `ebpf/src/maps.rs`.

/// Rules per chain (bitmap width 16 × 64).
pub const MAX_RULES: usize = 1024;

/// Words of a rule bitmap.
pub const WORDS: usize = MAX_RULES / 64;

/// Chains in a policy (all tables).
pub const MAX_CHAINS: u32 = 64;
/// Counters per slot unless the loader is told otherwise (`--counter-table-size`): one per rule
/// and one per chain policy. Per CPU: 128 KiB per CPU per slot. Rules past them are not
/// counted (the apply report says so).
pub const COUNTERS_DEFAULT: u32 = 1 << 13;
/// The most counters a policy can have: every chain full.
pub const MAX_COUNTERS: u32 = MAX_CHAINS * MAX_RULES as u32;

/// An `OWNERS` value: the chain and rule counting at an index (`chain << 16 | rule`; the
/// chain's policy as rule `0xffff`).
pub const fn counter_owner(chain: u32, rule: Option<u32>) -> u32 {
    let r = match rule {
        Some(r) => r & 0xffff,
        None => 0xffff,
    };
    (chain << 16) | r
}

/// Hosts each exact-match host map (`SRCH<s>`, `DSTH<s>`) holds unless the loader is told
/// otherwise: the kernel allocates a hash map's buckets up front (16 bytes per host), four
/// maps per datapath, one datapath per gateway.
pub const HOST_TABLE_DEFAULT: u32 = 1 << 16;

/// Entries of the `START` array: a bitmap per slot, chain and family.
pub const START_ENTRIES: u32 = 2 * MAX_CHAINS * 2;

/// Index in `START` of the start bitmap of `chain` for family index `fidx` (0: IPv4, 1: IPv6)
/// in policy slot `slot`.
pub const fn start_index(slot: u32, chain: u32, fidx: u32) -> u32 {
    (slot & 1) * MAX_CHAINS * 2 + chain * 2 + (fidx & 1)
}

/// Filter chains on one hook for one family.
pub const MAX_HOOK_CHAINS: usize = 16;

/// Hooks (prerouting, input, forward, output, postrouting).
pub const HOOKS: u32 = 5;

/// `BPF_F_NO_COMMON_LRU`: an LRU hash whose free and LRU lists are per CPU (each CPU evicts
/// among the entries it inserted, without the shared list's lock). The flags of the verdict
/// caches a flood of new flows may insert into (`VERDICTS4`, `VERDICTS6`); the flows not
/// replied yet (`FLOWS_NEW`) are a direct-mapped array, no LRU at all. The loader drops a pinned
/// cache whose flags differ (pinned by an older peerwall), as it does one whose entries have
/// another size.
pub const NO_COMMON_LRU: u32 = 1 << 1;

/// Map names: the pin names, and the identifiers of the eBPF side's statics (aya names a map
/// after its static, so `ebpf/src/maps.rs` declares `SRC0`, `SRC1`, … with exactly these
/// names). Per-slot maps are the prefix followed by the slot number (`SRC0`, `SRC1`).
pub mod map {
    /// Source address trie (per slot).
    pub const SRC: &str = "SRC";
    /// Destination address trie (per slot).
    pub const DST: &str = "DST";
    /// Source host hash (per slot).
    pub const SRCH: &str = "SRCH";
    /// Destination host hash (per slot).
    pub const DSTH: &str = "DSTH";
    /// The hosts' one-line tables, IPv4, of both address dimensions of both slots
    /// ([`crate::HostLine`], [`crate::host_line_entry`]).
    pub const HOST_LINES: &str = "HOST_LINES";
    /// Source port trie (per slot).
    pub const SPORT: &str = "SPORT";
    /// Destination port trie (per slot).
    pub const DPORT: &str = "DPORT";
    /// Family + protocol hash (per slot).
    pub const PROTO: &str = "PROTO";
    /// Start bitmaps of the chains whose protocol hash holds one bitmap per family, both
    /// slots ([`crate::start_index`]; [`crate::constrained::START_V4`]).
    pub const START: &str = "START";
    /// Input interface hash (per slot).
    pub const IIF: &str = "IIF";
    /// Output interface hash (per slot).
    pub const OIF: &str = "OIF";
    /// Conntrack state array (per slot).
    pub const CT: &str = "CT";
    /// Per-dimension masks (per slot).
    pub const MASKS: &str = "MASKS";
    /// Chain descriptions (per slot).
    pub const CHAINS: &str = "CHAINS";
    /// Rule descriptions (per slot).
    pub const RULES: &str = "RULES";
    /// Chains of each (hook, family) (per slot).
    pub const HOOKS: &str = "HOOKS";
    /// Per-CPU rule counters (per slot).
    pub const COUNTERS: &str = "COUNTERS";
    /// Who counts at each `COUNTERS` index (per slot): [`crate::counter_owner`].
    pub const OWNERS: &str = "OWNERS";
    /// Destination rewrites of prerouting's NAT by input interface (per slot).
    pub const VIEW: &str = "VIEW";
    /// Live slot and flags.
    pub const CONFIG: &str = "CONFIG";
    /// Emergency switch.
    pub const ALLOW_ALL: &str = "ALLOW_ALL";
    /// Interface types (link-layer length) by index.
    pub const IFACES: &str = "IFACES";
    /// Conntrack flows.
    pub const FLOWS: &str = "FLOWS";
    /// Flows not replied yet (conntrack's unassured entries): a flood of new flows evicts
    /// only these, never a flow in [`FLOWS`], which holds the replied ones.
    pub const FLOWS_NEW: &str = "FLOWS_NEW";
    /// When a flow was last written, per [`crate::flow_seen_slot`] (both directions of a flow
    /// share one entry): a packet whose entry is idle longer than flows live is known to no
    /// flow without a lookup in [`FLOWS`] or [`FLOWS_NEW`] ([`crate::flags::FLOW_SEEN`]).
    pub const FLOW_SEEN: &str = "FLOW_SEEN";
    /// `CT_SWEPT[0]`: until when (`bpf_ktime_get_ns`) [`FLOW_SEEN`] also covers every
    /// connection of the kernel's table (the agent's sweep stamped them), so that the
    /// kernel-conntrack mode skips the kernel's lookup for a packet whose entry is idle.
    pub const CT_SWEPT: &str = "CT_SWEPT";
    /// `ENDED_UNTIL[0]`: until when (`bpf_ktime_get_ns`) a flow user space ended may still
    /// hold its mark in [`FLOWS`]: past it, the kernel-conntrack mode looks for no mark.
    /// User space moves it before it writes marks, the datapath with every packet that holds
    /// one.
    pub const ENDED_UNTIL: &str = "ENDED_UNTIL";
    /// Per-flow verdict cache, IPv4 ([`crate::VerdictKey4`] keys).
    pub const VERDICTS4: &str = "VERDICTS4";
    /// Per-flow verdict cache, IPv6 ([`crate::FlowKey`] keys).
    pub const VERDICTS6: &str = "VERDICTS6";
    /// The per-CPU verdict cache in front of `VERDICTS4` ([`crate::CpuVerdicts4`] sets, one
    /// region of [`crate::CPU_VERDICT_SETS`] per CPU). Not pinned: each loaded program has its
    /// own, sized for the machine's CPUs.
    pub const VERDICTS4_CPU: &str = "VERDICTS4_CPU";
    /// The tags of `VERDICTS4_CPU`'s ways ([`crate::CpuVerdictTags`], one entry per
    /// [`crate::CPU_VERDICT_TAG_SETS`] sets). Not pinned, sized as `VERDICTS4_CPU`.
    pub const VERDICTS4_TAGS: &str = "VERDICTS4_TAGS";
    /// The per-CPU pair-drop cache ([`crate::PairDrops`] sets, one region of
    /// [`crate::PAIR_DROP_SETS`] per CPU). Not pinned, sized as `VERDICTS4_CPU`.
    pub const PAIR_DROPS: &str = "PAIR_DROPS";
    /// Per verdict-cache set, until when the shared level may serve a verdict of it
    /// ([`crate::FreshLine`]). Not pinned: a new program's starts empty.
    pub const VERDICTS_FRESH: &str = "VERDICTS_FRESH";
    /// Verdict-cache generations, one per set ([`crate::verdict_set`]): conntrack bumps a
    /// flow's when a commit changes its state, and a cached verdict holds only under the
    /// generation it was computed in.
    pub const VERDICT_GENS: &str = "VERDICT_GENS";
    /// The last decision (probe mode).
    pub const LAST: &str = "LAST";
    /// Drop, reject, would-drop and flow events (ring buffer, [`crate::FlowEvent`]).
    pub const EVENTS: &str = "EVENTS";
    /// Event rate limits ([`crate::EventConfig`]).
    pub const EVENT_CONF: &str = "EVENT_CONF";
    /// Per-flow event state ([`crate::EventFlow`]).
    pub const EVENT_FLOWS: &str = "EVENT_FLOWS";
    /// The gateway's local destinations, mirrored from its local routing table
    /// ([`crate::AddrKeyData`] keys, chain 0; value 1): the packets the kernel delivers to the
    /// gateway itself rather than forwards. Read only when [`ROUTES`] vouches for the mirror.
    pub const LOCAL: &str = "LOCAL";
    /// `ROUTES[0]`: a [`crate::RouteMirror`], set by the agent's route watcher when
    /// the namespace's routing makes the [`LOCAL`] mirror exact (every other destination is
    /// forwarded): the datapath then answers "forwarded or delivered?" from the mirror instead
    /// of a FIB lookup.
    pub const ROUTES: &str = "ROUTES";
    /// The benchmark's bare lookup table.
    pub const BARE: &str = "BARE";
    /// The benchmark's one-hash-lookup table.
    pub const BARE_HASH: &str = "BARE_HASH";
    /// The connection stamps of the benchmark's one-lookup-per-fact limit.
    pub const BARE_SEEN: &str = "BARE_SEEN";
}

/// Entries of the per-slot `HOOKS` map: one per (hook, family), index `hook * 2 + family`.
pub const HOOK_SLOTS: u32 = HOOKS * 2;

/// Hook numbers used in [`crate::HookChains`] indexes: `hook * 2 + family`.
pub mod hook {
    /// prerouting.
    pub const PREROUTING: u32 = 0;
    /// input.
    pub const INPUT: u32 = 1;
    /// forward.
    pub const FORWARD: u32 = 2;
    /// output.
    pub const OUTPUT: u32 = 3;
    /// postrouting.
    pub const POSTROUTING: u32 = 4;
}

/// Address family codes in keys.
pub mod family {
    /// IPv4.
    pub const V4: u8 = 4;
    /// IPv6.
    pub const V6: u8 = 6;
}

/// Packet and byte counts (per CPU). Index in `COUNTERS`: [`crate::ChainInfo::counters`] plus
/// the rule, the policy after the chain's rules; who counts at an index is in `OWNERS`
/// ([`counter_owner`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    /// Packets.
    pub packets: u64,
    /// Bytes (IP length).
    pub bytes: u64,
}

/// Global switches. `CONFIG[0]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// The policy epoch. Bit 0: which copy of the policy maps is live (0 or 1). The loader
    /// adds 1 when it switches slots and 2 after it changes the live slot in place, so every
    /// policy change gives a new value in one aligned 32-bit store: verdicts cached under
    /// another epoch ([`crate::CachedVerdict::epoch`]) are never served.
    pub active: u32,
    /// Bit 0: emergency allow-all (the datapath passes everything). Bit 1: probe mode (the
    /// scratch engine of `peerwall verdict --engine bpf`: path from skb->cb, verdict recorded).
    /// Bits 2-3: which slots have NAT views. See [`flags`].
    pub flags: u32,
}

/// [`Config::flags`] bits.
pub mod flags {
    /// Pass everything.
    pub const ALLOW_ALL: u32 = 1;
    /// Probe mode (scratch engine only).
    pub const PROBE: u32 = 2;
    /// Slot 0 has NAT views (`VIEW0` non-empty); `VIEWS0 << 1` for slot 1.
    pub const VIEWS0: u32 = 1 << 2;
    /// The views bit of `slot`.
    pub const fn views(slot: u32) -> u32 {
        VIEWS0 << (slot & 1)
    }
    /// Report drops, rejects and would-drops as events (`EVENTS` ring buffer).
    pub const EVENTS: u32 = 1 << 4;
    /// Also report accepted new flows (the flow log).
    pub const FLOW_LOG: u32 = 1 << 5;
    /// With [`PROBE`]: probe packets are cached and served from the verdict cache like
    /// traffic, the input interface taken from the control block (tests of the cache only).
    pub const PROBE_CACHE: u32 = 1 << 6;
    /// `FLOW_SEEN` holds an entry for every live flow (the loader set it after stamping the
    /// flows already there, with every attached program one that keeps the entries): a packet
    /// whose entry is idle is a new flow without looking in the flow tables.
    pub const FLOW_SEEN: u32 = 1 << 7;
    /// Benchmark breakdown only (`cargo xtask bench`): these skip one part of the work each,
    /// to measure what it costs. They change verdicts; the agent never sets them.
    /// No FIB lookup: every packet taken as forwarded, output interface unknown.
    pub const DIAG_NO_FIB: u32 = 1 << 8;
    /// No conntrack lookup (every packet new) and no commit.
    pub const DIAG_NO_CT: u32 = 1 << 9;
    /// Conntrack looked up but never written.
    pub const DIAG_NO_CT_COMMIT: u32 = 1 << 10;
    /// No rule counters.
    pub const DIAG_NO_COUNTERS: u32 = 1 << 11;
    /// Parse, route and conntrack only: no chain runs (accept).
    pub const DIAG_NO_CHAINS: u32 = 1 << 12;
    /// No verdict cache: every packet classified as the first of its flow. Any other
    /// diagnostic flag implies it (they measure the parts of a full classification).
    pub const DIAG_NO_CACHE: u32 = 1 << 13;
    /// Some chain of slot 0 tests the output interface (`OIF_TESTED0 << 1` for slot 1): the
    /// datapath needs the FIB's answer for it, and never takes the local-address mirror's
    /// ([`crate::routes`]).
    pub const OIF_TESTED0: u32 = 1 << 14;
    /// The output-interface bit of `slot`.
    pub const fn oif_tested(slot: u32) -> u32 {
        OIF_TESTED0 << (slot & 1)
    }
    /// The FIB answers every packet's path, never the local-address mirror.
    pub const DIAG_NO_MIRROR: u32 = 1 << 16;
    /// The loaded program reads the kernel's connection table for IPv4 TCP and UDP: set by
    /// the loader for `inspect` (the program itself reads its `KERNEL_CT` global).
    pub const KERNEL_CT4: u32 = 1 << 17;
    /// The same for IPv6.
    pub const KERNEL_CT6: u32 = 1 << 18;
    /// Both maps of every address dimension looked up (the host map, then the trie on a
    /// miss), whatever a chain's description says they can answer
    /// ([`crate::constrained::SRC_NO_HOSTS`] and the like): what those skips save.
    pub const DIAG_ALL_ADDR_LOOKUPS: u32 = 1 << 19;
    /// No one-line host table looked up (`crate::lines`): every host lookup asks the host map,
    /// as where the tables are off.
    pub const DIAG_NO_HOST_LINES: u32 = 1 << 20;
    /// Every diagnostic flag.
    pub const DIAG_ALL: u32 = DIAG_ALL_ADDR_LOOKUPS
        | DIAG_NO_HOST_LINES
        | DIAG_NO_MIRROR
        | DIAG_NO_FIB
        | DIAG_NO_CT
        | DIAG_NO_CT_COMMIT
        | DIAG_NO_COUNTERS
        | DIAG_NO_CHAINS
        | DIAG_NO_CACHE;
}

/// [`RouteMirror::families`] bits: for which families the `LOCAL` mirror decides a packet's
/// path.
///
/// The agent sets a family's bit only while, in the gateway's namespace, every destination of
/// that family is either in the local routing table (delivered to the gateway) or forwarded:
/// the local table is looked up first, no rule or route ends a lookup unroutable
/// (blackhole, unreachable, prohibit, nexthop objects), main holds a live default route and a
/// selector-free rule reaches it, no other table delivers locally, and forwarding is on.
/// There, a FIB lookup's only other answer (the output interface) matters to no chain when no
/// chain tests it ([`flags::oif_tested`]) and no event reports it ([`flags::EVENTS`]).
pub mod routes {
    /// IPv4 destinations.
    pub const V4: u32 = 1;
    /// IPv6 destinations.
    pub const V6: u32 = 2;
    /// How long a lease ([`crate::RouteMirror::until_ns`]) holds.
    pub const LEASE_NS: u64 = 2_000_000_000;
    /// How often the watcher renews it.
    pub const RENEW_NS: u64 = 500_000_000;
}

/// `ROUTES[0]`: the route watcher's lease on the `LOCAL` mirror.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteMirror {
    /// [`routes`] bits: the families whose path the mirror decides.
    pub families: u32,
    /// Which watcher holds the lease (a token of its own, never 0): another one leaves the
    /// maps alone while the lease holds, and takes over once it runs out.
    pub owner: u32,
    /// `CLOCK_MONOTONIC` nanoseconds until which the lease holds (the datapath reads the
    /// coarse clock, `bpf_ktime_get_coarse_ns`, at most a tick behind): the
    /// watcher renews it every [`routes::RENEW_NS`]; an agent that dies without clearing it
    /// leaves a mirror that stops being used within [`routes::LEASE_NS`], nobody keeping it
    /// current any more.
    pub until_ns: u64,
}

/// Entries of the `LOCAL` trie (local addresses, broadcast and multicast prefixes of the
/// gateway: a handful per interface).
pub const LOCAL_MAX: u32 = 4096;

/// Marker in `skb->cb[0]` of probe packets (with [`flags::PROBE`] set).
pub const PROBE_MAGIC: u32 = 0x7077_7072; // "pwpr"

/// Per interface the datapath is attached to. `IFACES[ifindex]` (hash).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IfaceInfo {
    /// Bytes before the IP header (14 on Ethernet, 0 on L3 devices such as WireGuard).
    pub l2_len: u32,
}

// Counter indices fit a cached verdict's u16.
const _: () = assert!(MAX_CHAINS as usize * MAX_RULES <= 1 << 16);
