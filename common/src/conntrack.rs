//! Connection tracking: state numbers, the flow key (original direction) and a flow's state.
//! eBPF twins: `ebpf/src/conntrack.rs`, `ebpf/src/flow.rs`.

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
    /// Not a state: the rules that match a packet whose state is *one of* new, established
    /// and related, unknown which (the OR of those three slots). What the kernel-conntrack
    /// datapath classifies a TCP SYN or a UDP packet with when it has not looked the kernel's
    /// table up ([`open_slots`](super::open_slots)).
    pub const OPEN_EITHER: u32 = 5;
    /// Not a state: the rules that match such a packet *whatever* its state of the three (the
    /// AND of those slots): a chain's decision under [`OPEN_EITHER`] holds for every one of
    /// the three states when its deciding rule is in this slot ([`open_slots`](super::open_slots)).
    pub const OPEN_EVERY: u32 = 6;
    /// States per chain (slots reserved for alignment).
    pub const SLOTS: u32 = 8;
}

/// The two slots beside a chain's state slots (`ct`, indexed by [`ct`] state number, at least
/// up to [`ct::RELATED`]): ([`ct::OPEN_EITHER`], [`ct::OPEN_EVERY`]).
///
/// Why a decision under `OPEN_EITHER` whose rule is in `OPEN_EVERY` is the decision for each
/// of the three states: let `A` be the rules every other dimension allows, `O` the OR and `E`
/// the AND of the three state slots, and `r` the lowest rule of `A ∩ O`. For each state `s`,
/// `A ∩ s ⊆ A ∩ O`, so its lowest rule is not below `r`; and `r ∈ A ∩ E ⊆ A ∩ s`, so it is
/// not above. With `A ∩ O` empty, every `A ∩ s` is: the chain's policy decides for all three.
pub fn open_slots(ct: &[crate::Bitmap]) -> (crate::Bitmap, crate::Bitmap) {
    let mut either = crate::Bitmap::EMPTY;
    let mut every = crate::Bitmap {
        w: [u64::MAX; crate::WORDS],
    };
    for s in [ct::NEW, ct::ESTABLISHED, ct::RELATED] {
        let b = ct.get(s as usize).copied().unwrap_or(crate::Bitmap::EMPTY);
        for i in 0..crate::WORDS {
            either.w[i] |= b.w[i];
            every.w[i] &= b.w[i];
        }
    }
    (either, every)
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
    /// [`crate::family`] code.
    pub family: u8,
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

/// Slots of `FLOWS_NEW` when the loader is not told otherwise (a power of two).
pub const NEW_FLOW_SLOTS: u32 = 1 << 16;

/// One slot of `FLOWS_NEW`, the flows not replied yet: a direct-mapped array indexed by
/// [`new_flow_slot`] (eBPF twin: `ebpf/src/conntrack.rs`). A new flow takes its slot
/// whatever was there, as an LRU would evict the oldest: both forget unanswered flows under a
/// flood; the array does it with one cache line written instead of a hash bucket, an LRU list
/// and the evicted entry's bucket. 64 bytes, one cache line; an empty slot is all zero
/// (`key.family` 0, which no flow has).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NewFlowSlot {
    /// The flow, original direction.
    pub key: FlowKey,
    /// Zero.
    pub _pad: [u8; 8],
    /// Its state (`replied` always 0 here).
    pub state: FlowState,
}

impl NewFlowSlot {
    /// An empty slot.
    pub const EMPTY: NewFlowSlot = NewFlowSlot {
        key: FlowKey {
            src: [0; 16],
            dst: [0; 16],
            sport: [0; 2],
            dport: [0; 2],
            proto: 0,
            family: 0,
            _pad: [0; 2],
        },
        _pad: [0; 8],
        state: FlowState {
            last_seen_ns: 0,
            replied: 0,
            ended: 0,
            _pad: [0; 6],
        },
    };
}

/// The 40 bytes of `k` as ten native-endian words (what [`new_flow_slot`] hashes and the
/// datapath compares).
#[inline(always)]
pub fn flow_words(k: &FlowKey) -> [u32; 10] {
    let w = |b: &[u8], i: usize| u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    [
        w(&k.src, 0),
        w(&k.src, 4),
        w(&k.src, 8),
        w(&k.src, 12),
        w(&k.dst, 0),
        w(&k.dst, 4),
        w(&k.dst, 8),
        w(&k.dst, 12),
        u32::from_ne_bytes([k.sport[0], k.sport[1], k.dport[0], k.dport[1]]),
        u32::from_ne_bytes([k.proto, k.family, k._pad[0], k._pad[1]]),
    ]
}

