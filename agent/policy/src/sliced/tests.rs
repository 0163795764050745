use super::*;
use crate::compile;
use peerwall_intent::AddressSetSpec;
use proptest::prelude::*;

const FWC: &str = r#"
apiVersion: peerwall.io/v1alpha1
kind: FirewallConfiguration
metadata: {name: gw, namespace: tenant}
spec:
  table:
    name: gw
    family: INET
    sets:
    - name: pods
      keyType: ipv4_addr
      fromAddressSets: true
      elements: [{key: 10.0.0.1}]
    - name: fixed
      keyType: ipv4_addr
      elements: [{key: 10.9.0.1}]
    chains:
    - name: fwd
      type: filter
      hook: forward
      priority: 0
      policy: drop
      rules:
        filterRules:
        - name: to_pods
          match: [{op: eq, ip: {value: "@pods", position: dst}}]
          action: accept
"#;

fn compiled() -> Compiled {
    compile::compile(&peerwall_intent::load::parse_documents(FWC, "t").unwrap()).unwrap()
}

fn slice(name: &str, set: &str, addrs: &[&str]) -> CheckedSlice {
    check_slice(&AddressSetObject {
        origin: Origin(format!("tenant/{name}")),
        namespace: "tenant".into(),
        spec: AddressSetSpec {
            firewall_configuration: "gw".into(),
            set: set.into(),
            addresses: addrs.iter().map(|s| s.to_string()).collect(),
        },
    })
    .unwrap()
}

fn members(s: &Sliced) -> Vec<String> {
    s.policy().addr_set("gw", "pods").unwrap().nft_elements()
}

#[test]
fn slices_fill_the_set_they_name() {
    let (s, issues) = Sliced::new(
        compiled(),
        &[
            slice("a", "pods", &["10.0.1.1", "10.0.1.3"]),
            slice("b", "pods", &["10.0.2.1"]),
            slice("c", "fixed", &["10.0.3.1"]),
            slice("d", "nope", &["10.0.3.1"]),
        ],
    );
    assert_eq!(
        members(&s),
        ["10.0.0.1", "10.0.1.1", "10.0.1.3", "10.0.2.1"]
    );
    assert!(matches!(
        issues.get(&Origin("tenant/c".into())),
        Some(SliceIssue::NotFromSlices { .. })
    ));
    assert!(matches!(
        issues.get(&Origin("tenant/d".into())),
        Some(SliceIssue::NoSet { .. })
    ));
    let six = slice("e", "pods", &["fd00::1"]);
    let (_, issues) = Sliced::new(compiled(), &[six]);
    assert_eq!(
        issues.values().next().unwrap().to_string(),
        "spec.addresses: IPv6 addresses, but set \"pods\" of tenant/gw holds IPv4 ones"
    );
}

#[test]
fn one_address_changed_is_one_element_changed() {
    let (mut s, _) = Sliced::new(compiled(), &[slice("a", "pods", &["10.0.1.1", "10.0.1.3"])]);
    let (changes, issue) = s.update(
        &Origin("tenant/a".into()),
        Some(&slice("a", "pods", &["10.0.1.1", "10.0.1.3", "10.0.1.9"])),
    );
    assert!(issue.is_none());
    assert_eq!(changes.len(), 1);
    assert_eq!(changes[0].set, "pods");
    assert!(changes[0].edit.removed.is_empty());
    assert_eq!(changes[0].edit.added.len(), 1);
}

#[test]
fn an_address_moving_between_slices_never_leaves_the_set() {
    let (mut s, _) = Sliced::new(
        compiled(),
        &[slice("a", "pods", &["10.0.1.1"]), slice("b", "pods", &[])],
    );
    // Joins b first, leaves a after: no change at all in between.
    let (c1, _) = s.update(
        &Origin("tenant/b".into()),
        Some(&slice("b", "pods", &["10.0.1.1"])),
    );
    let (c2, _) = s.update(&Origin("tenant/a".into()), Some(&slice("a", "pods", &[])));
    assert!(c1.is_empty() && c2.is_empty(), "{c1:?} {c2:?}");
    assert!(members(&s).contains(&"10.0.1.1".to_string()));
    // Listed inline too: deleting its last slice keeps it.
    let (c3, _) = s.update(
        &Origin("tenant/b".into()),
        Some(&slice("b", "pods", &["10.0.0.1"])),
    );
    assert_eq!(c3.len(), 1, "10.0.1.1 left: {c3:?}");
    let (c4, _) = s.update(&Origin("tenant/b".into()), None);
    assert!(c4.is_empty(), "{c4:?}");
    assert!(members(&s).contains(&"10.0.0.1".to_string()));
    assert!(!members(&s).contains(&"10.0.1.1".to_string()));
}

