//! The Kubernetes edge of the NetworkPolicy tier: API objects (`networking.k8s.io/v1`
//! NetworkPolicies, Pods, Namespaces, Liqo's virtual nodes and remaps) into the pure
//! [`crate::netpol::Cluster`], with the API server's defaults applied. A policy peerwall cannot
//! read (a malformed CIDR, an `endPort` with a named port, an unknown protocol) is left out
//! and reported with its field path: the policies that read stay enforced.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::networking::v1 as np;
use kube::ResourceExt;

use crate::netpol::{self, Cluster};
use crate::protection::Remap;
pub use peerwall_netpol::read::Unreadable;

/// The label every namespace carries with its name (API servers from 1.21 set it; for older
/// ones and snapshots it is filled in, so selectors on it hold everywhere).
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// One NetworkPolicy, defaults applied ([`peerwall_netpol::read::policy`], on its JSON).
pub fn policy(p: &np::NetworkPolicy) -> Result<netpol::NetworkPolicy, Unreadable> {
    match serde_json::to_value(p) {
        Ok(v) => peerwall_netpol::read::policy_json(v),
        Err(e) => Err(Unreadable {
            policy: format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()),
            why: format!("not serializable: {e}"),
        }),
    }
}

/// The addresses a pod owns (`status.podIPs`, else `status.podIP`): none for a hostNetwork
/// pod, whose status carries its node's address. Whoever may create a pod may ask for the
/// host's network; were its address a pod's, a selector or an offloaded namespace would put
/// the node itself (every port of it, every other hostNetwork pod on it) in an allowlist.
/// NetworkPolicy does not apply to such pods either (the API reference: "hostNetwork pods
/// ... are not selected by pod selectors"), so without addresses they are neither isolated
/// nor allowed anywhere.
pub fn pod_ips(p: &Pod) -> Vec<IpAddr> {
    if p.spec.as_ref().and_then(|s| s.host_network) == Some(true) {
        return Vec::new();
    }
    let status = p.status.as_ref();
    let mut ips: Vec<IpAddr> = status
        .and_then(|s| s.pod_ips.as_ref())
        .map(|v| v.iter().filter_map(|i| i.ip.parse().ok()).collect())
        .unwrap_or_default();
    if ips.is_empty() {
        ips.extend(
            status
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|i| i.parse::<IpAddr>().ok()),
        );
    }
    ips
}

/// What the NetworkPolicy tier reads of a pod, and no more: the controller keeps this for
/// every pod of the cluster (one watch, [`PodFacts::of`] on each event), not the object.
/// A whole `Pod` is kilobytes even trimmed (k8s-openapi's `PodSpec` holds every field
/// inline); 100k of them, twice during a relist, were most of the controller's memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodFacts {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// `spec.nodeName`: a virtual node's name places the pod on a peer.
    pub node: Option<String>,
    /// [`pod_ips`]: none for a hostNetwork pod.
    pub ips: Vec<IpAddr>,
    /// The containers' ports that read (named ports resolve against these).
    pub ports: Vec<netpol::ContainerPort>,
    /// [`gone`]: finished, its address released.
    pub gone: bool,
}

impl PodFacts {
    pub fn of(p: &Pod) -> Self {
        let ports = p
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .flat_map(|c| c.ports.iter().flatten())
            .filter_map(|cp| {
                Some(netpol::ContainerPort {
                    name: cp.name.clone(),
                    protocol: peerwall_netpol::read::protocol(cp.protocol.as_deref(), "").ok()?,
                    port: u16::try_from(cp.container_port).ok()?,
                })
            })
            .collect();
        PodFacts {
            namespace: p.namespace().unwrap_or_default(),
            name: p.name_any(),
            labels: p.labels().clone(),
            node: p.spec.as_ref().and_then(|s| s.node_name.clone()),
            ips: pod_ips(p),
            ports,
            gone: gone(p),
        }
    }

    /// The pod as the protection sets read it: only its peer label of all its labels.
    pub fn protection(&self) -> crate::protection::Pod {
        crate::protection::Pod {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            labels: self
                .labels
                .get(super::REMOTE_CLUSTER_ID)
                .map(|v| BTreeMap::from([(super::REMOTE_CLUSTER_ID.to_string(), v.clone())]))
                .unwrap_or_default(),
            node: self.node.clone(),
            ips: self.ips.clone(),
            gone: self.gone,
        }
    }
}

