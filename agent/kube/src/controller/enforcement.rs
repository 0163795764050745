//! Whether each peer's gateway configuration is in force somewhere: a `NotEnforced` condition,
//! an Event and a metric for one no host has applied past the grace period.

use kube::Resource;
use kube::ResourceExt;

use super::context::Ctx;
use super::publish::FIELD_MANAGER;
use super::GATEWAY_CONFIG;
use crate::protection;
use kube::api::Api;
use kube::api::DynamicObject;
use kube::api::Patch;
use kube::api::PatchParams;
use std::sync::Arc;
use std::time::Duration;

/// The hosts' conditions of `obj` (the controller's own left out).
pub(super) fn host_conditions(obj: &DynamicObject) -> impl Iterator<Item = &serde_json::Value> {
    obj.data
        .pointer("/status/conditions")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter(|k| {
            k.get("host").and_then(|h| h.as_str()) != Some(protection::enforcement::CONTROLLER_HOST)
        })
}

/// Whether `k` says its host applied `generation` (or a later one).
pub(super) fn applied_at(k: &serde_json::Value, generation: i64) -> bool {
    k.get("type").and_then(|t| t.as_str()) == Some("Applied")
        && k.get("observedGeneration").and_then(|g| g.as_i64()) >= Some(generation)
}

/// Whether every host that reports on `obj` has applied its current generation (or none
/// reports yet).
pub(super) fn applied_everywhere(obj: &DynamicObject) -> bool {
    let generation = obj.metadata.generation.unwrap_or_default();
    host_conditions(obj).all(|k| applied_at(k, generation))
}

/// Whether a live host reports `obj`'s current generation applied: with `live` known (see
/// [`crate::coverage::LiveHosts`]), only the hosts in it count; unknown, every host.
fn applied_by_live(obj: &DynamicObject, live: Option<&std::collections::BTreeSet<String>>) -> bool {
    let generation = obj.metadata.generation.unwrap_or_default();
    host_conditions(obj).any(|k| {
        applied_at(k, generation)
            && live.is_none_or(|l| {
                k.get("host")
                    .and_then(|h| h.as_str())
                    .is_some_and(|h| l.contains(h))
            })
    })
}

/// Since when each (configuration, host) has had a condition while the host ran no covered
/// gateway of the configuration's peer.
type Stale = std::collections::BTreeMap<(String, String), std::time::Instant>;

/// Take one condition of a host that has run no gateway of `obj`'s peer for `grace` out of
/// its status (a JSON patch that first tests the entry is still that host's): an `Applied`
/// left by an agent that is gone said "enforced" when nobody enforced. The grace keeps the
/// condition of an agent that is only restarting or briefly not ready (it would not write an
/// unchanged condition again).
async fn prune_stale(
    ctx: &Ctx,
    obj: &DynamicObject,
    live: &std::collections::BTreeSet<String>,
    stale: &mut Stale,
    grace: Duration,
) {
    let key = format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any());
    let now = std::time::Instant::now();
    let gone: Vec<String> = host_conditions(obj)
        .filter_map(|k| k.get("host").and_then(|h| h.as_str()))
        .filter(|h| !live.contains(*h))
        .map(str::to_string)
        .collect();
    stale.retain(|(k, h), _| k != &key || gone.contains(h));
    let Some(host) = gone.into_iter().find(|h| {
        let since = *stale.entry((key.clone(), h.clone())).or_insert(now);
        now.saturating_duration_since(since) >= grace
    }) else {
        return;
    };
    // The index among all conditions (the controller's own included).
    let Some(index) = obj
        .data
        .pointer("/status/conditions")
        .and_then(|v| v.as_array())
        .and_then(|cs| {
            cs.iter()
                .position(|k| k.get("host").and_then(|h| h.as_str()) == Some(host.as_str()))
        })
    else {
        return;
    };
    let patch: json_patch::Patch = match serde_json::from_value(serde_json::json!([
        {"op": "test", "path": format!("/status/conditions/{index}/host"), "value": host},
        {"op": "remove", "path": format!("/status/conditions/{index}")},
    ])) {
        Ok(p) => p,
        Err(_) => return,
    };
    let (ns, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let api: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), &ns, &crate::fwc_resource());
    match api
        .patch_status(&name, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
    {
        Ok(_) => {
            tracing::info!(configuration = %format!("{ns}/{name}"), host, "condition of a host that runs no gateway of this peer removed")
        }
        Err(e) => {
            tracing::debug!(configuration = %format!("{ns}/{name}"), host, error = %e, "stale condition not removed (retried)")
        }
    }
}

