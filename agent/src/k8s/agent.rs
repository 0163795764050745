//! `peerwall agent --source kube`: enforce the FirewallConfigurations a label selector picks.
//!
//! A reflector keeps the selected objects; every change (debounced) starts a *round*:
//! 1. [`plan`] (pure): each object is decoded and validated with [`super::check`]; valid objects
//!    are enforced, an invalid object keeps its last good spec in force (or none), objects being
//!    deleted are left out.
//! 2. The whole set is compiled into one policy and applied by the [`Engine`] (one nft
//!    transaction, or one bpf map sync). Objects the compiler refuses together (two objects
//!    claiming one table) are left out and reported.
//! 3. Each object gets this host's condition (`Applied` or `Error` with the message) through
//!    server-side apply of its status (field manager `peerwall-agent-<host>`; the CRD keys the
//!    conditions by `host`, so agents on several hosts never overwrite each other), an Event on
//!    every transition, and this host's finalizer: it is removed once the object's table is gone
//!    from the kernel.
//!
//! Between rounds the engine repairs drift (nftables) and follows new interfaces (bpf).
//!
//! Opt-in (`--liqo-selector`): Liqo's own FirewallConfigurations (`networking.liqo.io`) picked
//! by that selector are enforced too, read only: peerwall writes no status, finalizer or label
//! on Liqo's objects (errors go to the log).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::{reflector, watcher};
use kube::Resource;
use serde_json::json;

use crate::agent::Engine;
use peerwall_intent::load::Group;
use peerwall_intent::types::ConditionType;
use peerwall_policy::compile::PolicyObject;

/// Settings of the Kubernetes source.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Label selector of peerwall's FirewallConfigurations to enforce.
    pub selector: String,
    /// Opt-in: label selector of Liqo's FirewallConfigurations to enforce too (read only).
    pub liqo_selector: Option<String>,
    /// This host's name (condition `host`, finalizer, field manager).
    pub host: String,
    /// Drift-check period.
    pub interval: Duration,
}

/// One watched object, reduced to what planning needs (no kube types: [`plan`] is pure).
#[derive(Clone, Debug)]
pub struct Observed {
    /// `namespace/name`.
    pub key: String,
    /// UID (a re-created object does not inherit its predecessor's last good spec).
    pub uid: String,
    /// `metadata.generation`.
    pub generation: i64,
    /// Being deleted.
    pub deleting: bool,
    /// Decoded and validated object, or the message why not.
    pub checked: Result<PolicyObject, String>,
}

/// The spec of an object last enforced successfully.
#[derive(Clone, Debug, PartialEq)]
pub struct Good {
    uid: String,
    generation: i64,
    object: PolicyObject,
}

/// This host's verdict on one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Applied or Error.
    pub kind: ConditionType,
    /// Message (errors, or warnings / the spec still in force).
    pub message: Option<String>,
    /// Generation described.
    pub generation: i64,
}

/// What a round will enforce and report.
#[derive(Debug, Default)]
pub struct Plan {
    /// Objects to enforce (current valid spec or last good one), by key.
    pub enforce: BTreeMap<String, PolicyObject>,
    /// Keys whose *current* spec is in `enforce` (they become `Applied` on success).
    pub current: BTreeSet<String>,
    /// Keys refused, with the reason (they become `Error` whatever the apply does).
    pub refused: BTreeMap<String, String>,
    /// Keys being deleted (left out; finalizer released after a successful apply).
    pub deleting: BTreeSet<String>,
}

/// Decide what to enforce from the observed objects and the last good specs; forget the last
/// good spec of objects that are gone, re-created or being deleted.
pub fn plan(observed: &[Observed], last_good: &mut BTreeMap<String, Good>) -> Plan {
    let mut p = Plan::default();
    let present: BTreeSet<&str> = observed
        .iter()
        .filter(|o| !o.deleting)
        .map(|o| o.key.as_str())
        .collect();
    last_good.retain(|k, _| present.contains(k.as_str()));
    for o in observed {
        if o.deleting {
            p.deleting.insert(o.key.clone());
            continue;
        }
        match &o.checked {
            Ok(obj) => {
                p.enforce.insert(o.key.clone(), obj.clone());
                p.current.insert(o.key.clone());
            }
            Err(msg) => {
                let kept = last_good.get(&o.key).filter(|g| g.uid == o.uid);
                let note = match kept {
                    Some(g) => {
                        p.enforce.insert(o.key.clone(), g.object.clone());
                        format!(
                            "{msg} (not applied; generation {} stays in force)",
                            g.generation
                        )
                    }
                    None => format!("{msg} (not applied)"),
                };
                p.refused.insert(o.key.clone(), note);
            }
        }
    }
    p
}

