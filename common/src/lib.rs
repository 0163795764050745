//! Types shared by the peerwall eBPF datapath (`ebpf/`) and user space (`agent/`).
//!
//! Every map key and value is `#[repr(C)]` with explicit padding fields, so both sides agree on
//! the byte layout; every padding field must be zero (keys are compared byte for byte).
//! Byte order is stated per field: "BE" fields hold network byte order, others are host order.
//! The `user` feature adds `aya::Pod` impls for user space.
#![no_std]

/// Rules per chain (bitmap width 16 × 64).
pub const MAX_RULES: usize = 1024;
/// Words of a rule bitmap.
pub const WORDS: usize = MAX_RULES / 64;
/// Chains in a policy (all tables).
pub const MAX_CHAINS: u32 = 64;
/// Filter chains on one hook for one family.
pub const MAX_HOOK_CHAINS: usize = 16;
/// Hooks (prerouting, input, forward, output, postrouting).
pub const HOOKS: u32 = 5;
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
    /// Source port trie (per slot).
    pub const SPORT: &str = "SPORT";
    /// Destination port trie (per slot).
    pub const DPORT: &str = "DPORT";
    /// Family + protocol hash (per slot).
    pub const PROTO: &str = "PROTO";
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
    /// Per-flow verdict cache, IPv4 ([`crate::VerdictKey4`] keys).
    pub const VERDICTS4: &str = "VERDICTS4";
    /// Per-flow verdict cache, IPv6 ([`crate::FlowKey`] keys).
    pub const VERDICTS6: &str = "VERDICTS6";
    /// The per-CPU verdict cache in front of `VERDICTS4` ([`crate::CpuVerdicts4`] sets, one
    /// region of [`crate::CPU_VERDICT_SETS`] per CPU). Not pinned: each loaded program has its
    /// own, sized for the machine's CPUs.
    pub const VERDICTS4_CPU: &str = "VERDICTS4_CPU";
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
    /// The benchmark's bare lookup table.
    pub const BARE: &str = "BARE";
    /// The benchmark's one-hash-lookup table.
    pub const BARE_HASH: &str = "BARE_HASH";
}

/// Entries of the per-slot `HOOKS` map: one per (hook, family), index `hook * 2 + family`.
pub const HOOK_SLOTS: u32 = HOOKS * 2;

/// Hook numbers used in [`HookChains`] indexes: `hook * 2 + family`.
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

/// Conntrack state numbers (index into the per-chain ct bitmaps).
pub mod ct {
    /// First packet of a flow.
    pub const NEW: u32 = 0;
    /// Flow seen both ways.
    pub const ESTABLISHED: u32 = 1;
    /// ICMP error about a known flow.
    pub const RELATED: u32 = 2;
    /// Not tracked (never produced by the datapath: no notrack support).
    pub const UNTRACKED: u32 = 3;
    /// Unclassifiable (bad TCP flags, unsolicited ICMP replies, errors about unknown flows).
    pub const INVALID: u32 = 4;
    /// States per chain (slots reserved for alignment).
    pub const SLOTS: u32 = 8;
}

/// A rule bitmap: bit `r` (word `r / 64`, bit `r % 64`) set when rule `r` of the chain is
/// allowed by a dimension. Host byte order. EBpf twin: the value of every dimension map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bitmap {
    /// Words, host order.
    pub w: [u64; WORDS],
}

impl Bitmap {
    /// No rule.
    pub const EMPTY: Bitmap = Bitmap { w: [0; WORDS] };

    /// Set bit `r` (ignored when out of range).
    pub fn set(&mut self, r: usize) {
        if r < MAX_RULES {
            self.w[r / 64] |= 1u64 << (r % 64);
        }
    }

    /// Whether bit `r` is set.
    pub fn get(&self, r: usize) -> bool {
        r < MAX_RULES && self.w[r / 64] & (1u64 << (r % 64)) != 0
    }

    /// The lowest set bit.
    pub fn first(&self) -> Option<usize> {
        let mut i = 0;
        while i < WORDS {
            if self.w[i] != 0 {
                return Some(i * 64 + self.w[i].trailing_zeros() as usize);
            }
            i += 1;
        }
        None
    }
}