#[test]
fn a_bad_slice_names_the_field_and_value() {
    let e = check_slice(&AddressSetObject {
        origin: Origin("tenant/x".into()),
        namespace: "tenant".into(),
        spec: AddressSetSpec {
            firewall_configuration: "gw".into(),
            set: "pods".into(),
            addresses: vec!["10.0.0.1".into(), "10.0.0.300".into(), "fd00::1".into()],
        },
    })
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "tenant/x: spec.addresses[1]: \"10.0.0.300\" is not an address, CIDR or range\ntenant/x: spec.addresses[2]: \"fd00::1\" mixes IPv4 and IPv6 values in one match"
    );
    let many = AddressSetObject {
        origin: Origin("tenant/y".into()),
        namespace: "tenant".into(),
        spec: AddressSetSpec {
            firewall_configuration: "gw".into(),
            set: "pods".into(),
            addresses: (0..1001)
                .map(|i| format!("10.1.{}.{}", i / 250, i % 250))
                .collect(),
        },
    };
    assert!(check_slice(&many)
        .unwrap_err()
        .to_string()
        .contains("spec.addresses: 1001 addresses; an AddressSet holds at most 1000"));
}

proptest! {
    // Slice by slice equals all at once: whatever sequence of slice writes and deletions
    // (overlapping CIDRs, moves between slices and sets included), the policy kept up to date
    // incrementally equals the one merged from scratch, and replaying the reported changes on
    // the kernel's view of each set gives its contents.
    #[test]
    fn incremental_equals_from_scratch(steps in proptest::collection::vec(
        (0usize..3, any::<bool>(), proptest::collection::vec((0u8..12, prop_oneof![Just(32u8), Just(30u8)]), 0..5)),
        1..25,
    )) {
        let (mut s, _) = Sliced::new(compiled(), &[]);
        let mut kernel: std::collections::BTreeSet<AddrRange> =
            s.policy().addr_set("gw", "pods").unwrap().ranges().iter().copied().collect();
        let mut current: BTreeMap<usize, CheckedSlice> = BTreeMap::new();
        for (which, delete, addrs) in steps {
            let name = format!("s{which}");
            let origin = Origin(format!("tenant/{name}"));
            let texts: Vec<String> = addrs.iter().map(|(h, len)| format!("10.0.0.{}/{len}", h * 4)).collect();
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            let next = (!delete).then(|| slice(&name, "pods", &refs));
            let (changes, issue) = s.update(&origin, next.as_ref());
            prop_assert!(issue.is_none());
            for c in changes {
                for r in &c.edit.removed { prop_assert!(kernel.remove(r)); }
                for r in &c.edit.added { prop_assert!(kernel.insert(*r)); }
            }
            match next { Some(n) => { current.insert(which, n); } None => { current.remove(&which); } }
            let all: Vec<CheckedSlice> = current.values().cloned().collect();
            let (fresh, _) = Sliced::new(compiled(), &all);
            prop_assert_eq!(s.policy(), fresh.policy());
            prop_assert_eq!(
                kernel.iter().copied().collect::<Vec<_>>(),
                s.policy().addr_set("gw", "pods").unwrap().ranges().to_vec()
            );
        }
    }
}

/// [`FWC`] with `fixed` holding `elements` and a rule testing it (so the rule holds a copy).
fn with_fixed(elements: &[String]) -> Compiled {
    let elems: String = elements
        .iter()
        .map(|e| format!("{{key: \"{e}\"}},"))
        .collect();
    let doc = FWC
        .replace("elements: [{key: 10.9.0.1}]", &format!("elements: [{elems}]"))
        .replace(
            "          action: accept\n",
            "          action: accept\n        - name: from_fixed\n          match: [{op: eq, ip: {value: \"@fixed\", position: src}}]\n          action: accept\n",
        );
    compile::compile(&peerwall_intent::load::parse_documents(&doc, "t").unwrap()).unwrap()
}

