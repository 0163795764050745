//! The pods whose traffic crosses a gateway, indexed for selectors: by namespace, and within
//! it by *class* (the pods alike in everything but their addresses: namespace, labels,
//! container ports and side of the gateway; a Deployment's replicas, a Job's pods). Selectors,
//! named ports and the local/peer split are decided once per class, not once per pod, and the
//! sets of pods the tier works with are sets of classes ([`Group`]): its cost follows the
//! number of distinct pod shapes, and only a set's addresses are gathered pod by pod.
//!
//! Building the index is the tier's one pass over every pod: a pod alike to the one before it
//! (replicas sort together by name) joins its class without hashing, and the rest hash with
//! foldhash, not SipHash. Labels are written by whoever may create a pod, so the hasher stays
//! seeded at random (foldhash's `RandomState`: a random seed per process and one per map).
//! foldhash is only minimally DoS-resistant, which holds here: the map lives for one tier
//! computation, and a pod's author cannot time the controller's maps to learn seeds.

use std::collections::{BTreeMap, HashMap};

use super::super::{Cluster, ContainerPort, Peer, Pod, Protocol, Selector};

/// What makes pods alike: namespace, labels, container ports, on the peer or not.
type Shape<'a> = (
    &'a str,
    &'a BTreeMap<String, String>,
    &'a [ContainerPort],
    bool,
);

type ClassMap<'a> = HashMap<Shape<'a>, u32, foldhash::fast::RandomState>;

/// Pods alike in everything the tier decides by (indexes into [`Index::pods`]).
pub(super) struct Class<'a> {
    pub(super) labels: &'a BTreeMap<String, String>,
    pub(super) ports: &'a [ContainerPort],
    /// Whether its pods run on the peer.
    pub(super) remote: bool,
    pub(super) pods: Vec<usize>,
    /// Every address of its pods, side by side: a set's addresses are gathered from these
    /// (one pass over contiguous memory), not pod by pod through each pod's record.
    pub(super) ips: Vec<std::net::IpAddr>,
}

impl Class<'_> {
    /// The number its pods' container port `name` of `protocol` has.
    pub(super) fn named_port(&self, name: &str, protocol: Protocol) -> Option<u16> {
        super::super::named_port_in(self.ports, name, protocol)
    }
}

/// A set of pods, as the classes holding them (sorted, unique class numbers).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Group(Vec<u32>);

impl Group {
    /// The group of the classes `c` (any order, repeats allowed).
    pub(super) fn of(mut c: Vec<u32>) -> Self {
        c.sort_unstable();
        c.dedup();
        Self(c)
    }
    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub(super) fn contains(&self, class: u32) -> bool {
        self.0.binary_search(&class).is_ok()
    }
    pub(super) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().copied()
    }
    pub(super) fn is_subset(&self, other: &Self) -> bool {
        self.0.iter().all(|c| other.contains(*c))
    }
    /// The classes of both (already sorted).
    pub(super) fn intersection(&self, other: &Self) -> Self {
        Self(self.iter().filter(|c| other.contains(*c)).collect())
    }
    /// Add class `k`; whether it was not there.
    pub(super) fn insert(&mut self, k: u32) -> bool {
        match self.0.binary_search(&k) {
            Ok(_) => false,
            Err(at) => {
                self.0.insert(at, k);
                true
            }
        }
    }
    /// Take class `k` out; whether it was there.
    pub(super) fn remove(&mut self, k: u32) -> bool {
        match self.0.binary_search(&k) {
            Ok(at) => {
                self.0.remove(at);
                true
            }
            Err(_) => false,
        }
    }
    /// The classes `keep` keeps (already sorted).
    pub(super) fn filter(&self, keep: impl Fn(u32) -> bool) -> Self {
        Self(self.iter().filter(|c| keep(*c)).collect())
    }
}

/// Pods by namespace and class.
pub(super) struct Index<'a> {
    /// The crossing pods; every pod index of this module points into it.
    pub(super) pods: Vec<&'a Pod>,
    /// Every class; a [`Group`] holds indexes into it.
    pub(super) classes: Vec<Class<'a>>,
    by_ns: HashMap<&'a str, Vec<u32>, foldhash::fast::RandomState>,
}

impl<'a> Index<'a> {
    pub(super) fn new(pods: Vec<&'a Pod>) -> Self {
        let mut by_ns: HashMap<&str, Vec<u32>, foldhash::fast::RandomState> = HashMap::default();
        let mut classes: Vec<Class> = Vec::new();
        let mut class_of = ClassMap::default();
        // The pod before: its shape and class.
        let mut last: Option<(Shape, u32)> = None;
        for (i, p) in pods.iter().enumerate() {
            let shape: Shape = (
                p.namespace.as_str(),
                &p.labels,
                p.ports.as_slice(),
                p.peer.is_some(),
            );
            let k = match last {
                Some((s, k)) if s == shape => k,
                _ => *class_of.entry(shape).or_insert_with(|| {
                    // Class numbers fit: a cluster holds far fewer than 2^32 pods.
                    let k = u32::try_from(classes.len()).unwrap_or(u32::MAX);
                    classes.push(Class {
                        labels: &p.labels,
                        ports: &p.ports,
                        remote: p.peer.is_some(),
                        pods: Vec::new(),
                        ips: Vec::new(),
                    });
                    by_ns.entry(shape.0).or_default().push(k);
                    k
                }),
            };
            let class = &mut classes[k as usize];
            class.pods.push(i);
            class.ips.extend_from_slice(&p.ips);
            last = Some((shape, k));
        }
        Self {
            pods,
            classes,
            by_ns,
        }
    }

    /// The class numbered `k`.
    pub(super) fn class(&self, k: u32) -> &Class<'a> {
        &self.classes[k as usize]
    }

    /// Every class whose pods `keep` keeps.
    pub(super) fn all(&self, keep: impl Fn(u32, &Class<'a>) -> bool) -> Group {
        Group(
            (0..self.classes.len())
                .filter_map(|k| u32::try_from(k).ok())
                .filter(|&k| keep(k, self.class(k)))
                .collect(),
        )
    }

    /// The pods of namespace `ns` that `sel` selects.
    pub(super) fn selected(&self, ns: &str, sel: &Selector) -> Group {
        Group(
            self.by_ns
                .get(ns)
                .into_iter()
                .flatten()
                .copied()
                .filter(|&k| sel.matches(self.class(k).labels))
                .collect(),
        )
    }

    /// The pods the pod peers of a policy in `ns` select (its `ipBlock`s select none here).
    pub(super) fn peer_pods(&self, cluster: &Cluster, ns: &str, peers: &[Peer]) -> Group {
        let mut out = Vec::new();
        for peer in peers {
            let Peer::Pods { namespaces, pods } = peer else {
                continue;
            };
            // The namespaces the peer can select: its policy's, or those its selector matches
            // ([`Cluster::peer_selects_pod`], one namespace at a time).
            let candidates: Vec<&Vec<u32>> = match namespaces {
                None => self.by_ns.get(ns).into_iter().collect(),
                Some(_) => self
                    .by_ns
                    .iter()
                    .filter(|(n, _)| cluster.peer_namespace_holds(ns, namespaces.as_ref(), n))
                    .map(|(_, v)| v)
                    .collect(),
            };
            for classes in candidates {
                out.extend(classes.iter().copied().filter(|&k| {
                    pods.as_ref()
                        .is_none_or(|s| s.matches(self.class(k).labels))
                }));
            }
        }
        Group::of(out)
    }
}
