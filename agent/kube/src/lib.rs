//! The Kubernetes edge, a crate of its own (as linkerd's policy controller keeps its API apart
//! from its index): the agent's watch source, the DaemonSet's gateway-pods mode, the
//! provider/consumer-protection controller and the admission webhook, status and observe across
//! the cluster. Everything that decides (validation, desired objects) lives in the pure crates
//! ([`peerwall_policy::compile`], [`crate::protection`], [`crate::netpol`]); the enforcement it
//! drives is `peerwall-enforce`'s; this crate only moves objects between the API server and them.

pub(crate) use peerwall_enforce::{cni, enforcement, events, metrics, shutdown};
pub use peerwall_netpol as netpol;
pub use peerwall_protection as protection;

pub mod agent;
pub mod cluster_policy_crd;
pub mod controller;
pub mod coverage;
pub mod gateway_pods;
pub mod model;
pub mod observe;
pub mod protection_policies;
pub mod recorder;
pub mod reported;
pub mod schema;
pub mod snapshot;
pub mod status;
pub mod trust;
pub mod watched;
pub mod webhook;

use kube::api::{ApiResource, DynamicObject, GroupVersionKind};

use peerwall_intent::load::{self, Group};
use peerwall_policy::compile::PolicyObject;

/// Liqo's label naming the peer cluster of tenant namespaces, offloaded namespaces, virtual
/// nodes and reflected pods.
pub const REMOTE_CLUSTER_ID: &str = "liqo.io/remote-cluster-id";
/// Liqo's label on tenant namespaces (`"true"`; Liqo: `pkg/consts/core.go`, with
/// [`REMOTE_CLUSTER_ID`] from `pkg/consts/namespace_mapping.go`, set by its tenant-namespace
/// manager).
pub const TENANT_NAMESPACE: &str = "liqo.io/tenant-namespace";
/// Liqo's label on virtual nodes (`virtual-node`). Liqo: `pkg/consts/namespace_mapping.go`
/// (`TypeLabel = "liqo.io/type"`, `TypeNode = "virtual-node"`, beside `RemoteClusterID`).
pub const NODE_TYPE: &str = "liqo.io/type";
/// Liqo's FirewallConfiguration label that routes objects to its enforcers (`gateway`,
/// `fabric`; Liqo's `pkg/firewall/label.go`). peerwall never writes it: Liqo's gateway selects
/// objects by it (`cmd/gateway/main.go` with the label sets of `pkg/gateway/label.go`).
pub const FIREWALL_CATEGORY: &str = "networking.liqo.io/firewall-category";
/// Liqo's unique label (the peer cluster id for gateway configurations). Never written.
pub const FIREWALL_UNIQUE: &str = "networking.liqo.io/firewall-unique";
pub use crate::protection::{MANAGED_BY, MANAGER, PEER, TARGET, TARGET_GATEWAY};
/// The agent's default selection: peerwall's objects meant for gateways.
pub const DEFAULT_SELECTOR: &str = "peerwall.io/target=gateway";

/// peerwall's FirewallConfiguration resource (`firewallconfigurations.peerwall.io`), for
/// dynamic API access: objects are watched as [`watched::ConfigObject`] (the spec read into
/// its type, kept as text where it does not read), so that an invalid object becomes a
/// field-path error in its status instead of a watch that cannot deserialize.
pub fn fwc_resource() -> ApiResource {
    resource_of(Group::Peerwall)
}

/// The FirewallConfiguration resource of a group (Liqo's is only ever read).
pub fn resource_of(group: Group) -> ApiResource {
    let (g, v) = match group {
        Group::Peerwall => (load::GROUP, load::VERSION),
        Group::Liqo => (load::LIQO_GROUP, load::LIQO_VERSION),
    };
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(g, v, load::KIND),
        "firewallconfigurations",
    )
}

/// Liqo's FirewallConfigurationBinding resource (`firewallconfigurationbindings.networking.liqo.io`,
/// liqotech/liqo PR #3290): which gateway pod or node applies a Liqo FirewallConfiguration.
pub fn liqo_binding_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(
            load::LIQO_GROUP,
            load::LIQO_VERSION,
            "FirewallConfigurationBinding",
        ),
        "firewallconfigurationbindings",
    )
}

