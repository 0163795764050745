//! IR → the contents of the datapath's maps. Pure: data in, data out.
//!
//! Every filter chain gets an id; its deciding rules (accept/drop/reject, in order) get bit
//! positions. For each dimension the datapath looks up one bitmap of the rules that dimension
//! allows, and the AND's lowest bit decides. Dimensions:
//! - family+protocol (hash): address tests of another family, protocol tests, and port tests on
//!   non-TCP/UDP packets are all resolved here (exact booleans per (family, proto), plus one
//!   "other protocols" entry per family);
//! - source/destination address (LPM trie): each rule's tests in that dimension are combined at
//!   compile time into "address in S" or "address not in S"; the trie holds the prefixes of every
//!   S, each entry carrying the rules of every enclosing prefix (so the longest match answers
//!   "which rules' S contain this address"); per-chain masks turn that into the dimension's
//!   answer: `(lookup ^ neg) | any`;
//! - source/destination port (LPM trie over 16 bits): the same, for TCP/UDP packets;
//! - input/output interface (hash by ifindex, exact booleans per interface name; ifindex 0 is
//!   "no interface known here" and "interface created after compilation");
//! - conntrack state (array, exact booleans).

use std::collections::HashMap;
use std::net::IpAddr;

use ipnet::IpNet;
use peerwall_common::{
    ct, Bitmap, ChainInfo, DimMasks, HookChains, RuleInfo, HOOK_SLOTS, MAX_CHAINS, MAX_HOOK_CHAINS,
    MAX_RULES,
};

use peerwall_policy::ir::{
    self, eval::proto, AddrSet, ChainKind, CtState, Dir, Hook, IfDir, IpFamily, PortSet, Test,
    VerdictAction,
};

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
}

impl ChainMaps {
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
        ChainInfo {
            rules: self.rules.len() as u32,
            policy: action_code(self.policy),
            _pad: [0; 3],
            constrained: bits,
        }
    }

    /// `RULES` values, by rule position.
    pub fn rule_infos(&self) -> Vec<RuleInfo> {
        self.rules
            .iter()
            .map(|r| RuleInfo {
                action: action_code(r.action),
                counter: u8::from(r.counter),
                _pad: [0; 2],
            })
            .collect()
    }
}

/// The datapath's view of a whole policy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BpfPolicy {
    /// Chains by id.
    pub chains: Vec<ChainMaps>,
    /// `HOOKS` values: index `hook * 2 + (0 for IPv4, 1 for IPv6)`.
    pub hooks: Vec<HookChains>,
}

