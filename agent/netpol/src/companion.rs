//! Companion NetworkPolicies for the CNI at the local end. A label-aware CNI enforcing a
//! user's NetworkPolicy sees pods running on a peer as unknown addresses: a policy that names
//! them by label (`podSelector`, `namespaceSelector`) is dropped there, before or after the
//! gateway. For each such policy the controller keeps a companion in the same namespace, with
//! the same `podSelector` and `policyTypes`, whose peers are those remote pods' addresses as
//! this cluster sees them (`ipBlock` /32 or /128) and whose ports are the user's (a named port
//! of a remote destination resolved to its number, which the CNI cannot do): the CNI then
//! allows what the user's policy allows, and nothing more. NetworkPolicies add up, and the
//! companion selects only pods the user's policy already isolates, so it isolates nothing new.
//! The user's object is never modified.

pub mod admin;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde_json::{json, Value};

use super::{Cluster, NetworkPolicy, Operator, Peer, Pod, Port, Ports, Rule, Selector};

/// Label naming the user's NetworkPolicy a companion stands beside.
pub const COMPANION_OF: &str = "peerwall.io/companion-of";

/// At most this many addresses in one companion: a larger one is not written (reported).
pub const MAX_ADDRESSES: usize = 2000;

/// Name of the companion of the NetworkPolicy `name` (at most 253 characters).
pub fn name(policy: &str) -> String {
    let mut n = format!("peerwall-{policy}");
    n.truncate(253);
    n
}

/// A label selector as the API writes it.
pub(crate) fn selector_json(s: &Selector) -> Value {
    let mut v = json!({});
    if !s.labels.is_empty() {
        v["matchLabels"] = json!(s.labels);
    }
    if !s.exprs.is_empty() {
        v["matchExpressions"] = Value::Array(
            s.exprs
                .iter()
                .map(|r| {
                    let op = match r.op {
                        Operator::In => "In",
                        Operator::NotIn => "NotIn",
                        Operator::Exists => "Exists",
                        Operator::DoesNotExist => "DoesNotExist",
                    };
                    let mut e = json!({"key": r.key, "operator": op});
                    if matches!(r.op, Operator::In | Operator::NotIn) {
                        e["values"] = json!(r.values);
                    }
                    e
                })
                .collect(),
        );
    }
    v
}

fn port_json(p: &Port, number: Option<u16>) -> Value {
    let mut v = json!({"protocol": p.protocol.name()});
    match (&p.ports, number) {
        (_, Some(n)) => v["port"] = json!(n),
        (Ports::All, None) => {}
        (Ports::Range(lo, hi), None) => {
            v["port"] = json!(lo);
            if hi != lo {
                v["endPort"] = json!(hi);
            }
        }
        (Ports::Named(n), None) => v["port"] = json!(n),
    }
    v
}

fn block(ip: IpAddr) -> Value {
    let len = if ip.is_ipv4() { 32 } else { 128 };
    json!({"ipBlock": {"cidr": format!("{ip}/{len}")}})
}

/// The cluster's remote pods (those on a peer), in the cluster's order, with the positions
/// of each namespace's: a rule's pod peers are looked for only in the namespaces they can
/// select. Built once for every companion of a pass; scanning every pod of the cluster per
/// rule made the companions a quarter of the controller's pass at 1,000 policies and 10,000
/// pods (perf on `bench-netpol`'s API-server part).
#[derive(Default)]
pub(crate) struct RemotePods<'a> {
    pods: Vec<&'a Pod>,
    by_ns: BTreeMap<&'a str, Vec<usize>>,
}

impl<'a> RemotePods<'a> {
    pub(crate) fn of(cluster: &'a Cluster) -> Self {
        let pods: Vec<&Pod> = cluster
            .pods
            .iter()
            .map(|p| &**p)
            .filter(|p| p.peer.is_some())
            .collect();
        let mut by_ns: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, p) in pods.iter().enumerate() {
            by_ns.entry(p.namespace.as_str()).or_default().push(i);
        }
        Self { pods, by_ns }
    }

    /// The remote pods the pod peers of `rule` (in a policy of `ns`) select, in the cluster's
    /// order. Each candidate still passes [`Cluster::peer_selects_pod`]: the namespaces only
    /// narrow where it is asked.
    fn selected_by(&self, cluster: &Cluster, ns: &str, rule: &Rule) -> Vec<&'a Pod> {
        let mut hits: Vec<usize> = Vec::new();
        for peer in &rule.peers {
            let Peer::Pods { namespaces, .. } = peer else {
                continue;
            };
            let candidates: Vec<&Vec<usize>> = match namespaces {
                None => self.by_ns.get(ns).into_iter().collect(),
                Some(_) => self
                    .by_ns
                    .iter()
                    .filter(|(n, _)| cluster.peer_namespace_holds(ns, namespaces.as_ref(), n))
                    .map(|(_, v)| v)
                    .collect(),
            };
            for list in candidates {
                hits.extend(
                    list.iter()
                        .copied()
                        .filter(|&i| cluster.peer_selects_pod(ns, peer, self.pods[i])),
                );
            }
        }
        hits.sort_unstable();
        hits.dedup();
        hits.into_iter().map(|i| self.pods[i]).collect()
    }
}

