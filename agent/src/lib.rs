//! The `peerwall` binary's library: the edges around the pure core.
//!
//! The flow lives in its own crates: `peerwall-intent` (FirewallConfiguration, loading) →
//! `peerwall-policy` (validation, the IR, the reference evaluator) → `peerwall-backend` (the
//! interface and network namespaces) → `peerwall-backend-nftables` / `peerwall-backend-bpf` →
//! the kernel (`ebpf/`). `peerwall-probe` asks real kernels for verdicts.
//!
//! Here: [`cli`] (commands) and [`lab`] (the gateway lab), over two crates re-exported by their
//! old names: `peerwall-enforce` ([`enforcement`], [`dir`], [`metrics`], [`events`],
//! [`shutdown`], [`cni`]) and `peerwall-kube` ([`k8s`]: the agent's watch source, the
//! controller, the webhook) over the pure [`protection`] and [`netpol`] decisions.

pub mod cli;
pub mod lab;

pub use peerwall_enforce::{cni, dir, enforcement, events, metrics, shutdown};
pub use peerwall_kube as k8s;
pub use peerwall_netpol as netpol;
pub use peerwall_protection as protection;
