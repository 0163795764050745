//! What peerwall's tests and benchmarks share, written once: [`kube`] (a real API server on
//! loopback and peerwall processes against it), [`node`] (a real kubelet node running peerwall's
//! images), [`liqo`] (Liqo's objects peerwall reads) and [`NetNs`] (network namespaces that clean
//! up after themselves). Test code: failures panic with what went wrong.

pub mod kube;
pub mod liqo;
pub mod node;

use std::path::PathBuf;

pub use peerwall_netns::NetNs;

/// The repository's root (this crate lives in `tests/kit`).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.."))
}
