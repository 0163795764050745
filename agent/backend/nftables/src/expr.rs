//! Each expression of the typed model written both ways, side by side: as libnftables JSON
//! (what is loaded, [`crate::json`]) and as nft text (what `peerwall compile` prints,
//! [`crate::text`]). A new statement or match is added here once, in both forms; the model
//! ([`crate::model`]) defines it, the renderer ([`crate::render`]) makes it from the IR.

use serde_json::{json, Value};

use peerwall_policy::ir::{CtState, NatTarget};

use crate::model::{
    family_keyword, proto_keyword, Element, Expr, Key, RejectType, Right, TuplePart,
};

impl Element {
    /// An element or value as libnftables JSON.
    pub fn json(&self) -> Value {
        match self {
            Element::Addr(a) => json!(a.to_string()),
            Element::Prefix(a, len) => json!({"prefix": {"addr": a.to_string(), "len": len}}),
            Element::AddrRange(a, b) => json!({"range": [a.to_string(), b.to_string()]}),
            Element::Port(p) => json!(p),
            Element::PortRange(a, b) => json!({"range": [a, b]}),
            Element::Tuple(t) => json!({"concat": t
                .parts()
                .iter()
                .map(|p| match p {
                    TuplePart::Proto(n) => proto_json(*n),
                    TuplePart::Elem(e) => e.json(),
                })
                .collect::<Vec<_>>()}),
            Element::Jump(a, to) => json!([a.to_string(), {"jump": {"target": to.name()}}]),
        }
    }

    /// An element or value as nft prints it.
    pub fn text(&self) -> String {
        match self {
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
                    TuplePart::Proto(n) => proto_text(*n),
                    TuplePart::Elem(e) => e.text(),
                })
                .collect::<Vec<_>>()
                .join(" . "),
        }
    }
}

impl Key {
    /// What a match reads, as libnftables JSON.
    pub fn json(&self) -> Value {
        let field = |source: bool, s: &str, d: &str| if source { s } else { d }.to_string();
        match self {
            Key::Addr { family, source } => json!({"payload": {"protocol": family_keyword(*family),
                "field": field(*source, "saddr", "daddr")}}),
            Key::Port { source } => {
                json!({"payload": {"protocol": "th", "field": field(*source, "sport", "dport")}})
            }
            Key::L4Proto => json!({"meta": {"key": "l4proto"}}),
            Key::IifName => json!({"meta": {"key": "iifname"}}),
            Key::OifName => json!({"meta": {"key": "oifname"}}),
            Key::CtState => json!({"ct": {"key": "state"}}),
            Key::TcpFlags => json!({"payload": {"protocol": "tcp", "field": "flags"}}),
            Key::TcpOpenFlags => json!({"&": [{"payload": {"protocol": "tcp", "field": "flags"}},
                ["fin", "syn", "rst", "ack"]]}),
            Key::Tuple(c) => json!({"concat": c.keys().iter().map(Key::json).collect::<Vec<_>>()}),
        }
    }

    /// What a match reads, as nft prints it.
    pub fn text(&self) -> String {
        let dir = |source: bool, s: &str, d: &str| if source { s } else { d }.to_string();
        match self {
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
            Key::Tuple(c) => c
                .keys()
                .iter()
                .map(Key::text)
                .collect::<Vec<_>>()
                .join(" . "),
        }
    }
}

impl Right {
    /// What a match compares with, as libnftables JSON.
    pub fn json(&self) -> Value {
        match self {
            Right::SetRef(n) => json!(format!("@{n}")),
            Right::Element(e) => e.json(),
            Right::Elements(es) => json!({"set": es.iter().map(Element::json).collect::<Vec<_>>()}),
            Right::Protos(ps) => match ps.as_slice() {
                [one] => proto_json(*one),
                many => json!({"set": many.iter().map(|p| proto_json(*p)).collect::<Vec<_>>()}),
            },
            Right::IfName(n) => json!(n),
            Right::CtStates(states) => {
                json!({"set": states.iter().map(|s| CtState::nft(*s)).collect::<Vec<_>>()})
            }
            Right::Syn => json!("syn"),
        }
    }

    /// What a match compares with, as nft prints it.
    pub fn text(&self) -> String {
        match self {
            Right::SetRef(n) => format!("@{n}"),
            Right::Element(e) => e.text(),
            Right::Elements(es) => braces(es.iter().map(Element::text).collect()),
            Right::Protos(ps) => match ps.as_slice() {
                [one] => proto_text(*one),
                many => braces(many.iter().map(|p| proto_text(*p)).collect()),
            },
            Right::IfName(n) => format!("{n:?}"),
            Right::CtStates(s) => braces(s.iter().map(|s| s.nft().to_string()).collect()),
            Right::Syn => "syn".into(),
        }
    }
}

