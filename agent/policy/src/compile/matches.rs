//! Matches: addresses, ports, protocols, interfaces and conntrack states, each lowered to IR
//! tests with its own negation; value lists and `@set` references resolved.

use std::collections::HashMap;

use peerwall_intent::types as api;

use super::values::{parse_addr_item, parse_port_item, split_list};
use super::{Advice, Cx, Problem};
use crate::ir::{
    self, AddrSet, Dir, Hook, IfDir, IpFamily, Match, PortSet, SetElements, Source, TableFamily,
    Test,
};

/// `IPv4` / `IPv6`, as messages say it.
pub(super) fn family_name(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "IPv4",
        IpFamily::V6 => "IPv6",
    }
}

/// The table family as the API spells it.
pub(super) fn table_family_name(f: TableFamily) -> &'static str {
    match f {
        TableFamily::Ip => "IPV4",
        TableFamily::Ip6 => "IPV6",
        TableFamily::Inet => "INET",
    }
}

/// Parse a list of address items of one family that fits the table.
pub(super) fn lower_addr_list(
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

/// Parse a list of ports and port ranges.
pub(super) fn lower_port_list(cx: &mut Cx, path: &str, items: &[&str]) -> Option<PortSet> {
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

/// What lowering a rule needs from its table and chain.
pub(super) struct TableCx<'a> {
    pub(super) family: TableFamily,
    pub(super) sets: &'a HashMap<String, SetElements>,
    /// Priority of the chain being lowered.
    pub(super) priority: i32,
}

/// `src` / `dst`.
pub(super) fn position(p: Option<api::MatchPosition>) -> Option<Dir> {
    p.map(|p| match p {
        api::MatchPosition::Src => Dir::Src,
        api::MatchPosition::Dst => Dir::Dst,
    })
}

/// `position` of an ip or port match; missing is an error at `path`.
fn dir_at(cx: &mut Cx, path: String, p: Option<api::MatchPosition>) -> Option<Dir> {
    let dir = position(p);
    if dir.is_none() {
        cx.err(path, Problem::Required);
    }
    dir
}

/// How a `@set` reference is checked: the contents of the right kind, and its name in errors.
type SetKind<T> = (fn(&SetElements) -> Option<&T>, &'static str);

/// A value list or a `@set` reference of one kind (addresses or ports): the set's contents
/// when it is of `kind`, else `inline` over the listed items.
fn lower_values<T: Clone>(
    cx: &mut Cx,
    tcx: &TableCx<'_>,
    vpath: &str,
    value: &str,
    kind: SetKind<T>,
    inline: impl FnOnce(&mut Cx, &[&str]) -> Option<T>,
) -> Option<(T, Source)> {
    let items = split_list(value);
    match items.as_slice() {
        [] => {
            cx.err(vpath, Problem::Empty);
            None
        }
        [one] if one.starts_with('@') => {
            let name = &one[1..];
            let found = tcx.sets.get(name);
            match found.map(kind.0) {
                Some(Some(v)) => Some((v.clone(), Source::Named(name.into()))),
                Some(None) => {
                    cx.err(
                        vpath,
                        Problem::SetTypeMismatch {
                            value: value.to_string(),
                            expected: kind.1,
                        },
                    );
                    None
                }
                None => {
                    cx.err(vpath, Problem::UnknownSet(value.to_string()));
                    None
                }
            }
        }
        items => inline(cx, items).map(|v| (v, Source::Inline { count: items.len() })),
    }
}

fn addr_set_of(s: &SetElements) -> Option<&AddrSet> {
    match s {
        SetElements::Addr(a) => Some(a),
        SetElements::Port(_) => None,
    }
}

fn port_set_of(s: &SetElements) -> Option<&PortSet> {
    match s {
        SetElements::Port(p) => Some(p),
        SetElements::Addr(_) => None,
    }
}

fn lower_ip(cx: &mut Cx, tcx: &TableCx<'_>, path: &str, ip: &api::MatchIp) -> Option<Test> {
    let dir = dir_at(cx, format!("{path}.ip.position"), ip.position);
    let vpath = format!("{path}.ip.value");
    let kind: SetKind<AddrSet> = (
        addr_set_of,
        "addresses (ipv4_addr, ipv4_cidr, ipv6_addr, ipv6_cidr)",
    );
    let (set, source) = lower_values(cx, tcx, &vpath, &ip.value, kind, |cx, items| {
        lower_addr_list(cx, &vpath, &ip.value, items, tcx.family)
    })?;
    Some(Test::Addr {
        dir: dir?,
        set,
        source,
    })
}

fn lower_port(cx: &mut Cx, tcx: &TableCx<'_>, path: &str, port: &api::MatchPort) -> Option<Test> {
    let dir = dir_at(cx, format!("{path}.port.position"), port.position);
    let vpath = format!("{path}.port.value");
    let kind: SetKind<PortSet> = (port_set_of, "ports (integer)");
    let (set, source) = lower_values(cx, tcx, &vpath, &port.value, kind, |cx, items| {
        lower_port_list(cx, &vpath, items)
    })?;
    Some(Test::Port {
        dir: dir?,
        set,
        source,
    })
}

fn lower_proto(proto: &api::MatchProto) -> Test {
    Test::Proto(vec![match proto.value {
        api::L4Proto::Tcp => ir::eval::proto::TCP,
        api::L4Proto::Udp => ir::eval::proto::UDP,
        api::L4Proto::Sctp => ir::eval::proto::SCTP,
        api::L4Proto::Icmp => ir::eval::proto::ICMP,
        api::L4Proto::Icmpv6 => ir::eval::proto::ICMPV6,
    }])
}

fn lower_dev(
    cx: &mut Cx,
    path: &str,
    dev: &api::MatchDev,
    hook: Hook,
    op: &'static str,
) -> Option<Test> {
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
    let bad = |why| Problem::BadName {
        value: dev.value.clone(),
        why,
    };
    if name.is_empty() && !wildcard {
        cx.err(&vpath, Problem::Empty);
        return None;
    }
    if name.len() > 15 {
        cx.err(&vpath, bad("interface names have at most 15 characters"));
        return None;
    }
    let forbidden = |c: char| c.is_whitespace() || matches!(c, '/' | '"' | '*' | '\\');
    if name.chars().any(forbidden) {
        cx.err(
            &vpath,
            bad("interface names cannot hold spaces, '/', quotes or inner '*'"),
        );
        return None;
    }
    let dir = dir?;
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
                op,
            },
        );
    }
    Some(Test::Iface {
        dir,
        name: name.to_string(),
        wildcard,
    })
}

