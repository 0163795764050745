//! This host's conditions on the objects it enforces: decided by the round, written by
//! server-side apply of the status (with an Event when the condition's type changes or on
//! error), several at once. A first round on a host writes one condition per object (101 for a
//! 100k-pod peer's configuration and slices); written one after the other they held the next
//! round back for most of a second.

use futures::StreamExt;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::Resource;
use serde_json::json;

use super::plan::Outcome;
use super::{current_condition, Agent};
use peerwall_intent::types::{
    ConditionType, FirewallConfigurationStatus, FirewallConfigurationStatusCondition,
};

/// Conditions written at once, at most.
const CONCURRENT_WRITES: usize = 16;

/// A condition to write, decided without the API.
pub(super) struct PendingReport {
    key: String,
    outcome: Outcome,
    name: String,
    namespace: String,
    resource: kube::api::ApiResource,
    body: serde_json::Value,
    /// Published once the status is written.
    event: Option<Event>,
    reference: k8s_openapi::api::core::v1::ObjectReference,
}

impl Agent {
    /// The write `outcome` needs on `obj` (remembered under `key`), or none when the API or
    /// this agent already has it.
    pub(super) fn prepare_report(
        &mut self,
        obj: &DynamicObject,
        outcome: Outcome,
        key: &str,
        resource: &kube::api::ApiResource,
    ) -> Option<PendingReport> {
        let key = key.to_string();
        let host = &self.settings.host;
        let existing = current_condition(obj, host);
        let backend = self.backend;
        let unchanged_in_api = existing.as_ref().is_some_and(|c| {
            c.type_ == outcome.kind
                && c.message == outcome.message
                && c.observed_generation == Some(outcome.generation)
                && c.backend.as_deref() == Some(backend)
        });
        if unchanged_in_api || self.reported.get(&key) == Some(&outcome) {
            self.reported.insert(key, outcome);
            return None;
        }
        let cond = FirewallConfigurationStatusCondition {
            host: host.clone(),
            type_: outcome.kind,
            status: "True".into(),
            // The transition time moves only when the condition's type changes.
            last_transition_time: existing
                .as_ref()
                .filter(|c| c.type_ == outcome.kind)
                .and_then(|c| c.last_transition_time.clone())
                .or_else(|| {
                    Some(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
                }),
            message: outcome.message.clone(),
            observed_generation: Some(outcome.generation),
            backend: Some(backend.to_string()),
        };
        let body = json!({
            "apiVersion": peerwall_intent::load::API_VERSION,
            "kind": resource.kind,
            "status": FirewallConfigurationStatus { conditions: vec![cond] },
        });
        let changed_kind =
            self.reported.get(&key).map(|r| r.kind) != Some(outcome.kind) || existing.is_none();
        let event = (changed_kind || outcome.kind == ConditionType::Error).then(|| Event {
            type_: match outcome.kind {
                ConditionType::Applied => EventType::Normal,
                ConditionType::Error | ConditionType::NotEnforced => EventType::Warning,
            },
            reason: match outcome.kind {
                ConditionType::Applied => "Applied".into(),
                ConditionType::Error => "NotApplied".into(),
                ConditionType::NotEnforced => "NotEnforced".into(),
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
        });
        Some(PendingReport {
            key,
            outcome,
            name: obj.metadata.name.clone().unwrap_or_default(),
            namespace: obj
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".into()),
            resource: resource.clone(),
            body,
            event,
            reference: obj.object_ref(resource),
        })
    }

    /// Write `pending` ([`CONCURRENT_WRITES`] at a time); what was written is remembered, what
    /// failed is logged and tried again at the next round.
    pub(super) async fn send_reports(&mut self, pending: Vec<PendingReport>) {
        if pending.is_empty() {
            return;
        }
        let client = self.api.clone().into_client();
        let (recorder, manager) = (&self.recorder, self.manager.as_str());
        let written: Vec<(String, Outcome)> = futures::stream::iter(pending)
            .map(|p| {
                let client = client.clone();
                async move { send(client, recorder, manager, p).await }
            })
            .buffer_unordered(CONCURRENT_WRITES)
            .filter_map(futures::future::ready)
            .collect()
            .await;
        for (key, outcome) in written {
            self.reported.insert(key, outcome);
        }
    }
}

/// Write one condition (and its Event); the key and outcome when written.
async fn send(
    client: kube::Client,
    recorder: &Recorder,
    manager: &str,
    p: PendingReport,
) -> Option<(String, Outcome)> {
    let api: Api<DynamicObject> = Api::namespaced_with(client, &p.namespace, &p.resource);
    let pp = PatchParams::apply(manager).force();
    let kind = match p.outcome.kind {
        ConditionType::Applied => "Applied",
        ConditionType::Error => "Error",
        ConditionType::NotEnforced => "NotEnforced",
    };
    match api.patch_status(&p.name, &pp, &Patch::Apply(&p.body)).await {
        Ok(_) => {
            tracing::info!(object = %p.key, condition = kind, message = p.outcome.message.as_deref().unwrap_or(""), "status written");
            if let Some(ev) = &p.event {
                if let Err(e) = recorder.publish(ev, &p.reference).await {
                    tracing::warn!(object = %p.key, error = %e, "could not publish event");
                }
            }
            Some((p.key, p.outcome))
        }
        Err(e) => {
            tracing::warn!(object = %p.key, error = %e, "could not write status");
            None
        }
    }
}
