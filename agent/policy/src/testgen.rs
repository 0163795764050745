//! Random policies and packets for differential tests and benchmarks (seeded, reproducible).
//!
//! Policies are generated as FirewallConfiguration specs (so they exercise validation and
//! lowering too): 1-3 tables of random families, 1-2 filter chains on random hooks with tied
//! priorities, rules with addresses (single, CIDR with host bits, ranges, lists, sets), ports,
//! protocols, interfaces (exact and wildcard), ct states, eq and neq. Packets draw addresses
//! from the same small pools so that rules hit.

use rand::rngs::StdRng;
use rand::Rng;

use crate::compile::PolicyObject;
use crate::ir::{self, eval::proto, Origin, Packet};
use peerwall_intent::types::*;

mod cache;
mod long;
pub use cache::{cache_specs, cache_table};
pub use long::{long_table, rule_position};

/// Interface names policies and packets use.
pub const IFACES: [&str; 3] = ["liqo-tunnel", "liqo.abcdefghij", "liqo.zyxwvutsrq"];

fn pick<'a, T>(rng: &mut StdRng, items: &'a [T]) -> &'a T {
    &items[rng.random_range(0..items.len())]
}

fn v4(rng: &mut StdRng) -> String {
    format!(
        "10.{}.0.{}",
        rng.random_range(0..2),
        rng.random_range(1..16)
    )
}

fn v6(rng: &mut StdRng) -> String {
    format!(
        "fd0{}::{:x}",
        rng.random_range(0..2),
        rng.random_range(1..16)
    )
}

fn addr(rng: &mut StdRng, six: bool) -> String {
    if six {
        v6(rng)
    } else {
        v4(rng)
    }
}

fn addr_value(rng: &mut StdRng, six: bool) -> String {
    let one = |rng: &mut StdRng| -> String {
        match rng.random_range(0..4) {
            0 | 1 => addr(rng, six),
            2 => {
                let a = addr(rng, six);
                let len = if six {
                    *pick(rng, &[124u8, 126, 127])
                } else {
                    *pick(rng, &[28u8, 30, 31])
                };
                format!("{a}/{len}")
            }
            _ => {
                let (a, b) = (addr(rng, six), addr(rng, six));
                let (pa, pb): (std::net::IpAddr, std::net::IpAddr) =
                    (a.parse().unwrap(), b.parse().unwrap());
                if pa <= pb {
                    format!("{a}-{b}")
                } else {
                    format!("{b}-{a}")
                }
            }
        }
    };
    let n = if rng.random_bool(0.25) {
        rng.random_range(2..4)
    } else {
        1
    };
    (0..n).map(|_| one(rng)).collect::<Vec<_>>().join(",")
}

fn port_value(rng: &mut StdRng) -> String {
    pick(rng, &["80", "443", "79-81", "22,80-82", "40000", "1-1024"]).to_string()
}

fn random_match(rng: &mut StdRng, six: bool, sets: &[(String, bool)]) -> Match {
    let op = Some(if rng.random_bool(0.3) {
        MatchOperation::Neq
    } else {
        MatchOperation::Eq
    });
    let pos_v = if rng.random_bool(0.5) {
        MatchPosition::Src
    } else {
        MatchPosition::Dst
    };
    let pos = || pos_v;
    let mut m = Match {
        op,
        ..Match::default()
    };
    match rng.random_range(0..6) {
        0 | 1 => {
            let usable: Vec<&(String, bool)> = sets.iter().filter(|(_, s6)| *s6 == six).collect();
            let value = if !usable.is_empty() && rng.random_bool(0.3) {
                format!("@{}", pick(rng, &usable).0)
            } else {
                addr_value(rng, six)
            };
            m.ip = Some(MatchIp {
                value,
                position: Some(pos()),
            });
        }
        2 => {
            m.port = Some(MatchPort {
                value: port_value(rng),
                position: Some(pos()),
            })
        }
        3 => {
            let p = *pick(
                rng,
                &[
                    L4Proto::Tcp,
                    L4Proto::Udp,
                    L4Proto::Sctp,
                    L4Proto::Icmp,
                    L4Proto::Icmpv6,
                ],
            );
            m.proto = Some(MatchProto { value: p });
        }
        4 => {
            let wildcard = rng.random_bool(0.3);
            let value = if wildcard {
                "liqo.".to_string()
            } else {
                pick(rng, &IFACES).to_string()
            };
            let position = Some(if rng.random_bool(0.5) {
                MatchDevPosition::In
            } else {
                MatchDevPosition::Out
            });
            m.dev = Some(MatchDev {
                value,
                position,
                wildcard,
            });
        }
        _ => {
            let mut v: Vec<CtState> = [
                CtState::New,
                CtState::Established,
                CtState::Related,
                CtState::Untracked,
                CtState::Invalid,
            ]
            .into_iter()
            .filter(|_| rng.random_bool(0.35))
            .collect();
            if v.is_empty() {
                v.push(CtState::Established);
            }
            m.ctstate = Some(MatchCtState { value: v });
        }
    }
    // Sometimes two fields in one entry (op applies to each).
    if rng.random_bool(0.2) && m.proto.is_none() {
        m.proto = Some(MatchProto {
            value: *pick(rng, &[L4Proto::Tcp, L4Proto::Udp, L4Proto::Sctp]),
        });
    }
    m
}