/// Whether a pod is gone for traffic: finished (`Succeeded`/`Failed`: its sandbox and address
/// are released, and the address may already be another pod's). A pod being deleted is not
/// gone: it keeps its address, and serves, through its grace period, so it stays what it was
/// (selected, isolated, allowed) until it finishes or its object is removed.
pub fn gone(p: &Pod) -> bool {
    let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded" | "Failed"))
}

/// The peer of each virtual node (`liqo.io/type=virtual-node`, named by its
/// `liqo.io/remote-cluster-id` label; Liqo: `pkg/consts/namespace_mapping.go`, `TypeLabel`,
/// `TypeNode`, `RemoteClusterID`): a pod on one of them runs on that peer.
pub fn virtual_nodes<'a>(nodes: impl IntoIterator<Item = &'a Node>) -> BTreeMap<String, String> {
    nodes
        .into_iter()
        .filter(|n| n.labels().get(super::NODE_TYPE).map(String::as_str) == Some("virtual-node"))
        .filter_map(|n| {
            n.labels()
                .get(super::REMOTE_CLUSTER_ID)
                .map(|id| (n.name_any(), id.clone()))
        })
        .collect()
}

/// A namespace's name and labels, with the name label the API server sets filled in.
pub fn namespace_labels(n: &Namespace) -> (String, BTreeMap<String, String>) {
    let mut labels = n.labels().clone();
    labels
        .entry(NAMESPACE_NAME_LABEL.to_string())
        .or_insert_with(|| n.name_any());
    (n.name_any(), labels)
}

/// The pod as NetworkPolicies see it, or None when it takes no part (finished, or without an
/// address): on a virtual node (`vnode_peer`), it runs on that peer and is known by the
/// address its packets carry through the peer's tunnel (`remaps`).
pub fn derive(
    p: &PodFacts,
    vnode_peer: &BTreeMap<String, String>,
    remaps: &BTreeMap<String, Vec<Remap>>,
) -> Option<netpol::Pod> {
    if p.gone {
        return None;
    }
    let peer = p.node.as_ref().and_then(|n| vnode_peer.get(n)).cloned();
    let r = peer
        .as_ref()
        .and_then(|x| remaps.get(x))
        .map_or(&[][..], Vec::as_slice);
    let ips: Vec<IpAddr> = p
        .ips
        .iter()
        .map(|ip| r.iter().find_map(|m| m.to_real(*ip)).unwrap_or(*ip))
        .collect();
    if ips.is_empty() {
        return None;
    }
    Some(netpol::Pod {
        namespace: p.namespace.clone(),
        name: p.name.clone(),
        labels: p.labels.clone(),
        local_ips: if p.ips == ips {
            Vec::new()
        } else {
            p.ips.clone()
        },
        ips,
        ports: p.ports.clone(),
        peer,
    })
}

/// The users' NetworkPolicies, read ([`policy`]), and those that do not read. peerwall's own
/// (the offloaded namespaces', the CNI companions) are for the CNI: the gateway enforces the
/// users'.
pub fn policies<'a>(
    policies: impl IntoIterator<Item = &'a np::NetworkPolicy>,
) -> (Vec<netpol::NetworkPolicy>, Vec<Unreadable>) {
    let (mut good, mut bad) = (Vec::new(), Vec::new());
    for p in policies.into_iter().filter(|p| !ours(p)) {
        match policy(p) {
            Ok(p) => good.push(p),
            Err(e) => bad.push(e),
        }
    }
    (good, bad)
}

/// Whether a NetworkPolicy is peerwall's own (a companion): not a user's, not read.
fn ours(p: &&np::NetworkPolicy) -> bool {
    p.labels()
        .get(crate::protection::MANAGED_BY)
        .map(String::as_str)
        == Some(crate::protection::MANAGER)
}

