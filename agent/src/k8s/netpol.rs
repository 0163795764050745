//! The Kubernetes edge of the NetworkPolicy tier: API objects (`networking.k8s.io/v1`
//! NetworkPolicies, Pods, Namespaces, Liqo's virtual nodes and remaps) into the pure
//! [`crate::netpol::Cluster`], with the API server's defaults applied. A policy peerwall cannot
//! read (a malformed CIDR, an `endPort` with a named port, an unknown protocol) is left out
//! and reported with its field path: the policies that read stay enforced.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::networking::v1 as np;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;

use crate::netpol::{self, Cluster};
use crate::protection::Remap;

/// The label every namespace carries with its name (API servers from 1.21 set it; for older
/// ones and snapshots it is filled in, so selectors on it hold everywhere).
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// A policy (or part of one) that could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unreadable {
    /// `namespace/name`.
    pub policy: String,
    /// Field path and value.
    pub why: String,
}

fn selector(s: &LabelSelector, path: &str) -> Result<netpol::Selector, String> {
    let mut out = netpol::Selector {
        labels: s.match_labels.clone().unwrap_or_default(),
        exprs: Vec::new(),
    };
    for (i, e) in s.match_expressions.iter().flatten().enumerate() {
        let Some(op) = netpol::Operator::parse(&e.operator) else {
            return Err(format!(
                "{path}.matchExpressions[{i}].operator: unknown operator {:?} (In, NotIn, Exists, DoesNotExist)",
                e.operator
            ));
        };
        out.exprs.push(netpol::Requirement {
            key: e.key.clone(),
            op,
            values: e.values.clone().unwrap_or_default(),
        });
    }
    Ok(out)
}

fn protocol(p: Option<&str>, path: &str) -> Result<netpol::Protocol, String> {
    match p.unwrap_or("TCP") {
        "TCP" => Ok(netpol::Protocol::Tcp),
        "UDP" => Ok(netpol::Protocol::Udp),
        "SCTP" => Ok(netpol::Protocol::Sctp),
        other => Err(format!(
            "{path}.protocol: unknown protocol {other:?} (TCP, UDP, SCTP)"
        )),
    }
}

fn port(p: &np::NetworkPolicyPort, path: &str) -> Result<netpol::Port, String> {
    let protocol = protocol(p.protocol.as_deref(), path)?;
    let ports = match (&p.port, p.end_port) {
        (None, None) => netpol::Ports::All,
        (None, Some(_)) => return Err(format!("{path}.endPort: set without port")),
        (Some(IntOrString::Int(n)), end) => {
            let lo = u16::try_from(*n)
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{path}.port: {n} is not a port (1-65535)"))?;
            let hi = match end {
                None => lo,
                Some(e) => u16::try_from(e)
                    .ok()
                    .filter(|e| *e >= lo)
                    .ok_or_else(|| format!("{path}.endPort: {e} is not a port at or above {lo}"))?,
            };
            netpol::Ports::Range(lo, hi)
        }
        (Some(IntOrString::String(name)), None) => match name.parse::<u16>() {
            Ok(n) if n > 0 => netpol::Ports::Range(n, n),
            _ => netpol::Ports::Named(name.clone()),
        },
        (Some(IntOrString::String(name)), Some(_)) => {
            return Err(format!(
                "{path}.endPort: a range needs a numeric port, not the named port {name:?}"
            ))
        }
    };
    Ok(netpol::Port { protocol, ports })
}

fn peer(p: &np::NetworkPolicyPeer, path: &str) -> Result<netpol::Peer, String> {
    if let Some(b) = &p.ip_block {
        let cidr: ipnet::IpNet = b
            .cidr
            .parse()
            .map_err(|_| format!("{path}.ipBlock.cidr: {:?} is not a CIDR", b.cidr))?;
        let mut except = Vec::new();
        for (i, e) in b.except.iter().flatten().enumerate() {
            except.push(
                e.parse()
                    .map_err(|_| format!("{path}.ipBlock.except[{i}]: {e:?} is not a CIDR"))?,
            );
        }
        return Ok(netpol::Peer::Block(netpol::IpBlock {
            cidr: cidr.trunc(),
            except,
        }));
    }
    Ok(netpol::Peer::Pods {
        namespaces: p
            .namespace_selector
            .as_ref()
            .map(|s| selector(s, &format!("{path}.namespaceSelector")))
            .transpose()?,
        pods: p
            .pod_selector
            .as_ref()
            .map(|s| selector(s, &format!("{path}.podSelector")))
            .transpose()?,
    })
}

