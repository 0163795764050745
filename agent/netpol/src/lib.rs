//! Kubernetes NetworkPolicy (`networking.k8s.io/v1`) for pod traffic that crosses a Liqo
//! gateway, as pure data: the cluster as the controller sees it ([`Cluster`]: namespaces,
//! pods with labels, addresses and container ports, remote pods marked with their peer), the
//! policies ([`NetworkPolicy`], defaults already applied), the semantics ([`eval`], written
//! from the API reference: the judge), and the gateway tier that enforces them ([`tier`]).
//!
//! No kube types here: the edges convert API objects (the agent's `k8s::netpol`).

pub mod api;
pub mod cnp;
pub mod companion;
pub mod eval;
mod pods;
pub use pods::Pods;
pub mod read;
pub mod tier;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

/// A label selector (`matchLabels` and `matchExpressions`, ANDed). The empty selector
/// selects everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector {
    /// `matchLabels`.
    pub labels: BTreeMap<String, String>,
    /// `matchExpressions`.
    pub exprs: Vec<Requirement>,
}

/// One `matchExpressions` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requirement {
    /// Label key.
    pub key: String,
    /// Operator.
    pub op: Operator,
    /// Values (`In`, `NotIn`).
    pub values: Vec<String>,
}

/// `matchExpressions` operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operator {
    /// The label's value is one of the values.
    In,
    /// The label is absent or its value is none of the values.
    NotIn,
    /// The label is present.
    Exists,
    /// The label is absent.
    DoesNotExist,
}

impl Operator {
    /// The operator the API spells `s`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "In" => Some(Self::In),
            "NotIn" => Some(Self::NotIn),
            "Exists" => Some(Self::Exists),
            "DoesNotExist" => Some(Self::DoesNotExist),
            _ => None,
        }
    }

    /// As the API spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::In => "In",
            Self::NotIn => "NotIn",
            Self::Exists => "Exists",
            Self::DoesNotExist => "DoesNotExist",
        }
    }
}

impl Selector {
    /// Whether `labels` satisfy every term.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.labels.iter().all(|(k, v)| labels.get(k) == Some(v))
            && self.exprs.iter().all(|r| {
                let v = labels.get(&r.key);
                match r.op {
                    Operator::In => v.is_some_and(|v| r.values.contains(v)),
                    Operator::NotIn => v.is_none_or(|v| !r.values.contains(v)),
                    Operator::Exists => v.is_some(),
                    Operator::DoesNotExist => v.is_none(),
                }
            })
    }
}

/// `ipBlock`: `cidr` minus each `except`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpBlock {
    /// The block.
    pub cidr: ipnet::IpNet,
    /// Holes in it.
    pub except: Vec<ipnet::IpNet>,
}

impl IpBlock {
    /// Whether `ip` lies in the block and in none of its holes.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.cidr.contains(&ip) && !self.except.iter().any(|e| e.contains(&ip))
    }
}

/// One peer of a rule (`from` / `to` entry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Peer {
    /// `podSelector` and/or `namespaceSelector`: pods. Without a namespace selector, pods of
    /// the policy's namespace; without a pod selector, every pod of the selected namespaces.
    Pods {
        /// `namespaceSelector`.
        namespaces: Option<Selector>,
        /// `podSelector`.
        pods: Option<Selector>,
    },
    /// `ipBlock`.
    Block(IpBlock),
}

/// Transport protocols a NetworkPolicy port names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    /// TCP (the default).
    Tcp,
    /// UDP.
    Udp,
    /// SCTP.
    Sctp,
}

impl Protocol {
    /// IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Self::Tcp => 6,
            Self::Udp => 17,
            Self::Sctp => 132,
        }
    }

    /// The protocol of an IP protocol number.
    pub fn of(number: u8) -> Option<Self> {
        match number {
            6 => Some(Self::Tcp),
            17 => Some(Self::Udp),
            132 => Some(Self::Sctp),
            _ => None,
        }
    }

    /// As the API spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
            Self::Sctp => "SCTP",
        }
    }
}

/// Which ports of a protocol a rule's port entry names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ports {
    /// No `port`: all of them.
    All,
    /// `port` .. `endPort` (a single port: both the same).
    Range(u16, u16),
    /// A named port: resolved against the destination pod's container ports.
    Named(String),
}

/// One `ports` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    /// Protocol.
    pub protocol: Protocol,
    /// Ports.
    pub ports: Ports,
}

/// An ingress or egress rule: traffic matches when one of the peers and one of the ports
/// match; an empty list matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rule {
    /// `from` (ingress) or `to` (egress).
    pub peers: Vec<Peer>,
    /// `ports`.
    pub ports: Vec<Port>,
}

/// A NetworkPolicy with the API server's defaults applied: `ingress` is Some when
/// `policyTypes` holds `Ingress` (the pods it selects are isolated for ingress), likewise
/// `egress`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkPolicy {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `spec.podSelector`.
    pub pod_selector: Selector,
    /// Ingress rules, when the policy isolates for ingress.
    pub ingress: Option<Vec<Rule>>,
    /// Egress rules, when the policy isolates for egress.
    pub egress: Option<Vec<Rule>>,
}

/// A container port of a pod.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ContainerPort {
    /// `name`.
    pub name: Option<String>,
    /// `protocol`.
    pub protocol: Protocol,
    /// `containerPort`.
    pub port: u16,
}

