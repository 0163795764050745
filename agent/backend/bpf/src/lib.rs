//! The eBPF backend: tc (tcx) and XDP programs over maps the agent fills.
//!
//! - [`compile`]: pure IR → map contents, plus a datapath simulator for tests.

pub mod compile;
pub mod inspect;
pub mod loader;
pub mod pinned;
