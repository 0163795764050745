//! peerwall's policy core, pure data in and out.
//!
//! The flow: FirewallConfiguration objects (`peerwall-intent`) → [`compile`] (validation with
//! field paths, lowering) → [`ir`] (the policy IR) → backends (`peerwall-backend-nftables`,
//! `peerwall-backend-bpf`). [`ir::eval`] is the reference evaluator: the meaning of a verdict,
//! defined once, that both backends are tested against packet for packet.

pub mod compile;
pub mod ir;
pub mod sliced;
#[cfg(feature = "testgen")]
pub mod testgen;
