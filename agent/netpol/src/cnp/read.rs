//! ClusterNetworkPolicies as the API writes them ([`super::api`]) into
//! [`super::ClusterNetworkPolicy`]. A policy whose tier, priority, subject, an action or a port
//! cannot be read is refused whole with the field path and value (the caller reports it and
//! leaves it out; the others stay enforced). A peer peerwall does not enforce (the experimental
//! `nodes` and `domainNames`, or one with no field it knows) is kept as
//! [`super::Peer::Unsupported`], which fails closed as the API asks, and named in
//! [`Read::unenforced`] for the policy's status.

use super::api;
use crate::read::{selector, Unreadable};

/// One policy read, and what of it is not enforced as written (field path and reason).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Read {
    /// The policy.
    pub policy: super::ClusterNetworkPolicy,
    /// Parts that fail closed instead of doing what they say.
    pub unenforced: Vec<String>,
}

/// The JSON of one ClusterNetworkPolicy (as the API server serves it) read.
pub fn policy_json(v: serde_json::Value) -> Result<Read, Unreadable> {
    let name = v
        .pointer("/metadata/name")
        .and_then(serde_json::Value::as_str)
        .unwrap_or_default()
        .to_string();
    let p: api::ClusterNetworkPolicy = serde_json::from_value(v).map_err(|e| Unreadable {
        policy: name,
        why: format!("not a ClusterNetworkPolicy: {e}"),
    })?;
    policy(&p)
}

fn namespaced(
    p: &api::NamespacedPod,
    path: &str,
) -> Result<(crate::Selector, crate::Selector), String> {
    let ns = match &p.namespace_selector {
        Some(s) => selector(s, &format!("{path}.namespaceSelector"))?,
        None => crate::Selector::default(),
    };
    let pods = match &p.pod_selector {
        Some(s) => selector(s, &format!("{path}.podSelector"))?,
        None => return Err(format!("{path}.podSelector: required")),
    };
    Ok((ns, pods))
}

fn subject(s: Option<&api::Subject>) -> Result<super::Subject, String> {
    let Some(s) = s else {
        return Err("spec.subject: required".into());
    };
    match (&s.namespaces, &s.pods) {
        (Some(n), None) => Ok(super::Subject::Namespaces(selector(
            n,
            "spec.subject.namespaces",
        )?)),
        (None, Some(p)) => {
            let (namespaces, pods) = namespaced(p, "spec.subject.pods")?;
            Ok(super::Subject::Pods { namespaces, pods })
        }
        (Some(_), Some(_)) => {
            Err("spec.subject: exactly one of namespaces and pods, not both".into())
        }
        (None, None) => Err("spec.subject: exactly one of namespaces and pods (none set)".into()),
    }
}

fn action(a: Option<&str>, path: &str) -> Result<super::Action, String> {
    match a {
        Some("Accept") => Ok(super::Action::Accept),
        Some("Deny") => Ok(super::Action::Deny),
        Some("Pass") => Ok(super::Action::Pass),
        Some(other) => Err(format!(
            "{path}.action: unknown action {other:?} (Accept, Deny, Pass)"
        )),
        None => Err(format!("{path}.action: required")),
    }
}

fn port_number(n: i64, path: &str) -> Result<u16, String> {
    u16::try_from(n)
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{path}: {n} is not a port (1-65535)"))
}

fn protocol(p: &api::Protocol, path: &str) -> Result<Vec<crate::Port>, String> {
    let set = [
        p.tcp.is_some(),
        p.udp.is_some(),
        p.sctp.is_some(),
        p.destination_named_port.is_some(),
    ]
    .iter()
    .filter(|b| **b)
    .count();
    if set != 1 {
        return Err(format!(
            "{path}: exactly one of tcp, udp, sctp and destinationNamedPort ({set} set)"
        ));
    }
    if let Some(name) = &p.destination_named_port {
        // A container port of that name, whichever its protocol.
        return Ok([
            crate::Protocol::Tcp,
            crate::Protocol::Udp,
            crate::Protocol::Sctp,
        ]
        .into_iter()
        .map(|protocol| crate::Port {
            protocol,
            ports: crate::Ports::Named(name.clone()),
        })
        .collect());
    }
    let (protocol, ports, field) = match (&p.tcp, &p.udp, &p.sctp) {
        (Some(t), _, _) => (crate::Protocol::Tcp, t, "tcp"),
        (_, Some(u), _) => (crate::Protocol::Udp, u, "udp"),
        (_, _, Some(s)) => (crate::Protocol::Sctp, s, "sctp"),
        _ => return Err(format!("{path}: no protocol")),
    };
    let path = format!("{path}.{field}.destinationPort");
    let ports = match &ports.destination_port {
        None => crate::Ports::All,
        Some(d) => match (d.number, &d.range) {
            (Some(n), None) => {
                let n = port_number(n, &format!("{path}.number"))?;
                crate::Ports::Range(n, n)
            }
            (None, Some(r)) => {
                let start = port_number(r.start.unwrap_or(0), &format!("{path}.range.start"))?;
                let end = port_number(r.end.unwrap_or(0), &format!("{path}.range.end"))?;
                if start >= end {
                    return Err(format!(
                        "{path}.range: start {start} must be less than end {end}"
                    ));
                }
                crate::Ports::Range(start, end)
            }
            _ => return Err(format!("{path}: exactly one of number and range")),
        },
    };
    Ok(vec![crate::Port { protocol, ports }])
}

