//! `peerwall status`'s reads from the API server: the peers' tenant namespaces,
//! configurations and Events ([`fetch`]), and the install's components ([`fetch_install`]).
//! Everything read here goes to the pure [`super::summarize`] and [`super::components::check`].

use std::collections::BTreeMap;

use anyhow::Context;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams};

use super::components::{
    Crd, Found, Install, WebhookConfig, Workload, AGENT_DAEMONSET, CONTROLLER, CRDS,
    INSTALL_NAMESPACE, SIDECAR_CONTAINER, WEBHOOK, WEBHOOK_CONFIGURATION,
};
use super::EventInfo;

/// Everything [`super::summarize`] needs, from the API server.
pub async fn fetch(
    client: &kube::Client,
) -> anyhow::Result<(
    BTreeMap<String, String>,
    Vec<serde_json::Value>,
    Vec<EventInfo>,
)> {
    use k8s_openapi::api::core::v1::Namespace;
    use k8s_openapi::api::events::v1::Event;
    use kube::api::DynamicObject;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let tenants = crate::tenants_of(
        namespaces
            .list(&ListParams::default().labels(&format!("{}=true", crate::TENANT_NAMESPACE)))
            .await
            .context("listing Liqo's tenant namespaces")?
            .items
            .iter(),
    );
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &crate::fwc_resource());
    // Without the CRD there is no configuration; the components' part says the CRD is missing.
    let configs = match api
        .list(&ListParams::default().labels(crate::DEFAULT_SELECTOR))
        .await
    {
        Err(kube::Error::Api(s)) if s.code == 404 => Vec::new(),
        r => r
            .context("listing peerwall's gateway FirewallConfigurations")?
            .items
            .into_iter()
            .map(|o| serde_json::to_value(o).unwrap_or_default())
            .collect(),
    };
    let events: Api<Event> = Api::all(client.clone());
    let events = events
        .list(&ListParams::default())
        .await
        .context("listing Events")?
        .items
        .into_iter()
        .filter_map(|e| {
            let r = e.regarding.as_ref()?;
            if r.kind.as_deref() != Some("FirewallConfiguration") {
                return None;
            }
            let time = e
                .series
                .as_ref()
                .map(|s| s.last_observed_time.0)
                .or(e.event_time.as_ref().map(|t| t.0))
                .or(e.deprecated_last_timestamp.as_ref().map(|t| t.0))
                .map(|t| t.as_second());
            Some(EventInfo {
                reason: e.reason.clone().unwrap_or_default(),
                namespace: r.namespace.clone().unwrap_or_default(),
                name: r.name.clone().unwrap_or_default(),
                note: e.note.clone().unwrap_or_default(),
                time,
                count: e.series.as_ref().map_or(1, |s| s.count.max(1) as u64),
            })
        })
        .collect();
    Ok((tenants, configs, events))
}

/// An answer of the API server about one object: found, absent (404), or unreadable (the
/// reason, e.g. RBAC's 403). Anything else (the server unreachable) is an error: status cannot
/// say anything then.
fn found<T>(r: Result<Option<T>, kube::Error>, what: &str) -> anyhow::Result<Found<T>> {
    match r {
        Ok(Some(v)) => Ok(Found::Yes(v)),
        Ok(None) => Ok(Found::No),
        Err(kube::Error::Api(s)) => Ok(Found::Unknown(format!("{} ({})", s.message, s.code))),
        Err(e) => Err(e).with_context(|| format!("reading {what}")),
    }
}

/// How many pods are ready and which image they run, from the pods themselves: `container`
/// names the peerwall container (None: the first).
fn pods_of(pods: &[Pod], container: Option<&str>) -> Workload {
    let mut w = Workload::default();
    for p in pods {
        let spec = p.spec.as_ref();
        let c = spec.and_then(|s| match container {
            Some(n) => s.containers.iter().find(|c| c.name == n),
            None => s.containers.first(),
        });
        let Some(c) = c else { continue };
        w.desired += 1;
        if let Some(i) = &c.image {
            *w.images.entry(i.clone()).or_default() += 1;
        }
        let ready = p
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .into_iter()
            .flatten()
            .any(|s| s.name == c.name && s.ready);
        if ready {
            w.ready += 1;
        } else if w.not_ready.len() < 5 {
            let node = spec
                .and_then(|s| s.node_name.clone())
                .unwrap_or_else(|| "no node".into());
            let ns = p.metadata.namespace.clone().unwrap_or_default();
            let name = p.metadata.name.clone().unwrap_or_default();
            let who = if container.is_some() {
                format!("{ns}/{name}")
            } else {
                name
            };
            w.not_ready.push(format!("{who} ({node})"));
        }
    }
    w
}