/// A random table named `name`.
pub fn random_table(rng: &mut StdRng, name: &str) -> FirewallConfigurationSpec {
    let family = *pick(
        rng,
        &[
            TableFamily::Ipv4,
            TableFamily::Ipv6,
            TableFamily::Inet,
            TableFamily::Inet,
        ],
    );
    let mut sets = Vec::new();
    let mut set_names = Vec::new();
    if rng.random_bool(0.4) {
        let six =
            family == TableFamily::Ipv6 || (family == TableFamily::Inet && rng.random_bool(0.3));
        let n = rng.random_range(0..5);
        sets.push(Set {
            name: "pods".into(),
            key_type: Some(if six {
                SetDataType::Ipv6Addr
            } else {
                SetDataType::Ipv4Addr
            }),
            data_type: None,
            from_address_sets: false,
            address_sets: None,
            elements: (0..n)
                .map(|_| SetElement {
                    key: addr(rng, six),
                    data: None,
                })
                .collect(),
        });
        set_names.push(("pods".to_string(), six));
    }
    let chains = (0..rng.random_range(1..3))
        .map(|ci| {
            let hook = *pick(
                rng,
                &[
                    ChainHook::Prerouting,
                    ChainHook::Forward,
                    ChainHook::Forward,
                    ChainHook::Postrouting,
                    ChainHook::Input,
                ],
            );
            let rules = (0..rng.random_range(0..5))
                .map(|ri| {
                    let mut action = *pick(
                        rng,
                        &[
                            FilterAction::Accept,
                            FilterAction::Accept,
                            FilterAction::Drop,
                            FilterAction::Reject,
                            FilterAction::Ctmark,
                        ],
                    );
                    if action == FilterAction::Reject && hook == ChainHook::Postrouting {
                        action = FilterAction::Drop;
                    }
                    // One address family per rule (nft refuses rules mixing them).
                    let six = match family {
                        TableFamily::Ipv4 => false,
                        TableFamily::Ipv6 => true,
                        _ => rng.random_bool(0.4),
                    };
                    FilterRule {
                        name: Some(format!("r{ri}")),
                        r#match: (0..rng.random_range(0..3))
                            .map(|_| random_match(rng, six, &set_names))
                            .collect(),
                        action: Some(action),
                        value: (action == FilterAction::Ctmark).then(|| "0x10".to_string()),
                        counter: Some(rng.random_bool(0.7)),
                    }
                })
                .collect();
            Chain {
                name: Some(format!("c{ci}")),
                rules: RulesSet {
                    filter_rules: Some(rules),
                    ..RulesSet::default()
                },
                type_: Some(ChainType::Filter),
                policy: Some(if rng.random_bool(0.75) {
                    ChainPolicy::Accept
                } else {
                    ChainPolicy::Drop
                }),
                hook: Some(hook),
                priority: Some(*pick(rng, &[-150, -10, 0, 0, 10])),
            }
        })
        .collect();
    FirewallConfigurationSpec {
        table: Table {
            name: Some(name.into()),
            family: Some(family),
            chains,
            sets,
        },
        audit: rng.random_bool(0.2),
    }
}

