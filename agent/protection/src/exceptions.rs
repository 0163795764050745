//! ProtectionPolicies (`peerwall.io/v1alpha1`, [`peerwall_intent::protection`]): what a
//! provider admin declares on top of protection, checked with field paths and resolved per
//! peer into what the controller merges into the peer's gateway configuration
//! ([`super::gateway_spec`]) and into its offloaded namespaces' NetworkPolicy
//! ([`super::network_policy_spec`]).
//!
//! Order: policies for every peer first, then the ones naming the peer, each group by name; a
//! later policy's setting overrides an earlier one's, openings and closings add up.
//!
//! Selection: an opening selects **provider pods**, i.e. local pods (not on a virtual node)
//! outside tenant namespaces and namespaces offloaded here, without Liqo's
//! `liqo.io/remote-cluster-id` label. It can never open one consumer's pods to another.
//!
//! No kube types: the controller hands in [`ProtectionPolicySpec`]s and the cluster as
//! [`netpol::Cluster`].

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use peerwall_intent::protection::{self as api, From, ProtectionPolicySpec};

use super::{REMOTE_CLUSTER_ID, TENANT_NAMESPACE};
use peerwall_netpol::{self as netpol, Protocol};

/// A ProtectionPolicy that does not validate: the field path, the value, why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {value}: {why}")]
pub struct Invalid {
    /// Field path (`spec.open[0].ports[1].endPort`).
    pub path: String,
    /// The value found there.
    pub value: String,
    /// What is wrong and what is accepted.
    pub why: String,
}

fn invalid(
    path: impl Into<String>,
    value: impl std::fmt::Debug,
    why: impl Into<String>,
) -> Invalid {
    Invalid {
        path: path.into(),
        value: format!("{value:?}"),
        why: why.into(),
    }
}

/// A protocol and the ports of it (`None`: every port).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PortRange {
    /// Protocol.
    pub protocol: Protocol,
    /// First and last port, or every port.
    pub range: Option<(u16, u16)>,
}

/// A checked opening.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Opening {
    /// Its name.
    pub name: String,
    /// Who may reach the pods.
    pub from: BTreeSet<From>,
    /// Namespaces of the pods (with the provider-only terms added).
    pub namespaces: netpol::Selector,
    /// Pods (with the provider-only terms added).
    pub pods: netpol::Selector,
    /// Ports; empty: everything.
    pub ports: Vec<PortRange>,
}

/// A checked closing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Closing {
    /// Its name.
    pub name: String,
    /// Ports (at least one).
    pub ports: Vec<PortRange>,
}

/// Per-peer switches a policy sets (`None`: left as they are).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Switches {
    /// Audit mode.
    pub audit: Option<bool>,
    /// Leaf-to-leaf blocking.
    pub block_leaf_to_leaf: Option<bool>,
    /// Consumer protection limited to the pod's own namespace.
    pub own_namespace_only: Option<bool>,
}

/// A ProtectionPolicy that validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checked {
    /// Object name.
    pub name: String,
    /// Peers it applies to (empty: every peer).
    pub peers: BTreeSet<String>,
    /// Switches.
    pub switches: Switches,
    /// Openings.
    pub open: Vec<Opening>,
    /// Closings.
    pub close: Vec<Closing>,
}

impl Checked {
    /// Whether it applies to `peer`.
    pub fn applies_to(&self, peer: &str) -> bool {
        self.peers.is_empty() || self.peers.contains(peer)
    }
}

/// A DNS-1123 label (what names a rule and a set): lowercase letters, digits, `-`, at most 63.
fn check_label(path: &str, s: &str) -> Result<(), Invalid> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(invalid(
            path,
            s,
            "a DNS label: 1 to 63 lowercase letters, digits or '-', starting and ending with a letter or digit",
        ))
    }
}

fn selector(path: &str, s: &api::LabelSelector) -> Result<netpol::Selector, Invalid> {
    let mut out = netpol::Selector {
        labels: s.match_labels.clone(),
        exprs: Vec::new(),
    };
    for (i, e) in s.match_expressions.iter().enumerate() {
        let p = format!("{path}.matchExpressions[{i}]");
        if e.key.is_empty() {
            return Err(invalid(format!("{p}.key"), &e.key, "a label key"));
        }
        let Some(op) = netpol::Operator::parse(&e.operator) else {
            return Err(invalid(
                format!("{p}.operator"),
                &e.operator,
                "one of In, NotIn, Exists, DoesNotExist",
            ));
        };
        let needs_values = matches!(op, netpol::Operator::In | netpol::Operator::NotIn);
        if needs_values == e.values.is_empty() {
            return Err(invalid(
                format!("{p}.values"),
                &e.values,
                if needs_values {
                    "In and NotIn need at least one value"
                } else {
                    "Exists and DoesNotExist take no values"
                },
            ));
        }
        out.exprs.push(netpol::Requirement {
            key: e.key.clone(),
            op,
            values: e.values.clone(),
        });
    }
    Ok(out)
}