fn lower_ctstate(
    cx: &mut Cx,
    path: &str,
    ct: &api::MatchCtState,
    hook: Hook,
    priority: i32,
) -> Option<Test> {
    if ct.value.is_empty() {
        cx.err(format!("{path}.ctstate.value"), Problem::Empty);
        return None;
    }
    if matches!(hook, Hook::Prerouting | Hook::Output) && priority <= -200 {
        cx.err(
            format!("{path}.ctstate"),
            Problem::PriorityNotAllowed {
                value: priority,
                why: "conntrack has not classified the packet yet at priority <= -200; use a later priority",
            },
        );
        return None;
    }
    let mask = ct.value.iter().fold(0u8, |acc, s| {
        acc | match s {
            api::CtState::New => ir::CtState::New.bit(),
            api::CtState::Established => ir::CtState::Established.bit(),
            api::CtState::Related => ir::CtState::Related.bit(),
            api::CtState::Untracked => ir::CtState::Untracked.bit(),
            api::CtState::Invalid => ir::CtState::Invalid.bit(),
        }
    });
    Some(Test::CtState(mask))
}

/// One match entry: each field present becomes its own test, with the entry's `op`.
pub(super) fn lower_match(
    cx: &mut Cx,
    tcx: &TableCx<'_>,
    path: &str,
    m: &api::Match,
    hook: Hook,
) -> Vec<Match> {
    let negate = match m.op {
        Some(api::MatchOperation::Eq) => false,
        Some(api::MatchOperation::Neq) => true,
        None => {
            cx.err(format!("{path}.op"), Problem::Required);
            false
        }
    };
    if m.ip.is_none()
        && m.port.is_none()
        && m.proto.is_none()
        && m.dev.is_none()
        && m.ctstate.is_none()
    {
        cx.err(path, Problem::EmptyMatch);
    }
    let op = if negate { "neq" } else { "eq" };
    let tests = [
        m.ip.as_ref().and_then(|ip| lower_ip(cx, tcx, path, ip)),
        m.port.as_ref().and_then(|p| lower_port(cx, tcx, path, p)),
        m.proto.as_ref().map(lower_proto),
        m.dev
            .as_ref()
            .and_then(|d| lower_dev(cx, path, d, hook, op)),
        m.ctstate
            .as_ref()
            .and_then(|c| lower_ctstate(cx, path, c, hook, tcx.priority)),
    ];
    tests
        .into_iter()
        .flatten()
        .map(|test| Match { negate, test })
        .collect()
}

/// Matches of one rule; a rule testing IPv4 and IPv6 addresses together is refused.
pub(super) fn lower_rule_matches(
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