/// The `FLOWS_NEW` slot of flow `k` in a table of `mask + 1` slots (a power of two). A
/// multiplicative hash of the key's words, each word rotated differently so that swapping
/// addresses or ports gives another slot; not keyed: a sender who knows an unanswered flow's
/// five-tuple can evict it by sending a colliding one, which its flood does to every
/// unanswered flow anyway (as with an LRU); a replied flow lives in `FLOWS`, out of reach.
#[inline(always)]
pub fn new_flow_slot(k: &FlowKey, mask: u32) -> u32 {
    let w = flow_words(k);
    let mut x: u32 = 0;
    let mut i = 0;
    while i < 10 {
        x = (x ^ w[i].rotate_left(i as u32 * 3)).wrapping_mul(0x9e37_79b1);
        i += 1;
    }
    (x ^ (x >> 16)) & mask
}

/// A flow the datapath has not seen for this long is gone (its entry may linger in the table
/// until reused or evicted, but no packet finds it live).
pub const FLOW_IDLE_NS: u64 = 600_000_000_000;

/// The longest an ended flow may stay ended after its last packet (the datapath's
/// `ENDED_IDLE_NS`, set by the loader): 12 hours, well inside what a `FLOW_SEEN` stamp can
/// tell apart (2^16 units, [`FLOW_SEEN_SHIFT`]).
pub const ENDED_IDLE_MAX_NS: u64 = 12 * 3600 * 1_000_000_000;

/// Flow stamps of `FLOW_SEEN` (a power of two), [`FLOW_SEEN_LANES`] to a map entry: 256 KiB of
/// `u16`, a fraction of the flow tables' several MiB (under a flood of new flows they do not
/// stay in the CPU's cache either: the pair stamps, [`FLOW_SEEN_PAIRS`], are read first).
/// (As an array of single `u16` values it took 1 MiB: an array map rounds each value up to 8
/// bytes, and under a flood of new flows the datapath's read of that entry was its costliest
/// instruction, a cache miss per packet.)
pub const FLOW_SEEN_SLOTS: u32 = 1 << 17;

/// Stamps per `FLOW_SEEN` entry ([`SeenLine`]): one 64-byte cache line.
pub const FLOW_SEEN_LANES: u32 = 32;

/// Pair stamps of `FLOW_SEEN` (a power of two), after its [`FLOW_SEEN_SLOTS`] flow stamps: one
/// per hash of a flow's two addresses and protocol ([`flow_seen_pair_slot_of_words`]), written
/// with every flow stamp of that pair. 16 KiB: under a flood of new flows from addresses that
/// hold no live flow, the pair's stamp (a line of a table small enough to stay in the CPU's
/// cache) says so, and the flow's own stamp (a cache miss per packet in the large part) is
/// not read. Where the pair holds a live flow, both are read.
pub const FLOW_SEEN_PAIRS: u32 = 1 << 13;

/// Entries of the `FLOW_SEEN` map: [`FLOW_SEEN_SLOTS`] flow stamps then [`FLOW_SEEN_PAIRS`] pair
/// stamps, [`FLOW_SEEN_LANES`] to an entry.
pub const FLOW_SEEN_LINES: u32 = (FLOW_SEEN_SLOTS + FLOW_SEEN_PAIRS) / FLOW_SEEN_LANES;

/// One `FLOW_SEEN` map entry: the stamps of [`FLOW_SEEN_LANES`] consecutive slots, slot `s` at
/// entry `s / 32`, lane `s % 32` ([`seen_line_of`]). 64 bytes, no padding; the map is
/// `BPF_F_MMAPABLE`, so its values start page-aligned and each entry is one cache line. Stamps
/// are written one `u16` at a time, in place (the datapath through its lookup's pointer, user
/// space through the map's memory mapped into it), never as a whole entry: a whole-entry write
/// could put back an older stamp that another CPU had just renewed. eBPF twin:
/// `ebpf/src/seen.rs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeenLine {
    /// The stamps ([`flow_seen_stamp`]).
    pub stamps: [u16; FLOW_SEEN_LANES as usize],
}

/// The `FLOW_SEEN` entry and lane of stamp slot `slot` ([`flow_seen_slot`]).
#[inline(always)]
pub const fn seen_line_of(slot: u32) -> (u32, usize) {
    (slot / FLOW_SEEN_LANES, (slot % FLOW_SEEN_LANES) as usize)
}

/// A `FLOW_SEEN` stamp counts units of 2^30 ns (1.07 s) of `bpf_ktime_get_ns`, modulo 2^16
/// (19.5 hours): wider than any gap the datapath compares it over.
pub const FLOW_SEEN_SHIFT: u32 = 30;

/// The `FLOW_SEEN` entry of flow `k` *and of its reply* (table of `mask + 1` entries, a power
/// of two): the two addresses are hashed alone and added, and so are the two ports, so that
/// swapping the addresses gives the same entry whether the ports swap with them (TCP, UDP,
/// SCTP) or stay (ICMP echo keeps its identifier in `sport` both ways). eBPF twin:
/// `ebpf/src/seen.rs`.
#[inline(always)]
pub fn flow_seen_slot(k: &FlowKey, mask: u32) -> u32 {
    flow_seen_slot_of_words(&flow_words(k), mask)
}

