//! The cluster's pods as NetworkPolicies see them, kept by difference ([`ClusterIndex`]): a pod
//! event re-derives that pod, a virtual node that changes its peer re-derives the pods on it,
//! a peer whose remaps change re-derives the pods running there; nothing else is touched. A
//! view is then one shared pointer per pod ([`ClusterIndex::pods`]), not a copy of each, and
//! dropping an old view frees nothing but the pointers. What it must equal is the full
//! recompute, [`super::cluster`] (the tests below drive both with random event sequences).
//!
//! Pure: no kube types, no I/O; the controller's pod watch and caches feed it
//! (`controller/pod_facts.rs`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use super::{derive, PodFacts};
use crate::netpol;
use crate::protection::Remap;

/// A pod's namespace and name.
pub type Key = (String, String);

/// Every pod's facts and what NetworkPolicies see of it, kept by difference.
#[derive(Debug, Default)]
pub struct ClusterIndex {
    facts: BTreeMap<Key, Arc<PodFacts>>,
    /// The peer of each virtual node, and each peer's remaps, as of the last
    /// [`Self::set_context`]: what every pod in `derived` was derived with.
    vnodes: BTreeMap<String, String>,
    remaps: BTreeMap<String, Vec<Remap>>,
    /// [`derive()`] of each pod that takes part (running, with an address).
    derived: BTreeMap<Key, Arc<netpol::Pod>>,
    /// The pods (with facts) on each node, whatever the node is: a node turning virtual, or
    /// changing its peer, re-derives them.
    on_node: HashMap<String, BTreeSet<Key>>,
    /// How many derived pods each namespace holds.
    namespaces: BTreeMap<String, usize>,
}

impl ClusterIndex {
    /// A pod added or changed; false when its facts are those already known (a status update
    /// of nothing the tier reads: a condition, a container's restart count).
    pub fn upsert(&mut self, facts: Arc<PodFacts>) -> bool {
        let key = (facts.namespace.clone(), facts.name.clone());
        if self.facts.get(&key) == Some(&facts) {
            return false;
        }
        if let Some(old) = self.facts.insert(key.clone(), facts.clone()) {
            if old.node != facts.node {
                self.leave_node(&old.node, &key);
            }
        }
        if let Some(n) = &facts.node {
            self.on_node
                .entry(n.clone())
                .or_default()
                .insert(key.clone());
        }
        self.rederive(&key);
        true
    }

    /// A pod deleted; false when it was not known.
    pub fn remove(&mut self, namespace: &str, name: &str) -> bool {
        let key = (namespace.to_string(), name.to_string());
        let Some(old) = self.facts.remove(&key) else {
            return false;
        };
        self.leave_node(&old.node, &key);
        self.rederive(&key);
        true
    }

    /// Every pod at once (a relist completed): those absent are removed, the others upserted;
    /// O(pods) once, each pod re-derived only where its facts changed.
    pub fn replace_all(&mut self, listed: BTreeMap<Key, Arc<PodFacts>>) {
        for (ns, name) in
            crate::protection::index::absent_keys(self.facts.keys(), |k| listed.contains_key(k))
        {
            self.remove(&ns, &name);
        }
        for (_, f) in listed {
            self.upsert(f);
        }
    }

    /// The virtual nodes' peers and the peers' remaps as the caches show them now: the pods
    /// on a node whose peer changed, and on the nodes of a peer whose remaps changed, are
    /// re-derived; nothing else.
    pub fn set_context(
        &mut self,
        vnodes: BTreeMap<String, String>,
        remaps: &BTreeMap<String, Vec<Remap>>,
    ) {
        let mut touched: BTreeSet<&str> = BTreeSet::new();
        for n in self.vnodes.keys().chain(vnodes.keys()) {
            if self.vnodes.get(n) != vnodes.get(n) {
                touched.insert(n);
            }
        }
        let peers: BTreeSet<&String> = self
            .remaps
            .keys()
            .chain(remaps.keys())
            .filter(|p| self.remaps.get(*p) != remaps.get(*p))
            .collect();
        for (n, p) in self.vnodes.iter().chain(&vnodes) {
            if peers.contains(p) {
                touched.insert(n);
            }
        }
        let keys: BTreeSet<Key> = touched
            .iter()
            .filter_map(|n| self.on_node.get(*n))
            .flatten()
            .cloned()
            .collect();
        self.vnodes = vnodes;
        if !peers.is_empty() {
            self.remaps = remaps.clone();
        }
        for k in keys {
            self.rederive(&k);
        }
    }

    /// The derived pods, in namespace and name order (shared, not copied).
    pub fn pods(&self) -> Vec<Arc<netpol::Pod>> {
        self.derived.values().cloned().collect()
    }

    /// The namespaces holding at least one derived pod.
    pub fn pod_namespaces(&self) -> impl Iterator<Item = &str> {
        self.namespaces.keys().map(String::as_str)
    }

    /// Every pod's facts, in namespace and name order.
    pub fn facts(&self) -> impl Iterator<Item = &Arc<PodFacts>> {
        self.facts.values()
    }

    fn leave_node(&mut self, node: &Option<String>, key: &Key) {
        let Some(n) = node else {
            return;
        };
        if let Some(keys) = self.on_node.get_mut(n) {
            keys.remove(key);
            if keys.is_empty() {
                self.on_node.remove(n);
            }
        }
    }

    /// Derive `key` again from its facts and the context: replaced, added or removed.
    fn rederive(&mut self, key: &Key) {
        let now = self
            .facts
            .get(key)
            .and_then(|f| derive(f, &self.vnodes, &self.remaps));
        let before = match now {
            Some(p) => {
                if self.derived.get(key).is_some_and(|old| **old == p) {
                    return;
                }
                self.derived.insert(key.clone(), Arc::new(p))
            }
            None => self.derived.remove(key),
        };
        let added = self.derived.contains_key(key);
        match (before.is_some(), added) {
            (false, true) => *self.namespaces.entry(key.0.clone()).or_default() += 1,
            (true, false) => {
                if let Some(n) = self.namespaces.get_mut(&key.0) {
                    *n -= 1;
                    if *n == 0 {
                        self.namespaces.remove(&key.0);
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests;
