//! What Liqo does in the lab's gateways when a consumer's pod CIDR overlaps the provider's: the
//! remapping FirewallConfiguration Liqo's controller manager derives from the peer's
//! Configuration (`pkg/liqo-controller-manager/networking/external-network/remapping/cidr.go`,
//! `forgeCIDRFirewallConfigurationSpec`), and its firewall controller keeping that table in
//! force in the gateway (a table peerwall does not own). peerwall only reads the object
//! (`agent --observe`), as the DaemonSet does in a real gateway.

use anyhow::{Context, Result};
use serde_json::{json, Value};

use peerwall_intent::load::{self, Group};
use peerwall_netns::NetNs;

/// Liqo's `remap-podcidr` FirewallConfiguration for consumer `name`, whose pod CIDR `cidr`
/// this cluster sees as `remapped`: prerouting DNAT of the remapped CIDR towards the peer (not
/// from `eth0` nor the tunnel), postrouting SNAT of what comes from the peer's tunnel into the
/// remapped CIDR.
pub(super) fn remap_object(name: &str, cidr: &str, remapped: &str) -> Value {
    json!({
        "apiVersion": "networking.liqo.io/v1beta1",
        "kind": "FirewallConfiguration",
        "metadata": {
            "name": format!("{}-remap-podcidr", name),
            "namespace": format!("liqo-tenant-{}", name),
            "labels": {
                "networking.liqo.io/firewall-category": "gateway",
                "networking.liqo.io/firewall-unique": name,
            },
        },
        "spec": {"table": {
            "name": "remap-podcidr",
            "family": "IPV4",
            "chains": [
                {
                    "name": "outgoing", "policy": "accept", "type": "nat",
                    "hook": "prerouting", "priority": -100,
                    "rules": {"natRules": [{
                        "natType": "dnat",
                        "match": [
                            {"op": "eq", "ip": {"value": remapped, "position": "dst"}},
                            {"op": "neq", "dev": {"value": "eth0", "position": "in"}},
                            {"op": "neq", "dev": {"value": "liqo-tunnel", "position": "in"}},
                        ],
                        "to": cidr,
                    }]},
                },
                {
                    "name": "incoming", "policy": "accept", "type": "nat",
                    "hook": "postrouting", "priority": 100,
                    "rules": {"natRules": [{
                        "natType": "snat",
                        "match": [
                            {"op": "neq", "dev": {"value": "eth0", "position": "out"}},
                            {"op": "eq", "ip": {"value": cidr, "position": "src"}},
                            {"op": "eq", "dev": {"value": "liqo-tunnel", "position": "in"}},
                        ],
                        "to": remapped,
                    }]},
                },
            ],
        }},
    })
}

/// Keep `obj`'s table in force in `gw` as Liqo's firewall controller does: an nftables table
/// without peerwall's ownership marker, which peerwall's agent therefore never touches.
pub(super) fn apply_as_liqo(gw: &NetNs, obj: &Value) -> Result<()> {
    let po = load::object_from_json(obj.clone(), Group::Liqo).context("Liqo's remapping object")?;
    let compiled = peerwall_policy::compile::compile_object(&po)
        .map_err(|e| anyhow::anyhow!("Liqo's remapping object: {e}"))?;
    let table = peerwall_backend_nftables::render_table(&compiled.table, Default::default());
    let text = peerwall_backend_nftables::text::foreign_table_text(&table);
    super::infra::in_ns(gw.name(), &["nft", "-f", "-"], Some(&text))
        .with_context(|| format!("loading Liqo's remapping table in {}:\n{text}", gw.name()))?;
    Ok(())
}
