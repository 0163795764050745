//! NetworkPolicy semantics as data (cases from the API reference and the e2e suite), and the
//! gateway tier held to them: random clusters and policies, every crossing pair and probe,
//! the tier compiled to the policy IR and judged by the reference evaluator against
//! [`eval::decide`].

use std::collections::BTreeMap;
use std::net::IpAddr;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::eval::{decide, Flow, Side};
use super::*;

fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn sel(kv: &[(&str, &str)]) -> Selector {
    Selector {
        labels: labels(kv),
        exprs: Vec::new(),
    }
}

fn pod(ns: &str, name: &str, ip: &str, l: &[(&str, &str)], peer: Option<&str>) -> Pod {
    Pod {
        namespace: ns.into(),
        name: name.into(),
        labels: labels(l),
        ips: vec![ip.parse().unwrap()],
        local_ips: Vec::new(),
        ports: vec![
            ContainerPort {
                name: Some("serve-80-tcp".into()),
                protocol: Protocol::Tcp,
                port: 80,
            },
            ContainerPort {
                name: Some("serve-81-tcp".into()),
                protocol: Protocol::Tcp,
                port: 81,
            },
            ContainerPort {
                name: Some("serve-81-sctp".into()),
                protocol: Protocol::Sctp,
                port: 81,
            },
        ],
        peer: peer.map(str::to_string),
    }
}

/// The e2e suite's shape: namespaces x, y, z with pods a, b, c; in this cluster y's pods run
/// on the peer (remote), x's and z's locally.
fn cluster(policies: Vec<NetworkPolicy>) -> Cluster {
    let mut pods = Vec::new();
    for (n, ns) in ["x", "y", "z"].iter().enumerate() {
        for (m, p) in ["a", "b", "c"].iter().enumerate() {
            let remote = (*ns == "y").then_some("peer1");
            pods.push(pod(
                ns,
                p,
                &format!("10.{}.0.{}", n + 1, m + 1),
                &[("pod", p)],
                remote,
            ));
        }
    }
    Cluster {
        namespaces: ["x", "y", "z"]
            .iter()
            .map(|ns| {
                (
                    ns.to_string(),
                    labels(&[("ns", ns), ("kubernetes.io/metadata.name", ns)]),
                )
            })
            .collect(),
        pods,
        policies,
    }
}

fn flow<'a>(c: &'a Cluster, from: &str, to: &str, proto: u8, dport: u16) -> Flow<'a> {
    let (s, d) = (c.pod(from).unwrap(), c.pod(to).unwrap());
    Flow {
        src: s.ips[0],
        dst: d.ips[0],
        proto,
        dport,
        src_pod: Some(s),
        dst_pod: Some(d),
    }
}

fn policy(ns: &str, name: &str, selector: Selector) -> NetworkPolicy {
    NetworkPolicy {
        namespace: ns.into(),
        name: name.into(),
        pod_selector: selector,
        ingress: None,
        egress: None,
    }
}

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
    c.pods.iter_mut().find(|p| p.key() == "y/b").unwrap().ports[1].port = 8081;
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
        .find(|s| s.name.ends_with("_far"))
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

const PROBES: [(u8, u16); 8] = [
    (6, 80),
    (6, 81),
    (17, 80),
    (17, 81),
    (132, 81),
    (132, 8081),
    (6, 8081),
    (1, 0),
];

fn random_selector(rng: &mut StdRng, key: &str, values: &[&str]) -> Selector {
    let mut s = Selector::default();
    match rng.random_range(0..5) {
        0 => {}
        1 => {
            s.labels.insert(
                key.into(),
                values[rng.random_range(0..values.len())].to_string(),
            );
        }
        n => s.exprs.push(Requirement {
            key: key.into(),
            op: [
                Operator::In,
                Operator::NotIn,
                Operator::Exists,
                Operator::DoesNotExist,
            ][(n as usize + rng.random_range(0..2)) % 4],
            values: values
                .iter()
                .filter(|_| rng.random_bool(0.5))
                .map(|v| v.to_string())
                .collect(),
        }),
    }
    s
}

