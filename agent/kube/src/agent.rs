//! `peerwall agent --source kube`: enforce the FirewallConfigurations a label selector picks.
//!
//! A reflector keeps the selected objects; every change (debounced) starts a *round*:
//! 1. [`plan`] (pure): each object is decoded and validated with [`super::check`]; valid objects
//!    are enforced, an invalid object keeps its last good spec in force (or none), objects being
//!    deleted are left out.
//! 2. The whole set is compiled into one policy and applied by the [`Enforcement`] (one nft
//!    transaction, or one bpf map sync). Objects the compiler refuses together (two objects
//!    claiming one table) are left out and reported.
//! 3. Each object gets this host's condition (`Applied` or `Error` with the message) through
//!    server-side apply of its status (field manager `peerwall-agent-<host>`; the CRD keys the
//!    conditions by `host`, so agents on several hosts never overwrite each other), an Event on
//!    every transition, and this host's finalizer: it is removed once the object's table is gone
//!    from the kernel.
//!
//! Between rounds the enforcement repairs drift (nftables) and follows new interfaces (bpf).
//!
//! Opt-in (`--liqo-selector`): Liqo's own FirewallConfigurations (`networking.liqo.io`) picked
//! by that selector are enforced too, read only: peerwall writes no status, finalizer or label
//! on Liqo's objects (errors go to the log).

// size: the agent's Kubernetes edge: watches, rounds, conditions, finalizers and drop-summary
// Events around one Agent; its pure decisions are in plan.rs and slices.rs.

mod admit;
mod plan;
mod report;
mod slices;

pub use plan::{
    controllers_key, finalizer, plan, reserved_table, settle, Good, Observed, Outcome, Plan,
    Settled, SWITCH_ON_MESSAGE,
};
pub use slices::{SliceObserved, Slices};

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::recorder::Recorder;
use anyhow::Context;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DynamicObject, ListParams, ObjectMeta, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Reporter};
use kube::runtime::reflector;
use kube::Resource;
use serde_json::json;
use tracing::Instrument;

use crate::enforcement::Enforcement;
use crate::watched::{Answer, ConfigObject, SliceObject, Watched};
use peerwall_intent::load::Group;
use peerwall_intent::types::{ConditionType, FirewallConfigurationStatusCondition};
use peerwall_policy::compile::PolicyObject;
use peerwall_policy::sliced::{SliceIssue, Sliced};

/// Settings of the Kubernetes source.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Label selector of peerwall's FirewallConfigurations to enforce.
    pub selector: String,
    /// Opt-in: label selector of Liqo's FirewallConfigurations to enforce too (read only).
    pub liqo_selector: Option<String>,
    /// Label selectors of Liqo's FirewallConfigurations Liqo's own firewall controller keeps in
    /// force where this agent enforces: read only, for the NAT the datapath must see through.
    pub observe: Vec<String>,
    /// The Liqo entity whose firewall this agent stands beside (its gateway pod): where the
    /// cluster serves Liqo's FirewallConfigurationBindings, Liqo's objects (`liqo_selector`,
    /// `observe`) count only while a live binding names them and this target
    /// ([`peerwall_intent::binding`]).
    pub liqo_target: Option<peerwall_intent::binding::Target>,
    /// This host's name (condition `host`, finalizer, field manager).
    pub host: String,
    /// Drift-check period.
    pub interval: Duration,
    /// Label selector of the objects this agent answers for when it releases stale
    /// finalizers (gateway mode: its peer's; several agents share one host name there).
    pub scope: Option<String>,
    /// With events: every period, an Event on each object whose rules dropped packets ("dropped
    /// N packets from A to B by rule R in the last …"), at most five per object.
    pub drop_summary: Option<Duration>,
    /// Which namespaces steer this agent's gateways, and whether their objects may change
    /// packets ([`super::trust`]). Liqo's own objects (`--liqo-selector`, `--observe`) are
    /// Liqo's to trust and not subject to it.
    pub trust: super::trust::Trust,
}

/// This host's condition in `obj`'s status, if it has one that reads as a condition.
fn current_condition<S>(
    obj: &Watched<S>,
    host: &str,
) -> Option<FirewallConfigurationStatusCondition> {
    let conditions = obj.status.as_ref()?.pointer("/conditions")?.as_array()?;
    conditions
        .iter()
        .filter_map(|c| {
            serde_json::from_value::<FirewallConfigurationStatusCondition>(c.clone()).ok()
        })
        .find(|c| c.host == host)
}

