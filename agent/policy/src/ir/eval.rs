//! The reference evaluator: the judge both backends are tested against.
//!
//! Semantics (README, "The intent API", is the user-facing statement of what this implements):
//! a packet traverses the hooks of its path in order; at each hook the filter chains of every
//! table that sees the packet's family run in ascending (priority, table name, chain name).
//! Within a chain the first rule whose matches all hold decides: `accept` ends the chain,
//! `drop`/`reject` are final; marking actions do not decide. No matching rule: the chain policy.
//! The packet survives only if every chain on its path accepts it.
//!
//! Audit mode ([`super::Table::audit`]): when a chain of an audited table decides drop or
//! reject, the packet is accepted by that chain instead (a *would-drop*) and evaluation goes on;
//! the verdict reports the first would-drop on the path in [`Verdict::audit`].

use std::net::IpAddr;

use serde::Serialize;

use super::{ChainKind, Dir, Hook, IfDir, IpFamily, Policy, Test};

/// Final fate of a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VerdictAction {
    /// Delivered.
    Accept,
    /// Silently discarded.
    Drop,
    /// Discarded with an ICMP/ICMPv6 port unreachable to the sender.
    Reject,
}

impl VerdictAction {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accept => "accept",
            Self::Drop => "drop",
            Self::Reject => "reject",
        }
    }
}

/// Conntrack state of a packet.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum CtState {
    /// First packet of a flow.
    New,
    /// Flow seen in both directions.
    Established,
    /// Related to a known flow (ICMP error).
    Related,
    /// Conntrack disabled for this packet.
    Untracked,
    /// Conntrack could not classify the packet.
    Invalid,
}

impl CtState {
    /// All states.
    pub const ALL: [CtState; 5] = [
        Self::New,
        Self::Established,
        Self::Related,
        Self::Untracked,
        Self::Invalid,
    ];

    /// Bit in an IR ct-state mask.
    pub const fn bit(self) -> u8 {
        match self {
            Self::New => 1,
            Self::Established => 2,
            Self::Related => 4,
            Self::Untracked => 8,
            Self::Invalid => 16,
        }
    }

    /// nft keyword.
    pub fn nft(self) -> &'static str {
        match self {
            Self::New => "new",
            Self::Established => "established",
            Self::Related => "related",
            Self::Untracked => "untracked",
            Self::Invalid => "invalid",
        }
    }
}

/// Which hooks a packet traverses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PacketPath {
    /// Routed through the gateway: prerouting, forward, postrouting.
    Forward,
    /// Addressed to the gateway: prerouting, input.
    Input,
    /// Sent by the gateway: output, postrouting.
    Output,
}

impl PacketPath {
    /// Hooks in traversal order.
    pub fn hooks(self) -> &'static [Hook] {
        match self {
            Self::Forward => &[Hook::Prerouting, Hook::Forward, Hook::Postrouting],
            Self::Input => &[Hook::Prerouting, Hook::Input],
            Self::Output => &[Hook::Output, Hook::Postrouting],
        }
    }
}

/// IP protocol numbers.
pub mod proto {
    /// ICMP.
    pub const ICMP: u8 = 1;
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
    /// ICMPv6.
    pub const ICMPV6: u8 = 58;
    /// SCTP.
    pub const SCTP: u8 = 132;

    /// Whether packets of protocol `p` carry ports (TCP, UDP, SCTP): the only ones a port
    /// match can hold for, as with nftables' `th sport`/`th dport`.
    pub fn carries_ports(p: u8) -> bool {
        matches!(p, TCP | UDP | SCTP)
    }
}

/// A packet as the evaluator sees it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Packet {
    /// Source address.
    pub src: IpAddr,
    /// Destination address (same family as `src`).
    pub dst: IpAddr,
    /// Layer-4 protocol number.
    pub proto: u8,
    /// Source port (TCP/UDP/SCTP; ignored otherwise).
    pub sport: u16,
    /// Destination port (TCP/UDP/SCTP; ignored otherwise).
    pub dport: u16,
    /// Input interface (forward and input paths).
    pub iif: Option<String>,
    /// Output interface (forward and output paths).
    pub oif: Option<String>,
    /// Conntrack state.
    pub ct_state: CtState,
}