/// peerwall's AddressSet resource (`addresssets.peerwall.io`): slices of named sets.
pub fn address_set_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(load::GROUP, load::VERSION, load::ADDRESS_SET_KIND),
        "addresssets",
    )
}

/// Decode and validate a watched AddressSet (field-path errors, as for files).
pub fn check_slice(
    obj: &watched::SliceObject,
) -> Result<peerwall_policy::sliced::CheckedSlice, CheckError> {
    let slice = match (&obj.metadata.name, &obj.spec) {
        (Some(name), watched::Spec::Read(spec)) => load::address_set_with_spec(
            obj.metadata.namespace.as_deref(),
            name,
            peerwall_intent::AddressSetSpec::clone(spec),
        ),
        _ => load::address_set_from_json(whole(obj)?)?,
    };
    Ok(peerwall_policy::sliced::check_slice(&slice)?)
}

/// Liqo's `Configuration` (`networking.liqo.io/v1beta1`), read for remapped CIDRs.
pub fn liqo_configuration_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(load::LIQO_GROUP, load::LIQO_VERSION, "Configuration"),
        "configurations",
    )
}

/// ClusterNetworkPolicies (`policy.networking.k8s.io/v1alpha2`, cluster-scoped), read by the
/// controller into each peer's tier.
pub fn cluster_network_policy_resource() -> ApiResource {
    use peerwall_netpol::cnp::api as cnp;
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(cnp::GROUP, cnp::VERSION, cnp::KIND),
        cnp::PLURAL,
    )
}

/// An object the agent reads (watched, or sent in an admission review): its metadata and
/// `apiVersion`, which give its key and group.
pub trait ApiObject {
    /// Its `apiVersion`, if it came with one.
    fn api_version_of(&self) -> Option<&str>;
    /// Its metadata.
    fn meta_of(&self) -> &kube::api::ObjectMeta;
}

impl ApiObject for DynamicObject {
    fn api_version_of(&self) -> Option<&str> {
        self.types.as_ref().map(|t| t.api_version.as_str())
    }
    fn meta_of(&self) -> &kube::api::ObjectMeta {
        &self.metadata
    }
}

impl<S> ApiObject for watched::Watched<S> {
    fn api_version_of(&self) -> Option<&str> {
        self.api_version()
    }
    fn meta_of(&self) -> &kube::api::ObjectMeta {
        &self.metadata
    }
}

impl<T: ApiObject + ?Sized> ApiObject for std::sync::Arc<T> {
    fn api_version_of(&self) -> Option<&str> {
        T::api_version_of(self)
    }
    fn meta_of(&self) -> &kube::api::ObjectMeta {
        T::meta_of(self)
    }
}

impl<T: ApiObject + ?Sized> ApiObject for &T {
    fn api_version_of(&self) -> Option<&str> {
        T::api_version_of(self)
    }
    fn meta_of(&self) -> &kube::api::ObjectMeta {
        T::meta_of(self)
    }
}

/// The group of a watched object (from its `apiVersion`; peerwall's when absent).
pub fn group_of(obj: &impl ApiObject) -> Group {
    obj.api_version_of()
        .and_then(Group::of_api_version)
        .unwrap_or(Group::Peerwall)
}

/// In-memory label on a watched copy of a Liqo object the agent only observes (`--observe`):
/// never written to the API (peerwall writes nothing to Liqo's objects).
pub const OBSERVED: &str = "peerwall.io/observed";

/// The watched copy of `obj`, marked as observed.
pub fn mark_observed(obj: &watched::ConfigObject) -> watched::ConfigObject {
    let mut o = obj.clone();
    o.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert(OBSERVED.into(), "true".into());
    o
}

/// The whole object as JSON, for the loader's field-path refusal.
fn whole<S: serde::Serialize>(
    obj: &watched::Watched<S>,
) -> Result<serde_json::Value, load::LoadError> {
    obj.to_json().map_err(|e| load::LoadError::Field {
        origin: key_of(obj),
        path: ".".into(),
        message: e.to_string(),
    })
}

