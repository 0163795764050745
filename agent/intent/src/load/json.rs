//! The objects as the API server sends them (watch events, admission reviews): JSON values,
//! with the same field-path errors as files.

use super::{address_set_from, document_object, explain, object_from, Document, Group, LoadError};
use crate::types::{AddressSetSpec, FirewallConfigurationSpec};
use crate::{AddressSetObject, Origin, PolicyObject};

/// `namespace/name` of an object as the API server sends it, keyed as `group` keys them.
fn json_origin(value: &serde_json::Value, group: Group) -> String {
    let field = |p: &str, default: &'static str| {
        value
            .pointer(p)
            .and_then(|v| v.as_str())
            .unwrap_or(default)
            .to_string()
    };
    group.origin(
        &field("/metadata/namespace", "default"),
        &field("/metadata/name", "?"),
    )
}

/// One AddressSet as the API server sends it (origin `namespace/name`).
pub fn address_set_from_json(value: serde_json::Value) -> Result<AddressSetObject, LoadError> {
    let origin = json_origin(&value, Group::Peerwall);
    address_set_from(value, &origin)
}

/// One FirewallConfiguration of `group` as the API server sends it (a watch event, an
/// admission review): the same field-path errors as files, origin `namespace/name` (Liqo's
/// marked `liqo:`). `apiVersion` and `kind` are not checked: the caller knows the resource.
pub fn object_from_json(value: serde_json::Value, group: Group) -> Result<PolicyObject, LoadError> {
    let origin = json_origin(&value, group);
    // Read first without tracking field paths (tracking costs per field, and a NetworkPolicy
    // tier has 20,000 set elements): the same `Deserialize`, so the same object or the same
    // refusal; only a refusal is read again, for the path of the field it names.
    match <Document as serde::Deserialize>::deserialize(&value) {
        Ok(fc) => document_object(fc, &origin, group),
        Err(_) => object_from(value, &origin, group),
    }
}

/// The object of a spec a watch already read into its type: what [`object_from_json`] gives
/// for the same object (origin `namespace/name`, Liqo's marked `liqo:`; namespace `default`
/// when absent).
pub fn object_with_spec(
    namespace: Option<&str>,
    name: &str,
    spec: FirewallConfigurationSpec,
    group: Group,
) -> PolicyObject {
    PolicyObject {
        origin: Origin(group.origin(namespace.unwrap_or("default"), name)),
        spec,
        role: crate::Role::Enforce,
    }
}

/// The AddressSet of a spec a watch already read into its type: what
/// [`address_set_from_json`] gives for the same object.
pub fn address_set_with_spec(
    namespace: Option<&str>,
    name: &str,
    spec: AddressSetSpec,
) -> AddressSetObject {
    let namespace = namespace.unwrap_or("default").to_string();
    AddressSetObject {
        origin: Origin(format!("{namespace}/{name}")),
        namespace,
        spec,
    }
}

/// A ProtectionPolicy's `spec` as the API server stores it (or a file holds it): unknown
/// fields (the CRD keeps them, so that a misspelt field is refused here instead of pruned
/// into a wider policy) and mistyped values are refused with their field path below `spec`
/// and the did-you-mean message of [`explain`]. `Err((path, given, message))`: `given` is the
/// unknown field or value when the message names one.
pub fn protection_spec_from_json(
    spec: serde_json::Value,
) -> Result<crate::ProtectionPolicySpec, (String, String, String)> {
    serde_path_to_error::deserialize(spec).map_err(|e| {
        let message = e.inner().to_string();
        let given = message.split('`').nth(1).unwrap_or_default().to_string();
        (e.path().to_string(), given, explain(&message))
    })
}
