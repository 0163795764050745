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
use crate::protection::{self, Remap};

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
    /// How many derived pods of each peer (running on its virtual nodes) each namespace
    /// holds: the namespaces [`Self::namespace_sets`] reads.
    on_peer: BTreeMap<String, BTreeMap<String, usize>>,
    /// `derived`'s pods as one shared list in key order, what [`Self::pods`] hands out, and
    /// the keys re-derived since it was last brought up to date.
    list: netpol::Pods,
    stale: BTreeSet<Key>,
}

/// Past this many re-derived pods since the last view (a relist, a peer's remaps), the list is
/// rebuilt whole rather than edited pod by pod (each edit moves the list's tail). Small under
/// test, so that the random tests take both ways.
#[cfg(not(test))]
const REBUILD_PAST: usize = 256;
#[cfg(test)]
const REBUILD_PAST: usize = 4;

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

    /// The pods as NetworkPolicies see them, in namespace and name order: one shared list,
    /// brought up to date by the pods re-derived since the last call (O(changes) while no view
    /// still holds the last list; a view that does is left as it was, and the list is copied
    /// once).
    pub fn pods(&mut self) -> netpol::Pods {
        if self.stale.len() > REBUILD_PAST {
            self.stale.clear();
            self.list = self.derived.values().cloned().collect();
        }
        let stale = std::mem::take(&mut self.stale);
        if !stale.is_empty() {
            let list: &mut Vec<Arc<netpol::Pod>> = &mut self.list;
            for key in stale {
                let at = list.binary_search_by(|p| {
                    (p.namespace.as_str(), p.name.as_str()).cmp(&(key.0.as_str(), key.1.as_str()))
                });
                match (at, self.derived.get(&key)) {
                    (Ok(i), Some(p)) => list[i] = p.clone(),
                    (Ok(i), None) => {
                        list.remove(i);
                    }
                    (Err(i), Some(p)) => list.insert(i, p.clone()),
                    (Err(_), None) => {}
                }
            }
        }
        self.list.clone()
    }

    /// The namespaces holding at least one derived pod.
    pub fn pod_namespaces(&self) -> impl Iterator<Item = &str> {
        self.namespaces.keys().map(String::as_str)
    }

    /// [`protection::namespaces::namespace_sets`] of the view: the same sets, read from the
    /// namespaces holding pods of `peer` alone (the full function reads every pod of the
    /// cluster, ~10 ms at 100k pods on every pass). `tenant` tells a tenant namespace, from
    /// the namespaces' labels ([`protection::namespaces::is_tenant`] of the view).
    pub fn namespace_sets(
        &self,
        peer: &str,
        tenant: impl Fn(&str) -> bool,
    ) -> BTreeMap<String, protection::namespaces::NsSets> {
        let mut out = BTreeMap::new();
        let Some(namespaces) = self.on_peer.get(peer) else {
            return out;
        };
        for ns in namespaces.keys().filter(|ns| !tenant(ns)) {
            let mut sets = protection::namespaces::NsSets::default();
            let first = (ns.clone(), String::new());
            for (_, p) in self
                .derived
                .range(first..)
                .take_while(|((n, _), _)| n == ns)
            {
                protection::namespaces::add_pod(&mut sets, p, peer);
            }
            out.insert(ns.clone(), sets);
        }
        out
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
        self.stale.insert(key.clone());
        if let Some(p) = before.as_ref().and_then(|b| b.peer.as_ref()) {
            let gone = self.on_peer.get_mut(p).is_some_and(|by_ns| {
                count_down(by_ns, &key.0);
                by_ns.is_empty()
            });
            if gone {
                self.on_peer.remove(p);
            }
        }
        if let Some(p) = self.derived.get(key).and_then(|d| d.peer.clone()) {
            *self
                .on_peer
                .entry(p)
                .or_default()
                .entry(key.0.clone())
                .or_default() += 1;
        }
        let added = self.derived.contains_key(key);
        match (before.is_some(), added) {
            (false, true) => *self.namespaces.entry(key.0.clone()).or_default() += 1,
            (true, false) => count_down(&mut self.namespaces, &key.0),
            _ => {}
        }
    }
}

/// One less of `name` in `counts`, gone at zero.
fn count_down(counts: &mut BTreeMap<String, usize>, name: &str) {
    if let Some(n) = counts.get_mut(name) {
        *n -= 1;
        if *n == 0 {
            counts.remove(name);
        }
    }
}

#[cfg(test)]
mod tests;