/// LPM trie key of the address dimensions (`SRC`, `DST`).
///
/// `data` = chain id (u32 BE) | family (u32 BE: 4 or 6) | address (16 bytes BE; IPv4 in the
/// first 4 bytes, rest zero). `prefix_len` = 64 + address prefix length. Eq twin:
/// `aya_ebpf::maps::lpm_trie::Key<[u8; 24]>`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddrKeyData {
    /// Chain id, BE.
    pub chain: [u8; 4],
    /// Family, BE u32.
    pub family: [u8; 4],
    /// Address, BE.
    pub addr: [u8; 16],
}

/// Bits of an [`AddrKeyData`] before the address.
pub const ADDR_KEY_FIXED_BITS: u32 = 64;

/// Value of the `VIEW` tries (key: an [`AddrKeyData`] whose `chain` field holds the input
/// ifindex, BE): the destination prefix a packet arriving there is seen in by the forward hook
/// once prerouting's NAT ran (a DNAT, or the un-SNAT of a reply). The datapath keeps the host
/// bits of the destination beyond `prefix_len` and replaces the others with `to`'s.
/// Eq twin: `ebpf/src/view.rs`. 20 bytes, no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ViewTarget {
    /// Replacement network, BE (IPv4 in the first 4 bytes).
    pub to: [u8; 16],
    /// Length of the rewritten prefix (0..=32 or 0..=128), native endian.
    pub prefix_len: u32,
}

/// LPM trie key data of the port dimensions (`SPORT`, `DPORT`): chain id (u32 BE) | port
/// (u16 BE) | padding (2 bytes, zero). `prefix_len` = 32 + port prefix length.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortKeyData {
    /// Chain id, BE.
    pub chain: [u8; 4],
    /// Port, BE.
    pub port: [u8; 2],
    /// Zero.
    pub _pad: [u8; 2],
}

/// Bits of a [`PortKeyData`] before the port.
pub const PORT_KEY_FIXED_BITS: u32 = 32;

/// Key of the `PROTO` hash: which rules a packet's family and layer-4 protocol allow (rules
/// with port matches are cleared for non-TCP/UDP protocols). `proto` = 0 .. 255, host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProtoKey {
    /// Chain id, host order.
    pub chain: u32,
    /// [`family`] code.
    pub family: u8,
    /// IP protocol number.
    pub proto: u8,
    /// Zero.
    pub _pad: [u8; 2],
}

/// Key of the `IIF` / `OIF` hashes: rules whose interface matches hold for this interface.
/// `ifindex` 0 stands for "no interface known at this hook" and for interfaces created after
/// the maps were filled (their names match no rule pattern until the agent refreshes them).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IfKey {
    /// Chain id, host order.
    pub chain: u32,
    /// Interface index, host order.
    pub ifindex: u32,
}

/// Per chain and per address/port dimension: rules the dimension does not constrain (`any`)
/// and rules whose test is negated (`neg`). A dimension allows `(lookup ^ neg) | any`.
/// Index in `MASKS`: `chain * 4 + dim` (dims: 0 src, 1 dst, 2 sport, 3 dport).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DimMasks {
    /// Unconstrained rules.
    pub any: Bitmap,
    /// Negated rules.
    pub neg: Bitmap,
}

/// Dimension numbers in `MASKS`.
pub mod dim {
    /// Source address.
    pub const SRC: u32 = 0;
    /// Destination address.
    pub const DST: u32 = 1;
    /// Source port.
    pub const SPORT: u32 = 2;
    /// Destination port.
    pub const DPORT: u32 = 3;
}

/// Per chain: what happens when no rule matches, and bookkeeping. Index in `CHAINS`: chain id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainInfo {
    /// Number of deciding rules (bits in use).
    pub rules: u32,
    /// [`ActionCode`] of the policy (Accept or Drop).
    pub policy: u8,
    /// Zero.
    pub _pad: [u8; 3],
    /// [`constrained`] bits: dimensions some rule of the chain tests. The datapath skips the
    /// lookups of the others (their bitmaps would allow every rule).
    pub constrained: u32,
}

