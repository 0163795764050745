use std::collections::BTreeSet;
use std::net::IpAddr;

use peerwall_policy::ir::IpFamily;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::dispatch::dispatch;
use crate::dispatch::tests::table_of;
use crate::model::{Expr, Key, Right, Rule};

fn pool(v4: bool) -> Vec<IpAddr> {
    if v4 {
        (1..=12)
            .map(|i| format!("10.0.0.{i}").parse().unwrap())
            .collect()
    } else {
        (1..=6)
            .map(|i| format!("fd00::{i}").parse().unwrap())
            .collect()
    }
}

fn family(v4: bool) -> IpFamily {
    if v4 {
        IpFamily::V4
    } else {
        IpFamily::V6
    }
}

fn host_set(name: &str, v4: bool, addrs: &BTreeSet<IpAddr>) -> Set {
    Set {
        name: name.into(),
        key: KeyType::of(family(v4)),
        interval: false,
        elements: addrs.iter().map(|a| Element::Addr(*a)).collect(),
        counter: false,
        comments: Vec::new(),
        verdict_map: false,
        timeout: None,
    }
}

/// `ip[6] daddr @set` or `ip[6] daddr <addr>`, then a port and accept.
fn rule(i: usize, v4: bool, right: Right) -> Rule {
    Rule {
        chain: "c".into(),
        comment: format!("r{i}"),
        exprs: vec![
            Expr::Match {
                negate: false,
                left: Key::Addr {
                    family: family(v4),
                    source: false,
                },
                right,
            },
            Expr::Match {
                negate: false,
                left: Key::Port { source: false },
                right: Right::Element(Element::Port(i as u16)),
            },
            Expr::Accept,
        ],
    }
}

/// A table whose chain is one run of 8 to 14 rules, each looking the destination up in a
/// set of its own (one in eight: one address), most IPv4, over small pools of addresses of
/// four kinds (address `i` is of kind `i % 4`, and a set holds every address of the kinds it
/// holds: pods of one label set, so that classes hold several addresses).
fn random_table(rng: &mut StdRng) -> (Table, Vec<(bool, BTreeSet<IpAddr>)>) {
    let n = rng.random_range(8..=14);
    let mut sets = Vec::new();
    let mut contents = Vec::new();
    let mut rules = Vec::new();
    for i in 0..n {
        let v4 = rng.random_bool(0.8);
        let p = pool(v4);
        if rng.random_bool(0.125) {
            rules.push(rule(
                i,
                v4,
                Right::Element(Element::Addr(p[rng.random_range(0..p.len())])),
            ));
            continue;
        }
        let kinds: Vec<bool> = (0..4).map(|_| rng.random_bool(0.35)).collect();
        let addrs: BTreeSet<IpAddr> = p
            .iter()
            .enumerate()
            .filter(|(i, _)| kinds[i % 4])
            .map(|(_, a)| *a)
            .collect();
        sets.push(host_set(&format!("s{i}"), v4, &addrs));
        contents.push((v4, addrs));
        rules.push(rule(i, v4, Right::SetRef(format!("s{i}"))));
    }
    let t = table_of(sets, rules);
    (t, contents)
}

fn elements(t: &Table, map: &str) -> BTreeSet<Element> {
    t.sets
        .iter()
        .find(|s| s.name == map)
        .map(|s| s.elements.iter().copied().collect())
        .unwrap_or_default()
}