/// The companion rules of one direction's rules (of a policy in `ns`): for each rule naming
/// remote pods, those pods' addresses as `ipBlock`s with its ports.
pub(crate) fn direction_rules(
    cluster: &Cluster,
    remote_pods: &RemotePods<'_>,
    ns: &str,
    rules: &[Rule],
    egress: bool,
) -> Vec<Value> {
    let key = if egress { "to" } else { "from" };
    let mut out = Vec::new();
    for rule in rules {
        let named = rule
            .ports
            .iter()
            .any(|p| matches!(p.ports, Ports::Named(_)));
        // A named port of an egress rule resolves against the destination pod: for a remote
        // one the CNI cannot, whichever peer (any, a selector, an ipBlock) let it through.
        let resolve = egress && named;
        let remote: Vec<&Pod> = if resolve {
            remote_pods
                .pods
                .iter()
                .copied()
                .filter(|p| {
                    rule.peers.is_empty()
                        || rule.peers.iter().any(|peer| match peer {
                            Peer::Block(b) => p.ips.iter().any(|ip| b.contains(*ip)),
                            Peer::Pods { .. } => cluster.peer_selects_pod(ns, peer, p),
                        })
                })
                .collect()
        } else if rule.peers.is_empty() {
            // Everyone already: the CNI allows remote pods too.
            continue;
        } else {
            remote_pods.selected_by(cluster, ns, rule)
        };
        if remote.is_empty() {
            continue;
        }
        if !resolve {
            let peers: Vec<Value> = remote
                .iter()
                .flat_map(|p| p.local_ips().iter().map(|ip| block(*ip)))
                .collect();
            let mut r = json!({ key: peers });
            if !rule.ports.is_empty() {
                r["ports"] = Value::Array(rule.ports.iter().map(|p| port_json(p, None)).collect());
            }
            out.push(r);
            continue;
        }
        // Egress with named ports: a remote destination's names resolved here, pods grouped
        // by the numbers they give.
        let mut groups: BTreeMap<Vec<String>, Vec<&Pod>> = BTreeMap::new();
        for pod in &remote {
            let ports: Vec<String> = rule
                .ports
                .iter()
                .filter_map(|p| match &p.ports {
                    Ports::Named(n) => pod
                        .named_port(n, p.protocol)
                        .map(|num| port_json(p, Some(num)).to_string()),
                    _ => Some(port_json(p, None).to_string()),
                })
                .collect();
            if !ports.is_empty() {
                groups.entry(ports).or_default().push(pod);
            }
        }
        for (ports, pods) in groups {
            let peers: Vec<Value> = pods
                .iter()
                .flat_map(|p| p.local_ips().iter().map(|ip| block(*ip)))
                .collect();
            let ports: Vec<Value> = ports
                .iter()
                .filter_map(|p| serde_json::from_str(p).ok())
                .collect();
            out.push(json!({ key: peers, "ports": ports }));
        }
    }
    out
}

/// The companion of `policy` (a NetworkPolicy object; the controller adds the owner
/// reference), None when its rules name no remote pod by label. Err when it would exceed
/// [`MAX_ADDRESSES`].
pub fn companion(cluster: &Cluster, policy: &NetworkPolicy) -> Result<Option<Value>, String> {
    companion_among(cluster, &RemotePods::of(cluster), policy)
}

