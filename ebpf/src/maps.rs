//! Every map of the datapath, declared here and nowhere else (the benchmark's `bare` programs
//! keep their own): the two policy slots, configuration, conntrack, per-CPU scratch space, the
//! probe record, events, the local routing table's mirror, the clock measurements. Names are
//! the pin names under the pin directory (README, "The eBPF backend"); their key and value
//! layouts are `peerwall-common`'s, but for the kernel-only per-CPU state ([`Bucket`]).

use aya_ebpf::macros::map;
use aya_ebpf::maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf};
use peerwall_common::{
    ct, flags, AddrKeyData, Bitmap, CachedVerdict, ChainInfo, Config, Counter, CpuVerdictTags,
    CpuVerdicts4, DimMasks, EventConfig, EventFlow, FlowKey, FlowState, FreshLine, HookChains,
    HostLine, IfKey, IfaceInfo, NewFlowSlot, PairDrops, PortKeyData, ProbeRecord, ProtoKey,
    RouteMirror, RuleInfo, SeenLine, VerdictKey4, ViewTarget, CACHED_COUNTERS, COUNTERS_DEFAULT,
    CPU_VERDICT_SETS, CPU_VERDICT_TAG_SETS, FLOW_SEEN_LINES, HOOK_SLOTS, LOCAL_MAX, MAX_CHAINS,
    MAX_RULES, NEW_FLOW_SLOTS, NO_COMMON_LRU, PAIR_DROP_SETS, VERDICT_FRESH_LANES,
};

use crate::work::Work;

// Maps. Names are the pin names under /sys/fs/bpf/peerwall/ (see README, "The eBPF backend").

/// Prefix entries of the address dimensions (no preallocation: memory follows the policy).
pub(crate) const TRIE_MAX: u32 = 4 << 20;
pub(crate) const PORT_TRIE_MAX: u32 = 1 << 16;
/// Entries of the per-chain keyed maps (protocols, interfaces): a handful per chain, taken as
/// they come (`NO_PREALLOC`), so their memory follows the policy.
pub(crate) const HASH_MAX: u32 = 1 << 12;
pub(crate) const FLOWS_MAX: u32 = 1 << 16;
/// Host entries of the address dimensions' hash maps by default (the loader's
/// `--host-table-size` changes it). Their entries come with the policy, but the kernel
/// allocates a hash map's buckets up front, 16 bytes per power-of-two slot, four maps per
/// datapath (two dimensions, two slots) and one datapath per gateway: at 1M hosts they were
/// 64 MiB of every gateway's 121. Hosts past it go into the tries (the loader's `layout.rs`).
pub(crate) const HOST_MAX: u32 = peerwall_common::HOST_TABLE_DEFAULT;
pub(crate) use peerwall_common::FLOW_IDLE_NS;
/// `BPF_F_NO_PREALLOC`: a hash map's entries take memory as they come (its buckets do not:
/// see [`HOST_MAX`]).
pub(crate) const NO_PREALLOC: u32 = 1;