/// Against rendering the table again with the edited sets: where the map edits are given,
/// that rendering has the same chains, rules and classes, and its maps hold the elements the
/// edits make; where they are refused, it does differ in those (a class made or emptied),
/// so nothing falls back that the edits could have done.
#[test]
fn map_edits_are_what_rendering_again_gives() {
    let mut rng = StdRng::seed_from_u64(0x00d1_5ba7);
    let (mut edited_in_place, mut rendered_again, mut moved_class) = (0, 0, 0);
    for case in 0..3000 {
        let (base, contents) = random_table(&mut rng);
        let mut before = base.clone();
        dispatch(&mut before);
        if before.dispatch_maps.is_empty() {
            continue;
        }
        // One address relabelled: it leaves every set, takes another address's sets (joins
        // its class), or joins or leaves one or two sets (most often a class of its own).
        let v4 = rng.random_bool(0.8);
        let p = pool(v4);
        let a = p[rng.random_range(0..p.len())];
        let b = p[rng.random_range(0..p.len())];
        let how = rng.random_range(0..3);
        let toggled: Vec<usize> = (0..rng.random_range(1..=2))
            .map(|_| rng.random_range(0..contents.len()))
            .collect();
        let mut after_base = base.clone();
        let mut changes: Vec<(String, Vec<Element>, Vec<Element>)> = Vec::new();
        for (k, (set_v4, held)) in contents.iter().enumerate() {
            if *set_v4 != v4 {
                continue;
            }
            let was = held.contains(&a);
            let now = match how {
                0 => false,
                1 => held.contains(&b),
                _ => was ^ toggled.contains(&k),
            };
            if was == now {
                continue;
            }
            let el = Element::Addr(a);
            let set = &mut after_base.sets[k];
            if now {
                set.elements.push(el);
                set.elements.sort_unstable();
                changes.push((set.name.clone(), Vec::new(), vec![el]));
            } else {
                set.elements.retain(|e| *e != el);
                changes.push((set.name.clone(), vec![el], Vec::new()));
            }
        }
        let edits: Vec<SetEdit<'_>> = changes
            .iter()
            .map(|(set, gone, new)| SetEdit { set, gone, new })
            .collect();
        let mut after = after_base;
        dispatch(&mut after);
        let same_structure = after.regular == before.regular
            && after.rules == before.rules
            && after.dispatch_maps == before.dispatch_maps
            && after
                .sets
                .iter()
                .zip(&before.sets)
                .all(|(a, b)| a.capacity() == b.capacity());
        match map_edits(&before, &edits) {
            Some(maps) => {
                edited_in_place += 1;
                assert!(same_structure, "case {case}: edited in place, but rendering again changes the table's structure");
                for dm in &before.dispatch_maps {
                    let mut want = elements(&before, &dm.map);
                    for m in maps.iter().filter(|m| m.map == dm.map) {
                        for g in &m.gone {
                            assert!(want.remove(g), "case {case}: {g:?} was not in {}", m.map);
                        }
                        for n in &m.new {
                            assert!(
                                want.insert(*n),
                                "case {case}: {n:?} was in {} already",
                                m.map
                            );
                        }
                        moved_class += usize::from(m.gone.iter().any(|g| {
                            let Element::Jump(a, _) = g else { return false };
                            m.new
                                .iter()
                                .any(|n| matches!(n, Element::Jump(b, _) if b == a))
                        }));
                    }
                    assert_eq!(want, elements(&after, &dm.map), "case {case}: {}", dm.map);
                }
            }
            None => {
                rendered_again += 1;
                assert!(
                    !same_structure,
                    "case {case}: refused, but rendering again changes only elements"
                );
            }
        }
    }
    // The generator meets both outcomes, and addresses changing class.
    let counts = format!("in place {edited_in_place}, again {rendered_again}, moved {moved_class}");
    assert!(edited_in_place >= 500, "{counts}");
    eprintln!("{counts}");
    assert!(rendered_again >= 300, "{counts}");
    assert!(moved_class >= 100, "{counts}");
}

/// Sets `s0` to `s7` each holding `held`, and rules `r0` to `r7` looking them up in turn: one
/// run, one class.
fn eight_sets(held: &BTreeSet<IpAddr>) -> Table {
    table_of(
        (0..8)
            .map(|i| host_set(&format!("s{i}"), true, held))
            .collect(),
        (0..8)
            .map(|i| rule(i, true, Right::SetRef(format!("s{i}"))))
            .collect(),
    )
}

/// The same edit of each of `eight_sets`' sets.
fn every_set<'a>(gone: &'a [Element], new: &'a [Element]) -> Vec<SetEdit<'a>> {
    ["s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7"]
        .into_iter()
        .map(|set| SetEdit { set, gone, new })
        .collect()
}

#[test]
fn an_address_leaving_its_class_but_not_the_last_is_one_element() {
    let a: IpAddr = "10.0.0.1".parse().unwrap();
    let b: IpAddr = "10.0.0.2".parse().unwrap();
    let both: BTreeSet<IpAddr> = [a, b].into();
    let mut t = eight_sets(&both);
    dispatch(&mut t);
    assert_eq!(t.dispatch_maps.len(), 1);
    let gone = [Element::Addr(a)];
    let edits = every_set(&gone, &[]);
    let maps = map_edits(&t, &edits).expect("b keeps the class");
    assert_eq!(maps.len(), 1);
    assert!(maps[0].new.is_empty());
    assert!(matches!(maps[0].gone[..], [Element::Jump(x, _)] if x == a));
    // Both leave: the class would have no address, its chain would go.
    let gone_both = [Element::Addr(a), Element::Addr(b)];
    let edits = every_set(&gone_both, &[]);
    assert_eq!(map_edits(&t, &edits), None);
}

#[test]
fn a_map_whose_count_crosses_its_declared_size_is_rendered_again() {
    // 32 addresses in every set: one class, a map of 32 elements declaring 64.
    let held: BTreeSet<IpAddr> = (1..=32)
        .map(|i| format!("10.0.0.{i}").parse().unwrap())
        .collect();
    let mut t = eight_sets(&held);
    dispatch(&mut t);
    let map = t.sets.iter().find(|s| s.verdict_map).unwrap();
    assert_eq!(map.capacity(), Some(64));
    // One more address in every set: the same class, but 33 elements declare 128.
    let more = [Element::Addr("10.0.1.1".parse().unwrap())];
    let edits = every_set(&[], &more);
    assert_eq!(map_edits(&t, &edits), None);
    // One leaving keeps the size: in place.
    let less = [Element::Addr("10.0.0.1".parse().unwrap())];
    let edits = every_set(&less, &[]);
    assert!(map_edits(&t, &edits).is_some());
}
