//! Test helpers, for this crate's tests and for the edges that judge their conversions
//! with it (feature `testing`): the e2e suite's cluster shape (namespaces x, y, z with pods a,
//! b, c; y's pods remote), builders, probes, random clusters and the tier compiled as the
//! agent compiles it. Panics on bad input: test code only.

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::Rng;

use crate::eval::Flow;
use crate::*;

/// A label map.
pub fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A selector of `matchLabels` only.
pub fn sel(kv: &[(&str, &str)]) -> Selector {
    Selector {
        labels: labels(kv),
        exprs: Vec::new(),
    }
}

/// A pod serving TCP 80 and 81 and SCTP 81 under named ports; `peer`: it runs there.
pub fn pod(ns: &str, name: &str, ip: &str, l: &[(&str, &str)], peer: Option<&str>) -> Pod {
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
pub fn cluster(policies: Vec<NetworkPolicy>) -> Cluster {
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
        pods: pods.into_iter().map(std::sync::Arc::new).collect(),
        policies: policies.into_iter().map(std::sync::Arc::new).collect(),
        cluster_policies: Vec::new(),
        remaps: Default::default(),
    }
}

/// A flow from pod `from` to pod `to` (keys `ns/name`).
pub fn flow<'a>(c: &'a Cluster, from: &str, to: &str, proto: u8, dport: u16) -> Flow<'a> {
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

/// A NetworkPolicy selecting `selector`, isolating nothing yet.
pub fn policy(ns: &str, name: &str, selector: Selector) -> NetworkPolicy {
    NetworkPolicy {
        namespace: ns.into(),
        name: name.into(),
        pod_selector: selector,
        ingress: None,
        egress: None,
    }
}

/// The (protocol, port) pairs probed between every pair.
pub const PROBES: [(u8, u16); 8] = [
    (6, 80),
    (6, 81),
    (17, 80),
    (17, 81),
    (132, 81),
    (132, 8081),
    (6, 8081),
    (1, 0),
];

