//! What peerwall's tests and benchmarks share, written once: [`kube`] (a real API server on
//! loopback and peerwall processes against it), [`node`] (a real kubelet node running peerwall's
//! images), [`liqo`] (Liqo's objects peerwall reads), [`net`] (networks of namespaces and the
//! traffic through them), [`bpf`] (the bpf backend's pins as a user reads them), [`proc`] (the
//! one process handle), [`wait`] (the one way to wait) and [`NetNs`] (network namespaces that
//! clean up after themselves). Test code: failures panic with what went wrong.

pub mod bpf;
pub mod kube;
pub mod liqo;
pub mod net;
pub mod node;
pub mod proc;
pub mod wait;

use std::path::PathBuf;

pub use peerwall_netns::NetNs;

/// What an integration test imports: the network helpers, the process handle, waiting, the
/// repository and the binary.
pub mod prelude {
    pub use crate::net::*;
    pub use crate::proc::Proc;
    pub use crate::wait::{poll, wait_until};
    pub use crate::{peerwall, repo, require_root, NetNs};
}

/// The repository's root (this crate lives in `tests/kit`).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// Path of a file under the repository root.
pub fn repo(rel: &str) -> PathBuf {
    repo_root().join(rel)
}

/// The `peerwall` binary this test or benchmark runs: `PEERWALL_BIN`, else the one cargo built
/// beside the running test (a test runs from `<target>/<profile>/deps/`, the binary is in
/// `<target>/<profile>/`).
pub fn peerwall() -> PathBuf {
    if let Some(b) = std::env::var_os("PEERWALL_BIN") {
        return PathBuf::from(b);
    }
    let exe = std::env::current_exe().expect("the running test's path");
    let profile = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("a test under <target>/<profile>/deps");
    let bin = profile.join("peerwall");
    assert!(
        bin.exists(),
        "{} is not built (cargo builds it for the peerwall package's tests and benchmarks; elsewhere set PEERWALL_BIN)",
        bin.display()
    );
    bin
}

/// Fail loudly when not root: these tests exist to touch real kernels.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(
        uid, 0,
        "integration tests need root (network namespaces, nftables): run them as root"
    );
}
