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

use enforcement::watch_enforcement;
use gateways::{reconcile_gateway, reconcile_slices};
use offloaded::reconcile_namespace;
use tier::netpol_view;

mod enforcement;
mod gateways;
mod offloaded;
mod optional;
mod tier;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
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
    /// ClusterNetworkPolicies (read only). Set once they can be listed (the CRD of
    /// sigs.k8s.io/network-policy-api installed, RBAC in place).
    cluster_policies: std::sync::OnceLock<Store<DynamicObject>>,
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

/// How each peer's CIDRs are remapped here (Liqo's `Configuration`s).
fn remaps(ctx: &Ctx) -> BTreeMap<String, Vec<protection::Remap>> {
    per_peer(ctx, protection::configuration_remaps)
}

/// The protection view of a pod.
pub(crate) fn pod_info(p: &Pod) -> protection::Pod {
    let ips = super::netpol::pod_ips(p);
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
        gone: super::netpol::gone(p),
    }
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
        let Some(ctx) = started(&client, &changed, opts, metrics, &stop).await? else {
            tracing::info!("controller stopping");
            return Ok(());
        };
        ctx.count(|m| m.ready = true);
        // Every cache change re-reconciles all peers (coalesced by Notify, then debounced),
        // in two loops: the slices (the addresses a new pod brings: O(changes), milliseconds)
        // and everything read from the whole cluster (the gateway configuration's declared
        // sets, the NetworkPolicy tier, companions: a pass over every pod, ~0.1 s at 100k), so
        // that a pod's address never waits behind a pass of the second.
        let tenants =
            || watcher::Config::default().labels(&format!("{}=true", super::TENANT_NAMESPACE));
        let cfg = CtrlConfig::default().debounce(DEBOUNCE);
        let slices = Controller::new(Api::<Namespace>::all(client.clone()), tenants())
            .with_config(cfg.clone())
            .reconcile_all_on(futures::stream::unfold(changed.clone(), |n| async move {
                n.notify.notified().await;
                Some(((), n))
            }))
            .run(reconcile_slices, error_policy, ctx.clone())
            .for_each(|r| {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "slices reconcile");
                }
                futures::future::ready(())
            });
        let gateways = Controller::new(Api::<Namespace>::all(client.clone()), tenants())
            .owns_with(
                Api::<DynamicObject>::all_with(client.clone(), &super::fwc_resource()),
                super::fwc_resource(),
                watcher::Config::default().labels(&format!("{MANAGED_BY}={MANAGER}")),
            )
            .with_config(cfg.clone())
            .reconcile_all_on(futures::stream::unfold(changed.clone(), |n| async move {
                n.notify_also.notified().await;
                Some(((), n))
            }))
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
        let live: super::coverage::LiveHosts = Default::default();
        let enforced = watch_enforcement(ctx.clone(), coverage.grace, live.clone());
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
        let covered = super::coverage::run(client.clone(), coverage, ctx.metrics.clone(), live);
        let stopped = stop.wait();
        // The two loops on tasks of their own: polled together in one task, a pass of the
        // second (CPU over every pod) would hold the first back anyway.
        let slices = tokio::spawn(slices);
        let gateways = tokio::spawn(gateways);
        tokio::select! {
            _ = slices => {},
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

/// The controller's context once it reached the API server and its caches are synced (nothing
/// is published before every pod was listed: a cold cache never empties a set); None when a
/// stop came first, which ends the wait at once.
async fn started(
    client: &Client,
    changed: &Arc<super::Changes>,
    opts: Options,
    metrics: Arc<std::sync::Mutex<ControllerMetrics>>,
    stop: &crate::shutdown::Shutdown,
) -> anyhow::Result<Option<Arc<Ctx>>> {
    let setup = async {
        reach(client).await;
        let publisher = Arc::new(std::sync::Mutex::new(Publisher::new()));
        let pods_listed = feed_pods(client, changed, &publisher);
        let ctx = Arc::new(Ctx::watching(client, changed, opts, metrics, publisher));
        ctx.synced(pods_listed).await?;
        optional::watch_optional_kinds(&ctx, client, changed).await?;
        tracing::info!("caches synced; reconciling");
        anyhow::Ok(ctx)
    };
    tokio::select! {
        r = setup => r.map(Some),
        _ = stop.wait() => Ok(None),
    }
}

/// Reach the API server before anything else, each failure reported with the server's answer
/// and retried (1 s, doubling to 30 s): without this the watches retried behind a "started"
/// line, and nothing said why nothing happened.
async fn reach(client: &Client) {
    let mut delay = Duration::from_secs(1);
    loop {
        match client.apiserver_version().await {
            Ok(v) => {
                tracing::info!(server = %v.git_version, "controller started: API server reached");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in_secs = delay.as_secs(), "cannot reach the API server");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(30));
            }
        }
    }
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
            cluster_policies: std::sync::OnceLock::new(),
            pods: super::cache_trimmed(
                Api::all(client.clone()),
                wc(),
                (),
                changed.clone(),
                super::netpol::trim_pod,
            ),
            network_policies: super::cache(Api::all(client.clone()), wc(), (), changed.clone()),
            protection_policies: Arc::new(super::protection_policies::InForce::new(super::cache(
                Api::all_with(client.clone(), &super::protection_policies::resource()),
                wc(),
                super::protection_policies::resource(),
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
