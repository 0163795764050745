//! What classification reads: rule bitmaps, the keys of the address, port, protocol and
//! interface dimensions, per-chain masks and policies, rules and their actions, the chains of
//! each hook. eBPF twin: `ebpf/src/classify.rs`.

use crate::maps::{MAX_HOOK_CHAINS, MAX_RULES, WORDS};

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
        self.first_within::<WORDS>()
    }

    /// The lowest set bit among the first `NW` words (a chain of at most `NW * 64` rules).
    #[inline(always)]
    pub fn first_within<const NW: usize>(&self) -> Option<usize> {
        let mut i = 0;
        while i < NW {
            if self.w[i] != 0 {
                return Some(i * 64 + self.w[i].trailing_zeros() as usize);
            }
            i += 1;
        }
        None
    }

    /// The lowest bit set in both `self` and `other` among the first `NW` words.
    #[inline(always)]
    pub fn first_within_and<const NW: usize>(&self, other: &Bitmap) -> Option<usize> {
        let mut i = 0;
        while i < NW {
            let w = self.w[i] & other.w[i];
            if w != 0 {
                return Some(i * 64 + w.trailing_zeros() as usize);
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
    /// [`crate::family`] code.
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
    pub _pad: u8,
    /// Index in `COUNTERS` of rule 0's counter: rule `r` counts at `counters + r`, the policy at
    /// `counters + rules` (chains in id order, each after the one before: the table holds what
    /// the policy has, not 1024 per chain; the last index is at most 64 × 1024 − 1). An index
    /// past the table's end counts nothing. In what was padding before 0.2.0, so the struct
    /// keeps its 12 bytes and maps pinned by 0.1.0 stay readable.
    pub counters: u16,
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
    /// No exact-match (host) entry in the chain's source dimension: the datapath skips its
    /// `SRCH` lookup, which can only miss (under a flood of new sources, a cold bucket each).
    /// Negative sense, like the three below: a `ChainInfo` written by a peerwall without them
    /// (0) has both of a dimension's lookups made, as before.
    pub const SRC_NO_HOSTS: u32 = 128;
    /// No trie entry in the chain's source dimension (no prefix shorter than a host, and no
    /// host the exact-match map had no room for): a miss of the host map is the answer.
    pub const SRC_NO_PREFIXES: u32 = 256;
    /// As [`SRC_NO_HOSTS`], destination.
    pub const DST_NO_HOSTS: u32 = 512;
    /// As [`SRC_NO_PREFIXES`], destination.
    pub const DST_NO_PREFIXES: u32 = 1024;
    /// The four bits above.
    pub const NO_LOOKUPS: u32 = SRC_NO_HOSTS | SRC_NO_PREFIXES | DST_NO_HOSTS | DST_NO_PREFIXES;
    /// Every protocol of IPv4 starts the chain from the same bitmap (no rule tests protocol or
    /// ports in a way that tells IPv4 protocols apart): the datapath reads the chain's
    /// `START` entry for the family, an array, instead of the protocol hash (`PROTO`), whose
    /// entries for the family all hold that bitmap. Positive sense: a `ChainInfo` written by a
    /// peerwall without it (0) has the hash looked up, as before.
    pub const START_V4: u32 = 2048;
    /// As [`START_V4`], IPv6.
    pub const START_V6: u32 = 4096;
    /// [`START_V4`] or [`START_V6`] by family index (0: IPv4, 1: IPv6, as in `HOOKS`).
    pub const fn start(family_index: u32) -> u32 {
        START_V4 << (family_index & 1)
    }
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
