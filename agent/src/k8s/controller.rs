//! `peerwall controller`: provider and consumer protection, kept in place on the API server.
//!
//! The pod watch feeds an index of every peer's desired address sets event by event
//! ([`protection::index`]: a pod event costs its own addresses, no pod objects are cached).
//! Reflectors cache namespaces, virtual nodes and peerwall's own objects. Two kube-runtime
//! controllers reconcile the stable objects, never individual pod events:
//! - tenant namespaces (one per peer cluster) → the peer's gateway FirewallConfiguration and
//!   its AddressSet slices, re-reconciled for every peer whenever something changed
//!   (debounced, so an event storm becomes one pass). A pass writes only the slices the
//!   changed addresses touch ([`protection::publish`]: O(changes), the IP-reuse gate applied
//!   to each new address);
//! - namespaces → a NetworkPolicy for each offloaded namespace, removed when it stops being one.
//!
//! Everything created carries an ownerReference to its namespace and the
//! `app.kubernetes.io/managed-by=peerwall` label, so deleting a peering cleans up. A restart is a
//! full resync: nothing is published before every pod was listed, then the first pass compares
//! every desired address with every published one, and stale addresses disappear.

// size: the controller's reconciles (gateways, offloaded namespaces, enforcement) share one Ctx of
// caches; not yet split by reconcile (issue 32 follow-up). Its decisions are in the protection and
// netpol crates.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::runtime::controller::{Action, Config as CtrlConfig, Controller};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

use super::{MANAGED_BY, MANAGER, PEER, TARGET, TARGET_GATEWAY};
use crate::metrics::ControllerMetrics;
use crate::netpol;
use crate::protection::publish::Publisher;
use crate::protection::{self, Options};

pub use crate::protection::GATEWAY_CONFIG;
pub use crate::protection::NETWORK_POLICY;
const FIELD_MANAGER: &str = "peerwall-controller";
/// How long reconciles wait for more events before a pass (one pass serves them all).
const DEBOUNCE: Duration = Duration::from_millis(2);

/// Why a reconcile failed (retried with backoff).
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The API server refused a write.
    #[error("{action} {object}: {source}")]
    Api {
        /// What was attempted.
        action: &'static str,
        /// Which object.
        object: String,
        /// Cause.
        source: kube::Error,
    },
}

struct Ctx {
    client: Client,
    namespaces: Store<Namespace>,
    nodes: Store<Node>,
    configs: Store<DynamicObject>,
    /// peerwall's AddressSets (the slices of the gateway configurations' sets).
    slices: Store<DynamicObject>,
    /// Liqo's `Configuration`s (read only): how each peer's CIDRs are remapped here. Set once
    /// they can be listed (Liqo's CRD installed, RBAC in place).
    liqo_configs: std::sync::OnceLock<Store<DynamicObject>>,
    opts: Options,
    metrics: Arc<std::sync::Mutex<ControllerMetrics>>,
    /// Desired sets (fed pod by pod by the pod watch), published slices, the reuse gate.
    publisher: Arc<std::sync::Mutex<Publisher>>,
    /// Every pod (labels, addresses, container ports) and every NetworkPolicy: the input of
    /// each peer's NetworkPolicy tier.
    pods: Store<Pod>,
    network_policies: Store<NetworkPolicy>,
    /// ProtectionPolicies (the last good version of each).
    protection_policies: Arc<super::protection_policies::InForce>,
    /// Problems with NetworkPolicies already reported (policy and reason), so each gets one
    /// Event and one log line.
    reported: std::sync::Mutex<BTreeSet<String>>,
}

impl Ctx {
    fn count(&self, f: impl FnOnce(&mut ControllerMetrics)) {
        if let Ok(mut m) = self.metrics.lock() {
            f(&mut m);
        }
    }

