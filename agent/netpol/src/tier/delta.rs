//! The tier by difference: what one computation of a peer's tier leaves for the next
//! ([`Kept`]), so that a change of pods alone (a pod relabelled, created, deleted, given another
//! address) rewrites only the sets whose classes it touched, as linkerd's policy index updates
//! only what an event touches.
//!
//! Everything the tier decides is decided per *class* (`tier/pods.rs`: pods alike in
//! namespace, labels, container ports and side of the gateway), and every set whose source is
//! [`Source::Classes`] or [`Source::Far`] holds exactly the addresses of its classes' pods. So
//! when the other inputs (policies, namespaces, ClusterNetworkPolicies, the peer's remaps, the
//! audit setting) are the very ones of the last computation, the chains stay those of the last
//! computation as long as no class a policy applies to comes or goes, and the tier is the last
//! one with the touched sets' elements computed again from their classes:
//! - a pod that leaves and joins classes that existed and stay non-empty moves its addresses;
//! - a class that comes (a pod whose shape no pod had: a pod relabelled to labels of its own)
//!   or goes (its last pod relabelled or deleted) where no policy and no ClusterNetworkPolicy
//!   selects it as its own pods joins or leaves the far ends of the rules whose peers select
//!   it ([`Far`]), and nothing else: only a policy's own pods decide its rules, its isolation
//!   and its named ports (but for an egress rule's named port, resolved on the far end: then
//!   classes never come or go by difference).
//!
//! Anything else is computed whole, as [`super::tier`] does: a class a policy applies to
//! coming or going, a set that would appear or vanish in a family, a set with more than pods'
//! addresses ([`Source::Fixed`]) among the touched, chains that read pods one by one, more
//! than [`MAX_CHANGES`] pods changed, more classes gone than alive. The random test in
//! `tier/tests.rs` holds the two equal over random clusters and random pod changes.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use peerwall_intent::types as api;

use super::super::{cnp, Cluster, ContainerPort, NetworkPolicy, Peer, Pod, Remap};
use super::pods::{Group, Index};
use super::sets::{Addrs, Far, Names, Source};
use super::{built, Unenforced};

/// Changed pods beyond which the tier is computed whole (the difference would cost as much).
pub const MAX_CHANGES: usize = 512;

/// How a tier was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    /// Computed whole.
    Computed,
    /// Nothing it reads changed: the last one.
    Unchanged,
    /// From the last one: `pods` pods changed, `sets` sets' elements rewritten.
    ByDifference {
        /// Pods that came, went or changed.
        pods: usize,
        /// Sets whose elements changed.
        sets: usize,
    },
}

impl std::fmt::Display for How {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Computed => f.write_str("computed"),
            Self::Unchanged => f.write_str("unchanged"),
            Self::ByDifference { pods, sets } => {
                write!(f, "by difference ({pods} pods, {sets} sets)")
            }
        }
    }
}

/// What the tier reads besides pods, as the last computation read it.
struct Inputs {
    namespaces: BTreeMap<String, BTreeMap<String, String>>,
    policies: Vec<Arc<NetworkPolicy>>,
    cluster_policies: Vec<cnp::ClusterNetworkPolicy>,
    remaps: Vec<Remap>,
}

impl Inputs {
    fn of(cluster: &Cluster, peer: &str) -> Self {
        Self {
            namespaces: cluster.namespaces.clone(),
            policies: cluster.policies.clone(),
            cluster_policies: cluster.cluster_policies.clone(),
            remaps: cluster.remaps.get(peer).cloned().unwrap_or_default(),
        }
    }

    /// Whether `cluster` holds the same (policies: the same objects, or equal ones).
    fn same(&self, cluster: &Cluster, peer: &str) -> bool {
        self.policies.len() == cluster.policies.len()
            && self
                .policies
                .iter()
                .zip(&cluster.policies)
                .all(|(a, b)| Arc::ptr_eq(a, b) || a == b)
            && self.namespaces == cluster.namespaces
            && self.cluster_policies == cluster.cluster_policies
            && self.remaps.as_slice() == cluster.remaps.get(peer).map_or(&[][..], Vec::as_slice)
    }
}

