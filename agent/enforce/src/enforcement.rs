//! The enforcement every policy source shares ([`Enforcement`]: compile, apply through any
//! backend (`Box<dyn Backend>`, opened by `peerwall_backend_select::open`), metrics, logs). The
//! sources: the directory ([`crate::dir`]) and Kubernetes (`peerwall_kube::agent`, a crate
//! above this one).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;

use peerwall_backend::{Backend, BackendError, EventError, EventSource, HostInterface};
use peerwall_policy::compile;

mod bridge;
mod revoke;

pub use bridge::Loading;

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

/// Read `source` until the process ends, into the agent's metrics (`/events`, drop counts).
fn pump(mut source: Box<dyn EventSource>, metrics: crate::metrics::Shared) {
    if let Ok(mut m) = metrics.lock() {
        m.events.on = true;
    }
    let spawned = std::thread::Builder::new()
        .name("events".into())
        .spawn(move || loop {
            // Only this thread still holds the metrics: the enforcement is gone, so is its source.
            if std::sync::Arc::strong_count(&metrics) == 1 {
                return;
            }
            match source.next_batch(std::time::Duration::from_millis(500)) {
                Ok(batch) if batch.is_empty() => {}
                Ok(batch) => {
                    if let Ok(mut m) = metrics.lock() {
                        for e in batch {
                            m.events.push(e);
                        }
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "reading events failed; retrying in 1 s");
                    std::thread::sleep(std::time::Duration::from_secs(1));
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "could not start the event reader");
    }
}

/// How often the connection-tracking fill is read (`peerwall_conntrack_entries`).
pub const CONNTRACK_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// How often the rule counters are read (`peerwall_rule_packets_total`), and after every
/// apply: on nftables each read lists the ruleset (an `nft` process), which at every tick of
/// 50 gateways was most of a node's idle CPU; a scrape every 15 s or more sees no difference.
pub const COUNTERS_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// At most this many drop summaries (Kubernetes Events) per table and period.
pub const DROP_SUMMARY_PER_TABLE: usize = 5;

/// Why a set of objects was not enforced.
#[derive(Debug, thiserror::Error)]
pub enum EnforceError {
    /// Validation refused some objects; nothing was applied.
    #[error(transparent)]
    Invalid(#[from] compile::CompileError),
    /// The kernel refused the policy; the previous one stays.
    #[error(transparent)]
    Apply(#[from] BackendError),
    /// A configuration declares more AddressSets than are there yet; nothing was applied,
    /// the previous policy stays.
    #[error("{origin}: {why}; nothing applied, the previous policy stays in force")]
    WaitingForSlices {
        /// The configuration.
        origin: String,
        /// Which sets, how many declared and seen.
        why: String,
    },
}

/// A successful apply as [`Enforcement::record`] counted it.
struct Recorded {
    generation: u64,
    /// From the start of the change (its compilation) to the kernel's answer.
    secs: f64,
    /// When the change started, by the wall clock (RFC 3339): the kernel changed after it,
    /// and before the log line that reports it, so a reader of the log can bound the moment
    /// of the change even when the agent was paused before logging.
    started_at: String,
    summary: peerwall_backend::Report,
}

/// Compile-and-apply with metrics and logs: the part every policy source shares.
pub struct Enforcement {
    backend: Box<dyn Backend>,
    /// `--audit`: every table is enforced in audit mode, whatever its objects say.
    audit_all: bool,
    metrics: crate::metrics::Shared,
    generation: u64,
    last_env: Option<Vec<HostInterface>>,
    /// Compilation warnings already logged (logged again only when they change).
    warned: Vec<(peerwall_policy::ir::Origin, compile::Warning)>,
    /// What the backend said it does not enforce, as last logged (again only when it changes).
    backend_warned: Vec<String>,
    /// When the connection-tracking fill was last read.
    conntrack_read: Option<std::time::Instant>,
    /// When the rule counters were last read, and the policy generation they were read at.
    counters_read: Option<(std::time::Instant, u64)>,
    /// The policy in force, to judge which connections a change ends
    /// ([`crate::revoke`]).
    enforced: Option<peerwall_policy::ir::Policy>,
    /// A gateway's boot policy, kept in force until the policy holds its peer's table.
    boot: Option<Boot>,
    /// The datapath loading to take over from the backend in force ([`bridge`]).
    loading: Option<Loading>,
    /// The datapath a bridged start loaded failed to: the bridge enforces for good.
    load_failed: bool,
}

/// A gateway's boot policy ([`crate::protection::boot`]) as the enforcement keeps it.
pub struct Boot {
    /// The boot tables, compiled.
    policy: peerwall_policy::ir::Policy,
    /// The table whose presence in the policy supersedes them (the controller's table for
    /// the peer).
    superseded_by: String,
    /// The tunnel interfaces (for the bpf backend's release).
    tunnel: String,
    /// Released: the boot table is gone from the kernel and never comes back.
    released: bool,
    /// The backend was asked to hold it until it filters the tunnel
    /// ([`peerwall_backend::HoldBoot::hold_boot`]).
    held: bool,
}

/// A boot FirewallConfiguration ([`crate::protection::boot`]'s objects) compiled: what the
/// agent holds, `peerwall boot` and the CNI plugin put in force.
pub fn boot_policy(obj: serde_json::Value) -> anyhow::Result<peerwall_policy::ir::Policy> {
    let obj = peerwall_intent::load::object_from_json(obj, peerwall_intent::load::Group::Peerwall)
        .context("reading the boot policy")?;
    Ok(compile::compile(&[obj])
        .context("compiling the boot policy")?
        .policy)
}

impl Boot {
    /// Put this boot policy in force through `backend`, opened for this alone, now
    /// ([`peerwall_backend::HoldBoot::hold_boot_alone`]: only where nothing of peerwall's
    /// enforces yet), before an enforcement is opened (a bpf gateway waiting for its turn to
    /// load).
    /// Once that worked (held now, or peerwall's tables already enforce), the enforcement
    /// given this boot asks no backend again ([`Enforcement::hold_boot`]): its answer would be
    /// the same, at the cost of listing the ruleset once more.
    pub fn hold_in(
        &mut self,
        backend: &mut dyn peerwall_backend::HoldBoot,
    ) -> Result<bool, peerwall_backend::BackendError> {
        let held = backend.hold_boot_alone(&self.policy, &self.tunnel)?;
        self.held = true;
        Ok(held)
    }

    /// The boot policy of `peer`'s gateway (default tunnel and tunnel check).
    pub fn for_peer(peer: &str) -> anyhow::Result<Self> {
        let opts = crate::protection::boot::default_options();
        Ok(Self {
            policy: boot_policy(crate::protection::boot::boot_object(peer, &opts))?,
            superseded_by: crate::protection::table_name(peer),
            tunnel: opts.tunnel,
            released: false,
            held: false,
        })
    }
}

impl Enforcement {
    /// An enforcement over a backend, reporting into `metrics`.
    pub fn new(backend: Box<dyn Backend>, metrics: crate::metrics::Shared) -> Self {
        Self {
            backend,
            audit_all: false,
            metrics,
            generation: 0,
            last_env: None,
            warned: Vec::new(),
            backend_warned: Vec::new(),
            conntrack_read: None,
            counters_read: None,
            enforced: None,
            boot: None,
            loading: None,
            load_failed: false,
        }
    }

    /// Keep `boot` in force until the policy holds the table that supersedes it, then let it
    /// go in the same apply that puts that table in force (`--boot-peer`).
    pub fn with_boot(mut self, boot: Option<Boot>) -> Self {
        self.boot = boot;
        self
    }

    /// `policy`, with the boot tables while it does not hold the table superseding them.
    fn with_boot_tables<'a>(
        &self,
        policy: std::borrow::Cow<'a, peerwall_policy::ir::Policy>,
    ) -> std::borrow::Cow<'a, peerwall_policy::ir::Policy> {
        let Some(b) = self.boot.as_ref().filter(|b| !b.released) else {
            return policy;
        };
        if policy.tables.iter().any(|t| t.name == b.superseded_by) {
            return policy;
        }
        let mut p = policy.into_owned();
        p.tables.extend(b.policy.tables.iter().cloned());
        p.tables
            .sort_by(|x, y| (&x.name, x.family).cmp(&(&y.name, y.family)));
        std::borrow::Cow::Owned(p)
    }

    /// Before the first apply (as soon as the enforcer exists, and again before each apply
    /// until it worked): have the backend put the boot policy in force where nothing of
    /// peerwall's enforces yet ([`peerwall_backend::HoldBoot::hold_boot`]). Asked once; a
    /// failure is logged and asked again at the next apply.
    pub fn hold_boot(&mut self) {
        let Some(b) = self.boot.as_mut().filter(|b| !b.released && !b.held) else {
            return;
        };
        match self.backend.hold_boot(&b.policy, &b.tunnel) {
            Ok(held) => {
                b.held = true;
                if held {
                    tracing::info!(tunnel = %b.tunnel, "boot policy held in nftables until the datapath filters the tunnel");
                }
            }
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "could not hold the boot policy: a tunnel created before the datapath attaches to it is not filtered until then (retrying)")
            }
        }
    }

    /// Once the policy in force supersedes the boot tables: release them (bpf: once the
    /// tunnel is attached). Logged once.
    fn release_boot(&mut self) {
        let Some(b) = self.boot.as_mut().filter(|b| !b.released) else {
            return;
        };
        let superseded = self
            .enforced
            .as_ref()
            .is_some_and(|p| p.tables.iter().any(|t| t.name == b.superseded_by));
        if !superseded {
            return;
        }
        let table = b
            .policy
            .tables
            .first()
            .map(|t| t.name.clone())
            .unwrap_or_default();
        // The node's CNI chain's boot table too, where it put one in the pod's sandbox.
        let released = [table.as_str(), crate::protection::boot::NODE_BOOT_TABLE]
            .into_iter()
            .try_fold(true, |all, t| {
                Ok::<_, peerwall_backend::BackendError>(
                    self.backend.release_boot(t, &b.tunnel)? && all,
                )
            });
        match released {
            Ok(true) => {
                b.released = true;
                tracing::info!(boot = %table, by = %b.superseded_by, "boot policy released: the peer's gateway configuration is in force");
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "releasing the boot policy failed (retrying)")
            }
        }
    }

    /// Enforce every table in audit mode (`--audit`): drops and rejects become would-drops.
    pub fn audit_all(mut self, on: bool) -> Self {
        self.audit_all = on;
        self
    }

    /// Start reading the backend's events into the metrics and `/events`.
    pub fn start_events(&mut self) -> Result<(), EventError> {
        let source = self.backend.events()?;
        pump(source, self.metrics.clone());
        Ok(())
    }

    /// What the backend's events say was dropped since the last call
    /// ([`crate::events::EventLog::take_drop_summary`]).
    pub fn drop_summary(&self) -> Vec<crate::events::DropSummary> {
        self.metrics
            .lock()
            .map(|mut m| m.events.take_drop_summary(DROP_SUMMARY_PER_TABLE))
            .unwrap_or_default()
    }

    /// `policy` as enforced: with `--audit`, every table audited.
    fn as_enforced<'a>(
        &self,
        policy: &'a peerwall_policy::ir::Policy,
    ) -> std::borrow::Cow<'a, peerwall_policy::ir::Policy> {
        if !self.audit_all || policy.tables.iter().all(|t| t.audit) {
            return std::borrow::Cow::Borrowed(policy);
        }
        let mut p = policy.clone();
        for t in &mut p.tables {
            t.audit = true;
        }
        std::borrow::Cow::Owned(p)
    }

    /// Count a policy change refused by validation.
    pub fn count_invalid(&self) {
        self.update(|m| m.invalid_policies += 1);
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
        // Once per change, not once per apply: a pod churn re-applies many times a second.
        if compiled.warnings != self.warned {
            for (origin, w) in compiled
                .warnings
                .iter()
                .filter(|w| !self.warned.contains(w))
            {
                tracing::warn!(object = %origin, "{w}");
            }
            self.warned.clone_from(&compiled.warnings);
        }
        self.last_env = Some(self.backend.environment());
        self.hold_boot();
        let policy = self.with_boot_tables(self.as_enforced(&compiled.policy));
        let result = self.backend.apply(&policy);
        let r = self.record(result, started, false)?;
        tracing::info!(
            generation = r.generation,
            digest = %format!("{:016x}", compiled.policy.digest()),
            tables = compiled.policy.tables.len(),
            rules = compiled.policy.rule_count(),
            apply_ms = r.secs * 1e3,
            started_at = %r.started_at,
            summary = %r.summary,
            "policy applied"
        );
        self.end_revoked(&policy);
        self.release_boot();
        Ok(())
    }

    /// Count an apply's outcome in the metrics: on success the new generation, its latency,
    /// when it started and the backend's summary; on failure the error.
    fn record(
        &mut self,
        result: Result<peerwall_backend::Report, BackendError>,
        started: Instant,
        sets_only: bool,
    ) -> Result<Recorded, EnforceError> {
        match result {
            Ok(summary) => {
                // Once per change, not once per apply: a pod churn re-applies many times a
                // second.
                if summary.warnings != self.backend_warned {
                    for w in summary
                        .warnings
                        .iter()
                        .filter(|w| !self.backend_warned.contains(w))
                    {
                        tracing::warn!(backend = self.backend.name(), "{w}");
                    }
                    self.backend_warned.clone_from(&summary.warnings);
                }
                self.generation += 1;
                // The wall clock first: a pause between the two readings moves the start
                // earlier, never later than the kernel's change.
                let now = chrono::Utc::now();
                let took = started.elapsed();
                let secs = took.as_secs_f64();
                let started_at = now - chrono::TimeDelta::from_std(took).unwrap_or_default();
                let generation = self.generation;
                self.update(|m| {
                    m.generation = generation;
                    m.ready = true;
                    m.set_updates += u64::from(sets_only);
                    m.observe_apply(secs);
                });
                Ok(Recorded {
                    generation,
                    secs,
                    started_at: started_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                    summary,
                })
            }
            Err(e) => {
                self.update(|m| m.apply_errors += 1);
                Err(EnforceError::Apply(e))
            }
        }
    }

    /// Apply a policy that differs from the one in force only by `changes` (address slices
    /// merged in place, [`peerwall_policy::sliced::Sliced`]): the backend changes just those
    /// set elements. On error nothing changes and the caller falls back to a full apply.
    pub fn update_sets(
        &mut self,
        policy: &peerwall_policy::ir::Policy,
        changes: &[peerwall_policy::ir::SetChange],
        started: Instant,
    ) -> Result<(), EnforceError> {
        if changes.is_empty() {
            return Ok(());
        }
        let policy = self.with_boot_tables(self.as_enforced(policy));
        let backend_started = Instant::now();
        let result = self.backend.update_sets(&policy, changes);
        let backend_secs = backend_started.elapsed().as_secs_f64();
        let r = self.record(result, started, true)?;
        tracing::debug!(
            generation = r.generation,
            sets = changes.len(),
            apply_ms = r.secs * 1e3,
            started_at = %r.started_at,
            backend_ms = backend_secs * 1e3,
            summary = %r.summary,
            "set elements updated"
        );
        self.end_revoked(&policy);
        Ok(())
    }

    /// Whether the host changed under the applied policy (bpf: the interface list), so the
    /// policy must be applied again.
    pub fn environment_changed(&self) -> bool {
        self.last_env.is_some() && self.last_env != Some(self.backend.environment())
    }

    /// Whether the emergency switch was on at the last upkeep (or apply).
    pub fn switch_on(&self) -> bool {
        self.metrics.lock().map(|m| m.allow_all).unwrap_or(false)
    }

    /// Whether the policy source answers (the Kubernetes watches); `/readyz` fails while not.
    pub fn set_source_connected(&self, connected: bool) {
        self.update(|m| m.source_down = !connected);
    }

    /// Periodic upkeep: repair drift, refresh rule counters, release the boot policy.
    pub fn maintain(&mut self) {
        self.release_boot();
        match self.backend.repair() {
            Ok(fixed) if !fixed.is_empty() => {
                tracing::warn!(drift = ?fixed, "drift repaired");
                self.update(|m| m.drift_repairs += fixed.len() as u64);
            }
            Ok(_) => {}
            Err(e) => tracing::error!(error = %format!("{e:#}"), "drift repair failed"),
        }
        let generation = self.metrics.lock().map(|m| m.generation).unwrap_or(0);
        if self
            .counters_read
            .is_none_or(|(t, g)| g != generation || t.elapsed() >= COUNTERS_EVERY)
        {
            self.counters_read = Some((std::time::Instant::now(), generation));
            if let Ok(rules) = self.backend.counters() {
                self.update(|m| m.rules = rules);
            }
        }
        // Counting the bpf flow table walks its keys: every CONNTRACK_EVERY at most.
        if self
            .conntrack_read
            .is_none_or(|t| t.elapsed() >= CONNTRACK_EVERY)
        {
            self.conntrack_read = Some(std::time::Instant::now());
            match self.backend.conntrack() {
                Ok(fill) => self.update(|m| m.conntrack = fill),
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "reading the flow table failed")
                }
            }
        }
        if let Ok(on) = self.backend.allow_all() {
            let was = self.metrics.lock().map(|m| m.allow_all).unwrap_or(on);
            if on != was {
                tracing::warn!(
                    allow_all = on,
                    "emergency switch flipped: enforcement is {}",
                    if on { "OFF" } else { "back on" }
                );
            }
            self.update(|m| m.allow_all = on);
        }
    }
}
