//! `peerwall agent --source kube --gateway-pods`: the DaemonSet's mode. Liqo's gateways are
//! pods with their own network namespace, where `liqo-tunnel`, the Geneve `liqo.*` links and
//! Liqo's NAT live; the node's namespace never sees that traffic. So the agent:
//!
//! 1. watches the active Liqo gateway pods scheduled on its node ([`pods::gateway_of`]);
//! 2. reaches each one's network namespace through a process of the pod ([`netns`], needs
//!    `hostPID`);
//! 3. runs one enforcer per gateway inside it (`peerwall_backend_select::open` on a thread that
//!    entered the namespace), driven by its own Kubernetes source ([`super::agent`]) that
//!    selects only that gateway's peer (`peerwall.io/remote-cluster-id=<peer>`);
//! 4. stops it when the pod goes (bpf: its pins, under `<pin-dir>/gateways/<peer>_<uid8>`, are
//!    removed once the pod's network namespace is gone, not before: a terminating pod still
//!    forwards through its tunnel during its grace period) and starts a new one when the pod
//!    is recreated (new UID, new namespace) or its sandbox is (same UID, new namespace).
//!
//! Restarting the agent changes nothing in force: nftables tables stay in the pods'
//! namespaces and are replaced atomically by the next apply; bpf programs stay attached
//! through their pinned links and the new enforcer adopts the pins.

pub mod cni;
pub mod gate;
pub mod handles;
pub mod netns;
mod opening;
pub mod pods;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};

use crate::watched::Answer;

use crate::metrics::{AgentMetrics, GatewayMetrics};
use crate::shutdown::Shutdown;
use pods::GatewayPod;

/// Settings of the gateway-pod mode.
#[derive(Clone, Debug)]
pub struct Settings {
    /// This node (pods are watched with `spec.nodeName=<node>`; conditions' `host`).
    pub node: String,
    /// Label selector of gateway pods ([`pods::GATEWAY_SELECTOR`]).
    pub gateway_selector: String,
    /// Label selector of peerwall's objects; each gateway adds its peer to it.
    pub selector: String,
    /// Backend of every gateway's enforcer, with its events (bpf: pins go under
    /// `<pin_dir>/gateways/<gateway>`).
    pub backend: peerwall_backend_select::Settings,
    /// Drift-check period of each enforcer.
    pub interval: Duration,
    /// Where the node's processes are (`/proc` with `hostPID`).
    pub proc: PathBuf,
    /// Enforce every table in audit mode (`--audit`).
    pub audit: bool,
    /// Drop summaries as Kubernetes Events, this often (with events).
    pub drop_summary: Option<Duration>,
    /// Who may steer the gateways ([`super::trust`]).
    pub trust: super::trust::Trust,
    /// The node's CNI chain (`--cni-boot`).
    pub cni: Option<crate::cni::install::Settings>,
    /// bpf: a gateway with no free turn to load has nftables enforce its policy until its
    /// datapath takes over (`--no-start-bridge` turns it off; `opening`).
    pub bridge: bool,
    /// bpf: how many gateways load their datapath at once (None: one per CPU).
    pub load_turns: Option<usize>,
}

impl Settings {
    fn gateway_pins(&self) -> PathBuf {
        self.backend.pin_dir.join("gateways")
    }
}

/// One gateway being enforced in.
struct Worker {
    gateway: GatewayPod,
    ns_path: PathBuf,
    ns_id: Option<(u64, u64)>,
    stop: Arc<Shutdown>,
    thread: std::thread::JoinHandle<anyhow::Result<()>>,
    started: Instant,
}

/// What the supervisor tracks between ticks.
struct Supervisor {
    settings: Settings,
    metrics: Arc<Mutex<GatewayMetrics>>,
    workers: BTreeMap<String, Worker>,
    /// Pods whose skip reason was logged (UID → reason), so each is logged once.
    skipped: BTreeMap<String, String>,
    /// The last failure to start each gateway's enforcer (UID → message, when), logged when it
    /// changes and retried once a second.
    failed: BTreeMap<String, (String, Instant)>,
    /// Gateway pods wanted (by UID) and when each was first seen, for the "enforced after"
    /// log field.
    seen: BTreeMap<String, (Instant, GatewayPod)>,
    /// Gateways whose pod is going (deleted, terminating) while its network namespace still
    /// forwards: their bpf datapath stays attached until the namespace is gone (pin name → the
    /// namespace's path and identity).
    draining: BTreeMap<String, (PathBuf, Option<(u64, u64)>)>,
    /// Turns to load a bpf datapath ([`gate`]).
    gate: Arc<gate::Gate>,
}

