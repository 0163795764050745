//! The cluster as the controller sees it, without kube types: namespaces, pods, virtual
//! nodes and what Liqo's `Configuration`s say of each peer ([`World`]).

use crate::Remap;
use std::collections::BTreeMap;
use std::net::IpAddr;

/// A namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Namespace {
    /// Name.
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
}

/// A pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pod {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// `spec.nodeName`.
    pub node: Option<String>,
    /// `status.podIPs` (or `status.podIP`).
    pub ips: Vec<IpAddr>,
    /// Phase Succeeded/Failed: its IP may already belong to someone else. A pod being deleted
    /// is not gone (it keeps its address through its grace period).
    pub gone: bool,
}

/// A node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Node {
    /// Name.
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
}

/// What the controller sees.
#[derive(Clone, Debug, Default)]
pub struct World {
    /// All namespaces.
    pub namespaces: Vec<Namespace>,
    /// All pods.
    pub pods: Vec<Pod>,
    /// Virtual nodes (Liqo's `liqo.io/type=virtual-node`).
    pub virtual_nodes: Vec<Node>,
    /// Per peer (cluster id): how its CIDRs are remapped here, from Liqo's `Configuration` in
    /// its tenant namespace.
    pub remaps: BTreeMap<String, Vec<Remap>>,
    /// Per peer: the source CIDRs its packets may carry through the tunnel
    /// ([`crate::configuration_sources`]); a peer without any gets nothing through its tunnel
    /// ([`crate::NO_CONFIGURATION_RULE`]).
    pub sources: BTreeMap<String, Vec<ipnet::IpNet>>,
}
