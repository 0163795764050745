//! Chains: type, hook, priority and policy combinations nftables takes, and their rules.

use peerwall_intent::types as api;

use super::matches::TableCx;
use super::names::{check_identifier, rule_names};
use super::rules::{lower_filter_rule, lower_nat_rule};
use super::{Cx, Problem};
use crate::ir::{self, ChainKind, Hook, VerdictAction};

pub(super) fn lower_hook(h: api::ChainHook) -> Option<Hook> {
    Some(match h {
        api::ChainHook::Prerouting => Hook::Prerouting,
        api::ChainHook::Input => Hook::Input,
        api::ChainHook::Forward => Hook::Forward,
        api::ChainHook::Output => Hook::Output,
        api::ChainHook::Postrouting => Hook::Postrouting,
        api::ChainHook::Ingress => return None,
    })
}

/// One chain: its name, type, hook, priority and policy checked, its rules lowered.
pub(super) fn lower_chain(
    cx: &mut Cx,
    table_cx: &TableCx<'_>,
    path: &str,
    chain: &api::Chain,
) -> Option<ir::Chain> {
    let tcx = &TableCx {
        family: table_cx.family,
        sets: table_cx.sets,
        priority: chain.priority.unwrap_or(0),
    };
    let name = chain.name.clone().unwrap_or_default();
    match &chain.name {
        None => cx.err(format!("{path}.name"), Problem::Required),
        Some(n) => check_identifier(cx, &format!("{path}.name"), n),
    }
    let kind = match chain.type_ {
        Some(api::ChainType::Filter) => Some(ChainKind::Filter),
        Some(api::ChainType::Nat) => Some(ChainKind::Nat),
        Some(api::ChainType::Route) => Some(ChainKind::Route),
        None => {
            cx.err(format!("{path}.type"), Problem::Required);
            None
        }
    };
    let hpath = format!("{path}.hook");
    let hook = match chain.hook {
        None => {
            cx.err(&hpath, Problem::Required);
            None
        }
        Some(h) => {
            let hook = lower_hook(h);
            if hook.is_none() {
                cx.err(
                    &hpath,
                    Problem::HookNotAllowed {
                        hook: "ingress",
                        chain_type: kind.map_or("filter", ChainKind::nft),
                        why: "an ingress chain needs a device, which the API cannot name; use prerouting",
                    },
                );
            }
            hook
        }
    };
    let priority = chain.priority.unwrap_or(0);
    if let (Some(k), Some(h)) = (kind, hook) {
        check_hook(cx, path, k, h, priority);
    }
    let policy = match chain.policy {
        Some(api::ChainPolicy::Accept) => Some(VerdictAction::Accept),
        Some(api::ChainPolicy::Drop) => {
            if kind.is_some_and(|k| k != ChainKind::Filter) {
                cx.err(
                    format!("{path}.policy"),
                    Problem::PolicyNotAllowed("only filter chains decide verdicts"),
                );
            }
            Some(VerdictAction::Drop)
        }
        None => {
            cx.err(format!("{path}.policy"), Problem::Required);
            None
        }
    };
    let rules = match (kind, hook) {
        (Some(kind), Some(hook)) => lower_rules(cx, tcx, path, &chain.rules, kind, hook),
        _ => Vec::new(),
    };
    Some(ir::Chain {
        name,
        kind: kind?,
        hook: hook?,
        priority,
        policy: policy?,
        rules,
    })
}

/// The rules of a chain of `kind` on `hook`: exactly one rules kind, the one the chain type
/// takes; every rule named (or given a stable name) and lowered.
fn lower_rules(
    cx: &mut Cx,
    tcx: &TableCx<'_>,
    path: &str,
    rules: &api::RulesSet,
    kind: ChainKind,
    hook: Hook,
) -> Vec<ir::Rule> {
    let rs = rules;
    let set_count = [
        rs.nat_rules.is_some(),
        rs.filter_rules.is_some(),
        rs.route_rules.is_some(),
    ]
    .iter()
    .filter(|b| **b)
    .count();
    if set_count > 1 {
        cx.err(
            format!("{path}.rules"),
            Problem::RulesNotExactlyOne(set_count),
        );
    }
    let mut rules = Vec::new();
    {
        let mismatch = |cx: &mut Cx, field: &'static str| {
            cx.err(
                format!("{path}.rules.{field}"),
                Problem::RulesKindMismatch {
                    field,
                    chain_type: kind.nft(),
                },
            )
        };
        if let Some(frs) = &rs.filter_rules {
            if kind == ChainKind::Route {
                mismatch(cx, "filterRules");
            }
            let rpath = |j: usize| format!("{path}.rules.filterRules[{j}]");
            let named = rule_names(cx, frs, |r| r.name.as_deref(), rpath);
            for (j, r) in frs.iter().zip(named).enumerate() {
                rules.extend(lower_filter_rule(cx, tcx, &rpath(j), r, kind, hook));
            }
        }
        if let Some(nrs) = &rs.nat_rules {
            if kind != ChainKind::Nat {
                mismatch(cx, "natRules");
            }
            let rpath = |j: usize| format!("{path}.rules.natRules[{j}]");
            let named = rule_names(cx, nrs, |r| r.name.as_deref(), rpath);
            for (j, r) in nrs.iter().zip(named).enumerate() {
                rules.extend(lower_nat_rule(cx, tcx, &rpath(j), r, hook));
            }
        }
        if let Some(rrs) = &rs.route_rules {
            if kind != ChainKind::Route {
                mismatch(cx, "routeRules");
            }
            let rpath = |j: usize| format!("{path}.rules.routeRules[{j}]");
            rule_names(cx, rrs, |r| r.name.as_deref(), rpath);
        }
    }
    rules
}

/// Hook, type and priority combinations nftables refuses.
fn check_hook(cx: &mut Cx, path: &str, k: ChainKind, h: Hook, priority: i32) {
    let hpath = format!("{path}.hook");
    match k {
        ChainKind::Nat if h == Hook::Forward => cx.err(
            &hpath,
            Problem::HookNotAllowed {
                hook: "forward",
                chain_type: "nat",
                why: "nat chains hook prerouting, input, output or postrouting",
            },
        ),
        ChainKind::Nat if priority <= -200 => cx.err(
            format!("{path}.priority"),
            Problem::PriorityNotAllowed {
                value: priority,
                why: "nat chains must run after conntrack (priority > -200)",
            },
        ),
        ChainKind::Route if h != Hook::Output => cx.err(
            &hpath,
            Problem::HookNotAllowed {
                hook: h.nft(),
                chain_type: "route",
                why: "route chains only hook output",
            },
        ),
        _ => {}
    }
}
