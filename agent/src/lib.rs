//! The `peerwall` binary's library: the edges around the pure core.
//!
//! The flow lives in its own crates: `peerwall-intent` (FirewallConfiguration, loading) →
//! `peerwall-policy` (validation, the IR, the reference evaluator) → `peerwall-backend` (the
//! interface and network namespaces) → `peerwall-backend-nftables` / `peerwall-backend-bpf` →
//! the kernel (`ebpf/`). `peerwall-probe` asks real kernels for verdicts.
//!
//! Here: [`cli`] (commands), [`enforcement`] (the enforcement engine and the directory source),
//! [`k8s`] (the Kubernetes edge: agent watch source, controller, webhook) over the pure
//! [`protection`] decisions, [`metrics`], [`events`] (what the datapath did, for `observe`), and
//! [`lab`], the gateway lab.

pub mod cli;
pub mod cni;
pub mod dir;
pub mod enforcement;
pub mod events;
pub mod k8s;
pub mod lab;
pub mod metrics;
pub use peerwall_netpol as netpol;
pub use peerwall_protection as protection;
pub mod shutdown;