    fn publisher(&self) -> std::sync::MutexGuard<'_, Publisher> {
        // A panic while holding the lock leaves a state no worse than a restart would see
        // after the next sync.
        self.publisher
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn labels_of(m: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    m.clone()
}

/// The namespaces, virtual nodes and remaps the sets depend on (few objects: read whole at
/// every pass; the index re-derives only when they changed).
fn sync_context(pb: &mut Publisher, ctx: &Ctx) {
    let namespaces = ctx
        .namespaces
        .state()
        .iter()
        .map(|n| protection::Namespace {
            name: n.name_any(),
            labels: labels_of(n.labels()),
        })
        .collect();
    let nodes = ctx
        .nodes
        .state()
        .iter()
        .map(|n| protection::Node {
            name: n.name_any(),
            labels: labels_of(n.labels()),
        })
        .collect();
    pb.desired.set_context(namespaces, nodes, remaps(ctx));
}

/// Reads one of Liqo's `Configuration`s (its labels and body): the peer and what it says.
type ConfigurationReader<T> =
    fn(&BTreeMap<String, String>, &serde_json::Value) -> Option<(String, T)>;

/// What `read` finds in each of Liqo's `Configuration`s, by peer.
fn per_peer<T>(ctx: &Ctx, read: ConfigurationReader<T>) -> BTreeMap<String, T> {
    ctx.liqo_configs
        .get()
        .map(Store::state)
        .unwrap_or_default()
        .iter()
        .filter_map(|c| {
            let body = serde_json::to_value(c.as_ref()).ok()?;
            read(&labels_of(c.labels()), &body)
        })
        .collect()
}

/// Each peer's pod and external CIDRs as seen here (Liqo's `Configuration`s).
fn homes(ctx: &Ctx) -> BTreeMap<String, Vec<ipnet::IpNet>> {
    per_peer(ctx, protection::configuration_cidrs)
}

/// What the ProtectionPolicies say for `peer` (provider pods selected in `cluster`).
fn exceptions_for(
    ctx: &Ctx,
    peer: &str,
    cluster: &netpol::Cluster,
) -> protection::exceptions::ForPeer {
    protection::exceptions::for_peer(
        &ctx.protection_policies.checked(),
        peer,
        ctx.opts.settings(),
        cluster,
    )
}

/// Keep the NetworkPolicies of `peer`'s offloaded namespaces following its CIDRs (they
/// change with Liqo's `Configuration`, which the namespace reconcile does not watch) and its
/// ProtectionPolicies.
async fn refresh_offloaded(
    peer: &str,
    ctx: &Ctx,
    exceptions: &protection::exceptions::ForPeer,
) -> Result<(), ReconcileError> {
    let home = homes(ctx).remove(peer).unwrap_or_default();
    let open: Vec<_> = exceptions.for_offloaded().collect();
    let policies = ctx.network_policies.state();
    for ns in ctx.namespaces.state() {
        let info = protection::Namespace {
            name: ns.name_any(),
            labels: labels_of(ns.labels()),
        };
        if protection::offloaded_namespace_owner(&info) != Some(peer)
            || ns.metadata.deletion_timestamp.is_some()
        {
            continue;
        }
        let mut body = protection::offloaded_network_policy(&info.name, peer, &home, &open);
        let current = policies.iter().find(|p| {
            p.namespace().as_deref() == Some(info.name.as_str()) && p.name_any() == NETWORK_POLICY
        });
        // Absent: the namespace reconcile creates it.
        let Some(current) = current else { continue };
        if serde_json::to_value(&current.spec).ok().as_ref() == body.get("spec") {
            continue;
        }
        body["metadata"]["ownerReferences"] = owner_ref(&ns);
        let api: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), &info.name);
        server_side_apply(&api, &info.name, NETWORK_POLICY, &body).await?;
        ctx.count(|m| m.network_policy_writes += 1);
        tracing::info!(namespace = %info.name, peer, "offloaded namespace's NetworkPolicy follows its consumer's CIDRs and ProtectionPolicies");
    }
    Ok(())
}

/// How each peer's CIDRs are remapped here (Liqo's `Configuration`s).
fn remaps(ctx: &Ctx) -> BTreeMap<String, Vec<protection::Remap>> {
    per_peer(ctx, protection::configuration_remaps)
}

/// What the API shows of every peer's slices and gateway configuration. A slice's addresses
/// are read only when its version is new to the publisher.
fn sync_published(pb: &mut Publisher, ctx: &Ctx) {
    let mut by_peer: BTreeMap<String, Vec<Arc<DynamicObject>>> = pb
        .published_peers()
        .into_iter()
        .map(|p| (p, vec![]))
        .collect();
    for obj in ctx.slices.state() {
        if let Some(peer) = obj.labels().get(PEER) {
            by_peer.entry(peer.clone()).or_default().push(obj);
        }
    }
    for (peer, objs) in by_peer {
        let slices = pb.slices_mut(&peer);
        slices.begin_sync();
        for o in objs {
            let version = o.resource_version().unwrap_or_default();
            slices.observe(&o.name_any(), &version, applied_everywhere(&o), || {
                slice_of(&o)
            });
        }
        slices.end_sync();
    }
    pb.observe_configs(published_configs(ctx));
}

