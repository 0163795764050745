//! Backends: turn the policy IR into kernel state.

pub mod nftables;
