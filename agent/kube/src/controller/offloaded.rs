//! The NetworkPolicy of each offloaded namespace (`peerwall-offloaded`): created with the
//! namespace, following its consumer's CIDRs and ProtectionPolicies, removed when it stops being one.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams};
use kube::runtime::controller::Action;
use kube::ResourceExt;

use super::context::{exceptions_for, homes, labels_of, Ctx};
use super::publish::{api_error, apply, owned_by_namespace, publish, typed, ReconcileError, Seen};
use super::NETWORK_POLICY;
use crate::netpol;
use crate::protection;
use crate::{MANAGED_BY, MANAGER};

/// Keep the NetworkPolicies of `peer`'s offloaded namespaces following its CIDRs (they
/// change with Liqo's `Configuration`, which the namespace reconcile does not watch) and its
/// ProtectionPolicies.
pub(super) async fn refresh_offloaded(
    peer: &str,
    ctx: &Ctx,
    exceptions: &protection::exceptions::ForPeer,
) -> Result<(), ReconcileError> {
    let home = homes(ctx).remove(peer).unwrap_or_default();
    let open: Vec<_> = exceptions.for_offloaded().collect();
    let policies = ctx.network_policies.state();
    // Ours by namespace, found once (not a walk over every policy per namespace).
    let current_of: HashMap<&str, &Arc<NetworkPolicy>> = policies
        .iter()
        .filter(|p| p.metadata.name.as_deref() == Some(NETWORK_POLICY))
        .filter_map(|p| Some((p.metadata.namespace.as_deref()?, p)))
        .collect();
    let said = |ns: &str, version: &str, body: &serde_json::Value| {
        ctx.offloaded_said
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .holds(ns, version, body)
    };
    let namespaces = ctx.namespaces.state();
    {
        // Namespaces gone take what was said of them along.
        let live: std::collections::HashSet<&str> = namespaces
            .iter()
            .filter_map(|n| n.metadata.name.as_deref())
            .collect();
        ctx.offloaded_said
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .keep_only(|ns| live.contains(ns));
    }
    for ns in namespaces {
        let info = protection::Namespace {
            name: ns.name_any(),
            labels: labels_of(ns.labels()),
        };
        if protection::offloaded_namespace_owner(&info) != Some(peer)
            || ns.metadata.deletion_timestamp.is_some()
        {
            continue;
        }
        // Absent: the namespace reconcile creates it.
        let Some(current) = current_of.get(info.name.as_str()) else {
            continue;
        };
        let body = protection::offloaded_network_policy(&info.name, peer, &home, &open);
        // Without a version (a fixture) the policy is compared every time.
        let version = current.resource_version().filter(|v| !v.is_empty());
        if version
            .as_deref()
            .is_some_and(|v| said(&info.name, v, &body))
        {
            continue;
        }
        let api: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), &info.name);
        let seen = Seen::of(current.as_ref());
        if publish(
            &api,
            Some(&seen),
            body.clone(),
            Some(owned_by_namespace(&ns)),
        )
        .await?
        {
            ctx.count(|m| m.network_policy_writes += 1);
            tracing::info!(namespace = %info.name, peer, "offloaded namespace's NetworkPolicy follows its consumer's CIDRs and ProtectionPolicies");
        } else if let Some(v) = version {
            ctx.offloaded_said
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .note(info.name.clone(), v, body);
        }
    }
    Ok(())
}

pub(super) async fn reconcile_namespace(
    ns: Arc<Namespace>,
    ctx: Arc<Ctx>,
) -> Result<Action, ReconcileError> {
    let name = ns.name_any();
    let api: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), &name);
    let info = protection::Namespace {
        name: name.clone(),
        labels: labels_of(ns.labels()),
    };
    let owner = protection::offloaded_namespace_owner(&info).map(str::to_string);
    match owner {
        Some(consumer) if ns.metadata.deletion_timestamp.is_none() => {
            // The NetworkPolicy takes the openings' selectors only: no pod addresses needed.
            let exceptions = exceptions_for(&ctx, &consumer, &netpol::Cluster::default());
            let open: Vec<_> = exceptions.for_offloaded().collect();
            let object: NetworkPolicy = typed(
                protection::offloaded_network_policy(
                    &name,
                    &consumer,
                    &homes(&ctx).remove(&consumer).unwrap_or_default(),
                    &open,
                ),
                Some(owned_by_namespace(&ns)),
            )?;
            apply(&api, &object).await?;
            ctx.count(|m| m.network_policy_writes += 1);
        }
        _ => {
            // Not (or no longer) offloaded: remove ours if present.
            match api.get_opt(NETWORK_POLICY).await {
                Ok(Some(np))
                    if np.labels().get(MANAGED_BY).map(String::as_str) == Some(MANAGER) =>
                {
                    api.delete(NETWORK_POLICY, &DeleteParams::default())
                        .await
                        .map_err(api_error("deleting", &name, NETWORK_POLICY))?;
                    ctx.count(|m| m.network_policy_removals += 1);
                    tracing::info!(namespace = %name, "namespace no longer offloaded: NetworkPolicy removed");
                }
                Ok(_) => {}
                Err(source) => return Err(api_error("reading", &name, NETWORK_POLICY)(source)),
            }
        }
    }
    Ok(Action::await_change())
}

#[cfg(test)]
#[path = "offloaded/tests.rs"]
mod tests;