fn random_rules(rng: &mut StdRng) -> Vec<Rule> {
    (0..rng.random_range(0..3))
        .map(|_| Rule {
            peers: (0..rng.random_range(0..3))
                .map(|_| match rng.random_range(0..4) {
                    0 => Peer::Block(IpBlock {
                        cidr: ["10.0.0.0/8", "10.2.0.0/16", "10.1.0.0/30"][rng.random_range(0..3)]
                            .parse()
                            .unwrap(),
                        except: if rng.random_bool(0.5) {
                            vec!["10.2.0.2/31".parse().unwrap()]
                        } else {
                            vec![]
                        },
                    }),
                    1 => Peer::Pods {
                        namespaces: None,
                        pods: Some(random_selector(rng, "pod", &["a", "b", "c"])),
                    },
                    2 => Peer::Pods {
                        namespaces: Some(random_selector(rng, "ns", &["x", "y", "z"])),
                        pods: None,
                    },
                    _ => Peer::Pods {
                        namespaces: Some(random_selector(rng, "ns", &["x", "y", "z"])),
                        pods: Some(random_selector(rng, "pod", &["a", "b", "c"])),
                    },
                })
                .collect(),
            ports: (0..rng.random_range(0..3))
                .map(|_| Port {
                    protocol: [Protocol::Tcp, Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
                        [rng.random_range(0..4)],
                    ports: match rng.random_range(0..5) {
                        0 => Ports::All,
                        1 => Ports::Range(80, 80),
                        2 => Ports::Range(81, 8081),
                        3 => Ports::Named("serve-81-tcp".into()),
                        _ => Ports::Named("serve-81-sctp".into()),
                    },
                })
                .collect(),
        })
        .collect()
}

fn random_cluster(rng: &mut StdRng) -> Cluster {
    let mut c = cluster(Vec::new());
    // Some pods name their port differently (named ports resolve per pod).
    for p in c.pods.iter_mut() {
        if rng.random_bool(0.3) {
            p.ports[1].port = 8081;
        }
    }
    for i in 0..rng.random_range(1..5) {
        let ns = ["x", "y", "z"][rng.random_range(0..3)];
        let mut p = policy(
            ns,
            &format!("p{i}"),
            random_selector(rng, "pod", &["a", "b", "c"]),
        );
        match rng.random_range(0..3) {
            0 => p.ingress = Some(random_rules(rng)),
            1 => p.egress = Some(random_rules(rng)),
            _ => {
                p.ingress = Some(random_rules(rng));
                p.egress = Some(random_rules(rng));
            }
        }
        c.policies.push(p);
    }
    c
}

/// The tier as the agent would enforce it: the FirewallConfiguration loaded and compiled.
pub(crate) fn compiled(c: &Cluster) -> peerwall_policy::ir::Policy {
    let t = tier::tier(c, "peer1", false);
    let doc = serde_json::json!({
        "apiVersion": "peerwall.io/v1alpha1", "kind": "FirewallConfiguration",
        "metadata": {"name": "np", "namespace": "tenant"},
        "spec": t.spec,
    });
    let obj = peerwall_intent::load::object_from_json(doc, peerwall_intent::load::Group::Peerwall)
        .unwrap();
    peerwall_policy::compile::compile(&[obj])
        .unwrap_or_else(|e| panic!("the tier compiles: {e}"))
        .policy
}

#[test]
fn the_tier_gives_the_semantics_verdict_for_every_crossing_pair() {
    let mut rng = StdRng::seed_from_u64(31);
    let mut checked = 0;
    for _ in 0..300 {
        let c = random_cluster(&mut rng);
        let ir = compiled(&c);
        for from in &c.pods {
            for to in &c.pods {
                // Only pairs with one end on the peer cross its gateway.
                if from.peer.is_some() == to.peer.is_some() {
                    continue;
                }
                for (proto, dport) in PROBES {
                    let f = Flow {
                        src: from.ips[0],
                        dst: to.ips[0],
                        proto,
                        dport: if proto == 1 { 0 } else { dport },
                        src_pod: Some(from),
                        dst_pod: Some(to),
                    };
                    let want = decide(&c, &f);
                    let pkt = peerwall_policy::ir::Packet {
                        src: f.src,
                        dst: f.dst,
                        proto,
                        sport: 40000,
                        dport: f.dport,
                        iif: Some("liqo-tunnel".into()),
                        oif: Some("liqo.abcdefghij".into()),
                        ct_state: peerwall_policy::ir::CtState::New,
                    };
                    let got = peerwall_policy::ir::evaluate(&ir, &pkt);
                    let accepted = got.verdict == peerwall_policy::ir::VerdictAction::Accept;
                    assert_eq!(
                        accepted,
                        want.allowed(),
                        "{} -> {} proto {proto} port {dport}: semantics {want:?}, tier {got:?}\npolicies {:#?}",
                        from.key(),
                        to.key(),
                        c.policies
                    );
                    checked += 1;
                }
            }
        }
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
fn cni_view(c: &Cluster) -> Cluster {
    let (companions, too_large) = companion::companions(c, |_| false);
    assert!(too_large.is_empty());
    let mut v = c.clone();
    v.pods.retain(|p| p.peer.is_none());
    for comp in companions {
        let np: k8s_openapi::api::networking::v1::NetworkPolicy =
            serde_json::from_value(comp).unwrap();
        v.policies.push(crate::k8s::netpol::policy(&np).unwrap());
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

/// The offloaded namespaces' NetworkPolicy (what the controller writes on a provider),
/// judged as a label-aware CNI judges it: an offloaded pod calls home (its consumer's pods and
/// external CIDR, by the addresses seen here) and reaches its consumer's other offloaded
/// namespaces and DNS; not another consumer, its CIDRs, nor the provider's own pods.
#[test]
fn offloaded_pods_call_home_and_nowhere_else() {
    use crate::protection::offloaded_network_policy;
    let pod_at = |ns: &str, name: &str, ip: &str, l: &[(&str, &str)]| Pod {
        namespace: ns.into(),
        name: name.into(),
        labels: labels(l),
        ips: vec![ip.parse().unwrap()],
        ..Default::default()
    };
    let home_a: Vec<ipnet::IpNet> = vec![
        "10.10.0.0/16".parse().unwrap(),
        "10.110.0.0/16".parse().unwrap(),
    ];
    let home_b: Vec<ipnet::IpNet> = vec!["10.71.0.0/16".parse().unwrap()];
    let policy_of = |ns: &str, consumer: &str, home: &[ipnet::IpNet]| {
        let np: k8s_openapi::api::networking::v1::NetworkPolicy =
            serde_json::from_value(offloaded_network_policy(ns, consumer, home, &[])).unwrap();
        crate::k8s::netpol::policy(&np).unwrap()
    };
    let ns_labels = |name: &str, extra: &[(&str, &str)]| {
        let mut l = labels(extra);
        l.insert("kubernetes.io/metadata.name".into(), name.into());
        (name.to_string(), l)
    };
    let build = |home_a: &[ipnet::IpNet]| Cluster {
        namespaces: [
            ns_labels("offload-a", &[("liqo.io/remote-cluster-id", "a")]),
            ns_labels("offload-a2", &[("liqo.io/remote-cluster-id", "a")]),
            ns_labels("offload-b", &[("liqo.io/remote-cluster-id", "b")]),
            ns_labels("local", &[]),
            ns_labels("kube-system", &[]),
        ]
        .into_iter()
        .collect(),
        pods: vec![
            pod_at("offload-a", "p", "10.20.1.10", &[]),
            pod_at("offload-a2", "q", "10.20.1.11", &[]),
            pod_at("offload-b", "r", "10.20.2.10", &[]),
            pod_at("local", "s", "10.20.3.10", &[]),
            pod_at(
                "kube-system",
                "dns",
                "10.20.0.10",
                &[("k8s-app", "kube-dns")],
            ),
        ],
        policies: vec![
            policy_of("offload-a", "a", home_a),
            policy_of("offload-a2", "a", home_a),
            policy_of("offload-b", "b", &home_b),
        ],
    };
    let c = build(&home_a);
    let p = c.pod("offload-a/p").unwrap();
    let to = |dst: &str, proto: u8, dport: u16| -> bool {
        let pod = c.pods.iter().find(|x| x.key() == dst);
        let ip: IpAddr = pod.map_or_else(|| dst.parse().unwrap(), |x| x.ips[0]);
        decide(
            &c,
            &Flow {
                src: p.ips[0],
                dst: ip,
                proto,
                dport,
                src_pod: Some(p),
                dst_pod: pod,
            },
        )
        .allowed()
    };
    assert!(to("10.10.5.5", 6, 80), "its consumer's pods");
    assert!(to("10.110.0.7", 6, 443), "its consumer's external CIDR");
    assert!(
        to("offload-a2/q", 6, 80),
        "its consumer's other offloaded namespace"
    );
    assert!(to("kube-system/dns", 17, 53), "DNS");
    assert!(!to("kube-system/dns", 6, 80), "only DNS of kube-dns");
    assert!(!to("10.71.1.1", 6, 80), "another consumer's CIDR");
    assert!(
        !to("offload-b/r", 6, 80),
        "another consumer's offloaded pod"
    );
    assert!(!to("local/s", 6, 80), "the provider's own pods");
    // Without the consumer's CIDRs (the policy before this fix) the pod cannot call home.
    let old = build(&[]);
    let f = Flow {
        src: p.ips[0],
        dst: "10.10.5.5".parse().unwrap(),
        proto: 6,
        dport: 80,
        src_pod: old.pod("offload-a/p"),
        dst_pod: None,
    };
    assert!(!decide(&old, &f).allowed());
}
