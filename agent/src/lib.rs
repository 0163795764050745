//! peerwall: a gateway firewall for Liqo multi-cluster peering.
//!
//! The flow, one module per layer:
//! [`api`] (FirewallConfiguration types and YAML loading) → [`compile`] (validation and lowering)
//! → [`ir`] (the policy IR and the reference evaluator) → [`backend`] (nftables) → [`cli`].
//! [`k8s`] is the Kubernetes edge (agent watch source, [`protection`] controllers, webhook).
//! [`netns`] and [`probe`] drive real kernels for `peerwall verdict --engine nftables` and tests.

pub mod agent;
pub mod api;
pub mod backend;
pub mod cli;
pub mod compile;
pub mod ir;
pub mod k8s;
pub mod lab;
pub mod metrics;
pub mod netns;
pub mod probe;
pub mod protection;
pub mod testgen;
