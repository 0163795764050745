//! The shell of every object peerwall writes of its own kinds (`peerwall.io/v1alpha1`): each
//! peer's gateway configuration and NetworkPolicy tier, their AddressSet slices, the boot
//! configuration compiled locally. One place, so the objects cannot drift apart in their
//! version, kind or labels.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{json, Value};

/// An object of peerwall's `kind` ([`crate::load::KIND`], [`crate::load::ADDRESS_SET_KIND`])
/// named `namespace/name`, with `labels` and `spec`.
pub fn object(
    kind: &str,
    namespace: &str,
    name: &str,
    labels: &BTreeMap<String, String>,
    spec: impl Serialize,
) -> Value {
    let mut metadata = json!({"name": name, "namespace": namespace});
    if !labels.is_empty() {
        metadata["labels"] = json!(labels);
    }
    json!({
        "apiVersion": crate::load::API_VERSION,
        "kind": kind,
        "metadata": metadata,
        "spec": spec,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_has_peerwalls_version_its_kind_name_labels_and_spec() {
        let o = object(
            crate::load::KIND,
            "liqo-tenant-a",
            "peerwall-gateway",
            &crate::labels::for_gateway("a"),
            json!({"table": {"name": "t"}}),
        );
        assert_eq!(
            o,
            json!({
                "apiVersion": "peerwall.io/v1alpha1",
                "kind": "FirewallConfiguration",
                "metadata": {
                    "name": "peerwall-gateway", "namespace": "liqo-tenant-a",
                    "labels": {
                        "peerwall.io/target": "gateway",
                        "peerwall.io/remote-cluster-id": "a",
                        "app.kubernetes.io/managed-by": "peerwall",
                    },
                },
                "spec": {"table": {"name": "t"}},
            })
        );
        let bare = object(crate::load::KIND, "n", "x", &BTreeMap::new(), json!({}));
        assert!(bare["metadata"].get("labels").is_none());
    }
}
