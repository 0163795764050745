//! peerwall datapath: tc (tcx) and XDP classifiers over rule bitmaps in LPM tries.
//!
//! For a packet arriving on an attached interface the program reads its headers, asks the FIB
//! where it goes (forwarded through `oif`, or delivered to the gateway), derives its conntrack
//! state, and runs the filter chains of every hook on that path in order, as nftables would
//! (prerouting, forward, postrouting / prerouting, input). Per chain, each dimension (source and
//! destination prefix, source and destination port, family+protocol, input and output interface,
//! ct state) yields a bitmap of the rules it allows; their AND's lowest bit is the deciding rule,
//! no bit means the chain policy. Cost per chain is a fixed number of lookups: constant in the
//! number of rules and prefixes (the tries' depth is bounded by the key width).
//!
//! Two copies of every policy map exist (slot 0 and 1); `CONFIG.active` picks one, so a new
//! policy is written into the idle copy and switched to with one store.
//!
//! Unparseable IP packets (truncated or inconsistent headers) are dropped: the kernel's own IP
//! input would drop them too. Non-IP traffic (ARP, ...) passes. Non-first fragments carry no
//! ports: port matches (eq or neq) do not hold on them, as in nftables.
#![no_std]
#![no_main]
#![allow(static_mut_refs)]

use core::mem::size_of;

use aya_ebpf::bindings::{xdp_action, TC_ACT_OK, TC_ACT_SHOT};
use aya_ebpf::helpers::generated::{
    bpf_fib_lookup, bpf_ktime_get_ns, bpf_loop, bpf_redirect, bpf_skb_change_tail,
    bpf_skb_load_bytes, bpf_skb_store_bytes, bpf_xdp_load_bytes,
};
use aya_ebpf::macros::{classifier, map, xdp};
use aya_ebpf::maps::lpm_trie::Key;
use aya_ebpf::maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray};
use aya_ebpf::programs::{TcContext, XdpContext};
use aya_ebpf::EbpfContext;
use peerwall_common::{
    constrained, ct, dim, family, flags, hook, AddrKeyData, Bitmap, ChainInfo, Config, Counter,
    DimMasks, FlowKey, FlowState, HookChains, IfKey, IfaceInfo, PortKeyData, ProbeRecord, ProtoKey,
    RuleInfo, MAX_CHAINS, MAX_HOOK_CHAINS, MAX_RULES, PROBE_MAGIC, WORDS,
};

// ---------------------------------------------------------------------------------------------
// Maps. Names are the pin names under /sys/fs/bpf/peerwall/ (see README, "BPF map layout").

/// Prefix entries of the address dimensions (no preallocation: memory follows the policy).
const TRIE_MAX: u32 = 4 << 20;
const PORT_TRIE_MAX: u32 = 1 << 16;
const HASH_MAX: u32 = 1 << 14;
const FLOWS_MAX: u32 = 1 << 16;
const FLOW_IDLE_NS: u64 = 600_000_000_000;
/// `BPF_F_NO_PREALLOC`: hash maps sized for millions of hosts take memory as entries come.
const NO_PREALLOC: u32 = 1;

macro_rules! slot_maps {
    ($src:ident, $dst:ident, $srch:ident, $dsth:ident, $sport:ident, $dport:ident, $proto:ident, $iif:ident, $oif:ident,
     $ct:ident, $masks:ident, $chains:ident, $rules:ident, $hooks:ident, $counters:ident) => {
        #[map]
        static $src: LpmTrie<AddrKeyData, Bitmap> = LpmTrie::pinned(TRIE_MAX, 0);
        #[map]
        static $dst: LpmTrie<AddrKeyData, Bitmap> = LpmTrie::pinned(TRIE_MAX, 0);
        // Full-length prefixes (hosts: /32, /128) live in hash maps consulted first: an
        // exact-match lookup is O(1) where the trie walks its depth, and the tries stay small.
        #[map]
        static $srch: HashMap<AddrKeyData, Bitmap> = HashMap::pinned(TRIE_MAX, NO_PREALLOC);
        #[map]
        static $dsth: HashMap<AddrKeyData, Bitmap> = HashMap::pinned(TRIE_MAX, NO_PREALLOC);
        #[map]
        static $sport: LpmTrie<PortKeyData, Bitmap> = LpmTrie::pinned(PORT_TRIE_MAX, 0);
        #[map]
        static $dport: LpmTrie<PortKeyData, Bitmap> = LpmTrie::pinned(PORT_TRIE_MAX, 0);
        #[map]
        static $proto: HashMap<ProtoKey, Bitmap> = HashMap::pinned(HASH_MAX, 0);
        #[map]
        static $iif: HashMap<IfKey, Bitmap> = HashMap::pinned(HASH_MAX, 0);
        #[map]
        static $oif: HashMap<IfKey, Bitmap> = HashMap::pinned(HASH_MAX, 0);
        #[map]
        static $ct: Array<Bitmap> = Array::pinned(MAX_CHAINS * ct::SLOTS, 0);
        #[map]
        static $masks: Array<DimMasks> = Array::pinned(MAX_CHAINS * 4, 0);
        #[map]
        static $chains: Array<ChainInfo> = Array::pinned(MAX_CHAINS, 0);
        #[map]
        static $rules: Array<RuleInfo> = Array::pinned(MAX_CHAINS * MAX_RULES as u32, 0);
        #[map]
        static $hooks: Array<HookChains> = Array::pinned(10, 0);
        #[map]
        static $counters: PerCpuArray<Counter> =
            PerCpuArray::pinned(MAX_CHAINS * MAX_RULES as u32, 0);
    };
}

slot_maps!(
    SRC0, DST0, SRCH0, DSTH0, SPORT0, DPORT0, PROTO0, IIF0, OIF0, CT0, MASKS0, CHAINS0, RULES0,
    HOOKS0, COUNTERS0
);
slot_maps!(
    SRC1, DST1, SRCH1, DSTH1, SPORT1, DPORT1, PROTO1, IIF1, OIF1, CT1, MASKS1, CHAINS1, RULES1,
    HOOKS1, COUNTERS1
);

