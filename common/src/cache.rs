//! The verdict cache: its keys and entries, the per-CPU first level and its set hash. eBPF
//! twin: `ebpf/src/cache.rs`.

use crate::conntrack::FlowKey;

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

/// Rule counters a cached verdict bumps: one per chain on the packet's path. A path through
/// more chains than this is not cached.
pub const CACHED_COUNTERS: usize = 4;

/// A verdict the datapath reuses for the next packets of a flow in the same direction,
/// `VERDICTS4[key]` / `VERDICTS6[key]` (LRU hashes). The key is the packet's own
/// [`VerdictKey4`] / [`FlowKey`] (its direction, not the original one; ICMP: the echo type in
/// `icmp_type` / `_pad[0]`), after the NAT view.
///
/// Served only while all of these hold, otherwise the packet is classified in full and the
/// entry rewritten: the same policy epoch ([`crate::Config::active`]), the same input interface, and
/// less than a second old (the route and the conntrack refresh it stands for are at most that
/// stale). Conntrack deletes the entries whose state a commit changes (a reply turning a flow
/// established). Only accept and drop are cached, only for new and established packets.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CachedVerdict {
    /// [`crate::Config::active`] the verdict was computed under.
    pub epoch: u32,
    /// Input ifindex of the packet it was computed for.
    pub ifindex: u32,
    /// `bpf_jiffies64` when computed, low 32 bits (compared wrapping).
    pub at: u32,
    /// [`crate::ActionCode`].
    pub action: u8,
    /// How many of `counters` are used.
    pub counted: u8,
    /// [`crate::ct`] state it was computed for.
    pub state: u8,
    /// [`crate::ActionCode`] of the first would-drop on the path (`AuditDrop`, `AuditReject`), or 0.
    pub audit: u8,
    /// `COUNTERS` indices (of the epoch's slot, below 2^16: [`crate::ChainInfo::counters`]) of
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
    verdict_hash(words) >> (32 - CPU_VERDICT_SET_BITS)
}

/// The multiplicative hash whose top bits are [`verdict_set`] and whose next byte is
/// [`verdict_tag`].
#[inline(always)]
fn verdict_hash(words: [u32; 4]) -> u32 {
    let x = words[0] ^ words[1].rotate_left(16) ^ words[2].rotate_left(8) ^ words[3];
    x.wrapping_mul(0x9e37_79b1)
}

/// The tag of a flow key in its per-CPU set ([`CpuVerdictTags`]): the byte of the hash right
/// below [`verdict_set`]'s bits, so that keys of one set differ in it as keys of the table do
/// in their set.
#[inline(always)]
pub fn verdict_tag(words: [u32; 4]) -> u8 {
    (verdict_hash(words) >> (32 - CPU_VERDICT_SET_BITS - 8)) as u8
}

/// Sets of the verdict cache whose marks one [`FreshLine`] holds.
pub const VERDICT_FRESH_LANES: u32 = 16;

/// `VERDICTS_FRESH[set / VERDICT_FRESH_LANES]`: per verdict-cache set ([`verdict_set`]), the
/// latest time (`bpf_jiffies64`, low 32 bits) until which a verdict the datapath put into the
/// shared level (`VERDICTS4`, `VERDICTS6`) for a key of that set may be served: its `at` plus
/// its `ttl`. Past it, no entry of the set can be served, so a packet skips the shared level's
/// lookup ([`verdict_may_serve`]); a flood of one-packet flows puts nothing there, and its
/// every packet then skips a cold hash lookup. A mark only moves later, and one lost to a
/// race, or a map that starts at zero (not pinned: a new program's starts empty), costs an
/// entry its service, never a wrong verdict (the packet is classified). 64 bytes, no padding;
/// `BPF_F_MMAPABLE`, one cache line an entry. eBPF twin: `ebpf/src/cache/fresh.rs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FreshLine {
    /// Per set, the mark (jiffies, low 32 bits).
    pub until: [u32; VERDICT_FRESH_LANES as usize],
}

