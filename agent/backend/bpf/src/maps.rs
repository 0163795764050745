//! IR → the contents of the datapath's maps. Pure: data in, data out.
//!
//! Every filter chain gets an id; its deciding rules (accept/drop/reject, in order) get bit
//! positions. For each dimension the datapath looks up one bitmap of the rules that dimension
//! allows, and the AND's lowest bit decides. Dimensions:
//! - family+protocol (hash): address tests of another family, protocol tests, and port tests on
//!   non-TCP/UDP packets are all resolved here (exact booleans per (family, proto), plus one
//!   "other protocols" entry per family); where a family's entries of a chain all hold one
//!   bitmap, it is also the chain's start entry for the family (array), read instead;
//! - source/destination address (LPM trie): each rule's tests in that dimension are combined at
//!   compile time into "address in S" or "address not in S"; the trie holds the prefixes of every
//!   S, each entry carrying the rules of every enclosing prefix (so the longest match answers
//!   "which rules' S contain this address"); per-chain masks turn that into the dimension's
//!   answer: `(lookup ^ neg) | any`;
//! - source/destination port (LPM trie over 16 bits): the same, for TCP/UDP packets;
//! - input/output interface (hash by ifindex, exact booleans per interface name; ifindex 0 is
//!   "no interface known here" and "interface created after compilation");
//! - conntrack state (array, exact booleans).

mod delta;
mod dims;
mod left;
mod simulate;

use std::collections::HashMap;

use ipnet::IpNet;
use peerwall_common::{
    ct, Bitmap, ChainInfo, DimMasks, HookChains, RuleInfo, HOOK_SLOTS, MAX_CHAINS, MAX_HOOK_CHAINS,
    MAX_RULES,
};

use peerwall_policy::ir::{self, ChainKind, CtState, Hook, IpFamily, VerdictAction};

/// Why a policy does not fit the datapath.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BpfCompileError {
    /// Too many deciding rules in one chain.
    #[error("chain {table}/{chain} has {count} deciding rules; the bpf backend takes at most {max} per chain")]
    TooManyRules {
        /// Table.
        table: String,
        /// Chain.
        chain: String,
        /// Rules.
        count: usize,
        /// Limit.
        max: usize,
    },
    /// Too many filter chains.
    #[error("the policy has {count} filter chains; the bpf backend takes at most {max}")]
    TooManyChains {
        /// Chains.
        count: usize,
        /// Limit.
        max: u32,
    },
    /// Too many chains on one hook.
    #[error("{count} chains hook {hook} for {family}; the bpf backend takes at most {max}")]
    TooManyHookChains {
        /// Hook.
        hook: &'static str,
        /// Family.
        family: IpFamily,
        /// Chains.
        count: usize,
        /// Limit.
        max: usize,
    },
}

/// An interface of the host the policy is compiled for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Iface {
    /// Name.
    pub name: String,
    /// Index.
    pub ifindex: u32,
}

/// Index of a hook in the `HOOKS` map (`hook * 2 + family`).
pub fn hook_number(h: Hook) -> u32 {
    match h {
        Hook::Prerouting => peerwall_common::hook::PREROUTING,
        Hook::Input => peerwall_common::hook::INPUT,
        Hook::Forward => peerwall_common::hook::FORWARD,
        Hook::Output => peerwall_common::hook::OUTPUT,
        Hook::Postrouting => peerwall_common::hook::POSTROUTING,
    }
}

/// Datapath number of a ct state.
pub fn ct_number(s: CtState) -> u32 {
    match s {
        CtState::New => ct::NEW,
        CtState::Established => ct::ESTABLISHED,
        CtState::Related => ct::RELATED,
        CtState::Untracked => ct::UNTRACKED,
        CtState::Invalid => ct::INVALID,
    }
}

/// A deciding rule of a chain, as placed in the bitmaps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleMeta {
    /// Rule name.
    pub name: String,
    /// Verdict.
    pub action: VerdictAction,
    /// Whether it counts (`counter: true`).
    pub counter: bool,
}