#[map]
static CONFIG: Array<Config> = Array::pinned(1, 0);
/// Emergency switch, separate so that one bpftool command flips it:
/// `bpftool map update pinned /sys/fs/bpf/peerwall/ALLOW_ALL key 0 0 0 0 value 1 0 0 0`.
#[map]
static ALLOW_ALL: Array<u32> = Array::pinned(1, 0);

#[inline(always)]
fn allow_all(cfg: &Config) -> bool {
    cfg.flags & flags::ALLOW_ALL != 0 || ALLOW_ALL.get(0).is_some_and(|v| *v != 0)
}
#[map]
static IFACES: HashMap<u32, IfaceInfo> = HashMap::pinned(1024, 0);
#[map]
static FLOWS: LruHashMap<FlowKey, FlowState> = LruHashMap::pinned(FLOWS_MAX, 0);
#[map]
static LAST: PerCpuArray<ProbeRecord> = PerCpuArray::pinned(1, 0);
/// Per-CPU result of the chain being evaluated. Results live in map memory, not on the stack,
/// so the verifier sees one state after each chain instead of one per outcome.
#[map]
static SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);
/// Per-CPU packet under classification. Parsing, conntrack and routing leave their results
/// here and classification reads them back: the verifier then checks classification once,
/// not once per way the packet could have been parsed.
#[map]
static WORK: PerCpuArray<Work> = PerCpuArray::with_max_entries(1, 0);

#[repr(C)]
#[derive(Clone, Copy)]
struct Work {
    p: Pkt,
    /// The packet quoted by an ICMP error.
    inner: Pkt,
    r: Route,
}

/// Per-CPU buffer where `reject` builds its ICMP answer (too large for the stack).
#[map]
static REJECT_BUF: PerCpuArray<[u8; 96]> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU rule accumulator of the chain being evaluated.
#[map]
static ACC: PerCpuArray<Bitmap> = PerCpuArray::with_max_entries(1, 0);

#[repr(C)]
#[derive(Clone, Copy)]
struct Scratch {
    action: u32,
    chain: u32,
    rule: u32,
    has_chain: u32,
}

// ---------------------------------------------------------------------------------------------
// Packet access common to tc (skb loads) and XDP (direct access with bounds checks).

trait Source {
    fn read<T: Copy>(&self, off: usize) -> Option<T>;
}

impl Source for TcContext {
    #[inline(always)]
    fn read<T: Copy>(&self, off: usize) -> Option<T> {
        self.load::<T>(off).ok()
    }
}

impl Source for XdpContext {
    #[inline(always)]
    fn read<T: Copy>(&self, off: usize) -> Option<T> {
        let mut v = core::mem::MaybeUninit::<T>::uninit();
        // SAFETY: the helper writes exactly size_of::<T>() bytes into `v` or fails.
        let rc = unsafe {
            bpf_xdp_load_bytes(
                self.ctx,
                off as u32,
                v.as_mut_ptr().cast(),
                size_of::<T>() as u32,
            )
        };
        if rc != 0 {
            return None;
        }
        // SAFETY: initialised by the successful helper call.
        Some(unsafe { v.assume_init() })
    }
}

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;

/// What the classifier needs of a packet.
#[repr(C)]
#[derive(Clone, Copy)]
struct Pkt {
    family: u8,
    proto: u8,
    /// Ports were read (TCP/UDP, first fragment).
    has_ports: bool,
    tcp_flags: u8,
    icmp_type: u8,
    sport: u16,
    dport: u16,
    /// ICMP echo id (host order).
    icmp_id: u16,
    src: [u8; 16],
    dst: [u8; 16],
    /// IP total length (bytes counted).
    len: u32,
    /// Offset of the layer-4 header from the IP header.
    l4: u32,
}

enum Parse {
    /// Not IP: not ours.
    NotIp,
    /// IP but unparseable: fail closed.
    Bad,
    /// Parsed into the output.
    Ok,
}

