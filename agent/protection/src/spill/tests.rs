use super::*;

fn set(name: &str, n: usize, v6: bool) -> api::Set {
    api::Set {
        name: name.into(),
        key_type: Some(if v6 {
            api::SetDataType::Ipv6Addr
        } else {
            api::SetDataType::Ipv4Addr
        }),
        elements: (0..n)
            .map(|i| api::SetElement {
                key: if v6 {
                    format!("fd00::{:x}", i + 1)
                } else {
                    format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255)
                },
                data: None,
            })
            .collect(),
        ..Default::default()
    }
}

fn spec(sets: Vec<api::Set>) -> api::FirewallConfigurationSpec {
    api::FirewallConfigurationSpec {
        table: api::Table {
            name: Some("t".into()),
            sets,
            ..Default::default()
        },
        audit: false,
    }
}

fn json_len(s: &api::FirewallConfigurationSpec) -> usize {
    serde_json::to_vec(s).unwrap().len()
}

#[test]
fn a_configuration_that_fits_keeps_its_sets_inline() {
    let mut s = spec(vec![set("own.a", 100, false), set("own6.a", 10, true)]);
    let before = s.clone();
    let fits = json_len(&s);
    assert!(spill(&mut s, fits, &BTreeSet::new()).is_empty());
    assert_eq!(s, before);
}

#[test]
fn the_largest_sets_move_out_until_the_configuration_fits() {
    let mut s = spec(vec![
        set("small", 10, false),
        set("large", 5_000, false),
        set("middle", 2_000, true),
        api::Set {
            name: "ports".into(),
            key_type: Some(api::SetDataType::Integer),
            elements: vec![api::SetElement {
                key: "80".into(),
                data: None,
            }],
            ..Default::default()
        },
    ]);
    let before = s.clone();
    let full = json_len(&s);
    // A budget the large set alone brings it under.
    let budget = full - elements_bytes(&before.table.sets[1]) + 100;
    let moved = spill(&mut s, budget, &BTreeSet::new());
    assert_eq!(moved.len(), 1, "{moved:?}");
    assert_eq!(moved[0].set, "large");
    let keys: Vec<String> = before.table.sets[1]
        .elements
        .iter()
        .map(|e| e.key.clone())
        .collect();
    assert_eq!(moved[0].elements, keys);
    assert!(json_len(&s) <= budget, "{} > {budget}", json_len(&s));
    let large = &s.table.sets[1];
    assert!(large.from_address_sets && large.elements.is_empty());
    assert_eq!(s.table.sets[0], before.table.sets[0]);
    // A budget nothing but the elements meets: every address set moves, the ports stay.
    let mut s = before.clone();
    let moved = spill(&mut s, 1, &BTreeSet::new());
    let names: Vec<&str> = moved.iter().map(|m| m.set.as_str()).collect();
    assert_eq!(names, ["large", "middle", "small"]);
    assert_eq!(s.table.sets[3], before.table.sets[3]);
}

#[test]
fn the_size_estimate_is_the_json_the_api_server_stores() {
    // What moving a set takes off, as counted, equals the JSON's shrinking (so the budget is
    // met as measured, not as guessed).
    for (n, v6) in [(1, false), (999, false), (1_500, true)] {
        let ports = api::Set {
            key_type: Some(api::SetDataType::Integer),
            ..set("b", 3, false)
        };
        let mut s = spec(vec![set("a", n, v6), ports]);
        let before = json_len(&s);
        let bytes = elements_bytes(&s.table.sets[0]);
        let moved = spill(&mut s, before - 1, &BTreeSet::new());
        assert_eq!(moved[0].set, "a");
        let after = json_len(&s);
        // `"elements":[…],` replaced by `"fromAddressSets":true,`.
        let shell =
            r#""elements":[],"#.len() as isize - r#""fromAddressSets":true,"#.len() as isize;
        assert_eq!(
            (before - after) as isize,
            bytes as isize - 1 + shell,
            "{n} elements"
        );
    }
}

