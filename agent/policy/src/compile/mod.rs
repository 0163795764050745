//! Validation and lowering: FirewallConfiguration specs in, policy IR out.
//!
//! One function serves every caller (CLI, agent, admission webhook): [`compile_object`]
//! validates a spec completely, collecting every error with its field path, and only when there
//! are none yields the IR table. [`compile`] adds the checks across objects.
//! Pure: no I/O, no kube client, no kernel.

pub mod errors;
pub mod values;

use std::collections::HashMap;

use crate::ir::{
    self, Action, AddrSet, ChainKind, Dir, Hook, IfDir, IpFamily, Match, NamedSet, NatAction,
    NatTarget, Origin, PortSet, SetElements, Source, TableFamily, Test, VerdictAction,
};
pub use errors::{Advice, CompileError, FieldError, ObjectErrors, Problem, Warning};
use peerwall_intent::types as api;
use values::{
    generated_rule_name, parse_addr_item, parse_nat_target, parse_port_item, parse_u32, split_list,
};

pub use peerwall_intent::PolicyObject;

/// A validated table and what to tell the user about it.
#[derive(Clone, Debug, PartialEq)]
pub struct CompiledTable {
    /// The IR table.
    pub table: ir::Table,
    /// Warnings.
    pub warnings: Vec<Warning>,
}

/// A compiled policy with warnings per object.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Compiled {
    /// The policy.
    pub policy: ir::Policy,
    /// Warnings, with the object they came from.
    pub warnings: Vec<(Origin, Warning)>,
}

struct Cx {
    errors: Vec<FieldError>,
    warnings: Vec<Warning>,
}

impl Cx {
    fn err(&mut self, path: impl Into<String>, problem: Problem) {
        self.errors.push(FieldError {
            path: path.into(),
            problem,
        });
    }
    fn warn(&mut self, path: impl Into<String>, advice: Advice) {
        self.warnings.push(Warning {
            path: path.into(),
            advice,
        });
    }
}

/// Longest nftables table, chain or set name (`NFT_NAME_MAXLEN` is 256 with the NUL).
const NFT_NAME_MAX: usize = 255;

/// nftables identifiers: a letter, digit or `_` first, then letters, digits, `_ . - /`. Names
/// are passed to nft as JSON strings, so a leading digit works (Liqo names tables after nodes
/// and resources, which may start with one), as do Kubernetes-length names.
fn check_identifier(cx: &mut Cx, path: &str, name: &str) {
    let ok_first = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    let ok_rest = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '/'));
    if name.is_empty() {
        cx.err(path, Problem::Empty);
    } else if name.starts_with("__") {
        cx.err(
            path,
            Problem::BadName {
                value: name.into(),
                why: "names starting with \"__\" are reserved for peerwall",
            },
        );
    } else if name.len() > NFT_NAME_MAX {
        cx.err(
            path,
            Problem::BadName {
                value: name.into(),
                why: "longer than 255 characters",
            },
        );
    } else if !ok_first || !ok_rest {
        cx.err(
            path,
            Problem::BadName {
                value: name.into(),
                why: "use a letter, digit or '_' first, then letters, digits, '_', '.', '-', '/'",
            },
        );
    }
}

/// Rule names become nft comments: printable, no quotes or backslashes, at most 120 bytes.
fn check_rule_name(cx: &mut Cx, path: &str, name: &str) {
    if name.is_empty() {
        cx.err(path, Problem::Empty);
    } else if name.len() > 120 {
        cx.err(
            path,
            Problem::BadName {
                value: name.into(),
                why: "longer than 120 bytes",
            },
        );
    } else if name
        .chars()
        .any(|c| c.is_control() || c == '"' || c == '\\')
    {
        cx.err(
            path,
            Problem::BadName {
                value: name.into(),
                why: "quotes, backslashes and control characters are not allowed",
            },
        );
    }
}

fn family_name(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "IPv4",
        IpFamily::V6 => "IPv6",
    }
}

