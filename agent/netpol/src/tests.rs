//! NetworkPolicy semantics as data (cases from the API reference and the e2e suite), and the
//! gateway tier held to them: random clusters and policies, every crossing pair and probe,
//! the tier compiled to the policy IR and judged by the reference evaluator against
//! [`eval::decide`].

use std::net::IpAddr;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::eval::{decide, Flow, Side};
use super::testing::*;
use super::Remap;
use super::*;

#[test]
fn deny_all_ingress_isolates_only_the_selected_pods() {
    let mut p = policy("x", "deny", sel(&[("pod", "a")]));
    p.ingress = Some(vec![]);
    let c = cluster(vec![p]);
    let d = decide(&c, &flow(&c, "y/a", "x/a", 6, 80));
    assert_eq!(
        d.ingress,
        Side::Denied {
            policies: vec!["x/deny".into()]
        }
    );
    assert!(decide(&c, &flow(&c, "y/a", "x/b", 6, 80)).allowed());
    // Egress of x/a is not isolated by an ingress-only policy.
    assert!(decide(&c, &flow(&c, "x/a", "y/b", 6, 80)).allowed());
}

#[test]
fn allow_all_ingress_is_an_empty_rule_not_no_rule() {
    let mut p = policy("x", "all", Selector::default());
    p.ingress = Some(vec![Rule::default()]);
    let c = cluster(vec![p]);
    assert_eq!(
        decide(&c, &flow(&c, "y/a", "x/a", 17, 53)).ingress,
        Side::Allowed {
            policy: "x/all".into(),
            rule: 0
        }
    );
}

#[test]
fn namespace_and_pod_selector_in_one_peer_is_and_in_two_peers_is_or() {
    let and_peer = Peer::Pods {
        namespaces: Some(sel(&[("ns", "y")])),
        pods: Some(sel(&[("pod", "b")])),
    };
    let mut p = policy("x", "and", Selector::default());
    p.ingress = Some(vec![Rule {
        peers: vec![and_peer],
        ports: vec![],
    }]);
    let c = cluster(vec![p]);
    assert!(decide(&c, &flow(&c, "y/b", "x/a", 6, 80)).allowed());
    assert!(!decide(&c, &flow(&c, "y/a", "x/a", 6, 80)).allowed());
    let mut p = policy("x", "or", Selector::default());
    p.ingress = Some(vec![Rule {
        peers: vec![
            Peer::Pods {
                namespaces: Some(sel(&[("ns", "y")])),
                pods: None,
            },
            Peer::Pods {
                namespaces: None,
                pods: Some(sel(&[("pod", "b")])),
            },
        ],
        ports: vec![],
    }]);
    let c = cluster(vec![p]);
    assert!(decide(&c, &flow(&c, "y/a", "x/a", 6, 80)).allowed());
    // A pod selector alone means the policy's own namespace: z/b is not x/b.
    assert!(!decide(&c, &flow(&c, "z/b", "x/a", 6, 80)).allowed());
}

#[test]
fn named_ports_resolve_against_the_destination_pod() {
    let mut p = policy("y", "named", Selector::default());
    p.ingress = Some(vec![Rule {
        peers: vec![],
        ports: vec![Port {
            protocol: Protocol::Tcp,
            ports: Ports::Named("serve-81-tcp".into()),
        }],
    }]);
    let mut c = cluster(vec![p]);
    assert!(decide(&c, &flow(&c, "x/a", "y/a", 6, 81)).allowed());
    assert!(!decide(&c, &flow(&c, "x/a", "y/a", 6, 80)).allowed());
    assert!(
        !decide(&c, &flow(&c, "x/a", "y/a", 17, 81)).allowed(),
        "UDP"
    );
    // Another pod names another number.
    let b = c.pods.iter_mut().find(|p| p.key() == "y/b").unwrap();
    std::sync::Arc::make_mut(b).ports[1].port = 8081;
    assert!(decide(&c, &flow(&c, "x/a", "y/b", 6, 8081)).allowed());
    assert!(!decide(&c, &flow(&c, "x/a", "y/b", 6, 81)).allowed());
}

#[test]
fn egress_and_ingress_must_both_allow() {
    let mut e = policy("x", "egress-to-z", sel(&[("pod", "a")]));
    e.egress = Some(vec![Rule {
        peers: vec![Peer::Pods {
            namespaces: Some(sel(&[("ns", "z")])),
            pods: None,
        }],
        ports: vec![],
    }]);
    let c = cluster(vec![e]);
    assert_eq!(
        decide(&c, &flow(&c, "x/a", "y/a", 6, 80)).egress,
        Side::Denied {
            policies: vec!["x/egress-to-z".into()]
        }
    );
    assert!(decide(&c, &flow(&c, "x/b", "y/a", 6, 80)).allowed());
}