/// Everything the datapath holds for one chain.
#[derive(Clone, Debug, PartialEq)]
pub struct ChainMaps {
    /// Chain id (index in the per-chain maps).
    pub id: u32,
    /// Table name.
    pub table: String,
    /// Chain name.
    pub chain: String,
    /// Hook.
    pub hook: Hook,
    /// Policy.
    pub policy: VerdictAction,
    /// Its table is audited: drop and reject (of rules and policy) are written as their audit
    /// codes ([`action_code_in`]).
    pub audit: bool,
    /// Deciding rules; position = bit.
    pub rules: Vec<RuleMeta>,
    /// (family code, protocol or None for "other protocols") → rules.
    pub proto: Vec<(u8, Option<u8>, Bitmap)>,
    /// Source address prefixes → rules whose set contains them.
    pub src: Vec<(IpNet, Bitmap)>,
    /// Destination address prefixes.
    pub dst: Vec<(IpNet, Bitmap)>,
    /// Source port prefixes (port, prefix length over 16 bits).
    pub sport: Vec<(u16, u8, Bitmap)>,
    /// Destination port prefixes.
    pub dport: Vec<(u16, u8, Bitmap)>,
    /// Masks of src, dst, sport, dport.
    pub masks: [DimMasks; 4],
    /// Input interface → rules (ifindex 0: none known / unlisted).
    pub iif: Vec<(u32, Bitmap)>,
    /// Output interface → rules.
    pub oif: Vec<(u32, Bitmap)>,
    /// ct state number → rules.
    pub ct: [Bitmap; 5],
    /// Index in `COUNTERS` of rule 0's counter ([`ChainInfo::counters`]): the chains' counters
    /// one after another in id order, each chain's rules then its policy.
    pub counters: u32,
}

impl ChainMaps {
    /// The chain's `CT` slots, by slot number: its state bitmaps, then `OPEN_EITHER` and
    /// `OPEN_EVERY` ([`peerwall_common::open_slots`]).
    pub fn ct_slots(&self) -> [Bitmap; 7] {
        let (either, every) = peerwall_common::open_slots(&self.ct);
        let mut slots = [Bitmap::EMPTY; 7];
        slots[..5].copy_from_slice(&self.ct);
        slots[ct::OPEN_EITHER as usize] = either;
        slots[ct::OPEN_EVERY as usize] = every;
        slots
    }

    /// `CHAINS` value.
    pub fn info(&self) -> ChainInfo {
        use peerwall_common::constrained as c;
        let mut all = Bitmap::EMPTY;
        for i in 0..self.rules.len() {
            all.set(i);
        }
        let free_if = |v: &[(u32, Bitmap)]| v.iter().all(|(_, b)| *b == all);
        let mut bits = 0;
        if !free_if(&self.iif) {
            bits |= c::IIF;
        }
        if !free_if(&self.oif) {
            bits |= c::OIF;
        }
        if self.ct.iter().any(|b| *b != all) {
            bits |= c::CT;
        }
        for (d, bit) in [c::SRC, c::DST, c::SPORT, c::DPORT].into_iter().enumerate() {
            if self.masks[d].any != all {
                bits |= bit;
            }
        }
        for fidx in [0, 1] {
            if self.start(fidx).is_some() {
                bits |= c::start(fidx);
            }
        }
        for (dir, no_hosts, no_prefixes) in [
            (ir::Dir::Src, c::SRC_NO_HOSTS, c::SRC_NO_PREFIXES),
            (ir::Dir::Dst, c::DST_NO_HOSTS, c::DST_NO_PREFIXES),
        ] {
            if !self.has_addresses(dir, true) {
                bits |= no_hosts;
            }
            if !self.has_addresses(dir, false) {
                bits |= no_prefixes;
            }
        }
        ChainInfo {
            rules: self.rules.len() as u32,
            policy: action_code_in(self.policy, self.audit),
            _pad: 0,
            counters: self.counters as u16,
            constrained: bits,
        }
    }

