//! Companion NetworkPolicies for a CNI that enforces ClusterNetworkPolicy itself. Such a CNI
//! sees pods running on a peer as bare addresses, so an Admin `Accept` rule naming them by
//! namespace or pod labels does not match there and the CNI goes on: at ingress no later Admin
//! or Baseline rule can match the address either (their peers are namespaces and pods), so the
//! only refusal left is a NetworkPolicy isolating the local pod; at egress the same, or a later
//! rule whose `networks` covers the address (not covered here: it would need a
//! ClusterNetworkPolicy placed between two rules of the user's, which priorities cannot do).
//!
//! For each user NetworkPolicy that isolates pods in a direction, and each Admin
//! ClusterNetworkPolicy whose subject can select some of those pods and whose `Accept` rules of
//! that direction name remote pods, one companion NetworkPolicy in the user policy's namespace:
//! its `podSelector` is the conjunction of the user policy's and the subject's (so it selects
//! only pods the user's policy already isolates, and isolates nothing new), its rules the remote
//! pods those `Accept` rules select, as `ipBlock`s with the rules' ports (an egress named port
//! resolved per remote pod, as for the NetworkPolicies' companions). The CNI then lets through
//! what the Admin tier accepts for remote pods; it may let through more (an earlier Admin `Deny`
//! naming the remote pod by label does not match there either), which the gateway, enforcing the
//! whole semantics, still refuses: a packet crosses both.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::{direction_rules, selector_json, Companion, RemotePods, COMPANION_OF};
use crate::cnp::{
    order, Action, ClusterNetworkPolicy, Peer as CnpPeer, Rule as CnpRule, Subject, Tier,
};
use crate::{Cluster, NetworkPolicy, Peer, Rule, Selector};

/// Label naming the ClusterNetworkPolicy a companion carries the `Accept` rules of.
pub const COMPANION_OF_CLUSTER_POLICY: &str = "peerwall.io/companion-of-clusternetworkpolicy";

/// Name of the companion carrying `cnp`'s Admin accepts for the pods the NetworkPolicy `np`
/// isolates: readable, and unique per pair whatever their lengths (the pair's hash is kept when
/// the name is cut to 253 characters).
pub fn name(np: &str, cnp: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in np.bytes().chain([0]).chain(cnp.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let tail = format!("-{h:016x}");
    let mut head = format!("peerwall-cnp-{cnp}-for-{np}");
    head.truncate(253 - tail.len());
    while head.ends_with(['-', '.']) {
        head.pop();
    }
    head + &tail
}

/// The conjunction of two label selectors, None when no labels can satisfy both (one key
/// required with two values).
fn both(a: &Selector, b: &Selector) -> Option<Selector> {
    let mut labels = a.labels.clone();
    for (k, v) in &b.labels {
        if labels.get(k).is_some_and(|w| w != v) {
            return None;
        }
        labels.insert(k.clone(), v.clone());
    }
    let mut exprs = a.exprs.clone();
    exprs.extend(b.exprs.iter().cloned());
    Some(Selector { labels, exprs })
}

/// A ClusterNetworkPolicy peer as the NetworkPolicy peer selecting the same pods (`networks`
/// as `ipBlock`s, for the named ports of the remote pods they cover); None for a peer
/// peerwall does not enforce (it matches nothing in an `Accept` rule).
fn as_peers(peer: &CnpPeer) -> Vec<Peer> {
    match peer {
        CnpPeer::Namespaces(ns) => vec![Peer::Pods {
            namespaces: Some(ns.clone()),
            pods: None,
        }],
        CnpPeer::Pods { namespaces, pods } => vec![Peer::Pods {
            namespaces: Some(namespaces.clone()),
            pods: Some(pods.clone()),
        }],
        CnpPeer::Networks(nets) => nets
            .iter()
            .map(|cidr| {
                Peer::Block(crate::IpBlock {
                    cidr: *cidr,
                    except: Vec::new(),
                })
            })
            .collect(),
        CnpPeer::Unsupported(_) => Vec::new(),
    }
}

/// The `Accept` rules of one direction as NetworkPolicy rules (rules left with no peer it
/// enforces dropped: an empty peer list would mean everyone).
fn accepts(rules: &[CnpRule]) -> Vec<Rule> {
    rules
        .iter()
        .filter(|r| r.action == Action::Accept)
        .map(|r| Rule {
            peers: r.peers.iter().flat_map(as_peers).collect(),
            ports: r.ports.clone(),
        })
        .filter(|r| !r.peers.is_empty())
        .collect()
}

/// An Admin ClusterNetworkPolicy with its companion rules per direction (ingress, egress),
/// computed once: its peers name namespaces explicitly, so the rules are the same beside every
/// NetworkPolicy (only the selector and the namespace differ).
struct Admin<'a> {
    cnp: &'a ClusterNetworkPolicy,
    rules: [Vec<Value>; 2],
}

