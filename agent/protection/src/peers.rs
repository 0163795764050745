//! Who the peers are (Liqo tenant namespaces), which namespaces they offloaded, and the
//! address sets of each peer's gateway; an address two tenants claim stays with its holder.

use crate::liqo::real_address;
use crate::world::Namespace;
use crate::world::World;
use crate::REMOTE_CLUSTER_ID;
use crate::TENANT_NAMESPACE;
use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::net::IpAddr;

/// A peer cluster: its id and tenant namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Peer {
    /// Cluster id.
    pub id: String,
    /// Tenant namespace (where its gateway configuration lives).
    pub tenant_namespace: String,
    /// The source CIDRs its packets may carry through the tunnel (its pod and external
    /// CIDRs, its own and as seen here: [`crate::configuration_sources`]). Empty: not known (no
    /// `Configuration` yet): nothing from its tunnel passes ([`crate::NO_CONFIGURATION_RULE`]).
    pub sources: Vec<ipnet::IpNet>,
}

/// Address sets of one peer's gateway configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerSets {
    /// Pods the peer offloaded to us.
    pub offloaded: BTreeSet<IpAddr>,
    /// Our pods running on the peer, by the addresses the gateway's forward hook sees on
    /// packets from them: the peer's own (a remapped pod IP translated back, since Liqo's
    /// gateway SNATs what comes from the tunnel only at postrouting).
    pub remote: BTreeSet<IpAddr>,
    /// Our pods running on other peers.
    pub elsewhere: BTreeSet<IpAddr>,
}

pub(crate) fn is_tenant(ns: &Namespace) -> bool {
    ns.labels.get(TENANT_NAMESPACE).map(String::as_str) == Some("true")
}

/// The peers: tenant namespaces that name a remote cluster.
pub fn peers(world: &World) -> Vec<Peer> {
    let mut out: Vec<Peer> = world
        .namespaces
        .iter()
        .filter(|n| is_tenant(n))
        .filter_map(|n| {
            n.labels.get(REMOTE_CLUSTER_ID).map(|id| Peer {
                id: id.clone(),
                tenant_namespace: n.name.clone(),
                sources: world.sources.get(id).cloned().unwrap_or_default(),
            })
        })
        .collect();
    out.sort();
    out
}

/// The consumer an offloaded namespace belongs to (a non-tenant namespace naming a cluster).
pub fn offloaded_namespace_owner(ns: &Namespace) -> Option<&str> {
    if is_tenant(ns) {
        return None;
    }
    ns.labels.get(REMOTE_CLUSTER_ID).map(String::as_str)
}

/// The consumer a pod was offloaded by: the owner of its namespace ([`offloaded_namespace_owner`]).
/// The namespace decides, because only who may label Namespaces (a cluster-scoped verb) can
/// make one a consumer's; a pod's own `liqo.io/remote-cluster-id` label (anyone who may create
/// a pod can set it) may only narrow: a pod labelled with another peer belongs to no peer, and
/// a pod in a namespace without an owner belongs to none whatever it is labelled.
pub fn offloaded_by<'a>(
    pod_labels: &BTreeMap<String, String>,
    namespace_owner: Option<&'a str>,
) -> Option<&'a str> {
    let owner = namespace_owner?;
    match pod_labels.get(REMOTE_CLUSTER_ID) {
        Some(claimed) if claimed != owner => None,
        _ => Some(owner),
    }
}

/// Address sets for every peer, from one snapshot.
pub fn sets(world: &World) -> BTreeMap<String, PeerSets> {
    let ns_owner: BTreeMap<&str, Option<&str>> = world
        .namespaces
        .iter()
        .map(|n| (n.name.as_str(), offloaded_namespace_owner(n)))
        .collect();
    let tenant: BTreeSet<&str> = world
        .namespaces
        .iter()
        .filter(|n| is_tenant(n))
        .map(|n| n.name.as_str())
        .collect();
    let vnode_peer: BTreeMap<&str, &str> = world
        .virtual_nodes
        .iter()
        .filter_map(|n| {
            n.labels
                .get(REMOTE_CLUSTER_ID)
                .map(|id| (n.name.as_str(), id.as_str()))
        })
        .collect();
    let mut out: BTreeMap<String, PeerSets> = peers(world)
        .into_iter()
        .map(|p| (p.id, PeerSets::default()))
        .collect();
    for pod in &world.pods {
        if pod.gone || pod.ips.is_empty() || tenant.contains(pod.namespace.as_str()) {
            continue;
        }
        // Ours, running on a peer through its virtual node.
        if let Some(peer) = pod.node.as_deref().and_then(|n| vnode_peer.get(n)) {
            let remaps = world.remaps.get(*peer).map_or(&[][..], Vec::as_slice);
            for (id, s) in out.iter_mut() {
                if id == peer {
                    s.remote
                        .extend(pod.ips.iter().map(|ip| real_address(remaps, *ip)));
                } else {
                    s.elsewhere.extend(pod.ips.iter().copied());
                }
            }
            continue;
        }
        // Offloaded to us by a consumer: in a namespace the consumer owns.
        let owner = offloaded_by(
            &pod.labels,
            ns_owner.get(pod.namespace.as_str()).copied().flatten(),
        );
        if let Some(s) = owner.and_then(|o| out.get_mut(o)) {
            s.offloaded.extend(pod.ips.iter().copied());
        }
    }
    out
}

/// What the API currently holds for one peer's gateway configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Published {
    /// The `offloaded` addresses in its spec.
    pub offloaded: BTreeSet<IpAddr>,
    /// Every host reports `Applied` for the current generation (or no host enforces it).
    pub settled: bool,
}

/// IP reuse across tenants: an address joins peer `p`'s `offloaded` set only once no other
/// peer's published configuration lists it and that removal is enforced everywhere (settled).
/// An address another peer still wants stays with that peer. Returns the sets to publish and
/// whether something was held back (the caller retries shortly).
pub fn gate_reuse(
    desired: &BTreeMap<String, PeerSets>,
    published: &BTreeMap<String, Published>,
) -> (BTreeMap<String, PeerSets>, bool) {
    let mut held = false;
    let mut out = desired.clone();
    for (id, s) in out.iter_mut() {
        let mine = published.get(id).map(|p| &p.offloaded);
        s.offloaded.retain(|ip| {
            if mine.is_some_and(|m| m.contains(ip)) {
                return true;
            }
            let blocked = published
                .iter()
                .any(|(other, p)| other != id && (p.offloaded.contains(ip) || !p.settled));
            held |= blocked;
            !blocked
        });
    }
    (out, held)
}
