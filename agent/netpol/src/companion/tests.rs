//! The companions judged as a CNI sees them: the ClusterNetworkPolicies' Admin accepts of
//! remote pods (the NetworkPolicies' own companions: `crate::tests`).

use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::cnp::{Action, ClusterNetworkPolicy, Peer, Subject, Tier};
use crate::eval::{decide, Flow};
use crate::testing::*;
use crate::*;

/// Whether a rule of `c`'s ClusterNetworkPolicies in one direction can match `addr` as a bare
/// address, as a CNI sees a remote pod: a `networks` peer covering it, or a peer the reference
/// fails closed on (it matches everything in a `Deny` or `Pass`). Those can refuse at the CNI
/// what the Admin tier accepted for the remote pod, and no NetworkPolicy companion can undo it.
fn bare_address_rule(c: &Cluster, egress: bool, addr: std::net::IpAddr) -> bool {
    c.cluster_policies.iter().any(|p| {
        let rules = if egress { &p.egress } else { &p.ingress };
        rules.iter().flat_map(|r| &r.peers).any(|peer| match peer {
            Peer::Networks(nets) => nets.iter().any(|n| n.contains(&addr)),
            Peer::Unsupported(_) => true,
            _ => false,
        })
    })
}

#[test]
fn companions_let_a_cni_enforcing_cluster_policies_allow_what_the_admin_tier_accepts() {
    let mut rng = StdRng::seed_from_u64(3290);
    let (mut compared, mut needed, mut skipped) = (0, 0, 0);
    for _ in 0..400 {
        let mut c = random_cluster(&mut rng);
        c.cluster_policies = random_cluster_policies(&mut rng);
        // The CNI with the companions, and without any.
        let cni = crate::tests::cni_view(&c);
        let mut bare = c.clone();
        bare.pods.retain(|p| p.peer.is_none());
        for local in c.pods.iter().filter(|p| p.peer.is_none()) {
            for remote in c.pods.iter().filter(|p| p.peer.is_some()) {
                for (proto, dport) in PROBES {
                    let dport = if proto == 1 { 0 } else { dport };
                    for egress in [false, true] {
                        let (src, dst) = if egress {
                            (local, remote)
                        } else {
                            (remote, local)
                        };
                        let full = Flow {
                            src: src.ips[0],
                            dst: dst.ips[0],
                            proto,
                            dport,
                            src_pod: Some(src),
                            dst_pod: Some(dst),
                        };
                        // The CNI sees the remote pod as the address this cluster gives it.
                        let seen = Flow {
                            src: if egress {
                                local.ips[0]
                            } else {
                                remote.local_ips()[0]
                            },
                            dst: if egress {
                                remote.local_ips()[0]
                            } else {
                                local.ips[0]
                            },
                            src_pod: if egress { Some(local) } else { None },
                            dst_pod: if egress { None } else { Some(local) },
                            ..full
                        };
                        let side = |d: crate::eval::Decision| {
                            if egress {
                                d.egress.allows()
                            } else {
                                d.ingress.allows()
                            }
                        };
                        if !side(decide(&c, &full)) {
                            continue;
                        }
                        if bare_address_rule(&c, egress, remote.local_ips()[0]) {
                            skipped += 1;
                            continue;
                        }
                        assert!(
                            side(decide(&cni, &seen)),
                            "{} -> {} {proto}/{dport}: the semantics allow, the CNI with the companions refuses\n{:#?}\n{:#?}",
                            src.key(),
                            dst.key(),
                            c.cluster_policies,
                            cni.policies
                        );
                        needed += usize::from(!side(decide(&bare, &seen)));
                        compared += 1;
                    }
                }
            }
        }
    }
    // The companions were needed (the CNI without them refused) in enough cases to count, and
    // the cases left out for a bare-address rule are a minority.
    eprintln!("needed {needed} compared {compared} skipped {skipped}");
    assert!(needed > 100, "{needed}");
    assert!(compared > 10_000, "{compared}");
    assert!(skipped < compared, "{skipped} of {compared}");
}