    /// The bitmap every protocol of family `fidx` (0: IPv4, 1: IPv6) starts the chain from,
    /// where its protocol entries for the family all hold the same one: the chain's `START`
    /// entry ([`peerwall_common::constrained::START_V4`]). None where the family has no entry
    /// (the table does not see it: the datapath's lookup misses and the policy decides) or
    /// where a rule tells its protocols apart.
    pub fn start(&self, fidx: u32) -> Option<Bitmap> {
        let fam = if fidx == 0 {
            family_code(IpFamily::V4)
        } else {
            family_code(IpFamily::V6)
        };
        let mut of_family = self.proto.iter().filter(|(f, _, _)| *f == fam);
        let (_, _, first) = of_family.next()?;
        of_family.all(|(_, _, b)| b == first).then_some(*first)
    }

    /// Whether the address dimension `dir` has an entry that is a host (`host`), or one that
    /// is not: what decides whether the datapath looks up its exact-match map and its trie
    /// ([`ChainInfo::constrained`]'s `*_NO_HOSTS` and `*_NO_PREFIXES`).
    pub fn has_addresses(&self, dir: ir::Dir, host: bool) -> bool {
        let v = match dir {
            ir::Dir::Src => &self.src,
            ir::Dir::Dst => &self.dst,
        };
        v.iter().any(|(n, _)| is_host(n) == host)
    }

    /// `RULES` values, by rule position.
    pub fn rule_infos(&self) -> Vec<RuleInfo> {
        self.rules
            .iter()
            .map(|r| RuleInfo {
                action: action_code_in(r.action, self.audit),
                counter: u8::from(r.counter),
                _pad: [0; 2],
            })
            .collect()
    }
}

/// A full-length prefix: one host (what the exact-match maps hold).
pub fn is_host(n: &IpNet) -> bool {
    n.prefix_len() == n.max_prefix_len()
}

/// A `VIEW` entry: destinations in `from` arriving on `ifindex` are seen in `to` by the
/// forward hook (prerouting NAT; [`ir::nat`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ViewEntry {
    /// Input interface.
    pub ifindex: u32,
    /// Destinations rewritten.
    pub from: IpNet,
    /// What they become (same prefix length).
    pub to: IpNet,
}

/// The datapath's view of a whole policy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BpfPolicy {
    /// Chains by id.
    pub chains: Vec<ChainMaps>,
    /// `HOOKS` values: index `hook * 2 + (0 for IPv4, 1 for IPv6)`.
    pub hooks: Vec<HookChains>,
    /// Destination rewrites by input interface (one per (ifindex, prefix): the first rule).
    pub views: Vec<ViewEntry>,
}

/// The `VIEW` entries of `policy` on `ifaces`.
pub fn views(policy: &ir::Policy, ifaces: &[Iface]) -> Vec<ViewEntry> {
    let (rewrites, _) = policy.dst_rewrites();
    let mut out: Vec<ViewEntry> = Vec::new();
    for i in ifaces {
        for r in rewrites.iter().filter(|r| r.applies_on(&i.name)) {
            if !out
                .iter()
                .any(|e| e.ifindex == i.ifindex && e.from == r.from)
            {
                out.push(ViewEntry {
                    ifindex: i.ifindex,
                    from: r.from,
                    to: r.to,
                });
            }
        }
    }
    out
}

impl BpfPolicy {
    /// Whether some chain tests the output interface (the datapath then needs the FIB's).
    pub fn tests_oif(&self) -> bool {
        self.chains
            .iter()
            .any(|c| c.info().constrained & peerwall_common::constrained::OIF != 0)
    }

    /// Hosts (full-length prefixes) of the source (`src`) or destination address dimension,
    /// over every chain: what the exact-match maps must hold ([`crate::loader::Layout`]).
    pub fn host_count(&self, src: bool) -> usize {
        self.chains
            .iter()
            .map(|c| {
                let v = if src { &c.src } else { &c.dst };
                v.iter().filter(|(n, _)| is_host(n)).count()
            })
            .sum()
    }

    /// Counters the policy has: one per rule and one per chain policy.
    pub fn counter_count(&self) -> u32 {
        self.chains.iter().map(|c| c.rules.len() as u32 + 1).sum()
    }

    /// Total trie entries (for sizing and reporting).
    pub fn prefix_count(&self) -> usize {
        self.chains.iter().map(|c| c.src.len() + c.dst.len()).sum()
    }
}

