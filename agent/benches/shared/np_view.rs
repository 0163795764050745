//! The controller's view of the cluster after one pod change, computed both ways in the same
//! run: in full (`model::cluster` over every pod's facts, the old view dropped) and by
//! difference (`model::index::ClusterIndex`: the pod re-derived, the view assembled from the
//! shared pods, the old view dropped). Pods only: the NetworkPolicies are read alike by both.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Node};
use peerwall::k8s::model::{self, index::ClusterIndex, PodFacts};
use peerwall::netpol::Cluster;

/// Medians of `rounds` (full, by difference), each round one pod relabelled, over `c`'s pods
/// scaled to `pods` (copies of them in fresh namespaces), the peer's pods on a virtual node.
pub(crate) fn view_after_one_change(
    c: &Cluster,
    pods: usize,
    rounds: usize,
) -> (Duration, Duration) {
    let node: Node = serde_json::from_value(serde_json::json!({"metadata": {
        "name": "vk-peer",
        "labels": {"liqo.io/type": "virtual-node", "liqo.io/remote-cluster-id": "p1"},
    }}))
    .expect("node");
    let mut facts: Vec<PodFacts> = (0..pods)
        .map(|i| {
            let p = &c.pods[i % c.pods.len()];
            PodFacts {
                namespace: format!("{}-{}", p.namespace, i / c.pods.len()),
                name: p.name.clone(),
                labels: p.labels.clone(),
                node: Some(
                    if p.peer.is_some() {
                        "vk-peer"
                    } else {
                        "node-1"
                    }
                    .into(),
                ),
                ips: p.ips.clone(),
                ports: p.ports.clone(),
                gone: false,
            }
        })
        .collect();
    // In namespace and name order, as the controller keeps them.
    facts.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    let namespaces: Vec<Namespace> = c
        .namespaces
        .keys()
        .map(|n| serde_json::from_value(serde_json::json!({"metadata": {"name": n}})).expect("ns"))
        .collect();
    let vnodes = model::virtual_nodes([&node]);
    let remaps = BTreeMap::new();
    let mut index = ClusterIndex::default();
    for f in &facts {
        index.upsert(Arc::new(f.clone()));
    }
    let view_of = |index: &mut ClusterIndex| {
        index.set_context(vnodes.clone(), &remaps);
        model::assemble(
            namespaces.iter().map(model::namespace_labels),
            index.pods(),
            index.pod_namespaces().collect::<Vec<_>>(),
            Vec::new(),
            &remaps,
        )
    };
    let mut held_full = model::cluster(&namespaces, [&node], &facts, [], &remaps).0;
    let mut held_index = view_of(&mut index);
    let (mut full, mut diff) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        let k = (r * 7919) % facts.len();
        facts[k].labels.insert("bench-round".into(), r.to_string());
        let t0 = Instant::now();
        held_full = model::cluster(&namespaces, [&node], &facts, [], &remaps).0;
        full.push(t0.elapsed());
        let t1 = Instant::now();
        index.upsert(Arc::new(facts[k].clone()));
        held_index = view_of(&mut index);
        diff.push(t1.elapsed());
        assert!(
            held_full == held_index,
            "the index's view is the full recompute"
        );
    }
    drop((held_full, held_index));
    (crate::median(full), crate::median(diff))
}
