//! `peerwall webhook`: a validating admission webhook for FirewallConfiguration.
//!
//! It runs exactly the agent's validation ([`super::check`]), so an object the webhook admits
//! is one every agent can enforce, and a refused object is refused with the same field-path
//! message the agent would write into its status. Served over TLS (rustls) on `POST /validate`;
//! `GET /healthz` answers `ok`.
//!
//! Only peerwall's objects (`peerwall.io`) are judged: the webhook configuration in `deploy/`
//! covers that group alone, and an object of any other group that reaches it anyway (Liqo's
//! `networking.liqo.io`, a misconfigured webhook rule) is admitted unchanged. peerwall never
//! stands between Liqo and its own objects.
//!
//! Beyond validity it refuses what the agents would ignore ([`super::trust`]): gateway objects
//! from namespaces that may not steer a gateway, and packet-changing rules unless enabled.
//!
//! Here the pure review; [`serve`] is the HTTPS edge, [`certs`] the certificate peerwall
//! issues itself (a CA in a Secret, the webhook configuration's `caBundle` kept in step).

pub mod certs;
pub mod serve;

pub use serve::{run, Settings, Tls};

use kube::api::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};

/// What admission knows beyond the object: who may steer a gateway, and the Liqo tenant
/// namespaces as last listed.
#[derive(Clone, Debug)]
pub struct Judge {
    /// The agents' trust ([`super::trust`]): the webhook refuses what they would ignore.
    pub trust: super::trust::Trust,
    /// Tenant namespaces and their peers.
    pub tenants: super::trust::Tenants,
}

/// Whether `obj` is meant for an agent's gateway or host (`peerwall.io/target`, the label every
/// agent selector keys on): only such objects steer anything, so only they are held to the
/// namespace rule.
fn targeted(obj: &DynamicObject) -> bool {
    obj.metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(super::TARGET))
}

/// The namespace rule for `obj` in `namespace`: the reason it may not steer a gateway.
fn steering(judge: &Judge, namespace: &str, obj: &DynamicObject) -> Result<(), String> {
    if !targeted(obj) {
        return Ok(());
    }
    let peer = obj
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(super::PEER))
        .map(String::as_str);
    judge
        .trust
        .admits(namespace, peer, &judge.tenants)
        .map_err(|reason| format!("{}: {reason}", super::key_of(obj)))
}

/// Answer one AdmissionReview (JSON in, JSON out). Pure: the HTTP edge only moves bytes.
pub fn review(body: &[u8], judge: &Judge) -> serde_json::Value {
    let parsed: Result<AdmissionReview<DynamicObject>, _> = serde_json::from_slice(body);
    let req: AdmissionRequest<DynamicObject> = match parsed.map(|r| r.try_into()) {
        Ok(Ok(req)) => req,
        Ok(Err(e)) => return to_json(AdmissionResponse::invalid(e)),
        Err(e) => {
            return to_json(AdmissionResponse::invalid(format!(
                "not an AdmissionReview: {e}"
            )))
        }
    };
    let resp = AdmissionResponse::from(&req);
    let namespace = req.namespace.clone().unwrap_or_default();
    if req.kind.group != peerwall_intent::load::GROUP {
        tracing::debug!(group = %req.kind.group, name = %req.name, "not peerwall's: admitted");
        return to_json(resp);
    }
    let resp = match (&req.operation, &req.object) {
        (Operation::Create | Operation::Update, Some(obj))
            if req.kind.kind == peerwall_intent::load::PROTECTION_POLICY_KIND =>
        {
            match check_protection_policy(obj) {
                Ok(()) => resp,
                Err(e) => {
                    tracing::info!(object = %obj.metadata.name.as_deref().unwrap_or_default(), reason = %e, "refused");
                    resp.deny(e)
                }
            }
        }
        (Operation::Create | Operation::Update, Some(obj))
            if req.kind.kind == peerwall_intent::load::ADDRESS_SET_KIND =>
        {
            match super::check_slice(obj)
                .map_err(|e| e.to_string())
                .and_then(|_| steering(judge, &namespace, obj))
            {
                Ok(()) => resp,
                Err(e) => {
                    tracing::info!(object = %super::key_of(obj), reason = %e, "refused");
                    resp.deny(e)
                }
            }
        }
        (Operation::Create | Operation::Update, Some(obj)) => match super::check(obj)
            .map_err(|e| e.to_string())
            .and_then(|(po, warnings)| {
                judge
                    .trust
                    .allows_changes(&po.spec)
                    .map_err(|e| format!("{}: {e}", super::key_of(obj)))?;
                steering(judge, &namespace, obj)?;
                Ok(warnings)
            }) {
            Ok(warnings) => {
                let mut r = resp;
                if !warnings.is_empty() {
                    r.warnings = Some(warnings);
                }
                r
            }
            Err(e) => {
                tracing::info!(object = %super::key_of(obj), reason = %e, "refused");
                resp.deny(e)
            }
        },
        _ => resp,
    };
    to_json(resp)
}

