//! The order of peerwall's tiers on a gateway's forward hook, as nftables chain priorities
//! (lower first): the one definition the protection and NetworkPolicy crates both use.
//!
//! 1. provider/consumer protection (with its ProtectionPolicy exceptions): what a peer may
//!    reach at all;
//! 2. the policy tier of each direction, the destination's ingress then the source's egress:
//!    in each chain, replies, then ClusterNetworkPolicies' Admin tier, then NetworkPolicies,
//!    then ClusterNetworkPolicies' Baseline tier;
//! 3. what no chain dropped is accepted.
//!
//! A drop in any chain is final and an accept ends only its own chain, so a later tier never
//! opens what an earlier one closes.

/// Protection's chains (`peerwall_<peer>`: `from_peer`, `to_gateway`).
pub const PROTECTION: i32 = 0;
/// The policy tier's `ingress` chain (`pwnp_<peer>`).
pub const POLICY_INGRESS: i32 = 10;
/// The policy tier's `egress` chain (`pwnp_<peer>`).
pub const POLICY_EGRESS: i32 = 20;
