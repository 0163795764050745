//! Who may steer a gateway: the namespaces peerwall takes its gateway objects from, and whether
//! those objects may change packets. Pure decisions, no kube types: the agent (which ignores
//! what is not admitted, with a warning Event on the object) and the admission webhook (which
//! refuses it, with the same reason) both ask [`Trust`].
//!
//! Default: an object is taken from peerwall's own namespace (for any peer), or from a Liqo
//! tenant namespace (`liqo.io/tenant-namespace=true`, the namespaces the controller writes to)
//! when it is labelled for that namespace's own peer (`peerwall.io/remote-cluster-id` equal to
//! the namespace's `liqo.io/remote-cluster-id`). Labelling a namespace takes a cluster-wide
//! verb no namespace admin holds, so a namespace admin cannot make their namespace steer a
//! gateway. Packet-changing rules ([`peerwall_intent::changes`]) are refused unless enabled.

use std::collections::{BTreeMap, BTreeSet};

use peerwall_intent::changes::packet_changes;
use peerwall_intent::FirewallConfigurationSpec;

/// The peer a tenant namespace belongs to, by namespace name (Liqo's labels
/// `liqo.io/tenant-namespace=true` and `liqo.io/remote-cluster-id`).
pub type Tenants = BTreeMap<String, String>;

/// Where gateway objects come from, and what they may do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trust {
    /// Namespaces whose objects are taken for any peer (default: peerwall's own).
    pub namespaces: BTreeSet<String>,
    /// Also take a peer's objects from its Liqo tenant namespace.
    pub tenant_namespaces: bool,
    /// Enforce NAT, route, mark, MSS and notrack rules from peerwall's objects.
    pub packet_changes: bool,
}

impl Trust {
    /// The default: peerwall's namespace `own`, tenant namespaces on, packet changes off.
    pub fn default_for(own: &str) -> Self {
        Trust {
            namespaces: BTreeSet::from([own.to_string()]),
            tenant_namespaces: true,
            packet_changes: false,
        }
    }

    /// Whether an object in `namespace`, labelled for `peer` (`peerwall.io/remote-cluster-id`,
    /// if any), may steer a gateway; the reason when not.
    pub fn admits(
        &self,
        namespace: &str,
        peer: Option<&str>,
        tenants: &Tenants,
    ) -> Result<(), String> {
        if self.namespaces.contains(namespace) {
            return Ok(());
        }
        let designated = self.describe();
        match (self.tenant_namespaces, tenants.get(namespace), peer) {
            (true, Some(owner), Some(p)) if owner == p => Ok(()),
            (true, Some(owner), Some(p)) => Err(format!(
                "namespace {namespace:?} is the Liqo tenant namespace of peer {owner:?}, but this object is labelled {}={p:?}: a tenant namespace steers only its own peer's gateway; ignored (gateway objects are taken from {designated})",
                crate::PEER
            )),
            (true, Some(owner), None) => Err(format!(
                "namespace {namespace:?} is the Liqo tenant namespace of peer {owner:?}, but this object has no {} label: from a tenant namespace only objects labelled for its peer are taken; ignored",
                crate::PEER
            )),
            _ => Err(format!(
                "namespace {namespace:?} is not designated for gateway objects; ignored (gateway objects are taken from {designated}; an administrator designates more with the agent's --gateway-namespaces)"
            )),
        }
    }

    /// Whether `spec`'s rules may be enforced from a peerwall object: every packet-changing
    /// rule named by its field path when they may not.
    pub fn allows_changes(&self, spec: &FirewallConfigurationSpec) -> Result<(), String> {
        if self.packet_changes {
            return Ok(());
        }
        let found = packet_changes(spec);
        if found.is_empty() {
            return Ok(());
        }
        let list: Vec<String> = found
            .iter()
            .map(|c| format!("{}: {}", c.path, c.what))
            .collect();
        Err(format!(
            "packet-changing rules are off for peerwall objects (they could redirect or untrack another tenant's traffic; an administrator enables them with the agent's and the webhook's --allow-packet-changes): {}",
            list.join("; ")
        ))
    }

    /// The designated namespaces, for messages.
    fn describe(&self) -> String {
        let names: Vec<String> = self.namespaces.iter().map(|n| format!("{n:?}")).collect();
        let mut out = names.join(", ");
        if self.tenant_namespaces {
            if !out.is_empty() {
                out.push_str(" and ");
            }
            out.push_str("each peer's Liqo tenant namespace (for that peer only)");
        }
        if out.is_empty() {
            out.push_str("no namespace");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenants() -> Tenants {
        Tenants::from([
            ("liqo-tenant-a".to_string(), "a".to_string()),
            ("liqo-tenant-b".to_string(), "b".to_string()),
        ])
    }

    #[test]
    fn own_namespace_steers_any_peer() {
        let t = Trust::default_for("peerwall-system");
        assert_eq!(t.admits("peerwall-system", Some("a"), &tenants()), Ok(()));
        assert_eq!(t.admits("peerwall-system", None, &tenants()), Ok(()));
    }

    #[test]
    fn a_tenant_namespace_steers_only_its_own_peer() {
        let t = Trust::default_for("peerwall-system");
        assert_eq!(t.admits("liqo-tenant-a", Some("a"), &tenants()), Ok(()));
        let e = t
            .admits("liqo-tenant-a", Some("b"), &tenants())
            .unwrap_err();
        assert!(
            e.contains("tenant namespace of peer \"a\"") && e.contains("\"b\""),
            "{e}"
        );
        let e = t.admits("liqo-tenant-a", None, &tenants()).unwrap_err();
        assert!(e.contains("no peerwall.io/remote-cluster-id label"), "{e}");
    }

    #[test]
    fn any_other_namespace_is_ignored_with_the_designated_ones_named() {
        let t = Trust::default_for("peerwall-system");
        let e = t.admits("team-x", Some("a"), &tenants()).unwrap_err();
        assert!(e.contains("\"team-x\" is not designated"), "{e}");
        assert!(
            e.contains("\"peerwall-system\" and each peer's Liqo tenant namespace"),
            "{e}"
        );
        let off = Trust {
            tenant_namespaces: false,
            ..t
        };
        let e = off
            .admits("liqo-tenant-a", Some("a"), &tenants())
            .unwrap_err();
        assert!(
            e.contains("not designated") && !e.contains("tenant namespace ("),
            "{e}"
        );
    }

    #[test]
    fn packet_changes_are_refused_with_their_paths_unless_enabled() {
        let v: serde_json::Value = serde_yaml::from_str(
            "table: {name: t, family: IPV4, chains: [{name: n, type: nat, hook: prerouting, rules: {natRules: [{name: x, natType: dnat, to: 10.0.0.1}]}}]}",
        )
        .unwrap();
        let spec: FirewallConfigurationSpec = serde_json::from_value(v).unwrap();
        let t = Trust::default_for("peerwall-system");
        let e = t.allows_changes(&spec).unwrap_err();
        assert!(
            e.contains("spec.table.chains[0].type: a NAT chain")
                && e.contains("spec.table.chains[0].rules.natRules[0]: a NAT rule")
                && e.contains("--allow-packet-changes"),
            "{e}"
        );
        let on = Trust {
            packet_changes: true,
            ..t
        };
        assert_eq!(on.allows_changes(&spec), Ok(()));
    }
}