fn rule(
    peers: Option<&Vec<np::NetworkPolicyPeer>>,
    ports: Option<&Vec<np::NetworkPolicyPort>>,
    path: &str,
    peers_field: &str,
) -> Result<netpol::Rule, String> {
    Ok(netpol::Rule {
        peers: peers
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(i, p)| peer(p, &format!("{path}.{peers_field}[{i}]")))
            .collect::<Result<_, _>>()?,
        ports: ports
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(i, p)| port(p, &format!("{path}.ports[{i}]")))
            .collect::<Result<_, _>>()?,
    })
}

/// The rules of one direction (`field`: `ingress` or `egress`), each given as its peers
/// (`peers_field`: `from` or `to`) and ports.
fn rules<'a>(
    list: impl Iterator<
        Item = (
            Option<&'a Vec<np::NetworkPolicyPeer>>,
            Option<&'a Vec<np::NetworkPolicyPort>>,
        ),
    >,
    field: &str,
    peers_field: &str,
) -> Result<Vec<netpol::Rule>, String> {
    list.enumerate()
        .map(|(i, (peers, ports))| rule(peers, ports, &format!("spec.{field}[{i}]"), peers_field))
        .collect()
}

/// One NetworkPolicy, defaults applied (`policyTypes` absent: Ingress, plus Egress when
/// `spec.egress` is set).
pub fn policy(p: &np::NetworkPolicy) -> Result<netpol::NetworkPolicy, Unreadable> {
    let key = format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any());
    let fail = |why: String| Unreadable {
        policy: key.clone(),
        why,
    };
    let spec = p.spec.clone().unwrap_or_default();
    let types: Vec<String> = spec.policy_types.clone().unwrap_or_else(|| {
        let mut t = vec!["Ingress".to_string()];
        if spec.egress.as_ref().is_some_and(|e| !e.is_empty()) {
            t.push("Egress".into());
        }
        t
    });
    for (i, t) in types.iter().enumerate() {
        if t != "Ingress" && t != "Egress" {
            return Err(fail(format!(
                "spec.policyTypes[{i}]: unknown type {t:?} (Ingress, Egress)"
            )));
        }
    }
    let isolates = |kind: &str| types.iter().any(|t| t == kind);
    let ingress = isolates("Ingress")
        .then(|| {
            rules(
                spec.ingress
                    .iter()
                    .flatten()
                    .map(|r| (r.from.as_ref(), r.ports.as_ref())),
                "ingress",
                "from",
            )
        })
        .transpose()
        .map_err(fail)?;
    let egress = isolates("Egress")
        .then(|| {
            rules(
                spec.egress
                    .iter()
                    .flatten()
                    .map(|r| (r.to.as_ref(), r.ports.as_ref())),
                "egress",
                "to",
            )
        })
        .transpose()
        .map_err(fail)?;
    Ok(netpol::NetworkPolicy {
        namespace: p.namespace().unwrap_or_default(),
        name: p.name_any(),
        pod_selector: selector(&spec.pod_selector.unwrap_or_default(), "spec.podSelector")
            .map_err(fail)?,
        ingress,
        egress,
    })
}

/// The addresses of a pod (`status.podIPs`, else `status.podIP`).
pub fn pod_ips(p: &Pod) -> Vec<IpAddr> {
    let status = p.status.as_ref();
    let mut ips: Vec<IpAddr> = status
        .and_then(|s| s.pod_ips.as_ref())
        .map(|v| v.iter().filter_map(|i| i.ip.parse().ok()).collect())
        .unwrap_or_default();
    if ips.is_empty() {
        ips.extend(
            status
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|i| i.parse::<IpAddr>().ok()),
        );
    }
    ips
}

