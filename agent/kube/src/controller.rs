//! `peerwall controller`: provider and consumer protection, kept in place on the API server.
//!
//! The pod watch feeds an index of every peer's desired address sets event by event
//! ([`crate::protection::index`]: a pod event costs its own addresses) and the few facts of
//! each pod the NetworkPolicy tier reads ([`crate::model::PodFacts`]); no pod objects are
//! cached.
//! Reflectors cache namespaces, virtual nodes and peerwall's own objects. Two kube-runtime
//! controllers and one loop of its own reconcile the stable objects, never individual pod
//! events:
//! - tenant namespaces (one per peer cluster) → the peer's gateway FirewallConfiguration (a
//!   controller) and its AddressSet slices (`slices_loop.rs`, a pass as soon as a change
//!   comes), re-reconciled for every peer whenever something changed (an event storm becomes
//!   few passes: the configuration's pass is debounced, and a slices pass under way takes
//!   every change made meanwhile). A pass writes only the slices the changed addresses touch
//!   ([`crate::protection::publish`]: O(changes), the IP-reuse gate applied to each new
//!   address);
//! - namespaces → a NetworkPolicy for each offloaded namespace, removed when it stops being one.
//!
//! Everything created carries an ownerReference to its namespace and the
//! `app.kubernetes.io/managed-by=peerwall` label, so deleting a peering cleans up. A restart is a
//! full resync: nothing is published before every pod was listed, then the first pass compares
//! every desired address with every published one, and stale addresses disappear.

use context::Ctx;
use enforcement::watch_enforcement;
use offloaded::reconcile_namespace;
use policies::shared_view;
pub use publish::ReconcileError;
use tenants::reconcile_gateway;
use view::ClusterOf;

mod context;
mod enforcement;
#[cfg(test)]
mod fake_api;
mod offloaded;
mod optional;
mod plans;
mod pod_facts;
mod policies;
mod publish;
mod said;
mod slices_loop;
mod storable;
mod tenants;
mod tiers;
mod view;
mod written;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DynamicObject};
use kube::runtime::controller::{Action, Config as CtrlConfig, Controller};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};

use super::{MANAGED_BY, MANAGER};
use crate::metrics::ControllerMetrics;
use crate::model::PodFacts;
use crate::protection::publish::Publisher;
use crate::protection::Options;

pub use crate::protection::GATEWAY_CONFIG;

pub use crate::protection::NETWORK_POLICY;

/// How long reconciles wait for more events before a pass (one pass serves them all).
const DEBOUNCE: Duration = Duration::from_millis(2);

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
        // The slices pass runs as soon as a change comes (a storm still coalesces: a pass
        // under way takes every change made meanwhile, and the next waits for it). The
        // debounce's wait was about half of the controller's own time for one pod: 2 ms, and
        // the scheduler's round-up to its next millisecond tick on top (`bench-control` with
        // `PEERWALL_BENCH_LOGS`: a pod's change → its slices pass, 3.5–4.5 ms); without the
        // debounce, the tick alone (0.9–2.4 ms): a loop of its own (`slices_loop.rs`).
        let slices = slices_loop::run(changed.clone(), ctx.clone());
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
                    let view = tokio::task::block_in_place(|| shared_view(&c));
                    (peers, ClusterOf(view))
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
        let pods = Arc::new(pod_facts::PodFactsIndex::default());
        let pods_listed = feed_pods(client, changed, &publisher, &pods);
        let ctx = Arc::new(Ctx::watching(
            client,
            changed,
            opts,
            metrics,
            (publisher, pods),
        ));
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

/// The one pod watch: it feeds the publisher's desired sets and the NetworkPolicy tier's
/// [`pod_facts::PodFactsIndex`] pod by pod (neither keeps the objects); the receiver turns
/// true once every pod was listed.
fn feed_pods(
    client: &Client,
    changed: &Arc<super::Changes>,
    publisher: &Arc<std::sync::Mutex<Publisher>>,
    facts: &Arc<pod_facts::PodFactsIndex>,
) -> tokio::sync::watch::Receiver<bool> {
    let (pb, facts) = (publisher.clone(), facts.clone());
    super::feed(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default(),
        changed.clone(),
        move |ev| {
            let mut pb = pb.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let live = matches!(ev, watcher::Event::Apply(_));
            match ev {
                watcher::Event::Init => {
                    facts.begin_relist();
                    pb.desired.begin_relist();
                    true
                }
                watcher::Event::InitApply(p) | watcher::Event::Apply(p) => {
                    // The publisher's pod is derived from the facts: facts unchanged (a status
                    // update of a condition, a restart count) change neither, and wake no pass.
                    let f = PodFacts::of(&p);
                    let protection = f.protection();
                    let changed = facts.upsert(f);
                    if changed {
                        pb.desired.upsert_pod(protection);
                        if live {
                            // Where a change starts, to read the controller's part from.
                            tracing::trace!(pod = %p.name_any(), "pod changed");
                        }
                    }
                    changed
                }
                watcher::Event::Delete(p) => {
                    let (ns, name) = (p.namespace().unwrap_or_default(), p.name_any());
                    pb.desired.remove_pod(&ns, &name);
                    facts.remove(&ns, &name)
                }
                watcher::Event::InitDone => {
                    facts.end_relist();
                    pb.desired.end_relist();
                    true
                }
            }
        },
    )
}