impl BpfPolicy {
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

/// Family code in keys.
pub fn family_code(f: IpFamily) -> u8 {
    match f {
        IpFamily::V4 => peerwall_common::family::V4,
        IpFamily::V6 => peerwall_common::family::V6,
    }
}

/// "Holds iff value in S" or "holds iff value not in S".
#[derive(Clone, Debug)]
enum Cond<S> {
    Any,
    In(S),
    NotIn(S),
}

/// Sets of values a dimension's tests are combined over.
trait ValueSet: Clone {
    fn union(&self, other: &Self) -> Self;
    fn intersect(&self, other: &Self) -> Self;
    fn minus(&self, other: &Self) -> Self;
    /// The empty set of the same kind (family) as `self`.
    fn none_like(&self) -> Self;
}

/// Inclusive ranges present in both sorted, disjoint lists.
fn ranges_intersect(a: &[ir::AddrRange], b: &[ir::AddrRange]) -> Vec<ir::AddrRange> {
    let mut out = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let lo = a[i].lo.max(b[j].lo);
        let hi = a[i].hi.min(b[j].hi);
        if lo <= hi {
            out.push(ir::AddrRange { lo, hi });
        }
        if a[i].hi < b[j].hi {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

/// Inclusive ranges of `a` not covered by `b` (both sorted, disjoint).
fn ranges_minus(a: &[ir::AddrRange], b: &[ir::AddrRange]) -> Vec<ir::AddrRange> {
    let mut out = Vec::new();
    for r in a {
        let mut lo = r.lo;
        let mut done = false;
        for s in b {
            if s.hi < lo || s.lo > r.hi {
                continue;
            }
            if s.lo > lo {
                out.push(ir::AddrRange { lo, hi: s.lo - 1 });
            }
            if s.hi >= r.hi {
                done = true;
                break;
            }
            lo = s.hi + 1;
        }
        if !done {
            out.push(ir::AddrRange { lo, hi: r.hi });
        }
    }
    out
}

impl ValueSet for AddrSet {
    fn union(&self, other: &Self) -> Self {
        AddrSet::union(self, other)
    }
    fn intersect(&self, other: &Self) -> Self {
        AddrSet::from_ranges(
            self.family(),
            ranges_intersect(self.ranges(), other.ranges()),
        )
    }
    fn minus(&self, other: &Self) -> Self {
        AddrSet::from_ranges(self.family(), ranges_minus(self.ranges(), other.ranges()))
    }
    fn none_like(&self) -> Self {
        AddrSet::empty(self.family())
    }
}

fn port_ranges(p: &PortSet) -> Vec<ir::AddrRange> {
    p.ranges()
        .iter()
        .map(|(a, b)| ir::AddrRange {
            lo: u128::from(*a),
            hi: u128::from(*b),
        })
        .collect()
}

fn to_ports(r: Vec<ir::AddrRange>) -> PortSet {
    // Ranges come from port sets, so every bound fits in 16 bits.
    PortSet::from_ranges(r.into_iter().map(|r| (r.lo as u16, r.hi as u16)))
}

impl ValueSet for PortSet {
    fn union(&self, other: &Self) -> Self {
        PortSet::from_ranges(self.ranges().iter().chain(other.ranges()).copied())
    }
    fn intersect(&self, other: &Self) -> Self {
        to_ports(ranges_intersect(&port_ranges(self), &port_ranges(other)))
    }
    fn minus(&self, other: &Self) -> Self {
        to_ports(ranges_minus(&port_ranges(self), &port_ranges(other)))
    }
    fn none_like(&self) -> Self {
        PortSet::from_ranges([])
    }
}

/// Combine a rule's tests of one dimension (`pick` selects them) into one condition:
/// `eq A, eq B, neq C` → in (A ∩ B) ∖ C; only `neq` tests → not in their union.
fn cond<S: ValueSet>(rule: &ir::Rule, pick: impl Fn(&Test) -> Option<&S>) -> Cond<S> {
    let tests: Vec<(&S, bool)> = rule
        .matches
        .iter()
        .filter_map(|m| pick(&m.test).map(|s| (s, m.negate)))
        .collect();
    let Some(first) = tests.first() else {
        return Cond::Any;
    };
    let mut pos: Option<S> = None;
    let mut neg = first.0.none_like();
    for (s, negate) in tests {
        if negate {
            neg = neg.union(s);
        } else {
            pos = Some(match pos {
                None => s.clone(),
                Some(p) => p.intersect(s),
            });
        }
    }
    match pos {
        None => Cond::NotIn(neg),
        Some(p) => Cond::In(p.minus(&neg)),
    }
}

fn addr_cond(rule: &ir::Rule, dir: Dir) -> Cond<AddrSet> {
    cond(rule, |t| match t {
        Test::Addr { dir: d, set, .. } if *d == dir => Some(set),
        _ => None,
    })
}

fn port_cond(rule: &ir::Rule, dir: Dir) -> Cond<PortSet> {
    cond(rule, |t| match t {
        Test::Port { dir: d, set, .. } if *d == dir => Some(set),
        _ => None,
    })
}

fn port_prefixes(set: &PortSet) -> Vec<(u16, u8)> {
    let mut out = Vec::new();
    for (a, b) in set.ranges() {
        let (mut cur, hi) = (u32::from(*a), u32::from(*b));
        while cur <= hi {
            let mut size = if cur == 0 {
                16
            } else {
                cur.trailing_zeros().min(16)
            };
            while size > 0 && cur + (1 << size) - 1 > hi {
                size -= 1;
            }
            out.push((cur as u16, (16 - size) as u8));
            cur += 1 << size;
        }
    }
    out
}

/// Whether a rule's family, protocol and port tests hold for (family, proto).
fn fp_holds(rule: &ir::Rule, fam: IpFamily, p: u8) -> bool {
    rule.matches.iter().all(|m| match &m.test {
        Test::Addr { set, .. } => set.family() == fam,
        Test::Port { .. } => p == proto::TCP || p == proto::UDP,
        Test::Proto(list) => list.contains(&p) != m.negate,
        _ => true,
    })
}

fn iface_holds(rule: &ir::Rule, dir: IfDir, name: &str) -> bool {
    rule.matches.iter().all(|m| match &m.test {
        Test::Iface {
            dir: d,
            name: n,
            wildcard,
        } if *d == dir => {
            let hit = if *wildcard {
                name.starts_with(n.as_str())
            } else {
                name == n
            };
            hit != m.negate
        }
        _ => true,
    })
}

fn ct_holds(rule: &ir::Rule, s: CtState) -> bool {
    rule.matches.iter().all(|m| match &m.test {
        Test::CtState(mask) => (mask & s.bit() != 0) != m.negate,
        _ => true,
    })
}

/// Prefix entries with the rules of every enclosing prefix. `ancestors(k, lengths)` lists the
/// enclosing prefixes of `k` among the prefix lengths in use.
fn trie_entries<K: Copy + Eq + std::hash::Hash>(
    direct: HashMap<K, Bitmap>,
    len_of: impl Fn(&K) -> u8,
    ancestors: impl Fn(&K, &[u8]) -> Vec<K>,
) -> Vec<(K, Bitmap)> {
    let mut lengths: Vec<u8> = direct.keys().map(&len_of).collect();
    lengths.sort_unstable();
    lengths.dedup();
    let mut out = Vec::with_capacity(direct.len());
    for (k, own) in &direct {
        let mut b = *own;
        for a in ancestors(k, &lengths) {
            if let Some(x) = direct.get(&a) {
                for i in 0..b.w.len() {
                    b.w[i] |= x.w[i];
                }
            }
        }
        out.push((*k, b));
    }
    out
}

fn net_ancestors(n: &IpNet, lengths: &[u8]) -> Vec<IpNet> {
    lengths
        .iter()
        .filter(|l| **l < n.prefix_len())
        .filter_map(|l| IpNet::new(n.addr(), *l).ok().map(|x| x.trunc()))
        .collect()
}

/// Rule bits of one address or port dimension: the prefixes of each rule's set (with the rule's
/// bit) and the dimension's masks (rules it does not constrain; rules whose test is negated).
fn dim_prefixes<S, K: Eq + std::hash::Hash>(
    rules: &[&ir::Rule],
    cond_of: impl Fn(&ir::Rule) -> Cond<S>,
    prefixes_of: impl Fn(&S) -> Vec<K>,
) -> (HashMap<K, Bitmap>, DimMasks) {
    let mut masks = DimMasks {
        any: Bitmap::EMPTY,
        neg: Bitmap::EMPTY,
    };
    let mut direct: HashMap<K, Bitmap> = HashMap::new();
    for (i, r) in rules.iter().enumerate() {
        let set = match cond_of(r) {
            Cond::Any => {
                masks.any.set(i);
                continue;
            }
            Cond::In(s) => s,
            Cond::NotIn(s) => {
                masks.neg.set(i);
                s
            }
        };
        for p in prefixes_of(&set) {
            direct.entry(p).or_insert(Bitmap::EMPTY).set(i);
        }
    }
    (direct, masks)
}

fn addr_dim(rules: &[&ir::Rule], dir: Dir) -> (Vec<(IpNet, Bitmap)>, DimMasks) {
    let (direct, masks) = dim_prefixes(rules, |r| addr_cond(r, dir), AddrSet::to_prefixes);
    (
        trie_entries(direct, IpNet::prefix_len, net_ancestors),
        masks,
    )
}

fn port_dim(rules: &[&ir::Rule], dir: Dir) -> (Vec<(u16, u8, Bitmap)>, DimMasks) {
    let (direct, masks) = dim_prefixes(
        rules,
        |r| port_cond(r, dir),
        |s: &PortSet| {
            port_prefixes(s)
                .into_iter()
                .map(|(port, len)| (len, port))
                .collect()
        },
    );
    let entries = trie_entries(
        direct,
        |(len, _)| *len,
        |(len, port), lengths| {
            lengths
                .iter()
                .filter(|l| **l < *len)
                .map(|l| {
                    let mask = if *l == 0 { 0 } else { u16::MAX << (16 - l) };
                    (*l, port & mask)
                })
                .collect()
        },
    );
    let out = entries
        .into_iter()
        .map(|((len, port), b)| (port, len, b))
        .collect();
    (out, masks)
}

fn chain_maps(id: u32, table: &ir::Table, chain: &ir::Chain, ifaces: &[Iface]) -> ChainMaps {
    let deciding: Vec<&ir::Rule> = chain
        .rules
        .iter()
        .filter(|r| r.action.verdict().is_some())
        .collect();
    let bits = |f: &dyn Fn(&ir::Rule) -> bool| {
        let mut b = Bitmap::EMPTY;
        for (i, r) in deciding.iter().enumerate() {
            if f(r) {
                b.set(i);
            }
        }
        b
    };
    // Protocols that rules name, plus TCP and UDP (ports), plus one unnamed one for "others".
    let mut protos: Vec<u8> = vec![proto::TCP, proto::UDP, proto::ICMP, proto::ICMPV6];
    for r in &deciding {
        for m in &r.matches {
            if let Test::Proto(l) = &m.test {
                protos.extend(l);
            }
        }
    }
    protos.sort_unstable();
    protos.dedup();
    let other = (0..=255u8).find(|p| !protos.contains(p)).unwrap_or(255);
    let mut proto_entries = Vec::new();
    for fam in [IpFamily::V4, IpFamily::V6] {
        if !table.family.sees(fam) {
            continue;
        }
        for p in &protos {
            proto_entries.push((family_code(fam), Some(*p), bits(&|r| fp_holds(r, fam, *p))));
        }
        proto_entries.push((family_code(fam), None, bits(&|r| fp_holds(r, fam, other))));
    }
    let (src, m_src) = addr_dim(&deciding, Dir::Src);
    let (dst, m_dst) = addr_dim(&deciding, Dir::Dst);
    let (sport, m_sport) = port_dim(&deciding, Dir::Src);
    let (dport, m_dport) = port_dim(&deciding, Dir::Dst);
    let iface_entries = |dir: IfDir| {
        let mut v = vec![(0u32, bits(&|r| iface_holds(r, dir, "")))];
        for i in ifaces {
            v.push((i.ifindex, bits(&|r| iface_holds(r, dir, &i.name))));
        }
        v
    };
    let mut ct_bits = [Bitmap::EMPTY; 5];
    for s in CtState::ALL {
        ct_bits[ct_number(s) as usize] = bits(&|r| ct_holds(r, s));
    }
    ChainMaps {
        id,
        table: table.name.clone(),
        chain: chain.name.clone(),
        hook: chain.hook,
        policy: chain.policy,
        rules: deciding
            .iter()
            .map(|r| RuleMeta {
                name: r.name.clone(),
                action: r.action.verdict().unwrap_or(VerdictAction::Drop),
                counter: r.counter,
            })
            .collect(),
        proto: proto_entries,
        src,
        dst,
        sport,
        dport,
        masks: [m_src, m_dst, m_sport, m_dport],
        iif: iface_entries(IfDir::In),
        oif: iface_entries(IfDir::Out),
        ct: ct_bits,
    }
}

/// A rule the bpf backend leaves to nftables: it only enforces verdicts (filter chains'
/// accept/drop/reject). NAT, marks, MSS clamping and notrack change packets or conntrack, which
/// a tc program in front of netfilter does not do; they stay with an nftables enforcer (Liqo's
/// own firewall controller in its gateways, or peerwall's nftables backend).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeftToNftables {
    /// Table.
    pub table: String,
    /// Chain.
    pub chain: String,
    /// Rule.
    pub rule: String,
    /// What the rule does (`snat`, `ct mark`, …).
    pub action: &'static str,
}

impl std::fmt::Display for LeftToNftables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}: {} is not enforced by the bpf backend (it enforces verdicts only; NAT, marks, MSS clamping and notrack are left to nftables)",
            self.table, self.chain, self.rule, self.action
        )
    }
}

