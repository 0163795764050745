//! A cluster snapshot as `kubectl get -o yaml` writes it (Namespaces, Nodes, Pods,
//! NetworkPolicies, Liqo's `Configuration`s; multi-document files, `List`s, a file or a
//! directory of them), and what the controller writes for it: the same functions the
//! controller runs, on objects read from files instead of the API server
//! (`peerwall compile --cluster`, `peerwall verdict --cluster`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::ResourceExt;
use serde::Deserialize;
use serde_json::Value;

use crate::netpol;
use crate::protection::{self, Options, Remap};

/// Why a snapshot could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// A file or directory could not be read.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Not YAML, or an object of a known kind that does not read as one.
    #[error("{at}: {message}")]
    Document {
        /// `file:line`.
        at: String,
        /// What is wrong.
        message: String,
    },
    /// Nothing the controller reads was found.
    #[error("no Namespace, Node, Pod, NetworkPolicy or Configuration in {0}")]
    Empty(String),
}

/// The objects of a snapshot the controller reads.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Namespaces.
    pub namespaces: Vec<Namespace>,
    /// Nodes (Liqo's virtual nodes among them).
    pub nodes: Vec<Node>,
    /// Pods.
    pub pods: Vec<Pod>,
    /// NetworkPolicies.
    pub policies: Vec<NetworkPolicy>,
    /// Liqo's `Configuration`s, as JSON.
    pub configurations: Vec<Value>,
    /// peerwall's ProtectionPolicies, checked.
    pub protection_policies: Vec<protection::exceptions::Checked>,
    /// ClusterNetworkPolicies (`policy.networking.k8s.io/v1alpha2`), as JSON.
    pub cluster_policies: Vec<Value>,
}