/// Bits of [`ChainInfo::constrained`].
pub mod constrained {
    /// Input interface.
    pub const IIF: u32 = 1;
    /// Output interface.
    pub const OIF: u32 = 2;
    /// Conntrack state.
    pub const CT: u32 = 4;
    /// Source address.
    pub const SRC: u32 = 8;
    /// Destination address.
    pub const DST: u32 = 16;
    /// Source port.
    pub const SPORT: u32 = 32;
    /// Destination port.
    pub const DPORT: u32 = 64;
}

/// A deciding rule: its action. Index in `RULES`: `chain * MAX_RULES + rule`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleInfo {
    /// [`ActionCode`].
    pub action: u8,
    /// 1 when the rule counts packets.
    pub counter: u8,
    /// Zero.
    pub _pad: [u8; 2],
}

/// Chains on one hook for one family, in evaluation order. Index in `HOOKS`: `hook * 2 + f`
/// where f is 0 for IPv4 and 1 for IPv6.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HookChains {
    /// How many of `chains` are used.
    pub count: u32,
    /// Chain ids.
    pub chains: [u32; MAX_HOOK_CHAINS],
}

/// Packet and byte counts (per CPU). Index in `COUNTERS`: `chain * MAX_RULES + rule`; the
/// policy of a chain counts at `chain * MAX_RULES + MAX_RULES - 1`.
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
    /// another epoch ([`CachedVerdict::epoch`]) are never served.
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
    /// Every diagnostic flag.
    pub const DIAG_ALL: u32 = DIAG_NO_FIB
        | DIAG_NO_CT
        | DIAG_NO_CT_COMMIT
        | DIAG_NO_COUNTERS
        | DIAG_NO_CHAINS
        | DIAG_NO_CACHE;
}

/// Marker in `skb->cb[0]` of probe packets (with [`flags::PROBE`] set).
pub const PROBE_MAGIC: u32 = 0x7077_7072; // "pwpr"

/// Per interface the datapath is attached to. `IFACES[ifindex]` (hash).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IfaceInfo {
    /// Bytes before the IP header (14 on Ethernet, 0 on L3 devices such as WireGuard).
    pub l2_len: u32,
}

/// Connection-tracking key, original direction. Addresses BE (IPv4 in the first 4 bytes),
/// ports BE (ICMP: id in `sport`, 0 in `dport`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowKey {
    /// Source address, BE.
    pub src: [u8; 16],
    /// Destination address, BE.
    pub dst: [u8; 16],
    /// Source port / ICMP id, BE.
    pub sport: [u8; 2],
    /// Destination port, BE.
    pub dport: [u8; 2],
    /// IP protocol.
    pub proto: u8,
    /// [`family`] code.
    pub family: u8,
    /// Zero.
    pub _pad: [u8; 2],
}

/// Verdict-cache key of an IPv4 packet (`VERDICTS4`): what [`FlowKey`] holds for IPv4, in 16
/// bytes instead of 40, so that the lookup every packet of a known flow pays hashes less than
/// half as much. Addresses and ports BE, as in the packet (ICMP: id in `sport`, 0 in `dport`);
/// no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VerdictKey4 {
    /// Source address, BE.
    pub src: [u8; 4],
    /// Destination address, BE.
    pub dst: [u8; 4],
    /// Source port / ICMP id, BE.
    pub sport: [u8; 2],
    /// Destination port, BE.
    pub dport: [u8; 2],
    /// IP protocol.
    pub proto: u8,
    /// ICMP echo type (0 or 8); 0 for other protocols.
    pub icmp_type: u8,
    /// Zero.
    pub _pad: [u8; 2],
}

/// Connection-tracking state of a flow.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowState {
    /// Last packet, `bpf_ktime_get_ns`.
    pub last_seen_ns: u64,
    /// 1 once a packet was seen in the reply direction.
    pub replied: u8,
    /// 1 once user space ended the flow (a policy change no longer allows it): its packets,
    /// either way, are `invalid` until it expires, and none of them starts it again.
    pub ended: u8,
    /// Zero.
    pub _pad: [u8; 6],
}