/// Every rule of `policy` that the bpf backend does not enforce (never an error).
pub fn left_to_nftables(policy: &ir::Policy) -> Vec<LeftToNftables> {
    let mut out = Vec::new();
    for t in &policy.tables {
        for c in &t.chains {
            for r in &c.rules {
                let action = match &r.action {
                    ir::Action::Verdict(_) if c.kind == ChainKind::Filter => continue,
                    ir::Action::Verdict(_) => "a verdict outside a filter chain",
                    ir::Action::CtMark(_) => "ct mark set",
                    ir::Action::MetaMarkFromCtMark => "meta mark set ct mark",
                    ir::Action::TcpMssClamp(_) => "tcp mss clamping",
                    ir::Action::Notrack => "notrack",
                    ir::Action::Nat(ir::NatAction::Dnat(_)) => "dnat",
                    ir::Action::Nat(ir::NatAction::Snat(_)) => "snat",
                    ir::Action::Nat(ir::NatAction::Masquerade) => "masquerade",
                };
                out.push(LeftToNftables {
                    table: t.name.clone(),
                    chain: c.name.clone(),
                    rule: r.name.clone(),
                    action,
                });
            }
        }
    }
    out
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
            chains.push(chain_maps(id, t, c, ifaces));
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
    Ok(BpfPolicy { chains, hooks })
}

