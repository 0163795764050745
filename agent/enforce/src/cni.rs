//! No unguarded window in the DaemonSet's mode: `peerwall-boot`, a chained CNI plugin, puts
//! a gateway's boot policy in force when the container runtime creates the gateway pod's
//! sandbox, before any of its containers runs, whether an agent runs on the node or not (its
//! agent down, restarting, killed for memory, or being upgraded). The agent that then
//! enforces in the pod lets it go once the peer's configuration is in force
//! ([`crate::enforcement`]).
//!
//! - [`chain`]: the node's CNI configuration with the plugin chained, or taken out (pure);
//! - [`plugin`]: the plugin itself, as the runtime runs it;
//! - [`install`]: the node's files: copy, check it runs on the node, chain, keep, take out.

pub mod chain;
pub mod install;
pub mod plugin;