/// Rule counters a cached verdict bumps: one per chain on the packet's path. A path through
/// more chains than this is not cached.
pub const CACHED_COUNTERS: usize = 4;

/// A verdict the datapath reuses for the next packets of a flow in the same direction,
/// `VERDICTS4[key]` / `VERDICTS6[key]` (LRU hashes). The key is the packet's own
/// [`VerdictKey4`] / [`FlowKey`] (its direction, not the original one; ICMP: the echo type in
/// `icmp_type` / `_pad[0]`), after the NAT view.
///
/// Served only while all of these hold, otherwise the packet is classified in full and the
/// entry rewritten: the same policy epoch ([`Config::active`]), the same input interface, and
/// less than a second old (the route and the conntrack refresh it stands for are at most that
/// stale). Conntrack deletes the entries whose state a commit changes (a reply turning a flow
/// established). Only accept and drop are cached, only for new and established packets.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CachedVerdict {
    /// [`Config::active`] the verdict was computed under.
    pub epoch: u32,
    /// Input ifindex of the packet it was computed for.
    pub ifindex: u32,
    /// `bpf_jiffies64` when computed, low 32 bits (compared wrapping).
    pub at: u32,
    /// [`ActionCode`].
    pub action: u8,
    /// How many of `counters` are used.
    pub counted: u8,
    /// [`ct`] state it was computed for.
    pub state: u8,
    /// [`ActionCode`] of the first would-drop on the path (`AuditDrop`, `AuditReject`), or 0.
    pub audit: u8,
    /// `COUNTERS` indices (of the epoch's slot; chain × [`MAX_RULES`] + rule, below 2^16) of
    /// the rules, or chain policies, that decided in each chain on the path.
    pub counters: [u16; CACHED_COUNTERS],
    /// Output ifindex of the packet it was computed for (reported in events).
    pub oif: u32,
    /// Index in `counters` of the would-drop's chain.
    pub audit_step: u8,
    /// Zero.
    pub _pad: u8,
    /// Jiffies it is served for after `at`: one second's worth (at most).
    pub ttl: u16,
    /// `VERDICT_GENS[verdict_set(key)]` read before the verdict's conntrack state was: a
    /// commit that changes the flow's state since makes it stale.
    pub gen: u32,
}

/// Sets of the per-CPU verdict cache (`VERDICTS4_CPU`), per CPU, and of `VERDICT_GENS`.
pub const CPU_VERDICT_SETS: u32 = 1 << CPU_VERDICT_SET_BITS;
/// log2 of [`CPU_VERDICT_SETS`].
pub const CPU_VERDICT_SET_BITS: u32 = 11;
/// Ways of a [`CpuVerdicts4`] set.
pub const CPU_VERDICT_WAYS: usize = 2;

/// The set of the verdict caches a flow key falls in: the per-CPU cache's set, and its
/// generation's index in `VERDICT_GENS`. `words` are the key's 16 bytes as native-endian 32-bit
/// words (a [`VerdictKey4`], or an IPv6 key folded by [`fold_key6`]). A multiplicative hash:
/// cheap on the datapath, spreading the low bits of ports and addresses into the top bits it
/// keeps. Not keyed: a sender can crowd one set with its own flows, which costs it the
/// full-cache lookup, never a wrong verdict.
#[inline(always)]
pub fn verdict_set(words: [u32; 4]) -> u32 {
    let x = words[0] ^ words[1].rotate_left(16) ^ words[2].rotate_left(8) ^ words[3];
    x.wrapping_mul(0x9e37_79b1) >> (32 - CPU_VERDICT_SET_BITS)
}

