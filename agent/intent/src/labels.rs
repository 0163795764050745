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