#[test]
fn a_companion_selects_only_pods_a_networkpolicy_already_isolates() {
    // x's pods isolated for ingress (from y/a on TCP 80); an Admin accept of every remote pod of
    // namespace y for x's pods labelled pod=a.
    let mut c = cluster(vec![np_x_from_ya()]);
    let mut p = ClusterNetworkPolicy {
        name: "remote-y".into(),
        tier: Tier::Admin,
        priority: 5,
        subject: Subject::Pods {
            namespaces: sel(&[("ns", "x")]),
            pods: sel(&[("pod", "a")]),
        },
        ingress: Vec::new(),
        egress: Vec::new(),
    };
    p.ingress.push(from_ns(Action::Accept, "y"));
    // An egress accept for the same pods: x's policy does not isolate egress, so no companion.
    p.egress.push(from_ns(Action::Accept, "y"));
    c.cluster_policies.push(p);
    let (all, too_large) = super::companions(&c, |_| false);
    assert!(too_large.is_empty());
    let ours: Vec<_> = all
        .iter()
        .filter(|x| {
            x.object["metadata"]["labels"][super::admin::COMPANION_OF_CLUSTER_POLICY] == "remote-y"
        })
        .collect();
    assert_eq!(ours.len(), 1, "{all:#?}");
    let o = &ours[0].object;
    assert_eq!(ours[0].owner, "from-ya");
    assert_eq!(o["metadata"]["namespace"], "x");
    assert_eq!(o["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    assert_eq!(
        o["spec"]["podSelector"],
        serde_json::json!({"matchLabels": {"pod": "a"}})
    );
    let remote_y: Vec<String> = c
        .pods
        .iter()
        .filter(|p| p.peer.is_some() && p.namespace == "y")
        .map(|p| format!("{}/32", p.local_ips()[0]))
        .collect();
    assert!(!remote_y.is_empty());
    let listed: Vec<&str> = o["spec"]["ingress"][0]["from"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["ipBlock"]["cidr"].as_str().unwrap())
        .collect();
    assert_eq!(listed, remote_y);
    // Subjects that cannot meet the NetworkPolicy's pods give none: another namespace, or a
    // pod label the policy's selector excludes.
    for subject in [
        Subject::Namespaces(sel(&[("ns", "z")])),
        Subject::Pods {
            namespaces: sel(&[("ns", "x")]),
            pods: sel(&[("pod", "a")]),
        },
    ] {
        let mut c2 = c.clone();
        c2.cluster_policies[0].subject = subject.clone();
        if let Subject::Pods { .. } = subject {
            std::sync::Arc::make_mut(&mut c2.policies[0]).pod_selector = sel(&[("pod", "b")]);
        }
        let (all, _) = super::companions(&c2, |_| false);
        assert!(
            all.iter().all(|x| x.object["metadata"]["labels"]
                [super::admin::COMPANION_OF_CLUSTER_POLICY]
                .is_null()),
            "{subject:?}: {all:#?}"
        );
    }
}

/// The remote pods a rule's pod peers select, looked for by namespace ([`RemotePods`]), are
/// exactly those a scan of every pod of the cluster finds, in the cluster's order: random
/// clusters, every rule of every policy, from each policy's namespace and from another.
#[test]
fn remote_pods_by_namespace_are_those_a_scan_of_every_pod_finds() {
    use crate::companion::RemotePods;
    let mut rng = StdRng::seed_from_u64(5521);
    let (mut rules, mut found) = (0, 0);
    for _ in 0..400 {
        let c = random_cluster(&mut rng);
        let remote = RemotePods::of(&c);
        for p in &c.policies {
            let all = p.ingress.iter().chain(&p.egress).flatten();
            for rule in all {
                for ns in [p.namespace.as_str(), "y", "absent"] {
                    let scan: Vec<&Pod> = c
                        .pods
                        .iter()
                        .map(|p| &**p)
                        .filter(|p| p.peer.is_some())
                        .filter(|p| {
                            rule.peers.iter().any(|peer| {
                                matches!(peer, crate::Peer::Pods { .. })
                                    && c.peer_selects_pod(ns, peer, p)
                            })
                        })
                        .collect();
                    let indexed = remote.selected_by(&c, ns, rule);
                    assert_eq!(
                        indexed.iter().map(|p| p.key()).collect::<Vec<_>>(),
                        scan.iter().map(|p| p.key()).collect::<Vec<_>>(),
                        "rule {rule:?} of a policy in {ns}"
                    );
                    rules += 1;
                    found += usize::from(!scan.is_empty());
                }
            }
        }
    }
    // The comparison meant something: many rules, and many that select remote pods.
    assert!(
        rules > 1000 && found > 200,
        "{rules} rules, {found} selecting"
    );
}
