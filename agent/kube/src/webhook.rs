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

/// The ServiceAccount peerwall's controller runs as (`deploy/common/controller.yaml`).
pub const CONTROLLER_SERVICE_ACCOUNT: &str = "peerwall-controller";

/// What admission knows beyond the object: who may steer a gateway, the Liqo tenant
/// namespaces as last listed, and who the controller is.
#[derive(Clone, Debug)]
pub struct Judge {
    /// The agents' trust ([`super::trust`]): the webhook refuses what they would ignore.
    pub trust: super::trust::Trust,
    /// Tenant namespaces and their peers.
    pub tenants: super::trust::Tenants,
    /// The user the controller writes as (`system:serviceaccount:<ns>:peerwall-controller`):
    /// the identity the API server authenticated, which no label or field of an object can
    /// claim.
    pub controller: String,
}

/// What only the controller may write, by identity: its objects (by name), the tables it
/// derives (by name), the sets of its objects (AddressSets naming them). `None` when `obj`
/// is none of these or `user` is the controller.
fn controllers_only(
    judge: &Judge,
    user: Option<&str>,
    kind: &str,
    obj: &DynamicObject,
) -> Option<String> {
    if user == Some(judge.controller.as_str()) {
        return None;
    }
    let key = super::key_of(obj);
    let who = user.unwrap_or("an unauthenticated user");
    let what = if kind == peerwall_intent::load::ADDRESS_SET_KIND {
        let target = obj
            .data
            .pointer("/spec/firewallConfiguration")
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        super::agent::controllers_key(target)
            .then(|| format!("it fills a set of the controller's {target}"))?
    } else if super::agent::controllers_key(&key) {
        "it is one of the controller's objects".to_string()
    } else {
        let table = obj
            .data
            .pointer("/spec/table/name")
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        super::agent::reserved_table(table)
            .then(|| format!("spec.table.name {table:?} is reserved for the controller's tables"))?
    };
    Some(format!(
        "{key}: {what}: only peerwall's controller ({}) writes it, not {who}",
        judge.controller
    ))
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

/// The object under review read as the agent's watch reads it, so that the webhook and the
/// agent decode a spec one way.
fn read_as_watched<S: serde::de::DeserializeOwned>(
    obj: &DynamicObject,
) -> Result<crate::watched::Watched<S>, String> {
    crate::watched::Watched::from_dynamic(obj)
        .map_err(|e| format!("{}: unreadable: {e}", super::key_of(obj)))
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
    if let (Operation::Create | Operation::Update, Some(obj)) = (&req.operation, &req.object) {
        if let Some(why) = controllers_only(
            judge,
            req.user_info.username.as_deref(),
            &req.kind.kind,
            obj,
        ) {
            tracing::info!(object = %super::key_of(obj), reason = %why, "refused");
            return to_json(resp.deny(why));
        }
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
            match read_as_watched::<peerwall_intent::AddressSetSpec>(obj)
                .and_then(|o| super::check_slice(&o).map_err(|e| e.to_string()))
                .and_then(|_| steering(judge, &namespace, obj))
            {
                Ok(()) => resp,
                Err(e) => {
                    tracing::info!(object = %super::key_of(obj), reason = %e, "refused");
                    resp.deny(e)
                }
            }
        }
        (Operation::Create | Operation::Update, Some(obj)) => match read_as_watched(obj)
            .and_then(|o| super::check(&o).map_err(|e| e.to_string()))
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
            controller: "system:serviceaccount:peerwall-system:peerwall-controller".into(),
            trust: crate::trust::Trust::default_for("peerwall-system"),
            tenants: crate::trust::Tenants::from([("liqo-tenant-a".to_string(), "a".to_string())]),
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

#[cfg(test)]
mod identity_tests {
    use super::*;

    const CONTROLLER: &str = "system:serviceaccount:peerwall-system:peerwall-controller";

    /// A review of `kind` `name` in `liqo-tenant-a` with `spec`, written by `user`, labelled
    /// as the controller labels its objects (a label anyone can set).
    fn review_by(user: &str, kind: &str, name: &str, spec: serde_json::Value) -> serde_json::Value {
        let resource = if kind == "AddressSet" {
            "addresssets"
        } else {
            "firewallconfigurations"
        };
        let body = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-1",
                "kind": {"group": "peerwall.io", "version": "v1alpha1", "kind": kind},
                "resource": {"group": "peerwall.io", "version": "v1alpha1", "resource": resource},
                "operation": "CREATE",
                "userInfo": {"username": user},
                "name": name,
                "namespace": "liqo-tenant-a",
                "object": {
                    "apiVersion": "peerwall.io/v1alpha1",
                    "kind": kind,
                    "metadata": {"name": name, "namespace": "liqo-tenant-a", "labels": {
                        "app.kubernetes.io/managed-by": "peerwall",
                        "peerwall.io/target": "gateway", "peerwall.io/remote-cluster-id": "a"}},
                    "spec": spec,
                },
            },
        });
        review(
            body.to_string().as_bytes(),
            &Judge {
                controller: CONTROLLER.into(),
                trust: crate::trust::Trust::default_for("peerwall-system"),
                tenants: crate::trust::Tenants::from([(
                    "liqo-tenant-a".to_string(),
                    "a".to_string(),
                )]),
            },
        )
    }

    fn refusal(r: &serde_json::Value) -> Option<String> {
        (r["response"]["allowed"] == false).then(|| {
            r["response"]["status"]["message"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
    }

    #[test]
    fn only_the_controllers_identity_writes_its_objects_tables_and_sets() {
        let table = |name: &str| serde_json::json!({"table": {"name": name, "family": "INET", "chains": []}});
        let slice = serde_json::json!({"firewallConfiguration": "peerwall-gateway", "set": "offloaded", "addresses": ["10.0.0.1"]});
        let user = "system:serviceaccount:liqo-tenant-a:someone";
        // The controller label is no exemption: the writer's identity decides.
        for (kind, name, spec, what) in [
            (
                "FirewallConfiguration",
                "peerwall-gateway",
                table("peerwall_a"),
                "one of the controller's objects",
            ),
            (
                "FirewallConfiguration",
                "aaa",
                table("peerwall_a"),
                "reserved for the controller's tables",
            ),
            (
                "FirewallConfiguration",
                "aaa",
                table("pwnp_a"),
                "reserved for the controller's tables",
            ),
            (
                "AddressSet",
                "extra",
                slice.clone(),
                "fills a set of the controller's peerwall-gateway",
            ),
        ] {
            let msg = refusal(&review_by(user, kind, name, spec.clone()))
                .unwrap_or_else(|| panic!("{kind} {name} admitted"));
            assert!(
                msg.contains(what) && msg.contains(user) && msg.contains(CONTROLLER),
                "{msg}"
            );
            assert_eq!(
                refusal(&review_by(CONTROLLER, kind, name, spec)),
                None,
                "{kind} {name} from the controller"
            );
        }
        // Anyone's own names and sets.
        assert_eq!(
            refusal(&review_by(
                user,
                "FirewallConfiguration",
                "aaa",
                table("mine")
            )),
            None
        );
        let own = serde_json::json!({"firewallConfiguration": "mine", "set": "s", "addresses": []});
        assert_eq!(refusal(&review_by(user, "AddressSet", "s1", own)), None);
    }
}
