//! NetworkPolicies as the API writes them ([`api`]) into [`crate::NetworkPolicy`], with the
//! API server's defaults applied. A policy that cannot be read (a malformed CIDR, an `endPort`
//! with a named port, an unknown protocol) is refused with its field path and value, so the
//! caller leaves it out and reports it while the policies that read stay enforced.

use crate::api;

/// The JSON of one NetworkPolicy (as the API server serves it) read: [`policy`] of its
/// [`api::NetworkPolicy`].
pub fn policy_json(v: serde_json::Value) -> Result<crate::NetworkPolicy, Unreadable> {
    let meta = |f: &str| {
        v.pointer(&format!("/metadata/{f}"))
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let key = format!("{}/{}", meta("namespace"), meta("name"));
    let p: api::NetworkPolicy = serde_json::from_value(v).map_err(|e| Unreadable {
        policy: key,
        why: format!("not a NetworkPolicy: {e}"),
    })?;
    policy(&p)
}

/// A policy (or part of one) that could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unreadable {
    /// `namespace/name`.
    pub policy: String,
    /// Field path and value.
    pub why: String,
}

pub(crate) fn selector(s: &api::LabelSelector, path: &str) -> Result<crate::Selector, String> {
    let mut out = crate::Selector {
        labels: s.match_labels.clone().unwrap_or_default(),
        exprs: Vec::new(),
    };
    for (i, e) in s.match_expressions.iter().flatten().enumerate() {
        let Some(op) = crate::Operator::parse(&e.operator) else {
            return Err(format!(
                "{path}.matchExpressions[{i}].operator: unknown operator {:?} (In, NotIn, Exists, DoesNotExist)",
                e.operator
            ));
        };
        out.exprs.push(crate::Requirement {
            key: e.key.clone(),
            op,
            values: e.values.clone().unwrap_or_default(),
        });
    }
    Ok(out)
}

pub fn protocol(p: Option<&str>, path: &str) -> Result<crate::Protocol, String> {
    match p.unwrap_or("TCP") {
        "TCP" => Ok(crate::Protocol::Tcp),
        "UDP" => Ok(crate::Protocol::Udp),
        "SCTP" => Ok(crate::Protocol::Sctp),
        other => Err(format!(
            "{path}.protocol: unknown protocol {other:?} (TCP, UDP, SCTP)"
        )),
    }
}

fn port(p: &api::PolicyPort, path: &str) -> Result<crate::Port, String> {
    let protocol = protocol(p.protocol.as_deref(), path)?;
    let ports = match (&p.port, p.end_port) {
        (None, None) => crate::Ports::All,
        (None, Some(_)) => return Err(format!("{path}.endPort: set without port")),
        (Some(api::IntOrString::Int(n)), end) => {
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
            crate::Ports::Range(lo, hi)
        }
        (Some(api::IntOrString::String(name)), None) => match name.parse::<u16>() {
            Ok(n) if n > 0 => crate::Ports::Range(n, n),
            _ => crate::Ports::Named(name.clone()),
        },
        (Some(api::IntOrString::String(name)), Some(_)) => {
            return Err(format!(
                "{path}.endPort: a range needs a numeric port, not the named port {name:?}"
            ))
        }
    };
    Ok(crate::Port { protocol, ports })
}

fn peer(p: &api::PolicyPeer, path: &str) -> Result<crate::Peer, String> {
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
        return Ok(crate::Peer::Block(crate::IpBlock {
            cidr: cidr.trunc(),
            except,
        }));
    }
    Ok(crate::Peer::Pods {
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
    peers: Option<&Vec<api::PolicyPeer>>,
    ports: Option<&Vec<api::PolicyPort>>,
    path: &str,
    peers_field: &str,
) -> Result<crate::Rule, String> {
    Ok(crate::Rule {
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
            Option<&'a Vec<api::PolicyPeer>>,
            Option<&'a Vec<api::PolicyPort>>,
        ),
    >,
    field: &str,
    peers_field: &str,
) -> Result<Vec<crate::Rule>, String> {
    list.enumerate()
        .map(|(i, (peers, ports))| rule(peers, ports, &format!("spec.{field}[{i}]"), peers_field))
        .collect()
}

/// One NetworkPolicy, defaults applied (`policyTypes` absent: Ingress, plus Egress when
/// `spec.egress` is set).
pub fn policy(p: &api::NetworkPolicy) -> Result<crate::NetworkPolicy, Unreadable> {
    let namespace = p.metadata.namespace.clone().unwrap_or_default();
    let name = p.metadata.name.clone().unwrap_or_default();
    let key = format!("{namespace}/{name}");
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
    Ok(crate::NetworkPolicy {
        namespace,
        name,
        pod_selector: selector(&spec.pod_selector.unwrap_or_default(), "spec.podSelector")
            .map_err(fail)?,
        ingress,
        egress,
    })
}
