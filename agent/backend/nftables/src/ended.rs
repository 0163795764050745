//! Connections the agent ended stay ended, whichever side speaks next (the nftables twin of the
//! bpf datapath's `ended` flows).
//!
//! Deleting a conntrack entry alone does not end a connection: the next packet of either side
//! creates a new entry. When it comes from the side nobody filters (a UDP datagram of our pod,
//! a TCP segment conntrack picks up mid-stream where `nf_conntrack_tcp_loose` is on, as it
//! stays in a container whose `/proc/sys` is read-only), the new entry's original direction is
//! ours, and the peer's packets then pass as its replies. So every connection the backend ends
//! also enters the timeout set of the table `inet` [`ENDED_TABLE`], in both orientations, and
//! that table's forward chain drops every packet of it and refreshes its element: a
//! connection stays ended while either side keeps sending, and its elements expire once both
//! have been quiet for the timeout (600 s by default, bpf's idle timeout). Dropping our side's
//! packets too keeps conntrack from confirming an entry for them, so nothing can make the
//! peer's packets replies again. TCP, UDP and SCTP connections (ICMP is only deleted).
//!
//! The table is owned (it carries peerwall's marker): `peerwall delete` and the agent's
//! cleanup remove it with the rest, the emergency switch leads its chain with an accept, and
//! its elements, edited by the packet path, are never compared for drift.

use std::net::IpAddr;

use peerwall_backend::Flow;
use peerwall_policy::ir::{ChainKind, CtState, Hook, IpFamily, TableFamily};

use crate::model::{
    AddrPart, Chain, Columns, Command, Element, Expr, Key, KeyType, Policy, Right, Rule, Set,
    Table, Tuple,
};

/// The table of ended connections (a hyphen: no peer's table is named so).
pub const ENDED_TABLE: &str = "peerwall-ended";

/// Its owner, as the marker records it.
pub const ENDED_OWNER: &str = "peerwall:ended-connections";

/// How long an ended connection's elements outlive its last packet, by default: the bpf
/// datapath's idle timeout (`peerwall_common::FLOW_IDLE_NS`).
pub const DEFAULT_TIMEOUT_SECS: u32 = 600;

/// Elements each family's set holds at most (two per connection): an end that does not fit is
/// only deleted from conntrack.
pub const CAPACITY: usize = crate::model::TIMEOUT_SET_CAPACITY;

/// The comment of the rule that drops TCP connections conntrack picks up mid-stream.
pub const MID_STREAM: &str = "mid_stream";

/// The chain (forward hook, before the policies' chains at 0).
const CHAIN: &str = "ended";
const PRIORITY: i32 = -5;

/// All five columns of one family: source, destination, ports, protocol.
fn columns(family: IpFamily) -> Columns {
    Columns::flow(family, true)
}

fn set_name(family: IpFamily) -> String {
    match family {
        IpFamily::V4 => "ended4".into(),
        IpFamily::V6 => "ended6".into(),
    }
}

/// The table: one timeout set per family and the chain that drops their packets.
pub fn table(timeout_secs: u32) -> Table {
    let families = [IpFamily::V4, IpFamily::V6];
    let sets = families
        .iter()
        .map(|&f| Set::timeout_set(set_name(f), KeyType::Tuple(columns(f)), timeout_secs.max(1)))
        .collect();
    let rules: Vec<Rule> = families
        .iter()
        .map(|&f| Rule {
            chain: CHAIN.into(),
            comment: set_name(f),
            exprs: vec![
                Expr::Match {
                    negate: false,
                    left: Key::Tuple(columns(f)),
                    right: Right::SetRef(set_name(f)),
                },
                Expr::Update {
                    set: set_name(f),
                    key: Key::Tuple(columns(f)),
                },
                Expr::Counter,
                Expr::Drop,
            ],
        })
        .collect();
    // No connection is picked up mid-stream: where `nf_conntrack_tcp_loose` is read-only
    // (a container) and stays on, a segment of a connection ended here once its elements
    // expired would otherwise start it again in its sender's direction (what the kernel
    // makes `invalid` where the switch is off, as the datapath does: no `new` matches then).
    let mut rules = rules;
    rules.push(Rule {
        chain: CHAIN.into(),
        comment: MID_STREAM.into(),
        exprs: vec![
            Expr::Match {
                negate: false,
                left: Key::CtState,
                right: Right::CtStates(vec![CtState::New]),
            },
            Expr::Match {
                negate: true,
                left: Key::TcpOpenFlags,
                right: Right::Syn,
            },
            Expr::Counter,
            Expr::Drop,
        ],
    });
    Table {
        name: ENDED_TABLE.into(),
        family: TableFamily::Inet,
        owner: ENDED_OWNER.into(),
        sets,
        chains: vec![Chain {
            name: CHAIN.into(),
            kind: ChainKind::Filter,
            hook: Hook::Forward,
            priority: PRIORITY,
            policy: Policy::Accept,
        }],
        regular: Vec::new(),
        dispatch_maps: Vec::new(),
        rules,
        event_limit: None,
    }
}

