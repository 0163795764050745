//! ClusterNetworkPolicy semantics as data (cases after the API reference and the
//! network-policy-api conformance suite's scenarios: tier order, priorities, Pass, fail closed),
//! reading with field paths, and the gateway tier held to the semantics on random clusters.

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::{Action, ClusterNetworkPolicy, Peer, Rule as CnpRule, Subject, Tier};
use crate::eval::{decide, Side};
use crate::testing::*;
use crate::*;

fn cnp(name: &str, tier: Tier, priority: u32, subject: Subject) -> ClusterNetworkPolicy {
    ClusterNetworkPolicy {
        name: name.into(),
        tier,
        priority,
        subject,
        ingress: Vec::new(),
        egress: Vec::new(),
    }
}

fn ns_subject(ns: &str) -> Subject {
    Subject::Namespaces(sel(&[("ns", ns)]))
}

fn allowed(c: &Cluster, from: &str, to: &str) -> bool {
    decide(c, &flow(c, from, to, 6, 80)).allowed()
}

#[test]
fn admin_deny_overrides_a_networkpolicy_that_allows() {
    let mut c = cluster(vec![np_x_from_ya()]);
    assert!(allowed(&c, "y/a", "x/a"));
    let mut deny = cnp("no-y", Tier::Admin, 10, ns_subject("x"));
    deny.ingress = vec![from_ns(Action::Deny, "y")];
    c.cluster_policies.push(deny);
    assert!(!allowed(&c, "y/a", "x/a"));
    let d = decide(&c, &flow(&c, "y/a", "x/a", 6, 80));
    assert_eq!(
        d.ingress,
        Side::Cluster {
            tier: Tier::Admin,
            policy: "no-y".into(),
            rule: 0,
            accept: false
        }
    );
}

#[test]
fn admin_accept_opens_what_a_networkpolicy_isolates() {
    let mut c = cluster(vec![np_x_from_ya()]);
    assert!(!allowed(&c, "y/b", "x/a"), "the NetworkPolicy isolates x");
    let mut open = cnp("y-in", Tier::Admin, 10, ns_subject("x"));
    open.ingress = vec![from_ns(Action::Accept, "y")];
    c.cluster_policies.push(open);
    assert!(allowed(&c, "y/b", "x/a"));
    // Egress Accept decides the source's side only: the destination's ingress still applies.
    let mut c = cluster(vec![np_x_from_ya()]);
    let mut out = cnp("y-out", Tier::Admin, 10, ns_subject("y"));
    out.egress = vec![from_ns(Action::Accept, "x")];
    c.cluster_policies.push(out);
    assert!(!allowed(&c, "y/b", "x/a"));
}

#[test]
fn pass_skips_the_rest_of_its_tier_and_the_networkpolicies_decide() {
    let mut c = cluster(vec![np_x_from_ya()]);
    let mut pass = cnp("pass-y", Tier::Admin, 1, ns_subject("x"));
    pass.ingress = vec![from_ns(Action::Pass, "y")];
    let mut deny = cnp("deny-all", Tier::Admin, 2, ns_subject("x"));
    deny.ingress = vec![from_ns(Action::Deny, "y"), from_ns(Action::Deny, "z")];
    c.cluster_policies.extend([pass, deny]);
    // Passed: the NetworkPolicy allows y/a, isolates the rest.
    assert!(allowed(&c, "y/a", "x/a"));
    assert!(!allowed(&c, "y/b", "x/a"));
    // Not passed (z): the later Deny applies.
    assert!(!allowed(&c, "z/a", "x/a"));
}

#[test]
fn baseline_decides_only_where_no_networkpolicy_isolates() {
    let mut np = policy("x", "a-from-ya", sel(&[("pod", "a")]));
    np.ingress = np_x_from_ya().ingress;
    let mut c = cluster(vec![np]);
    let mut base = cnp("default-deny", Tier::Baseline, 0, ns_subject("x"));
    base.ingress = vec![from_ns(Action::Deny, "y")];
    c.cluster_policies.push(base);
    // x/a is isolated by the NetworkPolicy, which allows y/a: Baseline is not consulted.
    assert!(allowed(&c, "y/a", "x/a"));
    // x/b is not isolated: Baseline denies.
    assert!(!allowed(&c, "y/a", "x/b"));
    // A Baseline Pass skips the rest of the tier: the default allows.
    let mut pass = cnp("a-pass", Tier::Baseline, 0, ns_subject("x"));
    pass.name = "a-pass".into();
    pass.ingress = vec![from_ns(Action::Pass, "y")];
    c.cluster_policies.push(pass);
    assert!(
        allowed(&c, "y/a", "x/b"),
        "a-pass sorts before default-deny at equal priority"
    );
}

#[test]
fn lower_priority_first_then_rule_order() {
    let mut c = cluster(Vec::new());
    let mut accept = cnp("a", Tier::Admin, 20, ns_subject("x"));
    accept.ingress = vec![from_ns(Action::Accept, "y")];
    let mut deny = cnp("b", Tier::Admin, 10, ns_subject("x"));
    deny.ingress = vec![from_ns(Action::Deny, "y")];
    c.cluster_policies.extend([accept, deny]);
    assert!(!allowed(&c, "y/a", "x/a"), "priority 10 before 20");
    let mut c = cluster(Vec::new());
    let mut both = cnp("both", Tier::Admin, 10, ns_subject("x"));
    both.ingress = vec![from_ns(Action::Accept, "y"), from_ns(Action::Deny, "y")];
    c.cluster_policies.push(both);
    assert!(allowed(&c, "y/a", "x/a"), "the first rule decides");
}

