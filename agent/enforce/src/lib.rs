//! peerwall's enforcement, shared by every policy source (the directory, the Kubernetes watch
//! source of `peerwall-kube`): [`enforcement`] (compile, apply through any backend, boot hold,
//! revocation, drift repair), [`metrics`] (the agent's and controller's state, its Prometheus
//! exposition and listeners), [`events`] (what the datapath did, for `observe`), [`shutdown`],
//! [`dir`] (the directory source) and [`cni`] (the node's CNI plugin holding a gateway's boot
//! policy before any of its containers runs).

pub mod cni;
pub mod dir;
pub mod enforcement;
pub mod events;
pub mod metrics;
pub mod shutdown;

pub use peerwall_netpol as netpol;
pub use peerwall_protection as protection;

/// The commit this build is from (`git rev-parse HEAD` at build time, `unknown` outside a
/// checkout): `peerwall version`, `peerwall_build_info`.
pub const GIT_COMMIT: &str = env!("PEERWALL_GIT_COMMIT");

/// This build's version and the commit it was built from (`peerwall --version`).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("PEERWALL_GIT_COMMIT"),
    ")"
);