/// A ProtectionPolicy as the controller reads it: its spec decoded (unknown or mistyped
/// fields named by path) and checked ([`crate::protection::exceptions::check`]). Names are
/// at most 63 characters: they name gateway rules.
fn check_protection_policy(obj: &DynamicObject) -> Result<(), String> {
    let name = obj.metadata.name.clone().unwrap_or_default();
    let which = format!("ProtectionPolicy {name}");
    if name.len() > 63 {
        return Err(format!(
            "{which}: metadata.name: {} characters: at most 63 (the name becomes gateway rule and set names)",
            name.len()
        ));
    }
    super::protection_policies::check_object(obj)
        .map(|_| ())
        .map_err(|e| format!("{which}: {e}"))
}

fn to_json(resp: AdmissionResponse) -> serde_json::Value {
    serde_json::to_value(resp.into_review()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review_of(spec: serde_json::Value) -> serde_json::Value {
        review_in("peerwall.io", "v1alpha1", spec)
    }

    fn review_in(group: &str, version: &str, spec: serde_json::Value) -> serde_json::Value {
        let body = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-1",
                "kind": {"group": group, "version": version, "kind": "FirewallConfiguration"},
                "resource": {"group": group, "version": version, "resource": "firewallconfigurations"},
                "operation": "CREATE",
                "userInfo": {},
                "name": "x",
                "namespace": "ns",
                "object": {
                    "apiVersion": format!("{group}/{version}"),
                    "kind": "FirewallConfiguration",
                    "metadata": {"name": "x", "namespace": "ns"},
                    "spec": spec,
                },
            },
        });
        review(body.to_string().as_bytes(), &judge())
    }

    fn judge() -> Judge {
        Judge {
            trust: crate::k8s::trust::Trust::default_for("peerwall-system"),
            tenants: crate::k8s::trust::Tenants::from([(
                "liqo-tenant-a".to_string(),
                "a".to_string(),
            )]),
        }
    }

    #[test]
    fn refuses_with_the_field_path_and_allows_valid() {
        let bad = review_of(
            serde_json::json!({"table": {"name": "t", "family": "INET", "chains": [{
                "name": "c", "type": "filter", "hook": "forward", "priority": 0, "policy": "accept",
                "rules": {"filterRules": [{"action": "drop", "match": [{"op": "eq", "ip": {"value": "10.20.1.300", "position": "dst"}}]}]}
            }]}}),
        );
        assert_eq!(bad["response"]["uid"], "u-1");
        assert_eq!(bad["response"]["allowed"], false);
        let msg = bad["response"]["status"]["message"].as_str().unwrap();
        assert!(
            msg.contains("spec.table.chains[0].rules.filterRules[0].match[0].ip.value")
                && msg.contains("10.20.1.300"),
            "{msg}"
        );
        let good =
            review_of(serde_json::json!({"table": {"name": "t", "family": "INET", "chains": []}}));
        assert_eq!(good["response"]["allowed"], true, "{good}");
    }

    #[test]
    fn liqo_objects_are_never_refused() {
        let bad = serde_json::json!({"table": {"name": "t", "family": "INET", "chains": [{
            "name": "c", "type": "filter", "hook": "forward", "priority": 0, "policy": "accept",
            "rules": {"filterRules": [{"action": "drop", "match": [{"op": "eq", "ip": {"value": "10.20.1.300", "position": "dst"}}]}]}
        }]}});
        assert_eq!(review_of(bad.clone())["response"]["allowed"], false);
        let liqo = review_in("networking.liqo.io", "v1beta1", bad);
        assert_eq!(liqo["response"]["allowed"], true, "{liqo}");
    }

    /// A FirewallConfiguration review in `namespace` with `labels`.
    fn review_labelled(
        namespace: &str,
        labels: serde_json::Value,
        spec: serde_json::Value,
    ) -> serde_json::Value {
        let body = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-2",
                "kind": {"group": "peerwall.io", "version": "v1alpha1", "kind": "FirewallConfiguration"},
                "resource": {"group": "peerwall.io", "version": "v1alpha1", "resource": "firewallconfigurations"},
                "operation": "CREATE",
                "userInfo": {},
                "name": "x",
                "namespace": namespace,
                "object": {
                    "apiVersion": "peerwall.io/v1alpha1",
                    "kind": "FirewallConfiguration",
                    "metadata": {"name": "x", "labels": labels},
                    "spec": spec,
                },
            },
        });
        review(body.to_string().as_bytes(), &judge())
    }

    #[test]
    fn gateway_objects_are_refused_where_agents_would_ignore_them() {
        let spec = serde_json::json!({"table": {"name": "t", "family": "INET", "chains": []}});
        let gw = serde_json::json!({"peerwall.io/target": "gateway", "peerwall.io/remote-cluster-id": "a"});
        let denied = |r: &serde_json::Value| {
            (r["response"]["allowed"] == false).then(|| {
                r["response"]["status"]["message"]
                    .as_str()
                    .unwrap_or("")
                    .to_string()
            })
        };
        let r = review_labelled("team-x", gw.clone(), spec.clone());
        let msg = denied(&r).expect("refused");
        assert!(msg.contains("\"team-x\" is not designated"), "{msg}");
        assert_eq!(
            denied(&review_labelled("liqo-tenant-a", gw.clone(), spec.clone())),
            None
        );
        assert_eq!(
            denied(&review_labelled("peerwall-system", gw, spec.clone())),
            None
        );
        let other = serde_json::json!({"peerwall.io/target": "gateway", "peerwall.io/remote-cluster-id": "b"});
        let msg = denied(&review_labelled("liqo-tenant-a", other, spec.clone())).expect("refused");
        assert!(msg.contains("tenant namespace of peer \"a\""), "{msg}");
        // Not meant for any agent: steers nothing, admitted anywhere.
        assert_eq!(
            denied(&review_labelled("team-x", serde_json::json!({}), spec)),
            None
        );
    }

    #[test]
    fn packet_changing_rules_are_refused_by_default() {
        let nat = serde_json::json!({"table": {"name": "t", "family": "IPV4", "chains": [{
            "name": "n", "type": "nat", "hook": "prerouting", "priority": -100, "policy": "accept",
            "rules": {"natRules": [{"name": "x", "natType": "dnat", "to": "10.0.0.1", "match": []}]}
        }]}});
        let r = review_labelled("peerwall-system", serde_json::json!({}), nat);
        assert_eq!(r["response"]["allowed"], false, "{r}");
        let msg = r["response"]["status"]["message"].as_str().unwrap();
        assert!(
            msg.contains("spec.table.chains[0].rules.natRules[0]: a NAT rule"),
            "{msg}"
        );
    }

    #[test]
    fn garbage_is_refused() {
        let r = review(b"{\"kind\": 1}", &judge());
        assert_eq!(r["response"]["allowed"], false);
    }
}