impl Supervisor {
    /// Bring the workers in line with the gateway pods on the node.
    fn sync(&mut self, pods: &[Arc<Pod>]) {
        self.drain();
        let mut wanted: BTreeMap<String, GatewayPod> = BTreeMap::new();
        let mut skipped = BTreeMap::new();
        for p in pods {
            let uid = p.metadata.uid.clone().unwrap_or_default();
            match pods::gateway_of(p) {
                Ok(g) => {
                    wanted.insert(g.uid.clone(), g);
                }
                Err(why) => {
                    let name = format!(
                        "{}/{}",
                        p.metadata.namespace.as_deref().unwrap_or_default(),
                        p.metadata.name.as_deref().unwrap_or_default()
                    );
                    if self.skipped.get(&uid) != Some(&why.to_string()) {
                        tracing::info!(pod = %name, reason = %why, "gateway pod not enforced in");
                    }
                    skipped.insert(uid, why.to_string());
                }
            }
        }
        self.skipped = skipped;
        self.seen.retain(|uid, _| wanted.contains_key(uid));
        self.failed.retain(|uid, _| wanted.contains_key(uid));
        for (uid, g) in &wanted {
            self.seen
                .entry(uid.clone())
                .or_insert_with(|| (Instant::now(), g.clone()));
        }
        // Stop workers whose pod is gone, inactive, or whose namespace was replaced.
        let stale: Vec<String> = self
            .workers
            .iter()
            .filter(|(uid, w)| {
                !wanted.contains_key(*uid)
                    || w.thread.is_finished()
                    || netns::netns_id(&w.ns_path) != w.ns_id
            })
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in stale {
            if let Some(w) = self.workers.remove(&uid) {
                let gone = !wanted.contains_key(&uid);
                let g = w.gateway.clone();
                if let Some(msg) = self.stop(w, gone) {
                    // Retried a second later, logged when the reason changes.
                    if self.failed.get(&uid).map(|(m, _)| m) != Some(&msg) {
                        tracing::error!(gateway = %g.name, peer = %g.peer, error = %msg, "enforcing in gateway pod failed (retrying every second)");
                    }
                    self.failed.insert(uid, (msg, Instant::now()));
                }
            }
        }
        // A gateway enforcing for a while is past its last failure: the next one is logged.
        for (uid, w) in &self.workers {
            if w.started.elapsed() > Duration::from_secs(10) {
                self.failed.remove(uid);
            }
        }
        for (uid, g) in wanted {
            if self.workers.contains_key(&uid) {
                continue;
            }
            if self
                .failed
                .get(&uid)
                .is_some_and(|(_, at)| at.elapsed() < Duration::from_secs(1))
            {
                continue;
            }
            // The sandbox may not exist yet: try again on the next tick.
            let Some(ns_path) = self.find_netns(&g) else {
                continue;
            };
            match self.start(&g, ns_path) {
                Ok(w) => {
                    self.workers.insert(uid, w);
                }
                Err(e) => {
                    let msg = format!("{e:#}");
                    if self.failed.get(&uid).map(|(m, _)| m) != Some(&msg) {
                        tracing::error!(gateway = %g.name, peer = %g.peer, error = %msg, "could not enforce in gateway pod (retrying every second)");
                    }
                    self.failed.insert(uid, (msg, Instant::now()));
                }
            }
        }
    }

    fn find_netns(&self, g: &GatewayPod) -> Option<PathBuf> {
        // A pid's ns link, resolved to a stable fd path: the pid may exit, the link is
        // re-read on every check.
        netns::pod_netns(&self.settings.proc, &g.uid)
    }

