//! The labels peerwall writes on the objects it creates and selects them by: part of its API
//! (an agent's `--selector` names them). Nothing peerwall writes carries Liqo's
//! `networking.liqo.io/firewall-*` labels, which Liqo's gateway and fabric select.

/// peerwall's label naming the enforcer an object is for.
pub const TARGET: &str = "peerwall.io/target";
/// Its value for objects enforced in Liqo gateways.
pub const TARGET_GATEWAY: &str = "gateway";
/// peerwall's label naming the peer (remote cluster id) whose gateway enforces an object.
pub const PEER: &str = "peerwall.io/remote-cluster-id";
/// The label every object peerwall's controllers create carries.
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// Its value.
pub const MANAGER: &str = "peerwall";

/// The labels of every object a peer's gateway enforces (its configurations and their
/// slices): [`TARGET`] = [`TARGET_GATEWAY`], [`PEER`] = `peer`, [`MANAGED_BY`] = [`MANAGER`].
pub fn for_gateway(peer: &str) -> std::collections::BTreeMap<String, String> {
    [
        (TARGET, TARGET_GATEWAY),
        (PEER, peer),
        (MANAGED_BY, MANAGER),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}