/// An IPv6 `VERDICTS6` key folded into the four words [`verdict_set`] takes.
#[inline(always)]
pub fn fold_key6(k: &FlowKey) -> [u32; 4] {
    let w = |b: &[u8; 16], i: usize| u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    [
        w(&k.src, 0) ^ w(&k.src, 4) ^ w(&k.src, 8) ^ w(&k.src, 12),
        w(&k.dst, 0) ^ w(&k.dst, 4) ^ w(&k.dst, 8) ^ w(&k.dst, 12),
        u32::from_ne_bytes([k.sport[0], k.sport[1], k.dport[0], k.dport[1]]),
        u32::from_ne_bytes([k.proto, k.family, k._pad[0], k._pad[1]]),
    ]
}

impl VerdictKey4 {
    /// The key's 16 bytes as native-endian words (what the datapath reads from the packet).
    #[inline(always)]
    pub fn words(&self) -> [u32; 4] {
        [
            u32::from_ne_bytes(self.src),
            u32::from_ne_bytes(self.dst),
            u32::from_ne_bytes([self.sport[0], self.sport[1], self.dport[0], self.dport[1]]),
            u32::from_ne_bytes([self.proto, self.icmp_type, self._pad[0], self._pad[1]]),
        ]
    }
}

/// One way of a [`CpuVerdicts4`] set: a `VERDICTS4` entry copied for this CPU. 64 bytes, one
/// cache line (the map's values start page-aligned, `BPF_F_MMAPABLE`). An all-zero way
/// (`ttl` 0) is never served.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuVerdict4 {
    /// The flow's key.
    pub key: VerdictKey4,
    /// Its verdict.
    pub v: CachedVerdict,
    /// Zero.
    pub _pad: [u8; 12],
}

/// `VERDICTS4_CPU[cpu * CPU_VERDICT_SETS + verdict_set(key)]`: the first level of the IPv4
/// verdict cache, a two-way set-associative table per CPU that only that CPU's packets read and
/// write (no locks, no shared cache lines). A packet of a known flow then costs one array
/// access (which the verifier inlines) and a compare, where `VERDICTS4`, the shared second
/// level, costs a hash, a bucket and two element lines. Filled from `VERDICTS4` when it serves
/// a packet; a new entry replaces the way written longer ago.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuVerdicts4 {
    /// The ways.
    pub ways: [CpuVerdict4; CPU_VERDICT_WAYS],
}

// Counter indices fit a cached verdict's u16.
const _: () = assert!(MAX_CHAINS as usize * MAX_RULES <= 1 << 16);

/// What the datapath decided for a probe packet (probe mode only). `LAST[0]`, per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeRecord {
    /// Incremented per probe.
    pub seq: u32,
    /// [`ActionCode`] of the final verdict.
    pub verdict: u8,
    /// 1 when some chain was on the path.
    pub has_chain: u8,
    /// 1 when a rule (not a policy) decided.
    pub has_rule: u8,
    /// [`ActionCode`] of the first would-drop on the path, or 0 (none).
    pub audit: u8,
    /// Deciding chain id.
    pub chain: u32,
    /// Deciding rule index.
    pub rule: u32,
    /// Chain of the first would-drop.
    pub audit_chain: u32,
    /// Its rule index, or `u32::MAX` for the chain policy.
    pub audit_rule: u32,
}

/// [`FlowEvent::kind`] values.
pub mod event {
    /// Dropped.
    pub const DROP: u8 = 1;
    /// Rejected (dropped, ICMP answer sent).
    pub const REJECT: u8 = 2;
    /// Would have been dropped by an audited chain; accepted.
    pub const AUDIT_DROP: u8 = 3;
    /// Would have been rejected by an audited chain; accepted.
    pub const AUDIT_REJECT: u8 = 4;
    /// First packet of a flow, accepted (flow log).
    pub const ACCEPT: u8 = 5;
    /// `rule` of an event decided by the chain policy.
    pub const POLICY: u32 = u32::MAX;
}