/// One class as kept: its shape and its pods.
struct KeptClass {
    namespace: String,
    labels: BTreeMap<String, String>,
    ports: Vec<ContainerPort>,
    remote: bool,
    members: Vec<Arc<Pod>>,
}

impl KeptClass {
    fn of(p: &Pod) -> Self {
        Self {
            namespace: p.namespace.clone(),
            labels: p.labels.clone(),
            ports: p.ports.clone(),
            remote: p.peer.is_some(),
            members: Vec::new(),
        }
    }

    fn holds_shape_of(&self, p: &Pod) -> bool {
        self.namespace == p.namespace
            && self.remote == p.peer.is_some()
            && self.labels == p.labels
            && self.ports == p.ports
    }

    /// Whether a policy or a ClusterNetworkPolicy of `cluster` applies to its pods.
    fn selected_as_own(&self, cluster: &Cluster) -> bool {
        cluster
            .policies
            .iter()
            .any(|p| p.namespace == self.namespace && p.pod_selector.matches(&self.labels))
            || cluster.cluster_policies.iter().any(|cp| {
                let pod = Pod {
                    namespace: self.namespace.clone(),
                    labels: self.labels.clone(),
                    ..Pod::default()
                };
                cp.selects(&pod, cluster.namespaces.get(&self.namespace))
            })
    }

    /// Whether the far end `far` holds its pods (as `tier::pods::Index::peer_pods` and the
    /// side filter of a rule's far set decide).
    fn in_far(&self, far: &Far, cluster: &Cluster) -> bool {
        far.remote_own.is_none_or(|r| self.remote != r)
            && far.peers.iter().any(|p| match p {
                Peer::Block(_) => false,
                Peer::Pods { namespaces, pods } => {
                    cluster.peer_namespace_holds(&far.ns, namespaces.as_ref(), &self.namespace)
                        && pods.as_ref().is_none_or(|s| s.matches(&self.labels))
                }
            })
    }
}

/// A peer's tier and what its next computation by difference needs.
pub struct Kept {
    peer: String,
    audit: bool,
    inputs: Inputs,
    /// The crossing pods, in the cluster's order.
    pods: Vec<Arc<Pod>>,
    classes: Vec<KeptClass>,
    by_ns: HashMap<String, Vec<u32>>,
    /// Each definition's set names and source.
    sources: Vec<(Names, Source)>,
    /// Classes emptied (left in `classes`, out of `by_ns` and every group).
    gone: usize,
    per_pod: bool,
    far_ports: bool,
    spec: Arc<api::FirewallConfigurationSpec>,
    unenforced: Vec<Unenforced>,
    how: How,
}

/// The pods crossing `peer`'s gateway where a policy may select them, shared.
fn crossing(cluster: &Cluster, peer: &str) -> Vec<Arc<Pod>> {
    super::crossing_if_read(cluster, peer)
        .into_iter()
        .cloned()
        .collect()
}

/// Pods gone, pods come.
type Changed<'a> = (&'a [Arc<Pod>], &'a [Arc<Pod>]);

/// The pods of `old` not in `new` and those of `new` not in `old` (by identity), when they
/// lie in one window between a common head and tail of both (how a view by difference
/// changes: in place, or one pod in or out), and are at most [`MAX_CHANGES`].
fn changed<'a>(old: &'a [Arc<Pod>], new: &'a [Arc<Pod>]) -> Option<Changed<'a>> {
    let head = old
        .iter()
        .zip(new)
        .take_while(|(a, b)| Arc::ptr_eq(a, b))
        .count();
    let tail = old[head..]
        .iter()
        .rev()
        .zip(new[head..].iter().rev())
        .take_while(|(a, b)| Arc::ptr_eq(a, b))
        .count();
    let gone = &old[head..old.len() - tail];
    let came = &new[head..new.len() - tail];
    (gone.len() + came.len() <= MAX_CHANGES).then_some((gone, came))
}

