//! Destination rewrites netfilter performs before the forward hook, derived from NAT rules.
//!
//! A tc or XDP program at ingress sees a packet before prerouting; nftables' forward hook sees
//! it after. Where a gateway's NAT changes the destination in between (Liqo remaps an
//! overlapping pod CIDR: `remapping/cidr.go` DNATs the remapped CIDR towards the peer and SNATs
//! what comes from the peer, at postrouting), a datapath that classifies at ingress must first
//! rewrite the destination as prerouting will, or its verdicts and its connection tracking
//! disagree with the forward hook's. Two sources of rewrites:
//! - prerouting DNAT of a whole prefix or one address, matched only on that destination and on
//!   input interfaces: new connections;
//! - postrouting SNAT of a whole prefix or one address, matched only on that source (and on
//!   interfaces): the replies, whose destination conntrack rewrites back at prerouting. A reply
//!   arrives through the interface the original left by, so the rule's output-interface tests
//!   become input-interface tests; an input interface the rule requires is one the reply does
//!   not arrive on (a forwarded packet leaves by another interface than it came in by).
//!
//! Prefix mappings keep the host part (nftables `prefix to`, Liqo's netmap). A rule with any
//! other test (ports, protocols, state), masquerade, or a mapping of a prefix onto one address
//! cannot be expressed as an address rewrite; it is reported as [`Unexpressed`], never guessed.

use std::net::IpAddr;

use ipnet::IpNet;

use super::addr::{addr_to_u128, u128_to_addr, IpFamily};
use super::{Action, ChainKind, Dir, Hook, IfDir, NatAction, NatTarget, RuleId, Table, Test};

/// An input-interface condition of a rewrite.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfaceTest {
    /// `neq`.
    pub negate: bool,
    /// Name, or prefix when `wildcard`.
    pub name: String,
    /// Prefix match.
    pub wildcard: bool,
}

impl IfaceTest {
    /// Whether the test holds for a packet arriving on `iface`.
    pub fn holds(&self, iface: &str) -> bool {
        let m = if self.wildcard {
            iface.starts_with(self.name.as_str())
        } else {
            iface == self.name
        };
        m != self.negate
    }
}

/// Whether a rewrite applies to new connections or to replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RewriteKind {
    /// Prerouting DNAT.
    Dnat,
    /// The inverse of a postrouting SNAT, for replies.
    UnSnat,
}

/// Destinations in `from` arriving on an interface where every `iif` test holds are seen by
/// the forward hook in `to` (same prefix length, host part kept).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DstRewrite {
    /// Destinations rewritten.
    pub from: IpNet,
    /// What they become.
    pub to: IpNet,
    /// Input-interface conditions.
    pub iif: Vec<IfaceTest>,
    /// Where it comes from.
    pub kind: RewriteKind,
    /// The NAT rule.
    pub rule: RuleId,
}

impl DstRewrite {
    /// Whether the rewrite applies to packets arriving on `iface`.
    pub fn applies_on(&self, iface: &str) -> bool {
        self.iif.iter().all(|t| t.holds(iface))
    }

    /// `dst` as the forward hook sees it, if this rewrite covers it.
    pub fn rewrite(&self, dst: IpAddr) -> Option<IpAddr> {
        map_prefix(self.from, self.to, dst)
    }
}

/// `addr` moved from prefix `from` to prefix `to`, host part kept (nftables `prefix to`,
/// Liqo's netmap), if `from` covers it and both prefixes have the same length and family.
pub fn map_prefix(from: IpNet, to: IpNet, addr: IpAddr) -> Option<IpAddr> {
    let fam = IpFamily::of(&addr);
    if !from.contains(&addr)
        || from.prefix_len() != to.prefix_len()
        || IpFamily::of(&to.addr()) != fam
    {
        return None;
    }
    let host = addr_to_u128(&addr) & addr_to_u128(&from.hostmask());
    Some(u128_to_addr(fam, addr_to_u128(&to.network()) | host))
}

/// A NAT rule that changes addresses but is not expressed as a rewrite, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unexpressed {
    /// The rule.
    pub rule: RuleId,
    /// Why.
    pub why: &'static str,
}

/// The single prefix an address set is, if it is one.
fn single_prefix(set: &super::AddrSet) -> Option<IpNet> {
    match set.to_prefixes().as_slice() {
        [one] => Some(*one),
        _ => None,
    }
}