/// The protection view of a pod.
pub(crate) fn pod_info(p: &Pod) -> protection::Pod {
    let status = p.status.as_ref();
    let ips = super::netpol::pod_ips(p);
    let phase = status.and_then(|s| s.phase.as_deref());
    protection::Pod {
        namespace: p.namespace().unwrap_or_default(),
        name: p.name_any(),
        // The sets read only this label of a pod; the index keeps no more.
        labels: p
            .labels()
            .get(super::REMOTE_CLUSTER_ID)
            .map(|v| BTreeMap::from([(super::REMOTE_CLUSTER_ID.to_string(), v.clone())]))
            .unwrap_or_default(),
        node: p.spec.as_ref().and_then(|s| s.node_name.clone()),
        ips,
        gone: p.metadata.deletion_timestamp.is_some()
            || matches!(phase, Some("Succeeded" | "Failed")),
    }
}

/// The hosts' conditions of `obj` (the controller's own left out).
fn host_conditions(obj: &DynamicObject) -> impl Iterator<Item = &serde_json::Value> {
    obj.data
        .pointer("/status/conditions")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter(|k| {
            k.get("host").and_then(|h| h.as_str()) != Some(protection::enforcement::CONTROLLER_HOST)
        })
}

/// Whether `k` says its host applied `generation` (or a later one).
fn applied_at(k: &serde_json::Value, generation: i64) -> bool {
    k.get("type").and_then(|t| t.as_str()) == Some("Applied")
        && k.get("observedGeneration").and_then(|g| g.as_i64()) >= Some(generation)
}

/// Whether every host that reports on `obj` has applied its current generation (or none
/// reports yet).
fn applied_everywhere(obj: &DynamicObject) -> bool {
    let generation = obj.metadata.generation.unwrap_or_default();
    host_conditions(obj).all(|k| applied_at(k, generation))
}

/// Whether some host reports `obj`'s current generation applied.
fn applied_somewhere(obj: &DynamicObject) -> bool {
    let generation = obj.metadata.generation.unwrap_or_default();
    host_conditions(obj).any(|k| applied_at(k, generation))
}

/// Every few seconds: the peers' gateway configurations no host has applied past `grace`
/// ([`protection::enforcement`]) get a `NotEnforced` condition (host `peerwall-controller`),
/// a Warning Event and a log line, and count in `peerwall_controller_unenforced_peers`; the
/// condition is taken back once a host applies the configuration.
async fn watch_enforcement(ctx: Arc<Ctx>, grace: Duration) {
    use protection::enforcement::{Enforcement, Reported, CONTROLLER_HOST};
    let recorder = kube::runtime::events::Recorder::new(
        ctx.client.clone(),
        kube::runtime::events::Reporter {
            controller: "peerwall-controller".into(),
            instance: None,
        },
    );
    let manager = format!("{FIELD_MANAGER}/enforcement");
    let mut e = Enforcement::new(grace);
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let configs: Vec<Arc<DynamicObject>> = ctx
            .configs
            .state()
            .into_iter()
            .filter(|c| c.name_any() == GATEWAY_CONFIG)
            .collect();
        let key =
            |c: &DynamicObject| format!("{}/{}", c.namespace().unwrap_or_default(), c.name_any());
        let reported: Vec<Reported> = configs
            .iter()
            .map(|c| Reported {
                key: key(c),
                generation: c.metadata.generation.unwrap_or_default(),
                applied: applied_somewhere(c),
            })
            .collect();
        let f = e.observe(std::time::Instant::now(), &reported);
        ctx.count(|m| m.unenforced_peers = f.unenforced as u64);
        for (k, on) in f
            .newly_unenforced
            .iter()
            .map(|k| (k, true))
            .chain(f.recovered.iter().map(|k| (k, false)))
        {
            let Some(obj) = configs.iter().find(|c| &key(c) == k) else {
                continue;
            };
            let (ns, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
            let note = format!(
                "no host has applied generation {} of {k} for {}s: the peer's traffic is not filtered by it. Check the agents (kubectl get ds -n peerwall-system), their selector and their Error conditions",
                obj.metadata.generation.unwrap_or_default(),
                grace.as_secs()
            );
            let conditions = if on {
                tracing::warn!(configuration = %k, "{note}");
                serde_json::json!([{
                    "host": CONTROLLER_HOST,
                    "type": "NotEnforced",
                    "status": "True",
                    "message": note,
                    "lastTransitionTime": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    "observedGeneration": obj.metadata.generation.unwrap_or_default(),
                }])
            } else {
                tracing::info!(configuration = %k, "applied by a host again: enforced");
                serde_json::json!([])
            };
            let body = serde_json::json!({
                "apiVersion": peerwall_intent::load::API_VERSION,
                "kind": peerwall_intent::load::KIND,
                "status": {"conditions": conditions},
            });
            let api: Api<DynamicObject> =
                Api::namespaced_with(ctx.client.clone(), &ns, &super::fwc_resource());
            if let Err(err) = api
                .patch_status(
                    &name,
                    &PatchParams::apply(&manager).force(),
                    &Patch::Apply(&body),
                )
                .await
            {
                tracing::warn!(configuration = %k, error = %err, "could not write the NotEnforced condition");
            }
            if on {
                let ev = kube::runtime::events::Event {
                    type_: kube::runtime::events::EventType::Warning,
                    reason: "NotEnforced".into(),
                    note: Some(note.chars().take(1000).collect()),
                    action: "Enforce".into(),
                    secondary: None,
                };
                let reference = obj.object_ref(&super::fwc_resource());
                if let Err(err) = recorder.publish(&ev, &reference).await {
                    tracing::warn!(configuration = %k, error = %err, "could not publish the NotEnforced event");
                }
            }
        }
    }
}