#[inline(always)]
fn parse<S: Source>(s: &S, l3: usize, ethertype: u16, p: &mut Pkt) -> Parse {
    *p = Pkt {
        family: 0,
        proto: 0,
        has_ports: false,
        tcp_flags: 0,
        icmp_type: 0,
        sport: 0,
        dport: 0,
        icmp_id: 0,
        src: [0; 16],
        dst: [0; 16],
        len: 0,
        l4: 0,
    };
    let first_frag;
    if ethertype == ETH_P_IP {
        let Some(vihl) = s.read::<u8>(l3) else {
            return Parse::Bad;
        };
        if vihl >> 4 != 4 {
            return Parse::Bad;
        }
        let ihl = ((vihl & 0x0f) as u32) * 4;
        if ihl < 20 {
            return Parse::Bad;
        }
        let Some(tot) = s.read::<[u8; 2]>(l3 + 2) else {
            return Parse::Bad;
        };
        let Some(frag) = s.read::<[u8; 2]>(l3 + 6) else {
            return Parse::Bad;
        };
        let Some(proto) = s.read::<u8>(l3 + 9) else {
            return Parse::Bad;
        };
        let Some(src) = s.read::<[u8; 4]>(l3 + 12) else {
            return Parse::Bad;
        };
        let Some(dst) = s.read::<[u8; 4]>(l3 + 16) else {
            return Parse::Bad;
        };
        p.family = family::V4;
        p.proto = proto;
        p.len = u16::from_be_bytes(tot) as u32;
        if p.len < ihl {
            return Parse::Bad;
        }
        p.src[..4].copy_from_slice(&src);
        p.dst[..4].copy_from_slice(&dst);
        p.l4 = ihl;
        first_frag = (u16::from_be_bytes(frag) & 0x1fff) == 0;
    } else if ethertype == ETH_P_IPV6 {
        let Some(v) = s.read::<u8>(l3) else {
            return Parse::Bad;
        };
        if v >> 4 != 6 {
            return Parse::Bad;
        }
        let Some(plen) = s.read::<[u8; 2]>(l3 + 4) else {
            return Parse::Bad;
        };
        let Some(mut next) = s.read::<u8>(l3 + 6) else {
            return Parse::Bad;
        };
        let Some(src) = s.read::<[u8; 16]>(l3 + 8) else {
            return Parse::Bad;
        };
        let Some(dst) = s.read::<[u8; 16]>(l3 + 24) else {
            return Parse::Bad;
        };
        p.family = family::V6;
        p.src = src;
        p.dst = dst;
        p.len = 40 + u16::from_be_bytes(plen) as u32;
        let mut off: u32 = 40;
        let mut ff = true;
        // Extension headers, bounded: hop-by-hop, routing, fragment, destination options, AH.
        let mut i = 0;
        while i < 6 {
            i += 1;
            match next {
                0 | 43 | 60 => {
                    let Some(h) = s.read::<[u8; 2]>(l3 + off as usize) else {
                        return Parse::Bad;
                    };
                    next = h[0];
                    off += (h[1] as u32 + 1) * 8;
                }
                51 => {
                    let Some(h) = s.read::<[u8; 2]>(l3 + off as usize) else {
                        return Parse::Bad;
                    };
                    next = h[0];
                    off += (h[1] as u32 + 2) * 4;
                }
                44 => {
                    let Some(h) = s.read::<[u8; 4]>(l3 + off as usize) else {
                        return Parse::Bad;
                    };
                    next = h[0];
                    if (u16::from_be_bytes([h[2], h[3]]) & 0xfff8) != 0 {
                        ff = false;
                    }
                    off += 8;
                }
                _ => break,
            }
            if off > 512 {
                return Parse::Bad;
            }
        }
        p.proto = next;
        p.l4 = off;
        first_frag = ff;
    } else {
        return Parse::NotIp;
    }
    if !first_frag {
        return Parse::Ok;
    }
    let l4 = l3 + p.l4 as usize;
    match p.proto {
        IPPROTO_TCP | IPPROTO_UDP => {
            let Some(ports) = s.read::<[u8; 4]>(l4) else {
                return Parse::Bad;
            };
            p.sport = u16::from_be_bytes([ports[0], ports[1]]);
            p.dport = u16::from_be_bytes([ports[2], ports[3]]);
            p.has_ports = true;
            if p.proto == IPPROTO_TCP {
                let Some(f) = s.read::<u8>(l4 + 13) else {
                    return Parse::Bad;
                };
                p.tcp_flags = f;
            }
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            let Some(h) = s.read::<[u8; 6]>(l4) else {
                return Parse::Bad;
            };
            p.icmp_type = h[0];
            p.icmp_id = u16::from_be_bytes([h[4], h[5]]);
        }
        _ => {}
    }
    Parse::Ok
}

// ---------------------------------------------------------------------------------------------
// Connection tracking (an LRU of flows, original direction as key).

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

fn flow_key(p: &Pkt) -> FlowKey {
    let (sport, dport) = if p.proto == IPPROTO_ICMP || p.proto == IPPROTO_ICMPV6 {
        (p.icmp_id, 0)
    } else {
        (p.sport, p.dport)
    };
    FlowKey {
        src: p.src,
        dst: p.dst,
        sport: sport.to_be_bytes(),
        dport: dport.to_be_bytes(),
        proto: p.proto,
        family: p.family,
        _pad: [0; 2],
    }
}

/// The key of the opposite direction. ICMP echo keeps its identifier in `sport` both ways.
fn reverse(k: &FlowKey) -> FlowKey {
    let icmp = k.proto == IPPROTO_ICMP || k.proto == IPPROTO_ICMPV6;
    FlowKey {
        src: k.dst,
        dst: k.src,
        sport: if icmp { k.sport } else { k.dport },
        dport: if icmp { k.dport } else { k.sport },
        proto: k.proto,
        family: k.family,
        _pad: [0; 2],
    }
}

#[inline(always)]
fn fresh(st: &FlowState, now: u64) -> bool {
    now.wrapping_sub(st.last_seen_ns) < FLOW_IDLE_NS
}

/// ICMP types that are errors (quote another packet).
fn icmp_is_error(p: &Pkt) -> bool {
    if p.proto == IPPROTO_ICMP {
        matches!(p.icmp_type, 3 | 4 | 5 | 11 | 12)
    } else {
        matches!(p.icmp_type, 1..=4)
    }
}

/// ICMP types a flow cannot start with (replies).
fn icmp_is_reply(p: &Pkt) -> bool {
    if p.proto == IPPROTO_ICMP {
        matches!(p.icmp_type, 0 | 14 | 16 | 18)
    } else {
        p.icmp_type == 129
    }
}

/// Echo requests are tracked by id; ICMP types other than echo carry no usable id.
fn icmp_keyed(p: &Pkt) -> bool {
    if p.proto == IPPROTO_ICMP {
        matches!(p.icmp_type, 0 | 8)
    } else {
        matches!(p.icmp_type, 128 | 129)
    }
}