    /// Start enforcing in `g`'s namespace: a thread of its own opens the enforcer there (bpf:
    /// creates the maps; its first apply verifies the programs), holds the boot policy and
    /// runs the gateway's agent. Opening on that thread, not here, lets the gateways of a node
    /// load side by side while this loop goes on to the next pod: one by one, the last of 50
    /// bpf gateways waited for the 49 loads before it (`cargo xtask bench-peers`).
    fn start(&mut self, g: &GatewayPod, ns_path: PathBuf) -> anyhow::Result<Worker> {
        let s = &self.settings;
        let pins = s.gateway_pins().join(g.pin_name());
        let ns_id = netns::netns_id(&ns_path);
        let backend = peerwall_backend_select::Settings {
            pin_dir: pins.clone(),
            ..s.backend.clone()
        };
        let metrics = Arc::new(Mutex::new(AgentMetrics {
            backend: backend.kind.name(),
            ..Default::default()
        }));
        if let Ok(mut m) = self.metrics.lock() {
            m.gateways.insert(g.peer.clone(), metrics.clone());
        }
        let peer_sel = format!("{}={}", super::PEER, g.peer);
        let agent = super::agent::Settings {
            selector: format!("{},{peer_sel}", s.selector),
            liqo_selector: None,
            // nftables' forward hook sees through Liqo's NAT by itself; the bpf datapath
            // classifies at ingress and needs the rewrites, watched from the start with the
            // configurations (while the datapath loads).
            observe: if backend.kind.classifies_before_nat() {
                pods::observed_selectors(&g.peer)
            } else {
                Vec::new()
            },
            // Liqo's gateway binds the configurations it applies to its own pod.
            liqo_target: g
                .name
                .split_once('/')
                .map(|(ns, name)| peerwall_intent::binding::Target::pod(ns, name)),
            host: s.node.clone(),
            interval: s.interval,
            scope: Some(peer_sel),
            drop_summary: s.drop_summary,
            trust: s.trust.clone(),
        };
        let stop = Shutdown::new();
        let worker_stop = stop.clone();
        let span = tracing::info_span!("gateway", peer = %g.peer, pod = %g.name);
        let opening = opening::Opening {
            // bpf loads take turns; an nftables gateway opens in milliseconds.
            gate: (backend.kind == peerwall_backend_select::BackendKind::Bpf)
                .then(|| self.gate.clone()),
            backend,
            ns: ns_path.to_string_lossy().into_owned(),
            // Until the peer's configuration is in force, its boot policy is.
            boot: crate::enforcement::Boot::for_peer(&g.peer)
                .map_err(|e| tracing::error!(peer = %g.peer, error = %e, "the boot policy does not compile"))
                .ok(),
            metrics,
            audit: s.audit,
            events: s.backend.events.is_some(),
            pin_name: g.pin_name(),
            bridge: s.bridge,
            handle: handles::Handle {
                peer: g.peer.clone(),
                pod: g.name.clone(),
                uid: g.uid.clone(),
                pins: pins.clone(),
            },
        };
        let thread = std::thread::Builder::new()
            .name(format!("gw-{}", g.pin_name()))
            .spawn(move || {
                let _e = span.enter();
                // The policy source lists while the enforcer opens (its datapath loads):
                // the first apply follows whichever ends last.
                super::agent::run_opening(agent, || opening.open(), worker_stop)
            })
            .context("starting the gateway's agent thread")?;
        let after = self.seen.get(&g.uid).map(|(t, _)| t.elapsed().as_millis());
        tracing::info!(
            gateway = %g.name,
            peer = %g.peer,
            netns = %ns_path.display(),
            pins = %pins.display(),
            ms_since_pod_seen = after.unwrap_or_default() as u64,
            "enforcing inside gateway pod"
        );
        Ok(Worker {
            gateway: g.clone(),
            ns_path,
            ns_id,
            stop,
            thread,
            started: Instant::now(),
        })
    }

    /// Stop a worker; when its pod is gone, remove its bpf pins (nftables state went with the
    /// pod's namespace).
    /// Returns how its thread ended, if with an error (an enforcer that could not open, an
    /// agent that failed).
    fn stop(&mut self, w: Worker, gone: bool) -> Option<String> {
        w.stop.trigger();
        let failure = match w.thread.join() {
            Ok(Err(e)) => Some(format!("{e:#}")),
            Err(_) => Some("the gateway's thread panicked".to_string()),
            Ok(Ok(())) => None,
        };
        let others = self
            .workers
            .values()
            .any(|o| o.gateway.peer == w.gateway.peer);
        if !others {
            if let Ok(mut m) = self.metrics.lock() {
                m.gateways.remove(&w.gateway.peer);
            }
        }
        if gone {
            // A deleted pod's namespace forwards until its sandbox is torn down (the grace
            // period: the tunnel is still up, the peer still sends). Unpinning the links now
            // would detach the programs from traffic that still flows; nftables' tables stay
            // with the namespace by themselves.
            // Drained on the next tick when nothing of it filters a device any more.
            tracing::info!(gateway = %w.gateway.name, peer = %w.gateway.peer, "gateway pod going: its datapath stays attached until its network namespace is gone");
            self.draining
                .insert(w.gateway.pin_name(), (w.ns_path.clone(), w.ns_id));
        }
        tracing::info!(gateway = %w.gateway.name, peer = %w.gateway.peer, pod_gone = gone, "stopped enforcing inside gateway pod");
        failure
    }