macro_rules! slot_maps {
    ($src:ident, $dst:ident, $srch:ident, $dsth:ident, $sport:ident, $dport:ident, $proto:ident, $iif:ident, $oif:ident,
     $ct:ident, $masks:ident, $chains:ident, $rules:ident, $hooks:ident, $counters:ident,
     $owners:ident) => {
        #[map]
        pub(crate) static $src: LpmTrie<AddrKeyData, Bitmap> = LpmTrie::pinned(TRIE_MAX, 0);
        #[map]
        pub(crate) static $dst: LpmTrie<AddrKeyData, Bitmap> = LpmTrie::pinned(TRIE_MAX, 0);
        // Full-length prefixes (hosts: /32, /128) live in hash maps consulted first: an
        // exact-match lookup is O(1) where the trie walks its depth, and the tries stay small.
        #[map]
        pub(crate) static $srch: HashMap<AddrKeyData, Bitmap> =
            HashMap::pinned(HOST_MAX, NO_PREALLOC);
        #[map]
        pub(crate) static $dsth: HashMap<AddrKeyData, Bitmap> =
            HashMap::pinned(HOST_MAX, NO_PREALLOC);
        #[map]
        pub(crate) static $sport: LpmTrie<PortKeyData, Bitmap> = LpmTrie::pinned(PORT_TRIE_MAX, 0);
        #[map]
        pub(crate) static $dport: LpmTrie<PortKeyData, Bitmap> = LpmTrie::pinned(PORT_TRIE_MAX, 0);
        #[map]
        pub(crate) static $proto: HashMap<ProtoKey, Bitmap> =
            HashMap::pinned(HASH_MAX, NO_PREALLOC);
        #[map]
        pub(crate) static $iif: HashMap<IfKey, Bitmap> = HashMap::pinned(HASH_MAX, NO_PREALLOC);
        #[map]
        pub(crate) static $oif: HashMap<IfKey, Bitmap> = HashMap::pinned(HASH_MAX, NO_PREALLOC);
        #[map]
        pub(crate) static $ct: Array<Bitmap> = Array::pinned(MAX_CHAINS * ct::SLOTS, 0);
        #[map]
        pub(crate) static $masks: Array<DimMasks> = Array::pinned(MAX_CHAINS * 4, 0);
        #[map]
        pub(crate) static $chains: Array<ChainInfo> = Array::pinned(MAX_CHAINS, 0);
        // Mmapable: a slot written whole is one copy into its 65536 entries, not a
        // system call's update per entry (`loader/batch.rs`).
        #[map]
        pub(crate) static $rules: Array<RuleInfo> =
            Array::pinned(MAX_CHAINS * MAX_RULES as u32, BPF_F_MMAPABLE);
        #[map]
        pub(crate) static $hooks: Array<HookChains> = Array::pinned(HOOK_SLOTS, 0);
        #[map]
        pub(crate) static $counters: PerCpuArray<Counter> =
            PerCpuArray::pinned(COUNTERS_DEFAULT, 0);
        /// Who counts at each `COUNTERS` index ([`peerwall_common::counter_owner`]): what
        /// an event of a cached verdict names. Sized with `COUNTERS` by the loader.
        #[map]
        pub(crate) static $owners: Array<u32> = Array::pinned(COUNTERS_DEFAULT, 0);
    };
}

/// The chains' start bitmaps where a chain's protocol hash holds one per family
/// (`constrained::START_V4`), both slots in one map: the tc program references 64 maps, the
/// kernel's limit (`MAX_USED_MAPS`), with it. Index [`peerwall_common::start_index`].
#[map]
pub(crate) static START: Array<Bitmap> = Array::pinned(peerwall_common::START_ENTRIES, 0);

/// Destination rewrites of prerouting's NAT, per slot (`view.rs`): a handful of prefixes per
/// interface.
pub(crate) const VIEW_MAX: u32 = 4096;
#[map]
pub(crate) static VIEW0: LpmTrie<AddrKeyData, ViewTarget> = LpmTrie::pinned(VIEW_MAX, 0);
#[map]
pub(crate) static VIEW1: LpmTrie<AddrKeyData, ViewTarget> = LpmTrie::pinned(VIEW_MAX, 0);

slot_maps!(
    SRC0, DST0, SRCH0, DSTH0, SPORT0, DPORT0, PROTO0, IIF0, OIF0, CT0, MASKS0, CHAINS0, RULES0,
    HOOKS0, COUNTERS0, OWNERS0
);
slot_maps!(
    SRC1, DST1, SRCH1, DSTH1, SPORT1, DPORT1, PROTO1, IIF1, OIF1, CT1, MASKS1, CHAINS1, RULES1,
    HOOKS1, COUNTERS1, OWNERS1
);

/// The IPv4 hosts of the host maps of both slots in lines of one cache line
/// (`peerwall_common::lines`), looked up before them by chains of one bitmap word (`lines.rs`);
/// one map for the four tables (a program uses at most 64). Sized by the loader with the host
/// maps; mmapable: the loader writes words in place.
#[map]
pub(crate) static HOST_LINES: Array<HostLine> = Array::pinned(
    peerwall_common::host_line_entries(peerwall_common::host_lines_for(HOST_MAX)),
    BPF_F_MMAPABLE,
);

#[map]
pub(crate) static CONFIG: Array<Config> = Array::pinned(1, 0);