/// The selector with `liqo.io/remote-cluster-id` required absent: no tenant namespace, no
/// namespace offloaded here, no pod labelled as offloaded.
fn provider_only(mut s: netpol::Selector) -> netpol::Selector {
    s.exprs.push(netpol::Requirement {
        key: REMOTE_CLUSTER_ID.into(),
        op: netpol::Operator::DoesNotExist,
        values: vec![],
    });
    s
}

fn ports(path: &str, list: &[api::PortSpec]) -> Result<Vec<PortRange>, Invalid> {
    let mut out = Vec::new();
    for (i, p) in list.iter().enumerate() {
        let at = format!("{path}[{i}]");
        let protocol = match p.protocol.as_deref().unwrap_or("TCP") {
            "TCP" => Protocol::Tcp,
            "UDP" => Protocol::Udp,
            "SCTP" => Protocol::Sctp,
            other => {
                return Err(invalid(
                    format!("{at}.protocol"),
                    other,
                    "one of TCP, UDP, SCTP",
                ))
            }
        };
        let range = match (p.port, p.end_port) {
            (None, None) => None,
            (None, Some(e)) => return Err(invalid(format!("{at}.endPort"), e, "set without port")),
            (Some(0), _) => return Err(invalid(format!("{at}.port"), 0, "a port from 1 to 65535")),
            (Some(lo), None) => Some((lo, lo)),
            (Some(lo), Some(hi)) if hi < lo => {
                return Err(invalid(
                    format!("{at}.endPort"),
                    hi,
                    format!("below port {lo}"),
                ))
            }
            (Some(lo), Some(hi)) => Some((lo, hi)),
        };
        out.push(PortRange { protocol, range });
    }
    Ok(out)
}

/// Decode a ProtectionPolicy's `spec` as stored ([`peerwall_intent::load::protection_spec_from_json`]):
/// an unknown or mistyped field is [`Invalid`] with its path, like any other problem.
pub fn decode(spec: serde_json::Value) -> Result<ProtectionPolicySpec, Invalid> {
    peerwall_intent::load::protection_spec_from_json(spec).map_err(|(path, given, why)| Invalid {
        path: if path == "." {
            "spec".into()
        } else {
            format!("spec.{path}")
        },
        value: format!("{given:?}"),
        why,
    })
}

/// Check one ProtectionPolicy: the first problem, with its field path, or what it says.
pub fn check(name: &str, spec: &ProtectionPolicySpec) -> Result<Checked, Invalid> {
    let mut peers = BTreeSet::new();
    for (i, p) in spec.peers.iter().enumerate() {
        if p.is_empty() {
            return Err(invalid(
                format!("spec.peers[{i}]"),
                p,
                "a remote cluster id",
            ));
        }
        if !peers.insert(p.clone()) {
            return Err(invalid(format!("spec.peers[{i}]"), p, "named twice"));
        }
    }
    let s = spec.settings.clone().unwrap_or_default();
    let switches = Switches {
        audit: s.audit,
        block_leaf_to_leaf: s.block_leaf_to_leaf,
        own_namespace_only: s.own_namespace_only,
    };
    let mut names = BTreeSet::new();
    let mut open = Vec::new();
    for (i, o) in spec.open.iter().enumerate() {
        let at = format!("spec.open[{i}]");
        check_label(&format!("{at}.name"), &o.name)?;
        if !names.insert(o.name.clone()) {
            return Err(invalid(
                format!("{at}.name"),
                &o.name,
                "used twice in open/close",
            ));
        }
        if o.from.is_empty() {
            return Err(invalid(
                format!("{at}.from"),
                &o.from,
                "at least one of Offloaded, PeerPods, OwnPods",
            ));
        }
        if o.namespace_selector.is_none() && o.pod_selector.is_none() {
            return Err(invalid(
                format!("{at}.namespaceSelector"),
                "absent",
                "select the pods with namespaceSelector and/or podSelector ({} selects every provider pod)",
            ));
        }
        let namespaces = match &o.namespace_selector {
            Some(s) => selector(&format!("{at}.namespaceSelector"), s)?,
            None => netpol::Selector::default(),
        };
        let pods = match &o.pod_selector {
            Some(s) => selector(&format!("{at}.podSelector"), s)?,
            None => netpol::Selector::default(),
        };
        open.push(Opening {
            name: o.name.clone(),
            from: o.from.iter().copied().collect(),
            namespaces: provider_only(namespaces),
            pods: provider_only(pods),
            ports: ports(&format!("{at}.ports"), &o.ports)?,
        });
    }
    let mut close = Vec::new();
    for (i, c) in spec.close.iter().enumerate() {
        let at = format!("spec.close[{i}]");
        check_label(&format!("{at}.name"), &c.name)?;
        if !names.insert(c.name.clone()) {
            return Err(invalid(
                format!("{at}.name"),
                &c.name,
                "used twice in open/close",
            ));
        }
        if c.ports.is_empty() {
            return Err(invalid(
                format!("{at}.ports"),
                &c.ports,
                "at least one port: closing everything is the default already",
            ));
        }
        close.push(Closing {
            name: c.name.clone(),
            ports: ports(&format!("{at}.ports"), &c.ports)?,
        });
    }
    Ok(Checked {
        name: name.to_string(),
        peers,
        switches,
        open,
        close,
    })
}

