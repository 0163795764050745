//! The semantics of NetworkPolicy, from the API reference (`networking.k8s.io/v1`) and the
//! e2e suite's model: the judge the gateway tier ([`super::tier`]) is held to.
//!
//! Traffic from A to B is allowed when A's egress allows it and B's ingress allows it. A pod
//! is isolated for a direction when a policy of its namespace selects it and covers that
//! direction; an isolated pod allows what any rule of any selecting policy matches (a union);
//! a pod no policy isolates allows everything in that direction. ClusterNetworkPolicies
//! ([`crate::cnp`]) decide each direction first (Admin tier) and last (Baseline tier, only
//! for a pod no NetworkPolicy isolates), from the API reference of `v1alpha2`. A rule matches when one of
//! its peers and one of its ports match (an empty list: all). Policies are stateful: replies
//! of an allowed connection pass (the tier's first rule); this module judges first packets.

use std::net::IpAddr;

use super::cnp::{self, ClusterNetworkPolicy};
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
    /// Decided by rule `rule` (index in its direction's list) of ClusterNetworkPolicy
    /// `policy` of `tier`: accepted or denied. (A `Pass` decides nothing: the next tier does;
    /// one in the Baseline tier leaves the default.)
    Cluster {
        /// The tier.
        tier: cnp::Tier,
        /// The policy's name.
        policy: String,
        /// Index of the rule.
        rule: usize,
        /// Accept (true) or Deny.
        accept: bool,
    },
}

impl Side {
    /// Whether this direction lets the packet through.
    pub fn allows(&self) -> bool {
        match self {
            Self::Denied { .. } => false,
            Self::Cluster { accept, .. } => *accept,
            _ => true,
        }
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
        .map(AsRef::as_ref)
        .filter(|p| {
            p.namespace == pod.namespace
                && rules_of(p).is_some()
                && p.pod_selector.matches(&pod.labels)
        })
        .collect();
    v.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    v
}

/// The NetworkPolicies' outcome for `pod` in one direction.
fn np_side(
    cluster: &Cluster,
    pod: &Pod,
    rules_of: fn(&NetworkPolicy) -> Option<&Vec<Rule>>,
    far: Option<&Pod>,
    far_ip: IpAddr,
    flow: &Flow<'_>,
) -> Side {
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

/// Whether a ClusterNetworkPolicy `peer` matches the far end (`pod` when it is a pod, `ip` its
/// address as the gateway sees it). `networks` name addresses as this cluster sees them, as
/// `ipBlock`s do; a peer peerwall does not enforce matches everything in a `Deny` or `Pass`
/// rule and nothing in an `Accept` (the API's fail-closed reading).
fn cnp_peer_matches(
    cluster: &Cluster,
    peer: &cnp::Peer,
    action: cnp::Action,
    pod: Option<&Pod>,
    ip: IpAddr,
) -> bool {
    match peer {
        cnp::Peer::Unsupported(_) => action != cnp::Action::Accept,
        cnp::Peer::Networks(nets) => nets.iter().any(|n| {
            let block = Peer::Block(super::IpBlock {
                cidr: *n,
                except: Vec::new(),
            });
            peer_matches(cluster, "", &block, pod, ip)
        }),
        _ => pod
            .is_some_and(|p| cnp::peer_selects_pod(peer, p, cluster.namespaces.get(&p.namespace))),
    }
}

/// The first rule of `rules` matching the far end, with its index.
fn cnp_first<'a>(
    cluster: &Cluster,
    rules: &'a [cnp::Rule],
    far: Option<&Pod>,
    far_ip: IpAddr,
    flow: &Flow<'_>,
) -> Option<(usize, &'a cnp::Rule)> {
    rules.iter().enumerate().find(|(_, r)| {
        r.peers
            .iter()
            .any(|p| cnp_peer_matches(cluster, p, r.action, far, far_ip))
            && (r.ports.is_empty() || r.ports.iter().any(|p| port_matches(p, flow)))
    })
}

/// What one ClusterNetworkPolicy tier did with a direction of a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TierOutcome {
    /// An `Accept` or `Deny` rule decided ([`Side::Cluster`]).
    Decided(Side),
    /// Rule `rule` of policy `policy` passed to the next tier.
    Passed {
        /// The policy.
        policy: String,
        /// Index of the rule.
        rule: usize,
    },
    /// No rule of a policy selecting the pod matched.
    NoMatch,
}

/// One ClusterNetworkPolicy tier for `pod` in one direction.
fn cnp_tier(
    cluster: &Cluster,
    tier: cnp::Tier,
    pod: &Pod,
    rules_of: fn(&ClusterNetworkPolicy) -> &Vec<cnp::Rule>,
    far: Option<&Pod>,
    far_ip: IpAddr,
    flow: &Flow<'_>,
) -> TierOutcome {
    let ns = cluster.namespaces.get(&pod.namespace);
    for p in cnp::order(cluster.cluster_policies.iter(), tier) {
        if !p.selects(pod, ns) {
            continue;
        }
        if let Some((i, r)) = cnp_first(cluster, rules_of(p), far, far_ip, flow) {
            return match r.action {
                cnp::Action::Pass => TierOutcome::Passed {
                    policy: p.name.clone(),
                    rule: i,
                },
                a => TierOutcome::Decided(Side::Cluster {
                    tier,
                    policy: p.name.clone(),
                    rule: i,
                    accept: a == cnp::Action::Accept,
                }),
            };
        }
    }
    TierOutcome::NoMatch
}