struct Agent {
    /// peerwall's FirewallConfigurations, answers read without their spec.
    api: Api<Answer>,
    recorder: Recorder,
    settings: Settings,
    finalizer: String,
    manager: String,
    last_good: BTreeMap<String, Good>,
    reported: BTreeMap<String, Outcome>,
    enforced: Option<Vec<PolicyObject>>,
    /// Decoded and validated specs by key, for the `(uid, generation)` they were checked at:
    /// rounds triggered by status, finalizer or label updates (the generation does not move)
    /// do not decode and validate large objects again.
    checks: BTreeMap<String, (String, i64, Result<PolicyObject, String>)>,
    /// The last whole-policy compilation and the plan it was made for.
    settled: Option<(BTreeMap<String, PolicyObject>, Settled)>,
    /// The AddressSets watched, checked.
    slices: Slices,
    /// The compiled policy with the slices merged: what is in force after a successful round.
    sliced: Option<Sliced>,
    /// Valid slices that could not be merged, with why.
    slice_issues: BTreeMap<peerwall_intent::Origin, SliceIssue>,
    /// The emergency switch as the last round reported it in the conditions.
    switch_reported: bool,
    /// Objects ignored because their namespace may not steer this gateway: the reason, by key
    /// and `(uid, generation)` (one warning Event per change).
    ignored: BTreeMap<String, (String, i64, String)>,
    /// The enforcement's backend, reported in the conditions.
    backend: &'static str,
    /// After a failed apply: when to try the round again, and the wait that led there
    /// (doubling up to [`RETRY_MAX`]). Nothing else would start a round until the API changes.
    retry: Option<(std::time::Instant, Duration)>,
    /// Conditions being written in the background.
    writer: report::Writer,
}

/// Longest wait between two attempts at a failing apply.
const RETRY_MAX: Duration = Duration::from_secs(30);

/// How long a round waits after the first event for more to arrive.
const DEBOUNCE: Duration = Duration::from_millis(1);

/// How often a gateway whose datapath loads meanwhile (its policy in force through nftables)
/// looks whether the load is done.
const LOAD_POLL: Duration = Duration::from_millis(20);

/// Prefix of AddressSet keys in the agent's maps (distinct from FirewallConfiguration keys).
const SLICE_KEY_PREFIX: &str = "AddressSet ";

/// Key of an AddressSet in the agent's maps.
fn slice_report_key(key: &str) -> String {
    format!("{SLICE_KEY_PREFIX}{key}")
}

impl Agent {
    async fn round(
        &mut self,
        enforcement: &mut Enforcement,
        objects: Vec<Arc<ConfigObject>>,
        slice_objects: Vec<Arc<SliceObject>>,
        tenants: &super::trust::Tenants,
    ) {
        let started = std::time::Instant::now();
        self.switch_reported = enforcement.switch_on();
        let objects = self.admit(objects, tenants, &super::fwc_resource()).await;
        let slice_objects = self
            .admit(slice_objects, tenants, &super::address_set_resource())
            .await;
        let slice_changes = self.observe_slices(&slice_objects);
        let observed = self.observe(&objects);
        let mut p = plan(&observed, &mut self.last_good);
        plan::hold_incomplete(&mut p, &observed, &self.slices.counts(), &self.last_good);
        let settled = self.settle(&mut p);
        let desired: Vec<PolicyObject> = p.enforce.values().cloned().collect();
        let result = self.enforce(enforcement, &desired, &settled.1, &slice_changes, started);
        self.settled = Some(settled);
        self.remember(&result, desired, &observed, &p);
        self.report_slices(&slice_objects, &result).await;
        self.report_objects(&objects, &observed, &p, &result).await;
    }

    /// The AddressSets as this round sees them (each checked once per generation), and the
    /// slices that changed.
    fn observe_slices(
        &mut self,
        slice_objects: &[Arc<SliceObject>],
    ) -> Vec<(
        peerwall_intent::Origin,
        Option<peerwall_policy::sliced::CheckedSlice>,
    )> {
        let slice_obs: Vec<SliceObserved> = slice_objects
            .iter()
            .map(|o| {
                let key = super::key_of(o);
                let uid = o.metadata.uid.clone().unwrap_or_default();
                let generation = o.metadata.generation.unwrap_or_default();
                let checked = self
                    .slices
                    .needs_check(&key, &uid, generation)
                    .then(|| super::check_slice(o).map_err(|e| e.to_string()));
                SliceObserved {
                    key,
                    uid,
                    generation,
                    checked,
                }
            })
            .collect();
        self.slices.observe(slice_obs)
    }

    /// The FirewallConfigurations as this round sees them, each checked (once per generation).
    fn observe(&mut self, objects: &[Arc<ConfigObject>]) -> Vec<Observed> {
        let observed: Vec<Observed> = objects
            .iter()
            .map(|o| Observed {
                key: super::key_of(o),
                uid: o.metadata.uid.clone().unwrap_or_default(),
                generation: o.metadata.generation.unwrap_or_default(),
                deleting: o.metadata.deletion_timestamp.is_some(),
                checked: self.check(o),
            })
            .collect();
        self.checks
            .retain(|k, _| observed.iter().any(|o| &o.key == k));
        observed
    }