proptest! {
    /// An inline set edited in place ends as the whole compilation of the new objects would
    /// have it, the rule's copy included, and the changes turn the old contents into the new.
    #[test]
    fn inline_elements_replaced_in_place_equal_a_full_compilation(
        old in proptest::collection::vec(0u8..12, 1..8),
        new in proptest::collection::vec(0u8..12, 1..8),
    ) {
        let item = |k: &u8| match k {
            0..=7 => format!("10.9.0.{k}"),
            8 => "10.9.0.0/30".to_string(),
            9 => "10.9.0.4-10.9.0.6".to_string(),
            _ => format!("10.9.1.{k}"),
        };
        let old: Vec<String> = old.iter().map(item).collect();
        let new: Vec<String> = new.iter().map(item).collect();
        let slices = [slice("a", "pods", &["10.0.1.1"])];
        let (mut s, _) = Sliced::new(with_fixed(&old), &slices);
        let before = s.policy().addr_set("gw", "fixed").unwrap().clone();
        let changes = s
            .replace_inline(&with_fixed(&new), &[(Origin("tenant/gw".into()), "fixed".into())])
            .unwrap();
        let (full, _) = Sliced::new(with_fixed(&new), &slices);
        prop_assert_eq!(s.policy(), full.policy());
        // The changes, applied to the old contents, give the new.
        let mut ranges: std::collections::BTreeSet<AddrRange> = before.ranges().iter().copied().collect();
        for c in &changes {
            for r in &c.edit.removed {
                prop_assert!(ranges.remove(r));
            }
            ranges.extend(c.edit.added.iter().copied());
        }
        let want: Vec<AddrRange> = full.policy().addr_set("gw", "fixed").unwrap().ranges().to_vec();
        prop_assert_eq!(ranges.into_iter().collect::<Vec<_>>(), want);
    }
}

#[test]
fn a_set_slices_fill_is_not_replaced_inline() {
    let (mut s, _) = Sliced::new(compiled(), &[]);
    assert_eq!(
        s.replace_inline(&compiled(), &[(Origin("tenant/gw".into()), "pods".into())]),
        None
    );
}

#[test]
fn a_slice_count_on_a_set_that_takes_no_slices_is_refused_naming_the_field() {
    let bad = FWC.replace(
        "      elements: [{key: 10.9.0.1}]",
        "      elements: [{key: 10.9.0.1}]\n      addressSets: 2",
    );
    assert_ne!(bad, FWC);
    let err = compile::compile(&peerwall_intent::load::parse_documents(&bad, "t").unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("spec.table.sets[1].addressSets") && err.contains("2: counts"),
        "{err}"
    );
    // On the set that takes slices it is accepted.
    let good = FWC.replace(
        "      fromAddressSets: true\n",
        "      fromAddressSets: true\n      addressSets: 2\n",
    );
    assert_ne!(good, FWC);
    let c = compile::compile(&peerwall_intent::load::parse_documents(&good, "t").unwrap());
    assert!(c.is_ok());
}

#[test]
fn a_configuration_waits_until_its_declared_slices_are_there() {
    let yaml = FWC.replace(
        "      fromAddressSets: true\n",
        "      fromAddressSets: true\n      addressSets: 2\n",
    );
    let obj = peerwall_intent::load::parse_documents(&yaml, "t")
        .unwrap()
        .remove(0);
    let key = obj.origin.0.clone();
    assert_eq!(key, "tenant/gw");
    let one = [slice("s1", "pods", &["10.0.0.2"])];
    let why = waiting_for_slices(&key, &obj, &slice_counts(&one)).unwrap();
    assert!(
        why.contains(
            r#"spec.table.sets[0] ("pods"): 2 AddressSets declared (addressSets), 1 seen"#
        ),
        "{why}"
    );
    // A slice of another set does not count for this one.
    let other = [
        slice("s1", "pods", &["10.0.0.2"]),
        slice("s2", "fixed", &[]),
    ];
    assert!(waiting_for_slices(&key, &obj, &slice_counts(&other)).is_some());
    let two = [slice("s1", "pods", &["10.0.0.2"]), slice("s2", "pods", &[])];
    assert_eq!(waiting_for_slices(&key, &obj, &slice_counts(&two)), None);
}