impl<'a> Admin<'a> {
    fn new(cluster: &Cluster, remote: &RemotePods<'_>, cnp: &'a ClusterNetworkPolicy) -> Self {
        // The namespace only matters to a peer without a namespace selector: none here.
        let of = |rules: &[CnpRule], egress| {
            direction_rules(cluster, remote, "", &accepts(rules), egress)
        };
        Self {
            cnp,
            rules: [of(&cnp.ingress, false), of(&cnp.egress, true)],
        }
    }
}

/// The companion of the pair (`np`, `admin`), None when it would carry no rule.
fn companion(cluster: &Cluster, np: &NetworkPolicy, admin: &Admin<'_>) -> Option<Value> {
    let cnp = admin.cnp;
    if admin.rules.iter().all(Vec::is_empty) {
        return None;
    }
    let ns_labels = cluster.namespaces.get(&np.namespace)?;
    let pods = match &cnp.subject {
        Subject::Namespaces(ns) => ns.matches(ns_labels).then(Selector::default)?,
        Subject::Pods { namespaces, pods } => {
            namespaces.matches(ns_labels).then(|| pods.clone())?
        }
    };
    let selector = both(&np.pod_selector, &pods)?;
    let mut spec = json!({"podSelector": selector_json(&selector)});
    let mut types = Vec::new();
    for (egress, isolates, out) in [
        (false, np.ingress.is_some(), &admin.rules[0]),
        (true, np.egress.is_some(), &admin.rules[1]),
    ] {
        if !isolates || out.is_empty() {
            continue;
        }
        let (kind, key) = if egress {
            ("Egress", "egress")
        } else {
            ("Ingress", "ingress")
        };
        types.push(kind);
        spec[key] = Value::Array(out.clone());
    }
    if types.is_empty() {
        return None;
    }
    spec["policyTypes"] = json!(types);
    Some(json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": name(&np.name, &cnp.name),
            "namespace": np.namespace,
            "labels": {
                peerwall_intent::labels::MANAGED_BY: peerwall_intent::labels::MANAGER,
                COMPANION_OF: super::companion_label(&np.name),
                COMPANION_OF_CLUSTER_POLICY: super::companion_label(&cnp.name),
            },
        },
        "spec": spec,
    }))
}

/// The companions of every (NetworkPolicy, Admin ClusterNetworkPolicy) pair that needs one,
/// each owned by its NetworkPolicy.
pub(crate) fn companions<'a>(
    cluster: &'a Cluster,
    remote: &RemotePods<'_>,
    policies: impl Iterator<Item = &'a NetworkPolicy>,
) -> Vec<Companion> {
    let admin: Vec<Admin<'_>> = order(cluster.cluster_policies.iter(), Tier::Admin)
        .into_iter()
        .map(|cnp| Admin::new(cluster, remote, cnp))
        .collect();
    let mut out = BTreeMap::new();
    for np in policies {
        for a in &admin {
            if let Some(object) = companion(cluster, np, a) {
                out.insert(
                    (np.namespace.clone(), name(&np.name, &a.cnp.name)),
                    Companion {
                        owner: np.name.clone(),
                        object,
                    },
                );
            }
        }
    }
    out.into_values().collect()
}