/// Datapath action code.
pub fn action_code(v: VerdictAction) -> u8 {
    match v {
        VerdictAction::Accept => peerwall_common::ActionCode::Accept as u8,
        VerdictAction::Drop => peerwall_common::ActionCode::Drop as u8,
        VerdictAction::Reject => peerwall_common::ActionCode::Reject as u8,
    }
}

/// Datapath action code of `v` in a chain that is audited or not: an audited drop or reject is
/// a would-drop ([`peerwall_common::ActionCode::AuditDrop`], `AuditReject`).
pub fn action_code_in(v: VerdictAction, audit: bool) -> u8 {
    match (v, audit) {
        (VerdictAction::Drop, true) => peerwall_common::ActionCode::AuditDrop as u8,
        (VerdictAction::Reject, true) => peerwall_common::ActionCode::AuditReject as u8,
        _ => action_code(v),
    }
}

/// Family code in keys.
pub fn family_code(f: IpFamily) -> u8 {
    match f {
        IpFamily::V4 => peerwall_common::family::V4,
        IpFamily::V6 => peerwall_common::family::V6,
    }
}

/// Compile a policy for a host with the given interfaces.
pub fn compile(policy: &ir::Policy, ifaces: &[Iface]) -> Result<BpfPolicy, BpfCompileError> {
    let mut chains = Vec::new();
    let mut ids: HashMap<(&str, &str), u32> = HashMap::new();
    for t in &policy.tables {
        for c in t.chains.iter().filter(|c| c.kind == ChainKind::Filter) {
            let deciding = c
                .rules
                .iter()
                .filter(|r| r.action.verdict().is_some())
                .count();
            // The last counter slot of a chain counts its policy.
            if deciding > MAX_RULES - 1 {
                return Err(BpfCompileError::TooManyRules {
                    table: t.name.clone(),
                    chain: c.name.clone(),
                    count: deciding,
                    max: MAX_RULES - 1,
                });
            }
            let id = chains.len() as u32;
            if id >= MAX_CHAINS {
                return Err(BpfCompileError::TooManyChains {
                    count: id as usize + 1,
                    max: MAX_CHAINS,
                });
            }
            ids.insert((t.name.as_str(), c.name.as_str()), id);
            let mut cm = chain_maps(id, t, c, ifaces);
            // After the chains before it: their rules and policies.
            cm.counters = chains
                .iter()
                .map(|c: &ChainMaps| c.rules.len() as u32 + 1)
                .sum();
            chains.push(cm);
        }
    }
    let mut hooks = vec![
        HookChains {
            count: 0,
            chains: [0; MAX_HOOK_CHAINS]
        };
        HOOK_SLOTS as usize
    ];
    for h in [
        Hook::Prerouting,
        Hook::Input,
        Hook::Forward,
        Hook::Output,
        Hook::Postrouting,
    ] {
        for (fi, fam) in [IpFamily::V4, IpFamily::V6].into_iter().enumerate() {
            let path_chains: Vec<u32> = ir::eval::chains_on_path_hook(policy, fam, h)
                .iter()
                .filter_map(|pc| ids.get(&(pc.table.name.as_str(), pc.chain.name.as_str())))
                .copied()
                .collect();
            if path_chains.len() > MAX_HOOK_CHAINS {
                return Err(BpfCompileError::TooManyHookChains {
                    hook: h.nft(),
                    family: fam,
                    count: path_chains.len(),
                    max: MAX_HOOK_CHAINS,
                });
            }
            let e = &mut hooks[hook_number(h) as usize * 2 + fi];
            e.count = path_chains.len() as u32;
            e.chains[..path_chains.len()].copy_from_slice(&path_chains);
        }
    }
    Ok(BpfPolicy {
        chains,
        hooks,
        views: views(policy, ifaces),
    })
}

pub use delta::{apply_delta, set_delta, AddrEntryChange};
use dims::*;
pub use left::{left_to_nftables, LeftToNftables};
pub use simulate::{simulate, simulate_chain, simulate_chain_open_either, DatapathPacket};

#[cfg(test)]
mod tests;