    /// Remove a gone gateway's pins and handle.
    fn forget(&self, pin_name: &str) {
        remove_pins(&self.settings.gateway_pins().join(pin_name));
        handles::remove(Path::new(handles::HANDLES), pin_name);
    }

    /// Forget the draining gateways that are gone: no link of theirs filters a device any
    /// more (the kernel detaches a link when its device goes with the namespace) and the
    /// namespace they were enforced in is gone, or unknown. The namespace alone is not
    /// enough: it is reached through one process of the pod, which may exit before the
    /// others (a container killed first) while the tunnel still forwards.
    fn drain(&mut self) {
        let pins = self.settings.gateway_pins();
        let gone: Vec<String> = self
            .draining
            .iter()
            .filter(|(name, (path, id))| {
                let ns_gone = id.is_none() || netns::netns_id(path) != *id;
                ns_gone && !peerwall_backend_select::installed::still_filtering(&pins.join(name))
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            self.draining.remove(&name);
            tracing::info!(pins = %name, "gateway network namespace gone: its datapath removed");
            self.forget(&name);
        }
    }

    /// Remove pin directories and handles of gateways that are not on this node any more (the
    /// agent was down when they went). Gateways seen but not started yet keep theirs, for
    /// adoption; a datapath that still filters a device (a pod terminating while the agent
    /// restarted) drains first.
    fn collect_garbage(&mut self) {
        let keep: BTreeSet<String> = self
            .seen
            .values()
            .map(|(_, g)| g.pin_name())
            .chain(self.draining.keys().cloned())
            .collect();
        let pinned = std::fs::read_dir(self.settings.gateway_pins());
        for e in pinned.into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if keep.contains(&name) {
                continue;
            }
            if peerwall_backend_select::installed::still_filtering(&e.path()) {
                tracing::info!(pins = %e.path().display(), "pins of a gateway no longer on this node still filter a device: kept until it is gone");
                self.draining.insert(name, (PathBuf::new(), None));
            } else {
                tracing::info!(pins = %e.path().display(), "removing pins of a gateway no longer on this node");
                remove_pins(&e.path());
                handles::remove(Path::new(handles::HANDLES), &name);
            }
        }
        // Handles of gateways that went while the agent was down and left no pins (nftables).
        let dir = Path::new(handles::HANDLES);
        for name in handles::orphans(dir, &self.settings.gateway_pins(), &keep) {
            tracing::info!(handle = %name, "removing the handle of a gateway no longer on this node");
            handles::remove(dir, &name);
        }
    }
}

/// Remove a pin directory (maps, programs, links: unpinning a link detaches it) and the
/// slots' metadata kept for it under `/run/peerwall`.
fn remove_pins(dir: &std::path::Path) {
    if let Err(e) = peerwall_backend_select::installed::forget_pins(dir) {
        tracing::warn!(pins = %dir.display(), error = %e, "could not remove pins");
    }
}

