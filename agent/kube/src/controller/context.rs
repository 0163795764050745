//! What every reconcile of the controller reads: the client, the caches of the kinds it
//! watches, the publisher of address sets, its options and metrics ([`Ctx`]), and what is
//! derived from the caches alike by several reconciles (each peer's remaps, CIDRs and
//! ProtectionPolicy exceptions).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use anyhow::Context;
use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DynamicObject};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};

use super::pod_facts::PodFactsIndex;
use crate::metrics::ControllerMetrics;
use crate::netpol;
use crate::protection::publish::Publisher;
use crate::protection::{self, Options};
use crate::reported::StatusReaders;
use crate::{MANAGED_BY, MANAGER};

/// The controller's shared state, one per process, handed to every reconcile.
pub(super) struct Ctx {
    pub(super) client: Client,
    pub(super) namespaces: Store<Namespace>,
    pub(super) nodes: Store<Node>,
    pub(super) configs: Store<DynamicObject>,
    /// peerwall's AddressSets (the slices of the gateway configurations' sets).
    pub(super) slices: Store<DynamicObject>,
    /// Liqo's `Configuration`s (read only): how each peer's CIDRs are remapped here. Set once
    /// they can be listed (Liqo's CRD installed, RBAC in place).
    pub(super) liqo_configs: std::sync::OnceLock<Store<DynamicObject>>,
    /// ClusterNetworkPolicies (read only). Set once they can be listed (the CRD of
    /// sigs.k8s.io/network-policy-api installed, RBAC in place).
    pub(super) cluster_policies: std::sync::OnceLock<Store<DynamicObject>>,
    pub(super) opts: Options,
    pub(super) metrics: Arc<std::sync::Mutex<ControllerMetrics>>,
    /// Desired sets (fed pod by pod by the pod watch), published slices, the reuse gate.
    pub(super) publisher: Arc<std::sync::Mutex<Publisher>>,
    /// Every pod (labels, addresses, container ports: [`crate::model::PodFacts`]) and every
    /// NetworkPolicy: the input of each peer's NetworkPolicy tier.
    pub(super) pods: Arc<PodFactsIndex>,
    pub(super) network_policies: Store<NetworkPolicy>,
    /// Every cache's change counter, and the view of the cluster computed at a count
    /// ([`super::policies::shared_view`]): the peers of one pass share one view.
    pub(super) changes: Arc<crate::Changes>,
    pub(super) view: super::view::SharedView,
    /// The NetworkPolicies as last read, per object version (each view reads only those that
    /// changed).
    pub(super) policy_reads: std::sync::Mutex<crate::model::PolicyReads>,
    /// ProtectionPolicies (the last good version of each).
    pub(super) protection_policies: Arc<crate::protection_policies::InForce>,
    /// Problems with NetworkPolicies already reported (policy and reason), so each gets one
    /// Event and one log line.
    pub(super) reported: std::sync::Mutex<BTreeSet<String>>,
    /// What the controller last wrote of each of its FirewallConfigurations, or found the
    /// cache already showing ([`super::storable`]).
    pub(super) written: std::sync::Mutex<super::written::Written>,
    /// The offloaded namespaces' NetworkPolicies the cache showed as they are to be
    /// ([`super::offloaded`], [`super::said`]).
    pub(super) offloaded_said: std::sync::Mutex<super::said::Said>,
    /// The last plan of each configuration published ([`super::plans`]).
    pub(super) plans: std::sync::Mutex<super::plans::Plans>,
    /// The last NetworkPolicy tier of each peer, with the view it came from ([`super::tiers`]).
    pub(super) tiers: std::sync::Mutex<super::tiers::Tiers>,
}

impl Ctx {
    pub(super) fn count(&self, f: impl FnOnce(&mut ControllerMetrics)) {
        if let Ok(mut m) = self.metrics.lock() {
            f(&mut m);
        }
    }