    /// The plan's specs compiled, refusals marked: compiled again only when the specs to
    /// enforce changed since the last round.
    fn settle(&mut self, p: &mut Plan) -> (BTreeMap<String, PolicyObject>, Settled) {
        if let Some((input, s)) = self.settled.take() {
            if input == p.enforce {
                s.mark(p);
                return (input, s);
            }
            // Only inline set elements changed (a NetworkPolicy tier after a pod relabel):
            // those sets parsed alone and patched into what was compiled, not the whole
            // object compiled again (tens of milliseconds at 20,000 addresses).
            if s.refused.is_empty() && input.keys().eq(p.enforce.keys()) {
                let new: Vec<&PolicyObject> = p.enforce.values().collect();
                let patched = peerwall_intent::elements::inline_element_changes(
                    input.values(),
                    new.iter().copied(),
                )
                .and_then(|sets| peerwall_policy::compile::patch_elements(s.compiled, &new, &sets));
                if let Some(compiled) = patched {
                    let settled = Settled {
                        refused: Vec::new(),
                        compiled,
                    };
                    return (p.enforce.clone(), settled);
                }
            }
        }
        let input = p.enforce.clone();
        let s = settle(p, &self.last_good);
        (input, s)
    }

    /// Put `desired` in force: only set elements in place (O(changes)) when the rules and the
    /// host are unchanged (the slices' elements, and inline elements that alone changed), else
    /// the whole policy with every slice merged.
    fn enforce(
        &mut self,
        enforcement: &mut Enforcement,
        desired: &[PolicyObject],
        settled: &Settled,
        slice_changes: &[(
            peerwall_intent::Origin,
            Option<peerwall_policy::sliced::CheckedSlice>,
        )],
        started: std::time::Instant,
    ) -> Result<(), crate::enforcement::EnforceError> {
        // Objects that changed only inline set elements (a NetworkPolicy tier after a pod
        // relabel) are edited in place like slices; anything else applies the whole policy.
        let inline = match (self.sliced.as_mut(), self.enforced.as_deref()) {
            (Some(sliced), Some(old)) if !enforcement.environment_changed() => {
                peerwall_intent::elements::inline_element_changes(old, desired).and_then(|sets| {
                    if sets.is_empty() {
                        Some(Vec::new())
                    } else {
                        sliced.replace_inline(&settled.compiled, &sets)
                    }
                })
            }
            _ => None,
        };
        match (self.sliced.as_mut(), inline) {
            (Some(sliced), Some(mut changes)) => {
                for (origin, slice) in slice_changes {
                    let (c, issue) = sliced.update(origin, slice.as_ref());
                    changes.extend(c);
                    match issue {
                        Some(i) => self.slice_issues.insert(origin.clone(), i),
                        None => self.slice_issues.remove(origin),
                    };
                }
                let sliced = &*sliced;
                tokio::task::block_in_place(|| {
                    enforcement
                        .update_sets(sliced.policy(), &changes, started)
                        .or_else(|e| {
                            tracing::warn!(error = %e, "set update failed; applying the whole policy");
                            enforcement.apply_compiled(sliced.compiled(), started)
                        })
                })
            }
            (_, _) => {
                let (sliced, issues) = Sliced::new(settled.compiled.clone(), &self.slices.merged());
                self.slice_issues = issues;
                let r = tokio::task::block_in_place(|| {
                    enforcement.apply_compiled(sliced.compiled(), started)
                });
                self.sliced = Some(sliced);
                r
            }
        }
    }

    /// After the apply: what is in force and each object's last good spec, or, on failure,
    /// nothing known (the next round applies everything again).
    fn remember(
        &mut self,
        result: &Result<(), crate::enforcement::EnforceError>,
        desired: Vec<PolicyObject>,
        observed: &[Observed],
        p: &Plan,
    ) {
        match result {
            Ok(()) => {
                self.retry = None;
                self.enforced = Some(desired);
                for o in observed {
                    if p.current.contains(&o.key) {
                        if let Ok(obj) = &o.checked {
                            self.last_good.insert(
                                o.key.clone(),
                                Good {
                                    uid: o.uid.clone(),
                                    generation: o.generation,
                                    object: obj.clone(),
                                },
                            );
                        }
                    }
                }
            }
            Err(e) => {
                self.enforced = None;
                self.sliced = None;
                let wait = self
                    .retry
                    .map_or(self.settings.interval.max(DEBOUNCE), |(_, w)| {
                        (w * 2).min(RETRY_MAX)
                    });
                self.retry = Some((std::time::Instant::now() + wait, wait));
                tracing::error!(error = %e, retry_in_ms = wait.as_millis() as u64, "apply failed; previous policy stays")
            }
        }
    }