/// A packet as the datapath sees it after routing: the interfaces by index.
#[derive(Clone, Debug)]
pub struct DatapathPacket<'a> {
    /// The packet.
    pub pkt: &'a ir::Packet,
    /// Input interface index.
    pub iif: u32,
    /// Output interface index (forward path).
    pub oif: u32,
}

fn lpm_addr<'a>(entries: &'a [(IpNet, Bitmap)], a: &IpAddr) -> Option<&'a Bitmap> {
    entries
        .iter()
        .filter(|(n, _)| n.contains(a))
        .max_by_key(|(n, _)| n.prefix_len())
        .map(|(_, b)| b)
}

fn lpm_port(entries: &[(u16, u8, Bitmap)], p: u16) -> Option<&Bitmap> {
    entries
        .iter()
        .filter(|(port, len, _)| {
            let mask = if *len == 0 { 0 } else { u16::MAX << (16 - len) };
            p & mask == *port
        })
        .max_by_key(|(_, len, _)| *len)
        .map(|(_, _, b)| b)
}

fn and_into(acc: &mut Bitmap, b: &Bitmap) {
    for i in 0..acc.w.len() {
        acc.w[i] &= b.w[i];
    }
}

fn and_masked(acc: &mut Bitmap, l: Option<&Bitmap>, m: &DimMasks) {
    for i in 0..acc.w.len() {
        let x = l.map_or(0, |b| b.w[i]);
        acc.w[i] &= (x ^ m.neg.w[i]) | m.any.w[i];
    }
}