fn files(path: &Path) -> Result<Vec<PathBuf>, SnapshotError> {
    let io = |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    };
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = Vec::new();
    for e in std::fs::read_dir(path).map_err(io)? {
        let p = e.map_err(io)?.path();
        let yaml = p
            .extension()
            .and_then(|x| x.to_str())
            .is_some_and(|x| matches!(x, "yaml" | "yml" | "json"));
        if p.is_file() && yaml {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

impl Snapshot {
    /// Read `paths` (files or directories, one level deep).
    pub fn load(paths: &[PathBuf]) -> Result<Self, SnapshotError> {
        let mut s = Self::default();
        for path in paths {
            for f in files(path)? {
                let text = std::fs::read_to_string(&f).map_err(|source| SnapshotError::Io {
                    path: f.clone(),
                    source,
                })?;
                let lines = peerwall_intent::load::document_lines(&text);
                for (i, doc) in serde_yaml::Deserializer::from_str(&text).enumerate() {
                    let at = format!("{}:{}", f.display(), lines.get(i).copied().unwrap_or(1));
                    let v = serde_json::Value::deserialize(doc).map_err(|e| {
                        SnapshotError::Document {
                            at: at.clone(),
                            message: format!("not valid YAML: {e}"),
                        }
                    })?;
                    s.add(v, &at)?;
                }
            }
        }
        if s.namespaces.is_empty()
            && s.nodes.is_empty()
            && s.pods.is_empty()
            && s.policies.is_empty()
            && s.configurations.is_empty()
            && s.cluster_policies.is_empty()
        {
            let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
            return Err(SnapshotError::Empty(names.join(", ")));
        }
        Ok(s)
    }

    fn add(&mut self, v: Value, at: &str) -> Result<(), SnapshotError> {
        fn read<T: serde::de::DeserializeOwned>(v: Value, at: &str) -> Result<T, SnapshotError> {
            serde_path_to_error::deserialize(v).map_err(|e| SnapshotError::Document {
                at: at.to_string(),
                message: format!("{}: {}", e.path(), e.inner()),
            })
        }
        let api = v["apiVersion"].as_str().unwrap_or_default().to_string();
        let kind = v["kind"].as_str().unwrap_or_default().to_string();
        match (api.as_str(), kind.as_str()) {
            (_, "List")
            | (
                _,
                "NamespaceList"
                | "NodeList"
                | "PodList"
                | "NetworkPolicyList"
                | "ClusterNetworkPolicyList",
            ) => {
                if let Some(items) = v["items"].as_array() {
                    for (i, item) in items.iter().enumerate() {
                        let mut item = item.clone();
                        // `kubectl get -o yaml` of one kind may leave apiVersion/kind out of
                        // the items of a typed list.
                        if item.get("kind").is_none() {
                            if let Some(k) = kind.strip_suffix("List").filter(|k| !k.is_empty()) {
                                item["kind"] = Value::from(k);
                                item["apiVersion"] = Value::from(api.clone());
                            }
                        }
                        self.add(item, &format!("{at} items[{i}]"))?;
                    }
                }
            }
            ("v1", "Namespace") => self.namespaces.push(read(v, at)?),
            ("v1", "Node") => self.nodes.push(read(v, at)?),
            ("v1", "Pod") => self.pods.push(read(v, at)?),
            ("networking.k8s.io/v1", "NetworkPolicy") => self.policies.push(read(v, at)?),
            ("networking.liqo.io/v1beta1", "Configuration") => self.configurations.push(v),
            ("policy.networking.k8s.io/v1alpha2", "ClusterNetworkPolicy") => {
                self.cluster_policies.push(v)
            }
            (peerwall_intent::load::API_VERSION, peerwall_intent::load::PROTECTION_POLICY_KIND) => {
                let name = v["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let spec = v
                    .get("spec")
                    .cloned()
                    .unwrap_or(Value::Object(Default::default()));
                let checked = protection::exceptions::decode(spec)
                    .and_then(|spec| protection::exceptions::check(&name, &spec))
                    .map_err(|e| SnapshotError::Document {
                        at: at.to_string(),
                        message: format!("ProtectionPolicy {name}: {e}"),
                    })?;
                self.protection_policies.push(checked);
            }
            // Other kinds may share the files: the controller does not read them.
            _ => {}
        }
        Ok(())
    }

    /// How each peer's CIDRs are remapped here (Liqo's `Configuration`s).
    pub fn remaps(&self) -> BTreeMap<String, Vec<Remap>> {
        self.configurations
            .iter()
            .filter_map(|c| protection::configuration_remaps(&labels(c), c))
            .collect()
    }

    /// Each peer's pod and external CIDRs as this cluster sees them (Liqo's `Configuration`s).
    pub fn homes(&self) -> BTreeMap<String, Vec<ipnet::IpNet>> {
        self.configurations
            .iter()
            .filter_map(|c| protection::configuration_cidrs(&labels(c), c))
            .collect()
    }

    /// The snapshot as provider/consumer protection sees it.
    pub fn world(&self) -> protection::World {
        protection::World {
            namespaces: self
                .namespaces
                .iter()
                .map(|n| protection::Namespace {
                    name: n.name_any(),
                    labels: n.labels().clone(),
                })
                .collect(),
            pods: self
                .pods
                .iter()
                .map(|p| super::model::PodFacts::of(p).protection())
                .collect(),
            virtual_nodes: self
                .nodes
                .iter()
                .filter(|n| {
                    n.labels().get(super::NODE_TYPE).map(String::as_str) == Some("virtual-node")
                })
                .map(|n| protection::Node {
                    name: n.name_any(),
                    labels: n.labels().clone(),
                })
                .collect(),
            remaps: self.remaps(),
            sources: self
                .configurations
                .iter()
                .filter_map(|c| protection::configuration_sources(&labels(c), c))
                .collect(),
        }
    }

    /// The snapshot as NetworkPolicies and ClusterNetworkPolicies see it, and the policies
    /// that could not be read (a ClusterNetworkPolicy's part that fails closed among them, as
    /// `clusternetworkpolicy/<name>`).
    pub fn cluster(&self) -> (netpol::Cluster, Vec<super::model::Unreadable>) {
        let pods: Vec<super::model::PodFacts> =
            self.pods.iter().map(super::model::PodFacts::of).collect();
        let (mut cluster, mut unreadable) = super::model::cluster(
            &self.namespaces,
            &self.nodes,
            &pods,
            &self.policies,
            &self.remaps(),
        );
        for v in &self.cluster_policies {
            match netpol::cnp::read::policy_json(v.clone()) {
                Ok(r) => {
                    let key = format!("clusternetworkpolicy/{}", r.policy.name);
                    unreadable.extend(r.unenforced.into_iter().map(|why| {
                        super::model::Unreadable {
                            policy: key.clone(),
                            why: format!("{why} (fails closed)"),
                        }
                    }));
                    cluster.cluster_policies.push(r.policy);
                }
                Err(mut u) => {
                    u.policy = format!("clusternetworkpolicy/{}", u.policy);
                    unreadable.push(u);
                }
            }
        }
        (cluster, unreadable)
    }
}

/// The labels of an object read as JSON.
fn labels(c: &Value) -> BTreeMap<String, String> {
    c["metadata"]["labels"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// What the controller keeps in place for a snapshot, per peer.
pub struct Output {
    /// Every object, in the order the controller writes them: per peer its AddressSet
    /// slices, its gateway configuration and its NetworkPolicy tier; then the NetworkPolicy
    /// of each offloaded namespace.
    pub objects: Vec<Value>,
    /// Per peer: the gateway configuration with its addresses inline and the tier, as the
    /// agent enforces them once the slices are merged in.
    pub enforced: BTreeMap<String, Vec<Value>>,
    /// Policies or parts the tier could not enforce (they allow nothing).
    pub unenforced: Vec<String>,
}

/// What the controller writes for `snapshot` with `opts`.
pub fn output(snapshot: &Snapshot, opts: &Options) -> Output {
    let world = snapshot.world();
    let sets = protection::sets(&world);
    let (cluster, unreadable) = snapshot.cluster();
    let mut out = Output {
        objects: Vec::new(),
        enforced: BTreeMap::new(),
        unenforced: unreadable
            .iter()
            .map(|u| format!("NetworkPolicy {}: {} (left out)", u.policy, u.why))
            .collect(),
    };
    for peer in protection::peers(&world) {
        let s = sets.get(&peer.id).cloned().unwrap_or_default();
        let declared = protection::Declared {
            namespaces: protection::namespaces::namespace_sets(&cluster, &peer.id),
            exceptions: protection::exceptions::for_peer(
                &snapshot.protection_policies,
                &peer.id,
                opts.settings(),
                &cluster,
            ),
        };
        for slice in protection::peer_slices(&s, opts) {
            out.objects
                .push(protection::address_set_object(&peer, &slice));
        }
        out.objects.push(protection::gateway_object_with(
            &peer,
            &Default::default(),
            opts,
            &declared,
        ));
        let tier = netpol::tier::tier(&cluster, &peer.id, declared.exceptions.settings.audit);
        let tier_obj = netpol::tier::object(&peer.tenant_namespace, &peer.id, &tier.spec);
        out.objects.push(tier_obj.clone());
        out.unenforced.extend(
            tier.unenforced
                .iter()
                .map(|u| format!("NetworkPolicy {}: {}", u.policy, u.why)),
        );
        out.enforced.insert(
            peer.id.clone(),
            vec![
                protection::gateway_object_with(&peer, &s, opts, &declared),
                tier_obj,
            ],
        );
    }
    let homes = snapshot.homes();
    for ns in &world.namespaces {
        if let Some(consumer) = protection::offloaded_namespace_owner(ns) {
            let home = homes.get(consumer).map_or(&[][..], Vec::as_slice);
            let exceptions = protection::exceptions::for_peer(
                &snapshot.protection_policies,
                consumer,
                opts.settings(),
                &cluster,
            );
            let open: Vec<_> = exceptions.for_offloaded().collect();
            out.objects.push(protection::offloaded_network_policy(
                &ns.name, consumer, home, &open,
            ));
        }
    }
    let (companions, too_large) = netpol::companion::companions(&cluster, |_| false);
    out.objects.extend(companions.into_iter().map(|c| c.object));
    out.unenforced.extend(
        too_large
            .into_iter()
            .map(|(p, why)| format!("NetworkPolicy {p}: {why}")),
    );
    out.unenforced.sort();
    out.unenforced.dedup();
    out
}
