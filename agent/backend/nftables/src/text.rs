//! Human-readable nft syntax for a rendered table (what `peerwall compile` prints).
//!
//! Printed from the same typed model that is applied, so the two cannot diverge. Names that
//! nft's text parser would take as keywords are printed as they are; the JSON form is what
//! gets loaded.

use std::fmt::Write as _;

use peerwall_policy::ir::NatTarget;

use crate::model::{
    family_keyword, proto_keyword, Element, Expr, Key, Policy, RejectType, Right, Table, TuplePart,
    DIGEST_PREFIX, MARKER_CHAIN, MARKER_PREFIX,
};

pub(crate) fn element(e: &Element) -> String {
    match e {
        Element::Addr(a) => a.to_string(),
        Element::Prefix(a, len) => format!("{a}/{len}"),
        Element::AddrRange(a, b) => format!("{a}-{b}"),
        Element::Port(p) => p.to_string(),
        Element::PortRange(a, b) => format!("{a}-{b}"),
        Element::Jump(a, to) => format!("{a} : jump {}", to.name()),
        Element::Tuple(t) => t
            .parts()
            .iter()
            .map(|p| match p {
                TuplePart::Proto(n) => proto_name(*n),
                TuplePart::Elem(e) => element(e),
            })
            .collect::<Vec<_>>()
            .join(" . "),
    }
}

fn braces(items: Vec<String>) -> String {
    format!("{{ {} }}", items.join(", "))
}

fn proto_name(p: u8) -> String {
    proto_keyword(p).map_or(p.to_string(), str::to_string)
}

fn key(k: &Key) -> String {
    let dir = |source: bool, s: &str, d: &str| if source { s } else { d }.to_string();
    match k {
        Key::Addr { family, source } => {
            format!(
                "{} {}",
                family_keyword(*family),
                dir(*source, "saddr", "daddr")
            )
        }
        Key::Port { source } => format!("th {}", dir(*source, "sport", "dport")),
        Key::L4Proto => "meta l4proto".into(),
        Key::IifName => "iifname".into(),
        Key::OifName => "oifname".into(),
        Key::CtState => "ct state".into(),
        Key::TcpFlags => "tcp flags".into(),
        Key::TcpOpenFlags => "tcp flags & (fin | syn | rst | ack)".into(),
        Key::Tuple(c) => c.keys().iter().map(key).collect::<Vec<_>>().join(" . "),
    }
}

fn right(r: &Right) -> String {
    match r {
        Right::SetRef(n) => format!("@{n}"),
        Right::Element(e) => element(e),
        Right::Elements(es) => braces(es.iter().map(element).collect()),
        Right::Protos(ps) => match ps.as_slice() {
            [one] => proto_name(*one),
            many => braces(many.iter().map(|p| proto_name(*p)).collect()),
        },
        Right::IfName(n) => format!("{n:?}"),
        Right::CtStates(s) => braces(s.iter().map(|s| s.nft().to_string()).collect()),
        Right::Syn => "syn".into(),
    }
}

fn stmt(e: &Expr) -> String {
    match e {
        Expr::Match {
            negate,
            left,
            right: r,
        } => {
            let op = if *negate { " != " } else { " " };
            format!("{}{op}{}", key(left), right(r))
        }
        Expr::Counter => "counter".into(),
        Expr::Accept => "accept".into(),
        Expr::Drop => "drop".into(),
        Expr::Reject(t) => format!(
            "reject with {} port-unreachable",
            match t {
                RejectType::Icmp => "icmp",
                RejectType::Icmpv6 => "icmpv6",
                RejectType::Icmpx => "icmpx",
            }
        ),
        Expr::CtMarkSet(v) => format!("ct mark set {v}"),
        Expr::MetaMarkFromCtMark => "meta mark set ct mark".into(),
        Expr::MssSet(Some(v)) => format!("tcp option maxseg size set {v}"),
        Expr::MssSet(None) => "tcp option maxseg size set rt mtu".into(),
        Expr::Notrack => "notrack".into(),
        Expr::Nat {
            destination,
            family,
            target,
        } => {
            let kind = if *destination { "dnat" } else { "snat" };
            let fam = family
                .map(|f| format!(" {}", family_keyword(f)))
                .unwrap_or_default();
            match target {
                NatTarget::Addr(a) => format!("{kind}{fam} to {a}"),
                NatTarget::Prefix(n) => format!("{kind}{fam} prefix to {n}"),
            }
        }
        Expr::Masquerade => "masquerade".into(),
        Expr::LimitRef(name) => format!("limit name {name:?}"),
        Expr::Vmap { key: k, map } => format!("{} vmap @{map}", key(k)),
        Expr::Update { set, key: k } => format!("update @{set} {{ {} }}", key(k)),
        Expr::Log { prefix, group } => format!("log prefix {prefix:?} group {group}"),
    }
}