/// Release this node's finalizer on a peer's objects once no gateway of that peer runs here.
async fn release_peer(client: &kube::Client, node: &str, peer: &str) {
    let api: Api<Answer> = Api::all_with(client.clone(), &super::fwc_resource());
    let fin = super::agent::finalizer(node);
    let lp = kube::api::ListParams::default().labels(&format!("{}={peer}", super::PEER));
    // Metadata only: a NetworkPolicy tier's spec is not needed to release a finalizer.
    let Ok(list) = api.list_metadata(&lp).await else {
        return;
    };
    for obj in list.items {
        let Some(list) = obj.metadata.finalizers.clone() else {
            continue;
        };
        if !list.contains(&fin) {
            continue;
        }
        let ns = obj.metadata.namespace.clone().unwrap_or_default();
        let name = obj.metadata.name.clone().unwrap_or_default();
        let body = serde_json::json!({"metadata": {
            "finalizers": list.into_iter().filter(|f| *f != fin).collect::<Vec<_>>(),
            "resourceVersion": obj.metadata.resource_version,
        }});
        let api: Api<Answer> = Api::namespaced_with(client.clone(), &ns, &super::fwc_resource());
        if let Err(e) = api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            tracing::debug!(object = %format!("{ns}/{name}"), error = %e, "finalizer release deferred");
        }
    }
}

/// How often pods without a namespace yet, and the namespaces enforced in, are checked.
const TICK: Duration = Duration::from_millis(100);

/// Run the gateway-pod mode until `stop` is set.
pub fn run(
    settings: Settings,
    metrics: Arc<Mutex<GatewayMetrics>>,
    stop: Arc<Shutdown>,
) -> anyhow::Result<()> {
    let rt = super::runtime()?;
    // Chained first, before the API server is reached: it guards gateways created while the
    // agent cannot enforce.
    let mut chain = settings.cni.clone().map(cni::Chain::new);
    if let Some(c) = chain.as_mut() {
        c.tick(&metrics);
    }
    rt.block_on(async move {
        let client = super::client().await?;
        let changed = Arc::new(super::Changes::default());
        // From the watch cache (`super::watch_config`): a read through to etcd scans every
        // pod of the cluster (19 s at 51 000 pods on the bench's API server).
        let pods = super::cache(
            Api::<Pod>::all(client.clone()),
            super::watch_config()
                .labels(&settings.gateway_selector)
                .fields(&format!("spec.nodeName={}", settings.node)),
            (),
            changed.clone(),
        );
        tracing::info!(node = %settings.node, selector = %settings.gateway_selector, "watching gateway pods on this node");
        pods.wait_until_ready()
            .await
            .context("the gateway pod watch ended before its first list")?;
        // A bpf datapath made ready ahead for the next gateway (a new peer's), under
        // `<pin-dir>/spares` while it loads.
        if settings.backend.kind == peerwall_backend_select::BackendKind::Bpf {
            let root = settings.backend.pin_dir.join("spares");
            let serves = settings.gateway_pins();
            if let Err(e) = peerwall_backend_select::keep_spare_datapaths(&root, &serves) {
                tracing::warn!(error = %format!("{e:#}"), "no spare datapath: each new gateway loads its own");
            }
        }
        let gate = match settings.load_turns {
            Some(n) => gate::Gate::new(n),
            None => gate::Gate::per_cpu(),
        };
        let mut sup = Supervisor {
            settings,
            metrics: metrics.clone(),
            workers: BTreeMap::new(),
            skipped: BTreeMap::new(),
            failed: BTreeMap::new(),
            seen: BTreeMap::new(),
            draining: BTreeMap::new(),
            gate,
        };
        let mut first = true;
        while !stop.is_set() {
            let before: BTreeSet<String> =
                sup.workers.values().map(|w| w.gateway.peer.clone()).collect();
            tokio::task::block_in_place(|| sup.sync(&pods.state()));
            if first {
                sup.collect_garbage();
                if let Ok(mut m) = metrics.lock() {
                    m.synced = true;
                }
                first = false;
            }
            let after: BTreeSet<String> =
                sup.workers.values().map(|w| w.gateway.peer.clone()).collect();
            for peer in before.difference(&after) {
                release_peer(&client, &sup.settings.node, peer).await;
            }
            if let Some(c) = chain.as_mut() {
                tokio::task::block_in_place(|| c.tick(&metrics));
            }
            tokio::select! {
                _ = stop.wait() => break,
                _ = tokio::time::timeout(TICK, changed.notify.notified()) => {}
            }
        }
        // Leave everything in force: stop the workers without removing anything.
        for (_, w) in std::mem::take(&mut sup.workers) {
            w.stop.trigger();
            let _ = tokio::task::block_in_place(|| w.thread.join());
        }
        if let Some(c) = &chain {
            c.on_exit(&client).await;
        }
        tracing::info!("agent stopping; enforcement stays in place inside the gateway pods");
        Ok(())
    })
}