/// A table whose one chain holds a run of 4-8 rules of one shape followed by a catch-all: the
/// same verdict and the same fixed matches in every rule (sometimes an input interface), and
/// per rule its own values for the varying fields (addresses, ports, protocol), from the pools
/// [`random_packet`] draws from. What the nftables backend merges into one set lookup; values
/// that overlap, and a rule whose counter differs, split the run.
pub fn run_table(rng: &mut StdRng, name: &str) -> FirewallConfigurationSpec {
    let six = rng.random_bool(0.3);
    let family = if six {
        TableFamily::Ipv6
    } else {
        *pick(rng, &[TableFamily::Ipv4, TableFamily::Inet])
    };
    // Which fields vary: at least one address or port.
    let (mut dst, mut src, mut port, proto_col) = (
        rng.random_bool(0.7),
        rng.random_bool(0.3),
        rng.random_bool(0.6),
        rng.random_bool(0.4),
    );
    if !(dst || src || port) {
        dst = true;
        port = rng.random_bool(0.5);
        src = !port && rng.random_bool(0.5);
    }
    let iif = rng.random_bool(0.5).then(|| pick(rng, &IFACES).to_string());
    let hook = *pick(
        rng,
        &[ChainHook::Forward, ChainHook::Forward, ChainHook::Input],
    );
    let action = *pick(
        rng,
        &[
            FilterAction::Accept,
            FilterAction::Drop,
            FilterAction::Reject,
        ],
    );
    let counter = rng.random_bool(0.7);
    let odd_counter = rng.random_bool(0.2).then(|| rng.random_range(0..8));
    let eq = || Match {
        op: Some(MatchOperation::Eq),
        ..Match::default()
    };
    let mut rules: Vec<FilterRule> = (0..rng.random_range(4..9))
        .map(|ri| {
            let mut m = Vec::new();
            if let Some(dev) = &iif {
                m.push(Match {
                    dev: Some(MatchDev {
                        value: dev.clone(),
                        position: Some(MatchDevPosition::In),
                        wildcard: false,
                    }),
                    ..eq()
                });
            }
            for (on, position) in [(dst, MatchPosition::Dst), (src, MatchPosition::Src)] {
                if on {
                    m.push(Match {
                        ip: Some(MatchIp {
                            value: addr_value(rng, six),
                            position: Some(position),
                        }),
                        ..eq()
                    });
                }
            }
            if proto_col {
                let icmp = if six { L4Proto::Icmpv6 } else { L4Proto::Icmp };
                m.push(Match {
                    proto: Some(MatchProto {
                        value: *pick(rng, &[L4Proto::Tcp, L4Proto::Udp, icmp]),
                    }),
                    ..eq()
                });
            }
            if port {
                m.push(Match {
                    port: Some(MatchPort {
                        value: port_value(rng),
                        position: Some(MatchPosition::Dst),
                    }),
                    ..eq()
                });
            }
            FilterRule {
                name: Some(format!("m{ri}")),
                r#match: m,
                action: Some(action),
                value: None,
                counter: Some(counter != (odd_counter == Some(ri))),
            }
        })
        .collect();
    rules.push(FilterRule {
        name: Some("rest".into()),
        r#match: Vec::new(),
        action: Some(if action == FilterAction::Accept {
            FilterAction::Drop
        } else {
            FilterAction::Accept
        }),
        value: None,
        counter: Some(true),
    });
    one_chain_table(name, family, rules, ChainPolicy::Accept, hook)
}

/// A table `name` of `family` with one filter chain `c0` (priority 0) of `rules`.
fn one_chain_table(
    name: &str,
    family: TableFamily,
    rules: Vec<FilterRule>,
    policy: ChainPolicy,
    hook: ChainHook,
) -> FirewallConfigurationSpec {
    FirewallConfigurationSpec {
        table: Table {
            name: Some(name.into()),
            family: Some(family),
            chains: vec![Chain {
                name: Some("c0".into()),
                rules: RulesSet {
                    filter_rules: Some(rules),
                    ..RulesSet::default()
                },
                type_: Some(ChainType::Filter),
                policy: Some(policy),
                hook: Some(hook),
                priority: Some(0),
            }],
            sets: Vec::new(),
        },
        audit: false,
    }
}