#[test]
fn slices_are_laid_out_from_what_the_api_shows_and_counted() {
    let m = Moved {
        set: "own_0123".into(),
        elements: (0..2_500)
            .map(|i| format!("10.0.{}.{}", i / 256, i % 256))
            .collect(),
    };
    let first = lay_out("cfg", &m, &[], &BTreeSet::new());
    assert_eq!(first.count, 3);
    assert_eq!(first.write.len(), 3);
    assert!(first.delete.is_empty());
    assert!(first.write.iter().all(|s| s.addresses.len() <= 1000));
    // Shown by the API: nothing to write again.
    let again = lay_out("cfg", &m, &first.write, &BTreeSet::new());
    assert_eq!(
        again,
        SetSlices {
            write: vec![],
            delete: vec![],
            count: 3
        }
    );
    // Most elements gone: the slices that empty are deleted, the rest counted.
    let few = Moved {
        set: m.set.clone(),
        elements: first.write[0].addresses.iter().take(10).cloned().collect(),
    };
    let after = lay_out("cfg", &few, &first.write, &BTreeSet::new());
    assert_eq!(after.count, 1);
    assert_eq!(after.delete.len(), 2);
    assert_eq!(after.write.len(), 1);
    assert_eq!(
        after.write[0].addresses,
        few.elements.iter().cloned().collect::<BTreeSet<_>>()
    );
}

#[test]
fn slice_names_are_object_names_and_never_shared_by_two_sets() {
    let sets = [
        "own.a_b",
        "own.a-b",
        "OWN.A_B",
        "own6.a-very-long-namespace-name-that-takes-up-most-of-the-sixty-three",
        "far6_0123456789abcdef_2",
    ];
    let names: BTreeSet<String> = sets.iter().map(|s| slice_name("cfg", s, 7)).collect();
    assert_eq!(names.len(), sets.len(), "{names:?}");
    for n in &names {
        assert!(n.len() <= 253, "{n}");
        assert!(
            n.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            "{n}"
        );
        assert!(!n.contains("--") && n.ends_with("-0007"), "{n}");
    }
}

#[test]
fn a_new_slice_never_takes_a_name_another_set_holds() {
    let m = Moved {
        set: "own.shop".into(),
        elements: ["10.0.0.1".to_string()].into(),
    };
    // Another set's slice under the name this set's first slice would take (two names cut
    // short alike, or a hash collision): this set writes under the next name.
    let theirs = slice_name("cfg", &m.set, 0);
    let laid = lay_out("cfg", &m, &[], &BTreeSet::from([theirs.clone()]));
    assert_eq!(laid.write.len(), 1);
    assert_eq!(laid.write[0].name, slice_name("cfg", &m.set, 1));
    assert_ne!(laid.write[0].name, theirs);
}

#[test]
fn sets_in_slices_stay_there_until_the_configuration_clearly_fits() {
    let spec = spec(vec![set("a", 1_000, false), set("b", 1_001, false)]);
    let full = json_len(&spec);
    // Over budget by less than either set: the larger (b) moves.
    let budget = full - 100;
    let mut s = spec.clone();
    let moved: Vec<String> = spill(&mut s, budget, &BTreeSet::new())
        .into_iter()
        .map(|m| m.set)
        .collect();
    assert_eq!(moved, ["b"]);
    // a in slices (it was the larger before): a stays, b inline.
    let mut s = spec.clone();
    let moved: Vec<String> = spill(&mut s, budget, &BTreeSet::from(["a".to_string()]))
        .into_iter()
        .map(|m| m.set)
        .collect();
    assert_eq!(moved, ["a"]);
    // Under budget but not under three quarters of it: a still stays.
    let mut s = spec.clone();
    let moved = spill(&mut s, full + 1, &BTreeSet::from(["a".to_string()]));
    assert_eq!(moved.len(), 1);
    // Under three quarters: back inline.
    let mut s = spec.clone();
    assert!(spill(&mut s, full * 4 / 3 + 8, &BTreeSet::from(["a".to_string()])).is_empty());
    assert_eq!(s, spec);
}

