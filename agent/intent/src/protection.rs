//! peerwall's `ProtectionPolicy` (`peerwall.io/v1alpha1`, cluster-scoped): what a provider
//! admin declares on top of provider and consumer protection, instead of editing what the
//! controller writes.
//!
//! - `open`: provider pods (selected by namespace and pod labels, on chosen ports) that a
//!   peer's offloaded pods, the peer's own pods through the tunnel, and/or our pods the peer
//!   runs for us may reach besides what protection lets through;
//! - `close`: ports the peer's tunnel may not reach even on the pods it offloaded here;
//! - `settings`: per-peer switches (audit, leaf-to-leaf blocking, consumer protection limited
//!   to the pod's own namespace), overriding the controller's flags.
//!
//! A policy applies to the peers it names (`peers`), or to every peer when it names none. The
//! controller merges every policy that applies to a peer into that peer's gateway
//! configuration and into the NetworkPolicy of the peer's offloaded namespaces, and reports
//! per peer in `status`. Validation (with field paths) lives with the merge, in the agent's
//! `protection::exceptions`.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Spec of a ProtectionPolicy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[cfg_attr(feature = "kube", derive(kube::CustomResource))]
#[cfg_attr(
    feature = "kube",
    kube(
        group = "peerwall.io",
        version = "v1alpha1",
        kind = "ProtectionPolicy",
        plural = "protectionpolicies",
        status = "ProtectionPolicyStatus",
        shortname = "pwpp",
        category = "peerwall",
        printcolumn = r#"{"name":"Peers","type":"string","jsonPath":".status.summary"}"#,
        printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProtectionPolicySpec {
    /// Remote cluster ids (`liqo.io/remote-cluster-id`) this policy applies to; empty or
    /// absent: every peer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<String>,
    /// Per-peer switches; an absent one keeps the controller's flag (or what a policy earlier
    /// by name set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<ProtectionSettings>,
    /// Provider pods opened to the peer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub open: Vec<Opening>,
    /// Ports closed to the peer's tunnel, even towards the pods it offloaded here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub close: Vec<Closing>,
}

/// Per-peer switches.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProtectionSettings {
    /// Audit mode for the peer's gateway configuration: what it would drop is reported, not
    /// dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<bool>,
    /// Drop traffic from our pods the peer runs towards our pods on other peers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_leaf_to_leaf: Option<bool>,
    /// Our pods the peer runs reach only pods of their own namespace here (plus what `open`
    /// entries with `from: [OwnPods]` add). `false`: they reach every pod here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub own_namespace_only: Option<bool>,
}

/// Who an opening is for.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema,
)]
pub enum From {
    /// The pods the peer offloaded here (they run here: enforced by the NetworkPolicy of its
    /// offloaded namespaces).
    Offloaded,
    /// The peer's own pods, through the tunnel (enforced in the peer's gateway).
    PeerPods,
    /// Our pods the peer runs for us, through the tunnel (enforced in the peer's gateway).
    OwnPods,
}

/// Provider pods opened to (some of) a peer's pods.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Opening {
    /// Name (a DNS label, unique in the policy): names the gateway rules and sets it becomes.
    #[serde(default)]
    pub name: String,
    /// Who may reach the selected pods; at least one.
    #[serde(default)]
    pub from: Vec<From>,
    /// Namespaces of the selected pods (`{}`: every namespace). Tenant namespaces and
    /// namespaces offloaded here are never selected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Pods in those namespaces (absent: all of them). Pods offloaded here and our pods
    /// running on peers are never selected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    /// Ports (absent or empty: every port of every protocol).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<PortSpec>,
}

/// Ports closed to a peer's tunnel.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Closing {
    /// Name (a DNS label, unique in the policy).
    #[serde(default)]
    pub name: String,
    /// Ports; at least one.
    #[serde(default)]
    pub ports: Vec<PortSpec>,
}

/// A Kubernetes label selector.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LabelSelector {
    /// Labels that must all match.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    /// Requirements that must all hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<LabelSelectorRequirement>,
}

/// One `matchExpressions` entry.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LabelSelectorRequirement {
    /// Label key.
    #[serde(default)]
    pub key: String,
    /// `In`, `NotIn`, `Exists` or `DoesNotExist`.
    #[serde(default)]
    pub operator: String,
    /// Values (`In`, `NotIn`: at least one; otherwise none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

/// A protocol and a port or port range, as in a NetworkPolicy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PortSpec {
    /// `TCP` (default), `UDP` or `SCTP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// Port number (absent: every port of the protocol). Named ports are not accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Last port of a range starting at `port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_port: Option<u16>,
}

/// Status of a ProtectionPolicy, written by the controller.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProtectionPolicyStatus {
    /// The generation the controller last read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Why the policy is not merged anywhere (it does not validate), or absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// One line for `kubectl get`: the peers it is merged into.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// Per peer it applies to: what it became there.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<PeerStatus>,
    /// Names in `spec.peers` that match no peer now (no Liqo tenant namespace labelled with
    /// that cluster id): a misspelt id applies to nobody.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unknown_peers: Vec<String>,
}

/// What a ProtectionPolicy became for one peer.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PeerStatus {
    /// Remote cluster id.
    pub peer: String,
    /// Gateway rules it added to the peer's configuration.
    pub gateway_rules: u32,
    /// Provider pod addresses its openings select now.
    pub selected_addresses: u32,
    /// Egress rules it added to the NetworkPolicy of the peer's offloaded namespaces.
    pub network_policy_rules: u32,
}