/// nft text for one table.
pub fn table_text(t: &Table) -> String {
    text_of(t, true)
}

/// nft text for one table without peerwall's ownership marker: the table as another
/// controller holds it (the lab stands in for Liqo's firewall controller with it; peerwall's
/// backend never touches a table without its marker).
pub fn foreign_table_text(t: &Table) -> String {
    text_of(t, false)
}

fn text_of(t: &Table, marker: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "table {} {} {{", t.family.nft(), t.name);
    // Each object after what it names: sets, the event limit, the chains the maps jump to
    // (with their rules), the maps, the base chains.
    for s in t.sets.iter().filter(|s| !s.verdict_map) {
        set_text(&mut out, s);
    }
    if let Some(l) = &t.event_limit {
        let _ = writeln!(
            out,
            "\tlimit {} {{ rate {}/second burst {} packets }}",
            crate::model::EVENT_LIMIT,
            l.rate,
            l.burst
        );
    }
    for c in &t.regular {
        let _ = writeln!(out, "\tchain {} {{", c.name);
        rules_text(&mut out, t, &c.name);
        let _ = writeln!(out, "\t}}");
    }
    for s in t.sets.iter().filter(|s| s.verdict_map) {
        set_text(&mut out, s);
    }
    for c in &t.chains {
        let _ = writeln!(out, "\tchain {} {{", c.name);
        let _ = writeln!(
            out,
            "\t\ttype {} hook {} priority {}; policy {};",
            c.kind.nft(),
            c.hook.nft(),
            c.priority,
            match c.policy {
                Policy::Accept => "accept",
                Policy::Drop => "drop",
            }
        );
        rules_text(&mut out, t, &c.name);
        let _ = writeln!(out, "\t}}");
    }
    if marker {
        let _ = writeln!(out, "\tchain {MARKER_CHAIN} {{");
        let _ = writeln!(out, "\t\tcounter comment \"{MARKER_PREFIX}{}\"", t.owner);
        let digest = crate::json::digest(t);
        let _ = writeln!(out, "\t\tcounter comment \"{DIGEST_PREFIX}{digest}\"");
        let _ = writeln!(out, "\t}}");
    }
    let _ = writeln!(out, "}}");
    out
}

fn rules_text(out: &mut String, t: &Table, chain: &str) {
    for r in t.rules.iter().filter(|r| r.chain == chain) {
        let mut line: Vec<String> = r.exprs.iter().map(stmt).collect();
        if !r.comment.is_empty() {
            line.push(format!("comment {:?}", r.comment));
        }
        let _ = writeln!(out, "\t\t{}", line.join(" "));
    }
}

fn set_text(out: &mut String, s: &crate::model::Set) {
    let kind = if s.verdict_map { "map" } else { "set" };
    let value = if s.verdict_map { " : verdict" } else { "" };
    let _ = writeln!(out, "\t{kind} {} {{", s.name);
    let _ = writeln!(out, "\t\ttype {}{value}", s.key.nft());
    if let Some(size) = s.capacity() {
        let _ = writeln!(out, "\t\tsize {size}");
    }
    if s.interval {
        let _ = writeln!(out, "\t\tflags interval");
    }
    if let Some(secs) = s.timeout {
        let _ = writeln!(out, "\t\tflags dynamic,timeout");
        let _ = writeln!(out, "\t\ttimeout {secs}s");
    }
    if s.counter {
        let _ = writeln!(out, "\t\tcounter");
    }
    if !s.elements.is_empty() {
        let items: Vec<String> = if s.is_merged() {
            s.elements
                .iter()
                .zip(&s.comments)
                .map(|(e, c)| format!("{} comment {c:?}", element(e)))
                .collect()
        } else {
            s.elements.iter().map(element).collect()
        };
        let _ = writeln!(out, "\t\telements = {{ {} }}", items.join(", "));
    }
    let _ = writeln!(out, "\t}}");
}
