//! Per-dimension compilation: each rule's tests in a dimension combined into "value in S" or
//! "not in S" (range algebra over addresses and ports), then the prefixes of every S with the
//! rules of their enclosing prefixes (so a longest-prefix lookup answers for all), and the
//! chain's masks that turn a lookup into the dimension's answer.

use ipnet::IpNet;
use peerwall_common::{Bitmap, DimMasks};
use peerwall_policy::ir::{
    self, eval::proto, AddrSet, CtState, Dir, IfDir, IpFamily, PortSet, Test, VerdictAction,
};
use std::collections::HashMap;

use super::*;

/// "Holds iff value in S" or "holds iff value not in S".
#[derive(Clone, Debug)]
pub(super) enum Cond<S> {
    Any,
    In(S),
    NotIn(S),
}

/// Sets of values a dimension's tests are combined over.
pub(super) trait ValueSet: Clone {
    fn union(&self, other: &Self) -> Self;
    fn intersect(&self, other: &Self) -> Self;
    fn minus(&self, other: &Self) -> Self;
    /// The empty set of the same kind (family) as `self`.
    fn none_like(&self) -> Self;
}

/// Inclusive ranges present in both sorted, disjoint lists.
pub(super) fn ranges_intersect(a: &[ir::AddrRange], b: &[ir::AddrRange]) -> Vec<ir::AddrRange> {
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
pub(super) fn ranges_minus(a: &[ir::AddrRange], b: &[ir::AddrRange]) -> Vec<ir::AddrRange> {
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

pub(super) fn port_ranges(p: &PortSet) -> Vec<ir::AddrRange> {
    p.ranges()
        .iter()
        .map(|(a, b)| ir::AddrRange {
            lo: u128::from(*a),
            hi: u128::from(*b),
        })
        .collect()
}

pub(super) fn to_ports(r: Vec<ir::AddrRange>) -> PortSet {
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
pub(super) fn cond<S: ValueSet>(rule: &ir::Rule, pick: impl Fn(&Test) -> Option<&S>) -> Cond<S> {
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

pub(super) fn addr_cond(rule: &ir::Rule, dir: Dir) -> Cond<AddrSet> {
    cond(rule, |t| match t {
        Test::Addr { dir: d, set, .. } if *d == dir => Some(set),
        _ => None,
    })
}

pub(super) fn port_cond(rule: &ir::Rule, dir: Dir) -> Cond<PortSet> {
    cond(rule, |t| match t {
        Test::Port { dir: d, set, .. } if *d == dir => Some(set),
        _ => None,
    })
}

pub(super) fn port_prefixes(set: &PortSet) -> Vec<(u16, u8)> {
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
pub(super) fn fp_holds(rule: &ir::Rule, fam: IpFamily, p: u8) -> bool {
    rule.matches.iter().all(|m| match &m.test {
        Test::Addr { set, .. } => set.family() == fam,
        Test::Port { .. } => proto::carries_ports(p),
        Test::Proto(list) => list.contains(&p) != m.negate,
        _ => true,
    })
}

pub(super) fn iface_holds(rule: &ir::Rule, dir: IfDir, name: &str) -> bool {
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

pub(super) fn ct_holds(rule: &ir::Rule, s: CtState) -> bool {
    rule.matches.iter().all(|m| match &m.test {
        Test::CtState(mask) => (mask & s.bit() != 0) != m.negate,
        _ => true,
    })
}

/// Prefix entries with the rules of every enclosing prefix. `ancestors(k, lengths)` lists the
/// enclosing prefixes of `k` among the prefix lengths in use.
pub(super) fn trie_entries<K: Copy + Eq + std::hash::Hash>(
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

pub(super) fn net_ancestors(n: &IpNet, lengths: &[u8]) -> Vec<IpNet> {
    lengths
        .iter()
        .filter(|l| **l < n.prefix_len())
        .filter_map(|l| IpNet::new(n.addr(), *l).ok().map(|x| x.trunc()))
        .collect()
}

/// Rule bits of one address or port dimension: the prefixes of each rule's set (with the rule's
/// bit) and the dimension's masks (rules it does not constrain; rules whose test is negated).
pub(super) fn dim_prefixes<S, K: Eq + std::hash::Hash>(
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

pub(super) fn addr_dim(rules: &[&ir::Rule], dir: Dir) -> (Vec<(IpNet, Bitmap)>, DimMasks) {
    let (direct, masks) = dim_prefixes(rules, |r| addr_cond(r, dir), AddrSet::to_prefixes);
    (
        trie_entries(direct, IpNet::prefix_len, net_ancestors),
        masks,
    )
}

pub(super) fn port_dim(rules: &[&ir::Rule], dir: Dir) -> (Vec<(u16, u8, Bitmap)>, DimMasks) {
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

pub(super) fn chain_maps(
    id: u32,
    table: &ir::Table,
    chain: &ir::Chain,
    ifaces: &[Iface],
) -> ChainMaps {
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
    // Protocols that rules name, plus those with ports, plus one unnamed one for "others".
    let mut protos: Vec<u8> = vec![
        proto::TCP,
        proto::UDP,
        proto::SCTP,
        proto::ICMP,
        proto::ICMPV6,
    ];
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
        audit: table.audit,
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
        counters: 0,
    }
}