/// The cluster from its parts: `namespaces` (name and labels, [`namespace_labels`]), the
/// pods ([`derive()`]d) and the namespaces they are in, the policies read, the remaps. A
/// namespace named by a pod but absent from what was read (a partial snapshot) is known by
/// its name label, as the API server labels every namespace.
pub fn assemble<'a>(
    namespaces: impl IntoIterator<Item = (String, BTreeMap<String, String>)>,
    pods: netpol::Pods,
    pod_namespaces: impl IntoIterator<Item = &'a str>,
    policies: Vec<std::sync::Arc<netpol::NetworkPolicy>>,
    remaps: &BTreeMap<String, Vec<Remap>>,
) -> Cluster {
    let mut c = Cluster {
        namespaces: namespaces.into_iter().collect(),
        pods,
        policies,
        remaps: remaps.clone(),
        ..Cluster::default()
    };
    for ns in pod_namespaces {
        if !c.namespaces.contains_key(ns) {
            c.namespaces.insert(
                ns.to_string(),
                BTreeMap::from([(NAMESPACE_NAME_LABEL.to_string(), ns.to_string())]),
            );
        }
    }
    c
}

/// The cluster as NetworkPolicies see it, computed in full: virtual nodes (`liqo.io/type=
/// virtual-node`) tell which pods run on which peer, and a remote pod is known by the address
/// its packets carry through that peer's tunnel (`remaps`, from Liqo's `Configuration`s).
/// The controller keeps the same by difference ([`index::ClusterIndex`]); this is what it
/// must equal.
pub fn cluster<'a>(
    namespaces: impl IntoIterator<Item = &'a Namespace>,
    nodes: impl IntoIterator<Item = &'a Node>,
    pods: impl IntoIterator<Item = &'a PodFacts>,
    policies: impl IntoIterator<Item = &'a np::NetworkPolicy>,
    remaps: &BTreeMap<String, Vec<Remap>>,
) -> (Cluster, Vec<Unreadable>) {
    let vnode_peer = virtual_nodes(nodes);
    let derived: Vec<std::sync::Arc<netpol::Pod>> = pods
        .into_iter()
        .filter_map(|p| derive(p, &vnode_peer, remaps))
        .map(std::sync::Arc::new)
        .collect();
    let pod_namespaces: Vec<String> = derived.iter().map(|p| p.namespace.clone()).collect();
    let (read, bad) = self::policies(policies);
    let c = assemble(
        namespaces.into_iter().map(namespace_labels),
        derived.into(),
        pod_namespaces.iter().map(String::as_str),
        read.into_iter().map(std::sync::Arc::new).collect(),
        remaps,
    );
    (c, bad)
}

pub mod index;
mod reads;
pub use reads::PolicyReads;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, extra_spec: serde_json::Value, meta: serde_json::Value, phase: &str) -> Pod {
        let mut spec = json!({"containers": [{"name": "c"}]});
        spec.as_object_mut()
            .unwrap()
            .extend(extra_spec.as_object().unwrap().clone());
        let mut metadata = json!({"name": name, "namespace": "app", "labels": {"app": "x"}});
        metadata
            .as_object_mut()
            .unwrap()
            .extend(meta.as_object().unwrap().clone());
        serde_json::from_value(json!({
            "metadata": metadata,
            "spec": spec,
            "status": {"phase": phase, "podIP": "10.1.0.1", "podIPs": [{"ip": "10.1.0.1"}]},
        }))
        .unwrap()
    }

    #[test]
    fn host_network_pods_own_no_address_in_what_the_controller_keeps() {
        let p = PodFacts::of(&pod(
            "h",
            json!({"hostNetwork": true}),
            json!({}),
            "Running",
        ));
        assert!(p.ips.is_empty(), "the node's address is not the pod's");
        let (c, _) = cluster([], [], [&p], [], &BTreeMap::new());
        assert!(
            c.pods.is_empty(),
            "neither selected nor allowed: {:?}",
            c.pods
        );
        let plain = pod("p", json!({}), json!({}), "Running");
        assert_eq!(pod_ips(&plain), vec!["10.1.0.1".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn a_pod_being_deleted_keeps_its_place_until_it_finishes() {
        let deleting = pod(
            "d",
            json!({}),
            json!({"deletionTimestamp": "2026-01-01T00:00:00Z"}),
            "Running",
        );
        let finished = pod("f", json!({}), json!({}), "Succeeded");
        let failed = pod("x", json!({}), json!({}), "Failed");
        assert!(!gone(&deleting));
        assert!(gone(&finished) && gone(&failed));
        let facts = [&deleting, &finished, &failed].map(PodFacts::of);
        let (c, _) = cluster([], [], &facts, [], &BTreeMap::new());
        let names: Vec<&str> = c.pods.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["d"]);
    }
}