/// [`flow_seen_slot`] of a key given as its [`flow_words`] (the datapath's known-flow path
/// builds them from the headers, without a [`FlowKey`]).
#[inline(always)]
pub fn flow_seen_slot_of_words(w: &[u32; 10], mask: u32) -> u32 {
    let ports = w[8].to_ne_bytes();
    let p = u32::from(u16::from_ne_bytes([ports[0], ports[1]]))
        .wrapping_add(u32::from(u16::from_ne_bytes([ports[2], ports[3]])));
    let mut x = seen_pair_hash(w) ^ p.wrapping_mul(0x85eb_ca6b) ^ w[9].wrapping_mul(0xc2b2_ae35);
    x = x.wrapping_mul(0x9e37_79b1);
    (x ^ (x >> 16)) & mask
}

/// The two addresses of flow words `w`, each hashed alone and added: the same for a flow and
/// its reply.
#[inline(always)]
fn seen_pair_hash(w: &[u32; 10]) -> u32 {
    let addr = |a: u32, b: u32, c: u32, d: u32| {
        let mut x: u32 = 0x2545_f491;
        for v in [a, b, c, d] {
            x = (x ^ v).wrapping_mul(0x9e37_79b1);
            x ^= x >> 15;
        }
        x
    };
    addr(w[0], w[1], w[2], w[3]).wrapping_add(addr(w[4], w[5], w[6], w[7]))
}

/// The pair stamp of the flow whose [`flow_words`] are `w` and of its reply: a slot of
/// `FLOW_SEEN` past its flow stamps ([`FLOW_SEEN_SLOTS`] + a hash of the two addresses and
/// the protocol and family, ports left out, below [`FLOW_SEEN_PAIRS`]). Whoever writes a
/// flow's stamp writes this one too, with the same time, so that an idle pair stamp says that
/// every flow between the two addresses is idle. eBPF twin: `ebpf/src/seen.rs`.
#[inline(always)]
pub fn flow_seen_pair_slot_of_words(w: &[u32; 10]) -> u32 {
    let mut x = seen_pair_hash(w) ^ w[9].wrapping_mul(0xc2b2_ae35);
    x = x.wrapping_mul(0x85eb_ca6b);
    FLOW_SEEN_SLOTS + ((x ^ (x >> 16)) & (FLOW_SEEN_PAIRS - 1))
}

/// [`flow_seen_pair_slot_of_words`] of flow `k`.
#[inline(always)]
pub fn flow_seen_pair_slot(k: &FlowKey) -> u32 {
    flow_seen_pair_slot_of_words(&flow_words(k))
}

/// The `FLOW_SEEN` stamp of time `now_ns` (`bpf_ktime_get_ns`).
#[inline(always)]
pub const fn flow_seen_stamp(now_ns: u64) -> u16 {
    (now_ns >> FLOW_SEEN_SHIFT) as u16
}

/// A stamp that [`flow_seen_idle`] finds idle at `now_ns` for flows of lifetime `idle_ns`: what
/// an entry no live flow covers may be set to (benchmarks and tests, after emptying the
/// tables).
#[inline(always)]
pub const fn flow_seen_idle_stamp(now_ns: u64, idle_ns: u64) -> u16 {
    flow_seen_stamp(now_ns).wrapping_sub((idle_ns >> FLOW_SEEN_SHIFT) as u16 + 4)
}

/// Whether every flow whose `FLOW_SEEN` entry holds `stamp` is older than `idle_ns` at
/// `now_ns`, so that conntrack can know none of them without looking. Every write of a flow's
/// `last_seen_ns` also writes its entry (with the same clock, so the entry is never older than
/// any flow it covers by more than a unit, lost to a race of two CPUs writing it), and the
/// answer is yes only past `idle_ns` plus two units: a stamp can be too new (another flow
/// wrote it, or 2^16 units ago) and then the datapath merely looks, never too old.
///
/// A stamp *ahead* of `now_ns` (another CPU wrote it with a clock read after this one's, or
/// `now_ns` is a coarse clock, up to a tick behind the precise one stamps are written with)
/// wraps to an age just short of 2^16 units: the last [`FLOW_SEEN_AHEAD`] units of the range
/// count as live, never as idle.
#[inline(always)]
pub const fn flow_seen_idle(stamp: u16, now_ns: u64, idle_ns: u64) -> bool {
    let age = flow_seen_stamp(now_ns).wrapping_sub(stamp) as u64;
    age > (idle_ns >> FLOW_SEEN_SHIFT) + 2 && age < (1 << 16) - FLOW_SEEN_AHEAD
}

/// How many units a `FLOW_SEEN` stamp may be ahead of the clock it is compared with and still
/// count as live ([`flow_seen_idle`]): far more than a race between CPUs or a coarse clock's
/// lag (a tick, milliseconds) can put it ahead.
pub const FLOW_SEEN_AHEAD: u64 = 4;