/// One event in the `EVENTS` ring buffer. eBPF twin: `ebpf/src/events.rs` writes it. Native
/// byte order (both ends run on the same host) except the addresses, which are as on the wire.
/// 88 bytes, no implicit padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowEvent {
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) of the event.
    pub ts_ns: u64,
    /// Packets of this flow and kind since its last event, this one included.
    pub packets: u64,
    /// Their bytes (IP total length).
    pub bytes: u64,
    /// Source address, BE (IPv4 in the first 4 bytes).
    pub src: [u8; 16],
    /// Destination address as the forward hook sees it, BE.
    pub dst: [u8; 16],
    /// Source port (ICMP: echo id), host order.
    pub sport: u16,
    /// Destination port, host order.
    pub dport: u16,
    /// Input ifindex.
    pub iif: u32,
    /// Output ifindex (0: delivered to the gateway, or unknown).
    pub oif: u32,
    /// Chain id (of the slot of `epoch`).
    pub chain: u32,
    /// Rule index in the chain, or [`event::POLICY`].
    pub rule: u32,
    /// [`Config::active`] when it happened: which slot's names apply.
    pub epoch: u32,
    /// [`family`] code.
    pub family: u8,
    /// IP protocol.
    pub proto: u8,
    /// [`ct`] state number.
    pub state: u8,
    /// [`event`] kind.
    pub kind: u8,
    /// Zero.
    pub _pad: [u8; 4],
}

/// Event rate limits (`EVENT_CONF[0]`), written by the loader.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventConfig {
    /// At most one event per flow and kind in this interval; the packets in between are
    /// counted in the next event.
    pub flow_interval_ns: u64,
    /// Events per second per CPU (token bucket refill).
    pub rate: u32,
    /// Bucket size.
    pub burst: u32,
}

/// Per-flow event state (`EVENT_FLOWS`, LRU, keyed by [`FlowKey`] with the kind in `_pad[0]`
/// and the chain id in `_pad[1]`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventFlow {
    /// When the flow's last event was sent (0: never).
    pub last_ns: u64,
    /// Packets since.
    pub packets: u64,
    /// Bytes since.
    pub bytes: u64,
}

/// Verdict codes in [`RuleInfo::action`] and [`ChainInfo::policy`].
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActionCode {
    /// Let the packet continue to the next chain.
    Accept = 0,
    /// Discard silently.
    Drop = 1,
    /// Discard and answer with ICMP/ICMPv6 port unreachable.
    Reject = 2,
    /// A drop of an audited chain: the chain accepts and records a would-drop.
    AuditDrop = 3,
    /// A reject of an audited chain: the chain accepts and records a would-reject.
    AuditReject = 4,
}

