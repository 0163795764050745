//! The semantics of NetworkPolicy, from the API reference (`networking.k8s.io/v1`) and the
//! e2e suite's model: the judge the gateway tier ([`super::tier`]) is held to.
//!
//! Traffic from A to B is allowed when A's egress allows it and B's ingress allows it. A pod
//! is isolated for a direction when a policy of its namespace selects it and covers that
//! direction; an isolated pod allows what any rule of any selecting policy matches (a union);
//! a pod no policy isolates allows everything in that direction. A rule matches when one of
//! its peers and one of its ports match (an empty list: all). Policies are stateful: replies
//! of an allowed connection pass (the tier's first rule); this module judges first packets.

use std::net::IpAddr;

use super::{Cluster, NetworkPolicy, Peer, Pod, Port, Ports, Protocol, Rule};

/// The first packet of a connection: its addresses as the gateway sees them, IP protocol
/// number, destination port, and the pods at either end when they are pods of the cluster.
#[derive(Clone, Copy, Debug)]
pub struct Flow<'a> {
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// IP protocol number.
    pub proto: u8,
    /// Destination port (TCP, UDP, SCTP; 0 otherwise).
    pub dport: u16,
    /// The source pod.
    pub src_pod: Option<&'a Pod>,
    /// The destination pod.
    pub dst_pod: Option<&'a Pod>,
}

/// The outcome for one direction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Side {
    /// No policy isolates the pod for this direction (or the end is not a pod).
    NotIsolated,
    /// Allowed by rule `rule` (index in its list) of `policy` (`namespace/name`).
    Allowed {
        /// The policy.
        policy: String,
        /// Index of the rule.
        rule: usize,
    },
    /// Isolated and no rule matched: the isolating policies.
    Denied {
        /// `namespace/name` of each.
        policies: Vec<String>,
    },
}

impl Side {
    /// Whether this direction lets the packet through.
    pub fn allows(&self) -> bool {
        !matches!(self, Self::Denied { .. })
    }
}

/// Both directions' outcomes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The source pod's egress.
    pub egress: Side,
    /// The destination pod's ingress.
    pub ingress: Side,
}

impl Decision {
    /// Whether the packet is allowed.
    pub fn allowed(&self) -> bool {
        self.egress.allows() && self.ingress.allows()
    }
}

/// Whether `port` names `flow`'s destination port; a named port is resolved against the
/// destination pod's container ports of that protocol.
fn port_matches(port: &Port, flow: &Flow<'_>) -> bool {
    if Protocol::of(flow.proto) != Some(port.protocol) {
        return false;
    }
    match &port.ports {
        Ports::All => true,
        Ports::Range(lo, hi) => (*lo..=*hi).contains(&flow.dport),
        Ports::Named(name) => {
            flow.dst_pod.and_then(|p| p.named_port(name, port.protocol)) == Some(flow.dport)
        }
    }
}

/// Whether `peer` (of a policy in `ns`) matches the far end: `pod` when it is a pod, `ip`
/// its address as the gateway sees it. A block names addresses as this cluster sees them: a
/// pod running on a peer whose CIDR Liqo remaps is met at its address here.
fn peer_matches(cluster: &Cluster, ns: &str, peer: &Peer, pod: Option<&Pod>, ip: IpAddr) -> bool {
    match peer {
        Peer::Block(b) => match pod {
            Some(p) if p.peer.is_some() => p.local_ips().iter().any(|a| b.contains(*a)),
            _ => b.contains(ip),
        },
        Peer::Pods { .. } => pod.is_some_and(|p| cluster.peer_selects_pod(ns, peer, p)),
    }
}

/// Whether `rule` of a policy in `ns` matches, the far end being `far`/`far_ip`.
fn rule_matches(
    cluster: &Cluster,
    ns: &str,
    rule: &Rule,
    far: Option<&Pod>,
    far_ip: IpAddr,
    flow: &Flow<'_>,
) -> bool {
    let peer_ok = rule.peers.is_empty()
        || rule
            .peers
            .iter()
            .any(|p| peer_matches(cluster, ns, p, far, far_ip));
    let port_ok = rule.ports.is_empty() || rule.ports.iter().any(|p| port_matches(p, flow));
    peer_ok && port_ok
}

/// The policies isolating `pod` in one direction (`rules_of` picks it), in name order.
fn isolating<'a>(
    cluster: &'a Cluster,
    pod: &'a Pod,
    rules_of: fn(&NetworkPolicy) -> Option<&Vec<Rule>>,
) -> Vec<&'a NetworkPolicy> {
    let mut v: Vec<&NetworkPolicy> = cluster
        .policies
        .iter()
        .filter(|p| {
            p.namespace == pod.namespace
                && rules_of(p).is_some()
                && p.pod_selector.matches(&pod.labels)
        })
        .collect();
    v.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    v
}

fn side(
    cluster: &Cluster,
    pod: Option<&Pod>,
    rules_of: fn(&NetworkPolicy) -> Option<&Vec<Rule>>,
    far: Option<&Pod>,
    far_ip: IpAddr,
    flow: &Flow<'_>,
) -> Side {
    let Some(pod) = pod else {
        return Side::NotIsolated;
    };
    let policies = isolating(cluster, pod, rules_of);
    if policies.is_empty() {
        return Side::NotIsolated;
    }
    for p in &policies {
        let rules = rules_of(p).map_or(&[][..], Vec::as_slice);
        if let Some(i) = rules
            .iter()
            .position(|r| rule_matches(cluster, &p.namespace, r, far, far_ip, flow))
        {
            return Side::Allowed {
                policy: format!("{}/{}", p.namespace, p.name),
                rule: i,
            };
        }
    }
    Side::Denied {
        policies: policies
            .iter()
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect(),
    }
}

/// The NetworkPolicy decision for the first packet of `flow`.
pub fn decide(cluster: &Cluster, flow: &Flow<'_>) -> Decision {
    Decision {
        egress: side(
            cluster,
            flow.src_pod,
            |p| p.egress.as_ref(),
            flow.dst_pod,
            flow.dst,
            flow,
        ),
        ingress: side(
            cluster,
            flow.dst_pod,
            |p| p.ingress.as_ref(),
            flow.src_pod,
            flow.src,
            flow,
        ),
    }
}
