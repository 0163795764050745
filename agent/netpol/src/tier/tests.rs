//! The tier's structure under label changes: a pod entering or leaving selectors changes the
//! elements of the sets those selectors define, never the sets' names or the chains, so the
//! backends apply it as element changes.

use std::collections::BTreeSet;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::super::testing::*;
use super::tier;
use crate::Cluster;

fn names(t: &peerwall_intent::types::Table) -> BTreeSet<String> {
    t.sets.iter().map(|s| s.name.clone()).collect()
}

#[test]
fn a_relabelled_pod_changes_set_elements_and_nothing_else() {
    let mut rng = StdRng::seed_from_u64(58);
    let (mut tries, mut same_sets, mut elements_changed) = (0, 0, 0);
    for round in 0..400 {
        let mut c = random_cluster(&mut rng);
        if round % 2 == 0 {
            c.cluster_policies = random_cluster_policies(&mut rng);
        }
        with_replicas(&mut c, None);
        let before = tier(&c, "peer1", false).spec.table;
        let k = rng.random_range(0..c.pods.len());
        let was = c.pods[k].labels.get("pod").cloned().unwrap_or_default();
        let others: Vec<&str> = ["a", "b", "c"].into_iter().filter(|v| *v != was).collect();
        let to = others[rng.random_range(0..others.len())];
        std::sync::Arc::make_mut(&mut c.pods[k])
            .labels
            .insert("pod".into(), to.into());
        let after = tier(&c, "peer1", false).spec.table;
        tries += 1;
        // A selector emptied or filled adds or removes its sets and the rules over them.
        if names(&before) != names(&after) {
            continue;
        }
        same_sets += 1;
        assert_eq!(
            serde_json::to_value(&before.chains).unwrap(),
            serde_json::to_value(&after.chains).unwrap(),
            "pod {} relabelled pod={to}: the chains changed with the same sets",
            c.pods[k].key()
        );
        if before.sets != after.sets {
            elements_changed += 1;
        }
    }
    // Most relabels keep every set (the name follows the definition, not the contents or the
    // sharing of equal contents), and many of them move addresses between sets.
    assert!(
        same_sets * 10 >= tries * 7 && elements_changed * 4 >= same_sets,
        "{tries} relabels: {same_sets} kept every set, {elements_changed} of them changed elements"
    );
}

#[test]
fn a_set_is_named_by_its_selector_not_by_its_policys_place() {
    let mut c = random_cluster(&mut StdRng::seed_from_u64(3));
    let before = names(&tier(&c, "peer1", false).spec.table);
    // A policy sorting before every other, selecting nothing here: every other name stays.
    let mut p = policy("a-first", "np", sel(&[("pod", "nobody")]));
    p.ingress = Some(vec![]);
    c.policies.push(std::sync::Arc::new(p));
    let after = names(&tier(&c, "peer1", false).spec.table);
    assert!(!before.is_empty());
    assert_eq!(before, after);
}

