//! Why the bpf backend failed: [`BpfError`], one variant per kind of failure with what it
//! was working on.

use std::path::PathBuf;

use crate::maps;

/// Failures of the bpf backend.
#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    /// bpffs is not mounted where pins go.
    #[error("{0} is not on a bpf filesystem: mount it with `mount -t bpf bpf /sys/fs/bpf`")]
    NoBpffs(PathBuf),
    /// Loading or verifying the object failed.
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    /// A program operation failed.
    #[error("{what}: {source}")]
    Program {
        /// What was attempted.
        what: String,
        /// Cause.
        source: aya::programs::ProgramError,
    },
    /// A map operation failed.
    #[error("map {map}: {source}")]
    Map {
        /// Map name.
        map: String,
        /// Cause.
        source: aya::maps::MapError,
    },
    /// The kernel's connection table was asked for (`--bpf-conntrack kernel`) and this
    /// kernel does not offer it, or the object's kfunc calls could not be resolved.
    #[error("the kernel's connection table for the bpf datapath: {0}")]
    KernelConntrack(String),
    /// The guard of interfaces not attached yet (`backend::Guard`) could not be kept.
    #[error("the guard of interfaces the datapath is not attached to yet (nftables table inet peerwall-guard): {0}")]
    Guard(#[source] peerwall_backend::BackendError),
    /// A map missing from the object.
    #[error("map {0} is missing from the eBPF object")]
    MissingMap(String),
    /// A program missing from the object.
    #[error("program {0} is missing from the eBPF object")]
    MissingProgram(String),
    /// Pinning failed.
    #[error("pinning {path}: {source}")]
    Pin {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: aya::pin::PinError,
    },
    /// Reading a pinned link failed.
    #[error("reading pinned link {path}: {source}")]
    Link {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: aya::programs::links::LinkError,
    },
    /// Filesystem work failed.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The policy does not fit the datapath.
    #[error(transparent)]
    Compile(#[from] maps::BpfCompileError),
    /// No interface matched the attach patterns.
    #[error("no interface matches {0:?}")]
    NoInterface(Vec<String>),
    /// The host's interfaces could not be listed.
    #[error("listing interfaces: {0}")]
    ListInterfaces(#[source] std::io::Error),
}

/// `map_err` for a map operation on `map`.
pub(crate) fn map_err(map: &str) -> impl FnOnce(aya::maps::MapError) -> BpfError + '_ {
    move |source| BpfError::Map {
        map: map.to_string(),
        source,
    }
}