impl ActionCode {
    /// Decode a raw byte; unknown values decode as `None` (callers fail closed).
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::Accept),
            1 => Some(Self::Drop),
            2 => Some(Self::Reject),
            3 => Some(Self::AuditDrop),
            4 => Some(Self::AuditReject),
            _ => None,
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all these types are repr(C), Copy, made only of integers and byte arrays, with
    // explicit padding fields: every bit pattern is valid.
    unsafe impl aya::Pod for Bitmap {}
    unsafe impl aya::Pod for AddrKeyData {}
    unsafe impl aya::Pod for PortKeyData {}
    unsafe impl aya::Pod for ProtoKey {}
    unsafe impl aya::Pod for FlowEvent {}
    unsafe impl aya::Pod for EventConfig {}
    unsafe impl aya::Pod for EventFlow {}
    unsafe impl aya::Pod for IfKey {}
    unsafe impl aya::Pod for DimMasks {}
    unsafe impl aya::Pod for ChainInfo {}
    unsafe impl aya::Pod for RuleInfo {}
    unsafe impl aya::Pod for HookChains {}
    unsafe impl aya::Pod for ViewTarget {}
    unsafe impl aya::Pod for Counter {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for IfaceInfo {}
    unsafe impl aya::Pod for FlowKey {}
    unsafe impl aya::Pod for VerdictKey4 {}
    unsafe impl aya::Pod for FlowState {}
    unsafe impl aya::Pod for CachedVerdict {}
    unsafe impl aya::Pod for CpuVerdicts4 {}
    unsafe impl aya::Pod for ProbeRecord {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn action_codes_round_trip() {
        for a in [
            ActionCode::Accept,
            ActionCode::Drop,
            ActionCode::Reject,
            ActionCode::AuditDrop,
            ActionCode::AuditReject,
        ] {
            assert_eq!(ActionCode::from_u8(a as u8), Some(a));
        }
        assert_eq!(ActionCode::from_u8(9), None);
    }

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<Bitmap>(), 128);
        assert_eq!(size_of::<AddrKeyData>(), 24);
        assert_eq!(size_of::<PortKeyData>(), 8);
        assert_eq!(size_of::<ProtoKey>(), 8);
        assert_eq!(size_of::<IfKey>(), 8);
        assert_eq!(size_of::<DimMasks>(), 256);
        assert_eq!(size_of::<ChainInfo>(), 12);
        assert_eq!(size_of::<RuleInfo>(), 4);
        assert_eq!(size_of::<HookChains>(), 4 + 4 * MAX_HOOK_CHAINS);
        assert_eq!(size_of::<Counter>(), 16);
        assert_eq!(size_of::<Config>(), 8);
        assert_eq!(size_of::<FlowKey>(), 40);
        assert_eq!(size_of::<VerdictKey4>(), 16);
        // With the kernel's 48-byte element header and the 16-byte key, a `VERDICTS4` element
        // is 104 bytes (the value rounded up to 40); a per-CPU way is one cache line.
        assert_eq!(size_of::<CachedVerdict>(), 36);
        assert_eq!(size_of::<CpuVerdict4>(), 64);
        assert_eq!(size_of::<CpuVerdicts4>(), 128);
        assert_eq!(size_of::<FlowState>(), 16);
        assert_eq!(size_of::<ProbeRecord>(), 24);
        assert_eq!(size_of::<FlowEvent>(), 88);
        assert_eq!(size_of::<EventConfig>(), 16);
        assert_eq!(size_of::<EventFlow>(), 24);
    }

    #[test]
    fn verdict_sets_cover_the_table_and_follow_the_key() {
        let k = VerdictKey4 {
            src: [172, 16, 0, 9],
            dst: [10, 0, 3, 7],
            sport: 40000u16.to_be_bytes(),
            dport: 8080u16.to_be_bytes(),
            proto: 17,
            icmp_type: 0,
            _pad: [0; 2],
        };
        // The words are the key's bytes, as the datapath loads them from the packet.
        let bytes: [u8; 16] = unsafe { core::mem::transmute(k) };
        let loaded: [u32; 4] = core::array::from_fn(|i| {
            u32::from_ne_bytes([
                bytes[4 * i],
                bytes[4 * i + 1],
                bytes[4 * i + 2],
                bytes[4 * i + 3],
            ])
        });
        assert_eq!(k.words(), loaded);
        // 4096 flows differing in the source port alone spread over the sets: no set holds
        // more than a few (a two-way set overflows at three).
        let mut per_set = [0u32; CPU_VERDICT_SETS as usize];
        for port in 0..4096u16 {
            let mut f = k;
            f.sport = (20000 + port).to_be_bytes();
            let s = verdict_set(f.words());
            assert!(s < CPU_VERDICT_SETS);
            per_set[s as usize] += 1;
        }
        assert!(
            per_set.iter().all(|&n| n <= 8),
            "{:?}",
            per_set.iter().max()
        );
        assert!(per_set.iter().filter(|&&n| n > 0).count() > 1200);
        // IPv6: every byte of the key reaches the set.
        let k6 = FlowKey {
            src: [0xfd; 16],
            dst: [0xfe; 16],
            sport: [1, 2],
            dport: [3, 4],
            proto: 6,
            family: family::V6,
            _pad: [0; 2],
        };
        let mut other = k6;
        other.dst[15] ^= 1;
        assert_ne!(fold_key6(&k6), fold_key6(&other));
    }

    #[test]
    fn bitmap_first() {
        let mut b = Bitmap::EMPTY;
        assert_eq!(b.first(), None);
        b.set(700);
        b.set(65);
        assert_eq!(b.first(), Some(65));
        assert!(b.get(700) && !b.get(64));
    }
}
