use std::net::IpAddr;

use peerwall_policy::ir::{ChainKind, Hook, IpFamily, TableFamily};

use super::*;
use crate::listing::{ListedRule, ListedTable, Listing};
use crate::model::{Chain, Policy};

fn addr(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn host_set(name: &str, addrs: &[String]) -> Set {
    Set {
        name: name.into(),
        key: KeyType::Ipv4Addr,
        interval: false,
        elements: addrs.iter().map(|a| Element::Addr(addr(a))).collect(),
        counter: false,
        comments: Vec::new(),
        verdict_map: false,
        timeout: None,
    }
}

fn lookup(set: &str) -> Expr {
    Expr::Match {
        negate: false,
        left: Key::Addr {
            family: IpFamily::V4,
            source: false,
        },
        right: Right::SetRef(set.into()),
    }
}

fn port(p: u16) -> Expr {
    Expr::Match {
        negate: false,
        left: Key::Port { source: false },
        right: Right::Element(Element::Port(p)),
    }
}

fn rule(name: &str, exprs: Vec<Expr>) -> Rule {
    Rule {
        chain: "c".into(),
        comment: name.into(),
        exprs,
    }
}

/// A table with `n` rules `ip daddr @s<i> th dport <i> counter accept`, set `s<i>` holding
/// 10.0.0.<i> and 10.0.0.200 (in every set), between a first and a last rule without lookup.
fn table(n: usize) -> Table {
    let mut sets = Vec::new();
    let mut rules = vec![rule("first", vec![port(1), Expr::Drop])];
    for i in 0..n {
        sets.push(host_set(
            &format!("s{i}"),
            &[format!("10.0.0.{i}"), "10.0.0.200".into()],
        ));
        rules.push(rule(
            &format!("r{i}"),
            vec![
                lookup(&format!("s{i}")),
                port(i as u16),
                Expr::Counter,
                Expr::Accept,
            ],
        ));
    }
    rules.push(rule("last", vec![Expr::Drop]));
    table_of(sets, rules)
}

/// Table `t` (inet) of `sets` and `rules`, in its one chain `c` (forward, accepting).
pub(super) fn table_of(sets: Vec<Set>, rules: Vec<Rule>) -> Table {
    Table {
        name: "t".into(),
        family: TableFamily::Inet,
        owner: "ns/t".into(),
        sets,
        chains: vec![Chain {
            name: "c".into(),
            kind: ChainKind::Filter,
            hook: Hook::Forward,
            priority: 0,
            policy: Policy::Accept,
        }],
        regular: Vec::new(),
        dispatch_maps: Vec::new(),
        rules,
        event_limit: None,
    }
}

fn base_rules(t: &Table) -> Vec<String> {
    t.rules
        .iter()
        .filter(|r| r.chain == "c")
        .map(|r| match r.exprs.as_slice() {
            [Expr::Vmap { map, .. }] => format!("vmap @{map}"),
            _ => r.comment.clone(),
        })
        .collect()
}

/// The chain the map sends `a` to, and that chain's rules (names).
fn class_of(t: &Table, a: &str) -> Option<(String, Vec<String>)> {
    let map = t.sets.iter().find(|s| s.verdict_map)?;
    let to = map.elements.iter().find_map(|e| match e {
        Element::Jump(x, cc) if *x == addr(a) => Some(cc.name()),
        _ => None,
    })?;
    let rules = t
        .rules
        .iter()
        .filter(|r| r.chain == to)
        .map(|r| r.comment.clone())
        .collect();
    Some((to, rules))
}

#[test]
fn a_long_run_becomes_one_map_lookup_and_a_chain_per_class() {
    let mut t = table(10);
    dispatch(&mut t);
    assert_eq!(base_rules(&t), ["first", "vmap @__pw_v0_4", "last"]);
    // 10.0.0.3 is in s3 only; 10.0.0.200 in every set: all ten rules, in order.
    let (_, one) = class_of(&t, "10.0.0.3").unwrap();
    assert_eq!(one, ["r3"]);
    let (_, all) = class_of(&t, "10.0.0.200").unwrap();
    assert_eq!(all, (0..10).map(|i| format!("r{i}")).collect::<Vec<_>>());
    assert!(
        class_of(&t, "10.0.0.99").is_none(),
        "in no set: not in the map"
    );
    // A class chain's rules are the originals without the lookup the map made.
    let copy = t
        .rules
        .iter()
        .find(|r| r.chain.starts_with("__pw_k") && r.comment == "r3")
        .unwrap();
    assert_eq!(copy.exprs, vec![port(3), Expr::Counter, Expr::Accept]);
    // Eleven classes, each a regular chain of chain c; the sets stay (updated in place).
    assert_eq!(t.regular.len(), 11);
    assert!(t.regular.iter().all(|r| r.base == "c"));
    assert_eq!(t.sets.iter().filter(|s| !s.verdict_map).count(), 10);
    assert_eq!(t.dispatch_sources().len(), 10);
}

#[test]
fn rendering_twice_names_classes_the_same() {
    let (mut a, mut b) = (table(9), table(9));
    dispatch(&mut a);
    // One address more, in an existing class: the same chains, one map element more.
    b.sets[4].elements.push(Element::Addr(addr("10.0.0.77")));
    dispatch(&mut b);
    assert_eq!(a.regular, b.regular);
    assert_eq!(a.rules, b.rules);
    assert!(a.same_structure(&b));
    let (to, rules) = class_of(&b, "10.0.0.77").unwrap();
    assert_eq!((to, rules), class_of(&b, "10.0.0.4").unwrap());
}

#[test]
fn short_runs_and_the_rules_around_a_run_stay_as_they_are() {
    let mut short = table(MIN_RUN - 1);
    let before = short.clone();
    dispatch(&mut short);
    assert_eq!(short, before);

    // A rule without lookup in the middle splits 16 rules into runs of 8 and 7.
    let mut split = table(16);
    split.rules[9].exprs.remove(0);
    dispatch(&mut split);
    let mut want = vec!["first".to_string(), "vmap @__pw_v0_4".into(), "r8".into()];
    want.extend((9..16).map(|i| format!("r{i}")));
    want.push("last".into());
    assert_eq!(base_rules(&split), want);
}

#[test]
fn classes_that_would_copy_too_many_rules_stay_linear() {
    // 12 rules, address i in set j when bit j of i is set: 4095 classes of 6 rules on average.
    let mut t = table(12);
    for (j, s) in t.sets.iter_mut().enumerate() {
        s.elements = (1u32..4096)
            .filter(|i| i & (1 << j) != 0)
            .map(|i| Element::Addr(IpAddr::from(std::net::Ipv4Addr::from(0x0a01_0000 + i))))
            .collect();
    }
    let before = t.clone();
    dispatch(&mut t);
    assert_eq!(t, before);
    assert!(within_budget(12, 4 * 12 + 1024));
    assert!(!within_budget(12, 4 * 12 + 1025));
}

#[test]
fn counters_of_class_copies_add_up_in_their_base_chain() {
    let r = |chain: &str, comment: &str, packets: u64, lookups: &[&str]| ListedRule {
        family: "inet".into(),
        table: "t".into(),
        chain: chain.into(),
        handle: None,
        comment: Some(comment.into()),
        counter: Some(crate::listing::Counter {
            packets,
            bytes: packets * 100,
        }),
        lookups: lookups.iter().map(|s| s.to_string()).collect(),
        logs: Vec::new(),
        statements: Vec::new(),
    };
    let listing = Listing {
        tables: vec![ListedTable {
            family: "inet".into(),
            name: "t".into(),
        }],
        rules: vec![
            r(crate::model::MARKER_CHAIN, "peerwall owner=ns/t", 0, &[]),
            r("c", "first", 1, &[]),
            r("c", "", 0, &["__pw_v0_4"]),
            r("__pw_k0_00000000000000aa", "r1", 3, &[]),
            r("__pw_k0_00000000000000bb", "r1", 4, &[]),
            r("__pw_k0_00000000000000bb", "r2", 5, &[]),
        ],
        ..Listing::default()
    };
    let got: Vec<(String, String, u64, u64)> = listing
        .rule_counters(&[])
        .into_iter()
        .filter(|c| !c.rule.is_empty())
        .map(|c| (c.chain, c.rule, c.packets, c.bytes))
        .collect();
    assert_eq!(
        got,
        [
            ("c".to_string(), "first".to_string(), 1, 100),
            ("c".into(), "r1".into(), 7, 700),
            ("c".into(), "r2".into(), 5, 500),
        ]
    );
}
