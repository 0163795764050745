//! Each peer's NetworkPolicy tier and the companion NetworkPolicies a label-aware CNI needs,
//! from one view of the cluster per pass; policies peerwall cannot enforce reported once.

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, DynamicObject};
use kube::{Resource, ResourceExt};
use serde_json::json;

use super::context::{remaps, Ctx};
use super::publish::{api_error, publish, ReconcileError, Seen};
use super::storable::publish_configuration;
use super::view::NetpolView;
use crate::netpol;
use crate::protection;

/// The view of the cluster as the caches stand now, shared: computed once per change of a
/// cache it reads ([`crate::Changes::inputs`]: not the controller's own FirewallConfigurations
/// and AddressSets, whose echoes woke a pass that computed the same view again) and handed to
/// every peer's pass meanwhile. Each peer's pass
/// used to compute its own, so a pass over N peers read every pod N times, and N views could
/// be alive at once (a node of 50 peers: gigabytes). The count is read before the caches: a
/// change after it moves the count, and the next pass computes anew.
pub(super) fn shared_view(ctx: &Ctx) -> Arc<NetpolView> {
    ctx.view.at(ctx.changes.inputs(), || netpol_view(ctx))
}

fn netpol_view(ctx: &Ctx) -> NetpolView {
    let (namespaces, nodes, policies) = (
        ctx.namespaces.state(),
        ctx.nodes.state(),
        ctx.network_policies.state(),
    );
    let remaps = remaps(ctx);
    // The pods by difference: only those a pod event, a virtual node or a remap touched since
    // the last view are derived anew.
    let (pods, pod_namespaces) = ctx.pods.view(
        crate::model::virtual_nodes(nodes.iter().map(AsRef::as_ref)),
        &remaps,
    );
    let (read, unreadable) = ctx
        .policy_reads
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .policies(policies.iter().map(AsRef::as_ref));
    let mut cluster = crate::model::assemble(
        namespaces.iter().map(|n| crate::model::namespace_labels(n)),
        pods,
        pod_namespaces.iter().map(String::as_str),
        read,
        &remaps,
    );
    let mut cnp_problems = Vec::new();
    for obj in ctx
        .cluster_policies
        .get()
        .map(kube::runtime::reflector::Store::state)
        .unwrap_or_default()
    {
        let read = serde_json::to_value(obj.as_ref())
            .map_err(|e| e.to_string())
            .and_then(|v| netpol::cnp::read::policy_json(v).map_err(|u| u.why));
        match read {
            Ok(r) => {
                cnp_problems.extend(r.unenforced.into_iter().map(|why| (obj.clone(), why)));
                cluster.cluster_policies.push(r.policy);
            }
            Err(why) => cnp_problems.push((obj.clone(), format!("{why} (the policy is left out)"))),
        }
    }
    (cluster, unreadable, policies, cnp_problems)
}

