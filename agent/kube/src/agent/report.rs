//! This host's conditions on the objects it enforces: decided by the round, written by
//! server-side apply of the status (with an Event when the condition's type changes or on
//! error), several at once, in the background ([`Writer`]): a round hands its reports over and
//! the next change is applied meanwhile. A first round on a host writes one condition per
//! object (101 for a 100k-pod peer's configuration and slices): written within the round, they
//! held the next apply back by up to 0.7 s (`cargo xtask bench-control`'s slowest samples).

use std::collections::BTreeMap;

use crate::recorder::Recorder;
use futures::StreamExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use kube::Resource;
use serde_json::json;

use super::plan::Outcome;
use super::{current_condition, Agent};
use crate::watched::{Answer, Watched};
use peerwall_intent::types::{
    ConditionType, FirewallConfigurationStatus, FirewallConfigurationStatusCondition,
};

/// Conditions written at once, at most.
const CONCURRENT_WRITES: usize = 16;

/// Status writes in the background: one batch at a time; reports decided meanwhile wait for
/// it (a newer outcome for the same object replaces the waiting one).
#[derive(Default)]
pub(super) struct Writer {
    running: Option<tokio::task::JoinHandle<Vec<(String, Outcome, bool)>>>,
    queued: BTreeMap<String, PendingReport>,
    /// What is being written or waits to be, by key: not prepared again meanwhile.
    in_flight: BTreeMap<String, Outcome>,
}

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
    pub(super) fn prepare_report<S>(
        &mut self,
        obj: &Watched<S>,
        outcome: Outcome,
        key: &str,
        resource: &kube::api::ApiResource,
    ) -> Option<PendingReport> {
        let key = key.to_string();
        // Reported already: nothing to read from the object (every round passes every slice
        // here, and reading a condition back from JSON is the costly part).
        if self.reported.get(&key) == Some(&outcome) {
            return None;
        }
        let host = &self.settings.host;
        let existing = current_condition(obj, host);
        let backend = self.backend;
        let unchanged_in_api = existing.as_ref().is_some_and(|c| {
            c.type_ == outcome.kind
                && c.message == outcome.message
                && c.observed_generation == Some(outcome.generation)
                && c.backend.as_deref() == Some(backend)
        });
        if unchanged_in_api {
            self.reported.insert(key, outcome);
            return None;
        }
        if self.writer.in_flight.get(&key) == Some(&outcome) {
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

    /// Hand `pending` to the background writer ([`CONCURRENT_WRITES`] at a time); what was
    /// written is remembered at a later [`pump`](Self::pump), what failed is logged and tried
    /// again at a later round.
    pub(super) async fn send_reports(&mut self, pending: Vec<PendingReport>) {
        for p in pending {
            self.writer
                .in_flight
                .insert(p.key.clone(), p.outcome.clone());
            self.writer.queued.insert(p.key.clone(), p);
        }
        self.pump().await;
    }

    /// Take in the ended batch's results, start the next batch.
    pub(super) async fn pump(&mut self) {
        if self
            .writer
            .running
            .as_ref()
            .is_some_and(|h| h.is_finished())
        {
            if let Some(h) = self.writer.running.take() {
                let done = match h.await {
                    Ok(done) => done,
                    Err(e) => {
                        // The batch died: what it held is prepared again at the next round.
                        tracing::warn!(error = %e, "status writes interrupted");
                        let queued = &self.writer.queued;
                        self.writer.in_flight.retain(|k, _| queued.contains_key(k));
                        Vec::new()
                    }
                };
                for (key, outcome, written) in done {
                    if self.writer.in_flight.get(&key) == Some(&outcome)
                        && !self.writer.queued.contains_key(&key)
                    {
                        self.writer.in_flight.remove(&key);
                    }
                    if written {
                        self.reported.insert(key, outcome);
                    }
                }
            }
        }
        if self.writer.running.is_some() || self.writer.queued.is_empty() {
            return;
        }
        let batch: Vec<PendingReport> = std::mem::take(&mut self.writer.queued)
            .into_values()
            .collect();
        let client = self.api.clone().into_client();
        let (recorder, manager) = (self.recorder.clone(), self.manager.clone());
        self.writer.running = Some(tokio::spawn(async move {
            futures::stream::iter(batch)
                .map(|p| {
                    let (client, recorder, manager) =
                        (client.clone(), recorder.clone(), manager.clone());
                    async move { send(client, &recorder, &manager, p).await }
                })
                .buffer_unordered(CONCURRENT_WRITES)
                .collect()
                .await
        }));
    }
}

/// Write one condition (and its Event); the key, the outcome and whether it was written.
async fn send(
    client: kube::Client,
    recorder: &Recorder,
    manager: &str,
    p: PendingReport,
) -> (String, Outcome, bool) {
    let api: Api<Answer> = Api::namespaced_with(client, &p.namespace, &p.resource);
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
            (p.key, p.outcome, true)
        }
        Err(e) => {
            tracing::warn!(object = %p.key, error = %e, "could not write status");
            (p.key, p.outcome, false)
        }
    }
}