impl Expr {
    /// A statement as libnftables JSON (what `nft -j -f` loads).
    pub fn json(&self) -> Value {
        match self {
            Expr::Match {
                negate,
                left,
                right: r,
            } => {
                let op = match (left, negate) {
                    (Key::TcpFlags, _) => "in",
                    (_, true) => "!=",
                    (_, false) => "==",
                };
                // `ct state established,related`: a bitmask test (one AND and one compare),
                // where the set form `{ established, related }` is a hash lookup per packet
                // (`cargo xtask bench-gateway`, the 1000-NetworkPolicy tier's known flows).
                // The state is one bit per packet, so "any of these bits" is membership.
                if let (Right::CtStates(states), false) = (r, negate) {
                    let bits: Vec<_> = states.iter().map(|s| CtState::nft(*s)).collect();
                    return json!({"match": {"op": "in", "left": left.json(), "right": bits}});
                }
                json!({"match": {"op": op, "left": left.json(), "right": r.json()}})
            }
            Expr::Counter => json!({"counter": null}),
            Expr::Accept => json!({"accept": null}),
            Expr::Drop => json!({"drop": null}),
            Expr::Reject(t) => json!({"reject": {"type": match t {
                RejectType::Icmp => "icmp",
                RejectType::Icmpv6 => "icmpv6",
                RejectType::Icmpx => "icmpx",
            }, "expr": "port-unreachable"}}),
            Expr::CtMarkSet(v) => json!({"mangle": {"key": {"ct": {"key": "mark"}}, "value": v}}),
            Expr::MetaMarkFromCtMark => {
                json!({"mangle": {"key": {"meta": {"key": "mark"}}, "value": {"ct": {"key": "mark"}}}})
            }
            Expr::MssSet(v) => {
                let value = match v {
                    Some(mss) => json!(mss),
                    None => json!({"rt": {"key": "mtu"}}),
                };
                json!({"mangle": {"key": {"tcp option": {"name": "maxseg", "field": "size"}}, "value": value}})
            }
            Expr::Notrack => json!({"notrack": null}),
            Expr::Nat {
                destination,
                family,
                target,
            } => {
                let mut stmt = match target {
                    NatTarget::Addr(a) => json!({"addr": a.to_string()}),
                    // `snat ip prefix to 10.0.0.0/16` (NF_NAT_RANGE_NETMAP).
                    NatTarget::Prefix(n) => json!({
                        "addr": {"prefix": {"addr": n.network().to_string(), "len": n.prefix_len()}},
                        "flags": "netmap",
                        "type_flags": "prefix",
                    }),
                };
                if let Some(f) = family {
                    stmt["family"] = json!(family_keyword(*f));
                }
                json!({ if *destination { "dnat" } else { "snat" }: stmt })
            }
            Expr::Masquerade => json!({"masquerade": null}),
            Expr::LimitRef(name) => json!({ "limit": name }),
            Expr::Vmap { key: k, map } => {
                json!({"vmap": {"key": k.json(), "data": format!("@{map}")}})
            }
            Expr::Goto(chain) => json!({"goto": {"target": chain}}),
            Expr::Update { set, key: k } => {
                json!({"set": {"op": "update", "elem": k.json(), "set": format!("@{set}")}})
            }
            Expr::Log { prefix, group } => json!({"log": {"prefix": prefix, "group": group}}),
        }
    }

    /// A statement as nft prints it (`peerwall compile`).
    pub fn text(&self) -> String {
        match self {
            Expr::Match {
                negate,
                left,
                right: r,
            } => {
                if let (Right::CtStates(states), false) = (r, negate) {
                    let bits: Vec<_> = states.iter().map(|s| s.nft()).collect();
                    return format!("{} {}", left.text(), bits.join(","));
                }
                let op = if *negate { " != " } else { " " };
                format!("{}{op}{}", left.text(), r.text())
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
            Expr::Vmap { key: k, map } => format!("{} vmap @{map}", k.text()),
            Expr::Goto(chain) => format!("goto {chain}"),
            Expr::Update { set, key: k } => format!("update @{set} {{ {} }}", k.text()),
            Expr::Log { prefix, group } => format!("log prefix {prefix:?} group {group}"),
        }
    }
}

/// A protocol number as JSON: its keyword where nft has one.
fn proto_json(p: u8) -> Value {
    proto_keyword(p).map_or(json!(p), |k| json!(k))
}

/// A protocol number as text: its keyword where nft has one.
fn proto_text(p: u8) -> String {
    proto_keyword(p).map_or(p.to_string(), str::to_string)
}

fn braces(items: Vec<String>) -> String {
    format!("{{ {} }}", items.join(", "))
}
