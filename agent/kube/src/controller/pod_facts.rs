//! What the controller keeps of every pod for the NetworkPolicy tier ([`PodFacts`], a few
//! fields, not the object), fed by the one pod watch that also feeds the publisher's sets.
//! A relist (the watch restarted) replaces the known pods only once it is complete: until
//! then the last full state is served, as a reflector's store does.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock};

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use kube::ResourceExt;

use crate::model::PodFacts;

type Key = (String, String);

#[derive(Debug, Default)]
struct Known {
    pods: BTreeMap<Key, Arc<PodFacts>>,
    /// The pods of a relist under way.
    relist: Option<BTreeMap<Key, Arc<PodFacts>>>,
}

/// Every pod's [`PodFacts`], by namespace and name.
#[derive(Debug, Default)]
pub(crate) struct PodFactsIndex {
    known: RwLock<Known>,
}

impl PodFactsIndex {
    /// Take one event of the pod watch.
    pub(crate) fn apply(&self, ev: &watcher::Event<Pod>) {
        let mut k = self.known.write().unwrap_or_else(PoisonError::into_inner);
        let key = |p: &Pod| (p.namespace().unwrap_or_default(), p.name_any());
        match ev {
            watcher::Event::Init => k.relist = Some(BTreeMap::new()),
            watcher::Event::InitApply(p) => {
                let facts = Arc::new(PodFacts::of(p));
                // An InitApply outside a relist (never sent by kube's watcher) is a plain update.
                match k.relist.as_mut() {
                    Some(r) => r.insert(key(p), facts),
                    None => k.pods.insert(key(p), facts),
                };
            }
            watcher::Event::Apply(p) => {
                k.pods.insert(key(p), Arc::new(PodFacts::of(p)));
            }
            watcher::Event::Delete(p) => {
                k.pods.remove(&key(p));
            }
            watcher::Event::InitDone => {
                if let Some(listed) = k.relist.take() {
                    k.pods = listed;
                }
            }
        }
    }

    /// The pods known now, in namespace and name order (shared, not copied).
    pub(crate) fn snapshot(&self) -> Vec<Arc<PodFacts>> {
        let k = self.known.read().unwrap_or_else(PoisonError::into_inner);
        k.pods.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, app: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "labels": {"app": app}},
            "spec": {"containers": [{"name": "c"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1"},
        }))
        .unwrap()
    }

    fn names(i: &PodFactsIndex) -> Vec<(String, String)> {
        i.snapshot()
            .iter()
            .map(|p| (p.name.clone(), p.labels["app"].clone()))
            .collect()
    }

    #[test]
    fn events_update_delete_and_a_relist_replaces_only_when_complete() {
        let i = PodFactsIndex::default();
        i.apply(&watcher::Event::Apply(pod("a", "x")));
        i.apply(&watcher::Event::Apply(pod("b", "x")));
        i.apply(&watcher::Event::Apply(pod("a", "y")));
        assert_eq!(
            names(&i),
            [("a".into(), "y".into()), ("b".into(), "x".into())]
        );
        i.apply(&watcher::Event::Delete(pod("b", "x")));
        assert_eq!(names(&i), [("a".into(), "y".into())]);
        // A relist: `a` is gone and `c` new, but only once the list is complete.
        i.apply(&watcher::Event::Init);
        i.apply(&watcher::Event::InitApply(pod("c", "z")));
        assert_eq!(
            names(&i),
            [("a".into(), "y".into())],
            "the last full state served"
        );
        i.apply(&watcher::Event::InitDone);
        assert_eq!(names(&i), [("c".into(), "z".into())]);
    }
}
