use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use peerwall_netpol::testing::{random_rules, random_selector};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use super::*;
use crate::model::{assemble, cluster, PodFacts};

const NAMESPACES: [&str; 3] = ["x", "y", "z"];
const NODES: [&str; 4] = ["local-1", "vk-a", "vk-b", "vk-c"];
const PEERS: [&str; 2] = ["peer-a", "peer-b"];

fn random_facts(rng: &mut StdRng) -> PodFacts {
    let ns = NAMESPACES[rng.random_range(0..3)];
    let ips: Vec<IpAddr> = (0..rng.random_range(0..3))
        .map(|_| {
            if rng.random_bool(0.8) {
                format!("10.{}.0.{}", rng.random_range(1..3), rng.random_range(1..6))
            } else {
                format!("fd00::{}", rng.random_range(1..6))
            }
            .parse()
            .expect("address")
        })
        .collect();
    PodFacts {
        namespace: ns.into(),
        name: format!("p{}", rng.random_range(0..8)),
        labels: BTreeMap::from([(
            "pod".to_string(),
            ["a", "b", "c"][rng.random_range(0..3)].into(),
        )]),
        node: rng
            .random_bool(0.9)
            .then(|| NODES[rng.random_range(0..NODES.len())].to_string()),
        ips,
        ports: Vec::new(),
        gone: rng.random_bool(0.1),
    }
}

/// Each node virtual or not, and whose.
fn random_vnodes(rng: &mut StdRng) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for n in NODES {
        if rng.random_bool(0.7) {
            out.insert(n.to_string(), PEERS[rng.random_range(0..2)].to_string());
        }
    }
    out
}

/// Each peer with or without a remap of 10.2.0.0/24 (seen here) onto 10.1.0.0/24 (its own)
/// or onto 10.3.0.0/24.
fn random_remaps(rng: &mut StdRng) -> BTreeMap<String, Vec<Remap>> {
    let mut out = BTreeMap::new();
    for p in PEERS {
        if rng.random_bool(0.5) {
            let real = ["10.1.0.0/24", "10.3.0.0/24"][rng.random_range(0..2)];
            let remap = Remap {
                real: real.parse().expect("cidr"),
                seen: "10.2.0.0/24".parse().expect("cidr"),
            };
            out.insert(p.to_string(), vec![remap]);
        }
    }
    out
}

/// The nodes as the API shows them: a virtual node labelled with its peer, the others plain.
fn node_objects(vnodes: &BTreeMap<String, String>) -> Vec<Node> {
    NODES
        .iter()
        .map(|n| {
            let labels = match vnodes.get(*n) {
                Some(p) => json!({crate::NODE_TYPE: "virtual-node", crate::REMOTE_CLUSTER_ID: p}),
                None => json!({}),
            };
            serde_json::from_value(json!({"metadata": {"name": n, "labels": labels}}))
                .expect("node")
        })
        .collect()
}

fn random_policies(rng: &mut StdRng) -> Vec<netpol::NetworkPolicy> {
    (0..rng.random_range(0..4))
        .map(|i| {
            let ns = NAMESPACES[rng.random_range(0..3)];
            let mut p = peerwall_netpol::testing::policy(
                ns,
                &format!("np{i}"),
                random_selector(rng, "pod", &["a", "b", "c"]),
            );
            p.ingress = Some(random_rules(rng));
            if rng.random_bool(0.5) {
                p.egress = Some(random_rules(rng));
            }
            p
        })
        .collect()
}