    /// This host's condition on every FirewallConfiguration ([`plan::outcome`]), finalizers
    /// kept or released; written together once decided (a first round on a host writes one
    /// per object: concurrently, not one after the other).
    async fn report_objects(
        &mut self,
        objects: &[Arc<ConfigObject>],
        observed: &[Observed],
        p: &Plan,
        result: &Result<(), crate::enforcement::EnforceError>,
    ) {
        let by_key: BTreeMap<String, &Arc<ConfigObject>> =
            objects.iter().map(|o| (super::key_of(o), o)).collect();
        let apply_error = result.as_ref().err().map(ToString::to_string);
        let mut pending = Vec::new();
        for o in observed {
            let Some(obj) = by_key.get(&o.key) else {
                continue;
            };
            if super::group_of(obj) == Group::Liqo {
                // Liqo's objects are never written to: errors only reach the log.
                if let Some(msg) = p.refused.get(&o.key) {
                    tracing::warn!(object = %o.key, error = %msg, "Liqo FirewallConfiguration not enforced");
                }
                continue;
            }
            if o.deleting {
                if result.is_ok() {
                    self.release(&obj.metadata, &o.key).await;
                }
                continue;
            }
            self.ensure_finalizer(&obj.metadata, &o.key).await;
            let outcome = plan::outcome(
                p.refused.get(&o.key).map(String::as_str),
                apply_error.as_deref(),
                self.switch_reported,
                o.generation,
            );
            let key = super::key_of(obj);
            pending.extend(self.prepare_report(obj, outcome, &key, &super::fwc_resource()));
        }
        self.send_reports(pending).await;
        self.reported.retain(|k, _| {
            k.starts_with(SLICE_KEY_PREFIX)
                || by_key
                    .get(k)
                    .is_some_and(|o| o.metadata.deletion_timestamp.is_none())
        });
    }

    /// This host's condition on every AddressSet: `Applied` (its addresses are in force at its
    /// generation) or `Error` (invalid, not mergeable, or the apply failed).
    async fn report_slices(
        &mut self,
        slice_objects: &[Arc<SliceObject>],
        result: &Result<(), crate::enforcement::EnforceError>,
    ) {
        let present: std::collections::BTreeSet<String> = slice_objects
            .iter()
            .map(|o| slice_report_key(&super::key_of(o)))
            .collect();
        self.reported
            .retain(|k, _| !k.starts_with(SLICE_KEY_PREFIX) || present.contains(k));
        let mut pending = Vec::new();
        for obj in slice_objects {
            if obj.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let key = super::key_of(obj);
            let generation = obj.metadata.generation.unwrap_or_default();
            let issue = self
                .slice_issues
                .get(&peerwall_intent::Origin(key.clone()))
                .map(ToString::to_string);
            let message = match (self.slices.invalid(&key), issue, result) {
                (Some(m), _, _) => Some(m),
                (None, Some(i), _) => Some(format!("{i} (not applied)")),
                (None, None, Err(e)) => Some(format!("apply failed: {e}")),
                (None, None, Ok(())) => None,
            };
            let outcome = Outcome {
                kind: if message.is_some() {
                    ConditionType::Error
                } else {
                    ConditionType::Applied
                },
                message,
                generation,
            };
            pending.extend(self.prepare_report(
                obj,
                outcome,
                &slice_report_key(&key),
                &super::address_set_resource(),
            ));
        }
        self.send_reports(pending).await;
    }

    /// [`super::check`] of an object, reused while its uid and generation stay the same
    /// ([`super::check_since`] the version before).
    fn check(&mut self, o: &ConfigObject) -> Result<PolicyObject, String> {
        let key = super::key_of(o);
        let uid = o.metadata.uid.clone().unwrap_or_default();
        let generation = o.metadata.generation.unwrap_or_default();
        if let Some((u, g, r)) = self.checks.get(&key) {
            if *u == uid && *g == generation && generation != 0 {
                return r.clone();
            }
        }
        // The last version that passed, for a change of set elements only.
        let prior = self
            .checks
            .get(&key)
            .filter(|(u, _, _)| *u == uid)
            .and_then(|(_, _, r)| r.as_ref().ok());
        let r = super::check_since(o, prior)
            .map_err(|e| e.to_string())
            .and_then(|po| {
                // Liqo's objects are Liqo's: its own controller applies their NAT anyway.
                if super::group_of(o) == Group::Liqo {
                    return Ok(po);
                }
                self.settings.trust.allows_changes(&po.spec)?;
                Ok(po)
            });
        self.checks.insert(key, (uid, generation, r.clone()));
        r
    }

    /// One Warning Event per drop summary on the object of its table (audit: Normal).
    async fn publish_drops(
        &self,
        objects: &[Arc<ConfigObject>],
        drops: Vec<crate::events::DropSummary>,
        period: Duration,
    ) {
        for d in drops {
            let Some(obj) = objects
                .iter()
                .find(|o| o.table_name().as_deref() == Some(d.table.as_str()))
            else {
                continue;
            };
            let (type_, reason, did) = match d.verdict {
                "audit" => (EventType::Normal, "WouldDrop", "would have dropped"),
                "reject" => (EventType::Warning, "Rejected", "rejected"),
                _ => (EventType::Warning, "Dropped", "dropped"),
            };
            let ev = Event {
                type_,
                reason: reason.into(),
                note: Some(format!(
                    "{}: {did} {} packets from {} to {} by rule {}/{}/{} in the last {} s",
                    self.settings.host,
                    d.packets,
                    d.src,
                    d.dst,
                    d.table,
                    d.chain,
                    d.rule,
                    period.as_secs()
                )),
                action: "Enforce".into(),
                secondary: None,
            };
            let r = self
                .recorder
                .publish(&ev, &obj.object_ref(&super::fwc_resource()))
                .await;
            if let Err(e) = r {
                tracing::warn!(table = %d.table, error = %e, "could not publish a drop event");
            }
        }
    }