#[test]
fn a_peer_peerwall_does_not_enforce_fails_closed() {
    let unsupported = |action| CnpRule {
        name: String::new(),
        action,
        peers: vec![Peer::Unsupported(
            "spec.ingress[0].from[0].nodes: test".into(),
        )],
        ports: Vec::new(),
    };
    let mut c = cluster(Vec::new());
    let mut accept = cnp("acc", Tier::Admin, 0, ns_subject("x"));
    accept.ingress = vec![unsupported(Action::Accept)];
    let mut base = cnp("base", Tier::Baseline, 0, ns_subject("x"));
    base.ingress = vec![from_ns(Action::Deny, "y")];
    c.cluster_policies.extend([accept, base]);
    assert!(
        !allowed(&c, "y/a", "x/a"),
        "an Accept through it matches nothing"
    );
    let mut c = cluster(Vec::new());
    let mut deny = cnp("deny", Tier::Admin, 0, ns_subject("x"));
    deny.ingress = vec![unsupported(Action::Deny)];
    c.cluster_policies.push(deny);
    assert!(
        !allowed(&c, "y/a", "x/a"),
        "a Deny through it matches everything"
    );
    assert!(!allowed(&c, "z/a", "x/a"));
}

#[test]
fn the_tier_gives_the_semantics_verdict_with_cluster_policies() {
    let mut rng = StdRng::seed_from_u64(57);
    let (mut checked, mut decided) = (0, 0);
    for _ in 0..250 {
        let mut c = random_cluster(&mut rng);
        if rand::Rng::random_bool(&mut rng, 0.3) {
            c.policies.clear();
        }
        c.cluster_policies = random_cluster_policies(&mut rng);
        let ir = compiled(&c);
        checked += crossing_cases(&c, &ir, |from, to, proto, dport, want, got| {
            if matches!(want.ingress, Side::Cluster { .. })
                || matches!(want.egress, Side::Cluster { .. })
            {
                decided += 1;
            }
            let accepted = got.verdict == peerwall_policy::ir::VerdictAction::Accept;
            assert_eq!(
                accepted,
                want.allowed(),
                "{} -> {} proto {proto} port {dport}: semantics {want:?}, tier {got:?}\npolicies {:#?}\ncluster policies {:#?}",
                from.key(),
                to.key(),
                c.policies,
                c.cluster_policies
            );
        });
    }
    assert!(checked > 10_000, "{checked}");
    assert!(
        decided * 10 > checked,
        "ClusterNetworkPolicies decided only {decided} of {checked}"
    );
}

#[test]
fn reading_names_the_field_and_keeps_what_it_cannot_enforce_closed() {
    let read = |spec: serde_json::Value| {
        super::read::policy_json(serde_json::json!({
            "apiVersion": "policy.networking.k8s.io/v1alpha2",
            "kind": "ClusterNetworkPolicy",
            "metadata": {"name": "p"},
            "spec": spec,
        }))
    };
    let ok = read(serde_json::json!({
        "tier": "Admin", "priority": 5,
        "subject": {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "db"}}}},
        "ingress": [{"action": "Deny", "from": [{"namespaces": {}}],
                     "protocols": [{"tcp": {"destinationPort": {"range": {"start": 80, "end": 90}}}},
                                   {"destinationNamedPort": "http"}]}],
        "egress": [{"action": "Accept", "to": [{"networks": ["10.0.0.1/8"]}, {"nodes": {}}]}],
    }))
    .unwrap();
    assert_eq!(ok.policy.tier, Tier::Admin);
    assert_eq!(
        ok.policy.ingress[0].ports.len(),
        4,
        "a range, and the named port per protocol"
    );
    assert_eq!(
        ok.policy.egress[0].peers[0],
        Peer::Networks(vec!["10.0.0.0/8".parse().unwrap()])
    );
    assert!(matches!(ok.policy.egress[0].peers[1], Peer::Unsupported(_)));
    assert_eq!(ok.unenforced.len(), 1);
    assert!(
        ok.unenforced[0].starts_with("spec.egress[0].to[1].nodes"),
        "{:?}",
        ok.unenforced
    );
    for (spec, path) in [
        (
            serde_json::json!({"tier": "admin", "priority": 1, "subject": {"namespaces": {}}}),
            "spec.tier",
        ),
        (
            serde_json::json!({"tier": "Admin", "priority": 1001, "subject": {"namespaces": {}}}),
            "spec.priority",
        ),
        (
            serde_json::json!({"tier": "Admin", "priority": 1}),
            "spec.subject",
        ),
        (
            serde_json::json!({"tier": "Admin", "priority": 1, "subject": {"namespaces": {}},
            "ingress": [{"action": "Allow", "from": [{"namespaces": {}}]}]}),
            "spec.ingress[0].action",
        ),
        (
            serde_json::json!({"tier": "Admin", "priority": 1, "subject": {"namespaces": {}},
            "egress": [{"action": "Deny", "to": [{"networks": ["10.0.0.0/33"]}]}]}),
            "spec.egress[0].to[0].networks[0]",
        ),
        (
            serde_json::json!({"tier": "Admin", "priority": 1, "subject": {"namespaces": {}},
            "ingress": [{"action": "Deny", "from": [{"namespaces": {}}],
                         "protocols": [{"udp": {"destinationPort": {"range": {"start": 90, "end": 80}}}}]}]}),
            "spec.ingress[0].protocols[0].udp.destinationPort.range",
        ),
    ] {
        let e = read(spec).unwrap_err();
        assert!(e.why.starts_with(path), "{path}: {}", e.why);
    }
}
