//! ClusterNetworkPolicy (`policy.networking.k8s.io/v1alpha2`, sigs.k8s.io/network-policy-api) as
//! pure data: the admin's guardrails, in two tiers around the NetworkPolicies ([`Tier::Admin`]
//! before them, [`Tier::Baseline`] after them, where no NetworkPolicy isolates the pod). Read
//! from the API's JSON by [`read`]; their semantics are [`crate::eval`]'s, their enforcement
//! [`crate::tier`]'s, in the same chains as the NetworkPolicies.
//!
//! Semantics from the API reference (`apis/v1alpha2/clusternetworkpolicy_types.go`):
//! - a direction of a pod is decided by the Admin tier's policies that select it (lower
//!   `priority` first; equal priorities in name order, which the API leaves to the
//!   implementation), each policy's rules in order, the first rule that matches deciding:
//!   `Accept` (allowed, no NetworkPolicy or Baseline rule is consulted), `Deny` (dropped),
//!   `Pass` (the rest of the tier is skipped and the NetworkPolicies decide);
//! - then the NetworkPolicies, if one isolates the pod for that direction;
//! - then the Baseline tier, the same way (`Pass` skips the rest of it);
//! - then the default: allowed.
//! - Traffic is allowed when the source's egress and the destination's ingress both allow it;
//!   replies of allowed connections pass.
//! - A peer the implementation cannot read (a field of a newer API, or an experimental one
//!   peerwall does not enforce: `nodes`, `domainNames`) fails closed as the API asks: it
//!   matches nothing in an `Accept` rule, and everything in a `Deny` or `Pass` rule.
//!
//! Across clusters, as for NetworkPolicies: a pod running on a Liqo virtual node is a member of
//! its namespace, selected as it would be if it ran here.

pub mod api;
pub mod read;
#[cfg(test)]
mod tests;

use crate::{Pod, Port, Selector};

/// The tier of a ClusterNetworkPolicy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Before the NetworkPolicies; cannot be overridden by them.
    Admin,
    /// After the NetworkPolicies, only where none isolates the pod.
    Baseline,
}

impl Tier {
    /// As the API spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Admin => "Admin",
            Self::Baseline => "Baseline",
        }
    }
}

/// What a rule does with the traffic it matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Allowed; nothing later in this direction is consulted.
    Accept,
    /// Dropped (a drop, not a refusal: the conformance suite expects a timeout).
    Deny,
    /// The rest of the tier is skipped; the next tier decides.
    Pass,
}

impl Action {
    /// As the API spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Accept => "Accept",
            Self::Deny => "Deny",
            Self::Pass => "Pass",
        }
    }
}

/// The pods a policy applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Subject {
    /// Every pod of the namespaces the selector matches.
    Namespaces(Selector),
    /// The pods the pod selector matches in the namespaces the namespace selector matches.
    Pods {
        /// `namespaceSelector` (empty: every namespace).
        namespaces: Selector,
        /// `podSelector` (empty: every pod).
        pods: Selector,
    },
}

/// One peer of a rule (`from` / `to` entry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Peer {
    /// Every pod of the namespaces the selector matches.
    Namespaces(Selector),
    /// Pods by namespace and pod selector.
    Pods {
        /// `namespaceSelector`.
        namespaces: Selector,
        /// `podSelector`.
        pods: Selector,
    },
    /// `networks` (egress only): addresses as this cluster sees them.
    Networks(Vec<ipnet::IpNet>),
    /// A peer peerwall does not enforce (why: field path and reason): fails closed.
    Unsupported(String),
}

/// One ingress or egress rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// `name` (may be empty).
    pub name: String,
    /// `action`.
    pub action: Action,
    /// `from` (ingress) or `to` (egress): any of them.
    pub peers: Vec<Peer>,
    /// `protocols` as ports (empty: any protocol and port). A `destinationNamedPort` is one
    /// named port per protocol: it names a container port, whose protocol the packet's must be.
    pub ports: Vec<Port>,
}

/// A ClusterNetworkPolicy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterNetworkPolicy {
    /// `metadata.name` (cluster-scoped).
    pub name: String,
    /// `spec.tier`.
    pub tier: Tier,
    /// `spec.priority` (0-1000, lower first).
    pub priority: u32,
    /// `spec.subject`.
    pub subject: Subject,
    /// `spec.ingress`, in order.
    pub ingress: Vec<Rule>,
    /// `spec.egress`, in order.
    pub egress: Vec<Rule>,
}

impl ClusterNetworkPolicy {
    /// Whether the policy applies to `pod`, whose namespace has `ns_labels` (None: the
    /// namespace is not known here, and no selector matches it).
    pub fn selects(
        &self,
        pod: &Pod,
        ns_labels: Option<&std::collections::BTreeMap<String, String>>,
    ) -> bool {
        let Some(ns) = ns_labels else {
            return false;
        };
        match &self.subject {
            Subject::Namespaces(s) => s.matches(ns),
            Subject::Pods { namespaces, pods } => {
                namespaces.matches(ns) && pods.matches(&pod.labels)
            }
        }
    }
}

/// The order policies of one tier are consulted in: priority, then name.
pub fn order<'a>(
    policies: impl Iterator<Item = &'a ClusterNetworkPolicy>,
    tier: Tier,
) -> Vec<&'a ClusterNetworkPolicy> {
    let mut v: Vec<&ClusterNetworkPolicy> = policies.filter(|p| p.tier == tier).collect();
    v.sort_by(|a, b| (a.priority, &a.name).cmp(&(b.priority, &b.name)));
    v
}

/// Whether `peer` selects the pod `pod` (namespace labels `ns_labels`).
pub fn peer_selects_pod(
    peer: &Peer,
    pod: &Pod,
    ns_labels: Option<&std::collections::BTreeMap<String, String>>,
) -> bool {
    let Some(ns) = ns_labels else {
        return false;
    };
    match peer {
        Peer::Namespaces(s) => s.matches(ns),
        Peer::Pods { namespaces, pods } => namespaces.matches(ns) && pods.matches(&pod.labels),
        Peer::Networks(_) | Peer::Unsupported(_) => false,
    }
}