/// Evaluate one chain exactly as the datapath does (linear scans instead of tries):
/// (verdict, deciding rule position).
pub fn simulate_chain(
    c: &ChainMaps,
    p: &ir::Packet,
    iif: u32,
    oif: u32,
) -> (VerdictAction, Option<usize>) {
    let fam = family_code(p.family());
    let known = c
        .proto
        .iter()
        .find(|(f, pr, _)| *f == fam && *pr == Some(p.proto));
    let entry = known.or_else(|| c.proto.iter().find(|(f, pr, _)| *f == fam && pr.is_none()));
    let Some((_, _, first)) = entry else {
        return (c.policy, None);
    };
    let mut acc = *first;
    let pick = |v: &[(u32, Bitmap)], idx: u32| {
        v.iter()
            .find(|(i, _)| *i == idx)
            .or_else(|| v.iter().find(|(i, _)| *i == 0))
            .map(|(_, b)| *b)
            .unwrap_or(Bitmap::EMPTY)
    };
    and_into(&mut acc, &pick(&c.iif, iif));
    and_into(&mut acc, &pick(&c.oif, oif));
    and_into(&mut acc, &c.ct[ct_number(p.ct_state) as usize]);
    and_masked(&mut acc, lpm_addr(&c.src, &p.src), &c.masks[0]);
    and_masked(&mut acc, lpm_addr(&c.dst, &p.dst), &c.masks[1]);
    if p.proto == proto::TCP || p.proto == proto::UDP {
        and_masked(&mut acc, lpm_port(&c.sport, p.sport), &c.masks[2]);
        and_masked(&mut acc, lpm_port(&c.dport, p.dport), &c.masks[3]);
    }
    match acc.first() {
        Some(r) if r < c.rules.len() => (c.rules[r].action, Some(r)),
        _ => (c.policy, None),
    }
}

/// Evaluate a packet over the compiled maps as the datapath does.
pub fn simulate(bp: &BpfPolicy, dp: &DatapathPacket<'_>) -> ir::Verdict {
    let p = dp.pkt;
    let fi = usize::from(p.family() == IpFamily::V6);
    let mut last = ir::Verdict {
        verdict: VerdictAction::Accept,
        table: None,
        chain: None,
        rule: None,
    };
    for h in p.path().hooks() {
        let (iif, oif) = match h {
            Hook::Prerouting | Hook::Input => (dp.iif, 0),
            _ => (dp.iif, dp.oif),
        };
        let hc = &bp.hooks[hook_number(*h) as usize * 2 + fi];
        for id in &hc.chains[..hc.count as usize] {
            let c = &bp.chains[*id as usize];
            let (v, r) = simulate_chain(c, p, iif, oif);
            last = ir::Verdict {
                verdict: v,
                table: Some(c.table.clone()),
                chain: Some(c.chain.clone()),
                rule: r.map(|i| c.rules[i].name.clone()),
            };
            if v != VerdictAction::Accept {
                return last;
            }
        }
    }
    last
}

#[cfg(test)]
mod tests;
