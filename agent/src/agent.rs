//! `peerwall agent --source dir:PATH`: keep a directory of FirewallConfiguration YAML enforced.
//!
//! The directory is polled; when its contents change, every object is loaded, validated and
//! compiled into one policy and applied through the chosen backend. An invalid change is
//! logged and not applied: the last good policy stays in force. The nftables backend's drift
//! check runs on every tick and repairs tables someone deleted or edited.
//! [`Engine`] is the part every source shares; the Kubernetes source is [`crate::k8s::agent`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;

use peerwall_backend_bpf::{compile::Iface, loader};
use peerwall_backend_nftables::{Nft, NftBackend};
use peerwall_intent::load;
use peerwall_policy::compile;

/// Where policies come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicySource {
    /// A directory of YAML files.
    Dir(PathBuf),
    /// FirewallConfigurations watched on the Kubernetes API server (in-cluster config or
    /// `KUBECONFIG`).
    Kube,
}

impl std::str::FromStr for PolicySource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            Some(("dir", p)) if !p.is_empty() => Ok(PolicySource::Dir(PathBuf::from(p))),
            None if s == "kube" => Ok(PolicySource::Kube),
            _ => Err(format!(
                "{s:?} is not a policy source (use dir:PATH or kube)"
            )),
        }
    }
}

/// The enforcing backend of a running agent.
pub enum Enforcer {
    /// nftables.
    Nft(NftBackend),
    /// eBPF.
    Bpf {
        /// Loaded datapath.
        backend: Box<loader::BpfBackend>,
        /// Interface patterns to attach to.
        patterns: Vec<String>,
        /// Attach XDP too.
        xdp: bool,
    },
    /// A backend living on a thread inside another network namespace.
    InNetns(NsWorker),
}

type Job = Box<dyn FnOnce(&mut Enforcer) + Send>;

/// A backend owned by a thread that entered another network namespace (a gateway pod's):
/// every call runs there, so `nft` (a child of that thread), netlink, the FIB and the programs'
/// attachments all target that namespace, while the agent's own sockets (the API server
/// connection, `/metrics`) stay where the agent runs. bpffs is a mount, not part of the
/// network namespace: pins stay under the host's `/sys/fs/bpf`.
pub struct NsWorker {
    ns: String,
    tx: std::sync::mpsc::Sender<Job>,
}

impl NsWorker {
    fn spawn(
        ns: &str,
        make: impl FnOnce() -> anyhow::Result<Enforcer> + Send + 'static,
    ) -> anyhow::Result<Self> {
        use std::os::fd::AsRawFd;
        let path = format!("/run/netns/{ns}");
        let file = std::fs::File::open(&path)
            .with_context(|| format!("opening network namespace {path}"))?;
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<anyhow::Result<()>>();
        std::thread::Builder::new()
            .name(format!("enforcer-{ns}"))
            .spawn(move || {
                // SAFETY: setns on a valid namespace fd; affects only this thread.
                if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    let _ = ready_tx.send(Err(std::io::Error::last_os_error().into()));
                    return;
                }
                let mut enforcer = match make() {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                for job in rx {
                    job(&mut enforcer);
                }
            })
            .context("starting the enforcer thread")?;
        ready_rx
            .recv()
            .context("the enforcer thread ended before starting")?
            .with_context(|| format!("entering network namespace {ns}"))?;
        Ok(Self { ns: ns.into(), tx })
    }

    fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Enforcer) -> R + Send + 'static,
    ) -> anyhow::Result<R> {
        let (rtx, rrx) = std::sync::mpsc::channel();
        let gone = || anyhow::anyhow!("the enforcer thread in network namespace {} ended", self.ns);
        self.tx
            .send(Box::new(move |e| {
                let _ = rtx.send(f(e));
            }))
            .map_err(|_| gone())?;
        rrx.recv().map_err(|_| gone())
    }
}

