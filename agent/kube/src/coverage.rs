//! The controller's watch over gateway coverage: Liqo's active gateway pods and peerwall's
//! agent pods, compared every few seconds ([`crate::protection::coverage`]). A gateway that
//! stays without enforcement past the grace period gets a Warning Event
//! (`reason: Unprotected`), a log line and `peerwall_controller_unprotected_gateways`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::recorder::Recorder;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::events::{Event, EventType, Reporter};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};

use crate::metrics::ControllerMetrics;
use crate::protection::coverage::{live_hosts, Coverage, GatewayPod};

/// How the controller tells covered gateways from uncovered ones.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Label selector of Liqo's active gateway pods.
    pub gateway_selector: String,
    /// Label selector of peerwall's agent pods (the DaemonSet's).
    pub agent_selector: String,
    /// How long a gateway may be without enforcement before it is reported (an agent
    /// starting on a new node, a gateway moving).
    pub grace: Duration,
}

/// Where each tenant namespace's gateways are enforced now ([`live_hosts`]), as coverage last
/// saw it: `None` until it has looked, and while the cluster runs neither an agent pod nor a
/// gateway pod (agents run as host processes: no host can be told live or gone, so every
/// host's condition counts).
pub type LiveHosts = Arc<std::sync::Mutex<Option<BTreeMap<String, BTreeSet<String>>>>>;

/// How often coverage is compared.
const EVERY: Duration = Duration::from_secs(2);

fn ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn gateway(p: &Pod) -> GatewayPod {
    let spec = p.spec.as_ref();
    GatewayPod {
        namespace: p.namespace().unwrap_or_default(),
        name: p.name_any(),
        uid: p.uid().unwrap_or_default(),
        node: spec.and_then(|s| s.node_name.clone()),
        sidecar: spec.is_some_and(|s| {
            s.containers
                .iter()
                .any(|c| c.name == crate::protection::coverage::SIDECAR_CONTAINER)
        }),
    }
}

/// Watch and report until the future is dropped.
pub async fn run(
    client: Client,
    settings: Settings,
    metrics: Arc<std::sync::Mutex<ControllerMetrics>>,
    live: LiveHosts,
) {
    let quiet = Arc::new(super::Changes::default());
    let cache = |selector: &str| -> Store<Pod> {
        super::cache(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().labels(selector),
            (),
            quiet.clone(),
        )
    };
    let (gateways, agents) = (
        cache(&settings.gateway_selector),
        cache(&settings.agent_selector),
    );
    for s in [&gateways, &agents] {
        if s.wait_until_ready().await.is_err() {
            tracing::warn!("the pod watch of gateway coverage ended; coverage not reported");
            return;
        }
    }
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "peerwall-controller".into(),
            instance: None,
        },
    );
    let mut coverage = Coverage::new(settings.grace);
    loop {
        let agent_nodes: BTreeSet<String> = agents
            .state()
            .iter()
            .filter(|p| ready(p))
            .filter_map(|p| p.spec.as_ref().and_then(|s| s.node_name.clone()))
            .collect();
        let pods = gateways.state();
        let gws: Vec<GatewayPod> = pods.iter().map(|p| gateway(p)).collect();
        let f = coverage.observe(Instant::now(), &gws, &agent_nodes);
        let any = !gws.is_empty() || !agents.state().is_empty();
        if let Ok(mut l) = live.lock() {
            *l = any.then(|| live_hosts(&gws, &agent_nodes));
        }
        if let Ok(mut m) = metrics.lock() {
            m.unprotected_gateways = f.unprotected as u64;
        }
        for g in &f.newly_unprotected {
            let node = g.node.as_deref().unwrap_or_default();
            let note = format!(
                "no peerwall agent is ready on node {node} and the pod has no peerwall sidecar: \
                 its peer's traffic is not filtered. Make the agent DaemonSet reach the node \
                 (nodeSelector, tolerations) or add the sidecar (peerwall sidecar-patch)"
            );
            tracing::warn!(gateway = %format!("{}/{}", g.namespace, g.name), node, "{note}");
            let Some(pod) = pods
                .iter()
                .find(|p| p.uid().as_deref() == Some(g.uid.as_str()))
            else {
                continue;
            };
            let ev = Event {
                type_: EventType::Warning,
                reason: "Unprotected".into(),
                note: Some(note),
                action: "Enforce".into(),
                secondary: None,
            };
            if let Err(e) = recorder.publish(&ev, &pod.object_ref(&())).await {
                tracing::warn!(error = %e, "could not publish the Unprotected event");
            }
        }
        for name in &f.recovered {
            tracing::info!(gateway = %name, "gateway enforced again (or gone)");
        }
        tokio::time::sleep(EVERY).await;
    }
}