/// Conntrack state of the packet.
#[inline(never)]
fn ct_state<S: Source>(s: &S, l3: usize, p: &Pkt) -> u32 {
    let now = unsafe { bpf_ktime_get_ns() };
    if p.proto == IPPROTO_TCP && p.has_ports {
        let f = p.tcp_flags & (TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK);
        // The combinations conntrack accepts (tcp_valid_flags), URG/PSH aside.
        let valid = matches!(f, TCP_SYN | 0x12 | TCP_RST | 0x14 | 0x11 | TCP_ACK);
        if !valid {
            return ct::INVALID;
        }
    }
    let is_icmp = p.proto == IPPROTO_ICMP || p.proto == IPPROTO_ICMPV6;
    if is_icmp && icmp_is_error(p) {
        // Quoted packet: its flow, seen from the quoting side, is the reverse.
        let q = l3 + p.l4 as usize + 8;
        let Some(ip) = WORK.get_ptr_mut(0) else {
            return ct::INVALID;
        };
        // SAFETY: per-CPU slot of a successful lookup; `inner` is not the packet `p` points at.
        let inner = unsafe { &mut (*ip).inner };
        let fam = if p.family == family::V4 {
            ETH_P_IP
        } else {
            ETH_P_IPV6
        };
        if !matches!(parse(s, q, fam, inner), Parse::Ok) {
            return ct::INVALID;
        }
        let k = flow_key(inner);
        // SAFETY: read-only lookups of plain data.
        let known = unsafe {
            FLOWS.get(&k).is_some_and(|st| fresh(st, now))
                || FLOWS.get(&reverse(&k)).is_some_and(|st| fresh(st, now))
        };
        return if known { ct::RELATED } else { ct::INVALID };
    }
    if is_icmp && !icmp_keyed(p) {
        return if icmp_is_reply(p) {
            ct::INVALID
        } else {
            ct::NEW
        };
    }
    let k = flow_key(p);
    // SAFETY: plain data.
    if let Some(st) = unsafe { FLOWS.get(&k) } {
        if fresh(st, now) {
            return if st.replied != 0 {
                ct::ESTABLISHED
            } else {
                ct::NEW
            };
        }
    }
    if let Some(st) = unsafe { FLOWS.get(&reverse(&k)) } {
        if fresh(st, now) {
            return ct::ESTABLISHED;
        }
    }
    if is_icmp && icmp_is_reply(p) {
        return ct::INVALID;
    }
    ct::NEW
}

