//! Extension: `AddressSet` (`peerwall.io/v1alpha1`), a bounded slice of a named set of a
//! FirewallConfiguration.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[cfg(feature = "kube")]
use super::FirewallConfigurationStatus;

/// Most addresses one `AddressSet` holds (like an EndpointSlice's 1000 endpoints): an object
/// stays far below the API server's request limit, and a change rewrites one small object.
pub const MAX_SLICE_ADDRESSES: usize = 1000;

/// Extension: a bounded slice of a named address set of a FirewallConfiguration (kind
/// `AddressSet`, `peerwall.io/v1alpha1`). The set (declared with `fromAddressSets: true`)
/// holds its inline elements and the addresses of every slice naming it; an address stays in
/// the set while any slice lists it. Agents select slices with the same label selector as
/// FirewallConfigurations, so a slice carries its configuration's labels.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[cfg_attr(feature = "kube", derive(kube::CustomResource))]
#[cfg_attr(
    feature = "kube",
    kube(
        group = "peerwall.io",
        version = "v1alpha1",
        kind = "AddressSet",
        plural = "addresssets",
        namespaced,
        status = "FirewallConfigurationStatus",
        shortname = "pwas",
        category = "peerwall",
        printcolumn = r#"{"name":"Configuration","type":"string","jsonPath":".spec.firewallConfiguration"}"#,
        printcolumn = r#"{"name":"Set","type":"string","jsonPath":".spec.set"}"#,
        printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AddressSetSpec {
    /// Name of the FirewallConfiguration (in the same namespace) whose set this slice fills.
    #[serde(default)]
    pub firewall_configuration: String,
    /// Name of the set in its `spec.table.sets` (declared with `fromAddressSets: true`).
    #[serde(default)]
    pub set: String,
    /// Addresses, CIDRs or `a-b` ranges of the set's family; at most 1000.
    #[serde(default)]
    #[schemars(length(max = 1000))]
    pub addresses: Vec<String>,
}