    fn namespaced(&self, meta: &ObjectMeta) -> Api<Answer> {
        Api::namespaced_with(
            self.api.clone().into_client(),
            meta.namespace.as_deref().unwrap_or("default"),
            &super::fwc_resource(),
        )
    }

    /// Set `metadata.finalizers` to `list` (merge patch guarded by the resourceVersion, so a
    /// concurrent change by someone else is not overwritten; the next round retries).
    async fn set_finalizers(&self, meta: &ObjectMeta, key: &str, list: Vec<String>) {
        let body = json!({ "metadata": {
            "finalizers": list,
            "resourceVersion": meta.resource_version,
        }});
        let name = meta.name.clone().unwrap_or_default();
        if let Err(e) = self
            .namespaced(meta)
            .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            tracing::debug!(object = %key, error = %e, "finalizer update deferred");
        }
    }

    async fn ensure_finalizer(&self, meta: &ObjectMeta, key: &str) {
        let list = meta.finalizers.clone().unwrap_or_default();
        if !list.contains(&self.finalizer) {
            let mut list = list;
            list.push(self.finalizer.clone());
            self.set_finalizers(meta, key, list).await;
        }
    }

    /// Objects that carry this host's finalizer but no longer match the selector (it changed
    /// between runs, or their labels did) are not enforced here any more: release them, or
    /// their deletion would hang forever.
    async fn release_unselected(&self, selected: &reflector::Store<ConfigObject>) {
        // From the watch cache, as the watches list (`super::watch_config`); metadata only.
        let lp = match &self.settings.scope {
            Some(sel) => ListParams::default().labels(sel),
            None => ListParams::default(),
        }
        .match_any();
        let all = match self.api.list_metadata(&lp).await {
            Ok(l) => l.items,
            Err(e) => {
                tracing::warn!(error = %e, "could not list FirewallConfigurations to release stale finalizers");
                return;
            }
        };
        for obj in all {
            let meta = &obj.metadata;
            let mine = meta
                .finalizers
                .as_ref()
                .is_some_and(|f| f.contains(&self.finalizer));
            // peerwall's objects (the resource listed): keyed as `key_of` keys them.
            let key = Group::Peerwall.origin(
                meta.namespace.as_deref().unwrap_or_default(),
                meta.name.as_deref().unwrap_or_default(),
            );
            let still_selected = selected.state().iter().any(|o| super::key_of(o) == key);
            if mine && !still_selected {
                tracing::info!(object = %key, "no longer selected here; releasing finalizer");
                self.set_finalizers(
                    meta,
                    &key,
                    meta.finalizers
                        .clone()
                        .unwrap_or_default()
                        .into_iter()
                        .filter(|f| *f != self.finalizer)
                        .collect(),
                )
                .await;
            }
        }
    }

    async fn release(&self, meta: &ObjectMeta, key: &str) {
        let list = meta.finalizers.clone().unwrap_or_default();
        if list.contains(&self.finalizer) {
            tracing::info!(object = %key, "table removed; releasing finalizer");
            self.set_finalizers(
                meta,
                key,
                list.into_iter().filter(|f| *f != self.finalizer).collect(),
            )
            .await;
        }
    }
}

/// `obj` with its `apiVersion` set to `group`'s (list items may come without it), so that its
/// key and decoding follow its group.
fn tagged(obj: Arc<ConfigObject>, group: Group) -> Arc<ConfigObject> {
    if obj.types.is_some() {
        return obj;
    }
    let mut o = (*obj).clone();
    let r = super::resource_of(group);
    o.types = Some(kube::api::TypeMeta {
        api_version: r.api_version,
        kind: r.kind,
    });
    Arc::new(o)
}

/// Run the Kubernetes source until `stop` is set.
pub fn run(
    settings: Settings,
    enforcement: &mut Enforcement,
    stop: Arc<crate::shutdown::Shutdown>,
) -> anyhow::Result<()> {
    let rt = super::runtime()?;
    rt.block_on(async move {
        let client = super::client().await?;
        let changed = Arc::new(super::Changes::default());
        let watches = Watches::start(&client, &settings, &changed).await?;
        serve(client, changed, watches, settings, enforcement, stop).await
    })
}

/// [`run`] with the enforcer opened by `open` on this thread *while* the watches make their
/// first lists: a gateway's datapath load (maps, verifier: this node's CPUs) and its policy
/// source's listing (a round trip to the API server) overlap, so the first apply follows
/// whichever ends last, not their sum (`cargo xtask bench-peers`). `open` puts the boot policy
/// in force itself where one is held: nothing is applied before it returns.
pub fn run_opening(
    settings: Settings,
    open: impl FnOnce() -> anyhow::Result<Enforcement>,
    stop: Arc<crate::shutdown::Shutdown>,
) -> anyhow::Result<()> {
    let rt = super::runtime()?;
    let changed = Arc::new(super::Changes::default());
    let started = std::time::Instant::now();
    let listing = {
        let (settings, changed) = (settings.clone(), changed.clone());
        let span = tracing::Span::current();
        rt.spawn(
            async move {
                let client = super::client().await?;
                let watches = Watches::start(&client, &settings, &changed).await?;
                let ms = started.elapsed().as_secs_f64() * 1e3;
                tracing::debug!(ms, "the policy source listed");
                anyhow::Ok((client, watches))
            }
            .instrument(span),
        )
    };
    // On this thread, outside the runtime: its workers drive the listing meanwhile. Opened
    // (its boot policy held) whatever becomes of the listing.
    let mut enforcement = open()?;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    tracing::debug!(
        ms,
        "the enforcer opened, beside the policy source's listing"
    );
    rt.block_on(async move {
        let (client, watches) = listing
            .await
            .context("the policy source's first listing stopped")??;
        serve(client, changed, watches, settings, &mut enforcement, stop).await
    })
}