/// Convert a watched object into compilation input (field-path errors as the loader gives).
pub fn to_policy_object(obj: &watched::ConfigObject) -> Result<PolicyObject, load::LoadError> {
    let group = group_of(obj);
    // The spec the watch read; the whole object, as JSON, only for the field path of a
    // refusal.
    let mut po = match (&obj.metadata.name, &obj.spec) {
        (Some(name), watched::Spec::Read(spec)) => load::object_with_spec(
            obj.metadata.namespace.as_deref(),
            name,
            peerwall_intent::FirewallConfigurationSpec::clone(spec),
            group,
        ),
        _ => load::object_from_json(whole(obj)?, group)?,
    };
    let labels = obj.metadata.labels.as_ref();
    if labels.and_then(|l| l.get(OBSERVED)).map(String::as_str) == Some("true") {
        po.role = peerwall_intent::Role::Observe;
    }
    Ok(po)
}

/// `namespace/name` of an object (Liqo's marked `liqo:`), the same key as its origin.
pub fn key_of(obj: &impl ApiObject) -> String {
    let meta = obj.meta_of();
    group_of(obj).origin(
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default(),
    )
}

/// A client from the in-cluster service account or `KUBECONFIG` / `~/.kube/config`.
pub async fn client() -> anyhow::Result<kube::Client> {
    use anyhow::Context;
    let (file, context) = CONNECTION.get().cloned().unwrap_or_default();
    if file.is_none() && context.is_none() {
        return kube::Client::try_default()
            .await
            .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)");
    }
    let kubeconfig = match &file {
        Some(f) => kube::config::Kubeconfig::read_from(f)
            .with_context(|| format!("reading --kubeconfig {}", f.display()))?,
        None => kube::config::Kubeconfig::read()
            .context("reading the kubeconfig (KUBECONFIG or ~/.kube/config) for --context")?,
    };
    let options = kube::config::KubeConfigOptions {
        context: context.clone(),
        ..Default::default()
    };
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
        .await
        .with_context(|| match &context {
            Some(c) => format!("using kubeconfig context {c:?}"),
            None => "using the kubeconfig's current context".to_string(),
        })?;
    kube::Client::try_from(config).context("connecting to the Kubernetes API")
}

/// The kubeconfig file and context `--kubeconfig` and `--context` named, if any.
static CONNECTION: std::sync::OnceLock<(Option<std::path::PathBuf>, Option<String>)> =
    std::sync::OnceLock::new();

/// Make [`client`] connect with this kubeconfig file and context (the CLI's `--kubeconfig` and
/// `--context`; None: as kubectl defaults). Once per process; later calls change nothing.
pub fn connect_with(kubeconfig: Option<std::path::PathBuf>, context: Option<String>) {
    let _ = CONNECTION.set((kubeconfig, context));
}

/// Change signal shared by reflector caches: a wake-up for whoever waits, and a counter that
/// tells whether anything changed since a value was computed from the caches.
#[derive(Debug, Default)]
pub struct Changes {
    /// Woken on every event (coalesced).
    pub notify: tokio::sync::Notify,
    /// A second wake-up, for a second consumer of the same events (a `Notify` wakes one).
    pub notify_also: tokio::sync::Notify,
    count: std::sync::atomic::AtomicU64,
    /// Events that changed something other than the controller's own outputs ([`Changes::inputs`]).
    inputs: std::sync::atomic::AtomicU64,
    /// Watches whose last answer was an error (the API server unreachable, for example).
    failing: std::sync::atomic::AtomicU64,
}

impl Changes {
    pub(crate) fn bump(&self) {
        self.inputs
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.bump_output();
    }

    /// A change of one of the controller's own outputs (its FirewallConfigurations and
    /// AddressSets, other than in their status): moves the count, not [`Changes::inputs`].
    pub(crate) fn bump_output(&self) {
        self.count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.notify.notify_one();
        self.notify_also.notify_one();
    }

    /// An event that changed only an object's status ([`reported`]): wakes the first consumer,
    /// and the second with `also`, without moving the count.
    pub(crate) fn reported(&self, also: bool) {
        self.notify.notify_one();
        if also {
            self.notify_also.notify_one();
        }
    }