/// [`companion`] with the cluster's remote pods indexed once for every policy.
fn companion_among(
    cluster: &Cluster,
    remote: &RemotePods<'_>,
    policy: &NetworkPolicy,
) -> Result<Option<Value>, String> {
    let ingress = policy
        .ingress
        .as_ref()
        .map(|r| direction_rules(cluster, remote, &policy.namespace, r, false))
        .unwrap_or_default();
    let egress = policy
        .egress
        .as_ref()
        .map(|r| direction_rules(cluster, remote, &policy.namespace, r, true))
        .unwrap_or_default();
    if ingress.is_empty() && egress.is_empty() {
        return Ok(None);
    }
    let addresses = address_count(ingress.iter().chain(&egress));
    if addresses > MAX_ADDRESSES {
        return Err(too_many(addresses));
    }
    let mut types = Vec::new();
    let mut spec = json!({"podSelector": selector_json(&policy.pod_selector)});
    if policy.ingress.is_some() {
        types.push("Ingress");
        spec["ingress"] = Value::Array(ingress);
    }
    if policy.egress.is_some() {
        types.push("Egress");
        spec["egress"] = Value::Array(egress);
    }
    spec["policyTypes"] = json!(types);
    Ok(Some(json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": name(&policy.name),
            "namespace": policy.namespace,
            "labels": {
                peerwall_intent::labels::MANAGED_BY: peerwall_intent::labels::MANAGER,
                COMPANION_OF: companion_label(&policy.name),
            },
        },
        "spec": spec,
    })))
}

/// The value of [`COMPANION_OF`] for the policy `name` (label values are at most 63
/// characters: longer names are cut).
pub fn companion_label(name: &str) -> String {
    let mut v: String = name.chars().take(63).collect();
    while v.ends_with(['-', '.', '_']) {
        v.pop();
    }
    v
}

/// How many addresses companion rules list.
fn address_count<'a>(rules: impl Iterator<Item = &'a Value>) -> usize {
    rules
        .map(|r| {
            r["from"]
                .as_array()
                .or(r["to"].as_array())
                .map_or(0, Vec::len)
        })
        .sum()
}

fn too_many(addresses: usize) -> String {
    format!(
        "its companion for the CNI would list {addresses} remote pod addresses (at most {MAX_ADDRESSES}): not written, so a label-aware CNI may still drop what it allows towards remote pods"
    )
}

/// A companion NetworkPolicy and the user's NetworkPolicy it stands beside (its owner, in the
/// same namespace).
#[derive(Clone, Debug, PartialEq)]
pub struct Companion {
    /// `metadata.name` of the user's NetworkPolicy.
    pub owner: String,
    /// The companion object (a `networking.k8s.io/v1` NetworkPolicy, without owner reference).
    pub object: Value,
}

/// Whether a NetworkPolicy named `name` with `labels` is a companion peerwall keeps.
pub fn is_companion(labels: &BTreeMap<String, String>) -> bool {
    labels
        .get(peerwall_intent::labels::MANAGED_BY)
        .map(String::as_str)
        == Some(peerwall_intent::labels::MANAGER)
        && labels.contains_key(COMPANION_OF)
}

/// Every companion of `cluster`'s policies (their own companions and peerwall's policies
/// aside): those of the NetworkPolicies' rules, and those of the Admin ClusterNetworkPolicies'
/// accepts for the pods a NetworkPolicy isolates ([`admin`]); and the
/// policies (`namespace/name`) whose companion is too large, with why. Two companions never
/// share a name: where they would, the NetworkPolicy's own is kept.
pub fn companions(
    cluster: &Cluster,
    is_ours: impl Fn(&NetworkPolicy) -> bool,
) -> (Vec<Companion>, Vec<(String, String)>) {
    let mut out: Vec<Companion> = Vec::new();
    let mut too_large = Vec::new();
    let users = || {
        cluster
            .policies
            .iter()
            .map(AsRef::as_ref)
            .filter(|p| !is_ours(p))
    };
    // Without a user's policy there is no companion (the Admin tier's stand beside one):
    // nothing to index, and a pass of a cluster without NetworkPolicies stays free of a walk
    // over every pod (100,000 remote ones in `bench-control`, on the runtime's worker).
    let remote = if users().next().is_some() {
        RemotePods::of(cluster)
    } else {
        RemotePods::default()
    };
    for p in users() {
        match companion_among(cluster, &remote, p) {
            Ok(Some(object)) => out.push(Companion {
                owner: p.name.clone(),
                object,
            }),
            Ok(None) => {}
            Err(why) => too_large.push((format!("{}/{}", p.namespace, p.name), why)),
        }
    }
    let key = |c: &Companion| {
        (
            c.object["metadata"]["namespace"].to_string(),
            c.object["metadata"]["name"].to_string(),
        )
    };
    let taken: std::collections::BTreeSet<_> = out.iter().map(key).collect();
    for c in admin::companions(cluster, &remote, users()) {
        if taken.contains(&key(&c)) {
            continue;
        }
        let addresses = address_count(
            ["ingress", "egress"]
                .iter()
                .filter_map(|d| c.object["spec"][*d].as_array())
                .flatten(),
        );
        if addresses > MAX_ADDRESSES {
            let ns = c.object["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default();
            too_large.push((format!("{ns}/{}", c.owner), too_many(addresses)));
            continue;
        }
        out.push(c);
    }
    (out, too_large)
}