/// A published slice as the layout sees it.
fn slice_of(obj: &DynamicObject) -> protection::Slice {
    protection::Slice {
        name: obj.name_any(),
        set: obj
            .data
            .pointer("/spec/set")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string(),
        addresses: obj
            .data
            .pointer("/spec/addresses")
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str().and_then(|a| a.parse().ok()))
            .collect(),
    }
}

/// Each peer's gateway configuration as the API shows it: applied everywhere or not, and the
/// offloaded addresses listed inline (older controllers published them there).
fn published_configs(ctx: &Ctx) -> BTreeMap<String, (bool, BTreeSet<IpAddr>)> {
    let mut out = BTreeMap::new();
    for c in ctx.configs.state() {
        if c.name_any() != GATEWAY_CONFIG {
            continue;
        }
        let Some(peer) = c.labels().get(PEER) else {
            continue;
        };
        let offloaded: BTreeSet<IpAddr> = c
            .data
            .pointer("/spec/table/sets")
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
            .filter(|s| {
                matches!(
                    s.get("name").and_then(|n| n.as_str()),
                    Some("offloaded" | "offloaded6")
                )
            })
            .flat_map(|s| {
                s.get("elements")
                    .and_then(|e| e.as_array())
                    .cloned()
                    .unwrap_or_default()
            })
            .filter_map(|e| {
                e.get("key")
                    .and_then(|k| k.as_str())
                    .and_then(|k| k.parse().ok())
            })
            .collect();
        out.insert(peer.clone(), (applied_everywhere(&c), offloaded));
    }
    out
}

fn owner_ref(ns: &Namespace) -> serde_json::Value {
    json!([{
        "apiVersion": "v1",
        "kind": "Namespace",
        "name": ns.name_any(),
        "uid": ns.uid().unwrap_or_default(),
    }])
}

fn api_error<'a>(
    action: &'static str,
    ns: &'a str,
    name: &'a str,
) -> impl FnOnce(kube::Error) -> ReconcileError + 'a {
    move |source| ReconcileError::Api {
        action,
        object: format!("{ns}/{name}"),
        source,
    }
}

/// Server-side apply of `body` as the controller's field manager (forcing ownership of the
/// fields it sets, so a hand edit of them is reverted).
async fn server_side_apply<K>(
    api: &Api<K>,
    ns: &str,
    name: &str,
    body: &serde_json::Value,
) -> Result<(), ReconcileError>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(body),
    )
    .await
    .map(|_| ())
    .map_err(api_error("applying", ns, name))
}

async fn reconcile_gateway(ns: Arc<Namespace>, ctx: Arc<Ctx>) -> Result<Action, ReconcileError> {
    let Some(peer) = ns.labels().get(super::REMOTE_CLUSTER_ID).cloned() else {
        return Ok(Action::await_change());
    };
    if ns.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ns_name = ns.name_any();
    let who = protection::Peer {
        id: peer.clone(),
        tenant_namespace: ns_name.clone(),
        sources: per_peer(&ctx, protection::configuration_sources)
            .remove(&peer)
            .unwrap_or_default(),
    };
    // Addresses first, as slices: the configuration that takes them comes after, so a set
    // never misses addresses it had.
    let held = publish_slices(&ns, &who, &ctx).await?;
    // One view of pods and NetworkPolicies serves the declared sets, the tier and the
    // companions.
    let view = netpol_view(&ctx);
    let declared = protection::Declared {
        namespaces: protection::namespaces::namespace_sets(&view.0, &peer),
        exceptions: exceptions_for(&ctx, &peer, &view.0),
    };
    // The addresses live in the slices; the configuration declares the sets.
    let mut body = protection::gateway_object_with(&who, &Default::default(), &ctx.opts, &declared);
    let current = ctx
        .configs
        .state()
        .into_iter()
        .find(|c| c.name_any() == GATEWAY_CONFIG && c.namespace().as_deref() == Some(&ns_name));
    let up_to_date = current.as_ref().is_some_and(|c| {
        c.data.get("spec") == body.get("spec")
            && c.labels().get(PEER) == Some(&peer)
            && c.labels().get(TARGET).map(String::as_str) == Some(TARGET_GATEWAY)
            && c.labels().get(MANAGED_BY).map(String::as_str) == Some(MANAGER)
    });
    if !up_to_date {
        body["metadata"]["ownerReferences"] = owner_ref(&ns);
        let api: Api<DynamicObject> =
            Api::namespaced_with(ctx.client.clone(), &ns_name, &super::fwc_resource());
        server_side_apply(&api, &ns_name, GATEWAY_CONFIG, &body).await?;
        ctx.count(|m| m.gateway_writes += 1);
        tracing::info!(peer = %peer, "gateway configuration updated");
    }
    publish_tier(&ns, &who, &ctx, &view, declared.exceptions.settings.audit).await?;
    refresh_offloaded(&peer, &ctx, &declared.exceptions).await?;
    publish_companions(&ctx, &view).await?;
    Ok(if held > 0 {
        // An address is waiting for another tenant to release it.
        Action::requeue(Duration::from_millis(500))
    } else {
        Action::await_change()
    })
}

