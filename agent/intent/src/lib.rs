//! The intent API: what users (and peerwall's controller) write.
//!
//! [`types`] mirrors Liqo's FirewallConfiguration schema plus peerwall's filter extensions;
//! [`load`] reads objects of either group from YAML or JSON with field-path errors. With the
//! `kube` feature the spec is also a Kubernetes custom resource (`peerwall.io/v1alpha1`).
//! Next in the flow: `peerwall-policy` validates and lowers these objects into the policy IR.

pub mod binding;
pub mod changes;
pub mod elements;
pub mod labels;
pub mod load;
pub mod located;
pub mod object;
pub mod protection;
pub mod size;
pub mod tiers;
pub mod types;

use std::fmt;

#[cfg(feature = "kube")]
pub use protection::ProtectionPolicy;
pub use protection::ProtectionPolicySpec;
#[cfg(feature = "kube")]
pub use types::AddressSet;
pub use types::AddressSetSpec;
#[cfg(feature = "kube")]
pub use types::FirewallConfiguration;
pub use types::FirewallConfigurationSpec;

/// Identity of the object a policy came from (`namespace/name`, Liqo's marked `liqo:`), carried
/// through the IR so every rule traces back to it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Origin(pub String);

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A FirewallConfiguration as compilation input.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyObject {
    /// `namespace/name` (Liqo's objects `liqo:namespace/name`).
    pub origin: Origin,
    /// The spec.
    pub spec: FirewallConfigurationSpec,
    /// Enforced by peerwall, or only observed.
    pub role: Role,
}

/// An `AddressSet` (a slice of a named set of a FirewallConfiguration) as compilation input.
#[derive(Clone, Debug, PartialEq)]
pub struct AddressSetObject {
    /// `namespace/name` of the slice.
    pub origin: Origin,
    /// Namespace (its FirewallConfiguration is in the same one).
    pub namespace: String,
    /// The spec.
    pub spec: AddressSetSpec,
}

impl AddressSetObject {
    /// Origin of the FirewallConfiguration it fills (`namespace/name`, peerwall's group).
    pub fn target(&self) -> Origin {
        Origin(format!(
            "{}/{}",
            self.namespace, self.spec.firewall_configuration
        ))
    }
}

/// What peerwall does with an object.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Role {
    /// peerwall enforces it.
    #[default]
    Enforce,
    /// Another enforcer keeps it in force in the same network namespace (Liqo's firewall
    /// controller, in its gateways); peerwall reads it only for the addresses its NAT rewrites
    /// before the filter hooks.
    Observe,
}