/// What a whole-policy compilation made of a plan: the objects it refused (key, message
/// reported in status) and the compiled policy of the rest.
#[derive(Clone, Debug, Default)]
pub struct Settled {
    /// Refused keys with their status message.
    pub refused: Vec<(String, String)>,
    /// The policy of everything else.
    pub compiled: peerwall_policy::compile::Compiled,
}

impl Settled {
    /// Take the refusals into `p` (also when this result is reused for an unchanged plan).
    fn mark(&self, p: &mut Plan) {
        for (k, msg) in &self.refused {
            p.enforce.remove(k);
            p.current.remove(k);
            p.refused.insert(k.clone(), msg.clone());
        }
    }
}

/// Leave out the objects a whole-policy compilation refuses (for example two objects claiming
/// one table) until the rest compiles; returns the refusals and the compiled rest.
pub fn settle(p: &mut Plan) -> Settled {
    let mut out = Settled::default();
    loop {
        let objs: Vec<PolicyObject> = p.enforce.values().cloned().collect();
        let e = match peerwall_policy::compile::compile(&objs) {
            Ok(compiled) => {
                out.compiled = compiled;
                return out;
            }
            Err(e) => e,
        };
        let before = p.enforce.len();
        let round: Vec<(String, String)> = e
            .objects
            .iter()
            .map(|oe| (oe.origin.clone(), format!("{oe} (not applied)")))
            .filter(|(k, _)| p.enforce.contains_key(k))
            .collect();
        let step = Settled {
            refused: if round.is_empty() {
                // Nothing attributable: refuse everything rather than loop.
                p.enforce
                    .keys()
                    .map(|k| (k.clone(), format!("{e} (not applied)")))
                    .collect()
            } else {
                round
            },
            compiled: Default::default(),
        };
        step.mark(p);
        out.refused.extend(step.refused);
        if p.enforce.len() == before || p.enforce.is_empty() {
            return out;
        }
    }
}

/// Finalizer of this host: `peerwall.io/agent-<host>` (name part at most 63 characters).
pub fn finalizer(host: &str) -> String {
    let mut name: String = format!("agent-{host}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    while name.ends_with(['-', '.', '_']) {
        name.pop();
    }
    format!("peerwall.io/{name}")
}

/// The per-host condition of `obj` as it stands in its status.
fn current_condition<'a>(obj: &'a DynamicObject, host: &str) -> Option<&'a serde_json::Value> {
    obj.data
        .pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c.get("host").and_then(|h| h.as_str()) == Some(host))
}

struct Agent {
    api: Api<DynamicObject>,
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
}

impl Agent {
    async fn round(&mut self, engine: &mut Engine, objects: Vec<Arc<DynamicObject>>) {
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
        let mut p = plan(&observed, &mut self.last_good);
        let started = std::time::Instant::now();
        // Compile only when the set of specs to enforce changed since the last round.
        let settled = match self.settled.take() {
            Some((input, s)) if input == p.enforce => {
                s.mark(&mut p);
                (input, s)
            }
            _ => {
                let input = p.enforce.clone();
                let s = settle(&mut p);
                (input, s)
            }
        };
        let desired: Vec<PolicyObject> = p.enforce.values().cloned().collect();
        let result = if self.enforced.as_ref() == Some(&desired) && !engine.environment_changed() {
            Ok(())
        } else {
            tokio::task::block_in_place(|| engine.apply_compiled(&settled.1.compiled, started))
        };
        self.settled = Some(settled);
        let by_key: BTreeMap<String, &Arc<DynamicObject>> =
            objects.iter().map(|o| (super::key_of(o), o)).collect();
        match &result {
            Ok(()) => {
                self.enforced = Some(desired);
                for o in &observed {
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
            Err(e) => tracing::error!(error = %e, "apply failed; previous policy stays"),
        }
        for o in &observed {
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
                    self.release(obj).await;
                }
                continue;
            }
            self.ensure_finalizer(obj).await;
            let outcome = match (&result, p.refused.get(&o.key)) {
                (_, Some(msg)) => Outcome {
                    kind: ConditionType::Error,
                    message: Some(msg.clone()),
                    generation: o.generation,
                },
                (Err(e), None) => Outcome {
                    kind: ConditionType::Error,
                    message: Some(format!("apply failed: {e}")),
                    generation: o.generation,
                },
                (Ok(()), None) => Outcome {
                    kind: ConditionType::Applied,
                    message: None,
                    generation: o.generation,
                },
            };
            self.report(obj, outcome).await;
        }
        self.reported.retain(|k, _| {
            by_key
                .get(k)
                .is_some_and(|o| o.metadata.deletion_timestamp.is_none())
        });
    }