/// The cluster as NetworkPolicies see it, from the caches; the policies that do not read;
/// every NetworkPolicy object (for Events and companions).
/// The cluster as NetworkPolicies see it, what of them does not read, and the objects.
type NetpolView = (
    netpol::Cluster,
    Vec<super::netpol::Unreadable>,
    Vec<Arc<NetworkPolicy>>,
);

fn netpol_view(ctx: &Ctx) -> NetpolView {
    let (namespaces, nodes, pods, policies) = (
        ctx.namespaces.state(),
        ctx.nodes.state(),
        ctx.pods.state(),
        ctx.network_policies.state(),
    );
    let (cluster, unreadable) = super::netpol::cluster(
        namespaces.iter().map(AsRef::as_ref),
        nodes.iter().map(AsRef::as_ref),
        pods.iter().map(AsRef::as_ref),
        policies.iter().map(AsRef::as_ref),
        &remaps(ctx),
    );
    (cluster, unreadable, policies)
}

/// Keep `peer`'s NetworkPolicy tier ([`netpol::tier`]) in place, and report once what of the
/// NetworkPolicies it cannot read or enforce (an Event on the policy, a log line).
async fn publish_tier(
    ns: &Namespace,
    peer: &protection::Peer,
    ctx: &Ctx,
    (cluster, unreadable, policies): &NetpolView,
    audit: bool,
) -> Result<(), ReconcileError> {
    let ns_name = ns.name_any();
    let tier = netpol::tier::tier(cluster, &peer.id, audit);
    let problems = unreadable
        .iter()
        .map(|u| {
            (
                u.policy.clone(),
                format!("{} (the policy is left out)", u.why),
            )
        })
        .chain(
            tier.unenforced
                .iter()
                .map(|u| (u.policy.clone(), u.why.clone())),
        );
    for (policy, why) in problems {
        report_policy(ctx, policies, &policy, &why).await;
    }
    let mut body = netpol::tier::object(&peer.tenant_namespace, &peer.id, &tier.spec);
    let current = ctx.configs.state().into_iter().find(|c| {
        c.name_any() == netpol::tier::TIER_CONFIG && c.namespace().as_deref() == Some(&ns_name)
    });
    let up_to_date = current.as_ref().is_some_and(|c| {
        c.data.get("spec") == body.get("spec")
            && c.labels().get(PEER) == Some(&peer.id)
            && c.labels().get(TARGET).map(String::as_str) == Some(TARGET_GATEWAY)
    });
    if !up_to_date {
        body["metadata"]["ownerReferences"] = owner_ref(ns);
        let api: Api<DynamicObject> =
            Api::namespaced_with(ctx.client.clone(), &ns_name, &super::fwc_resource());
        server_side_apply(&api, &ns_name, netpol::tier::TIER_CONFIG, &body).await?;
        ctx.count(|m| m.gateway_writes += 1);
        tracing::info!(peer = %peer.id, "NetworkPolicy tier updated");
    }
    Ok(())
}