/// The agent's rounds, once the enforcer is open and the watches have listed: until `stop`.
async fn serve(
    client: kube::Client,
    changed: Arc<super::Changes>,
    mut watches: Watches,
    settings: Settings,
    enforcement: &mut Enforcement,
    stop: Arc<crate::shutdown::Shutdown>,
) -> anyhow::Result<()> {
    let api = Api::all_with(client.clone(), &super::fwc_resource());
    let mut agent = Agent::new(client, api, settings, enforcement.backend_name());
    // Stale finalizers are released after the first round: their list is no reason to
    // keep a new gateway behind its boot policy one more round trip.
    let mut released = false;
    let mut dirty = true;
    let mut summarized = std::time::Instant::now();
    let mut maintained = std::time::Instant::now();
    while !stop.is_set() {
        // A bridged start: the loaded datapath takes over from nftables (the policy in force
        // applied by it first).
        if enforcement.loading() {
            tokio::task::block_in_place(|| enforcement.take_over());
            // The conditions say which enforces (`nftables (bpf loading)`, then `bpf`).
            if enforcement.backend_name() != agent.backend {
                agent.backend = enforcement.backend_name();
                dirty = true;
            }
        }
        if let Some(period) = agent.settings.drop_summary {
            if summarized.elapsed() >= period {
                summarized = std::time::Instant::now();
                agent
                    .publish_drops(&watches.configs.state(), enforcement.drop_summary(), period)
                    .await;
            }
        }
        let retry_due = agent
            .retry
            .is_some_and(|(at, _)| std::time::Instant::now() >= at);
        if dirty || retry_due || enforcement.environment_changed() {
            // Debounce: let a burst of events settle into one round (short: a round that
            // only moves slices costs O(changes)).
            tokio::time::sleep(DEBOUNCE).await;
            agent
                .round(
                    enforcement,
                    watches.objects(),
                    watches.slices(),
                    &watches.tenants(),
                )
                .await;
            if !released {
                agent.release_unselected(&watches.configs).await;
                released = true;
            }
        } else if !enforcement.loading() || maintained.elapsed() >= agent.settings.interval {
            // Once per interval while a datapath loads too, not at every look at it
            // (`LOAD_POLL`): the bridge's drift check lists its tables, and a node's start
            // has many gateways bridged at once on CPUs their loads need.
            maintained = std::time::Instant::now();
            tokio::task::block_in_place(|| enforcement.maintain());
        }
        agent.pump().await;
        // Not ready while the API server is away (what is in force stays in force).
        enforcement.set_source_connected(changed.connected());
        // The switch flipped: the conditions say so at the next round.
        let switch_moved = enforcement.switch_on() != agent.switch_reported;
        dirty = tokio::select! {
            _ = stop.wait() => break,
            woke = tokio::time::timeout(
                if enforcement.loading() {
                    agent.settings.interval.min(LOAD_POLL)
                } else {
                    agent.settings.interval
                },
                changed.notify.notified(),
            ) => {
                woke.is_ok()
            }
        } || switch_moved;
    }
    tracing::info!("agent stopping; enforcement stays in place");
    Ok(())
}

/// What the agent watches: peerwall's FirewallConfigurations for this host, Liqo's ones it
/// enforces (`--liqo-selector`), the AddressSets, and Liqo's ones it only observes for their
/// NAT (`--observe`). Each has listed once before the first round.
struct Watches {
    /// Liqo's tenant namespaces (when they may steer their peer's gateway).
    tenants: Option<reflector::Store<Namespace>>,
    configs: reflector::Store<ConfigObject>,
    liqo: Option<reflector::Store<ConfigObject>>,
    slices: Option<reflector::Store<SliceObject>>,
    observed: Vec<reflector::Store<ConfigObject>>,
    /// Liqo's FirewallConfigurationBindings and the target they must name (none where Liqo
    /// serves no bindings, or no target is known: Liqo's objects count by their labels).
    bindings: Option<(
        reflector::Store<DynamicObject>,
        peerwall_intent::binding::Target,
    )>,
    /// Bindings already reported unreadable (each once).
    unreadable: std::collections::BTreeSet<String>,
}

