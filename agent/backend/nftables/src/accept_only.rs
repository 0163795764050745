//! Base chains that can only accept are not installed.
//!
//! A filter base chain whose policy is accept and whose every rule ends in `accept` (matches,
//! a counter, nothing else: no drop, no reject, no jump, no log, no set update) gives every
//! packet the verdict `accept`, whatever it matches: in netfilter an accept ends only its own
//! base chain, and the packet goes on to the next one as if this one were not there. Such a
//! chain changes no verdict, yet every packet of its hook pays a walk of it: the NetworkPolicy
//! tier's `egress` chain where no policy selects a pod for egress is one (`replies` and
//! nothing else), a base chain walk and a conntrack-state test per forwarded packet
//! (`cargo xtask bench-gateway`, the 1000-NetworkPolicy tier's known flows).
//!
//! So the rendering leaves it out, with its rules (and their counters: `peerwall counters`
//! shows none for them). The policy's verdicts are unchanged, as the reference evaluator,
//! which still walks the chain, judges them (`tests/differential.rs`). Chains with event or
//! flow-log rules are kept (those rules are what a user reads), and so are chains rendered
//! for the probe engine or in audit mode (their counters say which rule decided). Pure: data
//! in, data out; run before the decided-flow cache ([`crate::decided`]), which would give such
//! a chain a lookup and a keep chain of its own.

use peerwall_policy::ir::ChainKind;

use crate::model::{Expr, Policy, Rule, Table};

/// Whether `r` accepts every packet it matches and does nothing else (a counter aside).
fn accepts_only(r: &Rule) -> bool {
    matches!(r.exprs.last(), Some(Expr::Accept))
        && r.exprs
            .iter()
            .all(|e| matches!(e, Expr::Match { .. } | Expr::Counter | Expr::Accept))
}

/// Remove from `t` the filter base chains of policy accept that can only accept, and their
/// rules; the names of the chains removed.
pub fn remove(t: &mut Table) -> Vec<String> {
    let gone: Vec<String> = t
        .chains
        .iter()
        .filter(|c| c.kind == ChainKind::Filter && c.policy == Policy::Accept)
        .filter(|c| !t.regular.iter().any(|r| r.base == c.name))
        .filter(|c| {
            t.rules
                .iter()
                .filter(|r| r.chain == c.name)
                .all(accepts_only)
        })
        .map(|c| c.name.clone())
        .collect();
    t.chains.retain(|c| !gone.contains(&c.name));
    t.rules.retain(|r| !gone.contains(&r.chain));
    gone
}

#[cfg(test)]
mod tests;