fn table_family_name(f: TableFamily) -> &'static str {
    match f {
        TableFamily::Ip => "IPV4",
        TableFamily::Ip6 => "IPV6",
        TableFamily::Inet => "INET",
    }
}

/// Parse a list of address items of one family that fits the table.
fn lower_addr_list(
    cx: &mut Cx,
    path: &str,
    value: &str,
    items: &[&str],
    table_family: TableFamily,
) -> Option<AddrSet> {
    let mut family: Option<IpFamily> = None;
    let mut ranges = Vec::new();
    let mut ok = true;
    for item in items {
        match parse_addr_item(item) {
            Ok(a) => {
                if let Some(adv) = a.advice {
                    cx.warn(path, adv);
                }
                if !table_family.sees(a.family) {
                    cx.err(
                        path,
                        Problem::FamilyNotInTable {
                            value: (*item).to_string(),
                            family: family_name(a.family),
                            table: table_family_name(table_family),
                        },
                    );
                    ok = false;
                } else if family.is_some_and(|f| f != a.family) {
                    cx.err(path, Problem::MixedFamilies(value.to_string()));
                    ok = false;
                } else {
                    family = Some(a.family);
                    ranges.push(a.range);
                }
            }
            Err(p) => {
                cx.err(path, p);
                ok = false;
            }
        }
    }
    match (ok, family) {
        (true, Some(f)) => Some(AddrSet::from_ranges(f, ranges)),
        (true, None) => {
            cx.err(path, Problem::Empty);
            None
        }
        _ => None,
    }
}

fn lower_port_list(cx: &mut Cx, path: &str, items: &[&str]) -> Option<PortSet> {
    let mut ranges = Vec::new();
    let mut ok = true;
    for item in items {
        match parse_port_item(item) {
            Ok(r) => ranges.push(r),
            Err(p) => {
                cx.err(path, p);
                ok = false;
            }
        }
    }
    if ok && ranges.is_empty() {
        cx.err(path, Problem::Empty);
        return None;
    }
    ok.then(|| PortSet::from_ranges(ranges))
}

struct TableCx<'a> {
    family: TableFamily,
    sets: &'a HashMap<String, SetElements>,
    /// Priority of the chain being lowered.
    priority: i32,
}

fn position(p: Option<api::MatchPosition>) -> Option<Dir> {
    p.map(|p| match p {
        api::MatchPosition::Src => Dir::Src,
        api::MatchPosition::Dst => Dir::Dst,
    })
}

