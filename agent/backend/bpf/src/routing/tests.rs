use ipnet::IpNet;

use super::rtnl::{self, Message};
use super::*;

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn route(table: u32, kind: u8, dst: &str) -> Route {
    Route {
        table,
        kind,
        dst: net(dst),
        dead: false,
        nexthop_object: false,
        encap: false,
    }
}

fn rule(priority: u32, table: u32) -> Rule {
    Rule {
        priority,
        action: action::TO_TABLE,
        table,
        selector_free: true,
        suppresses: false,
    }
}

/// A Liqo gateway's IPv4 routing: default rules plus a policy rule, a default route, local
/// and broadcast addresses, a route per remote CIDR in a table of its own.
fn gateway() -> Snapshot {
    let mut policy = rule(1000, 1878);
    policy.selector_free = false;
    Snapshot {
        routes: vec![
            route(table::LOCAL, kind::LOCAL, "127.0.0.0/8"),
            route(table::LOCAL, kind::LOCAL, "127.0.0.1/32"),
            route(table::LOCAL, kind::BROADCAST, "127.255.255.255/32"),
            route(table::LOCAL, kind::LOCAL, "10.244.0.7/32"),
            route(table::LOCAL, kind::BROADCAST, "10.244.0.255/32"),
            route(table::LOCAL, kind::LOCAL, "169.254.18.1/32"),
            route(table::MAIN, kind::UNICAST, "0.0.0.0/0"),
            route(table::MAIN, kind::UNICAST, "10.244.0.0/24"),
            route(1878, kind::UNICAST, "10.71.0.0/16"),
        ],
        rules: vec![
            rule(0, table::LOCAL),
            policy,
            rule(32766, table::MAIN),
            rule(32767, 253),
        ],
        forwarding: vec![
            Forwarding {
                ifindex: -1,
                on: true,
            },
            Forwarding {
                ifindex: -2,
                on: false,
            },
            Forwarding {
                ifindex: 1,
                on: false,
            },
            Forwarding {
                ifindex: 2,
                on: true,
            },
        ],
    }
}

#[test]
fn a_gateways_routing_is_mirrored_by_its_local_table() {
    let m = mirror(&gateway()).unwrap();
    assert_eq!(m.len(), 6);
    assert!(m.contains(&net("10.244.0.7/32")));
    assert!(m.contains(&net("127.0.0.0/8")));
    assert!(!m.contains(&net("10.244.0.0/24")));
}

/// A change to the gateway's routing.
type Change = Box<dyn Fn(&mut Snapshot)>;

#[test]
fn anything_a_fib_lookup_would_answer_otherwise_closes_the_mirror() {
    let cases: Vec<(&str, Change, Closed)> = vec![
        (
            "a rule before local",
            Box::new(|s| s.rules.insert(0, rule(0, 100))),
            Closed::LocalRuleNotFirst,
        ),
        (
            "local looked up with a selector",
            Box::new(|s| s.rules[0].selector_free = false),
            Closed::LocalRuleNotFirst,
        ),
        (
            "an unreachable rule",
            Box::new(|s| {
                let mut r = rule(500, 0);
                r.action = 7;
                s.rules.insert(1, r);
            }),
            Closed::TerminalRule(500, 7),
        ),
        (
            "main behind a suppressing rule only",
            Box::new(|s| s.rules[2].suppresses = true),
            Closed::NoMainRule,
        ),
        (
            "no default route",
            Box::new(|s| s.routes.retain(|r| r.dst.prefix_len() != 0)),
            Closed::NoDefaultRoute,
        ),
        (
            "a dead default route",
            Box::new(|s| {
                for r in &mut s.routes {
                    r.dead |= r.dst.prefix_len() == 0;
                }
            }),
            Closed::NoDefaultRoute,
        ),
        (
            "a blackhole route",
            Box::new(|s| s.routes.push(route(1878, kind::BLACKHOLE, "10.72.0.0/16"))),
            Closed::TerminalRoute(net("10.72.0.0/16"), 1878),
        ),
        (
            "a route through a nexthop object",
            Box::new(|s| {
                let mut r = route(table::MAIN, kind::UNICAST, "10.80.0.0/16");
                r.nexthop_object = true;
                s.routes.push(r);
            }),
            Closed::OpaqueRoute(net("10.80.0.0/16"), table::MAIN),
        ),
        (
            "a local route in another table",
            Box::new(|s| s.routes.push(route(1878, kind::LOCAL, "10.90.0.0/16"))),
            Closed::LocalElsewhere(net("10.90.0.0/16"), 1878),
        ),
        (
            "a unicast route in the local table",
            Box::new(|s| {
                s.routes
                    .push(route(table::LOCAL, kind::UNICAST, "10.91.0.0/16"))
            }),
            Closed::UnicastInLocal(net("10.91.0.0/16")),
        ),
        (
            "a more specific route inside a local prefix",
            Box::new(|s| {
                s.routes
                    .push(route(table::MAIN, kind::UNICAST, "127.1.0.0/16"))
            }),
            Closed::Shadowed(net("127.1.0.0/16"), net("127.0.0.0/8")),
        ),
        (
            "forwarding off on an interface",
            Box::new(|s| s.forwarding[3].on = false),
            Closed::NotForwarding(2),
        ),
    ];
    for (what, change, why) in cases {
        let mut s = gateway();
        change(&mut s);
        assert_eq!(mirror(&s), Err(why), "{what}");
    }
}

