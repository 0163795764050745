//! Objects from namespaces that may not steer this gateway ([`crate::trust`]) are left
//! out of the round: never enforced, no condition written, one warning Event (`Ignored`) on
//! the object per generation, and this host's finalizer released if an earlier round (before
//! the namespace lost its designation) had added it.

use std::sync::Arc;

use kube::api::ApiResource;
use kube::runtime::events::{Event, EventType};
use kube::Resource;

use super::Agent;
use crate::watched::Watched;
use peerwall_intent::load::Group;

impl Agent {
    /// The objects of `objects` this agent takes; the others are reported as ignored.
    pub(super) async fn admit<S>(
        &mut self,
        objects: Vec<Arc<Watched<S>>>,
        tenants: &crate::trust::Tenants,
        resource: &ApiResource,
    ) -> Vec<Arc<Watched<S>>> {
        let mut kept = Vec::with_capacity(objects.len());
        for o in objects {
            // Liqo's own objects are Liqo's to trust (`--liqo-selector`, `--observe`).
            if crate::group_of(&o) == Group::Liqo {
                kept.push(o);
                continue;
            }
            let namespace = o.metadata.namespace.as_deref().unwrap_or_default();
            let peer = o
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(crate::PEER))
                .map(String::as_str);
            match self.settings.trust.admits(namespace, peer, tenants) {
                Ok(()) => {
                    self.ignored.remove(&crate::key_of(&o));
                    kept.push(o);
                }
                Err(reason) => self.ignore(&o, reason, resource).await,
            }
        }
        kept
    }

    /// Report `obj` ignored for `reason` (once per generation and reason) and drop this
    /// host's finalizer from it.
    async fn ignore<S>(&mut self, obj: &Watched<S>, reason: String, resource: &ApiResource) {
        let key = crate::key_of(obj);
        let uid = obj.metadata.uid.clone().unwrap_or_default();
        let generation = obj.metadata.generation.unwrap_or_default();
        let seen = (uid, generation, reason.clone());
        if self.ignored.get(&key) == Some(&seen) {
            return;
        }
        tracing::warn!(object = %key, reason = %reason, "gateway object ignored");
        let event = Event {
            type_: EventType::Warning,
            reason: "Ignored".into(),
            note: Some(
                format!("{}: {reason}", self.settings.host)
                    .chars()
                    .take(1000)
                    .collect(),
            ),
            action: "Admit".into(),
            secondary: None,
        };
        if let Err(e) = self
            .recorder
            .publish(&event, &obj.object_ref(resource))
            .await
        {
            tracing::warn!(object = %key, error = %e, "could not publish event");
        }
        self.release(&obj.metadata, &key).await;
        self.ignored.insert(key, seen);
    }
}