impl Kept {
    /// `peer`'s tier computed whole.
    pub fn compute(cluster: &Cluster, peer: &str, audit: bool) -> Self {
        let pods = crossing(cluster, peer);
        let index = Index::new(pods.iter().map(|p| &**p).collect());
        let (tier, sources, traits) = built(cluster, peer, audit, &index);
        let mut by_ns: HashMap<String, Vec<u32>> = HashMap::new();
        let classes = index
            .classes
            .iter()
            .enumerate()
            .filter_map(|(k, c)| {
                let first = index.pods[*c.pods.first()?];
                by_ns
                    .entry(first.namespace.clone())
                    .or_default()
                    .push(u32::try_from(k).ok()?);
                Some(KeptClass {
                    namespace: first.namespace.clone(),
                    labels: c.labels.clone(),
                    ports: c.ports.to_vec(),
                    remote: c.remote,
                    members: c.pods.iter().map(|&i| pods[i].clone()).collect(),
                })
            })
            .collect();
        Self {
            peer: peer.to_string(),
            audit,
            inputs: Inputs::of(cluster, peer),
            pods,
            classes,
            by_ns,
            sources,
            gone: 0,
            per_pod: traits.per_pod.get(),
            far_ports: traits.far_ports.get(),
            spec: Arc::new(tier.spec),
            unenforced: tier.unenforced,
            how: How::Computed,
        }
    }

    /// `peer`'s tier for `cluster`: by difference from this one where only pods changed and
    /// the chains stay as they are, computed whole otherwise.
    pub fn next(self, cluster: &Cluster, peer: &str, audit: bool) -> Self {
        self.by_difference(cluster, peer, audit)
            .unwrap_or_else(|| Self::compute(cluster, peer, audit))
    }

    /// The tier (shared with whoever keeps it).
    pub fn spec(&self) -> &Arc<api::FirewallConfigurationSpec> {
        &self.spec
    }

    /// What of the policies it could not express.
    pub fn unenforced(&self) -> &[Unenforced] {
        &self.unenforced
    }

    /// How it was made.
    pub fn how(&self) -> How {
        self.how
    }

    /// The class of `p`'s shape, if there is one.
    fn class_of(&self, p: &Pod) -> Option<u32> {
        self.by_ns
            .get(&p.namespace)?
            .iter()
            .copied()
            .find(|&k| self.classes[k as usize].holds_shape_of(p))
    }

    fn by_difference(mut self, cluster: &Cluster, peer: &str, audit: bool) -> Option<Self> {
        if self.peer != peer || self.audit != audit || !self.inputs.same(cluster, peer) {
            return None;
        }
        let pods = crossing(cluster, peer);
        let (gone, came) = changed(&self.pods, &pods)?;
        if gone.is_empty() && came.is_empty() {
            self.how = How::Unchanged;
            return Some(self);
        }
        if self.per_pod {
            return None;
        }
        let mut touched = Vec::with_capacity(gone.len() + came.len());
        for p in gone {
            let k = self.class_of(p)?;
            let members = &mut self.classes[k as usize].members;
            let at = members.iter().position(|m| Arc::ptr_eq(m, p))?;
            members.swap_remove(at);
            touched.push(k);
        }
        let mut born = Vec::new();
        for p in came {
            let k = match self.class_of(p) {
                Some(k) => k,
                None => {
                    let k = u32::try_from(self.classes.len()).ok()?;
                    self.classes.push(KeptClass::of(p));
                    self.by_ns.entry(p.namespace.clone()).or_default().push(k);
                    born.push(k);
                    k
                }
            };
            self.classes[k as usize].members.push(p.clone());
            touched.push(k);
        }
        let touched = Group::of(touched);
        let emptied: Vec<u32> = touched
            .iter()
            .filter(|&k| self.classes[k as usize].members.is_empty())
            .collect();
        let changes = gone.len() + came.len();
        let lost = if born.is_empty() && emptied.is_empty() {
            Vec::new()
        } else {
            self.regroup(cluster, &born, &emptied)?
        };
        let (spec, sets) = self.rewritten(&touched, &lost)?;
        self.spec = spec;
        self.pods = pods;
        self.how = How::ByDifference {
            pods: changes,
            sets,
        };
        Some(self)
    }