/// Whether the table keeps connections of protocol `proto` (its key has ports).
pub fn keeps(proto: u8) -> bool {
    matches!(proto, 6 | 17 | 132)
}

fn tuple(family: IpFamily, src: IpAddr, dst: IpAddr, proto: u8, sport: u16, dport: u16) -> Element {
    Element::Tuple(Tuple {
        columns: columns(family),
        proto,
        saddr: Some(AddrPart::Addr(src)),
        daddr: Some(AddrPart::Addr(dst)),
        sport: (sport, sport),
        dport: (dport, dport),
    })
}

/// The elements of `flows` (as the forward hook sees them), both orientations of each, by
/// set name; flows of other protocols are left out.
pub fn elements(flows: &[Flow]) -> Vec<(String, Vec<Element>)> {
    let mut out: Vec<(String, Vec<Element>)> = Vec::new();
    for family in [IpFamily::V4, IpFamily::V6] {
        let mut v = Vec::new();
        for f in flows {
            if !keeps(f.proto) || f.src.is_ipv4() != (family == IpFamily::V4) {
                continue;
            }
            v.push(tuple(family, f.src, f.dst, f.proto, f.sport, f.dport));
            v.push(tuple(family, f.dst, f.src, f.proto, f.dport, f.sport));
        }
        if !v.is_empty() {
            out.push((set_name(family), v));
        }
    }
    out
}

/// The commands that add (or delete) `flows`' elements to (from) table `t`'s sets.
pub fn commands<'a>(
    t: &'a Table,
    edits: &'a [(String, Vec<Element>)],
    add: bool,
) -> Vec<Command<'a>> {
    edits
        .iter()
        .map(|(set, elements)| {
            if add {
                Command::AddElements {
                    table: t,
                    set,
                    elements: elements.clone(),
                }
            } else {
                Command::DeleteElements {
                    table: t,
                    set,
                    elements: elements.clone(),
                }
            }
        })
        .collect()
}

/// Whether `set` of table `table` is one whose elements the packet path edits.
pub fn is_dynamic(t: &Table, set: &str) -> bool {
    t.sets.iter().any(|s| s.name == set && s.timeout.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(src: &str, dst: &str, proto: u8) -> Flow {
        Flow {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            proto,
            sport: 40000,
            dport: 8080,
        }
    }

    #[test]
    fn each_flow_enters_both_orientations_of_its_familys_set() {
        let e = elements(&[
            flow("10.10.1.67", "10.20.1.2", 17),
            flow("fd10::67", "fd20::2", 6),
            flow("10.10.1.67", "10.20.1.2", 1),
        ]);
        assert_eq!(e.len(), 2);
        assert_eq!(e[0].0, "ended4");
        assert_eq!(e[0].1.len(), 2, "ICMP is left out");
        let text: Vec<String> = e[0].1.iter().map(crate::model::Element::text).collect();
        assert_eq!(
            text,
            [
                "10.20.1.2 . 10.10.1.67 . 8080 . 40000 . udp",
                "10.10.1.67 . 10.20.1.2 . 40000 . 8080 . udp"
            ]
        );
        assert_eq!(e[1].0, "ended6");
    }

    #[test]
    fn the_table_drops_and_refreshes_what_its_sets_hold() {
        let t = table(3);
        let text = crate::text::table_text(&t);
        assert!(text.contains("flags dynamic,timeout"), "{text}");
        assert!(text.contains("timeout 3s"), "{text}");
        assert!(
            text.contains("ip daddr . ip saddr . th dport . th sport . meta l4proto @ended4 update @ended4 { ip daddr . ip saddr . th dport . th sport . meta l4proto } counter drop"),
            "{text}"
        );
        assert!(is_dynamic(&t, "ended6") && !is_dynamic(&t, "other"));
        // No TCP connection is picked up mid-stream (a SYN alone opens one).
        assert!(
            text.contains(
                "ct state new tcp flags & (fin | syn | rst | ack) != syn counter drop comment \"mid_stream\""
            ),
            "{text}"
        );
    }
}
