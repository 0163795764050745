//! The pods whose traffic crosses a gateway, indexed for selectors: by namespace, and within
//! it by *label class* (the pods whose labels are identical: a Deployment's replicas, a Job's
//! pods). A selector is matched once per class, not once per pod, which is what makes the
//! tier's cost follow the number of distinct label sets rather than of pods. Building it is
//! the tier's one pass over every pod: a pod with the same namespace and labels as the one
//! before it (replicas sort together by name) joins its class without hashing, and the rest
//! hash with foldhash, not SipHash. Labels are written by whoever may create a pod, so the
//! hasher stays seeded at random (foldhash's `RandomState`: a random seed per process and one
//! per map). foldhash is only minimally DoS-resistant, which holds here: the map lives for
//! one tier computation, and a pod's author cannot time the controller's maps to learn seeds.

use std::collections::{BTreeMap, BTreeSet, HashMap};

type ClassMap<'a> =
    HashMap<(&'a str, &'a BTreeMap<String, String>), usize, foldhash::fast::RandomState>;

use super::super::{Cluster, Peer, Pod, Selector};

/// The pods of one namespace with one set of labels (indexes into [`Index::pods`]).
struct Class<'a> {
    labels: &'a BTreeMap<String, String>,
    pods: Vec<usize>,
}

/// Pods by namespace and label class.
pub(super) struct Index<'a> {
    /// The crossing pods; every index of this module points into it.
    pub(super) pods: Vec<&'a Pod>,
    by_ns: HashMap<&'a str, Vec<Class<'a>>, foldhash::fast::RandomState>,
}

impl<'a> Index<'a> {
    pub(super) fn new(pods: Vec<&'a Pod>) -> Self {
        let mut by_ns: HashMap<&str, Vec<Class>, foldhash::fast::RandomState> = HashMap::default();
        let mut class_of = ClassMap::default();
        // The class of the pod before: (namespace, labels, class number).
        let mut last: Option<(&str, &BTreeMap<String, String>, usize)> = None;
        for (i, p) in pods.iter().enumerate() {
            let ns = p.namespace.as_str();
            let classes = by_ns.entry(ns).or_default();
            let k = match last {
                Some((n, l, k)) if n == ns && *l == p.labels => k,
                _ => *class_of.entry((ns, &p.labels)).or_insert_with(|| {
                    classes.push(Class {
                        labels: &p.labels,
                        pods: Vec::new(),
                    });
                    classes.len() - 1
                }),
            };
            classes[k].pods.push(i);
            last = Some((ns, &p.labels, k));
        }
        Self { pods, by_ns }
    }

    /// The pods of namespace `ns` that `sel` selects.
    pub(super) fn selected(&self, ns: &str, sel: &Selector) -> BTreeSet<usize> {
        self.by_ns
            .get(ns)
            .into_iter()
            .flatten()
            .filter(|c| sel.matches(c.labels))
            .flat_map(|c| c.pods.iter().copied())
            .collect()
    }

    /// The pods the pod peers of a policy in `ns` select (its `ipBlock`s select none here).
    pub(super) fn peer_pods(&self, cluster: &Cluster, ns: &str, peers: &[Peer]) -> BTreeSet<usize> {
        let mut out = BTreeSet::new();
        for peer in peers {
            let Peer::Pods { namespaces, pods } = peer else {
                continue;
            };
            // The namespaces the peer can select: its policy's, or those its selector matches
            // ([`Cluster::peer_selects_pod`], one namespace at a time).
            let candidates: Vec<&Vec<Class>> = match namespaces {
                None => self.by_ns.get(ns).into_iter().collect(),
                Some(sel) => self
                    .by_ns
                    .iter()
                    .filter(|(n, _)| {
                        cluster
                            .namespaces
                            .get(**n)
                            .is_some_and(|labels| sel.matches(labels))
                    })
                    .map(|(_, v)| v)
                    .collect(),
            };
            for classes in candidates {
                for c in classes {
                    if pods.as_ref().is_none_or(|s| s.matches(c.labels)) {
                        out.extend(c.pods.iter().copied());
                    }
                }
            }
        }
        out
    }
}
