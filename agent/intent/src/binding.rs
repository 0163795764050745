//! Liqo's `FirewallConfigurationBinding` (`networking.liqo.io/v1beta1`): which entity applies a
//! Liqo FirewallConfiguration.
//!
//! Since liqotech/liqo PR #3290 (`apis/networking/v1beta1/firewallconfigurationbinding_types.go`)
//! Liqo's firewall controller no longer applies every FirewallConfiguration its labels select:
//! each gateway pod (and each node's fabric) first binds the configurations its label sets
//! select to itself (`pkg/gateway/binding_creator_controller.go`,
//! `pkg/fabric/binding_creator_controller.go`: a binding in the configuration's namespace,
//! `spec.firewallConfigurationRef.name` the configuration, `spec.targetRef` the gateway pod as
//! `v1`/`Pod`, the fabric's node as `v1`/`Node` (`cmd/fabric/main.go`; the type's comments
//! mention `InternalNode`, which the code does not use)), and then applies only the
//! configurations of the bindings whose `targetRef` equals itself, field for field
//! (`pkg/firewall/firewallconfigurationbinding_controller.go`, `MatchesTargetRef`). A binding being deleted has its table removed first (the same file's
//! deletion path).
//!
//! So where a cluster serves bindings, a Liqo configuration is in force in a gateway only while
//! a live binding names it and that gateway; peerwall takes Liqo's objects (enforced with
//! `--liqo-selector`, or observed for their NAT) on the same terms. Bindings only narrow what the
//! label selectors pick: a binding can never bring in an object the selectors left out.

use std::collections::BTreeSet;
use std::fmt;

/// The entity a binding names (`spec.targetRef`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Target {
    /// `apiVersion` (`v1` for a Pod).
    pub api_version: String,
    /// `kind` (`Pod`, `InternalNode`).
    pub kind: String,
    /// `name`.
    pub name: String,
    /// `namespace`; empty for a cluster-scoped target (Liqo's `omitempty`).
    pub namespace: String,
}

/// `apiVersion` of Liqo's InternalNode.
pub const INTERNAL_NODE_API_VERSION: &str = "networking.liqo.io/v1beta1";

/// A target that cannot be read from `--liqo-target`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("--liqo-target {value:?}: {reason} (Pod:<namespace>/<name>, Node:<name> or InternalNode:<name>)")]
pub struct TargetError {
    /// What was given.
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl Target {
    /// The gateway pod `namespace/name`, as Liqo's gateway binds itself (`v1`, `Pod`).
    pub fn pod(namespace: &str, name: &str) -> Self {
        Self {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: name.into(),
            namespace: namespace.into(),
        }
    }

    /// `Pod:<namespace>/<name>`, `Node:<name>` or `InternalNode:<name>`.
    pub fn parse(value: &str) -> Result<Self, TargetError> {
        let err = |reason| TargetError {
            value: value.into(),
            reason,
        };
        let (kind, rest) = value.split_once(':').ok_or_else(|| err("no kind"))?;
        match kind {
            "Pod" => {
                let (ns, name) = rest
                    .split_once('/')
                    .ok_or_else(|| err("a Pod needs its namespace"))?;
                if ns.is_empty() || name.is_empty() || name.contains('/') {
                    return Err(err("a Pod is <namespace>/<name>"));
                }
                Ok(Self::pod(ns, name))
            }
            "Node" | "InternalNode" => {
                if rest.is_empty() || rest.contains('/') {
                    return Err(err("a node is cluster-scoped: <name>"));
                }
                Ok(Self {
                    api_version: if kind == "Node" {
                        "v1".into()
                    } else {
                        INTERNAL_NODE_API_VERSION.into()
                    },
                    kind: kind.into(),
                    name: rest.into(),
                    namespace: String::new(),
                })
            }
            _ => Err(err("unknown kind")),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{}:{}", self.kind, self.name)
        } else {
            write!(f, "{}:{}/{}", self.kind, self.namespace, self.name)
        }
    }
}

/// One binding as the agent reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// The binding's (and its configuration's) namespace.
    pub namespace: String,
    /// `spec.firewallConfigurationRef.name`.
    pub configuration: String,
    /// `spec.targetRef`.
    pub target: Target,
    /// `metadata.deletionTimestamp` is set: Liqo removes its table.
    pub deleting: bool,
}

/// A binding object that does not carry what Liqo's schema requires.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("FirewallConfigurationBinding {object}: {path}: {reason}")]
pub struct BindingError {
    /// `namespace/name` of the binding.
    pub object: String,
    /// Field path.
    pub path: &'static str,
    /// What is wrong.
    pub reason: &'static str,
}

/// Read a binding object (JSON as the API server serves it).
pub fn read(v: &serde_json::Value) -> Result<Binding, BindingError> {
    let meta = &v["metadata"];
    let namespace = meta["namespace"].as_str().unwrap_or_default().to_string();
    let object = format!("{namespace}/{}", meta["name"].as_str().unwrap_or_default());
    let text = |path: &'static str, value: &serde_json::Value, required: bool| match value {
        serde_json::Value::String(s) if !s.is_empty() || !required => Ok(s.clone()),
        serde_json::Value::Null if !required => Ok(String::new()),
        serde_json::Value::String(_) | serde_json::Value::Null => Err(BindingError {
            object: object.clone(),
            path,
            reason: "required",
        }),
        _ => Err(BindingError {
            object: object.clone(),
            path,
            reason: "not a string",
        }),
    };
    let spec = &v["spec"];
    let t = &spec["targetRef"];
    Ok(Binding {
        configuration: text(
            "spec.firewallConfigurationRef.name",
            &spec["firewallConfigurationRef"]["name"],
            true,
        )?,
        target: Target {
            api_version: text("spec.targetRef.apiVersion", &t["apiVersion"], true)?,
            kind: text("spec.targetRef.kind", &t["kind"], true)?,
            name: text("spec.targetRef.name", &t["name"], true)?,
            namespace: text("spec.targetRef.namespace", &t["namespace"], false)?,
        },
        deleting: !meta["deletionTimestamp"].is_null(),
        namespace,
    })
}

