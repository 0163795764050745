//! The ClusterNetworkPolicy CRD (`policy.networking.k8s.io/v1alpha2`, sigs.k8s.io/network-policy-api,
//! its standard channel), generated from these types with the same group, version, kind, scope,
//! short name, printer columns and schema constraints as the API's
//! (`apis/v1alpha2/clusternetworkpolicy_types.go`), for clusters that have none: the controller
//! creates it when the API server does not serve the kind, and never replaces one that is
//! installed (a newer version, or the project's own). The experimental channel's `nodes` and
//! `domainNames` are not in it; an installed experimental CRD keeps them, and the reader fails
//! closed on them. Its group is one of Kubernetes' protected ones (`*.k8s.io`): the API server
//! requires the `api-approved.kubernetes.io` annotation, which names the API's approval
//! (network-policy-api PR 300, as the project's own CRD does).
//!
//! What the controller reads is [`peerwall_netpol::cnp::read`]'s lenient view of the same JSON;
//! these types exist for the schema.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Spec of a ClusterNetworkPolicy.
#[derive(kube::CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1alpha2",
    kind = "ClusterNetworkPolicy",
    plural = "clusternetworkpolicies",
    status = "ClusterNetworkPolicyStatus",
    shortname = "cnp",
    printcolumn = r#"{"name":"Tier","type":"string","jsonPath":".spec.tier"}"#,
    printcolumn = r#"{"name":"Priority","type":"string","jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicySpec {
    /// `Admin` (before NetworkPolicies) or `Baseline` (after them).
    pub tier: Tier,
    /// 0-1000; lower values are consulted first within the tier.
    #[schemars(range(min = 0, max = 1000))]
    pub priority: i32,
    /// The pods the policy applies to.
    pub subject: Subject,
    /// Ingress rules, in order (at most 25).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 25))]
    pub ingress: Vec<IngressRule>,
    /// Egress rules, in order (at most 25).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 25))]
    pub egress: Vec<EgressRule>,
}

/// Status written by implementations.
#[derive(Serialize, Deserialize, Clone, Debug, Default, JsonSchema)]
pub struct ClusterNetworkPolicyStatus {
    /// Conditions (`type` is the list's key: each implementation applies its own entries).
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// The tier.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema)]
pub enum Tier {
    /// Before NetworkPolicies.
    Admin,
    /// After NetworkPolicies.
    Baseline,
}

/// A rule's action.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, JsonSchema)]
pub enum Action {
    /// Accept; nothing later in the direction is consulted.
    Accept,
    /// Drop.
    Deny,
    /// Skip the rest of the tier.
    Pass,
}

/// Exactly one field.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema)]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct Subject {
    /// Every pod of the selected namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// Pods by namespace and pod selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

/// Pods by namespace and pod selector.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedPod {
    /// Empty: every namespace.
    #[serde(default)]
    pub namespace_selector: LabelSelector,
    /// Empty: every pod.
    pub pod_selector: LabelSelector,
}

/// An ingress rule.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema)]
pub struct IngressRule {
    /// An identifier (at most 100 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 100))]
    pub name: Option<String>,
    /// The action.
    pub action: Action,
    /// Sources (1-25).
    #[schemars(length(min = 1, max = 25))]
    pub from: Vec<IngressPeer>,
    /// Protocol and port matches (1-25; absent: any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 25))]
    pub protocols: Option<Vec<Protocol>>,
}

/// An egress rule.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema)]
pub struct EgressRule {
    /// An identifier (at most 100 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 100))]
    pub name: Option<String>,
    /// The action.
    pub action: Action,
    /// Destinations (1-25).
    #[schemars(length(min = 1, max = 25))]
    pub to: Vec<EgressPeer>,
    /// Protocol and port matches (1-25; absent: any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 25))]
    pub protocols: Option<Vec<Protocol>>,
}

/// Exactly one field.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema)]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct IngressPeer {
    /// Every pod of the selected namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// Pods by namespace and pod selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

/// Exactly one field.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema)]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct EgressPeer {
    /// Every pod of the selected namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// Pods by namespace and pod selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
    /// CIDRs (1-25).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 25))]
    pub networks: Option<Vec<String>>,
}

/// Exactly one field.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct Protocol {
    /// TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<ProtocolPorts>,
    /// UDP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp: Option<ProtocolPorts>,
    /// SCTP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sctp: Option<ProtocolPorts>,
    /// A container port's name, whichever its protocol.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_named_port: Option<String>,
}

/// A protocol's port match.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1))]
pub struct ProtocolPorts {
    /// The destination port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_port: Option<Port>,
}

/// Exactly one of `number` and `range`.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema)]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct Port {
    /// A port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub number: Option<i32>,
    /// An inclusive range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<PortRange>,
}

/// `start` < `end`.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema)]
pub struct PortRange {
    /// First port.
    #[schemars(range(min = 1, max = 65535))]
    pub start: i32,
    /// Last port.
    #[schemars(range(min = 1, max = 65535))]
    pub end: i32,
}

/// The CRD as the controller installs it: cluster-scoped (kube's derive defaults to
/// cluster scope without `namespaced`), schema defaults removed as for peerwall's own CRDs.
pub fn crd() -> Result<
    k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    serde_json::Error,
> {
    use kube::CustomResourceExt;
    let mut v = serde_json::to_value(ClusterNetworkPolicy::crd())?;
    if let Some(versions) = v.pointer_mut("/spec/versions") {
        super::schema::strip_defaults(versions);
    }
    v["metadata"]["annotations"] = serde_json::json!({
        "api-approved.kubernetes.io": "https://github.com/kubernetes-sigs/network-policy-api/pull/300",
        "policy.networking.k8s.io/channel": "standard",
        "peerwall.io/generated-by": "peerwall",
    });
    serde_json::from_value(v)
}
