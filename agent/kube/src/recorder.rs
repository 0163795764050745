//! Kubernetes Events (`events.k8s.io/v1`) written the way client-go's events recorder writes
//! them: isomorphic events (same type, action, reason, **note**, regarding and related object,
//! reporter) seen within [`SERIES_WINDOW`] of each other become one Event whose `series`
//! counts them; an event with another note is an Event of its own.
//!
//! kube-runtime's `Recorder` leaves the note out of that key (client-go added it in
//! kubernetes/kubernetes#112365). Through it, the agent's second drop summary of an object
//! (another source, another packet count) or a second error with another message only bumped
//! the count of the first Event: its text was never written, `kubectl describe` showed the
//! first note "x2", and `peerwall status` multiplied the first summary's packets by the count.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Reporter};
use kube::Client;
use tokio::sync::Mutex;

/// How long after its last occurrence an Event still takes repeats into its series (as
/// client-go, which ends a series six minutes after its last occurrence).
pub const SERIES_WINDOW: SignedDuration = SignedDuration::from_mins(6);

/// Series remembered at most: beyond, the oldest is forgotten (its next repeat starts a new
/// Event), so a flood of distinct notes cannot grow the agent's memory.
pub const MAX_SERIES: usize = 1024;

/// What makes two events the same one (client-go's `eventKey`). The objects are identified
/// without their resourceVersion: a repeat about a newer version of the same object still
/// belongs to the series.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EventKey {
    type_: &'static str,
    action: String,
    reason: String,
    note: Option<String>,
    regarding: ObjectId,
    related: Option<ObjectId>,
}

/// An object reference's identity: API version, kind, namespace, name, uid.
type ObjectId = [Option<String>; 5];

fn id_of(r: &ObjectReference) -> ObjectId {
    [
        r.api_version.clone(),
        r.kind.clone(),
        r.namespace.clone(),
        r.name.clone(),
        r.uid.clone(),
    ]
}

fn type_name(t: EventType) -> &'static str {
    match t {
        EventType::Normal => "Normal",
        EventType::Warning => "Warning",
    }
}

impl EventKey {
    /// The key of `ev` about `regarding`.
    pub fn of(ev: &Event, regarding: &ObjectReference) -> Self {
        Self {
            type_: type_name(ev.type_),
            action: ev.action.clone(),
            reason: ev.reason.clone(),
            note: ev.note.clone(),
            regarding: id_of(regarding),
            related: ev.secondary.as_ref().map(id_of),
        }
    }
}

/// One Event written, and when it last occurred.
#[derive(Clone, Debug)]
struct Written {
    name: String,
    namespace: String,
    count: i32,
    last: Timestamp,
}

/// Publishes Events for one reporter (controller and instance); cheap to clone, clones share
/// their series.
#[derive(Clone)]
pub struct Recorder {
    client: Client,
    reporter: Reporter,
    series: Arc<Mutex<HashMap<EventKey, Written>>>,
}

impl Recorder {
    /// A recorder reporting as `reporter`.
    pub fn new(client: Client, reporter: Reporter) -> Self {
        Self {
            client,
            reporter,
            series: Arc::default(),
        }
    }