#[test]
fn ip_blocks_cut_out_their_exceptions() {
    let b = IpBlock {
        cidr: "10.2.0.0/16".parse().unwrap(),
        except: vec!["10.2.0.2/32".parse().unwrap()],
    };
    assert!(b.contains("10.2.0.1".parse().unwrap()));
    assert!(!b.contains("10.2.0.2".parse().unwrap()));
    let ranges = tier_block_ranges(&b);
    assert_eq!(ranges, ["10.2.0.0-10.2.0.1", "10.2.0.3-10.2.255.255"]);
}

fn tier_block_ranges(b: &IpBlock) -> Vec<String> {
    // Through a policy: the far set of its only rule.
    let mut p = policy("x", "blocks", Selector::default());
    p.ingress = Some(vec![Rule {
        peers: vec![Peer::Block(b.clone())],
        ports: vec![],
    }]);
    let c = cluster(vec![p]);
    let t = tier::tier(&c, "peer1", false);
    let far = t
        .spec
        .table
        .sets
        .iter()
        .find(|s| s.name.starts_with("far_"))
        .unwrap();
    far.elements.iter().map(|e| e.key.clone()).collect()
}

#[test]
fn selectors_implement_every_operator() {
    let l = labels(&[("a", "1"), ("b", "2")]);
    let req = |key: &str, op, values: &[&str]| Selector {
        labels: BTreeMap::new(),
        exprs: vec![Requirement {
            key: key.into(),
            op,
            values: values.iter().map(|v| v.to_string()).collect(),
        }],
    };
    assert!(req("a", Operator::In, &["1", "3"]).matches(&l));
    assert!(!req("a", Operator::NotIn, &["1"]).matches(&l));
    assert!(
        req("c", Operator::NotIn, &["1"]).matches(&l),
        "absent is not in"
    );
    assert!(req("b", Operator::Exists, &[]).matches(&l));
    assert!(req("c", Operator::DoesNotExist, &[]).matches(&l));
    assert!(Selector::default().matches(&BTreeMap::new()));
}

// ---- the tier against the semantics ----

#[test]
fn the_tier_gives_the_semantics_verdict_for_every_crossing_pair() {
    let mut rng = StdRng::seed_from_u64(31);
    let mut checked = 0;
    for _ in 0..300 {
        checked += judged(&random_cluster(&mut rng));
    }
    assert!(checked > 10_000, "{checked}");
}

/// The tier's verdict against the semantics' for every crossing pair and probe of `c`; how many.
fn judged(c: &Cluster) -> usize {
    let ir = compiled(c);
    crossing_cases(c, &ir, |from, to, proto, dport, want, got| {
        let accepted = got.verdict == peerwall_policy::ir::VerdictAction::Accept;
        assert_eq!(
            accepted,
            want.allowed(),
            "{} -> {} proto {proto} port {dport}: semantics {want:?}, tier {got:?}\npolicies {:#?}",
            from.key(),
            to.key(),
            c.policies
        );
    })
}

/// peer1's CIDR `real` seen here as `seen` (Liqo's remapping).
fn remap_peer1(c: &mut Cluster, real: &str, seen: &str) {
    c.remaps.insert(
        "peer1".into(),
        vec![Remap {
            real: real.parse().unwrap(),
            seen: seen.parse().unwrap(),
        }],
    );
}

/// The same judge over replicas: pods alike in labels (one class of the tier's index) that
/// resolve a named port to different numbers, or run on different sides of the gateway (which
/// the tier tells apart where the peer has remapped CIDRs).
#[test]
fn the_tier_gives_the_semantics_verdict_for_replicas_differing_in_ports_or_side() {
    let mut rng = StdRng::seed_from_u64(37);
    let mut checked = 0;
    for _ in 0..100 {
        let mut c = random_cluster(&mut rng);
        with_replicas(&mut c, Some(&mut rng));
        // Half of them with a remapped peer CIDR (no pod in it): the tier then meets a
        // policy's local pods and its pods on the peer in rules of their own.
        if rng.random_bool(0.5) {
            remap_peer1(&mut c, "10.200.0.0/16", "10.201.0.0/16");
        }
        checked += judged(&c);
    }
    assert!(checked > 10_000, "{checked}");
}