/// Every step of one direction of `pod`, in order: the Admin tier's outcome, then (unless it
/// decided) the NetworkPolicies', then (unless they decided) the Baseline tier's. The last
/// step decides; a Baseline step that decides nothing leaves the default (allowed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// A ClusterNetworkPolicy tier.
    Tier(cnp::Tier, TierOutcome),
    /// The NetworkPolicies.
    NetworkPolicies(Side),
}

fn steps(
    cluster: &Cluster,
    pod: &Pod,
    rules_of: fn(&NetworkPolicy) -> Option<&Vec<Rule>>,
    cnp_rules_of: fn(&ClusterNetworkPolicy) -> &Vec<cnp::Rule>,
    far: Option<&Pod>,
    far_ip: IpAddr,
    flow: &Flow<'_>,
) -> Vec<Step> {
    let admin = cnp_tier(
        cluster,
        cnp::Tier::Admin,
        pod,
        cnp_rules_of,
        far,
        far_ip,
        flow,
    );
    let decided = matches!(admin, TierOutcome::Decided(_));
    let mut out = vec![Step::Tier(cnp::Tier::Admin, admin)];
    if decided {
        return out;
    }
    let np = np_side(cluster, pod, rules_of, far, far_ip, flow);
    let isolated = np != Side::NotIsolated;
    out.push(Step::NetworkPolicies(np));
    if isolated {
        return out;
    }
    let base = cnp_tier(
        cluster,
        cnp::Tier::Baseline,
        pod,
        cnp_rules_of,
        far,
        far_ip,
        flow,
    );
    out.push(Step::Tier(cnp::Tier::Baseline, base));
    out
}

/// The steps of both directions of `flow` (egress of the source, ingress of the destination;
/// empty for an end that is not a pod of the cluster: it is open).
pub fn trace(cluster: &Cluster, flow: &Flow<'_>) -> (Vec<Step>, Vec<Step>) {
    let egress = flow.src_pod.map_or_else(Vec::new, |pod| {
        steps(
            cluster,
            pod,
            |p| p.egress.as_ref(),
            |p| &p.egress,
            flow.dst_pod,
            flow.dst,
            flow,
        )
    });
    let ingress = flow.dst_pod.map_or_else(Vec::new, |pod| {
        steps(
            cluster,
            pod,
            |p| p.ingress.as_ref(),
            |p| &p.ingress,
            flow.src_pod,
            flow.src,
            flow,
        )
    });
    (egress, ingress)
}

impl Step {
    /// One line for a person: which tier, what it did, which policy and rule.
    pub fn describe(&self) -> String {
        match self {
            Step::Tier(
                t,
                TierOutcome::Decided(Side::Cluster {
                    policy,
                    rule,
                    accept,
                    ..
                }),
            ) => {
                format!(
                    "{} tier: {} by ClusterNetworkPolicy {policy}, rule {rule}",
                    t.name(),
                    if *accept { "accepted" } else { "denied" }
                )
            }
            Step::Tier(t, TierOutcome::Decided(other)) => format!("{} tier: {other:?}", t.name()),
            Step::Tier(t, TierOutcome::Passed { policy, rule }) => format!(
                "{} tier: passed on by ClusterNetworkPolicy {policy}, rule {rule}",
                t.name()
            ),
            Step::Tier(cnp::Tier::Admin, TierOutcome::NoMatch) => {
                "Admin tier: no rule matches".to_string()
            }
            Step::Tier(cnp::Tier::Baseline, TierOutcome::NoMatch) => {
                "Baseline tier: no rule matches; the default allows".to_string()
            }
            Step::NetworkPolicies(Side::NotIsolated) => {
                "NetworkPolicies: none isolates the pod".to_string()
            }
            Step::NetworkPolicies(Side::Allowed { policy, rule }) => {
                format!("NetworkPolicies: allowed by {policy}, rule {rule}")
            }
            Step::NetworkPolicies(Side::Denied { policies }) => format!(
                "NetworkPolicies: isolated by {} and no rule allows it: denied",
                policies.join(", ")
            ),
            Step::NetworkPolicies(other) => format!("NetworkPolicies: {other:?}"),
        }
    }
}

/// The side the steps of one direction come to.
fn outcome(steps: &[Step]) -> Side {
    match steps.last() {
        Some(Step::Tier(_, TierOutcome::Decided(s))) | Some(Step::NetworkPolicies(s)) => s.clone(),
        _ => Side::NotIsolated,
    }
}

/// The decision for the first packet of `flow`: both directions, each through the Admin
/// tier, the NetworkPolicies and the Baseline tier ([`trace`]).
pub fn decide(cluster: &Cluster, flow: &Flow<'_>) -> Decision {
    let (egress, ingress) = trace(cluster, flow);
    Decision {
        egress: outcome(&egress),
        ingress: outcome(&ingress),
    }
}