/// Keep the CNI companions of the users' NetworkPolicies ([`netpol::companion`]) in place:
/// written when new or changed, removed when no longer needed. Each is owned by its user's
/// policy, so deleting that policy removes it too.
async fn publish_companions(
    ctx: &Ctx,
    (cluster, _, policies): &NetpolView,
) -> Result<(), ReconcileError> {
    let (desired, too_large) = netpol::companion::companions(cluster, |_| false);
    for (policy, why) in too_large {
        report_policy(ctx, policies, &policy, &why).await;
    }
    let key = |ns: &str, name: &str| format!("{ns}/{name}");
    let mut wanted = BTreeSet::new();
    for mut body in desired {
        let ns = body["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let name = body["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        wanted.insert(key(&ns, &name));
        let current = policies
            .iter()
            .find(|p| p.namespace().as_deref() == Some(&ns) && p.name_any() == name);
        let same = current.is_some_and(|c| {
            netpol::companion::is_companion(c.labels())
                && serde_json::to_value(&c.spec).ok().as_ref() == body.get("spec")
        });
        if same {
            continue;
        }
        // Owned by the user's policy it stands beside.
        let owner = policies.iter().find(|p| {
            p.namespace().as_deref() == Some(&ns)
                && netpol::companion::name(&p.name_any()) == name
                && !netpol::companion::is_companion(p.labels())
        });
        if let Some(u) = owner {
            body["metadata"]["ownerReferences"] = json!([{
                "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "name": u.name_any(), "uid": u.uid().unwrap_or_default(),
            }]);
        }
        let api: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), &ns);
        server_side_apply(&api, &ns, &name, &body).await?;
        tracing::info!(networkpolicy = %key(&ns, &name), "CNI companion written");
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

/// One Warning Event on the NetworkPolicy `key` (`namespace/name`) and a log line, once per
/// reason.
async fn report_policy(ctx: &Ctx, policies: &[Arc<NetworkPolicy>], key: &str, why: &str) {
    let first = ctx
        .reported
        .lock()
        .map(|mut r| r.insert(format!("{key}\n{why}")))
        .unwrap_or(false);
    if !first {
        return;
    }
    tracing::warn!(networkpolicy = key, "{why}");
    let Some(p) = policies
        .iter()
        .find(|p| format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()) == key)
    else {
        return;
    };
    let recorder = kube::runtime::events::Recorder::new(
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
    if let Err(e) = recorder.publish(&ev, &p.object_ref(&())).await {
        tracing::warn!(networkpolicy = key, error = %e, "could not publish the event");
    }
}

/// Write the slices of `peer`'s sets that the changes since its last pass touch (O(changed
/// addresses): [`Publisher::plan`]), and delete slices that are empty and whose emptying
/// every host has applied. Returns how many offloaded addresses the reuse gate holds back.
async fn publish_slices(
    ns: &Namespace,
    peer: &protection::Peer,
    ctx: &Ctx,
) -> Result<usize, ReconcileError> {
    let ns_name = &peer.tenant_namespace;
    let api: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), ns_name, &super::address_set_resource());
    let plan = {
        let mut pb = ctx.publisher();
        sync_context(&mut pb, ctx);
        sync_published(&mut pb, ctx);
        let plan = pb.plan(&peer.id, &ctx.opts);
        let wanted: u64 = pb
            .desired
            .peers()
            .iter()
            .map(|p| pb.desired.len(p, protection::index::Kind::Offloaded) as u64)
            .sum();
        let held = pb.held_back() as u64;
        let peers = pb.desired.peers().len() as u64;
        ctx.count(|m| {
            m.peers = peers;
            m.offloaded_addresses = wanted.saturating_sub(held);
            m.held_back_addresses = held;
        });
        plan
    };
    for slice in &plan.writes {
        let mut body = protection::address_set_object(peer, slice);
        body["metadata"]["ownerReferences"] = owner_ref(ns);
        let written = api
            .patch(
                &slice.name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await;
        match written {
            Ok(obj) => {
                let version = obj.resource_version().unwrap_or_default();
                ctx.publisher()
                    .slices_mut(&peer.id)
                    .written(&slice.name, version);
                ctx.count(|m| m.slice_writes += 1);
            }
            Err(source) => {
                // Whatever was not written is planned again from the API's view.
                let mut pb = ctx.publisher();
                let slices = pb.slices_mut(&peer.id);
                let failed = plan.writes.iter().skip_while(|s| s.name != slice.name);
                for s in failed {
                    slices.write_failed(&s.name);
                }
                return Err(api_error("applying", ns_name, &slice.name)(source));
            }
        }
    }
    if !plan.writes.is_empty() {
        tracing::debug!(peer = %peer.id, slices = plan.writes.len(), held_back = plan.held, "address sets updated");
    }
    let set_names: Vec<String> = protection::set_contents(&Default::default(), &ctx.opts)
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    let deletable = ctx.publisher().slices_mut(&peer.id).deletable(&set_names);
    for name in deletable {
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => ctx.count(|m| m.slice_deletes += 1),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(source) => return Err(api_error("deleting", ns_name, &name)(source)),
        }
        ctx.publisher().slices_mut(&peer.id).deleted(&name);
    }
    Ok(plan.held)
}