/// Emergency switch, separate so that one bpftool command flips it:
/// `bpftool map update pinned /sys/fs/bpf/peerwall/ALLOW_ALL key 0 0 0 0 value 1 0 0 0`.
#[map]
pub(crate) static ALLOW_ALL: Array<u32> = Array::pinned(1, 0);

#[inline(always)]
pub(crate) fn allow_all(cfg: &Config) -> bool {
    cfg.flags & flags::ALLOW_ALL != 0 || ALLOW_ALL.get(0).is_some_and(|v| *v != 0)
}
/// Interface types (link-layer header length): the loader's choice of tc entry, and `reject`,
/// which rebuilds the link-layer header. Nothing on the per-packet path looks them up.
#[map]
pub(crate) static IFACES: HashMap<u32, IfaceInfo> = HashMap::pinned(1024, 0);

/// Whether the live slot has NAT views (`VIEW<slot>` non-empty): most gateways have none, and
/// their packets then skip the lookup.
#[inline(always)]
pub(crate) fn has_views(cfg: &Config) -> bool {
    cfg.flags & flags::views(cfg.active & 1) != 0
}
/// `BPF_F_MMAPABLE`: an array's values start page-aligned, so each 64-byte value is one cache
/// line.
const BPF_F_MMAPABLE: u32 = 1 << 10;
/// Connection tracking in two tables (`conntrack.rs`): replied flows here, flows not replied
/// yet in `FLOWS_NEW`. A flood of new flows (a SYN flood, a spray of sources or ports) churns
/// `FLOWS_NEW` only: the LRU never evicts an established flow to make room for one that may
/// never be answered (conntrack's early drop of unassured entries, made structural).
#[map]
pub(crate) static FLOWS: LruHashMap<FlowKey, FlowState> = LruHashMap::pinned(FLOWS_MAX, 0);
/// Direct-mapped ([`peerwall_common::NewFlowSlot`], `conntrack.rs`): a flood's insert is one
/// cache line written. Page-aligned values (`BPF_F_MMAPABLE`), so each slot is one line.
#[map]
pub(crate) static FLOWS_NEW: Array<NewFlowSlot> = Array::pinned(NEW_FLOW_SLOTS, BPF_F_MMAPABLE);
/// When a flow was last written ([`peerwall_common::flow_seen_slot`]: a flow and its replies
/// share an entry; [`peerwall_common::flow_seen_stamp`] units): `conntrack.rs` writes it with
/// every `last_seen_ns`, and with [`peerwall_common::flags::FLOW_SEEN`] a packet whose entry is
/// idle longer than flows live is a new flow without a lookup in `FLOWS` or `FLOWS_NEW` (cold
/// misses in tables of several MiB: a flood of denied new flows paid them on every packet).
/// Its last [`peerwall_common::FLOW_SEEN_PAIRS`] stamps are per pair of addresses
/// ([`peerwall_common::flow_seen_pair_slot_of_words`]), written with each flow stamp and read
/// before it (`seen.rs`).
#[map]
/// [`peerwall_common::FLOW_SEEN_LANES`] stamps to an entry ([`SeenLine`]), page-aligned (`BPF_F_MMAPABLE`): one
/// cache line each, and user space writes stamps in place through the map's memory.
pub(crate) static FLOW_SEEN: Array<SeenLine> = Array::pinned(FLOW_SEEN_LINES, BPF_F_MMAPABLE);
/// `CT_SWEPT[0]`: until when (`bpf_ktime_get_ns`) `FLOW_SEEN` also covers every connection
/// the kernel's table holds, so that an idle entry there spares the kernel-table lookup
/// (`conntrack.rs`, `kernel_state`). The agent stamps the entries of the kernel's
/// connections and then writes this (`agent/backend/bpf/src/loader/seen.rs`); the program
/// zeroes it while the emergency switch lets connections start unstamped. Zero, or past: every
/// packet the kernel tracks asks the kernel, as exact and slower.
#[map]
pub(crate) static CT_SWEPT: Array<u64> = Array::pinned(1, 0);
/// `ENDED_UNTIL[0]`: until when (`bpf_ktime_get_ns`) a flow user space ended may still be
/// marked so in `FLOWS` (its mark lives [`ended_idle_ns`] past its last packet). User space
/// moves it past the marks' lifetime before it writes them (`loader/flows.rs`,
/// `mark_ended`); every packet that holds a mark moves it on (`conntrack.rs`, `ended_mark`).
/// Past it, the kernel-conntrack mode knows without looking that no mark is live: a packet
/// whose `FLOW_SEEN` entry is live (every entry is, under a flood of accepted new flows)
/// then spares `FLOWS`' two lookups.
#[map]
pub(crate) static ENDED_UNTIL: Array<u64> = Array::pinned(1, 0);
/// `FLOWS_NEW`'s slot count less one (a power of two less one): set by the loader (which may
/// size the table otherwise, `--flow-table-size`); read-only data the verifier sees as a
/// constant.
#[unsafe(no_mangle)]
static NEW_FLOW_MASK: u32 = NEW_FLOW_SLOTS - 1;

