//! What the bpf backend leaves to nftables: actions that change packets or conntrack.

use peerwall_policy::ir::{self, ChainKind};

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
