//! Every peer's desired address sets, kept up to date event by event: the incremental form of
//! [`super::sets`], which stays the specification (the tests check that both agree after any
//! sequence of events).
//!
//! A pod event costs O(its addresses × peers): its old contribution leaves, its new one
//! joins, and the addresses whose membership changed are remembered per peer until the
//! controller takes them ([`DesiredIndex::take_changes`]). Namespaces, virtual nodes and
//! remaps are few and rarely change; a change that matters re-derives everything and asks
//! every peer for a full comparison ([`Changes::Resync`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use super::{
    is_tenant, offloaded_namespace_owner, real_address, Namespace, Node, PeerSets, Pod, Remap,
    REMOTE_CLUSTER_ID,
};

/// Which set of a peer's gateway configuration an address belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// A pod the peer offloaded here.
    Offloaded,
    /// Our pod running on the peer.
    Remote,
    /// Our pod running on another peer.
    Elsewhere,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Kind; 3] = [Kind::Offloaded, Kind::Remote, Kind::Elsewhere];

    /// The IPv4 set's name (the IPv6 one ends in `6`).
    pub fn base_name(self) -> &'static str {
        match self {
            Kind::Offloaded => "offloaded",
            Kind::Remote => "remote",
            Kind::Elsewhere => "elsewhere",
        }
    }

    /// The IPv6 set's name (the IPv4 one's, ending in `6`).
    pub fn v6_name(self) -> String {
        format!("{}6", self.base_name())
    }

    /// The name of the set holding `ip` ([`super::set_contents`]'s naming).
    pub fn set_name(self, ip: IpAddr) -> String {
        if ip.is_ipv6() {
            self.v6_name()
        } else {
            self.base_name().to_string()
        }
    }

    /// The kind and family of a set name, if it is one of the gateway configuration's.
    pub fn of_set(name: &str) -> Option<(Kind, bool)> {
        let (base, v6) = match name.strip_suffix('6') {
            Some(b) => (b, true),
            None => (name, false),
        };
        Kind::ALL
            .into_iter()
            .find(|k| k.base_name() == base)
            .map(|k| (k, v6))
    }

    fn of(self, s: &mut PeerSets) -> &mut BTreeSet<IpAddr> {
        match self {
            Kind::Offloaded => &mut s.offloaded,
            Kind::Remote => &mut s.remote,
            Kind::Elsewhere => &mut s.elsewhere,
        }
    }
}

/// A pod's identity: namespace and name.
pub type PodKey = (String, String);

/// What changed for one peer since the controller last asked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Changes {
    /// Nothing.
    #[default]
    None,
    /// These addresses of these sets may have joined or left.
    Addresses(BTreeSet<(Kind, IpAddr)>),
    /// Anything may have changed: compare every address.
    Resync,
}

impl Changes {
    fn add(&mut self, k: Kind, ip: IpAddr) {
        match self {
            Changes::None => *self = Changes::Addresses(BTreeSet::from([(k, ip)])),
            Changes::Addresses(s) => {
                s.insert((k, ip));
            }
            Changes::Resync => {}
        }
    }

    /// Both: what either holds.
    pub fn merge(&mut self, other: Changes) {
        match other {
            Changes::None => {}
            Changes::Resync => *self = Changes::Resync,
            Changes::Addresses(s) => {
                for (k, ip) in s {
                    self.add(k, ip);
                }
            }
        }
    }
}

/// The desired sets of every peer, maintained from events.
#[derive(Debug, Default)]
pub struct DesiredIndex {
    namespaces: BTreeMap<String, Namespace>,
    virtual_nodes: BTreeMap<String, Node>,
    remaps: BTreeMap<String, Vec<Remap>>,
    pods: HashMap<PodKey, Pod>,
    /// Derived from the namespaces: the peers (remote cluster ids with a tenant namespace).
    peers: BTreeSet<String>,
    /// Per peer and set kind: address → how many pods contribute it.
    counts: BTreeMap<String, BTreeMap<Kind, HashMap<IpAddr, u32>>>,
    changes: BTreeMap<String, Changes>,
    /// A relist in progress: the pods listed so far.
    relist: Option<HashMap<PodKey, Pod>>,
}