/// Keep `peer`'s NetworkPolicy tier ([`netpol::tier`]) in place, and report once what of the
/// NetworkPolicies it cannot read or enforce (an Event on the policy, a log line).
pub(super) async fn publish_tier(
    ns: &Namespace,
    peer: &protection::Peer,
    ctx: &Ctx,
    view: &Arc<NetpolView>,
    audit: bool,
) -> Result<(), ReconcileError> {
    let (cluster, unreadable, policies, cnp_problems) = &**view;
    for (obj, why) in cnp_problems {
        report_object(ctx, obj, "clusternetworkpolicy", why).await;
    }
    publish_cnp_status(ctx, cnp_problems).await;
    let tiers = || {
        ctx.tiers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    let started = std::time::Instant::now();
    let kept = tiers().get(view, &peer.id, audit);
    let mut how = None;
    let (spec, unenforced) = match kept {
        Some(parts) => parts,
        None => {
            // Made outside the lock (other peers' passes go on meanwhile), by difference from
            // the peer's last tier where only pods changed.
            let last = tiers().take(&peer.id);
            if last.is_none() {
                // A peer's first tier: those of peers whose tenant namespace is gone go.
                let live: std::collections::HashSet<String> = ctx
                    .namespaces
                    .state()
                    .iter()
                    .filter(|n| n.metadata.deletion_timestamp.is_none())
                    .filter_map(|n| n.labels().get(crate::REMOTE_CLUSTER_ID).cloned())
                    .collect();
                tiers().forget_gone(&live);
            }
            let k = tokio::task::block_in_place(|| match last {
                Some(last) => last.next(cluster, &peer.id, audit),
                None => netpol::tier::Kept::compute(cluster, &peer.id, audit),
            });
            let parts = (k.spec().clone(), k.unenforced().to_vec());
            how = Some(k.how());
            tiers().keep(view, &peer.id, audit, k);
            parts
        }
    };
    let problems = unreadable
        .iter()
        .map(|u| {
            (
                u.policy.clone(),
                format!("{} (the policy is left out)", u.why),
            )
        })
        .chain(unenforced.iter().map(|u| (u.policy.clone(), u.why.clone())));
    for (policy, why) in problems {
        report_policy(ctx, policies, &policy, &why).await;
    }
    let tier_ms = started.elapsed().as_secs_f64() * 1e3;
    let labels = peerwall_intent::labels::for_gateway(&peer.id);
    if publish_configuration(ctx, ns, netpol::tier::TIER_CONFIG, spec, &labels).await? {
        ctx.count(|m| m.gateway_writes += 1);
        tracing::info!(peer = %peer.id, "NetworkPolicy tier updated");
    }
    tracing::debug!(
        peer = %peer.id,
        tier = %how.map_or_else(|| "kept".to_string(), |h| h.to_string()),
        tier_ms,
        publish_ms = started.elapsed().as_secs_f64() * 1e3 - tier_ms,
        "tier step"
    );
    Ok(())
}

/// Keep the CNI companions of the users' NetworkPolicies ([`netpol::companion`]) in place:
/// written when new or changed, removed when no longer needed. Each is owned by its user's
/// policy, so deleting that policy removes it too.
pub(super) async fn publish_companions(
    ctx: &Ctx,
    (cluster, _, policies, _): &NetpolView,
) -> Result<(), ReconcileError> {
    let (desired, too_large) = netpol::companion::companions(cluster, |_| false);
    for (policy, why) in too_large {
        report_policy(ctx, policies, &policy, &why).await;
    }
    let key = |ns: &str, name: &str| format!("{ns}/{name}");
    let mut wanted = BTreeSet::new();
    for netpol::companion::Companion { owner, object } in desired {
        let ns = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        wanted.insert(key(&ns, &name));
        // Owned by the user's policy it stands beside.
        let owner = policies.iter().find(|p| {
            p.namespace().as_deref() == Some(&ns)
                && p.name_any() == owner
                && !netpol::companion::is_companion(p.labels())
        });
        let owners = owner.map(|u| {
            json!([{
                "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "name": u.name_any(), "uid": u.uid().unwrap_or_default(),
            }])
        });
        // Seen only where it is a companion: a policy under this name (peerwall's, by its
        // prefix) that is not one is taken over.
        let seen = policies
            .iter()
            .find(|p| p.namespace().as_deref() == Some(&ns) && p.name_any() == name)
            .filter(|c| netpol::companion::is_companion(c.labels()))
            .map(|c| Seen::of(c.as_ref()));
        let api: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), &ns);
        if publish(&api, seen.as_ref(), object, owners).await? {
            tracing::info!(networkpolicy = %key(&ns, &name), "CNI companion written");
        }
    }
    for p in policies
        .iter()
        .filter(|p| netpol::companion::is_companion(p.labels()))
    {
        let ns = p.namespace().unwrap_or_default();
        let name = p.name_any();
        if wanted.contains(&key(&ns, &name)) {
            continue;
        }
        let api: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), &ns);
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => tracing::info!(networkpolicy = %key(&ns, &name), "CNI companion removed"),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(source) => return Err(api_error("deleting", &ns, &name)(source)),
        }
    }
    Ok(())
}

/// Condition type peerwall writes on each ClusterNetworkPolicy.
pub const CNP_CONDITION: &str = "Accepted";