/// Whether a verdict-cache set marked `until` ([`FreshLine`]) may hold a verdict served at
/// `now` (both jiffies, low 32 bits, compared wrapping): an entry is served while `now - at <
/// ttl`, that is while `now` is before `at + ttl`. A mark more than 2^31 jiffies old (weeks)
/// may read as ahead again, which only costs a lookup.
#[inline(always)]
pub const fn verdict_may_serve(until: u32, now: u32) -> bool {
    (until.wrapping_sub(now) as i32) > 0
}

/// Sets whose tags one [`CpuVerdictTags`] entry holds.
pub const CPU_VERDICT_TAG_SETS: u32 = 32;

/// `VERDICTS4_TAGS[i / CPU_VERDICT_TAG_SETS]`, `i = cpu * CPU_VERDICT_SETS + set`: the tags
/// ([`verdict_tag`]) of the keys last written into the ways of [`CPU_VERDICT_TAG_SETS`]
/// consecutive sets of `VERDICTS4_CPU`, set `i` at `tags[i % CPU_VERDICT_TAG_SETS]`, way `w` at
/// `[w]`, and until when each way's verdict serves at most (`until`, [`verdict_until_hint`]).
/// A filter in front of the ways: a packet whose tag neither way carries skips the set, whose
/// two ways are two cache lines, cold for a flow never seen; its tags are one line of 8 KiB per
/// CPU, which stays in the CPU's cache. And a drop of a flow never seen is written into a way
/// only where the hints say one is free, without reading the ways (under a flood of new
/// flows, reading them cost every packet two cold lines). Only a way's writer sets its tag and
/// hint, so either can be stale (the way expired early by a new generation or policy, or was
/// flushed) and cost a look or a verdict not cached, but a way whose key a packet carries has
/// that key's tag unless user space flushed the tags alone: then the packet is classified,
/// never served wrongly (the key compare decides). 128 bytes, no padding, tags in the first
/// cache line and hints in the second; the map is `BPF_F_MMAPABLE`. eBPF twin:
/// `ebpf/src/cache/key.rs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuVerdictTags {
    /// Per set, per way, the tag of the key written there (0 before any).
    pub tags: [[u8; CPU_VERDICT_WAYS]; CPU_VERDICT_TAG_SETS as usize],
    /// Per set, per way, [`verdict_until_hint`] of the verdict written there (0 before any).
    pub until: [[u8; CPU_VERDICT_WAYS]; CPU_VERDICT_TAG_SETS as usize],
}

/// Jiffies per unit of a way's hint ([`verdict_until_hint`]): 16, so that the hint's byte
/// spans 2,048 jiffies each way (two seconds at HZ 1000, twenty at HZ 100), past any cached
/// verdict's lifetime (at most a second, `ebpf/src/ttl.rs`).
pub const VERDICT_HINT_SHIFT: u32 = 4;

/// The hint of a way whose verdict is served until `until` (jiffies, low 32 bits): `until` in
/// units of [`VERDICT_HINT_SHIFT`], rounded up, as a byte, never 0 (0 is a way never written).
/// Rounding up (and 0 moved to 1) only makes the hint later than `until`, so
/// [`verdict_way_free`] never calls a way free while its verdict can serve.
#[inline(always)]
pub const fn verdict_until_hint(until: u32) -> u8 {
    let h = (until.wrapping_add((1 << VERDICT_HINT_SHIFT) - 1) >> VERDICT_HINT_SHIFT) as u8;
    if h == 0 {
        1
    } else {
        h
    }
}

/// Whether a way whose hint is `hint` may be written at `now` (jiffies) without evicting a
/// verdict that still serves: never written (0), or its hint's unit is past (compared
/// wrapping, so a way written more than 2,032 jiffies ago can look busy again: then a drop is
/// not cached there, which costs only its next packet a classification).
#[inline(always)]
pub const fn verdict_way_free(hint: u8, now: u32) -> bool {
    hint == 0 || (((now >> VERDICT_HINT_SHIFT) as u8).wrapping_sub(hint) as i8) > 0
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