/// A random selector over label `key` with `values`.
pub fn random_selector(rng: &mut StdRng, key: &str, values: &[&str]) -> Selector {
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

/// Random rules (ipBlocks, selectors, ports by number, range and name).
pub fn random_rules(rng: &mut StdRng) -> Vec<Rule> {
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

/// Every pod of `c` twice: a second replica with the same labels, its IPv4 address 100
/// higher. With `rng`, each replica's port named `serve-81-tcp` is drawn again (81 or 8081),
/// and three in ten run on the other side of the gateway: replicas alike in labels may resolve
/// a named port to different numbers, and cross the gateway where their original does not.
pub fn with_replicas(c: &mut Cluster, mut rng: Option<&mut StdRng>) {
    let replicas: Vec<_> = c
        .pods
        .iter()
        .map(|p| {
            let mut r = (**p).clone();
            r.name = format!("{}-2", p.name);
            r.ips = p
                .ips
                .iter()
                .map(|ip| match ip {
                    std::net::IpAddr::V4(a) => {
                        let [x, y, z, w] = a.octets();
                        std::net::IpAddr::from([x, y, z, w + 100])
                    }
                    v6 => *v6,
                })
                .collect();
            if let Some(rng) = rng.as_deref_mut() {
                r.ports[1].port = if rng.random_bool(0.5) { 81 } else { 8081 };
                // A Deployment partly offloaded: a replica on the other side of the gateway.
                if rng.random_bool(0.3) {
                    r.peer = match r.peer {
                        Some(_) => None,
                        None => Some("peer1".into()),
                    };
                }
            }
            std::sync::Arc::new(r)
        })
        .collect();
    c.pods.extend(replicas);
}

/// The e2e shape with random named ports and one to four random policies.
pub fn random_cluster(rng: &mut StdRng) -> Cluster {
    let mut c = cluster(Vec::new());
    // Some pods name their port differently (named ports resolve per pod).
    for p in c.pods.iter_mut().map(std::sync::Arc::make_mut) {
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
        c.policies.push(std::sync::Arc::new(p));
    }
    c
}

/// Random ClusterNetworkPolicies (zero to three): either tier, priorities that tie (so name
/// order counts), every subject and peer kind, `networks`, peers peerwall does not enforce
/// (fail closed), ports by number, range and name, every action.
pub fn random_cluster_policies(rng: &mut StdRng) -> Vec<cnp::ClusterNetworkPolicy> {
    let ns_sel = |rng: &mut StdRng| random_selector(rng, "ns", &["x", "y", "z"]);
    let pod_sel = |rng: &mut StdRng| random_selector(rng, "pod", &["a", "b", "c"]);
    let rules = |rng: &mut StdRng, egress: bool| -> Vec<cnp::Rule> {
        (0..rng.random_range(0..4))
            .map(|i| cnp::Rule {
                name: format!("r{i}"),
                action: [cnp::Action::Accept, cnp::Action::Deny, cnp::Action::Pass]
                    [rng.random_range(0..3)],
                peers: (0..rng.random_range(1..3))
                    .map(|_| match rng.random_range(0..if egress { 5 } else { 3 }) {
                        0 => cnp::Peer::Namespaces(ns_sel(rng)),
                        1 => cnp::Peer::Pods {
                            namespaces: ns_sel(rng),
                            pods: pod_sel(rng),
                        },
                        2 if rng.random_bool(0.2) => cnp::Peer::Unsupported("spec.x: test".into()),
                        2 => cnp::Peer::Namespaces(ns_sel(rng)),
                        3 => {
                            cnp::Peer::Networks(vec![["10.0.0.0/8", "10.2.0.0/16", "10.1.0.0/30"]
                                [rng.random_range(0..3)]
                            .parse()
                            .unwrap()])
                        }
                        _ => cnp::Peer::Unsupported("spec.x.nodes: test".into()),
                    })
                    .collect(),
                ports: (0..rng.random_range(0..3))
                    .flat_map(|_| match rng.random_range(0..5) {
                        0 => vec![Port {
                            protocol: Protocol::Tcp,
                            ports: Ports::Range(80, 80),
                        }],
                        1 => vec![Port {
                            protocol: Protocol::Udp,
                            ports: Ports::Range(81, 8081),
                        }],
                        2 => vec![Port {
                            protocol: Protocol::Sctp,
                            ports: Ports::All,
                        }],
                        // `destinationNamedPort`: one named port per protocol.
                        _ => [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
                            .into_iter()
                            .map(|protocol| Port {
                                protocol,
                                ports: Ports::Named(
                                    ["serve-81-tcp", "serve-81-sctp"][rng.random_range(0..2)]
                                        .into(),
                                ),
                            })
                            .collect(),
                    })
                    .collect(),
            })
            .collect()
    };
    (0..rng.random_range(0..4))
        .map(|i| cnp::ClusterNetworkPolicy {
            name: format!("cnp{i}"),
            tier: if rng.random_bool(0.5) {
                cnp::Tier::Admin
            } else {
                cnp::Tier::Baseline
            },
            priority: rng.random_range(0..3),
            subject: if rng.random_bool(0.5) {
                cnp::Subject::Namespaces(ns_sel(rng))
            } else {
                cnp::Subject::Pods {
                    namespaces: ns_sel(rng),
                    pods: pod_sel(rng),
                }
            },
            ingress: rules(rng, false),
            egress: rules(rng, true),
        })
        .collect()
}

/// Every crossing pair of `c`'s pods and every probe: the semantics' decision ([`decide`]) and
/// whether the compiled tier `ir` accepts the first packet, for `check` to hold together.
/// Returns the number of cases.
pub fn crossing_cases(
    c: &Cluster,
    ir: &peerwall_policy::ir::Policy,
    mut check: impl FnMut(&Pod, &Pod, u8, u16, &crate::eval::Decision, &peerwall_policy::ir::Verdict),
) -> usize {
    let mut n = 0;
    for from in &c.pods {
        for to in &c.pods {
            // Only pairs with one end on the peer cross its gateway.
            if from.peer.is_some() == to.peer.is_some() {
                continue;
            }
            for (proto, dport) in PROBES {
                let dport = if proto == 1 { 0 } else { dport };
                let f = Flow {
                    src: from.ips[0],
                    dst: to.ips[0],
                    proto,
                    dport,
                    src_pod: Some(from),
                    dst_pod: Some(to),
                };
                let want = crate::eval::decide(c, &f);
                let pkt = peerwall_policy::ir::Packet {
                    src: f.src,
                    dst: f.dst,
                    proto,
                    sport: 40000,
                    dport,
                    iif: Some("liqo-tunnel".into()),
                    oif: Some("liqo.abcdefghij".into()),
                    ct_state: peerwall_policy::ir::CtState::New,
                };
                let got = peerwall_policy::ir::evaluate(ir, &pkt);
                check(from, to, proto, dport, &want, &got);
                n += 1;
            }
        }
    }
    n
}

/// The tier as the agent would enforce it: the FirewallConfiguration loaded and compiled.
pub fn compiled(c: &Cluster) -> peerwall_policy::ir::Policy {
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

/// x's pods isolated for ingress by a NetworkPolicy allowing only y/a on TCP 80.
pub fn np_x_from_ya() -> NetworkPolicy {
    let mut p = policy("x", "from-ya", Selector::default());
    p.ingress = Some(vec![Rule {
        peers: vec![Peer::Pods {
            namespaces: Some(sel(&[("ns", "y")])),
            pods: Some(sel(&[("pod", "a")])),
        }],
        ports: vec![Port {
            protocol: Protocol::Tcp,
            ports: Ports::Range(80, 80),
        }],
    }]);
    p
}

/// A ClusterNetworkPolicy rule: `action` for every pod of the namespaces labelled `ns=<ns>`.
pub fn from_ns(action: cnp::Action, ns: &str) -> cnp::Rule {
    cnp::Rule {
        name: String::new(),
        action,
        peers: vec![cnp::Peer::Namespaces(sel(&[("ns", ns)]))],
        ports: Vec::new(),
    }
}