fn lower_match(
    cx: &mut Cx,
    tcx: &TableCx<'_>,
    path: &str,
    m: &api::Match,
    hook: Hook,
) -> Vec<Match> {
    let priority = tcx.priority;
    let mut out = Vec::new();
    let negate = match m.op {
        Some(api::MatchOperation::Eq) => false,
        Some(api::MatchOperation::Neq) => true,
        None => {
            cx.err(format!("{path}.op"), Problem::Required);
            false
        }
    };
    let op_name = if negate { "neq" } else { "eq" };
    if m.ip.is_none()
        && m.port.is_none()
        && m.proto.is_none()
        && m.dev.is_none()
        && m.ctstate.is_none()
    {
        cx.err(path, Problem::EmptyMatch);
    }
    if let Some(ip) = &m.ip {
        let vpath = format!("{path}.ip.value");
        let dir = position(ip.position);
        if dir.is_none() {
            cx.err(format!("{path}.ip.position"), Problem::Required);
        }
        let items = split_list(&ip.value);
        let lowered = match items.as_slice() {
            [] => {
                cx.err(&vpath, Problem::Empty);
                None
            }
            [one] if one.starts_with('@') => {
                let name = &one[1..];
                match tcx.sets.get(name) {
                    Some(SetElements::Addr(s)) => Some((s.clone(), Source::Named(name.into()))),
                    Some(SetElements::Port(_)) => {
                        cx.err(
                            &vpath,
                            Problem::SetTypeMismatch {
                                value: ip.value.clone(),
                                expected: "addresses (ipv4_addr, ipv4_cidr, ipv6_addr, ipv6_cidr)",
                            },
                        );
                        None
                    }
                    None => {
                        cx.err(&vpath, Problem::UnknownSet(ip.value.clone()));
                        None
                    }
                }
            }
            items => lower_addr_list(cx, &vpath, &ip.value, items, tcx.family)
                .map(|s| (s, Source::Inline { count: items.len() })),
        };
        if let (Some((set, source)), Some(dir)) = (lowered, dir) {
            out.push(Match {
                negate,
                test: Test::Addr { dir, set, source },
            });
        }
    }
    if let Some(port) = &m.port {
        let vpath = format!("{path}.port.value");
        let dir = position(port.position);
        if dir.is_none() {
            cx.err(format!("{path}.port.position"), Problem::Required);
        }
        let items = split_list(&port.value);
        let lowered = match items.as_slice() {
            [] => {
                cx.err(&vpath, Problem::Empty);
                None
            }
            [one] if one.starts_with('@') => {
                let name = &one[1..];
                match tcx.sets.get(name) {
                    Some(SetElements::Port(s)) => Some((s.clone(), Source::Named(name.into()))),
                    Some(SetElements::Addr(_)) => {
                        cx.err(
                            &vpath,
                            Problem::SetTypeMismatch {
                                value: port.value.clone(),
                                expected: "ports (integer)",
                            },
                        );
                        None
                    }
                    None => {
                        cx.err(&vpath, Problem::UnknownSet(port.value.clone()));
                        None
                    }
                }
            }
            items => lower_port_list(cx, &vpath, items)
                .map(|s| (s, Source::Inline { count: items.len() })),
        };
        if let (Some((set, source)), Some(dir)) = (lowered, dir) {
            out.push(Match {
                negate,
                test: Test::Port { dir, set, source },
            });
        }
    }
    if let Some(proto) = &m.proto {
        let n = match proto.value {
            api::L4Proto::Tcp => ir::eval::proto::TCP,
            api::L4Proto::Udp => ir::eval::proto::UDP,
            api::L4Proto::Icmp => ir::eval::proto::ICMP,
            api::L4Proto::Icmpv6 => ir::eval::proto::ICMPV6,
        };
        out.push(Match {
            negate,
            test: Test::Proto(vec![n]),
        });
    }
    if let Some(dev) = &m.dev {
        let vpath = format!("{path}.dev.value");
        let dir = match dev.position {
            Some(api::MatchDevPosition::In) => Some(IfDir::In),
            Some(api::MatchDevPosition::Out) => Some(IfDir::Out),
            None => {
                cx.err(format!("{path}.dev.position"), Problem::Required);
                None
            }
        };
        let name = dev.value.trim_end_matches('*');
        let wildcard = dev.wildcard || dev.value.ends_with('*');
        if name.is_empty() && !wildcard {
            cx.err(&vpath, Problem::Empty);
        } else if name.len() > 15 {
            cx.err(
                &vpath,
                Problem::BadName {
                    value: dev.value.clone(),
                    why: "interface names have at most 15 characters",
                },
            );
        } else if name
            .chars()
            .any(|c| c.is_whitespace() || c == '/' || c == '"' || c == '*' || c == '\\')
        {
            cx.err(
                &vpath,
                Problem::BadName {
                    value: dev.value.clone(),
                    why: "interface names cannot hold spaces, '/', quotes or inner '*'",
                },
            );
        } else if let Some(dir) = dir {
            let unknown_here = match dir {
                IfDir::Out => matches!(hook, Hook::Prerouting | Hook::Input),
                IfDir::In => hook == Hook::Output,
            };
            if unknown_here {
                cx.warn(
                    &vpath,
                    Advice::IfaceUnknownAtHook {
                        position: if dir == IfDir::In { "in" } else { "out" },
                        hook: hook.nft(),
                        op: op_name,
                    },
                );
            }
            out.push(Match {
                negate,
                test: Test::Iface {
                    dir,
                    name: name.to_string(),
                    wildcard,
                },
            });
        }
    }
    if let Some(ct) = &m.ctstate {
        if ct.value.is_empty() {
            cx.err(format!("{path}.ctstate.value"), Problem::Empty);
        } else if matches!(hook, Hook::Prerouting | Hook::Output) && priority <= -200 {
            cx.err(
                format!("{path}.ctstate"),
                Problem::PriorityNotAllowed {
                    value: priority,
                    why: "conntrack has not classified the packet yet at priority <= -200; use a later priority",
                },
            );
        } else {
            let mask = ct.value.iter().fold(0u8, |acc, s| {
                acc | match s {
                    api::CtState::New => ir::CtState::New.bit(),
                    api::CtState::Established => ir::CtState::Established.bit(),
                    api::CtState::Related => ir::CtState::Related.bit(),
                    api::CtState::Untracked => ir::CtState::Untracked.bit(),
                    api::CtState::Invalid => ir::CtState::Invalid.bit(),
                }
            });
            out.push(Match {
                negate,
                test: Test::CtState(mask),
            });
        }
    }
    out
}