/// Each chain's rules by what decides a packet (matches, action, value) as JSON: how rules
/// were told apart before they were compared as values.
fn rule_keys(t: &peerwall_intent::types::Table) -> Vec<Vec<String>> {
    t.chains
        .iter()
        .map(|c| {
            c.rules
                .filter_rules
                .iter()
                .flatten()
                .map(|r| serde_json::to_string(&(&r.r#match, &r.action, &r.value)).unwrap())
                .collect()
        })
        .collect()
}

#[test]
fn a_rule_repeating_an_earlier_one_is_left_out_and_only_it() {
    let mut repeats = 0;
    for seed in 0..40 {
        let c = random_cluster(&mut StdRng::seed_from_u64(seed));
        // Every policy again under another name: the same rules over the same sets.
        let mut twice = c.clone();
        for p in &c.policies {
            let mut again = (**p).clone();
            again.name = format!("{}-again", again.name);
            twice.policies.push(std::sync::Arc::new(again));
        }
        let once = rule_keys(&tier(&c, "peer1", false).spec.table);
        let both = rule_keys(&tier(&twice, "peer1", false).spec.table);
        for (a, b) in once.iter().zip(&both) {
            let distinct: BTreeSet<&String> = b.iter().collect();
            assert_eq!(distinct.len(), b.len(), "seed {seed}: a repeated rule kept");
            assert_eq!(
                a.iter().collect::<BTreeSet<_>>(),
                distinct,
                "seed {seed}: the rules of both differ"
            );
            repeats += a.len();
        }
    }
    assert!(
        repeats > 100,
        "the clusters repeat too few rules: {repeats}"
    );
}

/// One random change of `c`'s pods: a relabel (to another pod's labels, another value, labels
/// of its own), a replica created beside a pod, a pod deleted, a new address, an IPv6 address
/// added.
fn change_pods(c: &mut Cluster, rng: &mut StdRng, n: &mut u32) -> &'static str {
    use std::sync::Arc;
    let k = rng.random_range(0..c.pods.len());
    *n += 1;
    let fresh = std::net::IpAddr::from([10, 99, (*n / 250) as u8, (*n % 250 + 1) as u8]);
    match rng.random_range(0..9) {
        0 => {
            let other = c.pods[rng.random_range(0..c.pods.len())].labels.clone();
            Arc::make_mut(&mut c.pods[k]).labels = other;
            "relabelled like another pod"
        }
        1 => {
            let v = ["a", "b", "c"][rng.random_range(0..3)];
            Arc::make_mut(&mut c.pods[k])
                .labels
                .insert("pod".into(), v.into());
            "relabelled"
        }
        2 => {
            let mut r = (*c.pods[k]).clone();
            r.name = format!("{}-r{n}", r.name);
            r.ips = vec![fresh];
            let at = rng.random_range(0..=c.pods.len());
            c.pods.insert(at, Arc::new(r));
            "a replica created"
        }
        3 if c.pods.len() > 1 => {
            c.pods.remove(k);
            "deleted"
        }
        4 => {
            Arc::make_mut(&mut c.pods[k]).ips = vec![fresh];
            "given another address"
        }
        5 => {
            Arc::make_mut(&mut c.pods[k])
                .ips
                .push(format!("fd00::{n}").parse().unwrap());
            "given an IPv6 address"
        }
        6 | 7 => {
            // Labels no other pod has: a class of its own (a policy's pods, or only a far
            // end's: the `pod` label kept, another one added).
            let p = Arc::make_mut(&mut c.pods[k]);
            if rng.random_bool(0.5) {
                p.labels.insert("pod".into(), format!("u{n}"));
            } else {
                p.labels.insert("canary".into(), format!("u{n}"));
            }
            "relabelled to labels of its own"
        }
        _ => "left alone",
    }
}

/// The tier by difference is the tier computed whole, after every random change of pods, over
/// random clusters (replicas, ClusterNetworkPolicies, remapped CIDRs); and it is taken often.
#[test]
fn the_tier_by_difference_is_the_tier_computed_whole() {
    use super::{How, Kept};
    let mut rng = StdRng::seed_from_u64(55);
    let (mut steps, mut by_difference, mut unchanged, mut n) = (0, 0, 0, 0);
    for round in 0..300 {
        let mut c = random_cluster(&mut rng);
        if round % 2 == 0 {
            c.cluster_policies = random_cluster_policies(&mut rng);
        }
        with_replicas(&mut c, Some(&mut rng));
        if round % 5 == 0 {
            c.remaps.insert(
                "peer1".into(),
                vec![crate::Remap {
                    real: "10.1.0.0/16".parse().unwrap(),
                    seen: "10.71.0.0/16".parse().unwrap(),
                }],
            );
        }
        let mut kept = Kept::compute(&c, "peer1", false);
        for _ in 0..6 {
            let mut what = Vec::new();
            for _ in 0..rng.random_range(1..3) {
                what.push(change_pods(&mut c, &mut rng, &mut n));
            }
            kept = kept.next(&c, "peer1", false);
            let whole = tier(&c, "peer1", false);
            steps += 1;
            match kept.how() {
                How::ByDifference { .. } => by_difference += 1,
                How::Unchanged => unchanged += 1,
                How::Computed => {}
            }
            assert_eq!(
                **kept.spec(),
                whole.spec,
                "round {round}, {what:?}: made {}",
                kept.how()
            );
            assert_eq!(kept.unenforced(), whole.unenforced.as_slice());
        }
    }
    assert!(
        by_difference * 4 >= steps && unchanged > 0,
        "{steps} changes: {by_difference} by difference, {unchanged} unchanged"
    );
}

/// The chains' names of `c`'s tier for peer1.
fn chain_names(c: &Cluster) -> Vec<String> {
    tier(c, "peer1", false)
        .spec
        .table
        .chains
        .iter()
        .map(|ch| ch.name.clone().unwrap_or_default())
        .collect()
}

#[test]
fn a_direction_no_policy_applies_to_has_no_chain() {
    // No policy: nothing to walk.
    assert!(chain_names(&cluster(Vec::new())).is_empty());
    // Ingress only: the egress chain would hold the replies rule alone.
    let mut c = cluster(vec![np_x_from_ya()]);
    assert_eq!(chain_names(&c), ["ingress"]);
    // A policy whose egress selects no crossing pod adds no chain either.
    let mut nobody = policy("x", "nobody", sel(&[("pod", "nobody")]));
    nobody.egress = Some(Vec::new());
    c.policies.push(std::sync::Arc::new(nobody));
    assert_eq!(chain_names(&c), ["ingress"]);
    // Egress isolation of one pod: the chain is back, with its drop.
    let mut deny = policy("z", "deny-egress", sel(&[("pod", "a")]));
    deny.egress = Some(Vec::new());
    c.policies.push(std::sync::Arc::new(deny));
    assert_eq!(chain_names(&c), ["ingress", "egress"]);
    // An Admin ClusterNetworkPolicy's egress rule alone makes the egress chain too.
    let mut admin = cluster(Vec::new());
    admin.cluster_policies = vec![crate::cnp::ClusterNetworkPolicy {
        name: "no-y".into(),
        tier: crate::cnp::Tier::Admin,
        priority: 10,
        subject: crate::cnp::Subject::Namespaces(sel(&[("ns", "x")])),
        ingress: Vec::new(),
        egress: vec![from_ns(crate::cnp::Action::Deny, "y")],
    }];
    assert_eq!(chain_names(&admin), ["egress"]);
}
