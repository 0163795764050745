//! The node's CNI chain from the DaemonSet's agent ([`crate::cni::install`]): chained at
//! start, kept while it runs (a network plugin may rewrite its file), and taken out only
//! when peerwall is being uninstalled from the node. A restart or a rolling update keeps it:
//! the new gateways of those seconds are exactly what it is for.

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::Api;

use crate::cni::install::{self, Settings};
use crate::metrics::GatewayMetrics;

/// How often the chain is checked while the agent runs.
const KEEP_EVERY: Duration = Duration::from_secs(5);

/// The chain's upkeep between ticks.
pub struct Chain {
    settings: Settings,
    /// Installed (copied, checked on the node, chained) at least once.
    installed: bool,
    last: Option<Instant>,
    /// The last failure said, so each is logged once.
    said: Option<String>,
}

impl Chain {
    /// Upkeep of `settings`' chain.
    pub fn new(settings: Settings) -> Self {
        Self {
            settings,
            installed: false,
            last: None,
            said: None,
        }
    }

    /// Install, or keep, once every 5 s; the metric says whether it is chained.
    pub fn tick(&mut self, metrics: &std::sync::Mutex<GatewayMetrics>) {
        if self.last.is_some_and(|t| t.elapsed() < KEEP_EVERY) {
            return;
        }
        self.last = Some(Instant::now());
        // A binary that went (removed by hand, a node cleanup) is copied and checked again.
        if self.installed && !self.settings.binary().exists() {
            self.installed = false;
        }
        let outcome = if self.installed {
            install::keep(&self.settings).map(|(file, wrote)| {
                if wrote {
                    tracing::warn!(file = %file.display(), "peerwall-boot was missing from the node's CNI configuration in force (rewritten by the network plugin?): chained again");
                }
            })
        } else {
            install::install(&self.settings).map(|file| {
                self.installed = true;
                tracing::info!(file = %file.display(), binary = %self.settings.binary().display(), prefixes = ?self.settings.pod_name_prefixes, "peerwall-boot chained: new gateway pods get their boot policy when their sandbox is created");
            })
        };
        match outcome {
            Ok(()) => self.said = None,
            Err(e) => {
                let msg = e.to_string();
                if self.said.as_ref() != Some(&msg) {
                    tracing::error!(error = %msg, "peerwall-boot is not in the node's CNI chain: a gateway pod created while no agent runs here is unfiltered until one does (retrying)");
                    self.said = Some(msg);
                }
            }
        }
        if let Ok(mut m) = metrics.lock() {
            m.cni_boot = Some(install::chained_now(&self.settings));
        }
    }

    /// At the agent's end: take the plugin out if peerwall is being uninstalled.
    pub async fn on_exit(&self, client: &kube::Client) {
        match uninstalling(client).await {
            Some(why) => match install::uninstall(&self.settings) {
                Ok(files) => {
                    tracing::info!(reason = %why, files = ?files, "peerwall is being uninstalled from this node: peerwall-boot taken out of the CNI chain")
                }
                Err(e) => {
                    tracing::error!(reason = %why, error = %e, "could not take peerwall-boot out of the CNI chain: new gateway pods will keep their boot policy until it is removed by hand (docs/kubernetes.md)")
                }
            },
            None => {
                tracing::info!("peerwall-boot stays in the CNI chain: guards the gateways created until the next agent runs")
            }
        }
    }
}

/// Why peerwall is being uninstalled from this node, if it is: the agent's namespace or
/// DaemonSet is deleted or being deleted, or the API server refuses the agent's credentials
/// (`kubectl delete -k deploy/` removes the ServiceAccount and roles before the agents get
/// their signal). Anything else (the API server unreachable) keeps the chain: it fails
/// closed.
async fn uninstalling(client: &kube::Client) -> Option<String> {
    let ns = std::env::var("POD_NAMESPACE").ok()?;
    let gone = |e: &kube::Error| match e {
        kube::Error::Api(a) if a.code == 404 => Some("deleted".to_string()),
        kube::Error::Api(a) if a.code == 401 || a.code == 403 => Some(format!(
            "the API server refuses the agent's credentials ({}: ServiceAccount or role deleted)",
            a.code
        )),
        _ => {
            tracing::info!(error = %e, "uninstall check not answered: peerwall-boot kept");
            None
        }
    };
    match Api::<Namespace>::all(client.clone()).get(&ns).await {
        Ok(n) if n.metadata.deletion_timestamp.is_some() => {
            return Some(format!("namespace {ns} is being deleted"))
        }
        Ok(_) => {}
        Err(e) => return gone(&e).map(|w| format!("namespace {ns}: {w}")),
    }
    let pod = std::env::var("POD_NAME").ok()?;
    let owner = Api::<Pod>::namespaced(client.clone(), &ns)
        .get(&pod)
        .await
        .ok()?
        .metadata
        .owner_references
        .unwrap_or_default()
        .into_iter()
        .find(|o| o.kind == "DaemonSet")?
        .name;
    match Api::<DaemonSet>::namespaced(client.clone(), &ns)
        .get(&owner)
        .await
    {
        Ok(d) if d.metadata.deletion_timestamp.is_some() => {
            Some(format!("DaemonSet {ns}/{owner} is being deleted"))
        }
        Ok(_) => None,
        Err(e) => gone(&e).map(|w| format!("DaemonSet {ns}/{owner}: {w}")),
    }
}