/// An rtnetlink message: header, fixed part, attributes.
fn message(kind: u16, fixed: &[u8], attrs: &[(u16, Vec<u8>)]) -> Vec<u8> {
    let mut body = fixed.to_vec();
    body.resize((body.len() + 3) & !3, 0);
    for (t, v) in attrs {
        body.extend_from_slice(&((4 + v.len()) as u16).to_ne_bytes());
        body.extend_from_slice(&t.to_ne_bytes());
        body.extend_from_slice(v);
        body.resize((body.len() + 3) & !3, 0);
    }
    let mut m = Vec::new();
    m.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&[2, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
    m.extend_from_slice(&body);
    m
}

#[test]
fn dump_answers_parse_into_routes_rules_and_forwarding() {
    let mut buf = Vec::new();
    // rtmsg: AF_INET, /24, table main (254), type unicast, flags 0; RTA_DST, RTA_TABLE.
    buf.extend(message(
        rtnl::msg::NEWROUTE,
        &[2, 24, 0, 0, 254, 3, 0, 1, 0, 0, 0, 0],
        &[
            (1, vec![10, 71, 0, 0]),
            (15, 1878u32.to_ne_bytes().to_vec()),
        ],
    ));
    // A default route (no RTA_DST) whose nexthop is dead.
    buf.extend(message(
        rtnl::msg::NEWROUTE,
        &[2, 0, 0, 0, 254, 3, 0, 1, 1, 0, 0, 0],
        &[],
    ));
    // fib_rule_hdr: AF_INET6, action to-table, table local; FRA_PRIORITY 0; FRA_SRC selects.
    buf.extend(message(
        rtnl::msg::NEWRULE,
        &[10, 0, 0, 0, 255, 0, 0, 1, 0, 0, 0, 0],
        &[(6, 0u32.to_ne_bytes().to_vec()), (21, vec![2])],
    ));
    buf.extend(message(
        rtnl::msg::NEWRULE,
        &[2, 0, 8, 0, 0, 0, 0, 1, 0, 0, 0, 0],
        &[
            (6, 1000u32.to_ne_bytes().to_vec()),
            (15, 1878u32.to_ne_bytes().to_vec()),
            (2, vec![10, 0, 0, 0]),
        ],
    ));
    // netconfmsg: AF_INET; NETCONFA_IFINDEX -1, NETCONFA_FORWARDING 1.
    buf.extend(message(
        rtnl::msg::NEWNETCONF,
        &[2],
        &[
            (1, (-1i32).to_ne_bytes().to_vec()),
            (2, 1i32.to_ne_bytes().to_vec()),
        ],
    ));
    buf.extend(message(3, &[0, 0, 0, 0], &[]));
    let got = rtnl::parse(&buf).unwrap();
    assert_eq!(
        got,
        vec![
            Message::Route(
                Family::V4,
                Route {
                    table: 1878,
                    kind: kind::UNICAST,
                    dst: net("10.71.0.0/24"),
                    dead: false,
                    nexthop_object: false,
                    encap: false,
                }
            ),
            Message::Route(
                Family::V4,
                Route {
                    table: table::MAIN,
                    kind: kind::UNICAST,
                    dst: net("0.0.0.0/0"),
                    dead: true,
                    nexthop_object: false,
                    encap: false,
                }
            ),
            Message::Rule(
                Family::V6,
                Rule {
                    priority: 0,
                    action: action::TO_TABLE,
                    table: table::LOCAL,
                    selector_free: true,
                    suppresses: false,
                }
            ),
            Message::Rule(
                Family::V4,
                Rule {
                    priority: 1000,
                    action: action::TO_TABLE,
                    table: 1878,
                    selector_free: false,
                    suppresses: false,
                }
            ),
            Message::Forwarding(
                Family::V4,
                Forwarding {
                    ifindex: -1,
                    on: true
                }
            ),
            Message::Done,
        ]
    );
}

#[test]
fn a_truncated_or_refused_answer_is_an_error() {
    let mut m = message(
        rtnl::msg::NEWROUTE,
        &[2, 24, 0, 0, 254, 3, 0, 1, 0, 0, 0, 0],
        &[],
    );
    m[0] += 8;
    assert!(matches!(
        rtnl::parse(&m),
        Err(rtnl::RtnlError::Truncated(_))
    ));
    let refused = message(2, &(-1i32).to_ne_bytes(), &[]);
    assert_eq!(rtnl::parse(&refused), Err(rtnl::RtnlError::Kernel(1)));
}

#[test]
fn dump_requests_name_their_family() {
    let r = rtnl::dump_request(rtnl::msg::GETRULE, Family::V6, 7);
    assert_eq!(r.len(), 28);
    assert_eq!(u32::from_ne_bytes(r[0..4].try_into().unwrap()), 28);
    assert_eq!(r[16], 10);
    assert_eq!(
        rtnl::dump_request(rtnl::msg::GETNETCONF, Family::V4, 7).len(),
        20
    );
}

#[test]
fn local_keys_read_back_as_the_prefixes_written() {
    use crate::loader::addr_key;
    for p in [
        "10.244.0.7/32",
        "127.0.0.0/8",
        "fe80::/64",
        "ff00::/8",
        "::1/128",
    ] {
        assert_eq!(watch::prefix_of(&addr_key(0, &net(p))), Some(net(p)), "{p}");
    }
    // Another chain's key, or host bits set: not the watcher's.
    assert_eq!(watch::prefix_of(&addr_key(3, &net("10.0.0.0/8"))), None);
    let mut k = addr_key(0, &net("10.0.0.0/8"));
    let mut d = k.data();
    d.addr[3] = 1;
    k = aya::maps::lpm_trie::Key::new(k.prefix_len(), d);
    assert_eq!(watch::prefix_of(&k), None);
}
