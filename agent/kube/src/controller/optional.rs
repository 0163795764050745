//! Kinds whose CRD may be missing (Liqo's `Configuration`s, ClusterNetworkPolicies): watched
//! once they can be listed, with what the controller does meanwhile, and the CRD installed
//! where peerwall may install it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::Client;

use super::Ctx;

/// Liqo's Configurations and ClusterNetworkPolicies, each watched once it can be listed.
pub(super) async fn watch_optional_kinds(
    ctx: &Arc<Ctx>,
    client: &Client,
    changed: &Arc<crate::Changes>,
) -> anyhow::Result<()> {
    watch_optional(
        ctx,
        client,
        changed,
        Optional {
            resource: crate::liqo_configuration_resource(),
            slot: |c| &c.liqo_configs,
            what: "Liqo's Configurations",
            without: "no remapped CIDRs",
            only_if_absent: false,
            install: None,
        },
    )
    .await?;
    watch_optional(
        ctx,
        client,
        changed,
        Optional {
            resource: crate::cluster_network_policy_resource(),
            slot: |c| &c.cluster_policies,
            what: "ClusterNetworkPolicies",
            without: "no admin or baseline tier (no CRD, so none exists)",
            only_if_absent: true,
            install: Some(crate::cluster_policy_crd::crd),
        },
    )
    .await
}

/// A kind whose CRD may be missing, watched once it can be listed ([`watch_optional`]).
struct Optional {
    /// The kind.
    resource: kube::api::ApiResource,
    /// Where its cache goes.
    slot: fn(&Ctx) -> &std::sync::OnceLock<Store<DynamicObject>>,
    /// What it is, for the log.
    what: &'static str,
    /// What the controller does without it, for the log.
    without: &'static str,
    /// Only an API server that does not serve the kind (404: no CRD, so no object of it
    /// exists) is run without; any other failure to list it (RBAC) stops the controller:
    /// objects of the kind may exist, and running without them would silently enforce less
    /// than they say.
    only_if_absent: bool,
    /// The CRD to create when the API server does not serve the kind (never replacing one
    /// that exists: a create only, refused when the name is taken).
    install: Option<fn() -> Result<CustomResourceDefinition, serde_json::Error>>,
}

/// Create the CRD `install` gives, unless one of its name exists; whether it was created.
async fn install_crd(
    client: &Client,
    install: fn() -> Result<CustomResourceDefinition, serde_json::Error>,
    what: &str,
) -> bool {
    let crd = match install() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "the CRD of {what} could not be built");
            return false;
        }
    };
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    match api.create(&kube::api::PostParams::default(), &crd).await {
        Ok(_) => {
            tracing::info!(
                "installed the CRD of {what} ({})",
                crd.metadata.name.unwrap_or_default()
            );
            true
        }
        // Installed meanwhile, or another version of it: left as it is.
        Err(kube::Error::Api(e)) if e.code == 409 => false,
        Err(e) => {
            tracing::warn!(error = %e, "could not install the CRD of {what}; install it by hand (peerwall crd --cluster-network-policy | kubectl create -f -)");
            false
        }
    }
}

/// Liqo's Configurations only matter where CIDRs overlap; ClusterNetworkPolicies only where an
/// admin writes them. Without the CRD (a cluster not peered yet, network-policy-api not
/// installed) or the RBAC to read them, the controller runs without the kind rather than not
/// at all, probes again every 30 s (no watch retrying every second in the log meanwhile), and
/// takes it into account once it can be listed.
async fn watch_optional(
    ctx: &Arc<Ctx>,
    client: &Client,
    changed: &Arc<crate::Changes>,
    kind: Optional,
) -> anyhow::Result<()> {
    let api = Api::<DynamicObject>::all_with(client.clone(), &kind.resource);
    let probe = api
        .list_metadata(&kube::api::ListParams::default().limit(1))
        .await;
    let watch = {
        let (ctx, changed, api, resource) = (
            ctx.clone(),
            changed.clone(),
            api.clone(),
            kind.resource.clone(),
        );
        move || {
            let store = crate::cache(api, watcher::Config::default(), resource, changed);
            let _ = (kind.slot)(&ctx).set(store.clone());
            store
        }
    };
    match probe {
        Ok(_) => watch()
            .wait_until_ready()
            .await
            .with_context(|| format!("the watch of {} ended before its first list", kind.what))?,
        Err(e) if kind.only_if_absent && !matches!(&e, kube::Error::Api(a) if a.code == 404) => {
            return Err(e).with_context(|| {
                format!(
                    "listing {}: the API server serves them but they cannot be read (RBAC? kubectl apply -k deploy/); without them the controller would enforce less than they say",
                    kind.what
                )
            });
        }
        Err(e) => {
            tracing::warn!(
                error = %e,
                "{} cannot be listed (CRD not installed, or no RBAC): {} until they can; trying again every 30 s",
                kind.what,
                kind.without
            );
            let what = kind.what;
            let absent = matches!(&e, kube::Error::Api(a) if a.code == 404);
            let installed = match kind.install {
                Some(install) if absent => install_crd(client, install, what).await,
                _ => false,
            };
            tokio::spawn(async move {
                // Just installed: served within seconds; look every second for a minute.
                let mut quick: u32 = if installed { 60 } else { 0 };
                loop {
                    let pause = if quick > 0 { 1 } else { 30 };
                    quick = quick.saturating_sub(1);
                    tokio::time::sleep(Duration::from_secs(pause)).await;
                    let again = api
                        .list_metadata(&kube::api::ListParams::default().limit(1))
                        .await;
                    if again.is_ok() {
                        tracing::info!("{what} can be listed now: watching them");
                        watch();
                        break;
                    }
                }
            });
        }
    }
    Ok(())
}