/// A pod as NetworkPolicies see it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pod {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Its addresses as the gateway's filter sees its packets (a remote pod behind a remapped
    /// CIDR by the peer's own address).
    pub ips: Vec<IpAddr>,
    /// Its addresses as this cluster's pods and CNI see them (`status.podIPs`; for a remote
    /// pod behind a remapped CIDR, the remapped ones). Empty: the same as `ips`.
    pub local_ips: Vec<IpAddr>,
    /// Container ports (for named ports).
    pub ports: Vec<ContainerPort>,
    /// The peer it runs on (a pod on one of Liqo's virtual nodes), None for a local pod.
    pub peer: Option<String>,
}

impl Pod {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Its address of the family of `like`.
    pub fn ip_like(&self, like: IpAddr) -> Option<IpAddr> {
        self.ips
            .iter()
            .copied()
            .find(|i| i.is_ipv4() == like.is_ipv4())
    }

    /// Its addresses as this cluster sees them.
    pub fn local_ips(&self) -> &[IpAddr] {
        if self.local_ips.is_empty() {
            &self.ips
        } else {
            &self.local_ips
        }
    }

    /// The port its container port `name` of `protocol` has.
    pub fn named_port(&self, name: &str, protocol: Protocol) -> Option<u16> {
        named_port_in(&self.ports, name, protocol)
    }
}

/// The number container port `name` of `protocol` has among `ports`.
pub(crate) fn named_port_in(
    ports: &[ContainerPort],
    name: &str,
    protocol: Protocol,
) -> Option<u16> {
    ports
        .iter()
        .find(|p| p.protocol == protocol && p.name.as_deref() == Some(name))
        .map(|p| p.port)
}

/// What NetworkPolicies are evaluated against.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cluster {
    /// Namespace labels by name.
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
    /// Pods (with at least one address), each shared: the controller keeps them between
    /// views and re-derives only those a change touches (`peerwall-kube`'s cluster index), so a
    /// view is one pointer per pod, not a copy of every pod.
    pub pods: Pods,
    /// Policies.
    pub policies: Vec<Arc<NetworkPolicy>>,
    /// ClusterNetworkPolicies (both tiers).
    pub cluster_policies: Vec<cnp::ClusterNetworkPolicy>,
    /// Per peer: how its CIDRs that overlap ours are seen here (Liqo's `Configuration`).
    /// A policy's `ipBlock` names addresses as seen here; a peer's gateway sees that peer's
    /// own ones.
    pub remaps: BTreeMap<String, Vec<Remap>>,
}

/// One remapped CIDR of a peer, from Liqo's `Configuration` (`networking.liqo.io/v1beta1`):
/// `spec.remote.cidr.pod[i]` (or `external[i]`) is the peer's own CIDR, `status.remote.cidr.pod[i]`
/// how this cluster sees it (Liqo: `apis/networking/v1beta1/configuration_types.go`). When the
/// peer's CIDR overlaps ours, Liqo's gateway NAT (`remapping/cidr.go`) maps the two with the
/// host part kept: DNAT towards the peer, SNAT of what comes from it, at postrouting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remap {
    /// The peer's own CIDR: what crosses the tunnel, and what the gateway's forward hook sees.
    pub real: ipnet::IpNet,
    /// The CIDR this cluster uses for it: pod IPs Liqo's virtual kubelet reflects here.
    pub seen: ipnet::IpNet,
}

impl Remap {
    /// The peer's own address for `ip` as this cluster sees it, if this remap covers it.
    pub fn to_real(&self, ip: IpAddr) -> Option<IpAddr> {
        peerwall_policy::ir::nat::map_prefix(self.seen, self.real, ip)
    }

    /// `ip` (the peer's own) as this cluster sees it, if this remap covers it.
    pub fn to_seen(&self, ip: IpAddr) -> Option<IpAddr> {
        peerwall_policy::ir::nat::map_prefix(self.real, self.seen, ip)
    }
}

impl Cluster {
    /// The pod named `namespace/name`.
    pub fn pod(&self, key: &str) -> Option<&Pod> {
        self.pods.iter().map(|p| &**p).find(|p| p.key() == key)
    }

    /// Whether the pods of `peer`'s namespace selection include `pod`, for a policy in
    /// `policy_ns`.
    pub fn peer_selects_pod(&self, policy_ns: &str, peer: &Peer, pod: &Pod) -> bool {
        match peer {
            Peer::Block(_) => false,
            Peer::Pods { namespaces, pods } => {
                self.peer_namespace_holds(policy_ns, namespaces.as_ref(), &pod.namespace)
                    && pods.as_ref().is_none_or(|s| s.matches(&pod.labels))
            }
        }
    }

    /// The namespace half of [`peer_selects_pod`](Self::peer_selects_pod): whether a pod peer
    /// with namespace selector `namespaces` (None: its policy's own), in a policy of
    /// `policy_ns`, can select pods of namespace `ns`. The indexes by namespace (the tier's
    /// classes, the companions' remote pods) ask it to narrow where they look.
    pub fn peer_namespace_holds(
        &self,
        policy_ns: &str,
        namespaces: Option<&Selector>,
        ns: &str,
    ) -> bool {
        match namespaces {
            None => ns == policy_ns,
            Some(sel) => self
                .namespaces
                .get(ns)
                .is_some_and(|labels| sel.matches(labels)),
        }
    }

    /// The pods `policy` selects (its namespace, its pod selector).
    pub fn selected<'a>(&'a self, policy: &'a NetworkPolicy) -> impl Iterator<Item = &'a Pod> {
        self.pods.iter().map(|p| &**p).filter(move |p| {
            p.namespace == policy.namespace && policy.pod_selector.matches(&p.labels)
        })
    }
}

#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;
