//! Rules: filter rules (verdicts, marks, MSS clamping, notrack) and NAT rules (to an address,
//! to a prefix, masquerade), with the hooks each action is allowed on.

use peerwall_intent::types as api;

use super::matches::{family_name, lower_rule_matches, table_family_name, TableCx};
use super::values::{parse_nat_target, parse_u32};
use super::{Advice, Cx, Problem};
use crate::ir::{self, Action, ChainKind, Hook, NatAction, NatTarget, VerdictAction};

/// A filter rule: its action checked against the chain type and hook, its matches lowered.
pub(super) fn lower_filter_rule(
    cx: &mut Cx,
    tcx: &TableCx<'_>,
    path: &str,
    (rule, name): (&api::FilterRule, String),
    kind: ChainKind,
    hook: Hook,
) -> Option<ir::Rule> {
    let apath = format!("{path}.action");
    let vpath = format!("{path}.value");
    let action = match rule.action {
        None => {
            cx.err(&apath, Problem::Required);
            None
        }
        Some(
            a @ (api::FilterAction::Accept | api::FilterAction::Drop | api::FilterAction::Reject),
        ) => {
            let (v, an) = match a {
                api::FilterAction::Accept => (VerdictAction::Accept, "accept"),
                api::FilterAction::Drop => (VerdictAction::Drop, "drop"),
                _ => (VerdictAction::Reject, "reject"),
            };
            if kind != ChainKind::Filter {
                cx.err(
                    &apath,
                    Problem::ActionNotAllowed {
                        action: an,
                        why: "verdicts in nat/route chains run only for a flow's first packet; use a filter chain",
                    },
                );
                None
            } else if v == VerdictAction::Reject && hook == Hook::Postrouting {
                cx.err(
                    &apath,
                    Problem::ActionNotAllowed {
                        action: an,
                        why: "nftables refuses reject in postrouting chains",
                    },
                );
                None
            } else {
                Some(Action::Verdict(v))
            }
        }
        Some(api::FilterAction::Ctmark) => match rule.value.as_deref().map(parse_u32) {
            Some(Some(m)) => Some(Action::CtMark(m)),
            Some(None) => {
                cx.err(
                    &vpath,
                    Problem::BadActionValue {
                        value: rule.value.clone().unwrap_or_default(),
                        expected: "a 32-bit mark (decimal or 0x hex)",
                    },
                );
                None
            }
            None => {
                cx.err(&vpath, Problem::Required);
                None
            }
        },
        Some(api::FilterAction::Metamarkfromctmark) => Some(Action::MetaMarkFromCtMark),
        Some(api::FilterAction::Tcpmssclamp) => match rule.value.as_deref().map(str::trim) {
            // Liqo's chart writes "0" for "discover from the route's MTU"
            // (`deployments/liqo/values.yaml`, networking.gateway.mssclamp.value; Liqo's
            // `pkg/firewall/utils/filterule.go` clamps to `rt mtu` for 0).
            None | Some("") | Some("0") | Some("rt mtu") => Some(Action::TcpMssClamp(None)),
            Some(v) => match v.parse::<u16>() {
                Ok(mss) if mss >= 88 => Some(Action::TcpMssClamp(Some(mss))),
                _ => {
                    cx.err(
                        &vpath,
                        Problem::BadActionValue {
                            value: v.to_string(),
                            expected:
                                "an MSS from 88 to 65535, or 0 / \"rt mtu\" for the route's MTU",
                        },
                    );
                    None
                }
            },
        },
        Some(api::FilterAction::Notrack) => {
            if !matches!(hook, Hook::Prerouting | Hook::Output) {
                cx.warn(
                    &apath,
                    Advice::NoEffect(
                        "notrack only has an effect in prerouting and output chains before conntrack (priority < -200)",
                    ),
                );
            }
            Some(Action::Notrack)
        }
    };
    let matches = lower_rule_matches(cx, tcx, path, &rule.r#match, hook);
    action.map(|action| ir::Rule {
        name,
        matches,
        action,
        counter: rule.counter.unwrap_or(true),
    })
}

/// A NAT rule: its type checked against the hook, `to` parsed (an address, or a CIDR for a
/// prefix mapping), its matches lowered.
pub(super) fn lower_nat_rule(
    cx: &mut Cx,
    tcx: &TableCx<'_>,
    path: &str,
    (rule, name): (&api::NatRule, String),
    hook: Hook,
) -> Option<ir::Rule> {
    let tpath = format!("{path}.natType");
    let to_path = format!("{path}.to");
    let parse_to = |cx: &mut Cx| -> Option<NatTarget> {
        match rule.to.as_deref().map(str::trim) {
            None | Some("") => {
                cx.err(&to_path, Problem::Required);
                None
            }
            Some(v) => match parse_nat_target(v) {
                Ok((t, _)) if !tcx.family.sees(t.family()) => {
                    cx.err(
                        &to_path,
                        Problem::FamilyNotInTable {
                            value: v.to_string(),
                            family: family_name(t.family()),
                            table: table_family_name(tcx.family),
                        },
                    );
                    None
                }
                Ok((t, advice)) => {
                    if let Some(a) = advice {
                        cx.warn(&to_path, a);
                    }
                    Some(t)
                }
                Err(_) => {
                    cx.err(
                        &to_path,
                        Problem::BadActionValue {
                            value: v.to_string(),
                            expected: "an IP address, or a CIDR for a prefix mapping",
                        },
                    );
                    None
                }
            },
        }
    };
    let action = match rule.nat_type {
        None => {
            cx.err(&tpath, Problem::Required);
            None
        }
        Some(api::NatType::Dnat) => {
            if !matches!(hook, Hook::Prerouting | Hook::Output) {
                cx.err(
                    &tpath,
                    Problem::ActionNotAllowed {
                        action: "dnat",
                        why: "dnat is only allowed in prerouting and output chains",
                    },
                );
            }
            parse_to(cx).map(|a| Action::Nat(NatAction::Dnat(a)))
        }
        Some(api::NatType::Snat) => {
            if !matches!(hook, Hook::Postrouting | Hook::Input) {
                cx.err(
                    &tpath,
                    Problem::ActionNotAllowed {
                        action: "snat",
                        why: "snat is only allowed in postrouting and input chains",
                    },
                );
            }
            parse_to(cx).map(|a| Action::Nat(NatAction::Snat(a)))
        }
        Some(api::NatType::Masquerade) => {
            if hook != Hook::Postrouting {
                cx.err(
                    &tpath,
                    Problem::ActionNotAllowed {
                        action: "masquerade",
                        why: "masquerade is only allowed in postrouting chains",
                    },
                );
            }
            if rule.to.as_deref().is_some_and(|t| !t.trim().is_empty()) {
                cx.warn(
                    &to_path,
                    Advice::Ignored("masquerade translates to the output interface's address"),
                );
            }
            Some(Action::Nat(NatAction::Masquerade))
        }
    };
    let matches = lower_rule_matches(cx, tcx, path, &rule.r#match, hook);
    action.map(|action| ir::Rule {
        name,
        matches,
        action,
        counter: false,
    })
}