fn peer(p: &api::Peer, path: &str, egress: bool) -> Result<super::Peer, String> {
    let set = [
        p.namespaces.is_some(),
        p.pods.is_some(),
        p.networks.is_some(),
        p.nodes.is_some(),
        p.domain_names.is_some(),
    ]
    .iter()
    .filter(|b| **b)
    .count();
    if set > 1 {
        return Err(format!("{path}: exactly one peer field ({set} set)"));
    }
    if let Some(n) = &p.namespaces {
        return Ok(super::Peer::Namespaces(selector(
            n,
            &format!("{path}.namespaces"),
        )?));
    }
    if let Some(pods) = &p.pods {
        let (namespaces, pods) = namespaced(pods, &format!("{path}.pods"))?;
        return Ok(super::Peer::Pods { namespaces, pods });
    }
    if let Some(nets) = &p.networks {
        if !egress {
            return Ok(super::Peer::Unsupported(format!(
                "{path}.networks: an ingress peer has no networks field in v1alpha2"
            )));
        }
        let mut out = Vec::new();
        for (i, n) in nets.iter().enumerate() {
            let net: ipnet::IpNet = n
                .parse()
                .map_err(|_| format!("{path}.networks[{i}]: {n:?} is not a CIDR"))?;
            out.push(net.trunc());
        }
        return Ok(super::Peer::Networks(out));
    }
    Ok(super::Peer::Unsupported(if p.nodes.is_some() {
        format!(
            "{path}.nodes: experimental, not enforced across the gateway (nodes are not behind it)"
        )
    } else if p.domain_names.is_some() {
        format!("{path}.domainNames: experimental, not enforced (a packet filter sees no names)")
    } else {
        format!("{path}: no peer field peerwall knows (a newer API version?)")
    }))
}

fn rule(
    name: Option<&String>,
    act: Option<&String>,
    peers: Option<&Vec<api::Peer>>,
    protocols: Option<&Vec<api::Protocol>>,
    path: &str,
    peers_field: &str,
    unenforced: &mut Vec<String>,
) -> Result<super::Rule, String> {
    let action = action(act.map(String::as_str), path)?;
    let egress = peers_field == "to";
    let peers: Vec<super::Peer> = peers
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, p)| peer(p, &format!("{path}.{peers_field}[{i}]"), egress))
        .collect::<Result<_, _>>()?;
    if peers.is_empty() {
        return Err(format!("{path}.{peers_field}: at least one peer"));
    }
    for p in &peers {
        if let super::Peer::Unsupported(why) = p {
            unenforced.push(format!(
                "{why}; the {} rule {}",
                action.name(),
                if action == super::Action::Accept {
                    "matches nothing through it"
                } else {
                    "matches all traffic through it (fails closed)"
                }
            ));
        }
    }
    let mut ports = Vec::new();
    for (i, p) in protocols.into_iter().flatten().enumerate() {
        ports.extend(protocol(p, &format!("{path}.protocols[{i}]"))?);
    }
    Ok(super::Rule {
        name: name.cloned().unwrap_or_default(),
        action,
        peers,
        ports,
    })
}

/// One ClusterNetworkPolicy.
pub fn policy(p: &api::ClusterNetworkPolicy) -> Result<Read, Unreadable> {
    let name = p.metadata.name.clone().unwrap_or_default();
    let refuse = |why: String| Unreadable {
        policy: name.clone(),
        why,
    };
    let Some(spec) = &p.spec else {
        return Err(refuse("spec: required".into()));
    };
    let tier = match spec.tier.as_deref() {
        Some("Admin") => super::Tier::Admin,
        Some("Baseline") => super::Tier::Baseline,
        Some(other) => {
            return Err(refuse(format!(
                "spec.tier: unknown tier {other:?} (Admin, Baseline)"
            )))
        }
        None => return Err(refuse("spec.tier: required".into())),
    };
    let priority = match spec.priority {
        Some(n) if (0..=1000).contains(&n) => n as u32,
        Some(n) => return Err(refuse(format!("spec.priority: {n} is outside 0-1000"))),
        None => return Err(refuse("spec.priority: required".into())),
    };
    let subject = subject(spec.subject.as_ref()).map_err(refuse)?;
    let mut unenforced = Vec::new();
    let mut ingress = Vec::new();
    for (i, r) in spec.ingress.iter().flatten().enumerate() {
        ingress.push(
            rule(
                r.name.as_ref(),
                r.action.as_ref(),
                r.from.as_ref(),
                r.protocols.as_ref(),
                &format!("spec.ingress[{i}]"),
                "from",
                &mut unenforced,
            )
            .map_err(refuse)?,
        );
    }
    let mut egress = Vec::new();
    for (i, r) in spec.egress.iter().flatten().enumerate() {
        egress.push(
            rule(
                r.name.as_ref(),
                r.action.as_ref(),
                r.to.as_ref(),
                r.protocols.as_ref(),
                &format!("spec.egress[{i}]"),
                "to",
                &mut unenforced,
            )
            .map_err(refuse)?,
        );
    }
    Ok(Read {
        policy: super::ClusterNetworkPolicy {
            name,
            tier,
            priority,
            subject,
            ingress,
            egress,
        },
        unenforced,
    })
}
