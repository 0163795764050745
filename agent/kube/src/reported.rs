//! Reflector caches ([`cache`], behind [`crate::cache`]), and those of objects whose status the
//! agents write (the controller's FirewallConfigurations and AddressSets): every host reports
//! its conditions there after each apply, so most of their events change nothing but the
//! status. Such an event wakes the loops that read the status, and no others, and leaves the
//! change count alone: what was computed from the caches (the NetworkPolicy view) stays
//! current, and a host's report does not start a pass over every pod.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kube::api::ObjectMeta;

use crate::Changes;

/// Which loops a status-only event of a cache wakes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusReaders {
    /// The fast loop only (slices: its reuse gate and deletions read the hosts' reports).
    Fast,
    /// Both loops (configurations: the second deletes the slices a configuration no longer
    /// takes once every host applied it).
    Both,
}

/// Whether `new` differs from `old` (the same object as the cache held it) in nothing the
/// controller reads but the status: the same uid and spec generation (the API server moves
/// it on every spec change of a resource with a status subresource, never on a status
/// write), labels, annotations, owners, finalizers and deletion. False where either has no
/// generation: then the spec may have changed unseen.
pub fn status_only(old: &ObjectMeta, new: &ObjectMeta) -> bool {
    old.uid.is_some()
        && old.uid == new.uid
        && old.generation.is_some()
        && old.generation == new.generation
        && old.labels == new.labels
        && old.annotations == new.annotations
        && old.owner_references == new.owner_references
        && old.finalizers == new.finalizers
        && old.deletion_timestamp == new.deletion_timestamp
}

/// [`crate::cache`], and for a resource with a status subresource that others write
/// (`readers` given): an event that changes only the status ([`status_only`], against the
/// object the cache held) wakes `readers` without moving `changed`'s count; every other event
/// is a change. Those resources are the controller's own outputs (its FirewallConfigurations
/// and AddressSets, which hosts report on): their changes move the count but not the inputs'
/// ([`Changes::inputs`]).
pub fn cache<K>(
    api: kube::Api<K>,
    wc: kube::runtime::watcher::Config,
    dyntype: K::DynamicType,
    changed: Arc<Changes>,
    readers: Option<StatusReaders>,
) -> kube::runtime::reflector::Store<K>
where
    K: kube::Resource
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone + Send + Sync,
{
    use futures::StreamExt;
    use kube::runtime::reflector::ObjectRef;
    use kube::runtime::watcher::Event;
    use kube::runtime::WatchStreamExt;
    let writer = kube::runtime::reflector::store::Writer::new(dyntype.clone());
    let reader = writer.as_reader();
    // Set for an event before the reflector applies it (the cache still holds the object as
    // it was), read once it did: one stream, polled in order.
    let only = Arc::new(AtomicBool::new(false));
    let events = {
        let (reader, only) = (reader.clone(), only.clone());
        kube::runtime::watcher(api, wc).map(move |ev| {
            let status = match &ev {
                Ok(Event::Apply(obj)) if readers.is_some() => reader
                    .get(&ObjectRef::from_obj_with(obj, dyntype.clone()))
                    .is_some_and(|old| status_only(old.meta(), obj.meta())),
                _ => false,
            };
            only.store(status, Ordering::SeqCst);
            ev
        })
    };
    let stream = kube::runtime::reflector(writer, events)
        .default_backoff()
        .scan(false, move |failing, ev| {
            if let Err(e) = &ev {
                tracing::warn!(error = %e, "watch error (retrying)");
            }
            let now = ev.is_err();
            changed.set_failing(*failing, now);
            let status = !now && only.swap(false, Ordering::SeqCst) && *failing == now;
            *failing = now;
            if status {
                changed.reported(readers == Some(StatusReaders::Both));
            } else if readers.is_some() {
                changed.bump_output();
            } else {
                changed.bump();
            }
            futures::future::ready(Some(()))
        })
        .for_each(|()| futures::future::ready(()));
    tokio::spawn(stream);
    reader
}

#[cfg(test)]
#[path = "reported/tests.rs"]
mod tests;
