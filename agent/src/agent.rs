//! `peerwall agent --source dir:PATH`: keep a directory of FirewallConfiguration YAML enforced.
//!
//! The directory is polled; when its contents change, every object is loaded, validated and
//! compiled into one policy and applied through the chosen backend. An invalid change is
//! logged and not applied: the last good policy stays in force. The nftables backend's drift
//! check runs on every tick and repairs tables someone deleted or edited.
//! (The Kubernetes source, status, metrics and health endpoints are the agent issue's.)

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;

use crate::api::load;
use crate::backend::bpf::{compile::Iface, loader};
use crate::backend::nftables::{Nft, NftBackend};
use crate::compile;

/// Where policies come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicySource {
    /// A directory of YAML files.
    Dir(PathBuf),
}

impl std::str::FromStr for PolicySource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            Some(("dir", p)) if !p.is_empty() => Ok(PolicySource::Dir(PathBuf::from(p))),
            _ => Err(format!(
                "{s:?} is not a policy source (use dir:PATH; the Kubernetes source is not built yet)"
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
}

impl Enforcer {
    fn apply(&mut self, policy: &crate::ir::Policy) -> anyhow::Result<String> {
        match self {
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
            Enforcer::Nft(_) => Vec::new(),
            Enforcer::Bpf { .. } => loader::host_ifaces()
                .map(|v| v.into_iter().map(|i| (i.name, i.ifindex)).collect())
                .unwrap_or_default(),
        }
    }

    /// Restore drifted tables; returns how many.
    fn repair(&mut self) -> anyhow::Result<usize> {
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
    fn counters(&mut self) -> anyhow::Result<Vec<crate::backend::nftables::RuleCounter>> {
        Ok(match self {
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

/// Build the enforcer for a backend name.
pub fn enforcer(
    backend: &str,
    pin_dir: &Path,
    patterns: Vec<String>,
    xdp: bool,
) -> anyhow::Result<Enforcer> {
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

/// Run until `stop` is set: apply the directory's policy whenever it changes.
pub fn run(
    source: &PolicySource,
    mut enforcer: Enforcer,
    interval: Duration,
    stop: Arc<AtomicBool>,
    metrics: crate::metrics::Shared,
) -> anyhow::Result<()> {
    let update = |f: &mut dyn FnMut(&mut crate::metrics::AgentMetrics)| {
        if let Ok(mut m) = metrics.lock() {
            f(&mut m);
        }
    };
    let PolicySource::Dir(dir) = source;
    let mut last = None;
    let mut last_env = None;
    let mut generation = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let fp = fingerprint(dir).with_context(|| format!("reading {}", dir.display()))?;
        let env = enforcer.environment();
        if last.as_ref() != Some(&fp) || last_env.as_ref() != Some(&env) {
            if last_env.is_some() && last_env.as_ref() != Some(&env) {
                tracing::info!("interfaces changed: re-applying");
            }
            last_env = Some(env);
            let started = Instant::now();
            match load::load_paths(std::slice::from_ref(dir))
                .map_err(anyhow::Error::from)
                .and_then(|objs| compile::compile(&objs).map_err(anyhow::Error::from))
            {
                Ok(compiled) => {
                    for (origin, w) in &compiled.warnings {
                        tracing::warn!(object = %origin, "{w}");
                    }
                    match enforcer.apply(&compiled.policy) {
                        Ok(summary) => {
                            generation += 1;
                            let secs = started.elapsed().as_secs_f64();
                            update(&mut |m| {
                                m.generation = generation;
                                m.ready = true;
                                m.observe_apply(secs);
                            });
                            tracing::info!(
                                generation,
                                tables = compiled.policy.tables.len(),
                                rules = compiled.policy.rule_count(),
                                apply_ms = started.elapsed().as_secs_f64() * 1e3,
                                %summary,
                                "policy applied"
                            );
                        }
                        Err(e) => {
                            update(&mut |m| m.apply_errors += 1);
                            tracing::error!(error = %format!("{e:#}"), "apply failed; previous policy stays")
                        }
                    }
                }
                Err(e) => {
                    update(&mut |m| m.invalid_policies += 1);
                    tracing::error!(error = %e, "invalid policy not applied; previous policy stays")
                }
            }
            last = Some(fp);
        } else {
            match enforcer.repair() {
                Ok(n) if n > 0 => update(&mut |m| m.drift_repairs += n as u64),
                Ok(_) => {}
                Err(e) => tracing::error!(error = %format!("{e:#}"), "drift repair failed"),
            }
        }
        if let Ok(rules) = enforcer.counters() {
            update(&mut |m| m.rules = rules.clone());
        }
        std::thread::sleep(interval);
    }
    tracing::info!("agent stopping; enforcement stays in place");
    Ok(())
}
