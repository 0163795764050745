//! Consumer protection by namespace (thesis §3.2.2): our pods a peer runs for us reach, through
//! its tunnel, only the pods of their own namespace here (local ones, and ours on other peers),
//! plus what a ProtectionPolicy opens ([`super::exceptions`]).
//!
//! For each of our namespaces with pods on the peer, two address sets: `own.<ns>` (those pods,
//! by the address the gateway's forward hook sees on their packets: the peer's own when Liqo
//! remaps its CIDR) and `home.<ns>` (the namespace's other pods, by the addresses this cluster
//! sees). Namespace names are DNS labels (no `.`), so set names never collide.
//!
//! No kube types: input is the cluster as [`netpol::Cluster`] sees it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use super::TENANT_NAMESPACE;
use peerwall_netpol as netpol;

/// One namespace's two sets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NsSets {
    /// Its pods running on the peer (sources).
    pub own: BTreeSet<IpAddr>,
    /// Its pods anywhere else (destinations).
    pub home: BTreeSet<IpAddr>,
}

/// Name of a namespace set: `own.<ns>`, `own6.<ns>`, `home.<ns>`, `home6.<ns>`.
pub fn set_name(kind: &str, namespace: &str, v6: bool) -> String {
    format!("{kind}{}.{namespace}", if v6 { "6" } else { "" })
}

/// Whether `namespace` is a tenant namespace (Liqo's label on it, as `cluster` read it): its
/// pods have no namespace sets.
pub fn is_tenant(cluster: &netpol::Cluster, namespace: &str) -> bool {
    cluster
        .namespaces
        .get(namespace)
        .is_some_and(|l| l.get(TENANT_NAMESPACE).map(String::as_str) == Some("true"))
}

/// What pod `p` of a namespace with pods on `peer` adds to that namespace's sets.
pub fn add_pod(sets: &mut NsSets, p: &netpol::Pod, peer: &str) {
    if p.peer.as_deref() == Some(peer) {
        sets.own.extend(p.ips.iter().copied());
    } else {
        sets.home.extend(p.local_ips().iter().copied());
    }
}

/// For every namespace (outside tenant namespaces) with pods running on `peer`: its sets.
/// Reads every pod: the controller keeps the same by difference (its `ClusterIndex`, tested
/// against this).
pub fn namespace_sets(cluster: &netpol::Cluster, peer: &str) -> BTreeMap<String, NsSets> {
    let mut out: BTreeMap<String, NsSets> = cluster
        .pods
        .iter()
        .filter(|p| p.peer.as_deref() == Some(peer) && !is_tenant(cluster, &p.namespace))
        .map(|p| (p.namespace.clone(), NsSets::default()))
        .collect();
    for p in &cluster.pods {
        if let Some(s) = out.get_mut(&p.namespace) {
            add_pod(s, p, peer);
        }
    }
    out
}