impl Packet {
    /// Address family.
    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.src)
    }

    /// Path derived from the known interfaces: both → forward, only `iif` → input, else output.
    pub fn path(&self) -> PacketPath {
        match (&self.iif, &self.oif) {
            (Some(_), Some(_)) => PacketPath::Forward,
            (Some(_), None) => PacketPath::Input,
            _ => PacketPath::Output,
        }
    }

    fn has_ports(&self) -> bool {
        proto::carries_ports(self.proto)
    }

    /// Interface name as netfilter sees it at `hook` ("" when not known there).
    fn iface_at(&self, hook: Hook, dir: IfDir) -> &str {
        let known = match (dir, hook) {
            (IfDir::In, Hook::Output) => false,
            (IfDir::In, Hook::Postrouting) => self.path() == PacketPath::Forward,
            (IfDir::In, _) => true,
            (IfDir::Out, Hook::Prerouting | Hook::Input) => false,
            (IfDir::Out, _) => true,
        };
        let name = match dir {
            IfDir::In => &self.iif,
            IfDir::Out => &self.oif,
        };
        if known {
            name.as_deref().unwrap_or("")
        } else {
            ""
        }
    }
}

/// The fate of a packet and what decided it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// accept, drop or reject.
    pub verdict: VerdictAction,
    /// Table of the deciding chain (None when no chain is on the path).
    pub table: Option<String>,
    /// Deciding chain: for drop/reject the chain that refused, for accept the last chain run.
    pub chain: Option<String>,
    /// Deciding rule; None when the chain policy decided.
    pub rule: Option<String>,
    /// The first would-drop on the path: a chain of an audited table that decided drop or
    /// reject and accepted the packet instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditHit>,
}

impl Verdict {
    /// Accept, decided by no chain (nothing on the path).
    pub fn nothing_on_path() -> Self {
        Self {
            verdict: VerdictAction::Accept,
            table: None,
            chain: None,
            rule: None,
            audit: None,
        }
    }

    /// Fold the outcome `v` of the next chain on the path (`rule` None: its policy) into this
    /// verdict; false when evaluation ends there. A drop or reject of an audited table is a
    /// would-drop: recorded in [`Verdict::audit`] (the first one), the chain accepts. Every
    /// engine (evaluator, probes, simulation) folds its chains with this one function.
    pub fn fold(
        &mut self,
        table: &str,
        chain: &str,
        audited: bool,
        v: VerdictAction,
        rule: Option<String>,
    ) -> bool {
        let would = v != VerdictAction::Accept && audited;
        if would && self.audit.is_none() {
            self.audit = Some(AuditHit {
                table: table.to_string(),
                chain: chain.to_string(),
                rule: rule.clone(),
                would: v,
            });
        }
        self.verdict = if would { VerdictAction::Accept } else { v };
        self.table = Some(table.to_string());
        self.chain = Some(chain.to_string());
        self.rule = rule;
        self.verdict == VerdictAction::Accept
    }
}

/// A would-drop: what an audited chain would have done to the packet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AuditHit {
    /// Table.
    pub table: String,
    /// Chain.
    pub chain: String,
    /// Rule; None when the chain policy would have dropped.
    pub rule: Option<String>,
    /// drop or reject.
    pub would: VerdictAction,
}

/// A filter chain on the packet's path, in traversal order.
#[derive(Clone, Copy, Debug)]
pub struct PathChain<'a> {
    /// Table.
    pub table: &'a super::Table,
    /// Chain.
    pub chain: &'a super::Chain,
}

/// Filter chains at one hook for packets of `family`, in evaluation order.
pub fn chains_on_path_hook(policy: &Policy, family: IpFamily, hook: Hook) -> Vec<PathChain<'_>> {
    let mut at_hook: Vec<PathChain<'_>> = policy
        .tables
        .iter()
        .filter(|t| t.family.sees(family))
        .flat_map(|t| {
            t.chains
                .iter()
                .filter(|c| c.hook == hook && c.kind == ChainKind::Filter)
                .map(move |c| PathChain { table: t, chain: c })
        })
        .collect();
    at_hook.sort_by(|a, b| {
        (a.chain.priority, &a.table.name, &a.chain.name).cmp(&(
            b.chain.priority,
            &b.table.name,
            &b.chain.name,
        ))
    });
    at_hook
}