#[test]
fn external_addresses_meet_ip_blocks_only() {
    let mut p = policy("x", "from-block", Selector::default());
    p.ingress = Some(vec![Rule {
        peers: vec![Peer::Block(IpBlock {
            cidr: "192.168.0.0/24".parse().unwrap(),
            except: vec!["192.168.0.128/25".parse().unwrap()],
        })],
        ports: vec![],
    }]);
    let c = cluster(vec![p]);
    let ir = compiled(&c);
    let dst = c.pod("x/a").unwrap();
    for (src, allowed) in [
        ("192.168.0.1", true),
        ("192.168.0.200", false),
        ("172.16.0.1", false),
    ] {
        let src: IpAddr = src.parse().unwrap();
        let f = Flow {
            src,
            dst: dst.ips[0],
            proto: 6,
            dport: 80,
            src_pod: None,
            dst_pod: Some(dst),
        };
        assert_eq!(decide(&c, &f).allowed(), allowed, "{src}");
        let pkt = peerwall_policy::ir::Packet {
            src,
            dst: dst.ips[0],
            proto: 6,
            sport: 40000,
            dport: 80,
            iif: Some("liqo-tunnel".into()),
            oif: Some("liqo.abcdefghij".into()),
            ct_state: peerwall_policy::ir::CtState::New,
        };
        let v = peerwall_policy::ir::evaluate(&ir, &pkt);
        assert_eq!(
            v.verdict == peerwall_policy::ir::VerdictAction::Accept,
            allowed,
            "{src}: {v:?}"
        );
    }
}

/// The cluster as a label-aware CNI sees it: only local pods are pods (remote ones are bare
/// addresses), and the policies are the user's plus peerwall's companions.
pub(crate) fn cni_view(c: &Cluster) -> Cluster {
    let (companions, too_large) = companion::companions(c, |_| false);
    assert!(too_large.is_empty());
    let mut v = c.clone();
    v.pods.retain(|p| p.peer.is_none());
    for comp in companions {
        v.policies.push(std::sync::Arc::new(
            crate::read::policy_json(comp.object).unwrap(),
        ));
    }
    v
}

#[test]
fn companions_let_a_label_aware_cni_allow_what_the_policies_allow() {
    let mut rng = StdRng::seed_from_u64(1879);
    let mut compared = 0;
    let mut with_companions = 0;
    for _ in 0..300 {
        let c = random_cluster(&mut rng);
        let cni = cni_view(&c);
        with_companions += usize::from(cni.policies.len() > c.policies.len());
        for local in c.pods.iter().filter(|p| p.peer.is_none()) {
            for remote in c.pods.iter().filter(|p| p.peer.is_some()) {
                for (proto, dport) in PROBES {
                    let dport = if proto == 1 { 0 } else { dport };
                    // Remote to local: the local pod's ingress.
                    let full = decide(
                        &c,
                        &Flow {
                            src: remote.ips[0],
                            dst: local.ips[0],
                            proto,
                            dport,
                            src_pod: Some(remote),
                            dst_pod: Some(local),
                        },
                    );
                    let seen = decide(
                        &cni,
                        &Flow {
                            src: remote.local_ips()[0],
                            dst: local.ips[0],
                            proto,
                            dport,
                            src_pod: None,
                            dst_pod: Some(local),
                        },
                    );
                    assert_eq!(
                        full.ingress.allows(),
                        seen.ingress.allows(),
                        "{} -> {} {proto}/{dport}: {:#?}",
                        remote.key(),
                        local.key(),
                        cni.policies
                    );
                    // Local to remote: the local pod's egress.
                    let full = decide(
                        &c,
                        &Flow {
                            src: local.ips[0],
                            dst: remote.ips[0],
                            proto,
                            dport,
                            src_pod: Some(local),
                            dst_pod: Some(remote),
                        },
                    );
                    let seen = decide(
                        &cni,
                        &Flow {
                            src: local.ips[0],
                            dst: remote.local_ips()[0],
                            proto,
                            dport,
                            src_pod: Some(local),
                            dst_pod: None,
                        },
                    );
                    assert_eq!(
                        full.egress.allows(),
                        seen.egress.allows(),
                        "{} -> {} {proto}/{dport}: {:#?}",
                        local.key(),
                        remote.key(),
                        cni.policies
                    );
                    compared += 2;
                }
            }
        }
    }
    assert!(with_companions > 50, "{with_companions}");
    assert!(compared > 10_000);
}