/// Every few seconds: the peers' gateway configurations no host has applied past `grace`
/// ([`protection::enforcement`]) get a `NotEnforced` condition (host `peerwall-controller`),
/// a Warning Event and a log line, and count in `peerwall_controller_unenforced_peers`; the
/// condition is taken back once a host applies the configuration.
pub(super) async fn watch_enforcement(
    ctx: Arc<Ctx>,
    grace: Duration,
    live: crate::coverage::LiveHosts,
) {
    use protection::enforcement::{Enforcement, Reported, CONTROLLER_HOST};
    let recorder = crate::recorder::Recorder::new(
        ctx.client.clone(),
        kube::runtime::events::Reporter {
            controller: "peerwall-controller".into(),
            instance: None,
        },
    );
    let manager = format!("{FIELD_MANAGER}/enforcement");
    let mut e = Enforcement::new(grace);
    let mut stale = Stale::new();
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let configs: Vec<Arc<DynamicObject>> = ctx
            .configs
            .state()
            .into_iter()
            .filter(|c| c.name_any() == GATEWAY_CONFIG)
            .collect();
        let key =
            |c: &DynamicObject| format!("{}/{}", c.namespace().unwrap_or_default(), c.name_any());
        let live = live.lock().ok().and_then(|l| l.clone());
        let empty = std::collections::BTreeSet::new();
        let live_of = |c: &DynamicObject| {
            live.as_ref()
                .map(|l| l.get(&c.namespace().unwrap_or_default()).unwrap_or(&empty))
        };
        let reported: Vec<Reported> = configs
            .iter()
            .map(|c| Reported {
                key: key(c),
                generation: c.metadata.generation.unwrap_or_default(),
                applied: applied_by_live(c, live_of(c)),
            })
            .collect();
        for c in &configs {
            if let Some(l) = live_of(c) {
                prune_stale(&ctx, c, l, &mut stale, grace).await;
            }
        }
        let f = e.observe(std::time::Instant::now(), &reported);
        ctx.count(|m| m.unenforced_peers = f.unenforced as u64);
        for (k, on) in f
            .newly_unenforced
            .iter()
            .map(|k| (k, true))
            .chain(f.recovered.iter().map(|k| (k, false)))
        {
            let Some(obj) = configs.iter().find(|c| &key(c) == k) else {
                continue;
            };
            let (ns, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
            let note = format!(
                "no host has applied generation {} of {k} for {}s: the peer's traffic is not filtered by it. Check the agents (kubectl get ds -n peerwall-system), their selector and their Error conditions",
                obj.metadata.generation.unwrap_or_default(),
                grace.as_secs()
            );
            let conditions = if on {
                tracing::warn!(configuration = %k, "{note}");
                serde_json::json!([{
                    "host": CONTROLLER_HOST,
                    "type": "NotEnforced",
                    "status": "True",
                    "message": note,
                    "lastTransitionTime": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    "observedGeneration": obj.metadata.generation.unwrap_or_default(),
                }])
            } else {
                tracing::info!(configuration = %k, "applied by a host again: enforced");
                serde_json::json!([])
            };
            let body = serde_json::json!({
                "apiVersion": peerwall_intent::load::API_VERSION,
                "kind": peerwall_intent::load::KIND,
                "status": {"conditions": conditions},
            });
            let api: Api<DynamicObject> =
                Api::namespaced_with(ctx.client.clone(), &ns, &crate::fwc_resource());
            if let Err(err) = api
                .patch_status(
                    &name,
                    &PatchParams::apply(&manager).force(),
                    &Patch::Apply(&body),
                )
                .await
            {
                tracing::warn!(configuration = %k, error = %err, "could not write the NotEnforced condition");
            }
            if on {
                let ev = kube::runtime::events::Event {
                    type_: kube::runtime::events::EventType::Warning,
                    reason: "NotEnforced".into(),
                    note: Some(note.chars().take(1000).collect()),
                    action: "Enforce".into(),
                    secondary: None,
                };
                let reference = obj.object_ref(&crate::fwc_resource());
                if let Err(err) = recorder.publish(&ev, &reference).await {
                    tracing::warn!(configuration = %k, error = %err, "could not publish the NotEnforced event");
                }
            }
        }
    }
}