    pub(super) fn written(&self) -> std::sync::MutexGuard<'_, super::written::Written> {
        // What it holds is a shortcut: a state left by a panic only sends a pass back to
        // comparing with the cache.
        self.written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn plans(&self) -> std::sync::MutexGuard<'_, super::plans::Plans> {
        // A shortcut too: a state left by a panic serves only plans of the count they were
        // computed at.
        self.plans
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn publisher(&self) -> std::sync::MutexGuard<'_, Publisher> {
        // A panic while holding the lock leaves a state no worse than a restart would see
        // after the next sync.
        self.publisher
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

pub(super) fn labels_of(m: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    m.clone()
}

/// Reads one of Liqo's `Configuration`s (its labels and body): the peer and what it says.
pub(super) type ConfigurationReader<T> =
    fn(&BTreeMap<String, String>, &serde_json::Value) -> Option<(String, T)>;

/// What `read` finds in each of Liqo's `Configuration`s, by peer.
pub(super) fn per_peer<T>(ctx: &Ctx, read: ConfigurationReader<T>) -> BTreeMap<String, T> {
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
pub(super) fn homes(ctx: &Ctx) -> BTreeMap<String, Vec<ipnet::IpNet>> {
    per_peer(ctx, protection::configuration_cidrs)
}

/// What the ProtectionPolicies say for `peer` (provider pods selected in `cluster`).
pub(super) fn exceptions_for(
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
pub(super) fn remaps(ctx: &Ctx) -> BTreeMap<String, Vec<protection::Remap>> {
    per_peer(ctx, protection::configuration_remaps)
}

impl Ctx {
    /// The controller's caches, each watching its kind (every change notifies `changed`); the
    /// pods come from the watch that feeds `publisher` and `pods`.
    pub(super) fn watching(
        client: &Client,
        changed: &Arc<crate::Changes>,
        opts: Options,
        metrics: Arc<std::sync::Mutex<ControllerMetrics>>,
        (publisher, pods): (Arc<std::sync::Mutex<Publisher>>, Arc<PodFactsIndex>),
    ) -> Self {
        let wc = watcher::Config::default;
        Ctx {
            namespaces: crate::cache(Api::all(client.clone()), wc(), (), changed.clone()),
            nodes: crate::cache(
                Api::all(client.clone()),
                wc().labels(&format!("{}=virtual-node", crate::NODE_TYPE)),
                (),
                changed.clone(),
            ),
            // The hosts report on these after every apply: a report wakes the loops that
            // read it, and is no change to the NetworkPolicy view (`reported.rs`).
            configs: crate::reported::cache(
                Api::all_with(client.clone(), &crate::fwc_resource()),
                wc().labels(&format!("{MANAGED_BY}={MANAGER}")),
                crate::fwc_resource(),
                changed.clone(),
                Some(StatusReaders::Both),
            ),
            slices: crate::reported::cache(
                Api::all_with(client.clone(), &crate::address_set_resource()),
                wc().labels(&format!("{MANAGED_BY}={MANAGER}")),
                crate::address_set_resource(),
                changed.clone(),
                Some(StatusReaders::Fast),
            ),
            liqo_configs: std::sync::OnceLock::new(),
            cluster_policies: std::sync::OnceLock::new(),
            pods,
            changes: changed.clone(),
            view: Default::default(),
            policy_reads: Default::default(),
            plans: Default::default(),
            tiers: Default::default(),
            network_policies: crate::cache(Api::all(client.clone()), wc(), (), changed.clone()),
            protection_policies: Arc::new(crate::protection_policies::InForce::new(crate::cache(
                Api::all_with(client.clone(), &crate::protection_policies::resource()),
                wc(),
                crate::protection_policies::resource(),
                changed.clone(),
            ))),
            reported: std::sync::Mutex::new(BTreeSet::new()),
            written: Default::default(),
            offloaded_said: Default::default(),
            client: client.clone(),
            opts,
            metrics,
            publisher,
        }
    }

    /// Wait until every cache has listed its kind once (the pods through `pods_listed`).
    pub(super) async fn synced(
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

/// Tests only: the caches a test fills, object by object.
#[cfg(test)]
pub(super) struct Writers {
    pub namespaces: kube::runtime::reflector::store::Writer<Namespace>,
    pub network_policies: kube::runtime::reflector::store::Writer<NetworkPolicy>,
    pub configs: kube::runtime::reflector::store::Writer<DynamicObject>,
    /// The context's change counter, moved by every write below as a watch moves it.
    pub changes: Arc<crate::Changes>,
}

#[cfg(test)]
impl Writers {
    /// Put `ns` in the namespaces' cache.
    pub fn namespace(&mut self, ns: Namespace) {
        self.namespaces
            .apply_watcher_event(&watcher::Event::Apply(ns));
        self.changes.bump();
    }

    /// Put `np` in the NetworkPolicies' cache.
    pub fn network_policy(&mut self, np: NetworkPolicy) {
        self.network_policies
            .apply_watcher_event(&watcher::Event::Apply(np));
        self.changes.bump();
    }
}

#[cfg(test)]
impl Ctx {
    /// A context over `client` (a fake one: [`super::fake_api`]) with empty caches, and the
    /// writers of those a test fills.
    pub(super) fn for_tests(client: Client) -> (Self, Writers) {
        use kube::runtime::reflector::store::Writer;
        let dynamic = |r: kube::api::ApiResource| Writer::<DynamicObject>::new(r).as_reader();
        let namespaces = Writer::<Namespace>::default();
        let network_policies = Writer::<NetworkPolicy>::default();
        let configs = Writer::<DynamicObject>::new(crate::fwc_resource());
        let changes = Arc::new(crate::Changes::default());
        let ctx = Ctx {
            namespaces: namespaces.as_reader(),
            nodes: Writer::default().as_reader(),
            configs: configs.as_reader(),
            slices: dynamic(crate::address_set_resource()),
            liqo_configs: std::sync::OnceLock::new(),
            cluster_policies: std::sync::OnceLock::new(),
            opts: crate::protection::boot::default_options(),
            metrics: Arc::default(),
            publisher: Arc::new(std::sync::Mutex::new(Publisher::new())),
            pods: Arc::default(),
            changes: changes.clone(),
            view: Default::default(),
            policy_reads: Default::default(),
            plans: Default::default(),
            tiers: Default::default(),
            network_policies: network_policies.as_reader(),
            protection_policies: Arc::new(crate::protection_policies::InForce::new(dynamic(
                crate::protection_policies::resource(),
            ))),
            reported: std::sync::Mutex::new(BTreeSet::new()),
            written: Default::default(),
            offloaded_said: Default::default(),
            client,
        };
        (
            ctx,
            Writers {
                namespaces,
                network_policies,
                configs,
                changes,
            },
        )
    }
}