    /// Classes `born` join the far ends that hold them and classes `emptied` leave every group
    /// (they stay numbered, out of the index); the definitions whose group lost a class. None
    /// where the chains could change: a policy applies to one of them, an egress rule resolves
    /// a named port on its far end, a set with more than pods' addresses holds one, or the
    /// classes gone outnumber those alive (then the whole tier is computed again, afresh).
    fn regroup(&mut self, cluster: &Cluster, born: &[u32], emptied: &[u32]) -> Option<Vec<usize>> {
        if self.far_ports {
            return None;
        }
        let classes = &self.classes;
        if born
            .iter()
            .chain(emptied)
            .any(|&k| classes[k as usize].selected_as_own(cluster))
        {
            return None;
        }
        let mut lost = Vec::new();
        for (i, (_, source)) in self.sources.iter_mut().enumerate() {
            match source {
                Source::Classes(g) => {
                    if emptied.iter().any(|&k| g.contains(k)) {
                        return None;
                    }
                }
                Source::Far(g, far) => {
                    let mut left = false;
                    for &k in emptied {
                        left |= g.remove(k);
                    }
                    if left {
                        lost.push(i);
                    }
                    for &k in born {
                        if classes[k as usize].in_far(far, cluster) {
                            g.insert(k);
                        }
                    }
                }
                Source::Fixed(g, far) => {
                    let joins = |k: &u32| {
                        far.as_ref()
                            .is_some_and(|f| classes[*k as usize].in_far(f, cluster))
                    };
                    if emptied.iter().any(|&k| g.contains(k)) || born.iter().any(joins) {
                        return None;
                    }
                }
            }
        }
        for &k in emptied {
            let ns = &self.classes[k as usize].namespace;
            if let Some(v) = self.by_ns.get_mut(ns) {
                v.retain(|&x| x != k);
            }
        }
        self.gone += emptied.len();
        (self.gone * 2 <= self.classes.len()).then_some(lost)
    }

    /// The tier with the sets of the definitions `touched` classes are in, or whose group
    /// `lost` a class, computed again, and how many changed; None where a set would appear or
    /// vanish, or is not its classes' alone.
    fn rewritten(
        &self,
        touched: &Group,
        lost: &[usize],
    ) -> Option<(Arc<api::FirewallConfigurationSpec>, usize)> {
        let mut spec: Option<api::FirewallConfigurationSpec> = None;
        let mut at: HashMap<&str, usize> = HashMap::new();
        let mut sets = 0;
        for (i, (names, source)) in self.sources.iter().enumerate() {
            let hit = |g: &Group| g.iter().any(|k| touched.contains(k)) || lost.contains(&i);
            let classes = match source {
                Source::Classes(g) | Source::Far(g, _) if hit(g) => g,
                Source::Fixed(g, _) if hit(g) => return None,
                _ => continue,
            };
            let mut a = Addrs::default();
            for k in classes.iter() {
                for p in &self.classes[k as usize].members {
                    for ip in &p.ips {
                        a.add_ip(*ip);
                    }
                }
            }
            for (fi, v4) in [true, false].into_iter().enumerate() {
                let keys = a.keys(v4);
                let name = match (&names[fi], keys.is_empty()) {
                    (None, true) => continue,
                    (Some(name), false) => name,
                    // A set would appear or vanish, and with it rules.
                    _ => return None,
                };
                let spec = spec.get_or_insert_with(|| (*self.spec).clone());
                if at.is_empty() {
                    at = self
                        .spec
                        .table
                        .sets
                        .iter()
                        .enumerate()
                        .map(|(i, s)| (s.name.as_str(), i))
                        .collect();
                }
                let set = &mut spec.table.sets[*at.get(name.as_str())?];
                let elements: Vec<api::SetElement> = keys
                    .into_iter()
                    .map(|key| api::SetElement { key, data: None })
                    .collect();
                if set.elements != elements {
                    set.elements = elements;
                    sets += 1;
                }
            }
        }
        let spec = spec.map_or_else(|| self.spec.clone(), Arc::new);
        Some((spec, sets))
    }
}