/// After an accept: create the flow (new) or note the reply (established).
#[inline(never)]
fn ct_commit(p: &Pkt, state: u32) {
    let now = unsafe { bpf_ktime_get_ns() };
    let is_icmp = p.proto == IPPROTO_ICMP || p.proto == IPPROTO_ICMPV6;
    if state == ct::INVALID || state == ct::RELATED || (is_icmp && !icmp_keyed(p)) {
        return;
    }
    let k = flow_key(p);
    if let Some(st) = FLOWS.get_ptr_mut(&k) {
        // SAFETY: pointer from a successful lookup.
        unsafe { (*st).last_seen_ns = now };
        return;
    }
    let r = reverse(&k);
    if let Some(st) = FLOWS.get_ptr_mut(&r) {
        // SAFETY: pointer from a successful lookup.
        unsafe {
            (*st).last_seen_ns = now;
            (*st).replied = 1;
        }
        return;
    }
    if state == ct::NEW {
        let _ = FLOWS.insert(
            &k,
            &FlowState {
                last_seen_ns: now,
                replied: 0,
                _pad: [0; 7],
            },
            0,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Classification.

const ACT_ACCEPT: u8 = 0;
const ACT_DROP: u8 = 1;
const ACT_REJECT: u8 = 2;
const NO_RULE: u32 = u32::MAX;

/// Inputs of one chain evaluation.
#[repr(C)]
#[derive(Clone, Copy)]
struct Query {
    /// Count packets in the rule counters (tc always; XDP only for what it drops).
    count: bool,
    chain: u32,
    iif: u32,
    oif: u32,
    state: u32,
    p: Pkt,
}

/// acc &= b; whether any bit is left. A missing bitmap allows no rule.
#[inline(always)]
fn step(acc: &mut Bitmap, b: Option<&Bitmap>) -> bool {
    let Some(b) = b else {
        return false;
    };
    let mut any = 0u64;
    let mut i = 0;
    while i < WORDS {
        acc.w[i] &= b.w[i];
        any |= acc.w[i];
        i += 1;
    }
    any != 0
}

/// acc &= (lookup ^ neg) | any; a missing lookup is an empty bitmap.
#[inline(always)]
fn step_masked(acc: &mut Bitmap, l: Option<&Bitmap>, m: Option<&DimMasks>) -> bool {
    let Some(m) = m else {
        return false;
    };
    let mut any = 0u64;
    let mut i = 0;
    match l {
        Some(b) => {
            while i < WORDS {
                acc.w[i] &= (b.w[i] ^ m.neg.w[i]) | m.any.w[i];
                any |= acc.w[i];
                i += 1;
            }
        }
        None => {
            while i < WORDS {
                acc.w[i] &= m.neg.w[i] | m.any.w[i];
                any |= acc.w[i];
                i += 1;
            }
        }
    }
    any != 0
}

fn addr_data(chain: u32, p: &Pkt, addr: &[u8; 16]) -> AddrKeyData {
    AddrKeyData {
        chain: chain.to_be_bytes(),
        family: (p.family as u32).to_be_bytes(),
        addr: *addr,
    }
}

fn addr_key(chain: u32, p: &Pkt, addr: &[u8; 16]) -> Key<AddrKeyData> {
    let bits = if p.family == family::V4 { 32 } else { 128 };
    Key::new(
        peerwall_common::ADDR_KEY_FIXED_BITS + bits,
        addr_data(chain, p, addr),
    )
}

fn port_key(chain: u32, port: u16) -> Key<PortKeyData> {
    Key::new(
        peerwall_common::PORT_KEY_FIXED_BITS + 16,
        PortKeyData {
            chain: chain.to_be_bytes(),
            port: port.to_be_bytes(),
            _pad: [0; 2],
        },
    )
}

macro_rules! slot_eval {
    ($name:ident, $src:ident, $dst:ident, $srch:ident, $dsth:ident, $sport:ident, $dport:ident, $proto:ident, $iif:ident,
     $oif:ident, $ct:ident, $masks:ident, $chains:ident, $rules:ident, $counters:ident) => {
        /// Run one chain; the outcome goes to `SCRATCH` (action, deciding rule or NO_RULE).
        #[inline(never)]
        fn $name(q: &Query) -> u32 {
            let (action, idx) = $name::run(q);
            if let Some(sc) = SCRATCH.get_ptr_mut(0) {
                // SAFETY: per-CPU slot of a successful lookup.
                unsafe {
                    (*sc).action = action as u32;
                    (*sc).rule = idx;
                    (*sc).chain = q.chain;
                    (*sc).has_chain = 1;
                }
            }
            0
        }

        mod $name {
            use super::*;

            #[inline(always)]
            pub(super) fn run(q: &Query) -> (u8, u32) {
                let chain = q.chain;
                let Some(info) = $chains.get(chain) else {
                    return (ACT_DROP, NO_RULE);
                };
                let policy = info.policy;
                let nrules = info.rules;
                let pk = ProtoKey {
                    chain,
                    family: q.p.family,
                    proto: q.p.proto,
                    _pad: [0; 2],
                };
                // SAFETY: read-only lookups of plain data.
                // Protocols no rule names share the family's "other" entry (`_pad[0] = 1`).
                let other = ProtoKey {
                    chain,
                    family: q.p.family,
                    proto: 0,
                    _pad: [1, 0],
                };
                let found = unsafe { $proto.get(&pk) }.or_else(|| unsafe { $proto.get(&other) });
                let Some(first) = found else {
                    return (policy, NO_RULE);
                };
                // The accumulator lives in per-CPU map memory: whatever path led here, the
                // verifier sees the same state afterwards and prunes.
                let Some(accp) = ACC.get_ptr_mut(0) else {
                    return (ACT_DROP, NO_RULE);
                };
                // SAFETY: per-CPU slot of a successful lookup, used only by this CPU's program.
                let acc = unsafe { &mut *accp };
                acc.w = first.w;
                let cons = info.constrained;
                let done = 'dims: {
                    if cons & constrained::IIF != 0 {
                        let ik = IfKey {
                            chain,
                            ifindex: q.iif,
                        };
                        let ib = unsafe { $iif.get(&ik) }
                            .or_else(|| unsafe { $iif.get(&IfKey { chain, ifindex: 0 }) });
                        if !step(acc, ib) {
                            break 'dims true;
                        }
                    }
                    if cons & constrained::OIF != 0 {
                        let ok = IfKey {
                            chain,
                            ifindex: q.oif,
                        };
                        let ob = unsafe { $oif.get(&ok) }
                            .or_else(|| unsafe { $oif.get(&IfKey { chain, ifindex: 0 }) });
                        if !step(acc, ob) {
                            break 'dims true;
                        }
                    }
                    if cons & constrained::CT != 0
                        && !step(acc, $ct.get(chain * ct::SLOTS + q.state))
                    {
                        break 'dims true;
                    }
                    if cons & constrained::SRC != 0
                        && !step_masked(
                            acc,
                            // SAFETY: read-only lookup of plain data.
                            unsafe { $srch.get(&addr_data(chain, &q.p, &q.p.src)) }
                                .or_else(|| $src.get(addr_key(chain, &q.p, &q.p.src))),
                            $masks.get(chain * 4 + dim::SRC),
                        )
                    {
                        break 'dims true;
                    }
                    if cons & constrained::DST != 0
                        && !step_masked(
                            acc,
                            // SAFETY: read-only lookup of plain data.
                            unsafe { $dsth.get(&addr_data(chain, &q.p, &q.p.dst)) }
                                .or_else(|| $dst.get(addr_key(chain, &q.p, &q.p.dst))),
                            $masks.get(chain * 4 + dim::DST),
                        )
                    {
                        break 'dims true;
                    }
                    if q.p.has_ports {
                        if cons & constrained::SPORT != 0
                            && !step_masked(
                                acc,
                                $sport.get(port_key(chain, q.p.sport)),
                                $masks.get(chain * 4 + dim::SPORT),
                            )
                        {
                            break 'dims true;
                        }
                        if cons & constrained::DPORT != 0
                            && !step_masked(
                                acc,
                                $dport.get(port_key(chain, q.p.dport)),
                                $masks.get(chain * 4 + dim::DPORT),
                            )
                        {
                            break 'dims true;
                        }
                    }
                    false
                };
                let rule = if done { None } else { acc.first() };
                let (action, idx) = match rule {
                    Some(r) if (r as u32) < nrules => {
                        let r = r as u32;
                        match $rules.get(chain * MAX_RULES as u32 + r) {
                            Some(ri) => (ri.action, r),
                            None => (ACT_DROP, r),
                        }
                    }
                    _ => (policy, NO_RULE),
                };
                let slot = if idx == NO_RULE {
                    MAX_RULES as u32 - 1
                } else {
                    idx
                };
                if !q.count {
                    return (action, idx);
                }
                if let Some(c) = $counters.get_ptr_mut(chain * MAX_RULES as u32 + slot) {
                    // SAFETY: per-CPU slot of a successful lookup.
                    unsafe {
                        (*c).packets += 1;
                        (*c).bytes += q.p.len as u64;
                    }
                }
                (action, idx)
            }
        }
    };
}

slot_eval!(
    eval0, SRC0, DST0, SRCH0, DSTH0, SPORT0, DPORT0, PROTO0, IIF0, OIF0, CT0, MASKS0, CHAINS0,
    RULES0, COUNTERS0
);
slot_eval!(
    eval1, SRC1, DST1, SRCH1, DSTH1, SPORT1, DPORT1, PROTO1, IIF1, OIF1, CT1, MASKS1, CHAINS1,
    RULES1, COUNTERS1
);

/// Outcome of the whole path.
struct Outcome {
    action: u8,
    chain: u32,
    rule: u32,
    has_chain: bool,
}

#[inline(always)]
fn hooks_of(slot: u32, idx: u32) -> Option<&'static HookChains> {
    if slot == 0 {
        HOOKS0.get(idx)
    } else {
        HOOKS1.get(idx)
    }
}

/// State shared with the per-chain callback of `bpf_loop`.
#[repr(C)]
struct LoopCtx {
    q: Query,
    slot: u32,
    /// Index into `HOOKS`.
    hook_idx: u32,
    /// Set when a chain refused the packet.
    refused: u32,
}

/// One iteration: evaluate chain `index` of the hook. The verifier checks this body once per
/// `bpf_loop` call site, whatever the number of chains.
extern "C" fn chain_step(index: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: `ctx` is the LoopCtx on the caller's stack that bpf_loop hands back.
    let lc = unsafe { &mut *(ctx as *mut LoopCtx) };
    let Some(hc) = hooks_of(lc.slot, lc.hook_idx) else {
        return 1;
    };
    let i = index as usize;
    if i >= MAX_HOOK_CHAINS {
        return 1;
    }
    lc.q.chain = hc.chains[i];
    if lc.slot == 0 {
        eval0(&lc.q);
    } else {
        eval1(&lc.q);
    }
    let a = match SCRATCH.get(0) {
        Some(sc) => sc.action,
        None => ACT_DROP as u32,
    };
    if a != ACT_ACCEPT as u32 {
        lc.refused = 1;
        return 1;
    }
    0
}

/// Run every chain of `hk` for the packet; false when the packet was refused.
#[inline(always)]
fn run_hook(slot: u32, hk: u32, q: &mut Query) -> bool {
    let fidx = if q.p.family == family::V4 { 0 } else { 1 };
    let hook_idx = hk * 2 + fidx;
    let count = match hooks_of(slot, hook_idx) {
        Some(hc) => hc.count.min(MAX_HOOK_CHAINS as u32),
        None => return true,
    };
    if count == 0 {
        return true;
    }
    let mut lc = LoopCtx {
        q: *q,
        slot,
        hook_idx,
        refused: 0,
    };
    // SAFETY: bpf_loop calls `chain_step` with a pointer to `lc`, which outlives the call.
    unsafe {
        bpf_loop(
            count,
            chain_step as *mut core::ffi::c_void,
            (&mut lc as *mut LoopCtx).cast(),
            0,
        );
    }
    lc.refused == 0
}

const PATH_INPUT: u32 = 0;
const PATH_FORWARD: u32 = 1;

/// Evaluate the packet's path: (prerouting, forward, postrouting) or (prerouting, input).
#[inline(never)]
fn classify(route: &Route, p: &Pkt) -> u32 {
    let (slot, path, iif, oif, state, count) = (
        route.slot,
        route.path,
        route.iif,
        route.oif,
        route.state,
        route.count,
    );
    if let Some(sc) = SCRATCH.get_ptr_mut(0) {
        // SAFETY: per-CPU slot of a successful lookup.
        unsafe {
            (*sc).action = ACT_ACCEPT as u32;
            (*sc).chain = 0;
            (*sc).rule = NO_RULE;
            (*sc).has_chain = 0;
        }
    }
    let mut q = Query {
        count,
        chain: 0,
        iif,
        oif: 0,
        state,
        p: *p,
    };
    if !run_hook(slot, hook::PREROUTING, &mut q) {
        return 0;
    }
    if path == PATH_FORWARD {
        q.oif = oif;
        if !run_hook(slot, hook::FORWARD, &mut q) {
            return 0;
        }
        let _ = run_hook(slot, hook::POSTROUTING, &mut q);
    } else {
        let _ = run_hook(slot, hook::INPUT, &mut q);
    }
    0
}

/// The outcome `classify` left in `SCRATCH` (drop when unreadable: fail closed).
#[inline(always)]
fn outcome() -> Outcome {
    match SCRATCH.get(0) {
        Some(sc) => Outcome {
            action: sc.action as u8,
            chain: sc.chain,
            rule: sc.rule,
            has_chain: sc.has_chain != 0,
        },
        None => Outcome {
            action: ACT_DROP,
            chain: 0,
            rule: NO_RULE,
            has_chain: false,
        },
    }
}

/// Kernel layout of `struct bpf_fib_lookup` (64 bytes), unions flattened.
#[repr(C)]
struct FibParams {
    family: u8,
    l4_protocol: u8,
    sport: u16,
    dport: u16,
    tot_len: u16,
    ifindex: u32,
    flowinfo: u32,
    src: [u8; 16],
    dst: [u8; 16],
    vlan_proto: u16,
    vlan_tci: u16,
    smac: [u8; 6],
    dmac: [u8; 6],
}

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const FIB_SKIP_NEIGH: u32 = 4;
const FIB_SUCCESS: i64 = 0;
const FIB_NOT_FWDED: i64 = 4;
const FIB_NO_NEIGH: i64 = 7;

/// Path of a packet, the interfaces the chains see, and how to evaluate it.
#[repr(C)]
#[derive(Clone, Copy)]
struct Route {
    slot: u32,
    path: u32,
    iif: u32,
    oif: u32,
    state: u32,
    count: bool,
}

/// Where the kernel will send the packet: (path, oif).
#[inline(never)]
fn route<C: EbpfContext>(ctx: &C, p: &Pkt, iif: u32) -> (u32, u32) {
    let mut f = FibParams {
        family: if p.family == family::V4 {
            AF_INET
        } else {
            AF_INET6
        },
        l4_protocol: p.proto,
        sport: p.sport.to_be(),
        dport: p.dport.to_be(),
        tot_len: 0,
        ifindex: iif,
        flowinfo: 0,
        src: p.src,
        dst: p.dst,
        vlan_proto: 0,
        vlan_tci: 0,
        smac: [0; 6],
        dmac: [0; 6],
    };
    // SAFETY: `f` has the kernel's layout and size; the context pointer is the program's own.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.as_ptr(),
            (&mut f as *mut FibParams).cast(),
            size_of::<FibParams>() as i32,
            FIB_SKIP_NEIGH,
        )
    };
    match rc {
        FIB_SUCCESS | FIB_NO_NEIGH => (PATH_FORWARD, f.ifindex),
        FIB_NOT_FWDED => (PATH_INPUT, 0),
        // Unroutable: the kernel drops it after prerouting; only prerouting chains matter,
        // which the input path runs first (its input chains then cannot change the outcome
        // the kernel imposes).
        _ => (PATH_INPUT, 0),
    }
}