/// [`NEW_FLOW_MASK`], as loaded.
#[inline(always)]
pub(crate) fn new_flow_mask() -> u32 {
    // SAFETY: a plain read of a static; volatile, so that the value the loader wrote into the
    // object is read rather than the one compiled in.
    unsafe { core::ptr::read_volatile(&NEW_FLOW_MASK) }
}

/// The families whose TCP and UDP take their state from the kernel's connection table
/// (`kernel_ct.rs`) instead of this program's own tables: bit 0 IPv4, bit 1 IPv6
/// ([`peerwall_common::kfunc::KERNEL_CT_V4`], `_V6`); set by the loader, which resolved the
/// conntrack kfuncs then (`loader/kfunc.rs`). The verifier sees it as a constant: with 0
/// the kernel path is dead code.
#[unsafe(no_mangle)]
static KERNEL_CT: u32 = 0;

/// `offsetof(struct nf_conn, status)` in this kernel (from its BTF), set with [`KERNEL_CT`].
#[unsafe(no_mangle)]
static NF_CONN_STATUS_OFF: u32 = 0;

/// Whether [`KERNEL_CT`] is on for any family, as loaded.
#[inline(always)]
pub(crate) fn kernel_ct_on() -> bool {
    kernel_ct_families() != 0
}

/// [`KERNEL_CT`], as loaded.
#[inline(always)]
pub(crate) fn kernel_ct_families() -> u32 {
    // SAFETY: as in `new_flow_mask`.
    unsafe { core::ptr::read_volatile(&KERNEL_CT) }
}

/// `offsetof(struct sk_buff, mac_len)` in this kernel (from its BTF), for the tc entry of
/// every device type (`l2.rs`); set where the kernel offers `bpf_cast_to_kern_ctx`.
#[unsafe(no_mangle)]
static SKB_MAC_LEN_OFF: u32 = 0;

/// [`SKB_MAC_LEN_OFF`], as loaded.
#[inline(always)]
pub(crate) fn skb_mac_len_off() -> u32 {
    // SAFETY: as in `new_flow_mask`.
    unsafe { core::ptr::read_volatile(&SKB_MAC_LEN_OFF) }
}

/// [`NF_CONN_STATUS_OFF`], as loaded.
#[inline(always)]
pub(crate) fn nf_conn_status_off() -> u32 {
    // SAFETY: as in `new_flow_mask`.
    unsafe { core::ptr::read_volatile(&NF_CONN_STATUS_OFF) }
}

/// How long a flow user space ended stays ended after its last packet, either way, ns (the
/// agent's `--ended-connection-secs`, at most [`peerwall_common::ENDED_IDLE_MAX_NS`]; 0: an
/// ended flow is gone at once): set by the loader, like [`NEW_FLOW_MASK`]. Every packet of an
/// ended flow refreshes it (`conntrack.rs`), so it stays ended while either side sends.
#[unsafe(no_mangle)]
static ENDED_IDLE_NS: u64 = FLOW_IDLE_NS;

/// [`ENDED_IDLE_NS`], as loaded.
#[inline(always)]
pub(crate) fn ended_idle_ns() -> u64 {
    // SAFETY: as in `new_flow_mask`.
    unsafe { core::ptr::read_volatile(&ENDED_IDLE_NS) }
}