impl DesiredIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// The peers (cluster ids of tenant namespaces).
    pub fn peers(&self) -> &BTreeSet<String> {
        &self.peers
    }

    /// Whether `ip` belongs to `peer`'s set of kind `k`.
    pub fn wants(&self, peer: &str, k: Kind, ip: IpAddr) -> bool {
        self.counts
            .get(peer)
            .and_then(|m| m.get(&k))
            .is_some_and(|m| m.contains_key(&ip))
    }

    /// Every address of `peer`'s set of kind `k` (O(set size): for full comparisons only).
    pub fn members(&self, peer: &str, k: Kind) -> Vec<IpAddr> {
        self.counts
            .get(peer)
            .and_then(|m| m.get(&k))
            .map(|m| m.keys().copied().collect())
            .unwrap_or_default()
    }

    /// How many addresses `peer`'s set of kind `k` holds.
    pub fn len(&self, peer: &str, k: Kind) -> usize {
        self.counts
            .get(peer)
            .and_then(|m| m.get(&k))
            .map_or(0, HashMap::len)
    }

    /// `peer`'s sets, materialised (O(set sizes)).
    pub fn peer_sets(&self, peer: &str) -> PeerSets {
        let mut s = PeerSets::default();
        for k in Kind::ALL {
            k.of(&mut s).extend(self.members(peer, k));
        }
        s
    }

    /// What changed for `peer` since the last call (and forget it).
    pub fn take_changes(&mut self, peer: &str) -> Changes {
        self.changes.remove(peer).unwrap_or_default()
    }

    /// A pod appeared or changed.
    pub fn upsert_pod(&mut self, pod: Pod) {
        if let Some(r) = self.relist.as_mut() {
            r.insert((pod.namespace.clone(), pod.name.clone()), pod);
            return;
        }
        let key = (pod.namespace.clone(), pod.name.clone());
        if self.pods.get(&key) == Some(&pod) {
            return;
        }
        if let Some(old) = self.pods.remove(&key) {
            self.contribute(&old, false);
        }
        self.contribute(&pod, true);
        self.pods.insert(key, pod);
    }

    /// A pod is gone.
    pub fn remove_pod(&mut self, namespace: &str, name: &str) {
        let key = (namespace.to_string(), name.to_string());
        if let Some(r) = self.relist.as_mut() {
            r.remove(&key);
            return;
        }
        if let Some(old) = self.pods.remove(&key) {
            self.contribute(&old, false);
        }
    }

    /// A full list begins (the watch restarted): the pods listed until [`Self::end_relist`]
    /// replace the known ones then. Until then the index keeps serving the last full state,
    /// so a cold or restarting watch never empties a set.
    pub fn begin_relist(&mut self) {
        self.relist = Some(HashMap::new());
    }

    /// The full list is complete: pods not in it are gone. O(pods).
    pub fn end_relist(&mut self) {
        let Some(listed) = self.relist.take() else {
            return;
        };
        for (ns, name) in absent_keys(self.pods.keys(), |k| listed.contains_key(k)) {
            self.remove_pod(&ns, &name);
        }
        for (_, pod) in listed {
            self.upsert_pod(pod);
        }
    }

    /// The current namespaces, virtual nodes and remaps (a full snapshot of each: they are
    /// few). Re-derives everything only when something the sets depend on changed.
    pub fn set_context(
        &mut self,
        namespaces: Vec<Namespace>,
        virtual_nodes: Vec<Node>,
        remaps: BTreeMap<String, Vec<Remap>>,
    ) {
        let namespaces: BTreeMap<String, Namespace> = namespaces
            .into_iter()
            .map(|n| (n.name.clone(), n))
            .collect();
        let virtual_nodes: BTreeMap<String, Node> = virtual_nodes
            .into_iter()
            .map(|n| (n.name.clone(), n))
            .collect();
        if namespaces == self.namespaces
            && virtual_nodes == self.virtual_nodes
            && remaps == self.remaps
        {
            return;
        }
        let old_peers = std::mem::take(&mut self.peers);
        self.namespaces = namespaces;
        self.virtual_nodes = virtual_nodes;
        self.remaps = remaps;
        self.peers = self
            .namespaces
            .values()
            .filter(|n| is_tenant(n))
            .filter_map(|n| n.labels.get(REMOTE_CLUSTER_ID).cloned())
            .collect();
        self.counts.clear();
        let pods = std::mem::take(&mut self.pods);
        for pod in pods.values() {
            self.contribute(pod, true);
        }
        self.pods = pods;
        for p in old_peers.iter().chain(self.peers.clone().iter()) {
            self.changes.insert(p.clone(), Changes::Resync);
        }
    }

    /// The (peer, kind, address) triples `pod` contributes ([`super::sets`]' rules).
    fn contribution(&self, pod: &Pod) -> Vec<(String, Kind, IpAddr)> {
        let mut out = Vec::new();
        let in_tenant = self.namespaces.get(&pod.namespace).is_some_and(is_tenant);
        if pod.gone || pod.ips.is_empty() || in_tenant {
            return out;
        }
        // Ours, running on a peer through its virtual node.
        let vnode_peer = pod
            .node
            .as_deref()
            .and_then(|n| self.virtual_nodes.get(n))
            .and_then(|n| n.labels.get(REMOTE_CLUSTER_ID));
        if let Some(peer) = vnode_peer {
            let remaps = self.remaps.get(peer).map_or(&[][..], Vec::as_slice);
            for id in &self.peers {
                for ip in &pod.ips {
                    if id == peer {
                        out.push((id.clone(), Kind::Remote, real_address(remaps, *ip)));
                    } else {
                        out.push((id.clone(), Kind::Elsewhere, *ip));
                    }
                }
            }
            return out;
        }
        // Offloaded to us by a consumer: in a namespace the consumer owns.
        let owner = super::peers::offloaded_by(
            &pod.labels,
            self.namespaces
                .get(&pod.namespace)
                .and_then(offloaded_namespace_owner),
        );
        if let Some(o) = owner.filter(|o| self.peers.contains(*o)) {
            out.extend(
                pod.ips
                    .iter()
                    .map(|ip| (o.to_string(), Kind::Offloaded, *ip)),
            );
        }
        out
    }

    fn contribute(&mut self, pod: &Pod, join: bool) {
        for (peer, k, ip) in self.contribution(pod) {
            let m = self
                .counts
                .entry(peer.clone())
                .or_default()
                .entry(k)
                .or_default();
            let changed = if join {
                let n = m.entry(ip).or_insert(0);
                *n += 1;
                *n == 1
            } else {
                match m.get_mut(&ip) {
                    Some(n) if *n > 1 => {
                        *n -= 1;
                        false
                    }
                    Some(_) => {
                        m.remove(&ip);
                        true
                    }
                    None => false,
                }
            };
            if changed {
                self.changes.entry(peer).or_default().add(k, ip);
            }
        }
    }
}

/// The keys of `known` that the list lacks (`listed` says which it holds): what a completed
/// relist removes.
pub fn absent_keys<'a, K: Clone + 'a>(
    known: impl IntoIterator<Item = &'a K>,
    listed: impl Fn(&K) -> bool,
) -> Vec<K> {
    known.into_iter().filter(|k| !listed(k)).cloned().collect()
}

#[cfg(test)]
mod tests;