    /// Events seen so far.
    pub fn count(&self) -> u64 {
        self.count.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Events seen so far that changed something other than the controller's own outputs:
    /// what its view of the cluster (pods, namespaces, NetworkPolicies, remaps) is read from
    /// moves this, and its own writes, echoed by its watches, do not.
    pub fn inputs(&self) -> u64 {
        self.inputs.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether every watch answered its last request (false while the API server is away:
    /// the caches keep their last state meanwhile).
    pub fn connected(&self) -> bool {
        self.failing.load(std::sync::atomic::Ordering::SeqCst) == 0
    }

    fn set_failing(&self, was: bool, now: bool) {
        use std::sync::atomic::Ordering::SeqCst;
        match (was, now) {
            (false, true) => {
                self.failing.fetch_add(1, SeqCst);
            }
            (true, false) => {
                self.failing.fetch_sub(1, SeqCst);
            }
            _ => {}
        }
    }
}

/// Every event of a watch of `api` (filtered by `wc`) handed to `on_event` in order, by a
/// spawned task that signals `changed` after each that `on_event` says changed what the caller
/// keeps (and when the watch starts or stops failing); watch errors are logged and retried
/// with backoff. No cache: the caller keeps what it needs (the controller's pod index keeps a few
/// fields of each pod, not the objects). The receiver turns true once the first full list
/// has been delivered.
pub fn feed<K>(
    api: kube::Api<K>,
    wc: kube::runtime::watcher::Config,
    changed: std::sync::Arc<Changes>,
    mut on_event: impl FnMut(kube::runtime::watcher::Event<K>) -> bool + Send + 'static,
) -> tokio::sync::watch::Receiver<bool>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    use futures::StreamExt;
    use kube::runtime::watcher::Event;
    use kube::runtime::WatchStreamExt;
    let (listed, rx) = tokio::sync::watch::channel(false);
    let stream = kube::runtime::watcher(api, wc)
        .default_backoff()
        .scan(false, move |failing, ev| {
            let now = ev.is_err();
            let read = match ev {
                Err(e) => {
                    tracing::warn!(error = %e, "watch error (retrying)");
                    false
                }
                Ok(ev) => {
                    let done = matches!(ev, Event::InitDone);
                    let read = on_event(ev);
                    if done {
                        listed.send_replace(true);
                    }
                    read
                }
            };
            changed.set_failing(*failing, now);
            // An event that changed nothing read (a pod's status update of a condition) wakes
            // no pass; a watch failing or recovering does.
            if read || *failing != now {
                changed.bump();
            }
            *failing = now;
            futures::future::ready(Some(()))
        })
        .for_each(|()| futures::future::ready(()));
    tokio::spawn(stream);
    rx
}

/// How the agent's watches list: from the API server's watch cache (`resourceVersion=0`), as
/// client-go's informers and the kubelet do, not read through to etcd. Every gateway of every
/// node lists at start, and a read through decodes every object of the kind in etcd to filter
/// by label: 50 gateways starting on one node kept a 2-core API server busy for 19 s
/// (`cargo xtask bench-peers`). A list from the cache is as old as the cache's lag behind etcd
/// (milliseconds), and the watch goes on from the listed version, delivering every later
/// change in order: an address removed just before a gateway starts stays allowed no longer
/// than a removal that reaches a running gateway through its watch, and connections opened
/// meanwhile are ended as for any change (`revoke`). The boot policy holds until that first
/// apply. Unpaged: kube-rs sends `resourceVersion=0`
/// only without a `limit` (the watch cache ignores limits), and its watcher pages by 500 by
/// default, which made `any_semantic` alone a read through to etcd after all.
pub fn watch_config() -> kube::runtime::watcher::Config {
    let mut wc = kube::runtime::watcher::Config::default().any_semantic();
    wc.page_size = None;
    wc
}

/// The list that asks whether a kind is served at all (404 when its CRD is not installed),
/// metadata only, of the objects `selector` picks, from the watch cache. Not `limit=1` read
/// through to etcd: the API server (1.20 here) does not page custom resources, so that read
/// decoded every object of the kind, once per gateway (5 of the 12 CPU seconds the API
/// server spent while 50 gateways started, `cargo xtask bench-peers`).
pub fn list_check_params(selector: Option<&str>) -> kube::api::ListParams {
    let lp = kube::api::ListParams::default().match_any();
    match selector {
        Some(s) => lp.labels(s),
        None => lp,
    }
}

/// A reflector cache of `api` (filtered by `wc`), kept up to date by a spawned task that
/// signals `changed` on every event; watch errors are logged and retried with backoff.
pub fn cache<K>(
    api: kube::Api<K>,
    wc: kube::runtime::watcher::Config,
    dyntype: K::DynamicType,
    changed: std::sync::Arc<Changes>,
) -> kube::runtime::reflector::Store<K>
where
    K: kube::Resource
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone + Send + Sync,
{
    reported::cache(api, wc, dyntype, changed, None)
}

/// Build a multi-threaded runtime for a Kubernetes command.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    use anyhow::Context;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Why an object cannot be enforced; its Display is the user-facing message (status, webhook).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The object does not decode (a field of the wrong type or value).
    #[error(transparent)]
    Decode(#[from] load::LoadError),
    /// The object decodes but does not validate.
    #[error(transparent)]
    Invalid(#[from] peerwall_policy::compile::ObjectErrors),
}

/// The one validation both the agent and the admission webhook run on an object: decode it
/// (field-path errors) and validate it (every problem, with its field path and value).
/// Returns the object and its warnings.
pub fn check(obj: &watched::ConfigObject) -> Result<(PolicyObject, Vec<String>), CheckError> {
    let po = to_policy_object(obj)?;
    let warnings = peerwall_policy::compile::validate(&po)?;
    Ok((po, warnings.iter().map(|w| w.to_string()).collect()))
}

/// [`check`] of an object whose earlier version `prior` passed it: where only inline set
/// elements changed (a NetworkPolicy tier after a pod relabel), only those sets are
/// validated, with the errors and field paths the whole validation gives (at 20,000
/// elements, the whole costs tens of milliseconds per change); anything else is validated
/// whole. Warnings are not returned.
pub fn check_since(
    obj: &watched::ConfigObject,
    prior: Option<&PolicyObject>,
) -> Result<PolicyObject, CheckError> {
    let po = to_policy_object(obj)?;
    let only_elements = prior
        .and_then(|old| peerwall_intent::elements::inline_element_changes([old], [&po]))
        .and_then(|sets| {
            let names: Vec<String> = sets.into_iter().map(|(_, s)| s).collect();
            peerwall_policy::compile::validate_sets(&po, &names)
        });
    match only_elements {
        Some(r) => r?,
        None => drop(peerwall_policy::compile::validate(&po)?),
    }
    Ok(po)
}

/// A watch of Liqo's tenant namespaces (labelled [`TENANT_NAMESPACE`]`=true`), listed once:
/// who may steer which peer's gateway ([`trust`]), for the agent and the webhook.
pub async fn tenant_namespaces(
    client: &kube::Client,
    changed: std::sync::Arc<Changes>,
) -> anyhow::Result<kube::runtime::reflector::Store<k8s_openapi::api::core::v1::Namespace>> {
    use anyhow::Context;
    let r = cache(
        kube::Api::all(client.clone()),
        watch_config().labels(&format!("{TENANT_NAMESPACE}=true")),
        (),
        changed,
    );
    r.wait_until_ready()
        .await
        .context("the watch of Liqo's tenant namespaces ended before its first list")?;
    Ok(r)
}

/// The peer of every tenant namespace in `namespaces` (its [`REMOTE_CLUSTER_ID`] label).
pub fn tenants_of<'a>(
    namespaces: impl IntoIterator<Item = &'a k8s_openapi::api::core::v1::Namespace>,
) -> trust::Tenants {
    use kube::ResourceExt;
    namespaces
        .into_iter()
        .filter_map(|ns| {
            let peer = ns.labels().get(REMOTE_CLUSTER_ID)?;
            Some((ns.name_any(), peer.clone()))
        })
        .collect()
}
