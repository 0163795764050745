//! Provider and consumer protection, as pure functions from a snapshot of the cluster to the
//! objects peerwall's controller keeps in place (the thesis's Liqo Security Agent, chapters 3–4,
//! plus the consumer side it left as future work).
//!
//! For every peer cluster (a Liqo tenant namespace), one gateway FirewallConfiguration: traffic
//! arriving from that peer's tunnel is dropped unless
//! - it goes to a pod the peer offloaded here (provider protection), or
//! - it comes from one of our pods the peer runs for us (consumer protection; optionally not
//!   towards our pods offloaded to *other* peers: leaf-to-leaf blocking).
//!
//! Replies to connections our side opened (conntrack `established`/`related`) pass before the
//! default deny: provider pods reach consumer pods, the consumer still opens nothing but what
//! it offloaded. Established connections survive a pod's removal from a set until conntrack
//! forgets them, as with Kubernetes NetworkPolicy implementations.
//!
//! Address lists are named sets, so a pod added or removed is one set-element change in the
//! kernel. For every offloaded namespace, a NetworkPolicy allowing egress only to namespaces of
//! the same consumer and to DNS.
//!
//! No kube types here: the controller converts API objects into [`World`] at the edge.

pub mod boot;
pub mod coverage;
pub mod enforcement;
pub mod exceptions;
pub mod index;
pub mod namespaces;
pub mod publish;
pub mod spill;

mod gateway;
mod liqo;
mod offloaded;
mod peers;
mod slices;
mod world;

pub use gateway::*;
pub use liqo::*;
pub use offloaded::*;
pub use peers::*;
pub use slices::*;
pub use world::*;

/// Liqo labels the decisions depend on (same strings as the agent's `k8s` constants). Liqo:
/// `pkg/consts/namespace_mapping.go` (`RemoteClusterID`), `pkg/consts/core.go`
/// (`TenantNamespaceLabel`).
const REMOTE_CLUSTER_ID: &str = "liqo.io/remote-cluster-id";

const TENANT_NAMESPACE: &str = "liqo.io/tenant-namespace";

pub use peerwall_intent::labels::{MANAGED_BY, MANAGER, PEER, TARGET, TARGET_GATEWAY};

/// Name of the gateway FirewallConfiguration in each tenant namespace.
pub const GATEWAY_CONFIG: &str = "peerwall-gateway";

/// One remapped CIDR of a peer, from Liqo's `Configuration` (`networking.liqo.io/v1beta1`):
/// the NetworkPolicy tier and protection read the same ones.
pub use peerwall_netpol::Remap;

#[cfg(test)]
mod tests;
