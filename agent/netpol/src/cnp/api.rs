//! `policy.networking.k8s.io/v1alpha2` ClusterNetworkPolicy as the API writes it (JSON field
//! names, everything optional): what [`super::read`] reads. Unknown fields are ignored, as a
//! client of a newer API must; a peer or protocol left with no field peerwall knows is then
//! caught by the reader (the API's "exactly one field" rule) and fails closed.

use serde::Deserialize;

use crate::api::LabelSelector;

/// API group of ClusterNetworkPolicy.
pub const GROUP: &str = "policy.networking.k8s.io";
/// The version peerwall reads.
pub const VERSION: &str = "v1alpha2";
/// Kind.
pub const KIND: &str = "ClusterNetworkPolicy";
/// Plural resource name.
pub const PLURAL: &str = "clusternetworkpolicies";

/// A ClusterNetworkPolicy object.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ClusterNetworkPolicy {
    /// `metadata`.
    #[serde(default)]
    pub metadata: crate::api::Metadata,
    /// `spec`.
    #[serde(default)]
    pub spec: Option<Spec>,
}

/// `spec`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Spec {
    /// `spec.tier`: `Admin` or `Baseline`.
    #[serde(default)]
    pub tier: Option<String>,
    /// `spec.priority`: 0-1000.
    #[serde(default)]
    pub priority: Option<i64>,
    /// `spec.subject`.
    #[serde(default)]
    pub subject: Option<Subject>,
    /// `spec.ingress`.
    #[serde(default)]
    pub ingress: Option<Vec<IngressRule>>,
    /// `spec.egress`.
    #[serde(default)]
    pub egress: Option<Vec<EgressRule>>,
}

/// `spec.subject`: exactly one field.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Subject {
    /// `namespaces`.
    #[serde(default)]
    pub namespaces: Option<LabelSelector>,
    /// `pods`.
    #[serde(default)]
    pub pods: Option<NamespacedPod>,
}

/// `pods` of a subject or peer.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedPod {
    /// `namespaceSelector` (empty or absent: every namespace).
    #[serde(default)]
    pub namespace_selector: Option<LabelSelector>,
    /// `podSelector` (required by the API; empty: every pod).
    #[serde(default)]
    pub pod_selector: Option<LabelSelector>,
}

/// One `spec.ingress` entry.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct IngressRule {
    /// `name`.
    #[serde(default)]
    pub name: Option<String>,
    /// `action`: `Accept`, `Deny` or `Pass`.
    #[serde(default)]
    pub action: Option<String>,
    /// `from`.
    #[serde(default)]
    pub from: Option<Vec<Peer>>,
    /// `protocols`.
    #[serde(default)]
    pub protocols: Option<Vec<Protocol>>,
}

/// One `spec.egress` entry.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct EgressRule {
    /// `name`.
    #[serde(default)]
    pub name: Option<String>,
    /// `action`.
    #[serde(default)]
    pub action: Option<String>,
    /// `to`.
    #[serde(default)]
    pub to: Option<Vec<Peer>>,
    /// `protocols`.
    #[serde(default)]
    pub protocols: Option<Vec<Protocol>>,
}

/// A `from` / `to` entry: exactly one field.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Peer {
    /// `namespaces`.
    #[serde(default)]
    pub namespaces: Option<LabelSelector>,
    /// `pods`.
    #[serde(default)]
    pub pods: Option<NamespacedPod>,
    /// `networks` (egress): CIDRs.
    #[serde(default)]
    pub networks: Option<Vec<String>>,
    /// `nodes` (egress, experimental): not enforced.
    #[serde(default)]
    pub nodes: Option<serde_json::Value>,
    /// `domainNames` (egress, experimental): not enforced.
    #[serde(default)]
    pub domain_names: Option<serde_json::Value>,
}

/// A `protocols` entry: exactly one field.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Protocol {
    /// `tcp`.
    #[serde(default)]
    pub tcp: Option<ProtocolPorts>,
    /// `udp`.
    #[serde(default)]
    pub udp: Option<ProtocolPorts>,
    /// `sctp`.
    #[serde(default)]
    pub sctp: Option<ProtocolPorts>,
    /// `destinationNamedPort`: a container port's name.
    #[serde(default)]
    pub destination_named_port: Option<String>,
}

/// `tcp` / `udp` / `sctp`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProtocolPorts {
    /// `destinationPort`.
    #[serde(default)]
    pub destination_port: Option<PortSpec>,
}

/// `destinationPort`: exactly one of `number` and `range`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct PortSpec {
    /// `number`.
    #[serde(default)]
    pub number: Option<i64>,
    /// `range`.
    #[serde(default)]
    pub range: Option<PortRange>,
}

/// `range`: `start` < `end`, inclusive.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct PortRange {
    /// `start`.
    #[serde(default)]
    pub start: Option<i64>,
    /// `end`.
    #[serde(default)]
    pub end: Option<i64>,
}