async fn reconcile_namespace(ns: Arc<Namespace>, ctx: Arc<Ctx>) -> Result<Action, ReconcileError> {
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
            let mut body = protection::offloaded_network_policy(
                &name,
                &consumer,
                &homes(&ctx).remove(&consumer).unwrap_or_default(),
                &open,
            );
            body["metadata"]["ownerReferences"] = owner_ref(&ns);
            server_side_apply(&api, &name, NETWORK_POLICY, &body).await?;
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

fn error_policy<K>(obj: Arc<K>, err: &ReconcileError, ctx: Arc<Ctx>) -> Action
where
    K: Resource,
{
    ctx.count(|m| m.reconcile_errors += 1);
    tracing::warn!(object = %obj.meta().name.as_deref().unwrap_or_default(), error = %err, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(2))
}

/// Run both controllers until `stop` is set.
pub fn run(
    opts: Options,
    coverage: super::coverage::Settings,
    metrics: Arc<std::sync::Mutex<ControllerMetrics>>,
    stop: Arc<crate::shutdown::Shutdown>,
) -> anyhow::Result<()> {
    super::runtime()?.block_on(async move {
        let client = super::client().await?;
        let changed = Arc::new(super::Changes::default());
        let publisher = Arc::new(std::sync::Mutex::new(Publisher::new()));
        let pods_listed = feed_pods(&client, &changed, &publisher);
        let ctx = Arc::new(Ctx::watching(&client, &changed, opts, metrics, publisher));
        // Nothing is published before every pod was listed: a cold cache never empties a set.
        ctx.synced(pods_listed).await?;
        watch_liqo_configurations(&ctx, &client, &changed).await?;
        tracing::info!("caches synced; reconciling");
        ctx.count(|m| m.ready = true);
        // Every cache change re-reconciles all peers (coalesced by Notify, then debounced).
        let trigger = futures::stream::unfold(changed.clone(), |n| async move {
            n.notify.notified().await;
            Some(((), n))
        });
        let cfg = CtrlConfig::default().debounce(DEBOUNCE);
        let gateways = Controller::new(
            Api::<Namespace>::all(client.clone()),
            watcher::Config::default().labels(&format!("{}=true", super::TENANT_NAMESPACE)),
        )
        .owns_with(
            Api::<DynamicObject>::all_with(client.clone(), &super::fwc_resource()),
            super::fwc_resource(),
            watcher::Config::default().labels(&format!("{MANAGED_BY}={MANAGER}")),
        )
        .with_config(cfg.clone())
        .reconcile_all_on(trigger)
        .run(reconcile_gateway, error_policy, ctx.clone())
        .for_each(|r| {
            if let Err(e) = r {
                tracing::debug!(error = %e, "gateway reconcile");
            }
            futures::future::ready(())
        });
        let netpols = Controller::new(
            Api::<Namespace>::all(client.clone()),
            watcher::Config::default(),
        )
        .owns(
            Api::<NetworkPolicy>::all(client.clone()),
            watcher::Config::default().labels(&format!("{MANAGED_BY}={MANAGER}")),
        )
        .with_config(cfg)
        .run(reconcile_namespace, error_policy, ctx.clone())
        .for_each(|r| {
            if let Err(e) = r {
                tracing::debug!(error = %e, "namespace reconcile");
            }
            futures::future::ready(())
        });
        let enforced = watch_enforcement(ctx.clone(), coverage.grace);
        let statuses = {
            let c = ctx.clone();
            super::protection_policies::write_status(
                client.clone(),
                ctx.protection_policies.clone(),
                ctx.opts.settings(),
                move || {
                    let peers = c.publisher().desired.peers().iter().cloned().collect();
                    (peers, netpol_view(&c).0)
                },
            )
        };
        let covered = super::coverage::run(client.clone(), coverage, ctx.metrics.clone());
        let stopped = stop.wait();
        tokio::select! {
            _ = gateways => {},
            _ = netpols => {},
            _ = covered => {},
            _ = enforced => {},
            _ = statuses => {},
            _ = stopped => {},
        }
        tracing::info!("controller stopping");
        Ok(())
    })
}

/// The pod watch feeding the publisher's desired sets pod by pod; the receiver turns true once
/// every pod was listed.
fn feed_pods(
    client: &Client,
    changed: &Arc<super::Changes>,
    publisher: &Arc<std::sync::Mutex<Publisher>>,
) -> tokio::sync::watch::Receiver<bool> {
    let pb = publisher.clone();
    super::feed(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default(),
        changed.clone(),
        move |ev| {
            let mut pb = pb.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match ev {
                watcher::Event::Init => pb.desired.begin_relist(),
                watcher::Event::InitApply(p) | watcher::Event::Apply(p) => {
                    pb.desired.upsert_pod(pod_info(&p))
                }
                watcher::Event::Delete(p) => pb
                    .desired
                    .remove_pod(&p.namespace().unwrap_or_default(), &p.name_any()),
                watcher::Event::InitDone => pb.desired.end_relist(),
            }
        },
    )
}

impl Ctx {
    /// The controller's caches, each watching its kind (every change notifies `changed`).
    fn watching(
        client: &Client,
        changed: &Arc<super::Changes>,
        opts: Options,
        metrics: Arc<std::sync::Mutex<ControllerMetrics>>,
        publisher: Arc<std::sync::Mutex<Publisher>>,
    ) -> Self {
        let wc = watcher::Config::default;
        Ctx {
            namespaces: super::cache(Api::all(client.clone()), wc(), (), changed.clone()),
            nodes: super::cache(
                Api::all(client.clone()),
                wc().labels(&format!("{}=virtual-node", super::NODE_TYPE)),
                (),
                changed.clone(),
            ),
            configs: super::cache(
                Api::all_with(client.clone(), &super::fwc_resource()),
                wc().labels(&format!("{MANAGED_BY}={MANAGER}")),
                super::fwc_resource(),
                changed.clone(),
            ),
            slices: super::cache(
                Api::all_with(client.clone(), &super::address_set_resource()),
                wc().labels(&format!("{MANAGED_BY}={MANAGER}")),
                super::address_set_resource(),
                changed.clone(),
            ),
            liqo_configs: std::sync::OnceLock::new(),
            pods: super::cache(Api::all(client.clone()), wc(), (), changed.clone()),
            network_policies: super::cache(Api::all(client.clone()), wc(), (), changed.clone()),
            protection_policies: Arc::new(super::protection_policies::InForce::new(super::cache(
                Api::all(client.clone()),
                wc(),
                (),
                changed.clone(),
            ))),
            reported: std::sync::Mutex::new(BTreeSet::new()),
            client: client.clone(),
            opts,
            metrics,
            publisher,
        }
    }

    /// Wait until every cache has listed its kind once (the pods through `pods_listed`).
    async fn synced(
        &self,
        mut pods_listed: tokio::sync::watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        pods_listed
            .wait_for(|l| *l)
            .await
            .context("the pods watch ended before its first list")?;
        for (what, ready) in [
            ("namespaces", self.namespaces.wait_until_ready().await),
            ("nodes", self.nodes.wait_until_ready().await),
            (
                "firewallconfigurations",
                self.configs.wait_until_ready().await,
            ),
            ("addresssets", self.slices.wait_until_ready().await),
            ("pods", self.pods.wait_until_ready().await),
            (
                "networkpolicies",
                self.network_policies.wait_until_ready().await,
            ),
        ] {
            ready.with_context(|| format!("the {what} watch ended before its first list"))?;
        }
        self.protection_policies
            .ready()
            .await
            .context("the protectionpolicies watch ended before its first list (is peerwall's CRD installed? kubectl apply -k deploy/)")
    }
}

/// Liqo's Configurations only matter where CIDRs overlap. Without Liqo's CRD (a cluster not
/// peered yet) or the RBAC to read them, the controller runs without them rather than not at
/// all, probes again every 30 s (no watch retrying every second in the log meanwhile), and
/// takes them into account once they can be listed.
async fn watch_liqo_configurations(
    ctx: &Arc<Ctx>,
    client: &Client,
    changed: &Arc<super::Changes>,
) -> anyhow::Result<()> {
    let liqo_api =
        Api::<DynamicObject>::all_with(client.clone(), &super::liqo_configuration_resource());
    let probe = liqo_api
        .list_metadata(&kube::api::ListParams::default().limit(1))
        .await;
    let watch_liqo = {
        let (ctx, changed, api) = (ctx.clone(), changed.clone(), liqo_api.clone());
        move || {
            let store = super::cache(
                api,
                watcher::Config::default(),
                super::liqo_configuration_resource(),
                changed,
            );
            let _ = ctx.liqo_configs.set(store.clone());
            store
        }
    };
    match probe {
        Ok(_) => watch_liqo()
            .wait_until_ready()
            .await
            .context("the watch of Liqo's Configurations ended before its first list")?,
        Err(e) => {
            tracing::warn!(
                error = %e,
                "Liqo's Configurations cannot be listed (Liqo's CRD not installed, or no RBAC): no remapped CIDRs until they can; trying again every 30 s"
            );
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    let again = liqo_api
                        .list_metadata(&kube::api::ListParams::default().limit(1))
                        .await;
                    if again.is_ok() {
                        tracing::info!("Liqo's Configurations can be listed now: watching them");
                        watch_liqo();
                        break;
                    }
                }
            });
        }
    }
    Ok(())
}
