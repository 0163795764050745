//! Backends: turn the policy IR into kernel state.

pub mod bpf;
pub mod nftables;