/// A table whose chains hold long runs (8-14 rules) that each look the destination (or, in
/// some chains, the source) address up in a list of addresses from the packet pools, with
/// random further matches, verdicts and counters, broken now and then by a rule without that
/// lookup, and a catch-all: what the nftables backend dispatches through a verdict map
/// (addresses in several lists make classes of several rules). Inet tables mix IPv4 and IPv6
/// rules.
pub fn dispatch_table(rng: &mut StdRng, name: &str) -> FirewallConfigurationSpec {
    let family = *pick(
        rng,
        &[TableFamily::Ipv4, TableFamily::Inet, TableFamily::Ipv6],
    );
    let chains = (0..rng.random_range(1..3))
        .map(|ci| {
            let position = if rng.random_bool(0.75) {
                MatchPosition::Dst
            } else {
                MatchPosition::Src
            };
            let mut rules: Vec<FilterRule> = (0..rng.random_range(8..15))
                .map(|ri| {
                    let six = match family {
                        TableFamily::Ipv6 => true,
                        TableFamily::Inet => rng.random_bool(0.3),
                        _ => false,
                    };
                    let mut m = Vec::new();
                    // One rule in twenty breaks the run.
                    if !rng.random_bool(0.05) {
                        let n = rng.random_range(1..6);
                        let value = (0..n).map(|_| addr(rng, six)).collect::<Vec<_>>().join(",");
                        m.push(Match {
                            op: Some(MatchOperation::Eq),
                            ip: Some(MatchIp {
                                value,
                                position: Some(position),
                            }),
                            ..Match::default()
                        });
                    }
                    for _ in 0..rng.random_range(0..2) {
                        m.push(random_match(rng, six, &[]));
                    }
                    FilterRule {
                        name: Some(format!("d{ri}")),
                        r#match: m,
                        action: Some(*pick(
                            rng,
                            &[
                                FilterAction::Accept,
                                FilterAction::Accept,
                                FilterAction::Drop,
                                FilterAction::Reject,
                            ],
                        )),
                        value: None,
                        counter: Some(rng.random_bool(0.8)),
                    }
                })
                .collect();
            rules.push(FilterRule {
                name: Some("rest".into()),
                r#match: Vec::new(),
                action: Some(*pick(rng, &[FilterAction::Accept, FilterAction::Drop])),
                value: None,
                counter: Some(true),
            });
            Chain {
                name: Some(format!("c{ci}")),
                rules: RulesSet {
                    filter_rules: Some(rules),
                    ..RulesSet::default()
                },
                type_: Some(ChainType::Filter),
                policy: Some(ChainPolicy::Accept),
                hook: Some(*pick(
                    rng,
                    &[ChainHook::Forward, ChainHook::Forward, ChainHook::Input],
                )),
                priority: Some(ci),
            }
        })
        .collect();
    FirewallConfigurationSpec {
        table: Table {
            name: Some(name.into()),
            family: Some(family),
            chains,
            sets: Vec::new(),
        },
        audit: false,
    }
}

/// A random packet (forwarded 80%, else to the gateway), of any ct state.
pub fn random_packet(rng: &mut StdRng) -> Packet {
    let six = rng.random_bool(0.35);
    let src = addr(rng, six);
    let mut dst = addr(rng, six);
    while dst == src {
        dst = addr(rng, six);
    }
    let icmp = if six { proto::ICMPV6 } else { proto::ICMP };
    let mut ct_state = *pick(rng, &ir::CtState::ALL);
    let mut p = *pick(rng, &[proto::TCP, proto::UDP, proto::SCTP, icmp]);
    if ct_state == ir::CtState::Related {
        p = icmp;
    }
    if ct_state == ir::CtState::Established && p == icmp && rng.random_bool(0.5) {
        ct_state = ir::CtState::New;
    }
    Packet {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        proto: p,
        sport: *pick(rng, &[40000, 80, 1024]),
        dport: *pick(rng, &[79, 80, 81, 443, 22, 5000, 40000]),
        iif: Some(pick(rng, &IFACES).to_string()),
        oif: if rng.random_bool(0.8) {
            Some(pick(rng, &IFACES).to_string())
        } else {
            None
        },
        ct_state,
    }
}

/// Specs as compilation input.
pub fn objects(specs: &[FirewallConfigurationSpec]) -> Vec<PolicyObject> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| PolicyObject {
            origin: Origin(format!("diff/o{i}")),
            spec: s.clone(),
            role: peerwall_intent::Role::Enforce,
        })
        .collect()
}

/// 1-3 random tables named t0, t1, t2.
pub fn random_specs(rng: &mut StdRng) -> Vec<FirewallConfigurationSpec> {
    let names = ["t0", "t1", "t2"];
    (0..rng.random_range(1..4))
        .map(|i| random_table(rng, names[i]))
        .collect()
}

/// A spec as a complete FirewallConfiguration document (JSON, which YAML readers take), ready
/// for `peerwall verdict -f`.
pub fn as_yaml(i: usize, spec: &FirewallConfigurationSpec) -> String {
    serde_json::json!({
        "apiVersion": peerwall_intent::load::API_VERSION,
        "kind": peerwall_intent::load::KIND,
        "metadata": {"name": format!("o{i}"), "namespace": "diff"},
        "spec": spec,
    })
    .to_string()
}