// size: one walk over the NAT rules, one arm per way a rule can move addresses (each arm short).
/// Every destination rewrite of `tables`' NAT rules (DNAT first, in table and chain order),
/// and the NAT rules that change destinations or sources in a way no rewrite expresses.
pub fn dst_rewrites<'a>(
    tables: impl IntoIterator<Item = &'a Table>,
) -> (Vec<DstRewrite>, Vec<Unexpressed>) {
    let mut dnat = Vec::new();
    let mut unsnat = Vec::new();
    let mut unexpressed = Vec::new();
    for t in tables {
        for c in t.chains.iter().filter(|c| c.kind == ChainKind::Nat) {
            for r in &c.rules {
                let Action::Nat(nat) = &r.action else {
                    continue;
                };
                let rule = RuleId {
                    table: t.name.clone(),
                    chain: c.name.clone(),
                    rule: r.name.clone(),
                };
                let (kind, target, addr_dir, hook) = match nat {
                    NatAction::Dnat(to) => (RewriteKind::Dnat, to, Dir::Dst, Hook::Prerouting),
                    NatAction::Snat(to) => (RewriteKind::UnSnat, to, Dir::Src, Hook::Postrouting),
                    NatAction::Masquerade => {
                        // Replies to masqueraded traffic come back to the gateway's own
                        // address: delivered locally, never forwarded.
                        continue;
                    }
                };
                let mut prefix = None;
                let mut iif = Vec::new();
                let mut other = false;
                for m in &r.matches {
                    match &m.test {
                        Test::Addr { dir, set, .. } if *dir == addr_dir && !m.negate => {
                            if prefix.is_some() {
                                other = true;
                            }
                            prefix = single_prefix(set);
                        }
                        Test::Iface {
                            dir,
                            name,
                            wildcard,
                        } => {
                            // A DNAT tests where the packet comes from; a reply to a SNATed
                            // connection comes from where the original went.
                            let wanted = if kind == RewriteKind::Dnat {
                                IfDir::In
                            } else {
                                IfDir::Out
                            };
                            if *dir == wanted {
                                iif.push(IfaceTest {
                                    negate: m.negate,
                                    name: name.clone(),
                                    wildcard: *wildcard,
                                });
                            } else if kind == RewriteKind::UnSnat && !m.negate {
                                // The original came in there, so it left elsewhere: its reply
                                // does not arrive there (a gateway does not hairpin).
                                iif.push(IfaceTest {
                                    negate: true,
                                    name: name.clone(),
                                    wildcard: *wildcard,
                                });
                            }
                        }
                        _ => other = true,
                    }
                }
                let why = if c.hook != hook {
                    Some(if kind == RewriteKind::Dnat {
                        "DNAT outside prerouting"
                    } else {
                        "SNAT outside postrouting"
                    })
                } else if other {
                    Some("the rule tests more than one address prefix and interfaces")
                } else {
                    None
                };
                if let Some(why) = why {
                    unexpressed.push(Unexpressed { rule, why });
                    continue;
                }
                let Some(matched) = prefix else {
                    unexpressed.push(Unexpressed {
                        rule,
                        why: "the rule does not test one address prefix",
                    });
                    continue;
                };
                let target = match *target {
                    NatTarget::Prefix(n) => n,
                    NatTarget::Addr(a) => IpNet::from(a),
                };
                if target.prefix_len() != matched.prefix_len()
                    || IpFamily::of(&target.addr()) != IpFamily::of(&matched.addr())
                {
                    unexpressed.push(Unexpressed {
                        rule,
                        why: "the mapping is not one-to-one (prefix lengths differ)",
                    });
                    continue;
                }
                let (from, to) = match kind {
                    RewriteKind::Dnat => (matched, target),
                    RewriteKind::UnSnat => (target, matched),
                };
                let rw = DstRewrite {
                    from: from.trunc(),
                    to: to.trunc(),
                    iif,
                    kind,
                    rule,
                };
                match kind {
                    RewriteKind::Dnat => dnat.push(rw),
                    RewriteKind::UnSnat => unsnat.push(rw),
                }
            }
        }
    }
    dnat.extend(unsnat);
    (dnat, unexpressed)
}