fn lower_sets(cx: &mut Cx, table: &api::Table, family: TableFamily) -> Vec<NamedSet> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut out = Vec::new();
    for (i, set) in table.sets.iter().enumerate() {
        let path = format!("spec.table.sets[{i}]");
        check_identifier(cx, &format!("{path}.name"), &set.name);
        if let Some(first) = seen.insert(&set.name, i) {
            cx.err(
                format!("{path}.name"),
                Problem::Duplicate {
                    value: set.name.clone(),
                    first: format!("spec.table.sets[{first}].name"),
                },
            );
        }
        if set.data_type.is_some() {
            cx.warn(format!("{path}.dataType"), Advice::DataTypeIgnored);
        }
        let Some(key_type) = set.key_type else {
            cx.err(format!("{path}.keyType"), Problem::Required);
            continue;
        };
        let (fam, key_name) = match key_type {
            api::SetDataType::Integer => (None, "integer"),
            api::SetDataType::Ipv4Addr => (Some(IpFamily::V4), "ipv4_addr"),
            api::SetDataType::Ipv4Cidr => (Some(IpFamily::V4), "ipv4_cidr"),
            api::SetDataType::Ipv6Addr => (Some(IpFamily::V6), "ipv6_addr"),
            api::SetDataType::Ipv6Cidr => (Some(IpFamily::V6), "ipv6_cidr"),
        };
        if let Some(f) = fam {
            if !family.sees(f) {
                cx.err(
                    format!("{path}.keyType"),
                    Problem::FamilyNotInTable {
                        value: key_name.to_string(),
                        family: family_name(f),
                        table: table_family_name(family),
                    },
                );
                continue;
            }
        }
        let mut addr_ranges = Vec::new();
        let mut port_ranges = Vec::new();
        for (j, el) in set.elements.iter().enumerate() {
            let epath = format!("{path}.elements[{j}].key");
            match fam {
                Some(f) => match parse_addr_item(&el.key) {
                    Ok(a) if a.family == f => {
                        if let Some(adv) = a.advice {
                            cx.warn(&epath, adv);
                        }
                        addr_ranges.push(a.range);
                    }
                    _ => cx.err(
                        &epath,
                        Problem::BadSetElement {
                            value: el.key.clone(),
                            key_type: key_name,
                        },
                    ),
                },
                None => match parse_port_item(&el.key) {
                    Ok(r) => port_ranges.push(r),
                    Err(_) => {
                        // Integer sets may hold values above 65535 for other uses, but
                        // peerwall only uses them as port sets.
                        cx.err(
                            &epath,
                            Problem::BadSetElement {
                                value: el.key.clone(),
                                key_type: "integer (port 0-65535 or range)",
                            },
                        )
                    }
                },
            }
        }
        let elements = match fam {
            Some(f) => SetElements::Addr(AddrSet::from_ranges(f, addr_ranges)),
            None => SetElements::Port(PortSet::from_ranges(port_ranges)),
        };
        out.push(NamedSet {
            name: set.name.clone(),
            elements,
        });
    }
    out
}