impl Watches {
    /// Every watch started at once and their first lists awaited together: one round trip to
    /// the API server before a new gateway's first apply, not one per kind after another
    /// (`cargo xtask bench-peers`: a gateway starting beside 50 others).
    async fn start(
        client: &kube::Client,
        settings: &Settings,
        changed: &Arc<super::Changes>,
    ) -> anyhow::Result<Self> {
        let tenants = async {
            if settings.trust.tenant_namespaces {
                super::tenant_namespaces(client, changed.clone())
                    .await
                    .map(Some)
            } else {
                Ok(None)
            }
        };
        let configs = async {
            let r = super::cache(
                Api::<ConfigObject>::all_with(client.clone(), &super::fwc_resource()),
                super::watch_config().labels(&settings.selector),
                super::fwc_resource(),
                changed.clone(),
            );
            tracing::info!(selector = %settings.selector, host = %settings.host, "watching FirewallConfigurations");
            r.wait_until_ready()
                .await
                .context("the FirewallConfiguration watch ended before its first list")?;
            anyhow::Ok(r)
        };
        let liqo = async {
            let Some(sel) = &settings.liqo_selector else {
                return Ok(None);
            };
            let liqo = super::resource_of(Group::Liqo);
            let r = super::cache(
                Api::<ConfigObject>::all_with(client.clone(), &liqo),
                super::watch_config().labels(sel),
                liqo,
                changed.clone(),
            );
            tracing::info!(selector = %sel, "also enforcing Liqo's FirewallConfigurations (read only)");
            r.wait_until_ready()
                .await
                .context("the watch of Liqo's FirewallConfigurations ended before its first list (is Liqo's CRD installed?)")?;
            anyhow::Ok(Some(r))
        };
        let slices = address_sets(client, settings, changed);
        let observed = futures::future::try_join_all(
            settings
                .observe
                .iter()
                .map(|sel| observe_liqo(client, sel, changed)),
        );
        // Bindings matter where Liqo's objects do (enforced or observed); where Liqo serves
        // none, this finds out with one probe.
        let bindings = async {
            match &settings.liqo_target {
                Some(target)
                    if settings.liqo_selector.is_some() || !settings.observe.is_empty() =>
                {
                    Ok(liqo_bindings(client, changed)
                        .await?
                        .map(|r| (r, target.clone())))
                }
                _ => anyhow::Ok(None),
            }
        };
        let (tenants, configs, liqo, slices, observed, bindings) =
            tokio::try_join!(tenants, configs, liqo, slices, observed, bindings)?;
        let observed: Vec<_> = observed.into_iter().flatten().collect();
        // As before: no Liqo object enforced or observed after all, no bindings to follow.
        let bindings = bindings.filter(|_| liqo.is_some() || !observed.is_empty());
        Ok(Self {
            tenants,
            configs,
            liqo,
            slices,
            observed,
            bindings,
            unreadable: Default::default(),
        })
    }

    /// The FirewallConfigurations of a round: peerwall's, Liqo's enforced ones, and Liqo's
    /// observed ones marked as such; Liqo's only where in force at the target.
    fn objects(&mut self) -> Vec<Arc<ConfigObject>> {
        let bound = self.bound();
        let here = |o: &Arc<ConfigObject>| {
            bound.as_ref().is_none_or(|b| {
                b.contains(&(
                    o.metadata.namespace.clone().unwrap_or_default(),
                    o.metadata.name.clone().unwrap_or_default(),
                ))
            })
        };
        let mut objects = self.configs.state();
        if let Some(r) = &self.liqo {
            objects.extend(
                r.state()
                    .into_iter()
                    .filter(here)
                    .map(|o| tagged(o, Group::Liqo)),
            );
        }
        for r in &self.observed {
            objects.extend(
                r.state()
                    .into_iter()
                    .filter(here)
                    .map(|o| Arc::new(super::mark_observed(&tagged(o, Group::Liqo)))),
            );
        }
        objects
    }

    /// The Liqo configurations (`namespace`, `name`) the bindings keep in force at the target;
    /// None where Liqo's objects count by their labels alone.
    fn bound(&mut self) -> Option<std::collections::BTreeSet<(String, String)>> {
        let (store, target) = self.bindings.as_ref()?;
        let mut read = Vec::new();
        for o in store.state() {
            let v = match serde_json::to_value(o.as_ref()) {
                Ok(v) => v,
                Err(_) => continue,
            };
            match peerwall_intent::binding::read(&v) {
                Ok(b) => read.push(b),
                Err(e) => {
                    if self.unreadable.insert(e.object.clone()) {
                        tracing::warn!(error = %e, "a Liqo FirewallConfigurationBinding is unreadable: it binds nothing here");
                    }
                }
            }
        }
        Some(peerwall_intent::binding::in_force_at(&read, target))
    }

    /// The peer of every Liqo tenant namespace.
    fn tenants(&self) -> super::trust::Tenants {
        self.tenants
            .as_ref()
            .map(|r| super::tenants_of(r.state().iter().map(|n| n.as_ref())))
            .unwrap_or_default()
    }

    /// The AddressSets of a round.
    fn slices(&self) -> Vec<Arc<SliceObject>> {
        self.slices.as_ref().map(|r| r.state()).unwrap_or_default()
    }
}