impl Enforcer {
    fn apply(&mut self, policy: &peerwall_policy::ir::Policy) -> anyhow::Result<String> {
        match self {
            Enforcer::InNetns(w) => {
                let p = policy.clone();
                w.call(move |e| e.apply(&p))?
            }
            Enforcer::Nft(b) => {
                let r = b.apply(policy).context("applying with nftables")?;
                Ok(format!(
                    "recreated={:?} updated={:?} deleted={:?} element_changes={}",
                    r.recreated, r.updated, r.deleted, r.element_changes
                ))
            }
            Enforcer::Bpf {
                backend,
                patterns,
                xdp,
            } => {
                let host = loader::host_ifaces().context("listing interfaces")?;
                backend.register_ifaces(&host)?;
                let ifaces: Vec<Iface> = host
                    .iter()
                    .map(|i| Iface {
                        name: i.name.clone(),
                        ifindex: i.ifindex,
                    })
                    .collect();
                let r = backend
                    .apply(policy, &ifaces)
                    .context("applying with bpf")?;
                for t in loader::matching(&host, patterns) {
                    backend
                        .attach(t, *xdp)
                        .with_context(|| format!("attaching to {}", t.name))?;
                }
                Ok(format!(
                    "slot={} switched={} entries={}",
                    r.active, r.switched, r.entries_changed
                ))
            }
        }
    }

    /// Something outside the policy changed that the backend must follow: for bpf, the set of
    /// interfaces (new `liqo.*` devices must be attached and resolved in the maps).
    fn environment(&self) -> Vec<(String, u32)> {
        match self {
            Enforcer::InNetns(w) => w.call(|e| e.environment()).unwrap_or_default(),
            Enforcer::Nft(_) => Vec::new(),
            Enforcer::Bpf { .. } => loader::host_ifaces()
                .map(|v| v.into_iter().map(|i| (i.name, i.ifindex)).collect())
                .unwrap_or_default(),
        }
    }

    /// Restore drifted tables; returns how many.
    fn repair(&mut self) -> anyhow::Result<usize> {
        if let Enforcer::InNetns(w) = self {
            return w.call(|e| e.repair())?;
        }
        if let Enforcer::Nft(b) = self {
            let fixed = b.repair().context("drift repair")?;
            if !fixed.is_empty() {
                tracing::warn!(drift = ?fixed, "nftables drift repaired");
            }
            return Ok(fixed.len());
        }
        Ok(0)
    }

    /// Rule counters of what is applied.
    fn counters(&mut self) -> anyhow::Result<Vec<peerwall_backend_nftables::RuleCounter>> {
        Ok(match self {
            Enforcer::InNetns(w) => w.call(|e| e.counters())??,
            Enforcer::Nft(b) => b.counters()?,
            Enforcer::Bpf { backend, .. } => backend.counters()?,
        })
    }
}

/// Fingerprint of a directory: names, sizes and modification times of its YAML files.
fn fingerprint(dir: &Path) -> std::io::Result<BTreeMap<PathBuf, (u64, SystemTime)>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let p = e.path();
        let yaml = p
            .extension()
            .and_then(|x| x.to_str())
            .is_some_and(|x| x == "yaml" || x == "yml");
        if yaml {
            let m = e.metadata()?;
            out.insert(p, (m.len(), m.modified()?));
        }
    }
    Ok(out)
}

/// Build the enforcer for a backend name. `netns` enforces in a named network namespace (for
/// example a gateway's) from a thread that entered it, instead of the agent's own.
pub fn enforcer(
    backend: &str,
    pin_dir: &Path,
    patterns: Vec<String>,
    xdp: bool,
    netns: Option<&str>,
) -> anyhow::Result<Enforcer> {
    if let Some(ns) = netns {
        let (backend, pin_dir) = (backend.to_string(), pin_dir.to_path_buf());
        return Ok(Enforcer::InNetns(NsWorker::spawn(ns, move || {
            enforcer(&backend, &pin_dir, patterns, xdp, None)
        })?));
    }
    Ok(match backend {
        "nftables" => Enforcer::Nft(NftBackend::new(Nft::host())),
        _ => {
            loader::ensure_bpffs()?;
            Enforcer::Bpf {
                backend: Box::new(loader::BpfBackend::load(pin_dir)?),
                patterns,
                xdp,
            }
        }
    })
}

/// Why a set of objects was not enforced.
#[derive(Debug, thiserror::Error)]
pub enum EnforceError {
    /// Validation refused some objects; nothing was applied.
    #[error(transparent)]
    Invalid(#[from] compile::CompileError),
    /// The kernel refused the policy; the previous one stays.
    #[error("{0:#}")]
    Apply(anyhow::Error),
}

/// Compile-and-apply with metrics and logs: the part every policy source shares.
pub struct Engine {
    enforcer: Enforcer,
    metrics: crate::metrics::Shared,
    generation: u64,
    last_env: Option<Vec<(String, u32)>>,
}

impl Engine {
    /// An engine over a backend, reporting into `metrics`.
    pub fn new(enforcer: Enforcer, metrics: crate::metrics::Shared) -> Self {
        Self {
            enforcer,
            metrics,
            generation: 0,
            last_env: None,
        }
    }