/// The pods of `deploy/`'s workload `name` (its `app.kubernetes.io/name` label).
async fn install_pods(client: &kube::Client, name: &str) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), INSTALL_NAMESPACE);
    api.list(&ListParams::default().labels(&format!("app.kubernetes.io/name={name}")))
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

/// Counts from the workload's status, images and unready pods from its pods.
fn workload(desired: i32, ready: i32, updated: i32, pods: &[Pod]) -> Workload {
    let from_pods = pods_of(pods, None);
    Workload {
        desired,
        ready,
        updated,
        images: from_pods.images,
        not_ready: from_pods.not_ready,
    }
}

async fn deployment(client: &kube::Client, name: &str) -> anyhow::Result<Found<Workload>> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), INSTALL_NAMESPACE);
    let d = found(
        api.get_opt(name).await,
        &format!("Deployment {INSTALL_NAMESPACE}/{name}"),
    )?;
    Ok(match d {
        Found::Yes(d) => {
            let pods = install_pods(client, name).await;
            let st = d.status.unwrap_or_default();
            Found::Yes(workload(
                d.spec.and_then(|s| s.replicas).unwrap_or(1),
                st.ready_replicas.unwrap_or(0),
                st.updated_replicas.unwrap_or(0),
                &pods,
            ))
        }
        Found::No => Found::No,
        Found::Unknown(why) => Found::Unknown(why),
    })
}

/// Everything [`super::components::check`] needs, from the API server; `tenant_namespaces`:
/// Liqo's tenant namespaces (as [`fetch`] listed them), where sidecars run.
pub async fn fetch_install(
    client: &kube::Client,
    tenant_namespaces: impl Iterator<Item = &String>,
) -> anyhow::Result<Install> {
    let ds: Api<DaemonSet> = Api::namespaced(client.clone(), INSTALL_NAMESPACE);
    let agents = match found(
        ds.get_opt(AGENT_DAEMONSET).await,
        &format!("DaemonSet {INSTALL_NAMESPACE}/{AGENT_DAEMONSET}"),
    )? {
        Found::Yes(d) => {
            let pods = install_pods(client, AGENT_DAEMONSET).await;
            let st = d.status.unwrap_or_default();
            Found::Yes(workload(
                st.desired_number_scheduled,
                st.number_ready,
                st.updated_number_scheduled.unwrap_or(0),
                &pods,
            ))
        }
        Found::No => Found::No,
        Found::Unknown(why) => Found::Unknown(why),
    };
    // Sidecars: the peerwall containers of the pods in Liqo's tenant namespaces.
    let mut gateway_pods = Vec::new();
    for ns in tenant_namespaces {
        let api: Api<Pod> = Api::namespaced(client.clone(), ns);
        gateway_pods.extend(
            api.list(&ListParams::default())
                .await
                .map(|l| l.items)
                .unwrap_or_default()
                .into_iter()
                .filter(|p| {
                    p.spec
                        .as_ref()
                        .is_some_and(|s| s.containers.iter().any(|c| c.name == SIDECAR_CONTAINER))
                }),
        );
    }
    let sidecars = pods_of(&gateway_pods, Some(SIDECAR_CONTAINER));
    let hooks: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let webhook_config = match found(
        hooks.get_opt(WEBHOOK_CONFIGURATION).await,
        &format!("ValidatingWebhookConfiguration {WEBHOOK_CONFIGURATION}"),
    )? {
        Found::Yes(c) => Found::Yes(WebhookConfig {
            ca_bundles: c
                .webhooks
                .unwrap_or_default()
                .into_iter()
                .map(|w| {
                    let ca = w
                        .client_config
                        .ca_bundle
                        .as_ref()
                        .is_some_and(|b| !b.0.is_empty());
                    (w.name, ca)
                })
                .collect(),
        }),
        Found::No => Found::No,
        Found::Unknown(why) => Found::Unknown(why),
    };
    let crd_api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut crds = Vec::new();
    for (name, _, _, _) in CRDS {
        crds.push(
            match found(crd_api.get_opt(name).await, &format!("CRD {name}"))? {
                Found::Yes(c) => Found::Yes(Crd {
                    established: c
                        .status
                        .and_then(|s| s.conditions)
                        .into_iter()
                        .flatten()
                        .any(|c| c.type_ == "Established" && c.status == "True"),
                    served: c
                        .spec
                        .versions
                        .into_iter()
                        .filter(|v| v.served)
                        .map(|v| v.name)
                        .collect(),
                }),
                Found::No => Found::No,
                Found::Unknown(why) => Found::Unknown(why),
            },
        );
    }
    Ok(Install {
        agents,
        sidecars,
        controller: deployment(client, CONTROLLER).await?,
        webhook: deployment(client, WEBHOOK).await?,
        webhook_config,
        crds,
    })
}