/// peerwall's AddressSets of this host, watched (None where the CRD is not installed).
async fn address_sets(
    client: &kube::Client,
    settings: &Settings,
    changed: &Arc<super::Changes>,
) -> anyhow::Result<Option<reflector::Store<SliceObject>>> {
    let api = Api::<SliceObject>::all_with(client.clone(), &super::address_set_resource());
    let listed = match api
        .list_metadata(&super::list_check_params(Some(&settings.selector)))
        .await
    {
        Err(kube::Error::Api(e)) if e.code == 404 => {
            tracing::warn!("peerwall's AddressSet CRD is not installed: sets fill from their inline elements only (apply deploy/common/crd.yaml)");
            return Ok(None);
        }
        listed => listed.is_ok(),
    };
    let r = super::cache(
        api,
        super::watch_config().labels(&settings.selector),
        super::address_set_resource(),
        changed.clone(),
    );
    if listed {
        r.wait_until_ready()
            .await
            .context("the AddressSet watch ended before its first list")?;
    }
    Ok(Some(r))
}

/// Liqo's FirewallConfigurations of selector `sel`, watched for their NAT (None where Liqo's
/// CRD is not installed: no Liqo NAT to observe).
async fn observe_liqo(
    client: &kube::Client,
    sel: &str,
    changed: &Arc<super::Changes>,
) -> anyhow::Result<Option<reflector::Store<ConfigObject>>> {
    let liqo = super::resource_of(Group::Liqo);
    let api = Api::<ConfigObject>::all_with(client.clone(), &liqo);
    let listable = match api
        .list_metadata(&super::list_check_params(Some(sel)))
        .await
    {
        Err(kube::Error::Api(e)) if e.code == 404 => {
            tracing::warn!(selector = %sel, "Liqo's FirewallConfiguration CRD is not installed: no Liqo NAT to observe");
            return Ok(None);
        }
        Err(e) => {
            tracing::warn!(selector = %sel, error = %e, "Liqo's FirewallConfigurations cannot be listed yet; their NAT is taken into account once they can");
            false
        }
        Ok(_) => true,
    };
    let r = super::cache(
        api,
        super::watch_config().labels(sel),
        liqo,
        changed.clone(),
    );
    tracing::info!(selector = %sel, "observing Liqo's FirewallConfigurations for their NAT (read only)");
    if listable {
        r.wait_until_ready()
            .await
            .context("the watch of Liqo's FirewallConfigurations ended before its first list")?;
    }
    Ok(Some(r))
}

/// The watch of Liqo's FirewallConfigurationBindings, listed once; None where Liqo serves none
/// (a Liqo before liqotech/liqo PR #3290 applies what its labels select, and so does peerwall)
/// or this agent may not read them (the same, with a warning naming the missing permission).
async fn liqo_bindings(
    client: &kube::Client,
    changed: &Arc<super::Changes>,
) -> anyhow::Result<Option<reflector::Store<DynamicObject>>> {
    let resource = super::liqo_binding_resource();
    let api = Api::<DynamicObject>::all_with(client.clone(), &resource);
    match api.list_metadata(&super::list_check_params(None)).await {
        Err(kube::Error::Api(e)) if e.code == 404 => {
            tracing::info!("Liqo serves no FirewallConfigurationBindings: Liqo's FirewallConfigurations count by their labels");
            return Ok(None);
        }
        Err(kube::Error::Api(e)) if e.code == 403 => {
            tracing::warn!(error = %e.message, "cannot list Liqo's FirewallConfigurationBindings (grant list and watch on firewallconfigurationbindings.networking.liqo.io, deploy/common/rbac.yaml): Liqo's FirewallConfigurations count by their labels");
            return Ok(None);
        }
        _ => {}
    }
    let r = super::cache(api, super::watch_config(), resource, changed.clone());
    tracing::info!("Liqo's FirewallConfigurations count where a FirewallConfigurationBinding names this gateway");
    r.wait_until_ready()
        .await
        .context("the watch of Liqo's FirewallConfigurationBindings ended before its first list")?;
    Ok(Some(r))
}

impl Agent {
    /// The agent of `settings.host`, before its first round.
    fn new(
        client: kube::Client,
        api: Api<Answer>,
        settings: Settings,
        backend: &'static str,
    ) -> Self {
        Agent {
            recorder: Recorder::new(
                client,
                Reporter {
                    controller: "peerwall-agent".into(),
                    instance: Some(settings.host.clone()),
                },
            ),
            finalizer: finalizer(&settings.host),
            manager: format!("peerwall-agent-{}", settings.host),
            api,
            settings,
            last_good: BTreeMap::new(),
            reported: BTreeMap::new(),
            enforced: None,
            checks: BTreeMap::new(),
            settled: None,
            slices: Slices::default(),
            sliced: None,
            slice_issues: BTreeMap::new(),
            switch_reported: false,
            ignored: BTreeMap::new(),
            backend,
            retry: None,
            writer: report::Writer::default(),
        }
    }
}