/// The `Accepted` condition of every ClusterNetworkPolicy: `True` (reason `Accepted`) when it is
/// enforced as written, `False` (reason `NotEnforced`, the reasons as its message) when it was
/// refused or a part of it fails closed. Written by server-side apply of this one entry of the
/// conditions (a list keyed by `type`), only when it changes: what other implementations write
/// stays.
async fn publish_cnp_status(ctx: &Ctx, problems: &[(Arc<DynamicObject>, String)]) {
    let Some(store) = ctx.cluster_policies.get() else {
        return;
    };
    let resource = crate::cluster_network_policy_resource();
    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &resource);
    for obj in store.state() {
        let name = obj.name_any();
        let whys: Vec<&str> = problems
            .iter()
            .filter(|(o, _)| o.name_any() == name)
            .map(|(_, w)| w.as_str())
            .collect();
        let (status, reason, message) = if whys.is_empty() {
            (
                "True",
                "Accepted",
                "enforced by peerwall on the gateways of every peer".to_string(),
            )
        } else {
            ("False", "NotEnforced", whys.join("; "))
        };
        let generation = obj.metadata.generation.unwrap_or_default();
        let current = obj.data["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == CNP_CONDITION);
        let same = current.is_some_and(|c| {
            c["status"] == status
                && c["reason"] == reason
                && c["message"] == message.as_str()
                && c["observedGeneration"] == generation
        });
        if same {
            continue;
        }
        let body = json!({
            "apiVersion": format!("{}/{}", resource.group, resource.version),
            "kind": resource.kind,
            "status": {"conditions": [{
                "type": CNP_CONDITION,
                "status": status,
                "reason": reason,
                "message": message.chars().take(32768).collect::<String>(),
                "observedGeneration": generation,
                "lastTransitionTime": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            }]},
        });
        let params = kube::api::PatchParams::apply(super::publish::FIELD_MANAGER).force();
        match api
            .patch_status(&name, &params, &kube::api::Patch::Apply(&body))
            .await
        {
            Ok(_) => tracing::info!(clusternetworkpolicy = %name, status, "condition written"),
            Err(e) => {
                tracing::warn!(clusternetworkpolicy = %name, error = %e, "could not write the Accepted condition")
            }
        }
    }
}

/// One Warning Event on the NetworkPolicy `key` (`namespace/name`) and a log line, once per
/// reason.
pub(super) async fn report_policy(
    ctx: &Ctx,
    policies: &[Arc<NetworkPolicy>],
    key: &str,
    why: &str,
) {
    if !first_report(ctx, key, why) {
        return;
    }
    tracing::warn!(networkpolicy = key, "{why}");
    let Some(p) = policies
        .iter()
        .find(|p| format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()) == key)
    else {
        return;
    };
    not_enforced_event(ctx, &p.object_ref(&()), key, why).await;
}

/// [`report_policy`] for a watched object of another kind (`kind`, for the log).
async fn report_object(ctx: &Ctx, obj: &DynamicObject, kind: &str, why: &str) {
    let key = format!("{kind}/{}", obj.name_any());
    if !first_report(ctx, &key, why) {
        return;
    }
    tracing::warn!(object = %key, "{why}");
    let resource = crate::cluster_network_policy_resource();
    not_enforced_event(ctx, &obj.object_ref(&resource), &key, why).await;
}

/// Whether `why` about `key` is reported for the first time (then it is noted).
fn first_report(ctx: &Ctx, key: &str, why: &str) -> bool {
    ctx.reported
        .lock()
        .map(|mut r| r.insert(format!("{key}\n{why}")))
        .unwrap_or(false)
}

/// A Warning Event `NotEnforced` on the object `reference`.
async fn not_enforced_event(
    ctx: &Ctx,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    key: &str,
    why: &str,
) {
    let recorder = crate::recorder::Recorder::new(
        ctx.client.clone(),
        kube::runtime::events::Reporter {
            controller: "peerwall-controller".into(),
            instance: None,
        },
    );
    let ev = kube::runtime::events::Event {
        type_: kube::runtime::events::EventType::Warning,
        reason: "NotEnforced".into(),
        note: Some(why.chars().take(1000).collect()),
        action: "Enforce".into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&ev, reference).await {
        tracing::warn!(object = key, error = %e, "could not publish the event");
    }
}