/// Random sequences of what the watches report (a pod added, changed, finished or deleted; a
/// relist; a node turning virtual or changing peer; a peer's remaps changing): after every
/// event the index's view equals the full recompute over the same objects, and so does each
/// peer's NetworkPolicy tier built from it.
#[test]
fn the_index_by_difference_equals_the_full_recompute_after_every_event() {
    for seed in 0..60u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut index = ClusterIndex::default();
        let mut facts: BTreeMap<Key, Arc<PodFacts>> = BTreeMap::new();
        let mut vnodes = BTreeMap::new();
        let mut remaps = BTreeMap::new();
        let namespaces: Vec<(String, BTreeMap<String, String>)> = NAMESPACES[..2]
            .iter()
            .map(|n| {
                let mut labels = BTreeMap::from([
                    (
                        crate::model::NAMESPACE_NAME_LABEL.to_string(),
                        n.to_string(),
                    ),
                    ("ns".to_string(), n.to_string()),
                ]);
                // One tenant namespace: its pods have no namespace sets. The label is
                // Liqo's (`TenantNamespaceLabel`, pkg/consts/core.go; peerwall's
                // `TENANT_NAMESPACE`).
                if *n == "y" {
                    labels.insert("liqo.io/tenant-namespace".into(), "true".into());
                }
                (n.to_string(), labels)
            })
            .collect();
        let policies = random_policies(&mut rng);
        for step in 0..80 {
            match rng.random_range(0..10) {
                0..=4 => {
                    let f = Arc::new(random_facts(&mut rng));
                    facts.insert((f.namespace.clone(), f.name.clone()), f.clone());
                    index.upsert(f);
                }
                5 | 6 => {
                    let (ns, name) = (
                        NAMESPACES[rng.random_range(0..3)],
                        format!("p{}", rng.random_range(0..8)),
                    );
                    facts.remove(&(ns.to_string(), name.clone()));
                    index.remove(ns, &name);
                }
                7 => {
                    // A relist: some pods kept, some changed, some gone, some new.
                    let mut listed: BTreeMap<Key, Arc<PodFacts>> = facts
                        .iter()
                        .filter(|_| rng.random_bool(0.7))
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect();
                    for _ in 0..rng.random_range(0..4) {
                        let f = Arc::new(random_facts(&mut rng));
                        listed.insert((f.namespace.clone(), f.name.clone()), f);
                    }
                    facts = listed.clone();
                    index.replace_all(listed);
                }
                8 => vnodes = random_vnodes(&mut rng),
                _ => remaps = random_remaps(&mut rng),
            }
            // The view is taken with the caches' context as it stands.
            index.set_context(vnodes.clone(), &remaps);
            let got = assemble(
                namespaces.clone(),
                index.pods(),
                index.pod_namespaces(),
                policies.iter().cloned().map(Arc::new).collect(),
                &remaps,
            );
            let nodes = node_objects(&vnodes);
            let ns_objects: Vec<k8s_openapi::api::core::v1::Namespace> = namespaces
                .iter()
                .map(|(n, l)| {
                    serde_json::from_value(json!({"metadata": {"name": n, "labels": l}}))
                        .expect("namespace")
                })
                .collect();
            let (mut want, _) = cluster(
                &ns_objects,
                &nodes,
                facts.values().map(|f| &**f),
                [],
                &remaps,
            );
            want.policies = policies.iter().cloned().map(Arc::new).collect();
            assert_eq!(got, want, "seed {seed} step {step}");
            for peer in PEERS {
                let (a, b) = (
                    netpol::tier::tier(&got, peer, false),
                    netpol::tier::tier(&want, peer, false),
                );
                assert_eq!(a.spec, b.spec, "seed {seed} step {step} peer {peer}");
                let sets = index.namespace_sets(peer, |ns| {
                    crate::protection::namespaces::is_tenant(&got, ns)
                });
                assert_eq!(
                    sets,
                    crate::protection::namespaces::namespace_sets(&want, peer),
                    "seed {seed} step {step} peer {peer}: namespace sets"
                );
            }
        }
    }
}

/// A pod's facts unchanged re-derive nothing (the shared pod is the same allocation), and a
/// change of a context the pod does not depend on leaves it alone too.
#[test]
fn what_a_change_does_not_touch_stays_the_same_allocation() {
    let mut index = ClusterIndex::default();
    let pod = |name: &str, node: &str| {
        Arc::new(PodFacts {
            namespace: "x".into(),
            name: name.into(),
            labels: BTreeMap::new(),
            node: Some(node.into()),
            ips: vec!["10.2.0.7".parse().expect("ip")],
            ports: Vec::new(),
            gone: false,
        })
    };
    index.upsert(pod("here", "local-1"));
    index.upsert(pod("there", "vk-a"));
    let vnodes = BTreeMap::from([("vk-a".to_string(), "peer-a".to_string())]);
    index.set_context(vnodes.clone(), &BTreeMap::new());
    let before = index.pods();
    assert_eq!(before[1].peer.as_deref(), Some("peer-a"));
    // peer-a remaps 10.2.0.0/24 (seen here) onto its own 10.1.0.0/24: only its pod changes.
    let remaps = BTreeMap::from([(
        "peer-a".to_string(),
        vec![Remap {
            real: "10.1.0.0/24".parse().expect("cidr"),
            seen: "10.2.0.0/24".parse().expect("cidr"),
        }],
    )]);
    index.set_context(vnodes, &remaps);
    index.upsert(pod("here", "local-1"));
    let after = index.pods();
    assert!(
        Arc::ptr_eq(&before[0], &after[0]),
        "the local pod was not touched"
    );
    assert_eq!(after[1].ips, ["10.1.0.7".parse::<IpAddr>().expect("ip")]);
    assert_eq!(
        after[1].local_ips,
        ["10.2.0.7".parse::<IpAddr>().expect("ip")]
    );
}
