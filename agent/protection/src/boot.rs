//! The boot policy of a gateway: the controller's gateway configuration for a peer with
//! nothing allowed yet (no offloaded pod, none of ours, no exception), in a table of its own,
//! `peerwall_boot_<peer>`. Nothing from the tunnel is forwarded (no peer CIDRs are known yet,
//! [`super::NO_CONFIGURATION_RULE`]); the gateway itself takes Liqo's tunnel check and replies
//! to what it opened.
//!
//! It closes the window between a gateway pod's start and the first apply of its agent:
//! - the sidecar's init container (`peerwall boot --peer ID`) puts it in force (nftables:
//!   its rules match the tunnel by name, so they hold for a tunnel created later) before
//!   Liqo's containers create the tunnel;
//! - the agent (`--boot-peer ID`) keeps it in its policy until its policy holds the
//!   controller's table for that peer ([`super::table_name`]), then lets it go in the same
//!   step that puts that table in force: there is no moment with neither.
//! - the node's CNI chain (`peerwall-boot`, installed by the DaemonSet with `--cni-boot`) puts
//!   the same policy in force as [`NODE_BOOT_TABLE`] when a gateway pod's sandbox is created,
//!   before any container of it runs, whether an agent runs on the node or not. It cannot know
//!   the peer there (Liqo names it only in the containers' flags), so its table is not named
//!   after one; the agent that enforces in the pod lets it go as it lets its own go.

use peerwall_intent::types as api;
use serde_json::Value;

use super::{gateway_spec, table_name, Options, PeerSets};

/// Name of the boot table of `peer`'s gateway.
pub fn boot_table_name(peer: &str) -> String {
    table_name(peer).replacen("peerwall_", "peerwall_boot_", 1)
}

/// The boot configuration of `peer`'s gateway with `opts` (its tunnel and Liqo's tunnel
/// check port): the gateway configuration with empty sets, in the boot table.
pub fn boot_spec(peer: &str, opts: &Options) -> api::FirewallConfigurationSpec {
    let mut spec = gateway_spec(peer, &[], &PeerSets::default(), opts);
    spec.table.name = Some(boot_table_name(peer));
    spec.audit = false;
    spec
}

/// The boot table the node's CNI chain puts in force in a gateway pod's sandbox (no peer in
/// its name, and a hyphen, which the names of peers' tables never hold: `peerwall_<peer>`,
/// `peerwall_boot_<peer>`).
pub const NODE_BOOT_TABLE: &str = "peerwall-boot";

/// The boot configuration the node's CNI chain puts in force, for a gateway whose peer it
/// does not know: [`boot_spec`] in [`NODE_BOOT_TABLE`] (nothing is allowed in it, so no peer
/// shows through).
pub fn node_boot_object(opts: &Options) -> Value {
    let mut spec = boot_spec("node", opts);
    spec.table.name = Some(NODE_BOOT_TABLE.into());
    boot_shell(spec)
}

/// [`boot_spec`] as a FirewallConfiguration object (never written to the API: the init
/// container and the agent compile it locally).
pub fn boot_object(peer: &str, opts: &Options) -> Value {
    boot_shell(boot_spec(peer, opts))
}

/// A boot spec as a FirewallConfiguration object (`peerwall-boot/peerwall-boot`, no labels).
fn boot_shell(spec: api::FirewallConfigurationSpec) -> Value {
    peerwall_intent::object::object(
        peerwall_intent::load::KIND,
        "peerwall-boot",
        "peerwall-boot",
        &Default::default(),
        spec,
    )
}

/// The options the boot policy is built with when none are given: the tunnel of every Liqo
/// gateway (`liqo-tunnel*`) and Liqo's default tunnel check port.
pub fn default_options() -> Options {
    Options {
        tunnel: super::DEFAULT_TUNNEL.into(),
        block_leaf_to_leaf: false,
        audit: false,
        liqo_ping_port: super::LIQO_PING_PORT,
        own_namespace_only: true,
        inline_budget: crate::spill::INLINE_BUDGET,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use peerwall_policy::ir::{evaluate, CtState, Packet, VerdictAction};

    /// From the tunnel: nothing reaches any pod, not even a reply; Liqo's tunnel check passes;
    /// the table is apart from the controller's.
    #[test]
    fn the_boot_policy_denies_everything_new_from_the_tunnel() {
        let obj = peerwall_intent::load::object_from_json(
            boot_object("a-1", &default_options()),
            peerwall_intent::load::Group::Peerwall,
        )
        .unwrap();
        let policy = peerwall_policy::compile::compile(&[obj]).unwrap().policy;
        assert_eq!(policy.tables[0].name, "peerwall_boot_a_1");
        assert_ne!(policy.tables[0].name, table_name("a-1"));
        let v = |dst: &str, proto: u8, dport: u16, ct: CtState, oif: Option<&str>| {
            evaluate(
                &policy,
                &Packet {
                    src: "10.10.1.5".parse().unwrap(),
                    dst: dst.parse().unwrap(),
                    proto,
                    sport: 40000,
                    dport,
                    iif: Some("liqo-tunnel".into()),
                    oif: oif.map(Into::into),
                    ct_state: ct,
                },
            )
            .verdict
        };
        let fwd = Some("liqo.x");
        assert_eq!(
            v("10.20.1.2", 6, 80, CtState::New, fwd),
            VerdictAction::Drop
        );
        assert_eq!(
            v("10.20.1.2", 17, 53, CtState::New, fwd),
            VerdictAction::Drop
        );
        assert_eq!(
            v("10.20.1.2", 6, 80, CtState::Established, fwd),
            VerdictAction::Drop
        );
        assert_eq!(
            v(
                "169.254.18.1",
                17,
                super::super::LIQO_PING_PORT,
                CtState::New,
                None
            ),
            VerdictAction::Accept
        );
        assert_eq!(
            v("169.254.18.1", 6, 22, CtState::New, None),
            VerdictAction::Drop
        );
    }

    /// The CNI chain's table holds the same verdicts under a name no peer's boot table, nor
    /// any peer's table, can take.
    #[test]
    fn the_node_boot_table_is_the_boot_policy_under_a_name_no_peer_takes() {
        let load = |v| {
            let obj =
                peerwall_intent::load::object_from_json(v, peerwall_intent::load::Group::Peerwall)
                    .unwrap();
            peerwall_policy::compile::compile(&[obj]).unwrap().policy
        };
        let node = load(node_boot_object(&default_options()));
        let peer = load(boot_object("node", &default_options()));
        assert_eq!(node.tables[0].name, NODE_BOOT_TABLE);
        for id in ["node", "a", "_", "boot", "-boot", "boot-"] {
            assert_ne!(boot_table_name(id), NODE_BOOT_TABLE);
            assert_ne!(table_name(id), NODE_BOOT_TABLE);
        }
        let mut renamed = node.clone();
        renamed.tables[0].name = peer.tables[0].name.clone();
        assert_eq!(renamed, peer);
    }
}