fn config() -> Config {
    match CONFIG.get(0) {
        Some(c) => *c,
        None => Config {
            active: 0,
            flags: 0,
        },
    }
}

fn record(out: &Outcome) {
    if let Some(r) = LAST.get_ptr_mut(0) {
        // SAFETY: per-CPU slot of a successful lookup.
        unsafe {
            (*r).seq = (*r).seq.wrapping_add(1);
            (*r).verdict = out.action;
            (*r).has_chain = out.has_chain as u8;
            (*r).has_rule = (out.rule != NO_RULE) as u8;
            (*r).chain = out.chain;
            (*r).rule = out.rule;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Program entries.

#[classifier]
pub fn peerwall_tc(ctx: TcContext) -> i32 {
    match try_tc(&ctx) {
        Ok(v) => v,
        Err(()) => TC_ACT_SHOT,
    }
}

fn try_tc(ctx: &TcContext) -> Result<i32, ()> {
    let cfg = config();
    if allow_all(&cfg) {
        return Ok(TC_ACT_OK);
    }
    // SAFETY: the skb pointer is the program's context.
    let (ifindex, proto) = unsafe { ((*ctx.skb.skb).ifindex, (*ctx.skb.skb).protocol) };
    let ethertype = u16::from_be(proto as u16);
    if ethertype != ETH_P_IP && ethertype != ETH_P_IPV6 {
        return Ok(TC_ACT_OK);
    }
    // SAFETY: plain data.
    let l2 = match unsafe { IFACES.get(&ifindex) } {
        Some(i) => i.l2_len as usize,
        None => 14,
    };
    let Some(w) = WORK.get_ptr_mut(0) else {
        return Err(());
    };
    // SAFETY: per-CPU slot of a successful lookup; the packet is parsed in place.
    let p = unsafe { &mut (*w).p };
    match parse(ctx, l2 & 0xff, ethertype, p) {
        Parse::NotIp => return Ok(TC_ACT_OK),
        Parse::Bad => return Err(()),
        Parse::Ok => {}
    }
    let probe = cfg.flags & flags::PROBE != 0 && ctx.cb()[0] == PROBE_MAGIC;
    let state = ct_state(ctx, l2 & 0xff, p);
    let slot = cfg.active & 1;
    let r = if probe {
        let cb = ctx.cb();
        Route {
            slot,
            path: cb[1],
            iif: cb[3],
            oif: cb[2],
            state,
            count: true,
        }
    } else {
        let (path, oif) = route(ctx, p, ifindex);
        Route {
            slot,
            path,
            iif: ifindex,
            oif,
            state,
            count: true,
        }
    };
    // SAFETY: as above.
    unsafe { (*w).r = r };
    classify_work();
    Ok(finish_tc(ctx, probe))
}

/// Classify the packet in `WORK`.
#[inline(never)]
fn classify_work() -> u32 {
    match WORK.get(0) {
        Some(w) => classify(&w.r, &w.p),
        None => 0,
    }
}

/// Act on the outcome of `WORK`'s packet: conntrack, probe record, tc verdict.
#[inline(never)]
fn finish_tc(ctx: &TcContext, probe: bool) -> i32 {
    let out = outcome();
    if probe {
        record(&out);
    }
    match out.action {
        ACT_ACCEPT => {
            if let Some(w) = WORK.get(0) {
                ct_commit(&w.p, w.r.state);
            }
            TC_ACT_OK
        }
        ACT_REJECT => reject(ctx),
        _ => TC_ACT_SHOT,
    }
}

const TC_ACT_REDIRECT: i32 = 7;

/// One's-complement sum of big-endian 16-bit words.
#[inline(always)]
fn csum_add(mut sum: u32, b: &[u8]) -> u32 {
    let mut i = 0;
    while i + 1 < b.len() {
        sum += u16::from_be_bytes([b[i], b[i + 1]]) as u32;
        i += 2;
    }
    sum
}

#[inline(always)]
fn csum_fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// Copy the start of the packet's IP header into `dst` (its length is a constant at each call).
#[inline(always)]
fn load_quote(ctx: &TcContext, l2: usize, dst: &mut [u8]) -> bool {
    // SAFETY: the helper writes dst.len() bytes into `dst`.
    unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb.cast(),
            l2 as u32,
            dst.as_mut_ptr().cast(),
            dst.len() as u32,
        ) == 0
    }
}

/// Turn the packet into an ICMP (ICMPv6) port-unreachable quoting it and send it back out of
/// the interface it came in on, as nftables' `reject` does. Packets the kernel would not answer
/// (ICMP errors, non-first fragments, IPv4 with options) are dropped silently.
#[inline(never)]
fn reject(ctx: &TcContext) -> i32 {
    let Some(w) = WORK.get(0) else {
        return TC_ACT_SHOT;
    };
    let p = &w.p;
    let is_icmp = p.proto == IPPROTO_ICMP || p.proto == IPPROTO_ICMPV6;
    if (is_icmp && icmp_is_error(p)) || (!p.has_ports && !is_icmp && p.l4 == 0) {
        return TC_ACT_SHOT;
    }
    // SAFETY: the skb pointer is the program's context.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain data.
    let l2 = match unsafe { IFACES.get(&ifindex) } {
        Some(i) => i.l2_len as usize,
        None => 14,
    } & 0xff;
    if l2 == 14 {
        let Ok(macs) = ctx.load::<[u8; 12]>(0) else {
            return TC_ACT_SHOT;
        };
        let mut swapped = [0u8; 12];
        swapped[..6].copy_from_slice(&macs[6..12]);
        swapped[6..].copy_from_slice(&macs[..6]);
        if ctx.store(0, &swapped, 0).is_err() {
            return TC_ACT_SHOT;
        }
    } else if l2 != 0 {
        return TC_ACT_SHOT;
    }
    let Some(bp) = REJECT_BUF.get_ptr_mut(0) else {
        return TC_ACT_SHOT;
    };
    // SAFETY: per-CPU buffer of a successful lookup.
    let m = unsafe { &mut *bp };
    *m = [0u8; 96];
    let len = if p.family == family::V4 {
        // IPv4 header (20) + ICMP header (8) + quote: the IP header and 8 bytes of layer 4.
        if p.l4 != 20 || !load_quote(ctx, l2, &mut m[28..56]) {
            return TC_ACT_SHOT;
        }
        m[0] = 0x45;
        m[1] = 0xc0;
        m[2..4].copy_from_slice(&56u16.to_be_bytes());
        m[8] = 64;
        m[9] = IPPROTO_ICMP;
        // From the address the packet was sent to, back to its sender.
        m[12..16].copy_from_slice(&p.dst[..4]);
        m[16..20].copy_from_slice(&p.src[..4]);
        let ipsum = csum_fold(csum_add(0, &m[..20]));
        m[10..12].copy_from_slice(&ipsum.to_be_bytes());
        m[20] = 3; // destination unreachable
        m[21] = 3; // port unreachable
        let icsum = csum_fold(csum_add(0, &m[20..56]));
        m[22..24].copy_from_slice(&icsum.to_be_bytes());
        56
    } else {
        // IPv6 header (40) + ICMPv6 header (8) + quote: the IPv6 header and 8 bytes.
        if !load_quote(ctx, l2, &mut m[48..96]) {
            return TC_ACT_SHOT;
        }
        m[0] = 0x60;
        m[4..6].copy_from_slice(&56u16.to_be_bytes());
        m[6] = IPPROTO_ICMPV6;
        m[7] = 64;
        m[8..24].copy_from_slice(&p.dst);
        m[24..40].copy_from_slice(&p.src);
        m[40] = 1; // destination unreachable
        m[41] = 4; // port unreachable
                   // Pseudo-header: addresses, upper-layer length, next header.
        let mut sum = csum_add(0, &m[8..40]);
        sum += 56 + IPPROTO_ICMPV6 as u32;
        sum = csum_add(sum, &m[40..96]);
        let c = csum_fold(sum);
        m[42..44].copy_from_slice(&c.to_be_bytes());
        96
    };
    // Shrink the packet to the answer and write it over the original headers.
    // SAFETY: resizing the skb this program owns; the buffer holds `len` (<= 96) bytes.
    unsafe {
        if bpf_skb_change_tail(ctx.skb.skb, (l2 + len) as u32, 0) != 0
            || bpf_skb_store_bytes(
                ctx.skb.skb.cast(),
                l2 as u32,
                m.as_ptr().cast(),
                len as u32,
                0,
            ) != 0
        {
            return TC_ACT_SHOT;
        }
    }
    // SAFETY: plain helper call; the packet leaves through the interface it arrived on.
    unsafe { bpf_redirect(ifindex, 0) };
    TC_ACT_REDIRECT
}

#[xdp]
pub fn peerwall_xdp(ctx: XdpContext) -> u32 {
    match try_xdp(&ctx) {
        Ok(v) => v,
        Err(()) => xdp_action::XDP_DROP,
    }
}

/// Early drop: evaluates like tc but never changes conntrack or counts accepted packets; tc
/// makes the full decision for everything XDP passes.
fn try_xdp(ctx: &XdpContext) -> Result<u32, ()> {
    let cfg = config();
    if allow_all(&cfg) {
        return Ok(xdp_action::XDP_PASS);
    }
    let ifindex = ctx.ingress_ifindex() as u32;
    // SAFETY: plain data.
    let l2 = match unsafe { IFACES.get(&ifindex) } {
        Some(i) => i.l2_len as usize,
        None => 14,
    };
    let ethertype = if l2 == 14 {
        match ctx.read::<[u8; 2]>(12) {
            Some(t) => u16::from_be_bytes(t),
            None => return Ok(xdp_action::XDP_PASS),
        }
    } else {
        match ctx.read::<u8>(0) {
            Some(v) if v >> 4 == 4 => ETH_P_IP,
            Some(v) if v >> 4 == 6 => ETH_P_IPV6,
            _ => return Ok(xdp_action::XDP_PASS),
        }
    };
    let Some(w) = WORK.get_ptr_mut(0) else {
        return Err(());
    };
    // SAFETY: per-CPU slot of a successful lookup; the packet is parsed in place.
    let p = unsafe { &mut (*w).p };
    match parse(ctx, l2 & 0xff, ethertype, p) {
        Parse::NotIp => return Ok(xdp_action::XDP_PASS),
        Parse::Bad => return Err(()),
        Parse::Ok => {}
    }
    let (path, oif) = route(ctx, p, ifindex);
    let state = ct_state(ctx, l2 & 0xff, p);
    let r = Route {
        slot: cfg.active & 1,
        path,
        iif: ifindex,
        oif,
        state,
        count: false,
    };
    // SAFETY: as above.
    unsafe { (*w).r = r };
    Ok(finish_xdp())
}

/// Classify `WORK`'s packet; drop it here only when the verdict is drop.
#[inline(never)]
fn finish_xdp() -> u32 {
    classify_work();
    if outcome().action != ACT_DROP {
        return xdp_action::XDP_PASS;
    }
    // Count what XDP drops (tc never sees it): the same evaluation, counting.
    if let Some(w) = WORK.get_ptr_mut(0) {
        // SAFETY: per-CPU slot of a successful lookup.
        unsafe { (*w).r.count = true };
    }
    classify_work();
    xdp_action::XDP_DROP
}

// ---------------------------------------------------------------------------------------------
// Benchmark baseline: one LPM lookup on the IPv4 destination of an Ethernet frame. Never
// attached; `cargo xtask bench` runs it next to the classifier with BPF_PROG_TEST_RUN.

#[map]
static BARE: LpmTrie<[u8; 4], u32> = LpmTrie::with_max_entries(TRIE_MAX, 0);

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

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