    /// Publish `ev` about `regarding`: a new Event, or one more occurrence in the series of
    /// the same event seen within [`SERIES_WINDOW`]. Events of cluster-scoped objects go to
    /// `default`.
    pub async fn publish(
        &self,
        ev: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        if regarding
            .namespace
            .as_deref()
            .unwrap_or_default()
            .is_empty()
        {
            return self.publish_cluster_scoped(ev, regarding, now).await;
        }
        let key = EventKey::of(ev, regarding);
        // The lock is never held across a call to the API server: the agent writes the
        // conditions (and their Events) of many objects at once.
        let repeat = {
            let mut series = self.series.lock().await;
            series.retain(|_, w| w.last + SERIES_WINDOW > now);
            series.get(&key).cloned()
        };
        if let Some(w) = repeat {
            let count = w.count.saturating_add(1);
            let patch = serde_json::json!({ "series": EventSeries {
                count,
                last_observed_time: MicroTime(now),
            }});
            let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), &w.namespace);
            match api
                .patch(&w.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    self.remember(
                        key,
                        Written {
                            count,
                            last: now,
                            ..w
                        },
                    )
                    .await;
                    return Ok(());
                }
                // Expired (the API server's event TTL) or deleted: a new Event.
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e),
            }
        }
        let event = self.event(ev, regarding, now);
        let namespace = event.metadata.namespace.clone().unwrap_or_default();
        let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), &namespace);
        let created = api.create(&PostParams::default(), &event).await?;
        let written = Written {
            name: created.metadata.name.unwrap_or_default(),
            namespace,
            count: 1,
            last: now,
        };
        self.remember(key, written).await;
        Ok(())
    }

    /// Remember the series of `key`, forgetting the oldest one when full.
    async fn remember(&self, key: EventKey, w: Written) {
        let mut series = self.series.lock().await;
        if !series.contains_key(&key) && series.len() >= MAX_SERIES {
            let oldest = series
                .iter()
                .min_by_key(|(_, w)| w.last)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                series.remove(&k);
            }
        }
        series.insert(key, w);
    }

    /// An Event about a cluster-scoped object (a ProtectionPolicy), through the core `v1` API
    /// into `default`: API servers before 1.22 refuse an `events.k8s.io/v1` Event whose
    /// regarding object has no namespace ("involvedObject.namespace: does not match
    /// event.namespace"), while the core API takes it in `default`; both APIs read it. One
    /// Event per occurrence (such events are rare: a policy's status change).
    async fn publish_cluster_scoped(
        &self,
        ev: &Event,
        regarding: &ObjectReference,
        now: Timestamp,
    ) -> Result<(), kube::Error> {
        use k8s_openapi::api::core::v1::{Event as CoreEvent, EventSource};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let base = regarding
            .name
            .as_deref()
            .unwrap_or(&self.reporter.controller);
        let mut involved = regarding.clone();
        involved.namespace = None;
        let event = CoreEvent {
            metadata: ObjectMeta {
                namespace: Some("default".into()),
                name: Some(format!("{base}.{:x}", now.as_nanosecond())),
                ..Default::default()
            },
            involved_object: involved,
            reason: Some(ev.reason.clone()),
            message: ev.note.clone(),
            type_: Some(type_name(ev.type_).into()),
            action: Some(ev.action.clone()),
            count: Some(1),
            first_timestamp: Some(Time(now)),
            last_timestamp: Some(Time(now)),
            source: Some(EventSource {
                component: Some(self.reporter.controller.clone()),
                host: None,
            }),
            reporting_component: Some(self.reporter.controller.clone()),
            reporting_instance: Some(
                self.reporter
                    .instance
                    .clone()
                    .unwrap_or_else(|| self.reporter.controller.clone()),
            ),
            ..Default::default()
        };
        Api::<CoreEvent>::namespaced(self.client.clone(), "default")
            .create(&PostParams::default(), &event)
            .await
            .map(|_| ())
    }

    /// A new Event (as kube-runtime and client-go name it: the object's name and the time).
    fn event(&self, ev: &Event, regarding: &ObjectReference, now: Timestamp) -> K8sEvent {
        // A cluster-scoped object's reference may carry an empty namespace: `default` too.
        let namespace = regarding
            .namespace
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "default".into());
        let base = regarding
            .name
            .as_deref()
            .unwrap_or(&self.reporter.controller);
        K8sEvent {
            action: Some(ev.action.clone()),
            reason: Some(ev.reason.clone()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            related: ev.secondary.clone(),
            note: ev.note.clone(),
            metadata: ObjectMeta {
                namespace: Some(namespace),
                name: Some(format!("{base}.{:x}", now.as_nanosecond())),
                ..Default::default()
            },
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: Some(
                self.reporter
                    .instance
                    .clone()
                    .unwrap_or_else(|| self.reporter.controller.clone()),
            ),
            type_: Some(type_name(ev.type_).into()),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(reason: &str, note: &str) -> Event {
        Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(note.into()),
            action: "Enforce".into(),
            secondary: None,
        }
    }

    fn obj(rv: &str) -> ObjectReference {
        ObjectReference {
            api_version: Some("peerwall.io/v1alpha1".into()),
            kind: Some("FirewallConfiguration".into()),
            namespace: Some("liqo-tenant-a".into()),
            name: Some("gw".into()),
            uid: Some("u1".into()),
            resource_version: Some(rv.into()),
            ..Default::default()
        }
    }

    /// The note is part of what makes an event a repeat; the object's version is not.
    #[test]
    fn only_the_same_note_about_the_same_object_is_a_repeat() {
        let a = EventKey::of(&ev("Dropped", "dropped 3 packets from 10.0.0.1"), &obj("1"));
        let again = EventKey::of(&ev("Dropped", "dropped 3 packets from 10.0.0.1"), &obj("7"));
        let other_note = EventKey::of(&ev("Dropped", "dropped 1 packets from 10.0.0.9"), &obj("1"));
        let other_reason = EventKey::of(
            &ev("Rejected", "dropped 3 packets from 10.0.0.1"),
            &obj("1"),
        );
        let mut other_object = obj("1");
        other_object.uid = Some("u2".into());
        let other_object = EventKey::of(
            &ev("Dropped", "dropped 3 packets from 10.0.0.1"),
            &other_object,
        );
        assert_eq!(a, again);
        assert_ne!(a, other_note);
        assert_ne!(a, other_reason);
        assert_ne!(a, other_object);
    }
}