    /// [`super::check`] of an object, reused while its uid and generation stay the same.
    fn check(&mut self, o: &DynamicObject) -> Result<PolicyObject, String> {
        let key = super::key_of(o);
        let uid = o.metadata.uid.clone().unwrap_or_default();
        let generation = o.metadata.generation.unwrap_or_default();
        if let Some((u, g, r)) = self.checks.get(&key) {
            if *u == uid && *g == generation && generation != 0 {
                return r.clone();
            }
        }
        let r = super::check(o).map(|(po, _)| po);
        self.checks.insert(key, (uid, generation, r.clone()));
        r
    }

    /// Write this host's condition (server-side apply) and an Event, when it changed.
    async fn report(&mut self, obj: &DynamicObject, outcome: Outcome) {
        let key = super::key_of(obj);
        let host = &self.settings.host;
        let (kind, status) = match outcome.kind {
            ConditionType::Applied => ("Applied", "True"),
            ConditionType::Error => ("Error", "True"),
        };
        let existing = current_condition(obj, host);
        let unchanged_in_api = existing.is_some_and(|c| {
            c.get("type").and_then(|v| v.as_str()) == Some(kind)
                && c.get("message").and_then(|v| v.as_str()) == outcome.message.as_deref()
                && c.get("observedGeneration").and_then(|v| v.as_i64()) == Some(outcome.generation)
        });
        if unchanged_in_api || self.reported.get(&key) == Some(&outcome) {
            self.reported.insert(key, outcome);
            return;
        }
        let transition = existing
            .filter(|c| c.get("type").and_then(|v| v.as_str()) == Some(kind))
            .and_then(|c| c.get("lastTransitionTime").cloned())
            .unwrap_or_else(|| {
                json!(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
            });
        let mut cond = json!({
            "host": host,
            "type": kind,
            "status": status,
            "lastTransitionTime": transition,
            "observedGeneration": outcome.generation,
        });
        if let Some(m) = &outcome.message {
            cond["message"] = json!(m);
        }
        let body = json!({
            "apiVersion": peerwall_intent::load::API_VERSION,
            "kind": peerwall_intent::load::KIND,
            "status": { "conditions": [cond] },
        });
        let name = obj.metadata.name.clone().unwrap_or_default();
        let api = self.namespaced(obj);
        let pp = PatchParams::apply(&self.manager).force();
        match api.patch_status(&name, &pp, &Patch::Apply(&body)).await {
            Ok(_) => {
                tracing::info!(object = %key, condition = kind, message = outcome.message.as_deref().unwrap_or(""), "status written");
                let changed_kind = self.reported.get(&key).map(|r| r.kind) != Some(outcome.kind)
                    || existing.is_none();
                if changed_kind || outcome.kind == ConditionType::Error {
                    let ev = Event {
                        type_: match outcome.kind {
                            ConditionType::Applied => EventType::Normal,
                            ConditionType::Error => EventType::Warning,
                        },
                        reason: match outcome.kind {
                            ConditionType::Applied => "Applied".into(),
                            ConditionType::Error => "NotApplied".into(),
                        },
                        note: Some(
                            format!(
                                "{host}: {}",
                                outcome.message.as_deref().unwrap_or("table in force")
                            )
                            .chars()
                            .take(1000)
                            .collect(),
                        ),
                        action: "Enforce".into(),
                        secondary: None,
                    };
                    if let Err(e) = self
                        .recorder
                        .publish(&ev, &obj.object_ref(&super::fwc_resource()))
                        .await
                    {
                        tracing::warn!(object = %key, error = %e, "could not publish event");
                    }
                }
                self.reported.insert(key, outcome);
            }
            Err(e) => tracing::warn!(object = %key, error = %e, "could not write status"),
        }
    }

    fn namespaced(&self, obj: &DynamicObject) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.api.clone().into_client(),
            obj.metadata.namespace.as_deref().unwrap_or("default"),
            &super::fwc_resource(),
        )
    }

    /// Set `metadata.finalizers` to `list` (merge patch guarded by the resourceVersion, so a
    /// concurrent change by someone else is not overwritten; the next round retries).
    async fn set_finalizers(&self, obj: &DynamicObject, list: Vec<String>) {
        let body = json!({ "metadata": {
            "finalizers": list,
            "resourceVersion": obj.metadata.resource_version,
        }});
        let name = obj.metadata.name.clone().unwrap_or_default();
        if let Err(e) = self
            .namespaced(obj)
            .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            tracing::debug!(object = %super::key_of(obj), error = %e, "finalizer update deferred");
        }
    }

    async fn ensure_finalizer(&self, obj: &DynamicObject) {
        let list = obj.metadata.finalizers.clone().unwrap_or_default();
        if !list.contains(&self.finalizer) {
            let mut list = list;
            list.push(self.finalizer.clone());
            self.set_finalizers(obj, list).await;
        }
    }

    /// Objects that carry this host's finalizer but no longer match the selector (it changed
    /// between runs, or their labels did) are not enforced here any more: release them, or
    /// their deletion would hang forever.
    async fn release_unselected(&self, selected: &reflector::Store<DynamicObject>) {
        let all = match self.api.list(&Default::default()).await {
            Ok(l) => l.items,
            Err(e) => {
                tracing::warn!(error = %e, "could not list FirewallConfigurations to release stale finalizers");
                return;
            }
        };
        for obj in all {
            let mine = obj
                .metadata
                .finalizers
                .as_ref()
                .is_some_and(|f| f.contains(&self.finalizer));
            let key = super::key_of(&obj);
            let still_selected = selected.state().iter().any(|o| super::key_of(o) == key);
            if mine && !still_selected {
                tracing::info!(object = %key, "no longer selected here; releasing finalizer");
                self.set_finalizers(
                    &obj,
                    obj.metadata
                        .finalizers
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

    async fn release(&self, obj: &DynamicObject) {
        let list = obj.metadata.finalizers.clone().unwrap_or_default();
        if list.contains(&self.finalizer) {
            tracing::info!(object = %super::key_of(obj), "table removed; releasing finalizer");
            self.set_finalizers(
                obj,
                list.into_iter().filter(|f| *f != self.finalizer).collect(),
            )
            .await;
        }
    }
}

/// `obj` with its `apiVersion` set to `group`'s (list items may come without it), so that its
/// key and decoding follow its group.
fn tagged(obj: Arc<DynamicObject>, group: Group) -> Arc<DynamicObject> {
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
pub fn run(settings: Settings, engine: &mut Engine, stop: Arc<AtomicBool>) -> anyhow::Result<()> {
    let rt = super::runtime()?;
    rt.block_on(async move {
        let client = super::client().await?;
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &super::fwc_resource());
        let changed = Arc::new(super::Changes::default());
        let reader = super::cache(
            api.clone(),
            watcher::Config::default().labels(&settings.selector),
            super::fwc_resource(),
            changed.clone(),
        );
        tracing::info!(selector = %settings.selector, host = %settings.host, "watching FirewallConfigurations");
        reader
            .wait_until_ready()
            .await
            .context("the FirewallConfiguration watch ended before its first list")?;
        let liqo_reader = match &settings.liqo_selector {
            Some(sel) => {
                let liqo = super::resource_of(Group::Liqo);
                let r = super::cache(
                    Api::<DynamicObject>::all_with(client.clone(), &liqo),
                    watcher::Config::default().labels(sel),
                    liqo,
                    changed.clone(),
                );
                tracing::info!(selector = %sel, "also enforcing Liqo's FirewallConfigurations (read only)");
                r.wait_until_ready()
                    .await
                    .context("the watch of Liqo's FirewallConfigurations ended before its first list (is Liqo's CRD installed?)")?;
                Some(r)
            }
            None => None,
        };
        let mut agent = Agent {
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
        };
        agent.release_unselected(&reader).await;
        let mut dirty = true;
        while !stop.load(Ordering::Relaxed) {
            if dirty || engine.environment_changed() {
                // Debounce: let a burst of events settle into one round.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let mut objects = reader.state();
                if let Some(r) = &liqo_reader {
                    objects.extend(r.state().into_iter().map(|o| tagged(o, Group::Liqo)));
                }
                agent.round(engine, objects).await;
            } else {
                tokio::task::block_in_place(|| engine.maintain());
            }
            dirty = tokio::time::timeout(agent.settings.interval, changed.notify.notified())
                .await
                .is_ok();
        }
        tracing::info!("agent stopping; enforcement stays in place");
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_intent::load::parse_documents;

    fn object(name: &str, table: &str, policy: &str) -> PolicyObject {
        let y = format!(
            "apiVersion: peerwall.io/v1alpha1\nkind: FirewallConfiguration\nmetadata: {{name: {name}, namespace: ns}}\nspec:\n  table:\n    name: {table}\n    family: INET\n    chains:\n    - name: c\n      type: filter\n      hook: forward\n      priority: 0\n      policy: {policy}\n      rules: {{filterRules: []}}\n"
        );
        parse_documents(&y, "t").unwrap().remove(0)
    }

    fn observed(
        name: &str,
        uid: &str,
        generation: i64,
        checked: Result<PolicyObject, String>,
    ) -> Observed {
        Observed {
            key: format!("ns/{name}"),
            uid: uid.into(),
            generation,
            deleting: false,
            checked,
        }
    }

    #[test]
    fn invalid_object_keeps_its_last_good_spec() {
        let mut good = BTreeMap::new();
        let a1 = object("a", "ta", "accept");
        good.insert(
            "ns/a".to_string(),
            Good {
                uid: "u1".into(),
                generation: 1,
                object: a1.clone(),
            },
        );
        let p = plan(
            &[observed("a", "u1", 2, Err("spec.x: bad".into()))],
            &mut good,
        );
        assert_eq!(p.enforce.get("ns/a"), Some(&a1));
        assert!(p.current.is_empty());
        assert!(
            p.refused["ns/a"].contains("generation 1 stays in force"),
            "{:?}",
            p.refused
        );
    }

    #[test]
    fn recreated_object_does_not_inherit_last_good() {
        let mut good = BTreeMap::new();
        good.insert(
            "ns/a".to_string(),
            Good {
                uid: "old".into(),
                generation: 1,
                object: object("a", "ta", "accept"),
            },
        );
        let p = plan(&[observed("a", "new", 1, Err("bad".into()))], &mut good);
        assert!(p.enforce.is_empty());
        assert_eq!(p.refused["ns/a"], "bad (not applied)");
    }

    #[test]
    fn deleting_objects_are_left_out_and_forgotten() {
        let mut good = BTreeMap::new();
        good.insert(
            "ns/a".to_string(),
            Good {
                uid: "u".into(),
                generation: 1,
                object: object("a", "ta", "accept"),
            },
        );
        let mut o = observed("a", "u", 1, Ok(object("a", "ta", "accept")));
        o.deleting = true;
        let p = plan(&[o], &mut good);
        assert!(p.enforce.is_empty());
        assert!(p.deleting.contains("ns/a"));
        assert!(good.is_empty());
    }

    #[test]
    fn table_clash_refuses_only_the_clashing_object() {
        let mut good = BTreeMap::new();
        let mut p = plan(
            &[
                observed("a", "ua", 1, Ok(object("a", "shared", "accept"))),
                observed("b", "ub", 1, Ok(object("b", "shared", "drop"))),
                observed("c", "uc", 1, Ok(object("c", "other", "accept"))),
            ],
            &mut good,
        );
        let refused = settle(&mut p).refused;
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].0, "ns/b");
        assert!(refused[0].1.contains("spec.table.name"), "{refused:?}");
        assert_eq!(p.enforce.keys().collect::<Vec<_>>(), ["ns/a", "ns/c"]);
    }

    #[test]
    fn finalizer_names_are_valid() {
        assert_eq!(finalizer("gw-1"), "peerwall.io/agent-gw-1");
        let long = finalizer(&"x".repeat(100));
        assert!(long.len() <= "peerwall.io/".len() + 63);
        assert_eq!(finalizer("Node_A:1"), "peerwall.io/agent-Node_A-1");
    }
}