fn lower_hook(h: api::ChainHook) -> Option<Hook> {
    Some(match h {
        api::ChainHook::Prerouting => Hook::Prerouting,
        api::ChainHook::Input => Hook::Input,
        api::ChainHook::Forward => Hook::Forward,
        api::ChainHook::Output => Hook::Output,
        api::ChainHook::Postrouting => Hook::Postrouting,
        api::ChainHook::Ingress => return None,
    })
}

/// Matches of one rule; a rule testing IPv4 and IPv6 addresses together is refused.
fn lower_rule_matches(
    cx: &mut Cx,
    tcx: &TableCx<'_>,
    path: &str,
    matches: &[api::Match],
    hook: Hook,
) -> Vec<Match> {
    let mut out = Vec::new();
    for (k, m) in matches.iter().enumerate() {
        out.extend(lower_match(cx, tcx, &format!("{path}.match[{k}]"), m, hook));
    }
    let fams: Vec<IpFamily> = out
        .iter()
        .filter_map(|m| match &m.test {
            Test::Addr { set, .. } => Some(set.family()),
            _ => None,
        })
        .collect();
    if fams.windows(2).any(|w| w[0] != w[1]) {
        cx.err(format!("{path}.match"), Problem::RuleMixesFamilies);
    }
    out
}