/// A peer whose CIDR overlaps ours is seen here in another one (Liqo's remapping), while its
/// gateway sees the peer's own addresses. An `ipBlock` names addresses as seen here: a local
/// pod's egress to the peer's CIDR as seen here reaches the peer's own addresses through the
/// tunnel, and an egress to our own CIDR does not reach the peer's addresses that carry the
/// same numbers. A pod of the namespace running on the peer meets a block as written (its far
/// end is ours).
#[test]
fn ip_blocks_name_a_remapped_peer_by_the_addresses_seen_here() {
    let block = |cidr: &str| {
        Peer::Block(IpBlock {
            cidr: cidr.parse().unwrap(),
            except: vec![],
        })
    };
    let egress_to = |name: &str, ns: &str, pod: &str, cidr: &str| {
        let mut p = policy(ns, name, sel(&[("pod", pod)]));
        p.egress = Some(vec![Rule {
            peers: vec![block(cidr)],
            ports: vec![],
        }]);
        p
    };
    let mut c = cluster(vec![
        // x/a: to the peer as seen here; x/b: to our own CIDR, whose numbers the peer reuses.
        egress_to("to-peer", "x", "a", "10.71.0.0/16"),
        egress_to("to-ours", "x", "b", "10.20.0.0/16"),
        // y/a runs on the peer: its egress to 10.1.0.0/24 (our x pods) is ours as written.
        egress_to("peer-to-x", "y", "a", "10.1.0.0/24"),
    ]);
    remap_peer1(&mut c, "10.20.0.0/16", "10.71.0.0/16");
    // A pod on the peer, seen here at 10.71.9.10 (its own address 10.20.9.10).
    let mut d = pod("y", "d", "10.20.9.10", &[("pod", "d")], Some("peer1"));
    d.local_ips = vec!["10.71.9.10".parse().unwrap()];
    c.pods.push(std::sync::Arc::new(d));
    let ir = compiled(&c);
    // The judge agrees: x/a may reach it (seen here in the block), x/b may not.
    let judged = |from: &str| {
        let (src, dst) = (c.pod(from).unwrap(), c.pod("y/d").unwrap());
        decide(
            &c,
            &Flow {
                src: src.ips[0],
                dst: dst.ips[0],
                proto: 6,
                dport: 80,
                src_pod: Some(src),
                dst_pod: Some(dst),
            },
        )
        .allowed()
    };
    assert!(judged("x/a"));
    assert!(!judged("x/b"));
    let allowed =
        |src: &str, dst: &str| tcp80_accepted(&ir, src, dst, "liqo.abcdefghij", "liqo-tunnel");
    // The peer's pod seen here at 10.71.9.10 is 10.20.9.10 at its gateway.
    assert!(
        allowed("10.1.0.1", "10.20.9.10"),
        "x/a reaches the peer as seen here"
    );
    assert!(!allowed("10.1.0.1", "10.30.9.10"), "x/a: nothing else");
    assert!(
        !allowed("10.1.0.2", "10.20.9.10"),
        "x/b's block is our CIDR: the peer's 10.20.9.10 is 10.71.9.10 here"
    );
    assert!(
        allowed("10.2.0.1", "10.1.0.3"),
        "y/a, on the peer, reaches x as written"
    );
    assert!(!allowed("10.2.0.1", "10.3.0.1"), "y/a: nothing else");
}

/// Where Liqo remaps a peer CIDR that overlaps ours (peer1's 10.1.0.0/16 is our namespace x's
/// range; seen here as 10.71.0.0/16), the gateway's source check passes a peer pod carrying
/// the numbers of our local pod x/b. x/a admits x/b and y/c (on the peer): from the tunnel,
/// y/c gets in, the peer's pod posing as x/b does not (x/b's own traffic to x/a never
/// crosses the gateway, so the tier has no business admitting its address from there).
#[test]
fn a_peer_pod_cannot_pose_as_a_local_pod_behind_an_overlapping_remap() {
    let mut p = policy("x", "from-b-and-y-c", sel(&[("pod", "a")]));
    p.ingress = Some(vec![Rule {
        peers: vec![
            Peer::Pods {
                namespaces: None,
                pods: Some(sel(&[("pod", "b")])),
            },
            Peer::Pods {
                namespaces: Some(sel(&[("ns", "y")])),
                pods: Some(sel(&[("pod", "c")])),
            },
        ],
        ports: vec![],
    }]);
    let mut c = cluster(vec![p]);
    remap_peer1(&mut c, "10.1.0.0/16", "10.71.0.0/16");
    let ir = compiled(&c);
    let from_tunnel =
        |src: &str| tcp80_accepted(&ir, src, "10.1.0.1", "liqo-tunnel", "liqo.abcdefghij");
    assert!(from_tunnel("10.2.0.3"), "y/c, on the peer, is admitted");
    assert!(
        !from_tunnel("10.1.0.2"),
        "the peer's pod with x/b's numbers does not pass as x/b"
    );
    assert!(!from_tunnel("10.2.0.2"), "y/b is not admitted");
}

/// Whether `ir` accepts a new TCP connection to port 80 from `src` to `dst`, in through `iif`
/// and out through `oif`.
fn tcp80_accepted(
    ir: &peerwall_policy::ir::Policy,
    src: &str,
    dst: &str,
    iif: &str,
    oif: &str,
) -> bool {
    let pkt = peerwall_policy::ir::Packet {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        proto: 6,
        sport: 40000,
        dport: 80,
        iif: Some(iif.into()),
        oif: Some(oif.into()),
        ct_state: peerwall_policy::ir::CtState::New,
    };
    peerwall_policy::ir::evaluate(ir, &pkt).verdict == peerwall_policy::ir::VerdictAction::Accept
}
