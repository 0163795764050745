//! What the controller keeps of every pod for the NetworkPolicy tier ([`PodFacts`], a few
//! fields, not the object), fed by the one pod watch that also feeds the publisher's sets,
//! and what NetworkPolicies see of each, kept by difference ([`ClusterIndex`]).
//! A relist (the watch restarted) replaces the known pods only once it is complete: until
//! then the last full state is served, as a reflector's store does.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock};

use crate::model::index::{ClusterIndex, Key};
use crate::model::PodFacts;
use crate::netpol;
use crate::protection::Remap;

#[derive(Debug, Default)]
struct Known {
    pods: ClusterIndex,
    /// The pods of a relist under way.
    relist: Option<BTreeMap<Key, Arc<PodFacts>>>,
}

/// Every pod's [`PodFacts`], by namespace and name.
#[derive(Debug, Default)]
pub(crate) struct PodFactsIndex {
    known: RwLock<Known>,
}

impl PodFactsIndex {
    /// A full list begins (the watch restarted): the pods upserted until [`Self::end_relist`]
    /// replace the known ones then; until then the last full state is served.
    pub(crate) fn begin_relist(&self) {
        self.write().relist = Some(BTreeMap::new());
    }

    /// The full list is complete: pods not in it are gone.
    pub(crate) fn end_relist(&self) {
        let mut k = self.write();
        if let Some(listed) = k.relist.take() {
            k.pods.replace_all(listed);
        }
    }

    /// A pod added or changed (into the relist under way, if any); false when nothing the
    /// controller reads of it changed, so that the event wakes nothing.
    pub(crate) fn upsert(&self, facts: PodFacts) -> bool {
        let mut k = self.write();
        let key = (facts.namespace.clone(), facts.name.clone());
        let facts = Arc::new(facts);
        match k.relist.as_mut() {
            Some(r) => {
                r.insert(key, facts);
                true
            }
            None => k.pods.upsert(facts),
        }
    }

    /// A pod deleted; false when it was not known.
    pub(crate) fn remove(&self, namespace: &str, name: &str) -> bool {
        let key = (namespace.to_string(), name.to_string());
        let mut k = self.write();
        let listed = k.relist.as_mut().is_some_and(|r| r.remove(&key).is_some());
        k.pods.remove(namespace, name) || listed
    }

    /// The pods known now, in namespace and name order (shared, not copied).
    #[cfg(test)]
    pub(crate) fn snapshot(&self) -> Vec<Arc<PodFacts>> {
        let k = self.known.read().unwrap_or_else(PoisonError::into_inner);
        k.pods.facts().cloned().collect()
    }

    /// The pods as NetworkPolicies see them with the virtual nodes `vnodes` and the remaps
    /// `remaps` (only the pods these changed are derived anew), and the namespaces they are
    /// in; shared, not copied.
    pub(crate) fn view(
        &self,
        vnodes: BTreeMap<String, String>,
        remaps: &BTreeMap<String, Vec<Remap>>,
    ) -> (netpol::Pods, Vec<String>) {
        let mut k = self.write();
        k.pods.set_context(vnodes, remaps);
        let namespaces = k.pods.pod_namespaces().map(str::to_string).collect();
        (k.pods.pods(), namespaces)
    }

    /// Each namespace's sets for `peer` as of the last [`Self::view`]'s context (the pods
    /// since: a later pass reads them again), from the namespaces holding its pods alone
    /// ([`ClusterIndex::namespace_sets`]).
    pub(crate) fn namespace_sets(
        &self,
        peer: &str,
        tenant: impl Fn(&str) -> bool,
    ) -> BTreeMap<String, crate::protection::namespaces::NsSets> {
        let k = self.known.read().unwrap_or_else(PoisonError::into_inner);
        k.pods.namespace_sets(peer, tenant)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Known> {
        self.known.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::json;

    fn pod(name: &str, app: &str) -> PodFacts {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "labels": {"app": app}},
            "spec": {"containers": [{"name": "c"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1"},
        }))
        .unwrap();
        PodFacts::of(&p)
    }

    fn names(i: &PodFactsIndex) -> Vec<(String, String)> {
        i.snapshot()
            .iter()
            .map(|p| (p.name.clone(), p.labels["app"].clone()))
            .collect()
    }

    /// What wakes the controller's passes: an event that changes nothing it keeps (the same
    /// facts again, as a status update of a condition brings) does not.
    #[test]
    fn only_events_that_change_what_is_kept_say_so() {
        let i = PodFactsIndex::default();
        assert!(i.upsert(pod("a", "x")), "a new pod");
        assert!(!i.upsert(pod("a", "x")), "the same facts again");
        assert!(i.upsert(pod("a", "y")), "relabelled");
        assert!(!i.remove("ns", "b"), "never known");
        assert!(i.remove("ns", "a"));
        // Within a relist every listed pod counts: the list replaces the known ones.
        i.begin_relist();
        assert!(i.upsert(pod("c", "z")));
        i.end_relist();
        assert!(!i.upsert(pod("c", "z")));
    }

    #[test]
    fn events_update_delete_and_a_relist_replaces_only_when_complete() {
        let i = PodFactsIndex::default();
        i.upsert(pod("a", "x"));
        i.upsert(pod("b", "x"));
        i.upsert(pod("a", "y"));
        assert_eq!(
            names(&i),
            [("a".into(), "y".into()), ("b".into(), "x".into())]
        );
        i.remove("ns", "b");
        assert_eq!(names(&i), [("a".into(), "y".into())]);
        // A relist: `a` is gone and `c` new, but only once the list is complete.
        i.begin_relist();
        i.upsert(pod("c", "z"));
        assert_eq!(
            names(&i),
            [("a".into(), "y".into())],
            "the last full state served"
        );
        i.end_relist();
        assert_eq!(names(&i), [("c".into(), "z".into())]);
    }
}