/// Whether a pod is gone for traffic (finished, or being deleted).
fn gone(p: &Pod) -> bool {
    let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
    p.metadata.deletion_timestamp.is_some() || matches!(phase, Some("Succeeded" | "Failed"))
}

/// The cluster as NetworkPolicies see it: virtual nodes (`liqo.io/type=virtual-node`) tell
/// which pods run on which peer, and a remote pod is known by the address its packets carry
/// through that peer's tunnel (`remaps`, from Liqo's `Configuration`s).
pub fn cluster<'a>(
    namespaces: impl IntoIterator<Item = &'a Namespace>,
    nodes: impl IntoIterator<Item = &'a Node>,
    pods: impl IntoIterator<Item = &'a Pod>,
    policies: impl IntoIterator<Item = &'a np::NetworkPolicy>,
    remaps: &BTreeMap<String, Vec<Remap>>,
) -> (Cluster, Vec<Unreadable>) {
    let vnode_peer: BTreeMap<String, String> = nodes
        .into_iter()
        .filter(|n| n.labels().get(super::NODE_TYPE).map(String::as_str) == Some("virtual-node"))
        .filter_map(|n| {
            n.labels()
                .get(super::REMOTE_CLUSTER_ID)
                .map(|id| (n.name_any(), id.clone()))
        })
        .collect();
    let mut c = Cluster::default();
    for n in namespaces {
        let mut labels = n.labels().clone();
        labels
            .entry(NAMESPACE_NAME_LABEL.to_string())
            .or_insert_with(|| n.name_any());
        c.namespaces.insert(n.name_any(), labels);
    }
    for p in pods {
        if gone(p) {
            continue;
        }
        let peer = p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .and_then(|n| vnode_peer.get(n))
            .cloned();
        let r = peer
            .as_ref()
            .and_then(|x| remaps.get(x))
            .map_or(&[][..], Vec::as_slice);
        let local_ips = pod_ips(p);
        let ips: Vec<IpAddr> = local_ips
            .iter()
            .map(|ip| r.iter().find_map(|m| m.to_real(*ip)).unwrap_or(*ip))
            .collect();
        if ips.is_empty() {
            continue;
        }
        // A namespace named by a pod but absent from what was read (a partial snapshot):
        // known by its name label, as the API server labels every namespace.
        let ns = p.namespace().unwrap_or_default();
        c.namespaces
            .entry(ns.clone())
            .or_insert_with(|| BTreeMap::from([(NAMESPACE_NAME_LABEL.to_string(), ns.clone())]));
        let ports = p
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .flat_map(|c| c.ports.iter().flatten())
            .filter_map(|cp| {
                Some(netpol::ContainerPort {
                    name: cp.name.clone(),
                    protocol: protocol(cp.protocol.as_deref(), "").ok()?,
                    port: u16::try_from(cp.container_port).ok()?,
                })
            })
            .collect();
        c.pods.push(netpol::Pod {
            namespace: p.namespace().unwrap_or_default(),
            name: p.name_any(),
            labels: p.labels().clone(),
            local_ips: if local_ips == ips {
                Vec::new()
            } else {
                local_ips
            },
            ips,
            ports,
            peer,
        });
    }
    let mut bad = Vec::new();
    // peerwall's own NetworkPolicies (the offloaded namespaces', the CNI companions) are for
    // the CNI: the gateway enforces the users'.
    let ours = |p: &&np::NetworkPolicy| {
        p.labels()
            .get(crate::protection::MANAGED_BY)
            .map(String::as_str)
            == Some(crate::protection::MANAGER)
    };
    for p in policies.into_iter().filter(|p| !ours(p)) {
        match policy(p) {
            Ok(p) => c.policies.push(p),
            Err(e) => bad.push(e),
        }
    }
    (c, bad)
}