/// A set its slices already hold exactly is answered without laying it out, and that answer
/// is the one laying out gives: random slices (addresses missing, extra, listed twice, empty
/// slices) against random desired sets, both ways compared.
#[test]
fn a_set_its_slices_already_hold_is_laid_out_as_laying_out_would() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(77);
    let addr = |i: u32| format!("10.0.{}.{}", i / 256, i % 256);
    let (mut exact, mut tried) = (0, 0);
    for _ in 0..3000 {
        let n = rng.random_range(0..40u32);
        let desired: BTreeSet<String> = (0..n).filter(|_| rng.random_bool(0.8)).map(addr).collect();
        // Slices: the desired addresses dealt out, then perturbed (or not).
        let k = rng.random_range(1..4usize);
        let mut current: Vec<Slice<String>> = (0..k)
            .map(|i| Slice {
                name: format!("c-s-{i}"),
                set: "s".into(),
                addresses: BTreeSet::new(),
            })
            .collect();
        for (j, a) in desired.iter().enumerate() {
            current[j % k].addresses.insert(a.clone());
        }
        match rng.random_range(0..7) {
            0 => {
                let extra = addr(1000 + rng.random_range(0..5));
                current[0].addresses.insert(extra);
            }
            1 => {
                if let Some(a) = desired.iter().next() {
                    let i = rng.random_range(0..k);
                    current[i].addresses.insert(a.clone());
                }
            }
            2 => {
                if let Some(a) = desired.iter().last() {
                    current.iter_mut().for_each(|s| {
                        s.addresses.remove(a);
                    });
                }
            }
            // The same count, another content: one address in place of a desired one, or a
            // desired one listed twice in place of another.
            3 | 4 => {
                if let Some(a) = desired.iter().last() {
                    current.iter_mut().for_each(|s| {
                        s.addresses.remove(a);
                    });
                    let instead = match (rng.random_bool(0.5), desired.iter().next()) {
                        (true, Some(first)) if first != a => first.clone(),
                        _ => addr(1000),
                    };
                    let i = rng.random_range(0..k);
                    current[i].addresses.insert(instead);
                }
            }
            _ => {}
        }
        let moved = Moved {
            set: "s".into(),
            elements: desired.iter().cloned().collect(),
        };
        let taken = BTreeSet::new();
        let fast = lay_out("c", &moved, &current, &taken);
        let slow = lay_out_changes("c", "s", &desired, &current, &taken);
        assert_eq!(
            (fast.write, fast.delete, fast.count),
            (slow.write.clone(), slow.delete.clone(), slow.count),
            "{current:?} for {:?}",
            moved.elements
        );
        tried += 1;
        if holds_exactly(&current, &desired) {
            exact += 1;
            assert!(slow.write.is_empty() && slow.delete.is_empty());
        }
    }
    // Both kinds of case were met many times.
    assert!(exact > 500 && tried - exact > 500, "{exact} of {tried}");
}

/// The size of a spec whose sets' elements alone changed, from the size before, is its JSON's
/// length, whatever the sets lose or gain; anything else changed, or a set emptied or filled
/// (its field written or not), is left to measuring.
#[test]
fn a_size_by_difference_is_the_length_of_the_json() {
    let mut before = spec(vec![
        set("a", 40, false),
        set("b", 7, true),
        set("c", 300, false),
    ]);
    before.table.chains = vec![api::Chain {
        name: Some("c".into()),
        ..Default::default()
    }];
    let mut size = json_len(&before);
    let mut x: u32 = 7;
    for round in 0..300 {
        let mut after = before.clone();
        // One or two sets lose, gain or replace elements (never all of them).
        for _ in 0..=(round % 2) {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let s = &mut after.table.sets[(x >> 8) as usize % 3];
            match (x >> 16) % 3 {
                0 if s.elements.len() > 1 => {
                    s.elements.pop();
                }
                1 => s.elements.push(api::SetElement {
                    key: format!("10.200.{}.{}", (x >> 4) & 255, x & 255),
                    data: None,
                }),
                _ => s.elements[0].key = format!("10.9.{}.1-10.9.{}.9", x & 255, x & 255),
            }
        }
        let known = size_after(&before, size, &after);
        assert_eq!(known, Some(json_len(&after)), "round {round}");
        // The next round's size is this one's by difference: errors would add up.
        size = known.unwrap_or_default();
        before = after;
    }
    // A set emptied, a chain changed, a set's flag changed: measured whole.
    let mut emptied = before.clone();
    emptied.table.sets[0].elements.clear();
    assert_eq!(size_after(&before, size, &emptied), None);
    let mut chain = before.clone();
    chain.table.chains[0].priority = Some(5);
    assert_eq!(size_after(&before, size, &chain), None);
    let mut flag = before.clone();
    flag.table.sets[1].from_address_sets = true;
    assert_eq!(size_after(&before, size, &flag), None);
    assert_eq!(size_after(&before, size, &before.clone()), Some(size));
}