/// The configurations (`namespace`, `name`) Liqo keeps in force at `target`: those of the live
/// bindings naming it.
pub fn in_force_at<'a>(
    bindings: impl IntoIterator<Item = &'a Binding>,
    target: &Target,
) -> BTreeSet<(String, String)> {
    bindings
        .into_iter()
        .filter(|b| !b.deleting && &b.target == target)
        .map(|b| (b.namespace.clone(), b.configuration.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn binding(ns: &str, name: &str, config: &str, target: serde_json::Value) -> serde_json::Value {
        json!({"apiVersion": "networking.liqo.io/v1beta1", "kind": "FirewallConfigurationBinding",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"firewallConfigurationRef": {"name": config}, "targetRef": target}})
    }

    fn pod_ref(ns: &str, name: &str) -> serde_json::Value {
        json!({"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": ns})
    }

    #[test]
    fn targets_parse_as_liqo_writes_them() {
        assert_eq!(
            Target::parse("Pod:liqo-tenant-b/gw-b-7d9").unwrap(),
            Target::pod("liqo-tenant-b", "gw-b-7d9")
        );
        let node = Target::parse("InternalNode:worker-1").unwrap();
        assert_eq!(
            (
                node.api_version.as_str(),
                node.kind.as_str(),
                node.namespace.as_str()
            ),
            (INTERNAL_NODE_API_VERSION, "InternalNode", "")
        );
        assert_eq!(node.to_string(), "InternalNode:worker-1");
        let node = Target::parse("Node:worker-1").unwrap();
        assert_eq!(
            (
                node.api_version.as_str(),
                node.kind.as_str(),
                node.namespace.as_str()
            ),
            ("v1", "Node", "")
        );
        for bad in [
            "gw",
            "Pod:gw",
            "Pod:/gw",
            "Pod:ns/",
            "Pod:a/b/c",
            "InternalNode:",
            "InternalNode:ns/n",
            "Node:",
            "Machine:n",
        ] {
            let e = Target::parse(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn only_live_bindings_naming_this_target_field_for_field_count() {
        let here = Target::pod("liqo-tenant-b", "gw-b-1");
        let objects = [
            binding(
                "liqo-tenant-b",
                "a",
                "remap-podcidr",
                pod_ref("liqo-tenant-b", "gw-b-1"),
            ),
            // The other replica of the same gateway.
            binding(
                "liqo-tenant-b",
                "b",
                "remap-extcidr",
                pod_ref("liqo-tenant-b", "gw-b-2"),
            ),
            // Same name, another namespace: another pod.
            binding(
                "liqo-tenant-b",
                "c",
                "ipmap",
                pod_ref("liqo-tenant-c", "gw-b-1"),
            ),
            // Same name and namespace, another kind.
            binding(
                "liqo-tenant-b",
                "d",
                "fabric",
                json!({"apiVersion": "networking.liqo.io/v1beta1", "kind": "InternalNode", "name": "gw-b-1"}),
            ),
            // Another apiVersion of "Pod" is another target for Liqo too.
            binding(
                "liqo-tenant-b",
                "e",
                "odd",
                json!({"apiVersion": "v2", "kind": "Pod", "name": "gw-b-1", "namespace": "liqo-tenant-b"}),
            ),
        ];
        let mut read_all: Vec<Binding> = objects.iter().map(|o| read(o).unwrap()).collect();
        assert_eq!(
            in_force_at(&read_all, &here),
            BTreeSet::from([("liqo-tenant-b".to_string(), "remap-podcidr".to_string())])
        );
        // Being deleted: Liqo removes the table.
        read_all[0].deleting = true;
        assert!(in_force_at(&read_all, &here).is_empty());
        let mut deleting = objects[0].clone();
        deleting["metadata"]["deletionTimestamp"] = json!("2026-11-29T00:00:00Z");
        assert!(read(&deleting).unwrap().deleting);
    }

    #[test]
    fn a_binding_without_what_liqos_schema_requires_is_named_with_its_field() {
        let mut b = binding("ns", "x", "cfg", pod_ref("ns", "gw"));
        b["spec"]["targetRef"]
            .as_object_mut()
            .unwrap()
            .remove("kind");
        assert_eq!(
            read(&b).unwrap_err().to_string(),
            "FirewallConfigurationBinding ns/x: spec.targetRef.kind: required"
        );
        let mut b = binding("ns", "x", "cfg", pod_ref("ns", "gw"));
        b["spec"]["firewallConfigurationRef"]["name"] = json!(7);
        assert_eq!(
            read(&b).unwrap_err().to_string(),
            "FirewallConfigurationBinding ns/x: spec.firewallConfigurationRef.name: not a string"
        );
        // A cluster-scoped target has no namespace.
        let node = binding(
            "ns",
            "y",
            "cfg",
            json!({"apiVersion": INTERNAL_NODE_API_VERSION, "kind": "InternalNode", "name": "n1"}),
        );
        assert_eq!(
            read(&node).unwrap().target,
            Target::parse("InternalNode:n1").unwrap()
        );
    }
}
