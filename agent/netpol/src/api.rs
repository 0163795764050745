//! `networking.k8s.io/v1` NetworkPolicy as the API writes it (JSON field names, everything the
//! API server may leave out optional): what [`crate::read`] reads. The fields peerwall reads,
//! nothing more; unknown fields are ignored, as a client of a newer API server must.

use std::collections::BTreeMap;

use serde::Deserialize;

/// A NetworkPolicy object.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct NetworkPolicy {
    /// `metadata`.
    #[serde(default)]
    pub metadata: Metadata,
    /// `spec`.
    #[serde(default)]
    pub spec: Option<Spec>,
}

/// `metadata` (name and namespace).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Metadata {
    /// `metadata.name`.
    #[serde(default)]
    pub name: Option<String>,
    /// `metadata.namespace`.
    #[serde(default)]
    pub namespace: Option<String>,
}

/// `spec`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    /// `spec.podSelector`.
    #[serde(default)]
    pub pod_selector: Option<LabelSelector>,
    /// `spec.policyTypes`.
    #[serde(default)]
    pub policy_types: Option<Vec<String>>,
    /// `spec.ingress`.
    #[serde(default)]
    pub ingress: Option<Vec<IngressRule>>,
    /// `spec.egress`.
    #[serde(default)]
    pub egress: Option<Vec<EgressRule>>,
}

/// One `spec.ingress` entry.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct IngressRule {
    /// `from`.
    #[serde(default)]
    pub from: Option<Vec<PolicyPeer>>,
    /// `ports`.
    #[serde(default)]
    pub ports: Option<Vec<PolicyPort>>,
}

/// One `spec.egress` entry.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct EgressRule {
    /// `to`.
    #[serde(default)]
    pub to: Option<Vec<PolicyPeer>>,
    /// `ports`.
    #[serde(default)]
    pub ports: Option<Vec<PolicyPort>>,
}

/// A label selector.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// `matchLabels`.
    #[serde(default)]
    pub match_labels: Option<BTreeMap<String, String>>,
    /// `matchExpressions`.
    #[serde(default)]
    pub match_expressions: Option<Vec<SelectorRequirement>>,
}

/// One `matchExpressions` entry.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SelectorRequirement {
    /// `key`.
    #[serde(default)]
    pub key: String,
    /// `operator`.
    #[serde(default)]
    pub operator: String,
    /// `values`.
    #[serde(default)]
    pub values: Option<Vec<String>>,
}

/// A `from`/`to` entry.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyPeer {
    /// `ipBlock`.
    #[serde(default)]
    pub ip_block: Option<IpBlock>,
    /// `namespaceSelector`.
    #[serde(default)]
    pub namespace_selector: Option<LabelSelector>,
    /// `podSelector`.
    #[serde(default)]
    pub pod_selector: Option<LabelSelector>,
}

/// `ipBlock`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct IpBlock {
    /// `cidr`.
    #[serde(default)]
    pub cidr: String,
    /// `except`.
    #[serde(default)]
    pub except: Option<Vec<String>>,
}

/// A `ports` entry.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyPort {
    /// `protocol` (TCP when absent).
    #[serde(default)]
    pub protocol: Option<String>,
    /// `port`: a number or a named port.
    #[serde(default)]
    pub port: Option<IntOrString>,
    /// `endPort`.
    #[serde(default)]
    pub end_port: Option<i32>,
}

/// A number or a name, as `port` takes them.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum IntOrString {
    /// A number.
    Int(i32),
    /// A name (or a number written as a string).
    String(String),
}