/// How long any flow of a `FLOW_SEEN` entry can stay live after its last write: the longer
/// of the two lifetimes.
#[inline(always)]
pub(crate) fn seen_horizon_ns() -> u64 {
    let ended = ended_idle_ns();
    if ended > FLOW_IDLE_NS {
        ended
    } else {
        FLOW_IDLE_NS
    }
}
/// Verdicts reused for the next packets of a flow (`cache.rs`), per family: IPv4 under a 16-byte
/// key, hashed by every packet of a known flow. Separate from `FLOWS`: a flood of denied flows
/// evicts cached verdicts, never connection state.
/// 16384 flows each (an LRU hash is preallocated: ~2 MiB per family per gateway); a flow
/// past them pays the full classification, not a wrong verdict.
pub(crate) const VERDICTS_MAX: u32 = 1 << 14;
#[map]
pub(crate) static VERDICTS4: LruHashMap<VerdictKey4, CachedVerdict> =
    LruHashMap::pinned(VERDICTS_MAX, NO_COMMON_LRU);
#[map]
pub(crate) static VERDICTS6: LruHashMap<FlowKey, CachedVerdict> =
    LruHashMap::pinned(VERDICTS_MAX, NO_COMMON_LRU);
/// Generations of the verdict caches' sets (`cache.rs`): shared by every program loaded on
/// these pins, so a commit by one invalidates what all of them cached.
#[map]
pub(crate) static VERDICT_GENS: Array<u32> = Array::pinned(CPU_VERDICT_SETS, 0);
/// The per-CPU first level of the IPv4 verdict cache (`cache.rs`), a region of
/// `CPU_VERDICT_SETS` per CPU: the loader sizes it for the machine's possible CPUs. Not pinned
/// (a cache of this program's; its size is the machine's).
#[map]
pub(crate) static VERDICTS4_CPU: Array<CpuVerdicts4> =
    Array::with_max_entries(CPU_VERDICT_SETS, BPF_F_MMAPABLE);
/// Per verdict-cache set, until when the shared level may serve a verdict of it
/// (`cache/fresh.rs`). Not pinned: a new program's starts empty, which only costs the flows
/// whose verdicts an older program cached one classification.
#[map]
pub(crate) static VERDICTS_FRESH: Array<FreshLine> =
    Array::with_max_entries(CPU_VERDICT_SETS / VERDICT_FRESH_LANES, BPF_F_MMAPABLE);
/// The tags of `VERDICTS4_CPU`'s ways (`cache/key.rs`), one entry per `CPU_VERDICT_TAG_SETS`
/// of its sets: the loader sizes it with `VERDICTS4_CPU`. Not pinned, for the same reason.
#[map]
pub(crate) static VERDICTS4_TAGS: Array<CpuVerdictTags> =
    Array::with_max_entries(CPU_VERDICT_SETS / CPU_VERDICT_TAG_SETS, BPF_F_MMAPABLE);
/// The per-CPU pair-drop cache (`cache/pair.rs`), a region of `PAIR_DROP_SETS` per CPU: the
/// loader sizes it with `VERDICTS4_CPU`. Not pinned, for the same reason.
#[map]
pub(crate) static PAIR_DROPS: Array<PairDrops> =
    Array::with_max_entries(PAIR_DROP_SETS, BPF_F_MMAPABLE);
