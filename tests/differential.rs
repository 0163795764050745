//! Differential test: for random policies and packets, the real kernel running the nftables
//! rendering (`--engine nftables`) must give the reference evaluator's verdict, chain and rule.
//!
//! Seeded and reproducible: `PEERWALL_SEED=<n>` replays a run; `PEERWALL_DIFF_POLICIES` and
//! `PEERWALL_DIFF_PACKETS` scale it. A mismatch is shrunk to a minimal policy and printed as
//! FirewallConfiguration YAML with the packet.

mod common;

use common::require_root;
use peerwall::api::types::*;
use peerwall::compile::{compile, PolicyObject};
use peerwall::ir::{self, eval::proto, Origin, Packet};
use peerwall::probe::NftProbe;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const IFACES: [&str; 3] = ["liqo-tunnel", "liqo.abcdefghij", "liqo.zyxwvutsrq"];

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
    let pos = || {
        if rand::random::<bool>() {
            MatchPosition::Src
        } else {
            MatchPosition::Dst
        }
    };
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
                &[L4Proto::Tcp, L4Proto::Udp, L4Proto::Icmp, L4Proto::Icmpv6],
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
            value: *pick(rng, &[L4Proto::Tcp, L4Proto::Udp]),
        });
    }
    m
}

fn random_table(rng: &mut StdRng, name: &str) -> FirewallConfigurationSpec {
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
    }
}

fn random_packet(rng: &mut StdRng) -> Packet {
    let six = rng.random_bool(0.35);
    let src = addr(rng, six);
    let mut dst = addr(rng, six);
    while dst == src {
        dst = addr(rng, six);
    }
    let icmp = if six { proto::ICMPV6 } else { proto::ICMP };
    let mut ct_state = *pick(rng, &CtState_ALL);
    let mut p = *pick(rng, &[proto::TCP, proto::UDP, icmp]);
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
        dport: *pick(rng, &[79, 80, 81, 443, 22, 5000]),
        iif: Some(pick(rng, &IFACES).to_string()),
        oif: if rng.random_bool(0.8) {
            Some(pick(rng, &IFACES).to_string())
        } else {
            None
        },
        ct_state,
    }
}

#[allow(non_upper_case_globals)]
const CtState_ALL: [ir::CtState; 5] = ir::CtState::ALL;

fn objects(specs: &[FirewallConfigurationSpec]) -> Vec<PolicyObject> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| PolicyObject {
            origin: Origin(format!("diff/o{i}")),
            spec: s.clone(),
        })
        .collect()
}

/// Whether reference and kernel disagree on `pkt` under `specs` (a probe error counts).
fn mismatch(specs: &[FirewallConfigurationSpec], pkt: &Packet) -> Option<String> {
    let policy = compile(&objects(specs)).ok()?.policy;
    let expected = ir::evaluate(&policy, pkt);
    let ifs: Vec<String> = IFACES.iter().map(|s| s.to_string()).collect();
    let got = NftProbe::new(&policy, &ifs).and_then(|mut p| p.verdict(pkt));
    match got {
        Ok(v) if v == expected => None,
        Ok(v) => Some(format!("reference {expected:?}\nkernel    {v:?}")),
        Err(e) => Some(format!("reference {expected:?}\nkernel    error: {e}")),
    }
}

/// Drop tables, chains, rules and matches while the mismatch persists.
fn shrink(
    mut specs: Vec<FirewallConfigurationSpec>,
    pkt: &Packet,
) -> Vec<FirewallConfigurationSpec> {
    loop {
        let mut candidates: Vec<Vec<FirewallConfigurationSpec>> = Vec::new();
        for t in 0..specs.len() {
            let mut c = specs.clone();
            c.remove(t);
            candidates.push(c);
            for ch in 0..specs[t].table.chains.len() {
                let mut c = specs.clone();
                c[t].table.chains.remove(ch);
                candidates.push(c);
                let n = specs[t].table.chains[ch]
                    .rules
                    .filter_rules
                    .as_ref()
                    .map_or(0, Vec::len);
                for r in 0..n {
                    let mut c = specs.clone();
                    if let Some(rs) = c[t].table.chains[ch].rules.filter_rules.as_mut() {
                        rs.remove(r);
                    }
                    candidates.push(c);
                    let m = specs[t].table.chains[ch]
                        .rules
                        .filter_rules
                        .as_ref()
                        .map_or(0, |rs| rs[r].r#match.len());
                    for k in 0..m {
                        let mut c = specs.clone();
                        if let Some(rs) = c[t].table.chains[ch].rules.filter_rules.as_mut() {
                            rs[r].r#match.remove(k);
                        }
                        candidates.push(c);
                    }
                }
            }
        }
        match candidates.into_iter().find(|c| mismatch(c, pkt).is_some()) {
            Some(smaller) => specs = smaller,
            None => return specs,
        }
    }
}

fn env_num(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn nftables_kernel_equals_reference() {
    require_root();
    let seed = env_num("PEERWALL_SEED", rand::random::<u32>() as u64);
    let policies = env_num("PEERWALL_DIFF_POLICIES", 12);
    let packets = env_num("PEERWALL_DIFF_PACKETS", 25);
    eprintln!("differential: PEERWALL_SEED={seed} policies={policies} packets={packets}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cases = 0;
    let ifs: Vec<String> = IFACES.iter().map(|s| s.to_string()).collect();
    for _ in 0..policies {
        let names = ["t0", "t1", "t2"];
        let specs: Vec<FirewallConfigurationSpec> = (0..rng.random_range(1..4))
            .map(|i| random_table(&mut rng, names[i]))
            .collect();
        let policy = compile(&objects(&specs))
            .unwrap_or_else(|e| panic!("generator made an invalid policy: {e}"))
            .policy;
        let mut probe = NftProbe::new(&policy, &ifs).expect("scratch gateway");
        for _ in 0..packets {
            let pkt = random_packet(&mut rng);
            let expected = ir::evaluate(&policy, &pkt);
            let got = probe.verdict(&pkt);
            let agree = matches!(&got, Ok(v) if *v == expected);
            if !agree {
                let minimal = shrink(specs.clone(), &pkt);
                let yaml: Vec<String> = minimal
                    .iter()
                    .enumerate()
                    .map(|(i, s)| as_yaml(i, s))
                    .collect();
                panic!(
                    "MISMATCH (PEERWALL_SEED={seed})\npacket {pkt:?}\nreference {expected:?}\nkernel    {got:?}\nminimal policy:\n{}\nminimal: {}",
                    yaml.join("---\n"),
                    mismatch(&minimal, &pkt).unwrap_or_default()
                );
            }
            cases += 1;
        }
    }
    eprintln!("differential: {cases} cases, 0 mismatches");
    assert_eq!(cases, policies * packets);
}

/// A spec as a complete FirewallConfiguration document, ready for `peerwall verdict -f`.
fn as_yaml(i: usize, spec: &FirewallConfigurationSpec) -> String {
    let mut fc = FirewallConfiguration::new(&format!("o{i}"), spec.clone());
    fc.metadata.namespace = Some("diff".into());
    serde_yaml::to_string(&fc).unwrap_or_default()
}