/// Filter chains that a packet of `family` on `path` traverses, in order.
pub fn chains_on_path(policy: &Policy, family: IpFamily, path: PacketPath) -> Vec<PathChain<'_>> {
    path.hooks()
        .iter()
        .flat_map(|h| chains_on_path_hook(policy, family, *h))
        .collect()
}

/// Whether one test holds for a packet at a hook (before negation).
fn test_holds(test: &Test, pkt: &Packet, hook: Hook) -> Option<bool> {
    Some(match test {
        Test::Addr { dir, set, .. } => {
            // An address test exists only for packets of its family (nft adds an implicit
            // `meta nfproto` dependency): otherwise the match fails, whether eq or neq.
            if set.family() != pkt.family() {
                return None;
            }
            let a = match dir {
                Dir::Src => &pkt.src,
                Dir::Dst => &pkt.dst,
            };
            set.contains(a)
        }
        Test::Port { dir, set, .. } => {
            if !pkt.has_ports() {
                return None;
            }
            set.contains(match dir {
                Dir::Src => pkt.sport,
                Dir::Dst => pkt.dport,
            })
        }
        Test::Proto(list) => list.contains(&pkt.proto),
        Test::Iface {
            dir,
            name,
            wildcard,
        } => {
            let seen = pkt.iface_at(hook, *dir);
            if *wildcard {
                seen.starts_with(name.as_str())
            } else {
                seen == name
            }
        }
        Test::CtState(mask) => mask & pkt.ct_state.bit() != 0,
    })
}

/// Evaluate a packet as it arrives on its input interface: its destination first rewritten as
/// prerouting's NAT does ([`super::nat`]; the policy's own NAT rules and the observed ones).
pub fn evaluate_at_ingress(policy: &Policy, pkt: &Packet) -> Verdict {
    let Some(iif) = pkt.iif.as_deref() else {
        return evaluate(policy, pkt);
    };
    let (rewrites, _) = policy.dst_rewrites();
    let dst = super::nat::forward_dst(&rewrites, iif, pkt.dst);
    if dst == pkt.dst {
        return evaluate(policy, pkt);
    }
    evaluate(policy, &Packet { dst, ..pkt.clone() })
}

/// Whether a rule's matches all hold.
pub fn rule_matches(rule: &super::Rule, pkt: &Packet, hook: Hook) -> bool {
    rule.matches
        .iter()
        .all(|m| test_holds(&m.test, pkt, hook).is_some_and(|h| h != m.negate))
}

/// Outcome of one chain: the verdict and the deciding rule (None = policy).
pub fn run_chain<'a>(
    chain: &'a super::Chain,
    pkt: &Packet,
) -> (VerdictAction, Option<&'a super::Rule>) {
    for rule in &chain.rules {
        // Non-deciding actions (marks, notrack, nat) never end evaluation.
        if let Some(v) = rule.action.verdict() {
            if rule_matches(rule, pkt, chain.hook) {
                return (v, Some(rule));
            }
        }
    }
    (chain.policy, None)
}

/// The fate of `pkt` under `policy`.
///
/// `pkt` carries the addresses the filter hooks see, i.e. after prerouting's NAT; for a packet
/// as it arrives on its input interface use [`evaluate_at_ingress`].
pub fn evaluate(policy: &Policy, pkt: &Packet) -> Verdict {
    let mut last = Verdict::nothing_on_path();
    for pc in chains_on_path(policy, pkt.family(), pkt.path()) {
        let (v, rule) = run_chain(pc.chain, pkt);
        let name = rule.map(|r| r.name.clone());
        if !last.fold(&pc.table.name, &pc.chain.name, pc.table.audit, v, name) {
            break;
        }
    }
    last
}