/// The switches in force for a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Audit mode.
    pub audit: bool,
    /// Leaf-to-leaf blocking.
    pub block_leaf_to_leaf: bool,
    /// Consumer protection limited to the pod's own namespace.
    pub own_namespace_only: bool,
}

/// An opening as it applies to one peer: the addresses it selects now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Open {
    /// Policy name.
    pub policy: String,
    /// The opening.
    pub opening: Opening,
    /// Provider pod addresses it selects.
    pub addresses: BTreeSet<IpAddr>,
}

impl Open {
    /// Name of its set of family `v6` in the gateway configuration: `open.<policy>.<name>`
    /// (`open6.…`). The opening's name is a DNS label (no `.`), so names never collide.
    pub fn set_name(&self, v6: bool) -> String {
        format!(
            "open{}.{}.{}",
            if v6 { "6" } else { "" },
            self.policy,
            self.opening.name
        )
    }
}

/// A closing as it applies to one peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Close {
    /// Policy name.
    pub policy: String,
    /// The closing.
    pub closing: Closing,
}

/// Everything the policies say for one peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForPeer {
    /// Switches in force.
    pub settings: Settings,
    /// Openings, in order.
    pub open: Vec<Open>,
    /// Closings, in order.
    pub close: Vec<Close>,
}

impl ForPeer {
    /// Only the defaults.
    pub fn defaults(settings: Settings) -> Self {
        Self {
            settings,
            open: vec![],
            close: vec![],
        }
    }

    /// The openings for the peer's offloaded pods (the NetworkPolicy of its offloaded
    /// namespaces).
    pub fn for_offloaded(&self) -> impl Iterator<Item = &Open> {
        self.open
            .iter()
            .filter(|o| o.opening.from.contains(&From::Offloaded))
    }
}

/// Whether `pod` is a provider pod `o` selects.
fn selects(cluster: &netpol::Cluster, o: &Opening, pod: &netpol::Pod) -> bool {
    if pod.peer.is_some() {
        return false;
    }
    let Some(ns) = cluster.namespaces.get(&pod.namespace) else {
        return false;
    };
    !ns.contains_key(TENANT_NAMESPACE) && o.namespaces.matches(ns) && o.pods.matches(&pod.labels)
}

/// What the policies say for `peer`: `defaults` (the controller's flags) overridden by the
/// switches of the policies that apply, in order, and their openings with the provider pods of
/// `cluster` each selects.
pub fn for_peer(
    policies: &[Checked],
    peer: &str,
    defaults: Settings,
    cluster: &netpol::Cluster,
) -> ForPeer {
    let mut order: Vec<&Checked> = policies.iter().filter(|p| p.applies_to(peer)).collect();
    order.sort_by_key(|p| (!p.peers.is_empty(), p.name.clone()));
    let mut out = ForPeer::defaults(defaults);
    for p in order {
        let s = &mut out.settings;
        s.audit = p.switches.audit.unwrap_or(s.audit);
        s.block_leaf_to_leaf = p
            .switches
            .block_leaf_to_leaf
            .unwrap_or(s.block_leaf_to_leaf);
        s.own_namespace_only = p
            .switches
            .own_namespace_only
            .unwrap_or(s.own_namespace_only);
        for o in &p.open {
            let addresses = cluster
                .pods
                .iter()
                .filter(|pod| selects(cluster, o, pod))
                .flat_map(|pod| pod.ips.iter().copied())
                .collect();
            out.open.push(Open {
                policy: p.name.clone(),
                opening: o.clone(),
                addresses,
            });
        }
        out.close.extend(p.close.iter().map(|c| Close {
            policy: p.name.clone(),
            closing: c.clone(),
        }));
    }
    out
}

/// What one policy became for one peer (its `status.peers` entry).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerReport {
    /// Gateway rules it adds.
    pub gateway_rules: u32,
    /// Provider addresses its openings select.
    pub selected_addresses: u32,
    /// Egress rules it adds to the offloaded namespaces' NetworkPolicy.
    pub network_policy_rules: u32,
}

/// Per policy name: what it became in `peer`'s configuration (from the rules and NetworkPolicy
/// entries [`super::gateway_spec`] and [`super::network_policy_spec`] emit for it).
pub fn reports(f: &ForPeer) -> BTreeMap<String, PeerReport> {
    let mut out: BTreeMap<String, PeerReport> = BTreeMap::new();
    for o in &f.open {
        let r = out.entry(o.policy.clone()).or_default();
        r.selected_addresses += o.addresses.len() as u32;
        if o.opening.from.contains(&From::Offloaded) {
            r.network_policy_rules += 1;
        }
        if o.opening.from.iter().any(|f| *f != From::Offloaded) {
            r.gateway_rules += super::open_rules(o).len() as u32;
        }
    }
    for c in &f.close {
        out.entry(c.policy.clone()).or_default().gateway_rules +=
            super::close_rules(c).len() as u32;
    }
    out
}

#[cfg(test)]
mod tests;