/// `dst` arriving on `iif` as the forward hook sees it: the first rewrite that applies on
/// `iif` with the longest `from` covering `dst` (DNAT before un-SNAT on equal lengths).
pub fn forward_dst(rewrites: &[DstRewrite], iif: &str, dst: IpAddr) -> IpAddr {
    let mut best: Option<(&DstRewrite, IpAddr)> = None;
    for r in rewrites.iter().filter(|r| r.applies_on(iif)) {
        if let Some(to) = r.rewrite(dst) {
            if best.is_none_or(|(b, _)| r.from.prefix_len() > b.from.prefix_len()) {
                best = Some((r, to));
            }
        }
    }
    best.map_or(dst, |(_, to)| to)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile;
    use peerwall_intent::load::parse_documents;

    /// Liqo's remapping of an overlapping pod CIDR (`examples/liqo/gateway/remap-podcidr.yaml`, from
    /// `remapping/cidr.go`): the peer's 10.243.0.0/16 is seen here as 10.71.0.0/16.
    const REMAP: &str = "apiVersion: networking.liqo.io/v1beta1\nkind: FirewallConfiguration\nmetadata: {name: remap, namespace: t}\nspec:\n  table:\n    name: remap-podcidr\n    family: IPV4\n    chains:\n    - name: outgoing\n      policy: accept\n      type: nat\n      hook: prerouting\n      priority: -100\n      rules:\n        natRules:\n        - natType: dnat\n          to: 10.243.0.0/16\n          match:\n          - {op: eq, ip: {value: 10.71.0.0/16, position: dst}}\n          - {op: neq, dev: {value: eth0, position: in}}\n          - {op: neq, dev: {value: liqo-tunnel, position: in}}\n    - name: incoming\n      policy: accept\n      type: nat\n      hook: postrouting\n      priority: 100\n      rules:\n        natRules:\n        - natType: snat\n          to: 10.71.0.0/16\n          match:\n          - {op: neq, dev: {value: eth0, position: out}}\n          - {op: eq, ip: {value: 10.243.0.0/16, position: src}}\n          - {op: eq, dev: {value: liqo-tunnel, position: in}}\n";

    fn rewrites(yaml: &str) -> (Vec<DstRewrite>, Vec<Unexpressed>) {
        let objs = parse_documents(yaml, "t").unwrap();
        let c = compile::compile(&objs).unwrap();
        c.policy.dst_rewrites()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn liqo_pod_cidr_remap_rewrites_what_comes_from_the_nodes_only() {
        let (rw, un) = rewrites(REMAP);
        assert!(un.is_empty(), "{un:?}");
        assert_eq!(rw.len(), 2);
        assert_eq!(rw[0].kind, RewriteKind::Dnat);
        assert_eq!(rw[1].kind, RewriteKind::UnSnat);
        // From a Geneve interface (a node): the remapped peer address becomes the peer's own.
        assert_eq!(
            forward_dst(&rw, "liqo.abcdefghij", ip("10.71.9.10")),
            ip("10.243.9.10")
        );
        // From the tunnel or eth0: untouched (the DNAT excludes them; a reply to a SNATed flow
        // never arrives there since the original left through a node interface).
        assert_eq!(
            forward_dst(&rw, "liqo-tunnel", ip("10.71.9.10")),
            ip("10.71.9.10")
        );
        assert_eq!(forward_dst(&rw, "eth0", ip("10.71.9.10")), ip("10.71.9.10"));
        // Outside the remapped CIDR: untouched.
        assert_eq!(
            forward_dst(&rw, "liqo.abcdefghij", ip("10.72.0.1")),
            ip("10.72.0.1")
        );
    }

    #[test]
    fn one_address_mappings_and_inexpressible_rules() {
        let yaml = REMAP
            .replace("to: 10.243.0.0/16", "to: 10.243.0.7")
            .replace(
                "value: 10.71.0.0/16, position: dst",
                "value: 10.71.0.9, position: dst",
            )
            .replace("to: 10.71.0.0/16", "to: 10.71.0.1");
        let (rw, un) = rewrites(&yaml);
        assert_eq!(rw.len(), 1, "{rw:?}");
        assert_eq!(
            forward_dst(&rw, "liqo.x", ip("10.71.0.9")),
            ip("10.243.0.7")
        );
        // Many sources onto one address cannot be undone by address alone.
        assert_eq!(un.len(), 1);
        assert_eq!(un[0].rule.chain, "incoming");
        let ports = REMAP.replace(
            "          - {op: neq, dev: {value: eth0, position: in}}\n",
            "          - {op: neq, dev: {value: eth0, position: in}}\n          - {op: eq, port: {value: '80', position: dst}}\n",
        );
        let (rw, un) = rewrites(&ports);
        assert_eq!(rw.len(), 1);
        assert_eq!(un[0].rule.chain, "outgoing");
    }
}