fn lower_filter_rule(
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
            // Liqo's chart writes "0" for "discover from the route's MTU".
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

fn lower_nat_rule(
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

/// The name of every rule of a chain: its own (checked, unique in the chain), or for a rule
/// without one (Liqo's controllers create them; its mutating webhook names them only where it
/// runs) a stable name from its content, with a warning. Generated names never take a name
/// written elsewhere in the chain.
fn rule_names<R: serde::Serialize>(
    cx: &mut Cx,
    rules: &[R],
    name_of: impl Fn(&R) -> Option<&str>,
    path_of: impl Fn(usize) -> String,
) -> Vec<String> {
    let mut taken: HashMap<String, String> = HashMap::new();
    for (j, r) in rules.iter().enumerate() {
        let Some(n) = name_of(r).filter(|n| !n.is_empty()) else {
            continue;
        };
        let npath = format!("{}.name", path_of(j));
        check_rule_name(cx, &npath, n);
        match taken.get(n) {
            Some(first) => cx.err(
                npath,
                Problem::Duplicate {
                    value: n.to_string(),
                    first: first.clone(),
                },
            ),
            None => {
                taken.insert(n.to_string(), npath);
            }
        }
    }
    let mut out = Vec::with_capacity(rules.len());
    for (j, r) in rules.iter().enumerate() {
        if let Some(n) = name_of(r).filter(|n| !n.is_empty()) {
            out.push(n.to_string());
            continue;
        }
        // Serializing plain API data cannot fail; an empty text would still name the rule.
        let base = generated_rule_name(&serde_json::to_string(r).unwrap_or_default());
        let mut name = base.clone();
        let mut k = 2;
        while taken.contains_key(&name) {
            name = format!("{base}-{k}");
            k += 1;
        }
        let npath = format!("{}.name", path_of(j));
        cx.warn(&npath, Advice::NameGenerated(name.clone()));
        taken.insert(name.clone(), npath);
        out.push(name);
    }
    out
}

fn lower_chain(
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
    let rs = &chain.rules;
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
    if let (Some(kind), Some(hook)) = (kind, hook) {
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
    Some(ir::Chain {
        name,
        kind: kind?,
        hook: hook?,
        priority,
        policy: policy?,
        rules,
    })
}

/// Validate one object and lower it to an IR table. Every error is collected.
pub fn compile_object(obj: &PolicyObject) -> Result<CompiledTable, ObjectErrors> {
    let mut cx = Cx {
        errors: Vec::new(),
        warnings: Vec::new(),
    };
    let t = &obj.spec.table;
    match &t.name {
        None => cx.err("spec.table.name", Problem::Required),
        Some(n) => check_identifier(&mut cx, "spec.table.name", n),
    }
    let family = match t.family {
        Some(api::TableFamily::Inet) => Some(TableFamily::Inet),
        Some(api::TableFamily::Ipv4) => Some(TableFamily::Ip),
        Some(api::TableFamily::Ipv6) => Some(TableFamily::Ip6),
        Some(f) => {
            let name = match f {
                api::TableFamily::Arp => "ARP",
                api::TableFamily::Netdev => "NETDEV",
                _ => "BRIDGE",
            };
            cx.err("spec.table.family", Problem::UnsupportedFamily(name));
            None
        }
        None => {
            cx.err("spec.table.family", Problem::Required);
            None
        }
    };
    let mut chains = Vec::new();
    let mut sets = Vec::new();
    if let Some(family) = family {
        sets = lower_sets(&mut cx, t, family);
        let set_map: HashMap<String, SetElements> = sets
            .iter()
            .map(|s| (s.name.clone(), s.elements.clone()))
            .collect();
        let tcx = TableCx {
            family,
            sets: &set_map,
            priority: 0,
        };
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (i, c) in t.chains.iter().enumerate() {
            let path = format!("spec.table.chains[{i}]");
            if let Some(n) = &c.name {
                if let Some(first) = seen.insert(n, i) {
                    cx.err(
                        format!("{path}.name"),
                        Problem::Duplicate {
                            value: n.clone(),
                            first: format!("spec.table.chains[{first}].name"),
                        },
                    );
                }
            }
            chains.extend(lower_chain(&mut cx, &tcx, &path, c));
        }
    }
    if !cx.errors.is_empty() {
        return Err(ObjectErrors {
            origin: obj.origin.0.clone(),
            errors: cx.errors,
        });
    }
    // Sorted by name: the evaluator's tie-break between chains of equal priority (backends
    // register them so that the kernel runs them in this order).
    chains.sort_by(|a, b| a.name.cmp(&b.name));
    match family {
        Some(family) => Ok(CompiledTable {
            table: ir::Table {
                name: t.name.clone().unwrap_or_default(),
                family,
                origin: obj.origin.clone(),
                sets,
                chains,
            },
            warnings: cx.warnings,
        }),
        None => Err(ObjectErrors {
            origin: obj.origin.0.clone(),
            errors: vec![FieldError {
                path: "spec.table.family".into(),
                problem: Problem::Required,
            }],
        }),
    }
}

/// Validate one spec (the admission webhook's and the agent's shared entry point).
pub fn validate(obj: &PolicyObject) -> Result<Vec<Warning>, ObjectErrors> {
    compile_object(obj).map(|c| c.warnings)
}

/// Compile a set of objects into one policy. Any invalid object fails the whole compilation
/// (the caller keeps the last good policy).
pub fn compile(objects: &[PolicyObject]) -> Result<Compiled, CompileError> {
    let mut errors = Vec::new();
    let mut tables: Vec<ir::Table> = Vec::new();
    let mut warnings = Vec::new();
    let mut names: HashMap<String, String> = HashMap::new();
    for obj in objects {
        match compile_object(obj) {
            Ok(ct) => {
                if let Some(first) = names.get(&ct.table.name) {
                    errors.push(ObjectErrors {
                        origin: obj.origin.0.clone(),
                        errors: vec![FieldError {
                            path: "spec.table.name".into(),
                            problem: Problem::Duplicate {
                                value: ct.table.name.clone(),
                                first: format!("{first} spec.table.name"),
                            },
                        }],
                    });
                    continue;
                }
                names.insert(ct.table.name.clone(), obj.origin.0.clone());
                warnings.extend(ct.warnings.into_iter().map(|w| (obj.origin.clone(), w)));
                tables.push(ct.table);
            }
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        return Err(CompileError { objects: errors });
    }
    tables.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Compiled {
        policy: ir::Policy { tables },
        warnings,
    })
}

#[cfg(test)]
mod tests;