#[map]
pub(crate) static LAST: PerCpuArray<ProbeRecord> = PerCpuArray::pinned(1, 0);
/// Per-CPU result of the chain being evaluated. Results live in map memory, not on the stack,
/// so the verifier sees one state after each chain instead of one per outcome.
#[map]
pub(crate) static SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);
/// Per-CPU packet under classification. Parsing, conntrack and routing leave their results
/// here and classification reads them back: the verifier then checks classification once,
/// not once per way the packet could have been parsed.
#[map]
pub(crate) static WORK: PerCpuArray<Work> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU buffer where `reject` builds its ICMP answer (too large for the stack).
#[map]
pub(crate) static REJECT_BUF: PerCpuArray<[u8; 96]> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU rule accumulator of the chain being evaluated.
#[map]
pub(crate) static ACC: PerCpuArray<Bitmap> = PerCpuArray::with_max_entries(1, 0);

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Scratch {
    pub(crate) action: u32,
    pub(crate) chain: u32,
    pub(crate) rule: u32,
    pub(crate) has_chain: u32,
    /// Chains run on the packet's path so far (may exceed the trail's length).
    pub(crate) steps: u32,
    /// `COUNTERS` index of each chain's deciding rule (or policy), in path order: what a
    /// cached verdict counts.
    pub(crate) trail: [u32; CACHED_COUNTERS],
    /// Action code of the first would-drop on the path (0: none), its chain, rule and step.
    pub(crate) audit: u32,
    pub(crate) audit_chain: u32,
    pub(crate) audit_rule: u32,
    pub(crate) audit_step: u32,
    /// A chain run under [`ct::OPEN_EITHER`] decided by a rule whose state match differs
    /// between new, established and related (not in the chain's `OPEN_EVERY` slot): the
    /// classification does not hold for every state the packet can have.
    pub(crate) ambiguous: u32,
    /// Under [`ct::OPEN_EITHER`]: the first chain whose decision for a `new` packet is not
    /// the one it took (`new_split` 1), at path step `new_step`: the decision for `new`
    /// there (action, rule or NO_RULE, its counter). Where the kernel's table then says
    /// `new`, the path as `new` is the one taken up to that chain, and ends there when that
    /// decision is final (a drop): no second classification (`settle_open_either`).
    pub(crate) new_split: u32,
    pub(crate) new_step: u32,
    pub(crate) new_action: u32,
    pub(crate) new_chain: u32,
    pub(crate) new_rule: u32,
    pub(crate) new_counter: u32,
    /// 1 once a chain on the path may have decided by a port: its bitmap still held rules
    /// when its port dimensions came (`classify.rs`). 0: every chain decided whatever the
    /// packet's ports, which a pair drop needs (`cache/pair.rs`).
    pub(crate) narrow: u32,
}

pub(crate) fn config() -> Config {
    match CONFIG.get(0) {
        Some(c) => *c,
        None => Config {
            active: 0,
            flags: 0,
        },
    }
}

// Events (`events.rs`): the ring the agent reads, its settings, the flows with recent events
// and each CPU's token bucket.

/// 256 KiB: about 2900 events waiting for the reader.
#[map]
pub(crate) static EVENTS: RingBuf = RingBuf::pinned(256 * 1024, 0);
#[map]
pub(crate) static EVENT_CONF: Array<EventConfig> = Array::pinned(1, 0);
/// Flows with recent events; LRU, so a flood of new flows evicts old state, bounded memory.
#[map]
pub(crate) static EVENT_FLOWS: LruHashMap<FlowKey, EventFlow> = LruHashMap::pinned(1 << 12, 0);

/// Per-CPU token bucket: tokens scaled by 1e9 (one token = one event).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Bucket {
    pub(crate) tokens: u64,
    pub(crate) last_ns: u64,
}

#[map]
pub(crate) static EVENT_BUCKET: PerCpuArray<Bucket> = PerCpuArray::with_max_entries(1, 0);

// The local routing table's mirror (`local.rs`).

/// The gateway's local destinations, mirrored by the agent from the namespace's local routing
/// table: chain 0, prefix length 64 + the prefix's.
#[map]
pub(crate) static LOCAL: LpmTrie<AddrKeyData, u32> = LpmTrie::pinned(LOCAL_MAX, 0);

/// `ROUTES[0]`: for which families [`LOCAL`] decides a packet's path, and until when.
#[map]
pub(crate) static ROUTES: Array<RouteMirror> = Array::pinned(1, 0);

// The clock measurements of `ttl.rs`.

/// The first (nanoseconds, jiffies) sample of [`crate::ttl::ttl`]'s measurement of HZ. Pinned, so that a
/// restarted agent keeps the measurement (`bpf_ktime_get_ns` and jiffies both count from boot,
/// and pins do not outlive a boot).
#[map]
pub(crate) static CLOCKS: Array<[u64; 2]> = Array::pinned(1, 0);