    fn update(&self, f: impl FnOnce(&mut crate::metrics::AgentMetrics)) {
        if let Ok(mut m) = self.metrics.lock() {
            f(&mut m);
        }
    }

    /// Validate, compile and apply `objects` as the whole policy of this host (an empty list
    /// removes everything peerwall installed). On error nothing changes.
    pub fn enforce(&mut self, objects: &[compile::PolicyObject]) -> Result<(), EnforceError> {
        let started = Instant::now();
        let compiled = match compile::compile(objects) {
            Ok(c) => c,
            Err(e) => {
                self.update(|m| m.invalid_policies += 1);
                return Err(e.into());
            }
        };
        self.apply_compiled(&compiled, started)
    }

    /// Apply an already compiled policy (`started`: when its compilation began, for the
    /// latency metric). On error nothing changes.
    pub fn apply_compiled(
        &mut self,
        compiled: &compile::Compiled,
        started: Instant,
    ) -> Result<(), EnforceError> {
        for (origin, w) in &compiled.warnings {
            tracing::warn!(object = %origin, "{w}");
        }
        self.last_env = Some(self.enforcer.environment());
        match self.enforcer.apply(&compiled.policy) {
            Ok(summary) => {
                self.generation += 1;
                let secs = started.elapsed().as_secs_f64();
                let generation = self.generation;
                self.update(|m| {
                    m.generation = generation;
                    m.ready = true;
                    m.observe_apply(secs);
                });
                tracing::info!(
                    generation,
                    tables = compiled.policy.tables.len(),
                    rules = compiled.policy.rule_count(),
                    apply_ms = secs * 1e3,
                    %summary,
                    "policy applied"
                );
                Ok(())
            }
            Err(e) => {
                self.update(|m| m.apply_errors += 1);
                Err(EnforceError::Apply(e))
            }
        }
    }

    /// Whether the host changed under the applied policy (bpf: the interface list), so the
    /// policy must be applied again.
    pub fn environment_changed(&self) -> bool {
        self.last_env.is_some() && self.last_env != Some(self.enforcer.environment())
    }

    /// Periodic upkeep: repair drift, refresh rule counters.
    pub fn maintain(&mut self) {
        match self.enforcer.repair() {
            Ok(n) if n > 0 => self.update(|m| m.drift_repairs += n as u64),
            Ok(_) => {}
            Err(e) => tracing::error!(error = %format!("{e:#}"), "drift repair failed"),
        }
        if let Ok(rules) = self.enforcer.counters() {
            self.update(|m| m.rules = rules);
        }
    }
}

/// Run until `stop` is set: apply the directory's policy whenever it changes.
pub fn run_dir(
    dir: &Path,
    engine: &mut Engine,
    interval: Duration,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let mut last = None;
    let mut pending = None;
    while !stop.load(Ordering::Relaxed) {
        let fp = fingerprint(dir).with_context(|| format!("reading {}", dir.display()))?;
        let env_changed = engine.environment_changed();
        // A change is read once the directory looked the same on two polls in a row, so a
        // file caught half-written by a non-atomic editor is not reported as invalid.
        let settled = pending.as_ref() == Some(&fp);
        if last.as_ref() != Some(&fp) && !settled {
            pending = Some(fp);
        } else if last.as_ref() != Some(&fp) || env_changed {
            if env_changed {
                tracing::info!("interfaces changed: re-applying");
            }
            match load::load_paths(&[dir.to_path_buf()]) {
                Ok(objs) => match engine.enforce(&objs) {
                    Ok(()) => {}
                    Err(EnforceError::Invalid(e)) => tracing::error!(
                        error = %e,
                        "invalid policy not applied; previous policy stays"
                    ),
                    Err(e) => {
                        tracing::error!(error = %e, "apply failed; previous policy stays")
                    }
                },
                Err(e) => {
                    engine.update(|m| m.invalid_policies += 1);
                    tracing::error!(error = %e, "invalid policy not applied; previous policy stays")
                }
            }
            last = Some(fp);
        } else {
            engine.maintain();
        }
        std::thread::sleep(interval);
    }
    tracing::info!("agent stopping; enforcement stays in place");
    Ok(())
}
