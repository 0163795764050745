//! The NetworkPolicy the controller keeps in each offloaded namespace: egress home, to the
//! consumer's other offloaded namespaces, DNS, and what a ProtectionPolicy opens.

use crate::MANAGED_BY;
use crate::MANAGER;
use crate::REMOTE_CLUSTER_ID;
use crate::TENANT_NAMESPACE;

use crate::exceptions;
use serde_json::json;
use serde_json::Value;

/// Name of the NetworkPolicy in each offloaded namespace.
pub const NETWORK_POLICY: &str = "peerwall-offloaded";

/// The NetworkPolicy the controller keeps in the offloaded namespace `namespace` of
/// `consumer`, whose pod and external CIDRs as seen here are `home`, with the openings of the
/// consumer's ProtectionPolicies for offloaded pods (the controller adds the owner reference).
pub fn offloaded_network_policy(
    namespace: &str,
    consumer: &str,
    home: &[ipnet::IpNet],
    open: &[&exceptions::Open],
) -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": NETWORK_POLICY,
            "namespace": namespace,
            "labels": { MANAGED_BY: MANAGER, REMOTE_CLUSTER_ID: consumer },
        },
        "spec": network_policy_spec(consumer, home, open),
    })
}

/// A selector as the API writes it.
pub(crate) fn selector_json(s: &peerwall_netpol::Selector) -> Value {
    let mut out = serde_json::Map::new();
    if !s.labels.is_empty() {
        out.insert("matchLabels".into(), json!(s.labels));
    }
    if !s.exprs.is_empty() {
        let exprs: Vec<Value> = s
            .exprs
            .iter()
            .map(|r| {
                let mut e = json!({ "key": r.key, "operator": r.op.name() });
                if !r.values.is_empty() {
                    e["values"] = json!(r.values);
                }
                e
            })
            .collect();
        out.insert("matchExpressions".into(), Value::Array(exprs));
    }
    Value::Object(out)
}

/// The egress rule of an opening: its selectors (provider pods only) and ports (`endPort`
/// for ranges: NetworkPolicy's, beta since Kubernetes 1.22).
pub(crate) fn opening_egress(o: &exceptions::Open) -> Value {
    let mut rule = json!({ "to": [{
        "namespaceSelector": selector_json(&o.opening.namespaces),
        "podSelector": selector_json(&o.opening.pods),
    }]});
    if !o.opening.ports.is_empty() {
        let ports: Vec<Value> = o
            .opening
            .ports
            .iter()
            .map(|p| {
                let mut e = json!({ "protocol": p.protocol.name() });
                match p.range {
                    Some((a, b)) if a == b => e["port"] = json!(a),
                    Some((a, b)) => {
                        e["port"] = json!(a);
                        e["endPort"] = json!(b);
                    }
                    None => {}
                }
                e
            })
            .collect();
        rule["ports"] = Value::Array(ports);
    }
    rule
}

/// The spec of [`offloaded_network_policy`]: egress to the consumer's other offloaded
/// namespaces, to DNS, home (the consumer's own pods and external CIDR: reflected services,
/// leaf-to-leaf, through the tunnel, by the addresses this cluster sees them at), and what the
/// ProtectionPolicies open to offloaded pods.
pub fn network_policy_spec(
    consumer: &str,
    home: &[ipnet::IpNet],
    open: &[&exceptions::Open],
) -> Value {
    let mut egress = vec![
        json!({ "to": [{ "namespaceSelector": { "matchExpressions": [
            { "key": REMOTE_CLUSTER_ID, "operator": "In", "values": [consumer] },
            { "key": TENANT_NAMESPACE, "operator": "DoesNotExist" },
        ]}}]}),
        json!({ "to": [{ "namespaceSelector": {}, "podSelector": { "matchLabels": { "k8s-app": "kube-dns" }}}],
          "ports": [{ "protocol": "UDP", "port": 53 }, { "protocol": "TCP", "port": 53 }] }),
    ];
    if !home.is_empty() {
        egress.push(json!({ "to": home
            .iter()
            .map(|c| json!({ "ipBlock": { "cidr": c.trunc().to_string() } }))
            .collect::<Vec<_>>() }));
    }
    egress.extend(open.iter().map(|o| opening_egress(o)));
    json!({
        "podSelector": {},
        "policyTypes": ["Egress"],
        "egress": egress,
    })
}
